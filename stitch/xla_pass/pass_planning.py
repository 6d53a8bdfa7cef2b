"""The pass's work on one module (``stitch_module``): plan it (XLA's own fusions are the
baseline, XLA's instructions the explorer's units), snap the stitched kernels to whole XLA
instructions, lower those that can be placed (within the code budget, repaying their build,
not losing to a loop body's copies), build them for the device (``kernel_builds``) and put
them in (``hlo_rewrite.replace_kernels``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Iterator

from stitch.hlo import HloModule
from stitch.hlo.source_lines import plan_sources
from stitch.errors import Cancelled, StitchError

from stitch.config import grid_sync_on_gpu
from . import early_imports
from .delivered import deliver, loses_with_copies, price_xla_kernels
from .hlo_rewrite import (ComputationView, NotPlaceable, PlacedKernel, carried_copy_bytes,
                          find_site, replace_kernels, xla_layouts)


from .kernel_builds import GpuPrebuild, build_target, compile_cache
from .pass_request import BuiltKernel, PassError, PassReport, PassRequest
from .ptx_children import build_threads, release_ptx_workers, start_ptx_workers
from .segment_rows import SegmentRows, segment_rows
from .snap import snap_kernels

log = logging.getLogger("stitch.xla_pass.planning")

# LLVM (llvmlite's global context) is used by one thread at a time: the pass runs on an
# XLA thread, stitch.compile and the tests on others.
LLVM_LOCK = threading.RLock()


# GEMM-chain kernels of f32 dots that allow TF32 use TF32 tensor cores on the GPU path
# (stitch.codegen.gemm_chain's m16n8k8 MMA); host paths keep f32 exact.
GPU_CHAIN_TF32 = True

# The pass plans with XLA's instructions as the explorer's units (ExplorerOptions.xla_units;
# a request's own options choose for themselves).
XLA_UNITS = True

# GPU builds: a kernel whose Kernel IR is over the code budget ($STITCH_CODE_BUDGET, default
# code_budget.CODE_BUDGET statements) is built at a narrower vector width where the
# latency-evaluator prices that within tolerance (host builds are for checking, not speed).
CODE_BUDGET_ON_GPU = True

# GPU builds: a kernel whose modeled saving per step would not repay its build within
# $STITCH_PAYBACK_STEPS steps is left to XLA (stitch.xla_pass.payback; host builds are checks).
PAYBACK_ON_GPU = True

# GPU builds: a kernel in a loop body that loses (time, or memory-intensive bytes) once the
# copies of the loop state it writes are counted is left to XLA (delivered.loses_with_copies;
# host builds are checks and keep them).
LOOP_COPIES_ON_GPU = True

# Kernel IR lowered once per distinct kernel (stitch.codegen.lowering_reuse): a repeated
# layer's kernels are bound to the first one's lowering, as is what is derived from it (its
# structure key, its check, its busiest thread).
REUSE_LOWERING = True


def stitch_module(module: HloModule, request: PassRequest) -> PassReport:
    """Plan ``module``, build the kernels that fit, put them in (module docstring)."""
    timings: dict[str, float] = {}
    early_imports.wait()
    # GPU: PTX is emitted in isolated children, one per build thread, not a fresh
    # interpreter per kernel; ptxas runs in the same threads. The request started them as
    # its compile began; else they start now, so their start-up overlaps planning.
    ptx_workers = []
    if request.device == "gpu":
        ptx_workers = request.take_ptx_workers() or start_ptx_workers()
    try:
        return _plan_and_build(module, request, timings, ptx_workers)
    finally:
        release_ptx_workers(ptx_workers)


def _plan_and_build(module: HloModule, request: PassRequest, timings: dict[str, float],
                    ptx_workers: list) -> PassReport:
    report = _plan_and_build_once(module, request, timings, ptx_workers)
    if not report.kernels_stitched:
        report = _replan_useless(module, request, report, timings, ptx_workers)
    return report


def _replan_useless(module: HloModule, request: PassRequest, report: PassReport,
                    timings: dict[str, float], ptx_workers: list) -> PassReport:
    """``report`` placed no stitched kernel. A plan the plan cache handed back (valid, but
    fusing nothing, its kernels not building or losing to XLA) is dropped and the module
    planned afresh, once (``module`` is as XLA gave it: nothing was placed); a fresh plan
    that stitches nothing is noted in the cache with the reason, so later compiles keep it
    instead of planning again."""
    from stitch.explorer.plan_cache import default_plan_cache

    key = getattr(report.plan, "cache_key", None)
    if key is None:
        return report
    store = default_plan_cache()
    if store.failure(key) is not None:
        log.debug("%s: its plan stitched nothing before either (%s)", module.name,
                  store.failure(key))
        return report
    if report.plan.from_cache:
        log.info("%s: the cached plan stitches nothing (%s): dropped, planning again",
                 module.name, report.reason_nothing_stitched())
        store.drop(key)
        report = _plan_and_build_once(module, request, timings, ptx_workers)
        if report.kernels_stitched or report.plan.cache_key is None:
            return report
        key = report.plan.cache_key
    reason = report.reason_nothing_stitched()
    log.info("%s: its fresh plan stitches nothing (%s): noted in the plan cache, not "
             "planned again", module.name, reason)
    store.note_failure(key, reason)
    return report


def _plan_and_build_once(module: HloModule, request: PassRequest,
                         timings: dict[str, float], ptx_workers: list) -> PassReport:
    from stitch.hlo.evaluator.interpreter import Evaluator
    from stitch.cost.gpu_specs import get_spec
    from stitch.explorer.planner import ExplorerOptions, plan as make_plan

    t0, cpu0 = time.perf_counter(), time.thread_time()
    # Kernels are snapped to whole XLA instructions: plan with those as the units (an
    # op-level plan's cuts are undone by snapping, and it plans a ~10x larger graph).
    options = request.options or ExplorerOptions(xla_units=XLA_UNITS)
    if request.device == "gpu" and GPU_CHAIN_TF32:
        # XLA GPU runs f32 dots of DEFAULT precision on TF32 tensor cores: so may a chain.
        # And its chain schedules are assembled by ptxas, spilling ones struck.
        # Chains split n across blocks (a launch per phase) only where STITCH_GRID_SYNC
        # lets grid-barrier kernels run.
        # The spill checks' PTX is emitted by a PTX child, idle while the pass plans (not a
        # fresh interpreter per check).
        options = dataclasses.replace(options, chain_tf32=True,
                                      chain_spill_check=True,
                                      chain_grid_sync=grid_sync_on_gpu() != "off",
                                      spill_worker=ptx_workers[0] if ptx_workers else None,
                                      defer_spill_checks=True)
    if request.device == "gpu":
        # The planner prices a global-scope kernel only in the launch form this pass builds
        # it in, and none under "off" (stitch.cost.launch_forms, STITCH_GRID_SYNC).
        options = dataclasses.replace(options, grid_sync=grid_sync_on_gpu())
    # Planned (and cached, fingerprinted) from the module with proved segments as rows in
    # XLA's fusion bodies; placed into XLA's own module by instruction name.
    rows = segment_rows(module)
    fusion_plan = make_plan(rows.planned, request.target, options=options,
                            cancel=request.cancel, cache=True)
    timings["plan_s"] = time.perf_counter() - t0
    # This thread's CPU seconds: what planning cost, whatever else shares the machine.
    timings["plan_cpu_s"] = time.thread_time() - cpu0
    summary = fusion_plan.summary()
    report = PassReport(module.name, summary["baseline"]["kernels"],
                        summary["baseline"]["kernels"], 0, plan=fusion_plan,
                        segment_rows=list(rows.reductions),
                        where=plan_sources(module, fusion_plan, request.metadata_text))
    # The kernels are lowered from the planned graphs: their constants are the planned
    # module's.
    evaluator = Evaluator(rows.planned)
    spec = get_spec(request.target)
    graphs = [g.graph for g in fusion_plan.graphs]
    placed: list[PlacedKernel] = []
    # Kernels the pass priced itself (placed outside the plan, or built with fewer values
    # written than planned): their delivered price (stitch.xla_pass.delivered).
    priced: dict[str, Any] = {}
    views: dict[int, ComputationView] = {}
    built: dict[str, BuiltKernel] = {}
    launching: dict[str, int] = {}
    t1 = time.perf_counter()
    # XLA's own kernels priced where the plan's baseline is of another module: the XLA
    # side of payback and delivery (priced before the rewrite changes ``module``).
    xla_kernels = price_xla_kernels(module, spec) if rows.changed else None
    if xla_kernels is not None:
        # The kernels XLA launches are those of its own module, not of the planned one.
        report.kernels_xla = report.kernels_after = sum(
            1 for kernels in xla_kernels.values() for x in kernels if x.cost.launches)
    _place_kernels(request, report, fusion_plan, module, spec, evaluator, placed, views,
                   built, launching, ptx_workers, rows, xla_kernels, priced)
    timings["build_s"] = time.perf_counter() - t1
    if not fusion_plan.checks_held():
        # Planned beside the chains' ptxas checks (defer_spill_checks), and one struck a
        # schedule the plan guessed: ``module`` is still as XLA gave it (nothing placed);
        # planned again, the checked prices are known.
        log.info("%s: ptxas struck a chain schedule the plan guessed; planning again",
                 module.name)
        return _plan_and_build_once(module, request, timings, ptx_workers)
    rewrite = replace_kernels(module, graphs, placed, views)
    report.placed = rewrite.placed
    report.skipped.extend(rewrite.skipped)
    report.kernels_stitched = len(rewrite.placed)
    report.kernels_after = report.kernels_xla - sum(launching[n] - 1 for n in rewrite.placed) \
        - len(rewrite.dead_kernels)
    report.kernels = [built[name] for name in rewrite.placed]
    report.in_loop_bodies = sum(1 for p in placed if p.site.name in set(rewrite.placed)
                                and fusion_plan.graphs[p.site.graph_index].graph.kind != "entry")
    report.timings.update(timings)
    # The XLA side (and the XLA kernels left) priced as XLA made them, atomics included.
    report.delivery = deliver(report, fusion_plan, spec, placed, rewrite,
                              xla_kernels=xla_kernels, priced=priced)
    log.debug("%s: %d stitched kernels placed, %d skipped, %d failed to build",
              module.name, len(rewrite.placed), len(report.skipped), len(report.fallbacks))
    return report


def _global_scope(schedule: Any) -> bool:
    return any(part.kind == "global" for part in getattr(schedule, "parts", ()))


def _block_scope_schedule(graph: Any, members: Any, spec: Any) -> Any:
    """The kernel's best schedule without the global scope: STITCH_GRID_SYNC=off builds no
    grid-barrier kernel (config.grid_sync_on_gpu; the planner then priced none either,
    stitch.cost.launch_forms)."""
    from stitch.schedule.tuner import ScheduleError, schedule_kernel
    try:
        return schedule_kernel(graph, members, spec, force={"scope": "block"})
    except ScheduleError as exc:
        raise PassError(f"only a global-scope (grid barrier) schedule, and "
                        f"STITCH_GRID_SYNC=off builds none: {exc}") from exc


def _chain_jobs(request: PassRequest, report: PassReport, view: ComputationView, gi: int,
                graph_plan: Any, snapped: list, lower_once: Callable | None = None) -> list:
    """The graph's GEMM-chain kernels, lowered, as (view, kernel, site, lowered) jobs. A
    chain replaces whole XLA instructions (its GEMM fusions, the softmax fusion, split-K
    reduces) that no other stitched kernel touches; else it is left to XLA. ``lower_once``
    (``LoweringReuse.lower``): a repeated layer's chain lowered once."""
    from stitch.codegen.errors import CodegenError
    from stitch.codegen.site_keys import LoweringChoices
    from stitch.schedule.chain_tiling import lower_planned_chain

    taken = {view.top_of(m) for k in snapped for m in k.members}
    jobs = []
    for k in graph_plan.stitched.kernels:
        if k.kind != "gemm_chain":
            continue
        try:
            site = find_site(view, gi, k.name, frozenset(k.members))
            if taken & set(site.tops):
                raise NotPlaceable("shares XLA instructions with another stitched kernel")
        except NotPlaceable as exc:
            report.skipped.append((k.name, str(exc)))
            continue
        request.check_cancelled()
        arch = request.gpu_arch() if request.device == "gpu" else "sm_70"
        fma = request.device != "gpu"

        def lower(k: Any = k) -> Any:
            return lower_planned_chain(graph_plan.graph, k, arch, fma=fma)
        try:
            with LLVM_LOCK:
                lowered = lower() if lower_once is None else lower_once(
                    graph_plan.graph, frozenset(k.members),
                    LoweringChoices("gemm_chain", k.chain_schedule, (arch, fma)), k.name, lower)
        except (CodegenError, StitchError) as exc:
            log.info("kernel %s stays with XLA: %s", k.name, exc)
            report.fallbacks.append((k.name, f"{type(exc).__name__}: {exc}"))
            continue
        taken |= set(site.tops)
        jobs.append((view, k, site, lowered))
    return jobs


