"""Fusion plans against XLA's real GPU decisions, beam search against the BLP optimum, and
explorer cost against graph size.

    python -m bench.plans [--out docs/benchmarks.md] [--skip-blp] [--sizes 1000,2000,...]

Plans are made from the committed XLA-optimized fixtures (tests/data/<model>/full.gpu-*.hlo):
the baseline is XLA's own fusion partition. Kernel counts and bytes are counted; times are
modeled (stitch's kernel time model, stitch/cost/delta.py); planning times are measured.
With --out, the report replaces the section between the plan-report markers.
"""
from __future__ import annotations

import argparse
import datetime
import math
import platform
import re
import time
from pathlib import Path

import stitch
from bench.synthetic import synthetic_hlo
from tests.fixtures import DATA

TARGETS = ("v100", "a100", "h100")
TRAINING = ("bert_layer_train", "transformer_train", "dien_train", "log_softmax_xent_train")
START, END = "<!-- plan-report:start -->", "<!-- plan-report:end -->"


def _models() -> list[str]:
    return sorted(p.name for p in DATA.iterdir()
                  if p.is_dir() and (p / "full.gpu-h100.hlo").exists())


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "–"


def plan_table(lines: list[str]) -> None:
    lines += ["### Stitched plans vs XLA's fusion decisions (counted bytes/kernels, modeled time)",
              "",
              "Memory-intensive (mem) = every kernel that is not a GEMM/conv. Bytes are HBM "
              "bytes of memory-intensive kernels (each kernel reads each input and writes each "
              "output once), per step. µs = modeled time of the memory-intensive kernels. "
              "Planner: beam search; plan time measured.", "",
              "| model | target | mem kernels XLA → stitch | ratio | mem bytes ratio | "
              "mem µs XLA → stitch | plan time (s) |",
              "|---|---|---:|---:|---:|---:|---:|"]
    totals = {t: [0, 0, 0, 0] for t in TARGETS}
    geo = {t: [] for t in TARGETS}
    for model in _models():
        for target in TARGETS:
            text = (DATA / model / f"full.gpu-{target}.hlo").read_text()
            start = time.perf_counter()
            s = stitch.plan(text, target=target).summary()
            seconds = time.perf_counter() - start
            b, st = s["baseline"], s["stitched"]
            lines.append(f"| {model} | {target} | {b['mem_kernels']} → {st['mem_kernels']} | "
                         f"{_ratio(st['mem_kernels'], b['mem_kernels'])} | "
                         f"{_ratio(st['mem_hbm_bytes'], b['mem_hbm_bytes'])} | "
                         f"{b['mem_modeled_us']:.0f} → {st['mem_modeled_us']:.0f} | {seconds:.2f} |")
            if model in TRAINING:
                t = totals[target]
                t[0] += b["mem_kernels"]; t[1] += st["mem_kernels"]
                t[2] += b["mem_hbm_bytes"]; t[3] += st["mem_hbm_bytes"]
                geo[target].append((st["mem_kernels"] / b["mem_kernels"],
                                    st["mem_hbm_bytes"] / b["mem_hbm_bytes"]))
    lines += ["", "Training graphs (" + ", ".join(TRAINING) + "), all together:", "",
              "| target | mem kernels XLA → stitch | ratio (sum) | geo-mean ratio | "
              "mem bytes ratio (sum) | geo-mean bytes ratio |", "|---|---:|---:|---:|---:|---:|"]
    for target in TARGETS:
        t = totals[target]
        gk = math.exp(sum(math.log(r[0]) for r in geo[target]) / len(geo[target]))
        gb = math.exp(sum(math.log(r[1]) for r in geo[target]) / len(geo[target]))
        lines.append(f"| {target} | {t[0]} → {t[1]} | {_ratio(t[1], t[0])} | {gk:.2f} | "
                     f"{_ratio(t[3], t[2])} | {gb:.2f} |")


