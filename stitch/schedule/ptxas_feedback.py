"""ptxas feedback: a built kernel's schedule re-evaluated with the registers ptxas allocated.

The tuner picks a schedule with a liveness estimate of its registers (tuner._registers);
occupancy and the latency-evaluator depend on it. Once a kernel is built, ``ptxas -v`` gives
the real count. For every kernel:

1. ``scale`` = ptxas's registers / the model's estimate for the schedule as built (at scale
   1, so a schedule tuned with a wrong estimate is judged by the model, not by that error);
2. the built schedule is re-evaluated at ``scale`` (pinned: same choices) and the whole
   space tuned again at ``scale``: every candidate's estimate is multiplied by the same
   ratio (the error of one schedule of a kernel is the best guess for its siblings; the
   built schedule itself gets exactly ptxas's count);
3. if the re-tuned winner is another schedule, faster by more than the tuner's 1% tie, the
   kernel is rebuilt with it: at most once (the rebuilt kernel's own ptxas count is
   reported, not fed back again).

``revise`` does steps 1-2 for one kernel (the bench uses it on PTX alone);
``apply_to_executable`` is the compiler's hook (``compile(..., ptxas_feedback=True)``): it
assembles every kernel, revises, rebuilds what changed and returns the new Executable.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stitch.hlo_passes.graph import OpGraph

from ..cost.gpu_specs import GpuSpec, get_spec
from .kernel_schedule import KernelSchedule
from .tuner import TIE, ScheduleError, schedule_kernel, schedule_signature

if TYPE_CHECKING:  # the compiler imports this module lazily: no import cycle at run time
    from stitch.hlo_passes.evaluator.interpreter import Evaluator
    from stitch.codegen.cache import CompileCache
    from ..compiler import Executable

log = logging.getLogger(__name__)


@dataclass
class Revision:
    """One kernel's schedule judged again with ptxas's register count."""
    kernel: str
    graph_index: int
    estimate: int               # the model's registers for the schedule as built
    measured: int               # ptxas's
    spills: int                 # spill bytes (stores + loads) ptxas reported
    before_us: float            # the built schedule at the measured count
    after_us: float             # the re-tuned winner at the corrected counts
    before: tuple[str, ...]     # schemes and block size, as built
    after: tuple[str, ...]      # the winner's
    changed: bool               # another schedule wins by more than the tie
    schedule: KernelSchedule | None = None   # the winner, when changed
    rebuilt: bool = False       # the compiler rebuilt the kernel with it
    rebuilt_registers: int = 0  # ptxas's count for the rebuilt kernel (0: not assembled)
    note: str = ""              # why nothing was revised (no schedule, a tuner error)

    @property
    def scale(self) -> float:
        return self.measured / max(self.estimate, 1)


def _describe(schedule: KernelSchedule) -> tuple[str, ...]:
    return (*schedule.schemes, f"tpb={schedule.block}",
            "vw=" + "/".join(str(p.vector_width) for p in schedule.parts))


def revise(graph: OpGraph, schedule: KernelSchedule, spec: GpuSpec, measured: int, *,
           kernel: str = "", graph_index: int = 0, spills: int = 0) -> Revision:
    """Re-evaluate ``schedule`` (a built kernel of ``graph``) with ptxas's ``measured``
    registers and re-tune its kernel at the same correction (module docstring)."""
    members = schedule.members
    base = Revision(kernel, graph_index, schedule.regs_estimate, measured, spills,
                    schedule.modeled_us, schedule.modeled_us, _describe(schedule),
                    _describe(schedule), False)
    try:
        as_modeled = schedule_kernel(graph, members, spec, pin=schedule)
    except ScheduleError as exc:      # not a schedule this tuner makes: nothing to compare
        base.note = str(exc)[:300]
        return base
    base.estimate = as_modeled.regs_estimate
    scale = measured / max(as_modeled.regs_estimate, 1)
    try:
        current_us = schedule_kernel(graph, members, spec, register_scale=scale,
                                     pin=schedule).modeled_us
    except ScheduleError:             # the built schedule cannot launch at ptxas's count
        current_us = math.inf
    base.before_us = base.after_us = current_us
    try:
        best = schedule_kernel(graph, members, spec, register_scale=scale)
    except ScheduleError as exc:      # nothing launches at the corrected counts
        base.note = str(exc)[:300]
        return base
    base.changed = (schedule_signature(best) != schedule_signature(schedule)
                    and best.modeled_us < current_us * (1 - TIE))
    if base.changed:
        base.schedule, base.after_us, base.after = best, best.modeled_us, _describe(best)
    return base


def apply_to_executable(exe: "Executable", evaluator: "Evaluator",
                        store: "CompileCache | None") -> "Executable":
    """Assemble every kernel of ``exe`` for its target, revise each schedule with ptxas's
    registers, rebuild the kernels another schedule now wins (once each) and return the
    Executable with them; ``.ptxas_feedback`` lists a Revision per kernel."""
    from ..compiler import CompiledKernel, Executable, Fallback, _build_kernel

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


def _assemble_rebuilt(old: "Executable", new: "Executable", rebuilt: list,
                      revisions: list[Revision]) -> None:
    """PTX and ptxas for the rebuilt kernels only (the others keep their first PTX), so
    ``new.ptx`` is complete and each rebuilt kernel's Revision has its own count."""
    from stitch.codegen.gpu_cache import assemble_cached, emit_ptx_cached

    fresh = {id(ck) for ck in rebuilt}
    ptx = {ck.name: old.ptx[ck.name] for ck in new.kernels if id(ck) not in fresh}
    by_name = {r.kernel: r for r in revisions if r.rebuilt}
    for ck in rebuilt:
        ptx[ck.name] = emit_ptx_cached(ck.kernel, new.arch, cache=new.cache).ptx
        report = assemble_cached(ptx[ck.name], new.arch, cache=new.cache,
                                 kernel_name=ck.name).reports[ck.name]
        by_name[ck.name].rebuilt_registers = report.registers
    new._ptx = ptx


__all__ = ["Revision", "apply_to_executable", "revise"]