def _rows_alone(kernels: list, view: ComputationView, graph: Any, spec: Any,
                rows: SegmentRows, report: PassReport) -> list:
    """Kernels the plan left as one XLA kernel whose planned body is not XLA's (a fusion
    with segments as rows): scheduled here, so that the pass places them instead of XLA's
    atomic scatter fusion."""
    from stitch.schedule.tuner import ScheduleError, schedule_kernel
    out = []
    for k in kernels:
        if k.schedule is not None or k.kind != "fused" or not any(
                view.top_of(m) in rows.fusions for m in k.members):
            continue
        try:
            schedule = schedule_kernel(graph, frozenset(k.members), spec)
        except ScheduleError as exc:
            report.skipped.append((k.name, f"segments as rows, no schedule: {exc}"))
            continue
        out.append(dataclasses.replace(k, schedule=schedule))
    return out


def _xla_gain_s(graph_plan: Any, view: ComputationView, members: frozenset[int],
                cost: Any, xla_kernels: dict) -> float:
    """``payback.modeled_gain_s`` against XLA's own kernels (``delivered.price_xla_kernels``)
    where the plan's baseline is of another module: those of the instructions the kernel
    replaces."""
    tops = {view.top_of(m) for m in members}
    replaced = sum(x.cost.total_s for x in xla_kernels.get(graph_plan.graph.name, [])
                   if x.tops & tops)
    return (replaced - cost.kernel(members).total_s) * graph_plan.stitched.weight


