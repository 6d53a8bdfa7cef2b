"""A jax function's HLO, rewritten: each stitched kernel one XLA FFI custom call, everything
else jax.lax ops, so XLA compiles and fuses the rest (FusionStitching's "unmerged fusions go
through XLA").

``build_stitched(module, target, device)`` plans the module (``stitch.plan``), lowers every
scheduled stitched kernel to Kernel IR, builds it as an FFI target (the host SIMT program on
"cpu", the PTX launched by the CUDA handler on "gpu") and returns a ``StitchedProgram``:
``program.fn(*leaves)`` is a pure jax function of the ENTRY parameters (traceable, meant to
be wrapped in ``jax.jit``) returning the root's leaves. The op graphs are walked by
``hlo_passes.graph_exec.GraphRunner`` with ``JaxBackend``: plain nodes become lax ops through
``frontends.jax_ops.JaxOpEmitter``, loops ``lax.while_loop``, conditionals ``lax.switch``.

A kernel that cannot be lowered or built is left to XLA (its ops are emitted as lax ops like
any other) and listed with the reason in ``program.fallbacks``: one kernel never makes the
whole function fall back.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from codegen.errors import CodegenError
from codegen.lower import LoweredKernel, lower_kernel
from codegen.values import leaf
from hlo_passes import HloModule
from hlo_passes.evaluator.interpreter import Evaluator
from hlo_passes.graph import OpGraph, OpNode
from hlo_passes.graph_exec import GraphRunner, Unit
from hlo_passes.op_classes import OpClass

from .errors import StitchError
from .verify import poison_check  # noqa: F401 - re-exported for the TF front end
from .explorer.planner import ExplorerOptions, FusionPlan, plan as make_plan

log = logging.getLogger(__name__)

DEVICES = ("cpu", "gpu")


class StitchBuildError(StitchError):
    """The function cannot be rewritten at all (nothing of it is stitched)."""


class JaxBackend:
    """``graph_exec.Backend`` emitting jax ops (works under ``jax.jit`` tracing)."""

    def __init__(self, module: HloModule):
        from .frontends.jax_ops import JaxOpEmitter
        self.emitter = JaxOpEmitter(module)

    def apply(self, node: OpNode, operands: list[object]) -> object:
        return self.emitter.apply(node.computation, node.instruction, operands)

    def constant(self, node: OpNode) -> object:
        return self.emitter.constant(node.instruction)

    def while_loop(self, cond, body, init):
        from jax import lax
        import jax.numpy as jnp

        out = lax.while_loop(lambda s: jnp.reshape(cond(list(s)), ()),
                             lambda s: tuple(body(list(s))), tuple(init))
        return list(out)

    def switch(self, selector, branches):
        from jax import lax
        import jax.numpy as jnp

        sel = jnp.reshape(selector, ())
        if sel.dtype == jnp.bool_:
            index = jnp.where(sel, 0, 1).astype(jnp.int32)     # pred: true -> branch 0
        else:
            n = len(branches)
            index = jnp.where((sel < 0) | (sel >= n), n - 1, sel).astype(jnp.int32)
        return list(lax.switch(index, [lambda _, b=b: tuple(b()) for b in branches], None))


@dataclass
class StitchedKernel:
    name: str
    graph_index: int
    lowered: LoweredKernel
    target: Any                       # codegen.ffi.FfiTarget
    build_s: float


@dataclass
class StitchedProgram:
    module: HloModule
    plan: FusionPlan
    device: str
    kernels: list[StitchedKernel]
    fallbacks: list[tuple[str, str]]  # (kernel name, reason)
    fn: Callable[..., list[Any]]
    timings: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict:
        s = self.plan.summary()
        return {"kernels_before": s["baseline"]["kernels"],
                "kernels_after": s["stitched"]["kernels"],
                "stitched_kernels": len(self.kernels), "fallbacks": len(self.fallbacks),
                **{k: round(v, 3) for k, v in self.timings.items()}}


def _build_target(kernel, device: str, cache):
    from codegen.ffi import host_ffi_target

    if device == "cpu":
        return host_ffi_target(kernel, cache=cache)
    from codegen.ffi_cuda import cuda_ffi_target
    from codegen.gpu_cache import emit_ptx_cached

    return cuda_ffi_target(kernel, emit_ptx_cached(kernel, _gpu_arch(), cache=cache).ptx)


def _gpu_arch() -> str:
    """sm_XY of the first CUDA device jax sees."""
    import jax
    capability = getattr(jax.devices("gpu")[0], "compute_capability", None)
    if not capability:
        raise StitchBuildError("the GPU device does not report its compute capability")
    return "sm_" + str(capability).replace(".", "")


def _unit(graph: OpGraph, sk: StitchedKernel, members: frozenset[int]) -> Unit:
    from .frontends.jax_ops import jax_dtype

    lowered = sk.lowered
    outs = [leaf(graph.nodes[v].shape) for v in lowered.outputs]

    def run(values: list[object]) -> list[object]:
        import jax.numpy as jnp
        flat = [jnp.reshape(v, (-1,)) for v in values]
        results = sk.target.call(*flat)
        return [jnp.reshape(r, s.dims).astype(jax_dtype(s.element_type))
                for r, s in zip(results, outs)]
    return Unit(members, tuple(lowered.inputs), tuple(lowered.outputs), run, sk.name)


def _unit_members(graph: OpGraph, members, lowered: LoweredKernel) -> frozenset[int]:
    """What the unit replaces: its ops, less the values it reads (parameters, buffers)."""
    return frozenset(v for v in members if graph.nodes[v].op_class is not OpClass.SOURCE
                     or graph.nodes[v].opcode == "constant") - set(lowered.inputs)


def build_stitched(module: HloModule, target: str = "h100", device: str = "cpu", *,
                   options: ExplorerOptions | None = None, cache=None,
                   progress: Callable[[str], None] | None = None) -> StitchedProgram:
    """Plan ``module`` for ``target``, build its stitched kernels for ``device`` and return
    the rewritten program (module docstring)."""
    if device not in DEVICES:
        raise StitchBuildError(f"device {device!r} is not supported ({', '.join(DEVICES)})")
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    fusion_plan = make_plan(module, target, options=options)
    timings["plan_s"] = time.perf_counter() - t0
    evaluator = Evaluator(module)
    kernels: list[StitchedKernel] = []
    fallbacks: list[tuple[str, str]] = []
    units: dict[int, list[Unit]] = {}
    todo = [(gi, g, k) for gi, g in enumerate(fusion_plan.graphs) for k in g.stitched.kernels
            if k.schedule is not None]
    t1 = time.perf_counter()
    for done, (gi, g, k) in enumerate(todo):
        start = time.perf_counter()
        try:
            lowered = lower_kernel(g.graph, evaluator, k.schedule, k.name)
            ffi_target = _build_target(lowered.kernel, device, cache)
        except (CodegenError, StitchError) as exc:
            log.info("kernel %s stays with XLA: %s", k.name, exc)
            fallbacks.append((k.name, str(exc)))
            continue
        sk = StitchedKernel(k.name, gi, lowered, ffi_target, time.perf_counter() - start)
        kernels.append(sk)
        units.setdefault(gi, []).append(_unit(g.graph, sk,
                                              _unit_members(g.graph, k.members, lowered)))
        if progress is not None:
            progress(f"{done + 1}/{len(todo)} kernels built")
    timings["build_s"] = time.perf_counter() - t1
    graphs = [g.graph for g in fusion_plan.graphs]
    backend = JaxBackend(module)

    def fn(*leaves: Any) -> list[Any]:
        return GraphRunner(module, graphs, backend, units).run(list(leaves))
    return StitchedProgram(module, fusion_plan, device, kernels, fallbacks, fn, timings)
