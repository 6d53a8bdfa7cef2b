"""Compile cost: the stitch pipeline (``stitch.compiler.compile``: plan + lower + host build)
next to jax.jit's own XLA compile of the same function, per zoo model, in one process.

Both sides start from the same jax function at its ``tiny`` config: ``jax.jit(fn).lower``
gives the pre-optimization HLO; XLA compiles that lowering for this CPU, stitch plans it for
a GPU target (h100), lowers every stitched kernel to Kernel IR and builds it for the host
(no compile cache, so every kernel is built). All times are measured wall time.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from bench.report import geomean

TARGET = "h100"


@dataclass
class CompileRow:
    model: str
    lower_s: float            # jax tracing + lowering (shared by both sides)
    jax_s: float              # lowered.compile(): XLA CPU
    stitch_s: float           # stitch.compiler.compile, cache off
    plan_s: float
    kernel_lower_s: float
    host_build_s: float
    kernels: int
    fallbacks: int
    error: str = ""


def _available() -> str:
    """Why the section cannot run here, or ''."""
    try:
        import jax  # noqa: F401
        import stitch.compiler  # noqa: F401
        import stitch.models  # noqa: F401
    except ImportError as exc:
        return f"not available: {exc}"
    return ""


def collect(names: list[str] | None = None, config: str = "tiny",
            progress: Callable[[str], None] = lambda _: None) -> list[CompileRow]:
    import jax

    import stitch.compiler
    from stitch import models

    # XLA's first compile in a process pays one-time set-up: pay it before timing.
    jax.jit(lambda x: x + 1).lower(1.0).compile()
    rows = []
    for name in names or models.list_models():
        inst = models.build(name, config)
        # jax keeps compiled executables in memory by HLO: models with equal tiny configs
        # (attention_vit_*) would otherwise hit the previous model's compile.
        jax.clear_caches()
        t0 = time.perf_counter()
        lowered = jax.jit(inst.fn).lower(*inst.arg_specs)
        hlo = lowered.as_text(dialect="hlo")
        t1 = time.perf_counter()
        lowered.compile()
        t2 = time.perf_counter()
        try:
            exe = stitch.compiler.compile(hlo, TARGET, cache=False)
        except Exception as exc:      # a bench row, not a crash: report what failed
            rows.append(CompileRow(name, t1 - t0, t2 - t1, time.perf_counter() - t2,
                                   0, 0, 0, 0, 0, f"{type(exc).__name__}: {exc}"[:160]))
        else:
            t3 = time.perf_counter()
            s = exe.summary()
            rows.append(CompileRow(name, t1 - t0, t2 - t1, t3 - t2, s["plan_s"], s["lower_s"],
                                   s["host_build_s"], s["kernels"], len(s["fallbacks"])))
        r = rows[-1]
        progress(f"compile {name}: jax {r.jax_s:.2f} s, stitch {r.stitch_s:.2f} s")
    return rows


def markdown(rows: list[CompileRow], image: Callable[[str], str | None]) -> list[str]:
    ok = [r for r in rows if not r.error]
    lines = [
        "Measured wall time, one process, models in zoo order, `tiny` configs. **jax** = "
        "`jax.jit(fn).lower(*args).compile()` (XLA CPU: its HLO passes, fusion, LLVM codegen; "
        "one warm-up compile of a trivial function first); **stitch** = "
        f"`stitch.compiler.compile(hlo, \"{TARGET}\", cache=False)` on that lowering's HLO "
        "text: parse, plan for the GPU target (explorer + schedules), lower each stitched "
        "kernel to Kernel IR and build it for the host with LLVM MCJIT (no compile cache). "
        "Lowering (jax tracing, shared by both) is shown apart. The stitch executable runs "
        "everything but its stitched kernels through the reference evaluator, so this is not "
        "the cost of a drop-in `jax.jit` replacement: that would add XLA's compile of the "
        "unstitched rest.", "",
        "| model | lower (s) | jax compile (s) | stitch compile (s) | stitch/jax | plan (s) | "
        "kernel lowering (s) | host build (s) | kernels built / fallbacks |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r.error:
            lines.append(f"| {r.model} | {r.lower_s:.2f} | {r.jax_s:.2f} | failed | – | – | – | "
                         f"– | {r.error} |")
            continue
        lines.append(f"| {r.model} | {r.lower_s:.2f} | {r.jax_s:.2f} | {r.stitch_s:.2f} | "
                     f"{r.stitch_s / r.jax_s:.1f} | {r.plan_s:.2f} | {r.kernel_lower_s:.2f} | "
                     f"{r.host_build_s:.2f} | {r.kernels} / {r.fallbacks} |")
    if ok:
        js, ss = sum(r.jax_s for r in ok), sum(r.stitch_s for r in ok)
        slowest = max(ok, key=lambda r: r.stitch_s)
        lines += ["", f"Totals over {len(ok)} models: jax {js:.1f} s, stitch {ss:.1f} s "
                  f"({ss / js:.1f}×; geometric mean of the per-model ratios "
                  f"{geomean(r.stitch_s / r.jax_s for r in ok):.1f}×), of which plan "
                  f"{sum(r.plan_s for r in ok):.1f} s, kernel lowering "
                  f"{sum(r.kernel_lower_s for r in ok):.1f} s, host build "
                  f"{sum(r.host_build_s for r in ok):.1f} s. Slowest: {slowest.model} "
                  f"({slowest.stitch_s:.1f} s against jax's {slowest.jax_s:.2f} s)."]
    failed = [r for r in rows if r.error]
    if failed:
        lines += ["", f"{len(failed)} model(s) failed to compile with stitch (error in the row)."]
    link = image("compile_times")
    if link:
        lines += ["", link]
    return lines