def _lower_jobs(request: PassRequest, report: PassReport, fusion_plan: Any,
                module: HloModule, spec: Any, evaluator: Any, views: dict,
                submit: Callable[..., None] | None, rows: SegmentRows | None = None,
                xla_kernels: dict | None = None, priced: dict | None = None,
                store_later: list | None = None) -> list:
    """The plan's placeable kernels lowered to Kernel IR, as (view, kernel, site, lowered)
    jobs in plan order; ``submit(kernel IR)`` is called for each as soon as it is lowered.
    ``store_later``: the lowerings are not stored in the compile cache here; the callable
    that stores them is appended to it (the caller runs it while the PTX builds run).
    ``rows``/``xla_kernels``: the plan is of XLA's module with segments as rows
    (``segment_rows``); XLA's own kernels priced. ``priced`` gets the price of each kernel
    placed outside the plan (LM head losses, attention backwards) and of each forward chain
    built without the values only a replaced backward read."""
    lowering = _JobLowering(request, report, module, spec, evaluator, submit, rows,
                            xla_kernels, priced)
    for gi, graph_plan in enumerate(fusion_plan.graphs):
        lowering.graph(gi, graph_plan, views)
    jobs = lowering.finish()
    if store_later is None:
        lowering.reuse.flush()
    else:
        store_later.append(lowering.reuse.flush)
    return jobs


