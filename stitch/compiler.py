"""The compiler driver: HLO -> fusion plan -> stitched kernels -> an executable.

``compile(hlo, target, device="cpu")`` plans the module for ``target`` (stitch.plan), lowers
every scheduled stitched kernel to Kernel IR (stitch.codegen.lower) and builds it for the host
target; ``Executable(*args)`` runs the whole module on the CPU: stitched kernels as compiled
host kernels, everything else (GEMM, convolution, opaque ops, kernels that could not be
lowered) through the reference evaluator, op graph by op graph (stitch.hlo.graph_exec).
A kernel that cannot be lowered or built falls back to the evaluator with the reason logged
and kept in ``Executable.fallbacks``: compilation never fails because one kernel did.

PTX for the target's architecture is emitted on demand (``exe.ptx``), in a child process
(an LLVM abort cannot take the caller down) and through the on-disk compile cache
(``stitch.codegen.gpu_cache.emit_ptx_cached``); ``exe.ptxas()`` assembles it (through the cache too:
``assemble_cached``) and reports registers / shared memory / spills per kernel.
Times (plan, lower and host build per kernel, PTX and ptxas per kernel) and cache hits are
in ``exe.stats``.

If the planner itself fails on a graph (a planner bug, not bad input), the module is
planned again without kernel packing, and failing that runs wholly through the evaluator;
``exe.plan_notes`` says what happened.

``compile(..., ptxas_feedback=True)`` assembles every kernel after its first build and
re-tunes its schedule with ptxas's register count; kernels another schedule now wins are
rebuilt once (``apply_ptxas_feedback``, judging each schedule with
stitch/schedule/ptxas_feedback.py; ``exe.ptxas_feedback`` lists each kernel's revision).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from stitch.codegen.cache import CompileCache
from stitch.codegen.errors import CodegenError
from stitch.codegen.gpu_cache import assemble_cached, emit_ptx_cached
from stitch.codegen.host import NUMPY_DTYPES, HostKernel, compile_host
from stitch.codegen.lower import LoweredKernel, lower_kernel
from stitch.codegen.values import leaf
from stitch.hlo import HloModule, HloParseError, parse_hlo
from stitch.hlo.evaluator.dtypes import numpy_dtype
from stitch.hlo.evaluator.interpreter import Evaluator
from stitch.hlo.graph import OpGraph, build_op_graphs
from stitch.hlo.graph_exec import GraphRunner, NumpyBackend, Unit
from stitch.hlo.op_classes import OpClass
from stitch.hlo.segments_as_rows import segments_as_rows

from .cost.gpu_specs import UnknownTargetError, get_spec
from .errors import StitchError
from .explorer.patterns import is_plannable
from .explorer.planner import ExplorerOptions, FusionPlan, PlanError, plan as make_plan
from .schedule.chain_tiling import lower_planned_chain
from .schedule.ptxas_feedback import Revision, revise

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
    ptx_s: dict[str, float] = field(default_factory=dict)     # arch -> PTX emission time
    ptxas_s: dict[str, float] = field(default_factory=dict)   # arch -> ptxas time

    @property
    def kernel(self):
        return self.lowered.kernel

    @property
    def from_cache(self) -> bool:
        return self.host.from_cache


@dataclass
class Fallback:
    """A stitched kernel that runs through the evaluator instead, and why."""
    name: str
    graph_index: int
    reason: str
    # The exception's class: CodegenError (a known limit of codegen), ScheduleError (the
    # planner chose a kernel it could not schedule), anything else is a bug.
    error: str = "CodegenError"


@dataclass
class CompileStats:
    """Seconds spent per phase (wall clock, this process) and compile-cache hits."""
    plan_s: float = 0.0
    lower_s: float = 0.0
    host_build_s: float = 0.0
    host_cache_hits: int = 0
    ptx_s: float = 0.0              # PTX emission, every arch asked for
    ptx_cache_hits: int = 0
    ptxas_s: float = 0.0
    ptxas_cache_hits: int = 0

    @property
    def total_s(self) -> float:
        return self.plan_s + self.lower_s + self.host_build_s


class Executable:
    """A module compiled by stitch: call it like ``stitch.hlo.evaluate`` (args in ENTRY
    parameter order; the root's array leaves depth-first)."""

    def __init__(self, module: HloModule, plan: FusionPlan | None, target: str,
                 kernels: list[CompiledKernel], fallbacks: list[Fallback], stats: CompileStats,
                 cache: CompileCache | None, *, graphs: list[OpGraph] | None = None,
                 plan_notes: list[str] | None = None, poison_outputs: bool = False):
        self.module = module
        self.plan = plan            # None: planning failed, everything runs in the evaluator
        self.target = target
        self.arch = arch_of(target)
        self.kernels = kernels
        self.fallbacks = fallbacks
        self.stats = stats
        self.cache = cache
        self.plan_notes: list[str] = list(plan_notes or [])
        # Kernel output buffers start as NaN (floats) / a sentinel (integers), so an element
        # a kernel never writes cannot pass for a right one (tests; costs a fill per call).
        self.poison_outputs = poison_outputs
        self._ptx: dict[str, str] | None = None
        # One ptxas_feedback.Revision per kernel when compiled with ptxas_feedback=True.
        self.ptxas_feedback: list = []
        # One schedule.layouts.GraphLayouts per graph when compiled with layouts=True.
        self.layouts: list = []
        self.graphs: list[OpGraph] = graphs if graphs is not None else \
            [g.graph for g in plan.graphs]
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
            outs = [self._output_buffer(p) for p in params[n_in:]]
            for k, v in enumerate(lowered.outputs):
                if v in lowered.initial:      # an atomic scatter adds into its operand
                    outs[k][:] = args[lowered.inputs.index(lowered.initial[v])]
            ck.host(*args, *outs)
            return [o.reshape(s.dims).astype(numpy_dtype(s.element_type), copy=False)
                    for o, s in zip(outs, out_shapes)]
        return Unit(frozenset(members), tuple(lowered.inputs), tuple(lowered.outputs), run,
                    ck.name)

    def _output_buffer(self, p) -> np.ndarray:
        dtype = NUMPY_DTYPES[p.dtype]
        if not self.poison_outputs:
            return np.empty(p.size, dtype)
        if dtype.kind == "f" or dtype == NUMPY_DTYPES["bf16"]:
            return np.full(p.size, np.nan, dtype)
        if dtype == np.bool_:
            return np.ones(p.size, dtype)
        return np.full(p.size, np.iinfo(dtype).max // 3 + 7, dtype)

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
        from stitch.codegen.isolation import IsolatedWorker

        out: dict[str, str] = {}
        start = time.perf_counter()
        with IsolatedWorker(name="stitch-ptx") as worker:
            for ck in self.kernels:
                t0 = time.perf_counter()
                try:
                    built = emit_ptx_cached(ck.kernel, arch, cache=self.cache, worker=worker)
                except StitchError as exc:   # CodegenError, IsolatedCrash
                    raise CodegenError(f"kernel {ck.name}: PTX for {arch}: {exc}") from exc
                self.stats.ptx_cache_hits += built.from_cache
                out[ck.name] = built.ptx
                ck.ptx_s[arch] = time.perf_counter() - t0
        self.stats.ptx_s += time.perf_counter() - start
        return out

    def ptxas(self, arch: str | None = None) -> dict[str, object]:
        """Kernel name -> ``stitch.codegen.toolchain.PtxasReport`` (registers, shared memory,
        spills) for ``arch`` (default: the target's); ptxas results come from the cache."""
        arch = arch or self.arch
        ptx = self.ptx if arch == self.arch else self.emit_ptx(arch)
        reports = {}
        for ck in self.kernels:
            t0 = time.perf_counter()
            built = assemble_cached(ptx[ck.name], arch, cache=self.cache, kernel_name=ck.name)
            reports[ck.name] = built.reports[ck.name]
            self.stats.ptxas_cache_hits += built.from_cache
            ck.ptxas_s[arch] = time.perf_counter() - t0
            self.stats.ptxas_s += ck.ptxas_s[arch]
        return reports

    # --- reporting ----------------------------------------------------------------------
    def summary(self) -> dict:
        return {"target": self.target, "kernels": len(self.kernels),
                "fallbacks": [(f.name, f.reason) for f in self.fallbacks],
                "plan_notes": list(self.plan_notes),
                "plan_s": round(self.stats.plan_s, 3), "lower_s": round(self.stats.lower_s, 3),
                "host_build_s": round(self.stats.host_build_s, 3),
                "host_cache_hits": self.stats.host_cache_hits}


def _plan_with_retries(module: HloModule, target: str, options: ExplorerOptions | None,
                      notes: list[str]) -> FusionPlan | None:
    """The fusion plan; a planner failure (a bug, not bad input: PlanError and unknown
    targets are the caller's) is retried without kernel packing, then given up (None: the
    module runs through the evaluator). Each failure is logged and noted."""
    attempts = [options or ExplorerOptions()]
    if attempts[0].packing:
        attempts.append(dataclasses.replace(attempts[0], packing=False))
    for i, opts in enumerate(attempts):
        try:
            return make_plan(module, target, options=opts)
        except (PlanError, UnknownTargetError) as exc:
            raise CompileError(f"{module.name}: cannot plan for {target}: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - a planner bug must not stop compilation
            how = "without packing" if i + 1 < len(attempts) else "through the evaluator"
            note = (f"planner failed ({type(exc).__name__}: {exc})"
                    f"{' with packing' if opts.packing else ''}; runs {how}")
            log.warning("%s: %s", module.name, note)
            notes.append(note)
    return None


def _build_kernel(k, gi: int, graph: OpGraph, evaluator: Evaluator,
                  store: CompileCache | None, arch: str = "sm_80", *, schedule=None,
                  layouts: dict[int, tuple[int, ...]] | None = None
                  ) -> CompiledKernel | Fallback:
    """Lower and build one planned kernel; any failure becomes a Fallback with its reason
    (CodegenError: a known limit, logged at info; anything else is a bug: warning)."""
    def failed(stage: str, exc: Exception) -> Fallback:
        expected = isinstance(exc, CodegenError)
        reason = f"{stage}: {exc}" if expected else f"{stage}: {type(exc).__name__}: {exc}"
        log.log(logging.INFO if expected else logging.WARNING,
                "kernel %s: runs through the evaluator: %s", k.name, reason)
        return Fallback(k.name, gi, reason, type(exc).__name__)

    t0 = time.perf_counter()
    try:
        if k.kind == "gemm_chain":
            lowered = lower_planned_chain(graph, k, arch)
        else:
            # The runner fills LoweredKernel.initial buffers (atomic scatters) first.
            lowered = lower_kernel(graph, evaluator, schedule or k.schedule, k.name,
                                   in_place=True, layouts=layouts)
    except Exception as exc:  # noqa: BLE001 - one kernel must not stop compilation
        return failed("lowering", exc)
    t1 = time.perf_counter()
    try:
        host = compile_host(lowered.kernel, cache=store)
    except Exception as exc:  # noqa: BLE001
        return failed("host build", exc)
    t2 = time.perf_counter()
    return CompiledKernel(lowered.kernel.name, gi, tuple(k.members), lowered, host,
                          t1 - t0, t2 - t1)


def compile(hlo: str | HloModule, target: str = "h100", device: str = "cpu", *,
            plan: FusionPlan | None = None, options: ExplorerOptions | None = None,
            cache: CompileCache | None | bool = True,
            poison_outputs: bool = False, ptxas_feedback: bool = False,
            layouts: bool = False) -> Executable:
    """Plan ``hlo`` for ``target`` and build its stitched kernels for ``device`` ("cpu": the
    host target; the kernels' PTX for the target is ``Executable.ptx``).

    ``cache``: True for the default on-disk cache ($STITCH_CACHE_DIR), a CompileCache, or
    False/None for none. ``poison_outputs``: kernel output buffers start as NaN / a
    sentinel (for tests: an unwritten element cannot look right). ``ptxas_feedback``: assemble
    each kernel for the target and rebuild it once when ptxas's register count makes another
    schedule win (needs ptxas; ToolchainError without it). ``layouts``: values between
    stitched kernels get the layouts ``schedule.layouts`` chooses with the kernels'
    schedules (``Executable.layouts``); a value whose producer or reader falls back to the
    evaluator keeps the row-major layout.
    Raises CompileError for an unknown device or target and for text that does not parse.
    """
    if device not in DEVICES:
        raise CompileError(f"device {device!r} is not supported (supported: {', '.join(DEVICES)})")
    try:
        arch_of(target)
    except (KeyError, ValueError) as exc:
        raise CompileError(f"unknown target {target!r}: {exc}") from exc
    try:
        module = parse_hlo(hlo) if isinstance(hlo, str) else hlo
    except HloParseError as exc:
        raise CompileError(f"cannot parse the HLO: {exc}") from exc
    if (options or ExplorerOptions()).segments_as_rows:
        # As stitch.plan does: the plan's graphs are the rewritten module's.
        module = segments_as_rows(module)
    store = CompileCache() if cache is True else (cache or None)
    stats = CompileStats()
    notes: list[str] = []
    start = time.perf_counter()
    fusion_plan = plan if plan is not None else _plan_with_retries(module, target, options, notes)
    stats.plan_s = time.perf_counter() - start
    evaluator = Evaluator(module)
    kernels: list[CompiledKernel] = []
    fallbacks: list[Fallback] = []
    chosen = _choose_layouts(fusion_plan, target) if layouts and fusion_plan is not None \
        else []
    for gi, g in enumerate(fusion_plan.graphs if fusion_plan is not None else []):
        for k in g.stitched.kernels:
            if k.schedule is None and k.kind != "gemm_chain":
                if k.kind == "fused" and k.schedule_note and \
                        all(is_plannable(g.graph, v) for v in k.members):
                    # A stitched kernel the planner chose but could not schedule (a planner
                    # bug): it runs through the evaluator like any other fallback.
                    fallbacks.append(Fallback(k.name, gi, f"no schedule: {k.schedule_note}",
                                              "ScheduleError"))
                continue
            built = _build_kernel(k, gi, g.graph, evaluator, store, arch_of(target),
                                  **_layout_args(chosen, gi, g.graph, k))
            if isinstance(built, Fallback):
                fallbacks.append(built)
                continue
            kernels.append(built)
    if chosen:
        kernels = _keep_layouts_off_fallbacks(fusion_plan, chosen, kernels, fallbacks,
                                              evaluator, store, target)
    for built in kernels:
        stats.lower_s += built.lower_s
        stats.host_build_s += built.build_s
        stats.host_cache_hits += built.from_cache
    graphs = None if fusion_plan is not None else build_op_graphs(module)
    log.info("compiled %s for %s: %d stitched kernels, %d through the evaluator, "
             "plan %.2fs, lower %.2fs, host build %.2fs (%d from the cache)",
             module.name, target, len(kernels), len(fallbacks), stats.plan_s, stats.lower_s,
             stats.host_build_s, stats.host_cache_hits)
    exe = Executable(module, fusion_plan, target, kernels, fallbacks, stats, store,
                     graphs=graphs, plan_notes=notes, poison_outputs=poison_outputs)
    exe.layouts = chosen
    if ptxas_feedback:
        exe = apply_ptxas_feedback(exe, evaluator, store)
    return exe


def _choose_layouts(plan: FusionPlan, target: str) -> list:
    from .schedule.layouts import apply_layouts
    return apply_layouts(plan, target, assign=False)


def _layout_args(chosen: list, gi: int, graph: OpGraph, k) -> dict:
    """The re-tuned schedule and the layouts of kernel k (none without layouts)."""
    if not chosen or not chosen[gi].layouts:
        return {}
    from .schedule.layouts import kernel_layouts
    return {"schedule": chosen[gi].schedules.get(k.name),
            "layouts": kernel_layouts(graph, chosen[gi].layouts, k.members)}


def _keep_layouts_off_fallbacks(plan: FusionPlan, chosen: list, kernels: list[CompiledKernel],
                                fallbacks: list[Fallback], evaluator: Evaluator,
                                store: CompileCache | None, target: str
                                ) -> list[CompiledKernel]:
    """A kernel that runs through the evaluator reads and writes row-major buffers: the
    values it touches go back to the row-major layout and the built kernels touching them
    are lowered again (until nothing changes; a rebuild that fails falls back too)."""
    from .schedule.layouts import drop_layouts, kernel_layouts
    by_name = {(gi, k.name): k for gi, g in enumerate(plan.graphs) for k in g.stitched.kernels}
    # Built kernels carry the plan kernel's members (their names are sanitized).
    by_members = {(gi, tuple(k.members)): k for gi, g in enumerate(plan.graphs)
                  for k in g.stitched.kernels}
    while True:
        dropped: set[tuple[int, int]] = set()
        for f in fallbacks:
            g = plan.graphs[f.graph_index]
            k = by_name.get((f.graph_index, f.name))
            if k is None:
                continue
            touched = kernel_layouts(g.graph, chosen[f.graph_index].layouts, k.members)
            dropped |= {(f.graph_index, v)
                        for v in drop_layouts(g.graph, chosen[f.graph_index], touched)}
        if not dropped:
            return kernels
        log.info("layouts: %d values back to row-major (a kernel touching them falls back)",
                 len(dropped))
        kept = []
        for ck in kernels:
            graph = plan.graphs[ck.graph_index].graph
            if not any((ck.graph_index, v) in dropped for v in ck.lowered.layouts):
                kept.append(ck)
                continue
            k = by_members[(ck.graph_index, tuple(ck.members))]
            rebuilt = _build_kernel(k, ck.graph_index, graph, evaluator, store,
                                    arch_of(target), **_layout_args(chosen, ck.graph_index,
                                                                    graph, k))
            (fallbacks if isinstance(rebuilt, Fallback) else kept).append(rebuilt)
        kernels = kept



def apply_ptxas_feedback(exe: Executable, evaluator: Evaluator,
                         store: CompileCache | None) -> Executable:
    """Assemble every kernel of ``exe`` for its target, revise each schedule with ptxas's
    registers, rebuild the kernels another schedule now wins (once each) and return the
    Executable with them; ``.ptxas_feedback`` lists a Revision per kernel."""
    if exe.plan is None or not exe.kernels:
        exe.ptxas_feedback = []
        return exe
    spec = get_spec(exe.target)
    reports = exe.ptxas()
    # Built kernels carry the plan kernel's members (their names are sanitized).
    planned = {(gi, tuple(k.members)): k for gi, g in enumerate(exe.plan.graphs)
               for k in g.stitched.kernels}
    revisions: list[Revision] = []
    kernels: list[CompiledKernel] = []
    rebuilt: list[CompiledKernel] = []
    for ck in exe.kernels:
        k = planned.get((ck.graph_index, tuple(ck.members)))
        report = reports.get(ck.name)
        if k is None or k.schedule is None or report is None:
            kernels.append(ck)
            continue
        graph = exe.graphs[ck.graph_index]
        rev = revise(graph, k.schedule, spec, report.registers, kernel=ck.name,
                     graph_index=ck.graph_index,
                     spills=report.spill_store_bytes + report.spill_load_bytes)
        revisions.append(rev)
        if not rev.changed:
            kernels.append(ck)
            continue
        old_schedule = k.schedule
        k.schedule = rev.schedule
        # A kernel reading or writing a re-laid-out buffer keeps indexing it so.
        built = _build_kernel(k, ck.graph_index, graph, evaluator, store,
                              layouts=ck.lowered.layouts or None)
        if isinstance(built, Fallback):
            # The revised schedule does not lower: keep the kernel as first built.
            k.schedule = old_schedule
            rev.changed, rev.note = False, f"rebuild failed: {built.reason}"[:300]
            kernels.append(ck)
            continue
        rev.rebuilt = True
        exe.stats.lower_s += built.lower_s
        exe.stats.host_build_s += built.build_s
        exe.stats.host_cache_hits += built.from_cache
        log.info("kernel %s: ptxas %d registers (estimate %d): %s -> %s, %.2f -> %.2f us",
                 ck.name, rev.measured, rev.estimate, rev.before, rev.after, rev.before_us,
                 rev.after_us)
        kernels.append(built)
        rebuilt.append(built)
    new = Executable(exe.module, exe.plan, exe.target, kernels, exe.fallbacks, exe.stats,
                     exe.cache, graphs=exe.graphs, plan_notes=exe.plan_notes,
                     poison_outputs=exe.poison_outputs)
    new.ptxas_feedback = revisions
    new.layouts = exe.layouts
    if rebuilt:
        _assemble_rebuilt(exe, new, rebuilt, revisions)
    return new


def _assemble_rebuilt(old: Executable, new: Executable, rebuilt: list[CompiledKernel],
                      revisions: list[Revision]) -> None:
    """PTX and ptxas for the rebuilt kernels only (the others keep their first PTX), so
    ``new.ptx`` is complete and each rebuilt kernel's Revision has its own count."""
    fresh = {id(ck) for ck in rebuilt}
    ptx = {ck.name: old.ptx[ck.name] for ck in new.kernels if id(ck) not in fresh}
    by_name = {r.kernel: r for r in revisions if r.rebuilt}
    for ck in rebuilt:
        ptx[ck.name] = emit_ptx_cached(ck.kernel, new.arch, cache=new.cache).ptx
        report = assemble_cached(ptx[ck.name], new.arch, cache=new.cache,
                                 kernel_name=ck.name).reports[ck.name]
        by_name[ck.name].rebuilt_registers = report.registers
    new._ptx = ptx

__all__ = ["CompileError", "CompileStats", "CompiledKernel", "Executable", "Fallback", "arch_of",
           "compile"]
