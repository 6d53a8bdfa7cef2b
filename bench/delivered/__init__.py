"""Measure ``delivered``: what stitch's pass delivers into the module XLA compiles, against
what it planned, on third-party training steps and on the zoo's XLA GPU modules (counted
kernels and bytes, modeled µs; deviceless H100 compiles)."""
from __future__ import annotations

import argparse
import logging
import os

from bench.measure import Context, Measure, Part, script
from bench.report import as_part

log = logging.getLogger("bench")


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=lambda s: s.split(","),
                        help="delivered: third-party step names (bench/thirdparty_steps.py)")


def run_steps(ctx: Context) -> list[str] | None:
    from bench import plots, thirdparty_steps
    from bench.delivered import steps
    names = ctx.args.steps or (["remat MLP"] if ctx.quick else list(thirdparty_steps.STEPS))
    rows = steps.collect(names)
    ok = [r for r in rows if "error" not in r]
    if not ok:
        log.warning("delivered: no step compiled (%s)", rows[0].get("error") if rows else "none")
        return None
    ctx.save("delivered", [{k: r[k] for k in ("step", "xla_mem_us", "planned_mem_us",
                                              "delivered_mem_us", "xla_mem_bytes",
                                              "delivered_mem_bytes") if k in r} for r in ok])
    series = [(r["step"], r["xla_mem_us"], r["planned_mem_us"], r["delivered_mem_us"])
              for r in ok]
    link = ctx.image("delivered_steps", lambda p: plots.planned_vs_delivered(series, p))
    lines = as_part(steps.markdown(rows, "python -m bench delivered --part steps"))
    return lines + ([link] if link else [])


def run_segments(ctx: Context) -> list[str] | None:
    from bench.delivered import segments
    cases = list(segments.QUICK) if ctx.quick else \
        list(segments.EVERY_CASE)
    rows = segments.collect(cases)
    ok = [r for r in rows if "error" not in r]
    if not ok:
        log.warning("delivered: no segments case compiled (%s)",
                    rows[0].get("error") if rows else "none")
        return None
    ctx.save("segments", [{k: r[k] for k in ("case", "kernels_before", "kernels_after",
                                             "xla_mem_us", "delivered_mem_us")} for r in ok])
    return as_part(segments.markdown(rows, "python -m bench delivered --part segments"))


def run_lm_head_eval(ctx: Context) -> list[str] | None:
    from bench.delivered import lm_head_eval
    rows = lm_head_eval.collect()
    if not any("error" not in r for r in rows):
        log.warning("delivered: the LM head eval did not compile (%s)",
                    rows[0].get("error") if rows else "none")
        return None
    return as_part(lm_head_eval.markdown(rows,
                                         "python -m bench delivered --part lm-head-eval"))


def run_real(ctx: Context) -> list[str] | None:
    from bench.delivered import real
    from bench.real_steps import REAL_STEPS
    names = [c.name for c in (REAL_STEPS[:1] if ctx.quick else REAL_STEPS)]
    if ctx.args.steps:
        names = [n for n in names if n in ctx.args.steps] or names
    rows = real.collect(names)
    ok = [r for r in rows if "error" not in r]
    if not ok:
        log.warning("delivered: no real step compiled (%s)",
                    rows[0].get("error") if rows else "none")
        return None
    ctx.save("delivered_real", ok)
    return as_part(real.markdown(rows, "python -m bench delivered --part real"))


MEASURE = Measure(
    name="delivered",
    title="Planned against delivered (counted kernels and bytes, modeled µs)",
    summary="Each step compiled for an H100 without a device, stitch's pass on: the pass "
            "prices XLA's module, its plan and the module it returns with the delta cost "
            "model. Needs the deviceless CUDA venv (scripts/deviceless_check.sh); "
            f"STITCH_GRID_SYNC={os.environ.get('STITCH_GRID_SYNC', 'default')}.",
    parts=(
        Part("steps", "Third-party training steps", run_steps, quick=False),
        Part("segments", "Segmented reductions through the pass", run_segments,
             quick=False),
        Part("lm-head-eval", "LM head + cross-entropy eval loss without the logits (GPT-2 "
             "small)", run_lm_head_eval, quick=False),
        Part("real", "Real-size training steps: whole step, peak memory", run_real,
             quick=False),
        Part("units", "The zoo's XLA GPU modules: ops against XLA units",
             script("bench.delivered.units", ["--zoo"], block="bench-xla-units-zoo"),
             quick=False),
    ),
    arguments=arguments,
)
