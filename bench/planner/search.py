"""Beam search against the BLP optimum and explorer time against graph size
(``python -m bench planner``, parts ``blp`` and ``scaling``)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import stitch
from bench.report import fit_exponent
from bench.synthetic import synthetic_hlo
from hlo_fixtures import DATA

Progress = Callable[[str], None]


@dataclass
class BlpRow:
    model: str
    graph: str
    beam_us: float
    blp_us: float
    bound_us: float
    beam_mem_us: float
    blp_mem_us: float
    status: str
    gap: float | None
    variables: object
    solve_s: float
    beam_plan_s: float


def collect_blp(names: list[str], target: str = "h100", time_limit: float = 60.0,
                progress: Progress = lambda _: None) -> list[BlpRow]:
    options = stitch.ExplorerOptions(blp_time_limit_s=time_limit)
    rows = []
    for model in names:
        text = (DATA / model / f"full.gpu-{target}.hlo").read_text()
        beam = stitch.plan(text, target=target, planner="beam", options=options)
        blp = stitch.plan(text, target=target, planner="blp", options=options)
        for gb, gl in zip(beam.graphs, blp.graphs):
            if not any(k.cost.launches for k in gb.stitched.kernels):
                continue
            r = gl.report
            rows.append(BlpRow(
                model, gb.graph.name, gb.stitched.objective_s * 1e6,
                gl.stitched.objective_s * 1e6, r.detail.get("lower_bound_s", 0.0) * 1e6,
                sum(k.cost.total_s for k in gb.stitched.kernels if k.is_memory) * 1e6,
                sum(k.cost.total_s for k in gl.stitched.kernels if k.is_memory) * 1e6,
                r.status, r.gap, r.detail.get("variables", "–"),
                r.detail.get("solve_seconds", math.nan), gb.report.seconds))
        progress(f"planner {model}: BLP {sum(r.solve_s for r in rows if r.model == model):.2f} s")
    return rows


def blp_markdown(rows: list[BlpRow], target: str, time_limit: float) -> list[str]:
    lines = [f"### Beam search vs the BLP optimum ({target}, modeled µs of the whole graph)", "",
             "Objective = sum of the delta cost model's kernel times (GEMMs included, identical "
             "on both sides); the memory-intensive part is shown too. BLP: PuLP + HiGHS, "
             f"{time_limit:.0f} s limit per graph, candidates = explorer patterns + singletons "
             "+ the beam plans' kernels, started from the beam's plan. Bound = a proven lower "
             "bound on the optimum. Times: beam = the beam planner's time for the graph, BLP = "
             "the solver's (both measured).", "",
             "| model | graph | beam µs | BLP µs | beam/BLP | bound µs | beam/bound | "
             "beam mem µs | BLP mem µs | status | gap | BLP vars | beam (s) | BLP (s) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    worst = worst_bound = 1.0
    for r in rows:
        if r.status == "optimal":
            worst = max(worst, r.beam_us / r.blp_us)
        if r.bound_us > 0:
            worst_bound = max(worst_bound, r.beam_us / r.bound_us)
        gap = f"{r.gap:.1e}" if r.gap is not None else "–"
        bound = f"{r.beam_us / r.bound_us:.3f}" if r.bound_us else "–"
        lines.append(f"| {r.model} | {r.graph} | {r.beam_us:.1f} | {r.blp_us:.1f} | "
                     f"{r.beam_us / r.blp_us:.3f} | {r.bound_us:.1f} | {bound} | "
                     f"{r.beam_mem_us:.1f} | {r.blp_mem_us:.1f} | {r.status} | {gap} | "
                     f"{r.variables} | {r.beam_plan_s:.2f} | {r.solve_s:.2f} |")
    optimal = sum(r.status == "optimal" for r in rows)
    lines += ["", f"{optimal} of {len(rows)} graphs solved to optimality. Worst beam/BLP over "
              f"those: {worst:.3f}; worst beam/lower bound over all graphs: {worst_bound:.3f}. "
              f"Total beam {sum(r.beam_plan_s for r in rows):.1f} s, BLP solver "
              f"{sum(r.solve_s for r in rows):.1f} s."]
    return lines


def collect_scaling(sizes: list[int], progress: Progress = lambda _: None
                    ) -> list[tuple[int, float, int]]:
    """(ops, plan seconds, explorer evaluations) per synthetic graph size."""
    points = []
    for size in sizes:
        text = synthetic_hlo(size)
        start = time.perf_counter()
        p = stitch.plan(text, target="h100")
        seconds = time.perf_counter() - start
        points.append((len(p.graphs[0].graph.nodes), seconds,
                       p.graphs[0].report.detail.get("evaluations", 0)))
        progress(f"scaling {points[-1][0]} ops: {seconds:.2f} s")
    return points


def scaling_markdown(points: list[tuple[int, float, int]],
                     image: Callable[[str], str | None]) -> list[str]:
    lines = ["### Explorer cost vs graph size (measured)", "",
             "`bench/synthetic.py` graphs: stacked transformer-like blocks (layer norm, GEMM, "
             "bias + tanh-GELU, GEMM, softmax, residual; ~35 ops each), planned for h100 with "
             "the beam planner (base fusion, PatternReduction both ways + remote fusion, two "
             "beam searches, refinement and packing of each plan, validation, schedules).", "",
             "| ops | plan time (s) | explorer evaluations |", "|---:|---:|---:|"]
    lines += [f"| {o} | {s:.2f} | {e} |" for o, s, e in points]
    if len(points) >= 2:
        lines += ["", "Fitted exponent (time ∝ ops^k, least squares on log-log): "
                  f"k = {fit_exponent([(o, s) for o, s, _ in points]):.2f}."]
    link = image("planner_scaling")
    if link:
        lines += ["", link]
    return lines
