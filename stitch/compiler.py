"""The compiler driver: HLO -> fusion plan -> stitched kernels -> an executable.

``compile(hlo, target, device="cpu")`` plans the module for ``target`` (stitch.plan), lowers
every scheduled stitched kernel to Kernel IR (codegen.lower) and builds it for the host
target; ``Executable(*args)`` runs the whole module on the CPU: stitched kernels as compiled
host kernels, everything else (GEMM, convolution, opaque ops, kernels that could not be
lowered) through the reference evaluator, op graph by op graph (hlo_passes.graph_exec).
A kernel that cannot be lowered or built falls back to the evaluator with the reason logged
and kept in ``Executable.fallbacks``: compilation never fails because one kernel did.

PTX for the target's architecture is emitted on demand (``exe.ptx``), in a child process
(an LLVM abort cannot take the caller down) and through the on-disk compile cache;
``exe.ptxas()`` assembles it and reports registers / shared memory / spills per kernel.
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
import numpy as np

from codegen.cache import CompileCache, cache_key
from codegen.errors import CodegenError
from codegen.host import NUMPY_DTYPES, HostKernel, compile_host
from codegen.lower import LoweredKernel, lower_kernel
from codegen.values import leaf
from hlo_passes import HloModule, parse_hlo
from hlo_passes.evaluator.dtypes import numpy_dtype
from hlo_passes.evaluator.interpreter import Evaluator
from hlo_passes.graph import OpGraph
from hlo_passes.graph_exec import GraphRunner, NumpyBackend, Unit
from hlo_passes.op_classes import OpClass

from .cost.gpu_specs import get_spec
from .errors import StitchError
from .explorer.planner import ExplorerOptions, FusionPlan, plan as make_plan

log = logging.getLogger(__name__)

DEVICES = ("cpu",)


class CompileError(StitchError):
    """The module cannot be compiled at all (bad input, unknown target or device)."""


def arch_of(target: str) -> str:
    """The PTX architecture of a GPU target: sm_70 (v100), sm_80 (a100), sm_90 (h100/h200)."""
    major, minor = get_spec(target).compute_capability
    return f"sm_{major}{minor}"


@dataclass
class CompiledKernel:
    """One stitched kernel of the plan as built: its Kernel IR and host build."""
    name: str
    graph_index: int
    members: tuple[int, ...]        # the plan kernel's node ids
    lowered: LoweredKernel
    host: HostKernel
    lower_s: float
    build_s: float

    @property
    def kernel(self):
        return self.lowered.kernel


@dataclass
class Fallback:
    """A stitched kernel that runs through the evaluator instead, and why."""
    name: str
    graph_index: int
    reason: str


@dataclass
class CompileStats:
    plan_s: float = 0.0
    lower_s: float = 0.0
    host_build_s: float = 0.0
    host_cache_hits: int = 0
    ptx_s: float = 0.0
    ptx_cache_hits: int = 0

    @property
    def total_s(self) -> float:
        return self.plan_s + self.lower_s + self.host_build_s


def _kernel_fingerprint(kernel) -> str:
    """Content hash of a Kernel IR kernel (frozen dataclasses: repr is complete)."""
    return hashlib.sha256(repr(kernel).encode()).hexdigest()


def _emit_ptx_text(kernel, arch: str) -> str:
    """Top-level (picklable) so it can run in an isolated child."""
    from codegen.nvptx import emit_ptx
    return emit_ptx(kernel, arch)


class Executable:
    """A module compiled by stitch: call it like ``hlo_passes.evaluate`` (args in ENTRY
    parameter order; the root's array leaves depth-first)."""

    def __init__(self, module: HloModule, plan: FusionPlan, target: str,
                 kernels: list[CompiledKernel], fallbacks: list[Fallback], stats: CompileStats,
                 cache: CompileCache | None):
        self.module = module
        self.plan = plan
        self.target = target
        self.arch = arch_of(target)
        self.kernels = kernels
        self.fallbacks = fallbacks
        self.stats = stats
        self.cache = cache
        self._ptx: dict[str, str] | None = None
        self.graphs: list[OpGraph] = [g.graph for g in plan.graphs]
        units: dict[int, list[Unit]] = {}
        for ck in kernels:
            units.setdefault(ck.graph_index, []).append(self._unit(ck))
        self._runner = GraphRunner(module, self.graphs, NumpyBackend(module), units)

    # --- running ------------------------------------------------------------------------
    def _unit(self, ck: CompiledKernel) -> Unit:
        graph = self.graphs[ck.graph_index]
        lowered = ck.lowered
        # Parameters and values read from their own buffers come from the runner.
        members = {v for v in ck.members if graph.nodes[v].op_class is not OpClass.SOURCE
                   or graph.nodes[v].opcode == "constant"} - set(lowered.inputs)
        params = lowered.kernel.params
        n_in = len(lowered.inputs)
        out_shapes = [leaf(graph.nodes[v].shape) for v in lowered.outputs]

        def run(values: list[object]) -> list[object]:
            args = [np.ascontiguousarray(np.asarray(v), dtype=NUMPY_DTYPES[p.dtype]).reshape(-1)
                    for p, v in zip(params, values)]
            outs = [np.empty(p.size, NUMPY_DTYPES[p.dtype]) for p in params[n_in:]]
            ck.host(*args, *outs)
            return [o.reshape(s.dims).astype(numpy_dtype(s.element_type), copy=False)
                    for o, s in zip(outs, out_shapes)]
        return Unit(frozenset(members), tuple(lowered.inputs), tuple(lowered.outputs), run,
                    ck.name)

    def __call__(self, *args: np.ndarray) -> list[np.ndarray]:
        params = self.module.entry.parameters
        if len(args) != len(params):
            raise CompileError(f"{self.module.name}: {len(params)} arguments expected, "
                               f"got {len(args)}")
        for number, (param, value) in enumerate(zip(params, args)):
            if param.shape.is_array:
                value = np.asarray(value)
                want = numpy_dtype(param.shape.element_type)
                if value.shape != param.shape.dims or value.dtype != want:
                    raise CompileError(
                        f"{self.module.name}: parameter {number} ({param.name}) wants "
                        f"{want}{list(param.shape.dims)}, got {value.dtype}{list(value.shape)}")
        return [np.asarray(v) for v in self._runner.run(args)]

    # --- GPU artifacts ------------------------------------------------------------------
    @property
    def ptx(self) -> dict[str, str]:
        """Kernel name -> PTX for the target's architecture (built once, cached on disk)."""
        if self._ptx is None:
            self._ptx = self.emit_ptx(self.arch)
        return self._ptx

    def emit_ptx(self, arch: str) -> dict[str, str]:
        from codegen.isolation import IsolatedWorker
        import llvmlite

        out: dict[str, str] = {}
        start = time.perf_counter()
        with IsolatedWorker(name="stitch-ptx") as worker:
            for ck in self.kernels:
                key = cache_key("ptx", _kernel_fingerprint(ck.kernel), arch, llvmlite.__version__,
                                _libdevice_identity())
                cached = self.cache.get(key) if self.cache is not None else None
                if cached is not None:
                    self.stats.ptx_cache_hits += 1
                    out[ck.name] = cached.decode()
                    continue
                text = worker.call(_emit_ptx_text, ck.kernel, arch)
                if self.cache is not None:
                    self.cache.put(key, text.encode())
                out[ck.name] = text
        self.stats.ptx_s += time.perf_counter() - start
        return out

    def ptxas(self, arch: str | None = None) -> dict[str, object]:
        """Kernel name -> ``codegen.toolchain.PtxasReport`` (registers, shared memory,
        spills) for ``arch`` (default: the target's)."""
        from codegen.toolchain import assemble

        arch = arch or self.arch
        ptx = self.ptx if arch == self.arch else self.emit_ptx(arch)
        return {name: assemble(text, arch, kernel_name=name)[name] for name, text in ptx.items()}

    # --- reporting ----------------------------------------------------------------------
    def summary(self) -> dict:
        return {"target": self.target, "kernels": len(self.kernels),
                "fallbacks": [(f.name, f.reason) for f in self.fallbacks],
                "plan_s": round(self.stats.plan_s, 3), "lower_s": round(self.stats.lower_s, 3),
                "host_build_s": round(self.stats.host_build_s, 3),
                "host_cache_hits": self.stats.host_cache_hits}


def _libdevice_identity() -> str:
    from codegen.nvptx import default_libdevice_path

    path = default_libdevice_path()
    if path is None:
        return "none"
    st = path.stat()
    return f"{path}:{st.st_size}:{int(st.st_mtime)}"


def compile(hlo: str | HloModule, target: str = "h100", device: str = "cpu", *,
            plan: FusionPlan | None = None, options: ExplorerOptions | None = None,
            cache: CompileCache | None | bool = True) -> Executable:
    """Plan ``hlo`` for ``target`` and build its stitched kernels for ``device`` ("cpu": the
    host target; the kernels' PTX for the target is ``Executable.ptx``).

    ``cache``: True for the default on-disk cache ($STITCH_CACHE_DIR), a CompileCache, or
    False/None for none.
    """
    if device not in DEVICES:
        raise CompileError(f"device {device!r} is not supported (supported: {', '.join(DEVICES)})")
    module = parse_hlo(hlo) if isinstance(hlo, str) else hlo
    try:
        arch_of(target)
    except (KeyError, ValueError) as exc:
        raise CompileError(f"unknown target {target!r}: {exc}") from exc
    store = CompileCache() if cache is True else (cache or None)
    stats = CompileStats()
    start = time.perf_counter()
    fusion_plan = plan if plan is not None else make_plan(module, target, options=options)
    stats.plan_s = time.perf_counter() - start
    evaluator = Evaluator(module)
    kernels: list[CompiledKernel] = []
    fallbacks: list[Fallback] = []
    for gi, g in enumerate(fusion_plan.graphs):
        for k in g.stitched.kernels:
            if k.schedule is None:
                continue
            t0 = time.perf_counter()
            try:
                lowered = lower_kernel(g.graph, evaluator, k.schedule, k.name)
            except CodegenError as exc:
                log.info("kernel %s: runs through the evaluator: %s", k.name, exc)
                fallbacks.append(Fallback(k.name, gi, str(exc)))
                continue
            t1 = time.perf_counter()
            try:
                host = compile_host(lowered.kernel, cache=store)
            except CodegenError as exc:
                log.warning("kernel %s: host build failed, runs through the evaluator: %s",
                            k.name, exc)
                fallbacks.append(Fallback(k.name, gi, str(exc)))
                continue
            t2 = time.perf_counter()
            stats.lower_s += t1 - t0
            stats.host_build_s += t2 - t1
            stats.host_cache_hits += host.from_cache
            kernels.append(CompiledKernel(lowered.kernel.name, gi, tuple(k.members), lowered, host,
                                          t1 - t0, t2 - t1))
    log.info("compiled %s for %s: %d stitched kernels, %d through the evaluator, "
             "plan %.2fs, lower %.2fs, host build %.2fs (%d from the cache)",
             module.name, target, len(kernels), len(fallbacks), stats.plan_s, stats.lower_s,
             stats.host_build_s, stats.host_cache_hits)
    return Executable(module, fusion_plan, target, kernels, fallbacks, stats, store)


__all__ = ["CompileError", "CompiledKernel", "Executable", "Fallback", "arch_of", "compile"]
