"""Stitching schedules for a planned graph: every stitched kernel tuned (``schedule_plan``),
cached by member set and shared between kernels of the same structure (a repeated layer's
kernels are tuned once, ``SharedSchedules``)."""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Collection, Hashable

from stitch.hlo.graph import OpGraph

from ..analysis.buildable import build_problem
from ..cost.gpu_specs import GpuSpec
from ..cost.launch_forms import allows_global
from ..pricing.chain_pricing import chain_for, chain_price
from ..pricing.structure import StructureKeys
from ..schedule.kernel_schedule import KernelSchedule
from ..schedule.tuner import ScheduleError, schedule_kernel
from .graph_plan import GraphPlan, node_facts

log = logging.getLogger(__name__)

ScheduleCache = dict[frozenset[int], KernelSchedule | str]
# A member set's structure key (``StructureKeys.key``; None: no key).
StructureKey = Callable[[frozenset[int]], Hashable | None]

# A kernel whose member set has the structure key (``structure.StructureKeys``) of one tuned
# before gets that schedule with its node ids renumbered, not a tuning of its own: a repeated
# layer's kernels are tuned once.
SHARE_SCHEDULES = True

# Schedule fields holding node ids (KernelSchedule, PartSchedule, GroupSchedule,
# SharedBuffer, GlobalReduction).
_SCHEDULE_ID_FIELDS = frozenset({"members", "root", "node", "cached"})


# Per schedule dataclass: its init fields, each with whether it holds node ids (found once
# per class: a repeated layer renumbers hundreds of schedules).
_INIT_FIELDS: dict[type, tuple[tuple[str, bool], ...]] = {}
_PLAIN = frozenset({int, float, str, bool, type(None)})


def _renumbered(value, ids: dict[int, int], is_id: bool = False):
    """A schedule (or part of one) with its node ids mapped by ``ids``."""
    if is_id:
        if isinstance(value, int) and not isinstance(value, bool):
            return ids[value]
        if isinstance(value, (tuple, list, frozenset, set)):
            return type(value)(ids[v] for v in value)
    cls = type(value)
    if cls in _PLAIN:
        return value
    fields = _INIT_FIELDS.get(cls)
    if fields is None and dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = _INIT_FIELDS[cls] = tuple(
            (f.name, f.name in _SCHEDULE_ID_FIELDS) for f in dataclasses.fields(value)
            if f.init)
    if fields is not None:
        # ``dataclasses.replace`` with every init field given: the class called on them.
        return cls(**{name: _renumbered(getattr(value, name), ids, holds_ids)
                      for name, holds_ids in fields})
    if isinstance(value, list):
        return [_renumbered(v, ids) for v in value]
    if isinstance(value, tuple):
        return tuple(_renumbered(v, ids) for v in value)
    return value


class SharedSchedules:
    """Tuned schedules by structure key within one graph (``SHARE_SCHEDULES``)."""

    def __init__(self, graph: OpGraph, keys: StructureKey | None = None):
        # ``keys``: the planning cost model's (``CostModel.full_structure_key``), which
        # scored the plan's kernels and knows most of their keys; else keys of our own.
        self.key = keys or StructureKeys(graph).key
        self.first: dict = {}          # key -> (the tuned set's members sorted, schedule)
        self.shared = 0

    def get(self, members: frozenset[int]) -> KernelSchedule | None:
        key = self.key(members)
        if key is None or key not in self.first:
            return None
        tuned, schedule = self.first[key]
        self.shared += 1
        return _renumbered(schedule, dict(zip(tuned, sorted(members))))

    def put(self, members: frozenset[int], schedule: KernelSchedule | str) -> None:
        if isinstance(schedule, str):
            return                          # a reason names the set's own nodes
        key = self.key(members)
        if key is not None:
            self.first.setdefault(key, (tuple(sorted(members)), schedule))


def tuned_schedule(graph: OpGraph, spec: GpuSpec, members: frozenset[int], cache: ScheduleCache,
           grid_sync: str = "barrier", shared: SharedSchedules | None = None
           ) -> KernelSchedule | str:
    """The tuned schedule of a kernel, or why it has none (cached by member set; a cache
    serves one ``grid_sync`` setting: under "off" only the block scopes are tried,
    stitch.cost.launch_forms). ``shared``: a same-structure set's schedule, renumbered."""
    got = cache.get(members)
    if got is None and shared is not None:
        got = shared.get(members)
    if got is None:
        force = None if allows_global(grid_sync) else {"scope": "block"}
        try:
            got = schedule_kernel(graph, members, spec, force)
        except ScheduleError as exc:
            got = str(exc)
        if shared is not None:
            shared.put(members, got)
    cache[members] = got
    return got


def schedule_plan(graph: OpGraph, spec: GpuSpec, plan: GraphPlan,
                  cache: ScheduleCache | None = None,
                  poll: Callable[[], None] | None = None, chain_tf32: bool = False,
                  chain_spill_check: bool = False, chain_grid_sync: bool = False,
                  left_to_xla: Collection[frozenset[int]] = (),
                  grid_sync: str = "barrier", keys: StructureKey | None = None) -> None:
    """Attach the tuned stitching schedule to every stitched kernel of ``plan``. GEMM/conv,
    opaque ops, control flow and XLA's kept fusions around opaque ops run as XLA compiles
    them and get none; so does a kernel whose members are one of ``left_to_xla`` (with
    XLA units: a kernel that is one XLA kernel as XLA made it, which the pass leaves to
    XLA, so tuning it is wasted). ``keys``: structure keys to share schedules by
    (``SharedSchedules``)."""
    cache = {} if cache is None else cache
    shared = SharedSchedules(graph, keys) if SHARE_SCHEDULES else None
    for k in plan.kernels:
        if poll is not None:
            poll()
        if left_to_xla and frozenset(k.members) in left_to_xla:
            k.schedule_note = AS_XLA_MADE_IT
            continue
        if k.kind == "gemm_chain":
            chain = chain_for(graph, k.members)
            if chain is not None:
                k.chain_schedule = chain_price(graph, chain, spec, tf32=chain_tf32,
                                               check_spills=chain_spill_check,
                                               grid_sync=chain_grid_sync).schedule
            continue
        if k.kind != "fused" or not k.cost.launches:
            continue
        if kept_as_xla(graph, k.members):
            k.schedule_note = "XLA fusion around an op stitch does not generate; kept as is"
            continue
        got = tuned_schedule(graph, spec, frozenset(k.members), cache, grid_sync, shared)
        if isinstance(got, str):
            k.schedule_note = got
            log.debug("graph %s: %s has no schedule: %s", graph.name, k.name, got)
        else:
            k.schedule = got


# The schedule note of a kernel that is one XLA kernel unchanged (schedule_plan's left_to_xla).
AS_XLA_MADE_IT = "one XLA kernel as XLA made it: left to XLA"


def kept_as_xla(graph: OpGraph, members: Collection[int]) -> bool:
    """Whether a kernel holds an op stitch does not generate — one outside the plannable
    classes, or one codegen refuses (``buildable.build_problem``: a scatter-max with
    colliding updates, say): XLA's fusion around it runs as XLA made it, untuned."""
    plannable = node_facts(graph).plannable
    return not all(plannable[v] for v in members) or \
        any(build_problem(graph, v) for v in members)