def blp_table(lines: list[str], target: str = "h100", time_limit: float = 60.0) -> None:
    lines += ["", f"### Beam search vs the BLP optimum ({target}, modeled µs of the whole graph)",
              "", "Objective = sum of modeled kernel times (GEMMs included, identical on both "
              "sides); the memory-intensive part is shown too. BLP: PuLP + HiGHS, "
              f"{time_limit:.0f} s limit per graph, candidates = explorer patterns + singletons "
              "+ the beam plans' kernels, started from the beam's plan. Bound = a proven lower "
              "bound on the optimum (HiGHS's dual bound, or the optimum of a solve later cut "
              "for a kernel cycle); beam/bound bounds beam's distance from the optimum where "
              "the solver stopped at its limit.", "",
              "| model | graph | beam µs | BLP µs | beam/BLP | bound µs | beam/bound | "
              "beam mem µs | BLP mem µs | status | gap | BLP vars | BLP time (s) |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    options = stitch.ExplorerOptions(blp_time_limit_s=time_limit)
    worst = worst_bound = 1.0
    for model in _models():
        text = (DATA / model / f"full.gpu-{target}.hlo").read_text()
        beam = stitch.plan(text, target=target, planner="beam", options=options)
        blp = stitch.plan(text, target=target, planner="blp", options=options)
        for gb, gl in zip(beam.graphs, blp.graphs):
            if not any(k.cost.launches for k in gb.stitched.kernels):
                continue
            ob, ol = gb.stitched.objective_s * 1e6, gl.stitched.objective_s * 1e6
            mb = sum(k.cost.total_s for k in gb.stitched.kernels if k.is_memory) * 1e6
            ml = sum(k.cost.total_s for k in gl.stitched.kernels if k.is_memory) * 1e6
            r = gl.report
            if r.status == "optimal":
                worst = max(worst, ob / ol)
            bound = r.detail.get("lower_bound_s", 0.0) * 1e6
            if bound > 0:
                worst_bound = max(worst_bound, ob / bound)
            gap = f"{r.gap:.1e}" if r.gap is not None else "–"
            lines.append(f"| {model} | {gb.graph.name} | {ob:.1f} | {ol:.1f} | {ob / ol:.3f} | "
                         f"{bound:.1f} | {(f'{ob / bound:.3f}' if bound else '–')} | "
                         f"{mb:.1f} | {ml:.1f} | {r.status} | {gap} | "
                         f"{r.detail.get('variables', '–')} | "
                         f"{r.detail.get('solve_seconds', float('nan')):.2f} |")
    lines += ["", f"Worst beam/BLP ratio over graphs solved to optimality: {worst:.3f}; "
              f"worst beam/lower bound over all graphs: {worst_bound:.3f}."]


def scaling_table(lines: list[str], sizes: list[int]) -> None:
    lines += ["", "### Explorer cost vs graph size (measured)", "",
              "`bench/synthetic.py` graphs: stacked transformer-like blocks (layer norm, GEMM, "
              "bias + tanh-GELU, GEMM, softmax, residual; ~35 ops each), planned for h100 with "
              "the beam planner (base fusion, PatternReduction both ways + remote fusion, two "
              "beam searches, refinement and packing of each plan, validation).", "",
              "| ops | plan time (s) | explorer evaluations |", "|---:|---:|---:|"]
    points = []
    for size in sizes:
        text = synthetic_hlo(size)
        start = time.perf_counter()
        p = stitch.plan(text, target="h100")
        seconds = time.perf_counter() - start
        ops = len(p.graphs[0].graph.nodes)
        evaluations = p.graphs[0].report.detail.get("evaluations", 0)
        points.append((ops, seconds))
        lines.append(f"| {ops} | {seconds:.2f} | {evaluations} |")
    if len(points) >= 2:
        xs = [math.log(o) for o, _ in points]
        ys = [math.log(s) for _, s in points]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        lines += ["", f"Fitted exponent (time ∝ ops^k, least squares on log-log): k = {slope:.2f}."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--skip-table", action="store_true")
    parser.add_argument("--skip-blp", action="store_true")
    parser.add_argument("--skip-scaling", action="store_true")
    parser.add_argument("--sizes", default="1000,2000,4000,8000,16000")
    parser.add_argument("--blp-time-limit", type=float, default=60.0)
    args = parser.parse_args()
    command = "python -m bench.plans" + (" --skip-blp" if args.skip_blp else "")
    lines = [START, "## Fusion explorer: plans, planners, cost", "",
             f"`{command}` — {datetime.date.today()}, "
             f"{platform.processor() or platform.machine()}, Python {platform.python_version()}.",
             ""]
    if not args.skip_table:
        plan_table(lines)
    if not args.skip_blp:
        blp_table(lines, time_limit=args.blp_time_limit)
    if not args.skip_scaling:
        scaling_table(lines, [int(s) for s in args.sizes.split(",")])
    lines.append(END)
    report = "\n".join(lines) + "\n"
    if args.out:
        old = args.out.read_text() if args.out.exists() else ""
        if START in old and END in old:
            new = re.sub(re.escape(START) + r".*?" + re.escape(END) + r"\n?", lambda _: report,
                         old, flags=re.S)
        else:
            new = old.rstrip("\n") + "\n\n" + report
        args.out.write_text(new)
    print(report)


if __name__ == "__main__":
    main()
