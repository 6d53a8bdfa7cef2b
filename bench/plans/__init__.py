"""Measure ``plans``: stitch's plans against XLA's own GPU fusion decisions.

Kernels and memory-intensive bytes are counted, times are modeled (stitch's
latency-evaluator and XLA's GpuPerformanceModel formulas, bench/xla_formula.py).
"""
from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.measure import Context, Measure, Part, script
from bench.report import as_part

log = logging.getLogger("bench")
TARGETS = ("v100", "a100", "h100")


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", type=lambda s: s.split(","),
                        help="plans/planner: fixture models (default: every zoo fixture)")
    parser.add_argument("--targets", type=lambda s: tuple(s.split(",")), default=TARGETS)


def run_zoo(ctx: Context) -> list[str]:
    from bench import plots
    from bench.plans import zoo
    names = ctx.args.models or zoo.models()
    if ctx.quick and not ctx.args.models:
        names = list(zoo.TRAINING)
    rows = zoo.collect_plans(names, ctx.args.targets, log.info)
    ctx.shared["plan_rows"] = rows
    ctx.save("plans", headline_numbers(rows, ctx.args.targets))
    ctx.image("plans_ratios", lambda p: plots.plans_ratios(rows, p))
    bound = [(f"{r.model} {r.target}", r.xla.mem_bytes, r.stitch.mem_bytes, r.bytes_bound)
             for r in rows if r.model in zoo.TRAINING]
    ctx.image("plans_bytes_bound", lambda p: plots.bytes_against_bound(bound, p))
    return [line for line in zoo.plans_markdown(rows, ctx.image_link)]


def headline_numbers(rows, targets) -> dict:
    """Training-graph sums per target: (XLA, stitch) of mem kernels, bytes and modeled µs."""
    from bench.plans import zoo
    out = {}
    for target in targets:
        t = zoo.Totals([r for r in rows if r.target == target and r.model in zoo.TRAINING])
        if t.rows:
            out[target] = {a: list(t.sum(a)) for a in ("mem_kernels", "mem_bytes",
                                                         "latency_us", "formula_us")}
    return out


def run_scopes(ctx: Context) -> list[str]:
    """The zoo's plans with the global stitching scope off and on (two child processes:
    "off" replaces the scope's feasibility check)."""
    from bench.plans import scopes
    with tempfile.TemporaryDirectory(prefix="stitch-bench-") as tmp:
        paths = {mode: str(Path(tmp) / f"{mode}.json") for mode in ("off", "on")}
        for mode, path in paths.items():
            subprocess.run([sys.executable, "-m", "bench.plans.scopes", "measure", mode, path],
                           check=True, stdout=subprocess.DEVNULL)
        return as_part(scopes.render(paths["off"], paths["on"]) + "\n\n" + scopes.kernels())


def run_layouts(ctx: Context) -> list[str]:
    from bench.plans import layouts
    rows = layouts.collect(progress=log.info)
    return as_part("\n".join(layouts.markdown(rows)))


def run_gemm_chains(ctx: Context) -> list[str]:
    from bench.plans import gemm_chains
    targets = tuple(t for t in ctx.args.targets if t in gemm_chains.TARGETS) \
        or gemm_chains.TARGETS
    rows = gemm_chains.collect(None, targets, log.info)
    search = gemm_chains.search_rows(targets, log.info)
    return as_part("\n".join(gemm_chains.markdown(rows, search)))


MEASURE = Measure(
    name="plans",
    title="Plans: stitch's kernels against XLA's (counted kernels and bytes, modeled time)",
    summary="Plans made from the committed XLA-optimized zoo fixtures "
            "(tests/data/<model>/full.gpu-<target>.hlo) against XLA's own fusion partition "
            "of the same module. Kernel counts and bytes are counted; times are modeled.",
    parts=(
        Part("zoo", "The zoo per target: kernels, bytes, modeled time", run_zoo),
        Part("precision", "bf16 mixed-precision training steps",
             script("bench.plans.precision", [], ["--no-errors", "--targets", "h100"],
                    block="bench-bf16"), quick=False),
        Part("scopes", "Global stitching scope: persistent kernels with grid barriers",
             run_scopes, quick=False),
        Part("layouts", "Layouts chosen with the schedules", run_layouts, quick=False),
        Part("gemm-chains", "GEMM chains and attention in one kernel", run_gemm_chains,
             quick=False),
        Part("base-fusion", "Base fusion against XLA's kernel counts",
             script("bench.plans.base_fusion")),
        Part("segments", "Segmented reductions: sorted segments as rows",
             script("bench.plans.segments", [], ["--sizes", "10000x64"]), quick=False),
        Part("estimates", "Latency-evaluator against XLA's own per-fusion estimates",
             script("bench.plans.estimates", [], ["--targets", "h100"],
                    block="latency-vs-xla"), quick=False),
    ),
    arguments=arguments,
)
