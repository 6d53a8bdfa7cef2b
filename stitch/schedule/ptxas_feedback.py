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

``revise`` does steps 1-2 for one kernel (the bench uses it on PTX alone); the compiler's
``apply_ptxas_feedback`` (``compile(..., ptxas_feedback=True)``) assembles every kernel,
revises, rebuilds what changed and returns the new Executable.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from stitch.hlo.graph import OpGraph

from ..cost.gpu_specs import GpuSpec
from .kernel_schedule import KernelSchedule
from .tuner import TIE, ScheduleError, schedule_kernel, schedule_signature

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


__all__ = ["Revision", "revise"]
