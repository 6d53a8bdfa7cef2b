"""Step time on this CPU: ``stitch.jit(fn, async_compile=False)`` against ``jax.jit(fn)``.

Per zoo model and config: both jitted functions are called once (compilation, outputs
compared), then called alternately (jax, stitch, jax, stitch, ...) so that load from other
processes hits both alike; each call is timed to ``jax.block_until_ready``. Reported: the
median of each side's calls and their ratio. Skips cleanly when ``stitch.jit`` does not
exist yet.
"""
from __future__ import annotations

import inspect
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from bench.report import geomean

# The zoo has "tiny" (CPU-sized) and "full" (paper-sized) configs, and "medium" for the BERT
# layer (a few ms per CPU step). The full configs of these single-pattern models have at most 50 MB of inputs; the whole models'
# full configs and log_softmax_xent's 524 MB of logits take minutes per step through the
# host kernels here.
FULL_ON_CPU = ("layer_norm", "softmax", "bias_gelu", "bias_gelu_tanh", "layer_norm_nonminor",
               "column_reduce_broadcast", "attention_bert_base", "attention_vit_base",
               "attention_mlp_mixer_b")
MIN_CALLS, MAX_CALLS = 3, 41
BUDGET_S = 2.0               # per model and config, both sides together


@dataclass
class RuntimeRow:
    model: str
    config: str
    jax_s: float = 0.0           # median step time
    stitch_s: float = 0.0        # stitch.jit as users get it (its guard may keep stock XLA)
    forced_s: float = 0.0        # stitch.jit(guard=False): the stitched program every call
    stitched_share: float = 0.0  # of the timed default calls, those stitched kernels served
    kernels: int | None = None   # stitched kernels built
    calls: int = 0
    first_call_s: tuple[float, float] = (0.0, 0.0)   # compile + first run: jax, stitch
    max_abs_diff: float = 0.0
    error: str = ""
    samples: dict[str, list[float]] = field(default_factory=dict, repr=False)


def unavailable() -> str:
    """Why the section cannot run, or '' when it can."""
    import stitch
    if not hasattr(stitch, "jit"):
        return "stitch.jit not available"
    try:
        import jax  # noqa: F401
    except ImportError:
        return "jax not installed"
    return ""


def _timed(fn, args) -> tuple[float, object]:
    import jax
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return time.perf_counter() - start, out


def _max_diff(a, b) -> float:
    import jax
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    if len(la) != len(lb):
        return float("inf")
    diffs = [float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
             if np.size(x) else 0.0 for x, y in zip(la, lb)]
    return max(diffs, default=0.0)


def measure(name: str, config: str) -> RuntimeRow:
    import jax

    import stitch
    from stitch import models

    inst = models.build(name, config)
    args = [jax.device_put(a) for a in inst.random_args(0)]
    row = RuntimeRow(name, config)
    try:
        f_jax = jax.jit(inst.fn)
        f_stitch = stitch.jit(inst.fn, async_compile=False)
        # Without the guard (which keeps stock XLA when it times faster) every call runs
        # the stitched program: the stitched kernels' own speed.
        f_forced = (stitch.jit(inst.fn, async_compile=False, guard=False)
                    if "guard" in inspect.signature(stitch.jit).parameters else None)
        tj, out_j = _timed(f_jax, args)
        ts, out_s = _timed(f_stitch, args)
        if f_forced is not None:
            _, out_f = _timed(f_forced, args)
    except Exception as exc:          # a bench row, not a crash
        row.error = f"{type(exc).__name__}: {exc}"[:160]
        return row
    # The guard alternates both paths for its first calls after the switch, then settles
    # for good: that trial is part of compiling (as in training), not of the step time.
    from stitch.frontends.switching import GUARD_CALLS
    for _ in range(2 * GUARD_CALLS):
        _timed(f_stitch, args)
    row.first_call_s = (tj, ts)
    row.max_abs_diff = max(_max_diff(out_j, out_s),
                           _max_diff(out_j, out_f) if f_forced is not None else 0.0)
    sides = {"jax": f_jax, "stitch": f_stitch, **({"forced": f_forced} if f_forced else {})}
    times: dict[str, list[float]] = {k: [] for k in sides}
    stats = getattr(f_stitch, "stats", None)
    stitched_before = getattr(stats, "stitched_calls", 0)
    spent = 0.0
    while len(times["jax"]) < MAX_CALLS and (len(times["jax"]) < MIN_CALLS or spent < BUDGET_S):
        for key, fn in sides.items():
            t, _ = _timed(fn, args)
            times[key].append(t)
            spent += t
    row.jax_s = statistics.median(times["jax"])
    row.stitch_s = statistics.median(times["stitch"])
    row.forced_s = statistics.median(times["forced"]) if "forced" in times else 0.0
    row.calls = len(times["jax"])
    if stats is not None:
        row.stitched_share = (stats.stitched_calls - stitched_before) / row.calls
        row.kernels = stats.stitched_kernels
    row.samples = times
    return row