class _JobLowering:
    """``_lower_jobs``' state across the plan's graphs: the jobs, the lowering reuse, and
    the payback groups of kernels equal but for names."""

    def __init__(self, request: PassRequest, report: PassReport, module: HloModule,
                 spec: Any, evaluator: Any, submit: Callable[..., None] | None,
                 rows: SegmentRows | None, xla_kernels: dict | None,
                 priced: dict | None) -> None:
        from stitch.codegen.lowering_reuse import LoweringReuse

        from .code_budget import budget_setting
        from .payback import payback_setting
        self.request, self.report, self.module, self.spec = request, report, module, spec
        self.evaluator, self.submit, self.rows = evaluator, submit, rows
        self.xla_kernels, self.priced = xla_kernels, priced
        self.jobs: list[tuple[ComputationView, Any, Any, Any]] = []
        gpu = request.device == "gpu"
        # How global-scope kernels run: read once per pass (a bad STITCH_GRID_SYNC fails the
        # pass with its ConfigError, not every kernel with a copy of it).
        self.grid_sync_setting = grid_sync_on_gpu() if gpu else "barrier"
        self.budget = budget_setting() if gpu and CODE_BUDGET_ON_GPU else None
        self.payback = payback_setting() if gpu and PAYBACK_ON_GPU else None
        self.reuse = LoweringReuse(enabled=REUSE_LOWERING,
                                   cache=compile_cache() if REUSE_LOWERING else None)
        # Payback by kernel structure: kernels equal but for names are built once
        # (GpuPrebuild), so a repeated layer's kernel repays one build with all its copies'
        # savings. Structures built so far; structures waiting for enough copies to pay.
        self.built_keys: set[str] = set()
        self.waiting: dict[str, list[tuple[tuple, float, Any]]] = {}
        # The cost model slower_as_built prices with: made once per graph, when needed.
        self.priced_here: Any = None

    # --- the jobs --------------------------------------------------------------------------
    def lower_once(self, graph: Any, members: frozenset, choices: Any, name: str,
                   lower: Callable[[], Any]) -> Any:
        """A kernel lowered outside the tuner's schedules (chains, attention backwards),
        once per distinct site: identical layers bind the first one's lowering."""
        from stitch.codegen.lower import kernel_identifier
        return self.reuse.lower(graph, members, choices, kernel_identifier(name), lower)

    def structure_of(self, kernel: Any) -> str:
        return self.reuse.structure(kernel)

    def add(self, job: tuple, key: str | None = None) -> None:
        from stitch.codegen.errors import CodegenError
        kernel = job[3].kernel
        try:
            # Checked only now: a kernel the code budget or payback drops is never built.
            # Validity does not depend on names: checked once per lowering.
            self.reuse.checked(kernel)
        except CodegenError as exc:
            log.info("kernel %s stays with XLA: %s", job[1].name, exc)
            self.report.fallbacks.append((job[1].name, f"{type(exc).__name__}: {exc}"))
            return
        self.jobs.append(job)
        if self.submit is not None:
            self.submit(kernel, key if key is not None else self.structure_of(kernel))

    def leave(self, left: Any) -> None:
        log.info("kernel %s: %s", left.name, left.reason(self.payback))
        self.report.unpaid.append(left)
        self.report.skipped.append((left.name, left.reason(self.payback)))

    def add_if_paid(self, job: tuple, gain_s: float) -> None:
        from .code_budget import statements
        from .payback import unpaid
        assert self.payback is not None
        kernel = job[3].kernel
        key = self.structure_of(kernel)
        size = self.reuse.derived(kernel, "statements", lambda: statements(kernel))
        group = self.waiting.get(key, [])
        total = gain_s + sum(g for _, g, _ in group)
        if key in self.built_keys or unpaid(job[1].name, total, size, self.payback) is None:
            for earlier, _, _ in self.waiting.pop(key, []):
                self.add(earlier, key)
            self.built_keys.add(key)
            self.add(job, key)
            return
        alone = unpaid(job[1].name, gain_s, size, self.payback)
        assert alone is not None            # the group's total did not repay it either
        self.waiting.setdefault(key, []).append((job, gain_s, alone))

    def finish(self) -> list:
        for group in self.waiting.values():
            for _, _, left in group:
                self.leave(left)
        self.report.lowerings = {"kernels_lowered": self.reuse.lowered,
                                 "lowerings_reused": self.reuse.reused,
                                 "lowerings_from_cache": self.reuse.from_disk}
        return self.jobs

    # --- one graph -------------------------------------------------------------------------
    def graph(self, gi: int, graph_plan: Any, views: dict) -> None:
        """The graph's kernels: those placed outside the plan first, then the plan's own,
        largest first."""
        from stitch.explorer.planner import holds_own_scatter
        from stitch.pricing.delta import CostModel

        from .code_budget import estimated_statements
        from .payback import modeled_gain_s, unpaid
        request, report, spec = self.request, self.report, self.spec
        if not request.loop_bodies and graph_plan.graph.kind != "entry":
            report.skipped.extend((k.name, "in a loop body or branch: left to XLA on retry")
                                  for k in graph_plan.stitched.kernels if k.schedule)
            return
        try:
            view = views[gi] = ComputationView(self.module, graph_plan.graph)
        except KeyError as exc:
            report.skipped.extend((k.name, f"graph not found: {exc}")
                                  for k in graph_plan.stitched.kernels if k.schedule)
            return
        scheduled = [k for k in graph_plan.stitched.kernels if k.schedule is not None]
        alone: set[str] = set()
        if self.rows is not None and self.rows.fusions:
            extra = _rows_alone(graph_plan.stitched.kernels, view, graph_plan.graph, spec,
                                self.rows, report)
            alone = {k.name for k in extra}
            scheduled += extra
        # A kernel that is one XLA kernel whose scatter stitch generates otherwise (in runs,
        # in column tiles) is not XLA's.
        alone |= {k.name for k in scheduled if holds_own_scatter(graph_plan.graph, k.members)}
        snapped, left_out = snap_kernels(view, scheduled, spec)
        report.skipped.extend(left_out)
        # Memory-intensive kernels only (GEMM-chain kernels are always built): no chain
        # pricing, so a GEMM inside XLA's kernels is priced as the planner's baseline was.
        cost = CostModel(graph_plan.graph, spec, gemm_chains=False) \
            if self.payback is not None else None
        loop_copies = (cost or CostModel(graph_plan.graph, spec, gemm_chains=False)) \
            if request.device == "gpu" and LOOP_COPIES_ON_GPU and \
            graph_plan.graph.kind != "entry" else None
        snapped = self._outside_plan(gi, graph_plan, view, snapped)
        gains = {k.name: modeled_gain_s(graph_plan, k.members, cost) if self.xla_kernels is None
                 else _xla_gain_s(graph_plan, view, frozenset(k.members), cost,
                                  self.xla_kernels)
                 for k in snapped} if self.payback is not None else {}

        def likely_paid(k: Any) -> bool:
            """Whether the kernel's estimated size repays its build alone (its exact size,
            and its copies, are known only once lowered)."""
            gain = gains[k.name]
            size = estimated_statements(k.schedule) if getattr(k.schedule, "parts", None) \
                else 0
            return gain > 0 and unpaid(k.name, gain, size, self.payback) is None

        self.priced_here = None
        order = _largest_first(snapped, likely_paid if self.payback is not None else None,
                               lead=build_threads() if self.submit is not None else 0)
        for k in order:
            self._plan_kernel(gi, graph_plan, view, k, k.name in alone, cost, loop_copies,
                              gains)

    def _outside_plan(self, gi: int, graph_plan: Any, view: ComputationView,
                      snapped: list) -> list:
        """LM head losses, GEMM chains and attention backwards: their jobs added; the
        plan's kernels holding instructions they take dropped (returned without them)."""
        from .attention_backward_jobs import attention_backward_jobs, without_backward_reads
        from .lm_head_placement import lm_head_jobs
        request, report, spec = self.request, self.report, self.spec
        global_allowed = self.grid_sync_setting != "off"
        # LM head + cross-entropy sites first: the XLA instructions they take are not the
        # plan's kernels' any more (stitch.xla_pass.lm_head_placement).
        lm_jobs, lm_taken = lm_head_jobs(request, report, view, gi, graph_plan.graph, spec,
                                         global_allowed)
        snapped = _without_taken(report, view, snapped, lm_taken,
                                 "its XLA instructions go to an LM head loss kernel")
        for job in lm_jobs:
            self.add(job)
            if self.priced is not None:
                self.priced[job[1].name] = job[1].cost
        # The attention backward's kernels before the chains: the forward chains then lose
        # the values only the backward read (attention_backward_jobs).
        chain_jobs = _chain_jobs(request, report, view, gi, graph_plan, snapped,
                                 self.lower_once)
        backward_jobs = attention_backward_jobs(request, report, self.module, view, gi,
                                                graph_plan, snapped, self.jobs + chain_jobs,
                                                LLVM_LOCK, self.lower_once)
        # As with the LM head's sites: a planned kernel holding any instruction a backward
        # replaces is dropped whole, its XLA instructions left to XLA (the backward yielded
        # only where it wins with that kernel's saving counted).
        snapped = _without_taken(report, view, snapped,
                                 {t for job in backward_jobs for t in job[2].tops},
                                 "its XLA instructions go to an attention backward kernel")
        trimmed = without_backward_reads(request, report, chain_jobs, backward_jobs, LLVM_LOCK,
                                         spec, request.device == "gpu" and GPU_CHAIN_TF32,
                                         global_allowed, self.lower_once)
        for job, own_price in [(j, j[1].cost) for j in backward_jobs] + trimmed:
            self.add(job)
            if self.priced is not None and own_price is not None:
                self.priced[job[1].name] = own_price
        return snapped

    # --- one planned kernel ----------------------------------------------------------------
    def _plan_kernel(self, gi: int, graph_plan: Any, view: ComputationView, k: Any,
                     alone: bool, cost: Any, loop_copies: Any, gains: dict) -> None:
        """Place, check, lower and add one of the plan's kernels, or say why it stays XLA's."""
        from stitch.codegen.errors import CodegenError
        from stitch.pricing.delta import CostModel

        from .payback import Unpaid
        report, spec = self.report, self.spec
        try:
            site = find_site(view, gi, k.name, k.members, alone=alone)
        except NotPlaceable as exc:
            report.skipped.append((k.name, str(exc)))
            return
        if loop_copies is not None:
            # A kernel the copies of its loop body make lose is left to XLA.
            loses = loses_with_copies(graph_plan, frozenset(k.members),
                                      carried_copy_bytes(view, site), spec, loop_copies)
            if loses:
                log.info("kernel %s: %s: left to XLA", k.name, loses)
                report.skipped.append((k.name, loses))
                return
        self.request.check_cancelled()
        gain_s = 0.0
        if self.payback is not None:
            # A kernel modeled to save nothing is not even lowered. Any other may still
            # repay its build, alone or with copies of its structure: its size decides.
            gain_s = gains[k.name]
            if gain_s <= 0:
                self.leave(Unpaid(k.name, gain_s * 1e6, 0.0, None))
                return
        try:
            lowered = self._lower_planned(graph_plan, k)
        except (CodegenError, StitchError) as exc:
            log.info("kernel %s stays with XLA: %s", k.name, exc)
            report.fallbacks.append((k.name, f"{type(exc).__name__}: {exc}"))
            return
        if self.request.device == "gpu":
            if self.priced_here is None:
                self.priced_here = cost or CostModel(graph_plan.graph, spec, gemm_chains=False)
            work = self.reuse.busiest(lowered.kernel)
            slower = slower_as_built(graph_plan, frozenset(k.members), lowered, spec,
                                     self.priced_here,
                                     gains.get(k.name) if self.payback is not None else None,
                                     work=work)
            if slower is not None:
                log.info("kernel %s: %s", k.name, slower)
                report.skipped.append((k.name, slower))
                report.thread_bound.append(k.name)
                return
        if self.payback is not None:
            self.add_if_paid((view, k, site, lowered), gain_s)
        else:
            self.add((view, k, site, lowered))

    def _lower_planned(self, graph_plan: Any, k: Any) -> Any:
        """The planned kernel's Kernel IR: at block scope where its global-scope launch form
        is off, within the code budget, relaunched per phase where the form says so."""
        from stitch.codegen import kir
        from stitch.codegen.lower import kernel_identifier, lower_kernel
        from stitch.schedule.global_scope import launch_form

        from .code_budget import lower_within_budget
        schedule = k.schedule
        grid_sync = launch_form(schedule, self.grid_sync_setting) \
            if _global_scope(schedule) else None
        if _global_scope(schedule) and grid_sync is None:
            schedule = _block_scope_schedule(graph_plan.graph, k.members, self.spec)
        graph, members = graph_plan.graph, frozenset(k.members)
        layouts = xla_layouts(graph, k.members)

        def lower(schedule: Any) -> Any:
            def fresh() -> Any:
                with LLVM_LOCK:
                    # in_place: the rewrite makes an atomic scatter's output alias its
                    # operand (output_to_operand_aliasing, PlacedKernel.initial).
                    # layouts: buffers are read and written in XLA's layouts.
                    return lower_kernel(graph, self.evaluator, schedule, k.name,
                                        in_place=True, validate=False,    # add() validates
                                        layouts=layouts)
            return self.reuse.lower(graph, members, schedule, kernel_identifier(k.name),
                                    fresh, layouts=layouts, in_place=True)

        if self.budget is not None:
            lowered, narrowed = lower_within_budget(graph, schedule, self.spec, k.name, lower,
                                                    self.budget)
            if narrowed is not None:
                self.report.narrowed.append(narrowed)
        else:
            lowered = lower(schedule)
        if grid_sync == "relaunch" and kir.has_grid_barrier(lowered.kernel):
            relaunched = dataclasses.replace(lowered.kernel, grid_sync="relaunch")
            self.reuse.alias(relaunched, lowered.kernel, "relaunch")
            lowered = dataclasses.replace(lowered, kernel=relaunched)
        return lowered


