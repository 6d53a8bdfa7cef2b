"""``stitch demo``: train a zoo model under stitch.jit and show what stitch did.

The same SGD loop runs twice from the same initial parameters: with ``stitch.jit`` (async
compile: stock XLA until the stitched program is ready, then the switch) and with
``jax.jit``. The report gives the call where stitch switched, per-step times on this machine
before and after the switch next to stock jax.jit (measured), the largest per-step loss
difference, the plan for the GPU target (baseline vs stitched kernels, HBM bytes and modeled
time: counted and modeled, not measured) and how many stitched kernels' PTX passed ptxas.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

log = logging.getLogger("stitch.demo")


@dataclass
class LoopResult:
    losses: list[float]
    step_s: list[float]
    switched_at: int | None = None
    stats: dict = field(default_factory=dict)


def _train(step: Callable, args: list, param_argnums: tuple[int, ...], steps: int,
           until_switched: Any = None, extra_after_switch: int = 0,
           max_seconds: float = 900.0) -> LoopResult:
    """Run ``steps`` SGD steps (or, with ``until_switched``, until it has switched plus
    ``extra_after_switch`` steps, for at most ``max_seconds``). Parameters are the step's
    outputs after the loss."""
    import jax

    args = list(args)
    result = LoopResult([], [])
    i = 0
    deadline = time.monotonic() + max_seconds
    while True:
        start = time.perf_counter()
        out = step(*args)
        jax.block_until_ready(out)
        result.step_s.append(time.perf_counter() - start)
        result.losses.append(float(out[0]))
        for slot, value in zip(param_argnums, out[1:]):
            args[slot] = value
        i += 1
        if time.monotonic() > deadline:
            return result
        if until_switched is None or until_switched.stats.fallbacks:
            if i >= steps:
                return result
            continue
        switched = until_switched.stats.switched_at_call
        if switched is not None and i >= max(steps, switched + extra_after_switch):
            return result


def _ptxas_check(program: Any, arch: str) -> tuple[int, int, list[str]]:
    """(passed, total, problems) for the stitched kernels' PTX on ``arch``."""
    from stitch.codegen.errors import CodegenError
    from stitch.codegen.isolation import IsolatedWorker
    from stitch.codegen.nvptx import emit_ptx
    from stitch.codegen.toolchain import assemble

    passed, problems = 0, []
    with IsolatedWorker(name="stitch-demo-ptx") as worker:
        for k in program.kernels:
            try:
                ptx = worker.call(emit_ptx, k.lowered.kernel, arch)
                report = assemble(ptx, arch, kernel_name=k.lowered.kernel.name)
                entry = report[k.lowered.kernel.name]
                if entry.spill_store_bytes or entry.spill_load_bytes:
                    problems.append(f"{k.name}: spills")
                else:
                    passed += 1
            except (CodegenError, OSError) as exc:
                problems.append(f"{k.name}: {exc}")
    return passed, len(program.kernels), problems


def run_demo(model: str = "bert_layer_train", config: str = "tiny", target: str = "h100",
             steps: int = 40, seed: int = 0, ptxas: bool = True,
             out: Callable[[str], None] = print) -> dict:
    import jax

    from .jax_jit import jit as stitch_jit
    from stitch.compiler import arch_of
    from stitch.models import build

    inst = build(model, config)
    if not inst.param_argnums:
        raise ValueError(f"{model} is not a training step (it has no parameters to update)")
    args = inst.random_args(seed)
    out(f"stitch demo: {model} ({config}), plan for {target}, kernels run on this CPU")

    t0 = time.perf_counter()
    # guard=False: keep the stitched kernels after the switch, so their time is measured
    # (by default stitch.jit keeps whichever path is faster on the device).
    stitched = stitch_jit(inst.fn, target=target, async_compile=True, guard=False)
    with_stitch = _train(stitched, args, inst.param_argnums, steps, until_switched=stitched,
                         extra_after_switch=steps)
    stitch_wall = time.perf_counter() - t0
    n = len(with_stitch.losses)
    stock = _train(jax.jit(inst.fn), args, inst.param_argnums, n)
    stats = stitched.stats
    switched = stats.switched_at_call
    if switched is None:
        out(f"  no switch: {'; '.join(stats.fallbacks) or 'compile did not finish'}")
    else:
        out(f"  switched to stitched kernels at call {switched} of {n} "
            f"(compile {stats.compile_seconds:.1f}s in the background, run {stitch_wall:.1f}s)")

    def median_ms(xs: list[float]) -> str:
        return f"{1e3 * float(np.median(xs)):.3f} ms" if xs else "-"
    before = with_stitch.step_s[1:switched - 1] if switched else with_stitch.step_s[1:]
    after = with_stitch.step_s[switched:] if switched else []
    out(f"  per step on this CPU (median, measured): stock path before the switch "
        f"{median_ms(before)}, stitched {median_ms(after)}; jax.jit {median_ms(stock.step_s[1:])}")
    if after and np.median(after) > np.median(stock.step_s[1:]):
        out("  (the stitched kernels emulate the GPU's SIMT program on this CPU; by default "
            "stitch.jit times both paths after the switch and keeps XLA where it is faster)")
    rel = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(with_stitch.losses, stock.losses)]
    out(f"  loss parity with jax.jit over {n} steps ({stats.stitched_calls} of them ran the "
        f"stitched kernels): max relative difference {max(rel):.2e}; "
        f"loss {stock.losses[0]:.6f} -> {stock.losses[-1]:.6f}")

    report: dict = {"model": model, "config": config, "target": target, "steps": n,
                    "switched_at_call": switched, "compile_s": stats.compile_seconds,
                    "median_step_ms_before": 1e3 * float(np.median(before)) if before else None,
                    "median_step_ms_after": 1e3 * float(np.median(after)) if after else None,
                    "median_step_ms_jax": 1e3 * float(np.median(stock.step_s[1:])),
                    "max_loss_rel_diff": max(rel),
                    "stitched_steps": stats.stitched_calls}
    programs = stitched.programs()
    if programs:
        program = programs[0]
        s = program.plan.summary()
        b, st = s["baseline"], s["stitched"]
        out(f"  plan for {target} ({s['baseline_source']} baseline -> stitch; counted and "
            f"modeled, not measured on a GPU):")
        out(f"    kernels {b['kernels']} -> {st['kernels']}, memory-intensive "
            f"{b['mem_kernels']} -> {st['mem_kernels']}")
        out(f"    memory-intensive HBM bytes {b['mem_hbm_bytes']:,} -> {st['mem_hbm_bytes']:,}; "
            f"modeled memory-intensive time {b['mem_modeled_us']:.1f} -> "
            f"{st['mem_modeled_us']:.1f} us")
        out(f"    {len(program.kernels)} stitched kernels built, {len(program.fallbacks)} left "
            "to XLA")
        report["plan"] = s
        if ptxas:
            arch = arch_of(target)
            try:
                passed, total, problems = _ptxas_check(program, arch)
                out(f"    ptxas {arch}: {passed}/{total} stitched kernels assemble without "
                    "spills" + (f" ({'; '.join(problems[:3])})" if problems else ""))
                report["ptxas_passed"], report["ptxas_total"] = passed, total
            except Exception as exc:  # noqa: BLE001 - the check is informative only
                out(f"    ptxas {arch}: not checked ({type(exc).__name__}: {exc})")
    return report