def collect(names: list[str] | None = None,
            configs: tuple[str, ...] = ("tiny", "medium", "full"),
            progress: Callable[[str], None] = lambda _: None) -> list[RuntimeRow]:
    from stitch import models

    rows = []
    for name in names or models.list_models():
        for config in configs:
            if config == "full" and name not in FULL_ON_CPU:
                continue
            if config not in models.get_model(name).configs:
                continue
            rows.append(measure(name, config))
            r = rows[-1]
            progress(f"runtime {name} {config}: "
                     + (r.error or f"jax {r.jax_s * 1e3:.2f} ms, stitch {r.stitch_s * 1e3:.2f} ms"))
    return rows


def markdown(rows: list[RuntimeRow] | None, reason: str,
             image: Callable[[str], str | None]) -> list[str]:
    lines = ["Measured on this CPU (no GPU): the stitched kernels run as host code (LLVM MCJIT "
             "SIMT loops, codegen's host target), everything else as XLA CPU compiles it. The "
             "table uses `tiny` for every model, `medium` where the zoo has it (the BERT layer: "
             "batch 8, sequence 64, hidden 256) and `full` for the single-pattern models (" + ", ".join(FULL_ON_CPU)
             + "; at most 50 MB of inputs): the whole models' full configs and "
             "log_softmax_xent's 524 MB of logits take minutes per step through the host "
             "kernels.", ""]
    if rows is None:
        return lines + [f"**Not measured: {reason}.** `stitch.jit(fn, async_compile=False)` is "
                        "being written; this section fills in when `python -m bench runtime` "
                        "runs after it lands (the code is in `bench/runtime.py`)."]
    lines += ["Three callables per model, called in turn (jax, stitch, forced, jax, ...; at "
              f"least {MIN_CALLS} rounds, until {BUDGET_S:.0f} s or {MAX_CALLS} rounds), each "
              "call timed to `jax.block_until_ready`, medians reported: **jax** = `jax.jit(fn)`; "
              "**stitch** = `stitch.jit(fn, async_compile=False)` as a user gets it (its guard "
              "times both paths over the first calls after the switch and keeps stock XLA when "
              "that is faster; those calls run before the timing, like the compile; "
              "\"stitched\" = share of the timed calls the stitched program served); **forced** "
              "= `stitch.jit(fn, async_compile=False, guard=False)`: the stitched program on "
              "every call, i.e. the stitched kernels' own speed as host code. First call = "
              "compile + run; max |diff| = largest absolute difference from jax's outputs.", "",
              "| model | config | jax (ms) | stitch (ms) | stitch/jax | stitched | forced (ms) | "
              "forced/jax | kernels | rounds | first call jax / stitch (s) | max abs diff |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.error:
            lines.append(f"| {r.model} | {r.config} | – | failed | – | – | – | – | – | – | – | "
                         f"{r.error} |")
            continue
        forced = (f"{r.forced_s * 1e3:.3f} | {r.forced_s / r.jax_s:.2f}" if r.forced_s
                  else "– | –")
        lines.append(f"| {r.model} | {r.config} | {r.jax_s * 1e3:.3f} | {r.stitch_s * 1e3:.3f} | "
                     f"{r.stitch_s / r.jax_s:.2f} | {r.stitched_share:.0%} | {forced} | "
                     f"{r.kernels if r.kernels is not None else '–'} | {r.calls} | "
                     f"{r.first_call_s[0]:.2f} / {r.first_call_s[1]:.2f} | "
                     f"{r.max_abs_diff:.1e} |")
    ok = [r for r in rows if not r.error and r.jax_s > 0]
    for config in ("tiny", "medium", "full"):
        rs = [r for r in ok if r.config == config]
        if rs:
            forced = [r for r in rs if r.forced_s]
            lines += ["", f"{config}: geometric mean stitch/jax {geomean(r.stitch_s / r.jax_s for r in rs):.2f} "
                      f"over {len(rs)} models (stitch faster on "
                      f"{sum(r.stitch_s < r.jax_s for r in rs)})"
                      + (f", forced/jax {geomean(r.forced_s / r.jax_s for r in forced):.2f} "
                         f"(faster on {sum(r.forced_s < r.jax_s for r in forced)})"
                         if forced else "") + "."]
    link = image("runtime_ratios")
    if link:
        lines += ["", link]
    return lines


def _run_part(ctx) -> list[str]:
    from bench import plots
    reason = unavailable()
    rows = None
    if not reason:
        models = ctx.args.zoo_models or (["softmax"] if ctx.quick else None)
        rows = collect(models)
        ok = [(f"{r.model} ({r.config})", (r.forced_s or r.stitch_s) / r.jax_s) for r in rows
              if not r.error and r.jax_s > 0]
        if ok:
            ctx.image("runtime_ratios", lambda p: plots.runtime_ratios(ok, p))
    return markdown(rows, reason, ctx.image_link)


def _measure():
    from bench.measure import Measure, Part
    return Measure(
        name="runtime",
        title="Step time on this CPU: stitch.jit against jax.jit (measured)",
        summary="The stitched kernels run as host code here (no GPU): these times say what "
                "the host path costs, not what a GPU gains.",
        parts=(Part("steps", "Zoo step times", _run_part),
               Part("host-sort", "Host sorts against XLA's CPU sort",
                    lambda ctx: _host_sort(ctx))))


def _host_sort(ctx) -> list[str]:
    from bench.host_sort import run_part
    return run_part(ctx)


MEASURE = _measure()