def _without_taken(report: PassReport, view: ComputationView, snapped: list,
                   taken: set[str], why: str) -> list:
    """``snapped`` without the kernels holding any XLA instruction in ``taken`` (each
    reported with ``why``)."""
    if not taken:
        return snapped
    report.skipped.extend((k.name, why) for k in snapped
                          if taken & {view.top_of(m) for m in k.members})
    return [k for k in snapped if not taken & {view.top_of(m) for m in k.members}]


def slower_as_built(graph_plan: Any, members: frozenset[int], lowered: Any, spec: Any,
                    cost: Any, gain_s: float | None = None,
                    work: Any = None) -> str | None:
    """Why the ``lowered`` kernel of the planned kernel of ``members`` is left to XLA, or
    None: its busiest thread alone (``codegen.thread_work``,
    ``cost.latency.thread_bound_seconds``) runs longer than ``cost`` (the delta cost model)
    priced the kernel, by more than the saving that price promised (``gain_s``: the
    payback's modeled saving per step, else priced here; ``work``: the kernel's busiest
    thread where the caller has it).

    Where it happens: a warp/block part whose row layout lowering cannot prove is lowered
    with thread composition (``LoweredKernel.notes``) at the planned launch shape, and a
    thread then recomputes every row statistic it reads, rows times over for a column
    reduction, while the price is the warp/block schedule's."""
    from stitch.codegen.thread_work import busiest_thread
    from stitch.cost.latency import thread_bound_seconds

    from .payback import modeled_gain_s
    work = busiest_thread(lowered.kernel) if work is None else work
    bound = thread_bound_seconds(spec, work.loads, work.ops)
    priced = cost.kernel(members).total_s
    if bound <= priced:
        return None
    if gain_s is None:
        gain_s = modeled_gain_s(graph_plan, members, cost)
    weight = graph_plan.stitched.weight
    if gain_s - (bound - priced) * weight > 0:
        return None
    why = next((n for n in getattr(lowered, "notes", ()) if "thread composition" in n), None)
    return (f"as built, its busiest thread (block {work.block}, thread {work.thread}) "
            f"executes {work.loads:,.0f} loads and {work.ops:,.0f} instructions: about "
            f"{bound * 1e6:.1f} µs, not the {priced * 1e6:.2f} µs the plan priced it at, "
            f"which loses the {gain_s * 1e6:.2f} µs it was to save: left to XLA"
            + (f" ({why})" if why else ""))


