"""Measure ``gpu``: kernel and step times measured on a GPU.

They come from the GPU bring-up check: ``scripts/gpu_check.sh`` on a GPU machine, then
``python -m bench.gpu_kit.ingest RESULTS`` here (which writes this measure's ``check`` block
and the latency-evaluator's calibration table). ``python -m bench gpu --results RESULTS``
does the same; without results the block says none have been taken.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from bench.measure import Context, Measure, Part
from bench.report import as_part, block_body

NONE_YET = ("**No GPU measurement yet.** Every time in this report is counted, modeled, or "
            "measured on a CPU. `scripts/gpu_check.sh` on a GPU machine produces them (the "
            "stitched kernels' times against the latency-evaluator, whole steps under "
            "`stitch.jit` against `jax.jit`, the LLVM pipelines' kernel times); "
            "`python -m bench.gpu_kit.ingest RESULTS` then writes this section.")


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", type=Path,
                        help="gpu: the folder scripts/gpu_check.sh returned")


def run_check(ctx: Context) -> list[str] | None:
    if ctx.args.results is None:
        # without new results an ingested block stays as it is
        kept = ctx.out is not None and block_body(ctx.out, "bench-gpu-check")
        return None if kept and NONE_YET not in kept else [NONE_YET]
    from bench.gpu_kit import ingest
    text, _ = ingest.markdown(ctx.args.results, f"python -m bench gpu --results "
                                                f"{ctx.args.results}")
    return as_part(text)[2:]


MEASURE = Measure(
    name="gpu",
    title="On a GPU (measured)",
    summary="Measured on a GPU by scripts/gpu_check.sh (bench/gpu_kit).",
    parts=(Part("check", "GPU check", run_check),),
    arguments=arguments,
)
