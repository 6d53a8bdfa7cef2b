"""Stitched kernels snapped to XLA's own fusions, so they can replace whole instructions.

The planner works on XLA's flattened ops and may cut one of XLA's fusions between two
stitched kernels (XLA CPU's ``reduce_divide_fusion`` of a softmax: the row sum in one
kernel, the reciprocal in the next). The module rewrite can only replace whole top-level
instructions, so before placing, kernels that share an XLA fusion are merged and widened to
whole fusions; the result must stay convex and get a legal schedule from the tuner (else it
is left to XLA, with the reason). A kernel the planner kept exactly is used as planned.
"""
from __future__ import annotations

from dataclasses import dataclass

from stitch.hlo.op_classes import OpClass

from .hlo_rewrite import ComputationView


@dataclass
class SnappedKernel:
    name: str
    members: frozenset[int]
    schedule: object                  # stitch.schedule.KernelSchedule


def snap_kernels(view: ComputationView, kernels: list, spec: object
                 ) -> tuple[list[SnappedKernel], list[tuple[str, str]]]:
    """(kernels made of whole XLA instructions, (kernel name, reason) for those left out).
    ``kernels`` are the graph's scheduled stitched PlannedKernels."""
    graph = view.graph
    skipped: list[tuple[str, str]] = []
    tops_of: dict[str, set[str]] = {}
    for k in kernels:
        tops = {view.top_of(m) for m in k.members
                if graph.nodes[m].op_class is not OpClass.SOURCE}
        if None in tops:
            skipped.append((k.name, "holds ops inlined from a called computation"))
            continue
        tops_of[k.name] = tops                         # type: ignore[assignment]
    by_name = {k.name: k for k in kernels}
    groups = _merge_sharing(tops_of)
    snapped: list[SnappedKernel] = []
    for names in groups:
        label = names[0] if len(names) == 1 else f"{names[0]}_and_{len(names) - 1}"
        tops = set().union(*(tops_of[n] for n in names))
        got, why = _widen(view, spec, label, tops, names, by_name)
        if got is None and len(names) == 1:
            got = _narrow(view, spec, label, tops, names[0], by_name)
        if got is not None:
            snapped.append(got)
            continue
        if len(names) == 1:
            skipped.append((label, why))
            continue
        # The merged kernel does not work (two row partitions...): each kernel in turn
        # takes the XLA instructions it touches that no earlier one took.
        claimed: set[str] = set()
        for name in names:
            own = tops_of[name] - claimed
            got, why = _widen(view, spec, name, own, [name], by_name) if own else (None, "")
            if got is None and own:
                got = _narrow(view, spec, name, own, name, by_name)
            if got is None:
                skipped.append((name, why or "its XLA instructions went to another kernel"))
                continue
            claimed |= own
            snapped.append(got)
    return snapped, skipped


def _widen(view: ComputationView, spec: object, label: str, tops: set[str], names: list[str],
           by_name: dict) -> tuple[SnappedKernel | None, str]:
    """The kernel made of the whole instructions ``tops``, scheduled; or (None, why)."""
    from stitch.schedule.tuner import ScheduleError, schedule_kernel

    graph = view.graph
    ops = set().union(*(view.group_ops.get(t, set()) for t in tops))
    if any(graph.nodes[m].op_class in (OpClass.COMPUTE, OpClass.OPAQUE) for m in ops):
        return None, "widened to XLA's fusions it would hold a GEMM or an opaque op"
    sources = {m for n in names for m in by_name[n].members
               if graph.nodes[m].op_class is OpClass.SOURCE}
    members = frozenset(ops | sources)
    if len(names) == 1 and members == frozenset(by_name[names[0]].members):
        return SnappedKernel(label, members, by_name[names[0]].schedule), ""
    if not graph.is_convex(ops):
        return None, "widened to XLA's fusions it is not convex"
    try:
        schedule = schedule_kernel(graph, members, spec)
    except ScheduleError as exc:
        return None, f"widened to XLA's fusions it has no schedule: {exc}"
    return SnappedKernel(label, members, schedule), ""


def _narrow(view: ComputationView, spec: object, label: str, tops: set[str], name: str,
            by_name: dict) -> SnappedKernel | None:
    """Where widening fails: the kernel cut down to the XLA instructions of ``tops`` that it
    holds whole (the ops of the ones it holds in part stay with XLA), scheduled; None when
    that is not a different, convex, schedulable kernel of two or more instructions."""
    from stitch.schedule.tuner import ScheduleError, schedule_kernel

    graph = view.graph
    members = frozenset(by_name[name].members)
    whole = {t for t in tops if view.group_ops.get(t, set()) <= members}
    if len(whole) < 2 or whole == tops:
        return None
    ops = set().union(*(view.group_ops.get(t, set()) for t in whole))
    if not graph.is_convex(ops):
        return None
    sources = {m for m in members if graph.nodes[m].op_class is OpClass.SOURCE}
    try:
        schedule = schedule_kernel(graph, frozenset(ops | sources), spec)
    except ScheduleError:
        return None
    return SnappedKernel(label, frozenset(ops | sources), schedule)


def _merge_sharing(tops_of: dict[str, set[str]]) -> list[list[str]]:
    """Kernel names grouped so that kernels sharing a top-level instruction are together
    (union-find), in the planner's order."""
    parent = {n: n for n in tops_of}

    def find(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n
    owner: dict[str, str] = {}
    for name, tops in tops_of.items():
        for t in tops:
            if t in owner:
                parent[find(name)] = find(owner[t])
            else:
                owner[t] = name
    groups: dict[str, list[str]] = {}
    for name in tops_of:
        groups.setdefault(find(name), []).append(name)
    return list(groups.values())