def _largest_first(kernels: list, likely_paid: Callable[[Any], bool] | None = None,
                   lead: int = 0) -> list:
    """``kernels`` in the order to lower them: the largest first (estimated Kernel IR
    statements), so that on the GPU the longest PTX builds start first and the small ones
    fill the end of the build instead of a large one trailing it alone. The rewrite puts
    the kernels back in plan order (``_place_kernels``).

    ``lead``: that many of the largest kernels ``likely_paid`` says will be built go first.
    At tiny sizes the largest kernels are often the ones payback then leaves to XLA: lowered
    first, they kept the PTX children idle for the pass's first 0.17 s (transformer_train
    tiny: three of them before the first build). The rest stays largest first, so a kernel
    the rough estimate misjudges is still lowered in its place."""
    from .code_budget import estimated_statements
    ordered = sorted(kernels, key=lambda k: -estimated_statements(k.schedule)
                     if getattr(k.schedule, "parts", None) else 0)
    if likely_paid is None or lead <= 0:
        return ordered
    first = [k for k in ordered if likely_paid(k)][:lead]
    taken = {id(k) for k in first}
    return first + [k for k in ordered if id(k) not in taken]


@contextlib.contextmanager
def _in_background(work: list, name: str) -> Iterator[None]:
    """Run the callables of ``work`` in a thread while the block runs; on leaving, wait for
    them (an exception of theirs is raised then, unless the block raised its own)."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            for job in work:
                job()
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join()
    if failed:
        raise failed[0]


def _place_kernels(request: PassRequest, report: PassReport, fusion_plan: Any,
                   module: HloModule, spec: Any, evaluator: Any, placed: list,
                   views: dict, built: dict, launching: dict, ptx_workers: list,
                   rows: SegmentRows | None = None, xla_kernels: dict | None = None,
                   priced: dict | None = None) -> None:
    """Snap, lower and build every stitched kernel of the plan; what builds is appended to
    ``placed``/``built``, what does not to the report's skipped kernels and fallbacks.
    Lowering runs in plan order; on the GPU each lowered kernel's PTX and ptxas start at
    once, in parallel with the lowering of the next (``GpuPrebuild``); the FFI targets are
    made and registered in order, each as soon as its kernel's PTX is there."""
    from stitch.codegen.errors import CodegenError

    def place(job: tuple, ptx: Any) -> None:
        view, k, site, lowered = job
        try:
            if isinstance(ptx, Exception):
                raise ptx
            with LLVM_LOCK:
                ffi_target = build_target(lowered.kernel, request.device,
                                          arch=request.gpu_arch(),
                                          compile_only=request.compile_only,
                                          worker=ptx_workers[0] if ptx_workers else None,
                                          ptx=ptx.ptx if ptx is not None else None,
                                          assembled=ptx.assembled if ptx is not None
                                          else None, cancelled=request.cancel)
        except Cancelled:
            raise
        except (CodegenError, StitchError) as exc:
            log.info("kernel %s stays with XLA: %s", k.name, exc)
            report.fallbacks.append((k.name, f"{type(exc).__name__}: {exc}"))
            return
        placed.append(PlacedKernel(site, list(lowered.inputs), list(lowered.outputs),
                                   ffi_target.name, dict(lowered.initial),
                                   dict(getattr(lowered, "layouts", {}) or {})))
        built[k.name] = BuiltKernel(k.name, lowered, ffi_target)
        launching[k.name] = sum(1 for t in site.tops if view.launches(t))

    start = time.perf_counter()
    targets_s = 0.0
    if request.device == "gpu":
        with GpuPrebuild(request, ptx_workers) as prebuild:
            store_later: list = []
            jobs = _lower_jobs(request, report, fusion_plan, module, spec, evaluator, views,
                               prebuild.submit, rows, xla_kernels, priced, store_later)
            report.timings["lower_s"] = time.perf_counter() - start
            mark = time.perf_counter()
            # The lowerings are stored while the PTX builds run (the pass waits for them
            # anyway), and are complete when the pass returns.
            with _in_background(store_later, "stitch-store-lowerings"):
                # Each kernel's target is made as soon as its PTX is there, while later
                # kernels' PTX and ptxas still run.
                for job, ptx in zip(jobs, prebuild.each_result()):
                    request.check_cancelled()
                    begun = time.perf_counter()
                    place(job, ptx)
                    targets_s += time.perf_counter() - begun
        # The PTX and ptxas left to wait for once every kernel was lowered.
        report.timings["ptx_s"] = time.perf_counter() - mark - targets_s
    else:
        jobs = _lower_jobs(request, report, fusion_plan, module, spec, evaluator, views, None,
                           rows, xla_kernels, priced)
        report.timings["lower_s"] = time.perf_counter() - start
        begun = time.perf_counter()
        for job in jobs:
            request.check_cancelled()    # per kernel: an exit waits for one build at most
            place(job, None)
        targets_s = time.perf_counter() - begun
    report.timings["targets_s"] = targets_s
    # Lowered largest first (_largest_first): the rewrite places them in plan order.
    plan_order = {k.name: i for i, k in enumerate(fusion_plan.kernels)}
    # Attention-backward kernels (not planned) go in first: the forward chain placed after
    # them no longer writes what they replaced the readers of.
    backward = {name for name, b in built.items() if b.lowered.schemes == ["attention_backward"]}
    placed.sort(key=lambda p: -1 if p.site.name in backward else
                plan_order.get(p.site.name, len(plan_order)))
