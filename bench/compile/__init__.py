"""Measure ``compile``: what stitch adds to compile time (measured wall seconds): the
stand-alone compiler against jax.jit's XLA compile, stitch's pass inside XLA (CPU and a
deviceless H100 compile), real-size training steps against XLA's own compile, the compile
phases of one model, and HLO parse speed."""
from __future__ import annotations

import argparse
import logging

from bench.measure import Context, Measure, Part, script

log = logging.getLogger("bench")


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--zoo-models", type=lambda s: s.split(","),
                        help="compile/runtime: zoo models (default: all)")


def run_jit(ctx: Context) -> list[str]:
    from bench import plots
    from bench.compile import jit
    reason = jit._available()
    if reason:
        return [f"**Not measured: {reason}.**"]
    models = ctx.args.zoo_models or (["softmax", "layer_norm"] if ctx.quick else None)
    rows = jit.collect(models, progress=log.info)
    ok = [(r.model, r.stitch_s, r.jax_s) for r in rows if not r.error]
    if ok:
        ctx.save("compile", {"models": len(ok), "stitch_s": sum(r[1] for r in ok),
                             "jax_s": sum(r[2] for r in ok)})
        ctx.image("compile_times", lambda p: plots.compile_times(ok, p))
    return jit.markdown(rows, ctx.image_link)


def run_real(ctx: Context) -> list[str]:
    from bench.compile import real
    return real.markdown(real.collect(ctx.quick, progress=log.info))


MEASURE = Measure(
    name="compile",
    title="Compile cost (measured)",
    summary="Wall seconds on the machine named in each part, other processes sharing it "
            "(the load average says how much). No GPU is needed: the GPU path compiles for "
            "an H100 without a device.",
    parts=(
        Part("jit", "stitch.compiler.compile against jax.jit's XLA compile", run_jit),
        Part("in-xla", "stitch's pass inside XLA's CPU compile against jax.jit",
             script("bench.compile.in_xla", [], ["--models", "softmax"],
                    block="bench-pass-compile"), quick=False),
        Part("in-xla-gpu", "stitch's pass inside a deviceless XLA GPU (H100) compile",
             script("bench.compile.in_xla", ["--gpu"], ["--gpu", "--models", "softmax"],
                    block="bench-pass-compile-gpu"), quick=False),
        Part("phases", "Compile phases of bert_layer_train",
             script("bench.compile.phases", [], ["--configs", "tiny"], block="compile-time"),
             quick=False),
        Part("real", "Real-size training steps: XLA's compile against the compile with "
             "stitch's pass (deviceless H100), cold and warm cache", run_real),
        Part("parse", "HLO parse speed", script("bench.compile.parse", [], ["--repeat", "1",
                                                                            "--top", "2"])),
    ),
    arguments=arguments,
)
