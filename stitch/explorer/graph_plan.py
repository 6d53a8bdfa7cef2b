"""Fusion plans: kernels per op graph in launch order, their costs, checks and summaries.

A plan covers each op graph of a module (ENTRY, loop bodies, branches) with kernels. A
kernel is a set of op ids; kernels may overlap (recomputation: the BLP planner and XLA's own
fusions duplicate cheap producers). Free ops (bitcasts, tuple plumbing, sources) need no
kernel. Control flow (while/conditional) is a kernel of its own that launches nothing: its
body and condition are graphs of their own, weighted by the loop's trip count.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from stitch.hlo.graph import OpGraph
from stitch.hlo.op_classes import OpClass

from ..pricing.delta import CostModel, KernelCost
from ..errors import StitchError
from .patterns import CONTROL_OPCODES, is_plannable

if TYPE_CHECKING:
    from ..cost.occupancy import Occupancy
    from ..cost.gemm_tile import GemmChainSchedule
    from ..schedule.kernel_schedule import KernelSchedule

log = logging.getLogger(__name__)


class PlanValidationError(StitchError):
    """A plan does not cover its graph, misses an output, or has no valid launch order."""


@dataclass
class PlannedKernel:
    members: tuple[int, ...]        # node ids, ascending
    kind: str                       # "fused" | "gemm" | "gemm_chain" | "opaque" | "control"
    cost: KernelCost
    # Where the kernel came from: "dp" / "remote" / "trimmed" (explorer patterns), "merged"
    # (refinement), "packing", "baseline" (an XLA or base-fusion group), "single", "blp".
    origin: str = ""
    name: str = ""
    ops: tuple[str, ...] = ()       # instruction names, filled when the plan is named
    # The stitching schedule (stitched kernels of the final plan); why there is none.
    schedule: "KernelSchedule | None" = None
    schedule_note: str = ""
    # A "gemm_chain" kernel's schedule (stitch.cost.gemm_tile.GemmChainSchedule).
    chain_schedule: "GemmChainSchedule | None" = None

    @property
    def schemes(self) -> list[str]:
        return self.schedule.schemes if self.schedule else []

    @property
    def grid(self) -> int | None:
        return self.schedule.grid if self.schedule else None

    @property
    def block(self) -> int | None:
        return self.schedule.block if self.schedule else None

    @property
    def smem_bytes(self) -> int | None:
        return self.schedule.smem_bytes if self.schedule else None

    @property
    def regs_estimate(self) -> int | None:
        return self.schedule.regs_estimate if self.schedule else None

    @property
    def occupancy(self) -> "Occupancy | None":
        return self.schedule.occupancy if self.schedule else None

    @property
    def modeled_us(self) -> float:
        """The latency-evaluator's time for a scheduled kernel, else the kernel time model's
        (GEMM/conv, opaque ops, XLA's own kept fusions)."""
        return self.schedule.modeled_us if self.schedule else self.cost.total_s * 1e6

    @property
    def is_memory(self) -> bool:
        """Memory-intensive launches (``memory_intensive``)."""
        return memory_intensive(self.kind, self.cost)


@dataclass
class GraphPlan:
    graph: OpGraph
    kernels: list[PlannedKernel]    # launch order
    weight: int = 1                 # executions per module run (loop trip counts)

    @property
    def objective_s(self) -> float:
        return sum(k.cost.total_s for k in self.kernels)

    def ops(self, kernel: PlannedKernel) -> list[str]:
        return [self.graph.nodes[v].name for v in kernel.members]


def memory_intensive(kind: str, cost: KernelCost) -> bool:
    """Whether a kernel of ``kind`` costing ``cost`` is a memory-intensive launch: everything
    but GEMM/conv (and control, which launches nothing)."""
    return kind in ("fused", "opaque") and cost.launches > 0


def kernel_kind(graph: OpGraph, members: tuple[int, ...]) -> str:
    if len(members) > 1 and sum(graph.nodes[v].op_class is OpClass.COMPUTE
                                for v in members) == 2:
        from ..pricing.chain_pricing import chain_for
        if chain_for(graph, members) is not None:
            return "gemm_chain"
    if len(members) == 1:
        node = graph.nodes[members[0]]
        if node.opcode in CONTROL_OPCODES:
            return "control"
        if node.op_class is OpClass.COMPUTE:
            return "gemm"
        if node.op_class is OpClass.OPAQUE:
            return "opaque"
    return "fused"


def needs_kernel(graph: OpGraph, nid: int) -> bool:
    """Ops a plan must compute: everything except sources and free aliases (control flow
    included: it is placed in the launch order)."""
    node = graph.nodes[nid]
    return node.opcode in CONTROL_OPCODES or not graph.is_free(nid)


@dataclass
class NodeFacts:
    """Per-op answers that never change for a graph, asked for every op of every candidate
    plan (validation scans all ops per plan): ``needs_kernel``, whether the op alone
    is a kernel boundary (``kernel_kind`` of it alone is not "fused") and
    ``patterns.is_plannable``; ``io``: member sets' written and needed values
    (``kernel_io``), shared by every plan of the graph."""
    size: int
    needs: list[bool]
    boundary: list[bool]
    plannable: list[bool]
    io: "KernelIO"


_FACTS: "weakref.WeakKeyDictionary[OpGraph, NodeFacts]" = weakref.WeakKeyDictionary()


def node_facts(graph: OpGraph) -> NodeFacts:
    """The graph's ``NodeFacts``, built once (graphs are not changed once built)."""
    got = _FACTS.get(graph)
    if got is None or got.size != len(graph.nodes):
        ids = range(len(graph.nodes))
        got = _FACTS[graph] = NodeFacts(
            len(graph.nodes), [needs_kernel(graph, v) for v in ids],
            [kernel_kind(graph, (v,)) != "fused" for v in ids],
            [is_plannable(graph, v) for v in ids], {})
    return got


def make_kernel(graph: OpGraph, cost: CostModel, members, origin: str) -> PlannedKernel:
    members = tuple(sorted(members))
    return PlannedKernel(members, kernel_kind(graph, members), cost.kernel(members), origin)


def resolve_aliases(graph: OpGraph, starts, within: set[int] | None = None) -> set[int]:
    """The ops needing a kernel that ``starts`` stand for: each start itself, or, for a free
    alias (bitcast, tuple plumbing), what it aliases, walking back through operands (only
    those in ``within`` when given). Sources resolve to nothing."""
    found: set[int] = set()
    stack = list(starts)
    seen: set[int] = set()
    needs = node_facts(graph).needs
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if needs[v]:
            found.add(v)
        else:
            stack.extend(o for o in graph.nodes[v].operands if within is None or o in within)
    return found


def kernel_writes(graph: OpGraph, members: set[int]) -> set[int]:
    """The values a kernel writes: members used outside it or leaving the graph. A free
    alias member (a bitcast of a member) stands for the member it aliases, so what is
    recorded as written is always an op that needs a kernel."""
    outputs = graph.output_set()
    used_outside = [m for m in members
                    if m in outputs or any(u not in members for u in graph.nodes[m].users)]
    return resolve_aliases(graph, used_outside, within=members)


def producers_needed(graph: OpGraph, members: set[int]) -> set[int]:
    """Ops outside ``members`` whose results the kernel reads, seen through free aliases."""
    return resolve_aliases(graph, (o for m in members for o in graph.nodes[m].operands
                                   if o not in members))


KernelIO = dict[frozenset[int], tuple[set[int], set[int]]]


def launch_order(graph: OpGraph, kernels: list[PlannedKernel], io: "KernelIO | None" = None
                 ) -> list[PlannedKernel]:
    """Kernels reordered so every kernel runs after the kernels producing its inputs (for
    each needed value, the first kernel that writes it). Raises PlanValidationError on a
    cycle. ``io``: as ``launch_indices``'s."""
    order = launch_indices(graph, [frozenset(k.members) for k in kernels], io)
    return [kernels[i] for i in order]


def kernel_io(graph: OpGraph, members: frozenset[int], io: KernelIO) -> tuple[set[int], set[int]]:
    """(``kernel_writes``, ``producers_needed``) of a member set, cached in ``io``."""
    got = io.get(members)
    if got is None:
        got = io[members] = (kernel_writes(graph, set(members)),
                             producers_needed(graph, set(members)))
    return got


def launch_indices(graph: OpGraph, groups: list[frozenset[int]],
                   io: KernelIO | None = None) -> list[int]:
    """``launch_order`` on member sets, as indices: round by round, every kernel whose
    inputs are available, in plan order. ``io`` caches each set's (written, needed) values
    across calls (refinement orders the plan again after every move, one kernel changed).
    Raises PlanValidationError on a value no kernel writes or on a cycle."""
    io = {} if io is None else io
    written_by: list[set[int]] = []
    needs: list[set[int]] = []
    for g in groups:
        got = kernel_io(graph, g, io)
        written_by.append(got[0])
        needs.append(got[1])
    writers: set[int] = set().union(*written_by) if written_by else set()
    readers: dict[int, list[int]] = {}
    for index, need in enumerate(needs):
        for v in need:
            if v not in writers:
                raise PlanValidationError(
                    f"graph {graph.name}: kernel {index} reads {graph.nodes[v].name}, "
                    "which no kernel writes")
            readers.setdefault(v, []).append(index)
    # Kahn's algorithm in rounds (a kernel made ready in a round launches in the next,
    # rounds in plan order): the order the round-by-round rescan gave, in linear time.
    missing = [len(need) for need in needs]
    ready = [i for i, m in enumerate(missing) if m == 0]
    available: set[int] = set()
    order: list[int] = []
    while ready:
        ready.sort()
        order.extend(ready)
        following: list[int] = []
        for i in ready:
            for v in written_by[i]:
                if v in available:
                    continue
                available.add(v)
                for j in readers.get(v, ()):
                    missing[j] -= 1
                    if missing[j] == 0:
                        following.append(j)
        ready = following
    if len(order) < len(groups):
        launched = set(order)
        pending = [i for i in range(len(groups)) if i not in launched]
        names = ", ".join(graph.nodes[min(groups[i])].name for i in pending[:5])
        raise PlanValidationError(
            f"graph {graph.name}: kernels form a cycle (stuck at {names}...)")
    return order


def validate(graph: OpGraph, kernels: list[PlannedKernel], io: KernelIO | None = None
             ) -> None:
    """Prove a plan: every op computed, outputs produced, kernels convex, boundaries alone,
    and the given order a valid launch order. Raises PlanValidationError. ``io``: each
    set's written and needed values, shared with ``launch_order`` (the same answers)."""
    io = {} if io is None else io
    facts = node_facts(graph)
    alone_a_boundary = facts.boundary
    covered: set[int] = set()
    for k in kernels:
        members = set(k.members)
        covered |= members
        if len(members) > 1:
            boundary = [v for v in members if alone_a_boundary[v]]
            # XLA's own fusions may hold a scatter or a GEMM epilogue: kept whole, they run
            # as XLA compiled them.
            if boundary and k.origin != "baseline" and k.kind != "gemm_chain":
                raise PlanValidationError(
                    f"graph {graph.name}: kernel with {graph.nodes[boundary[0]].name} "
                    "fuses a GEMM/conv, opaque or control op with other ops")
            if not graph.is_convex(members):
                raise PlanValidationError(
                    f"graph {graph.name}: kernel starting at "
                    f"{graph.nodes[min(members)].name} is not convex (fusing it is a cycle)")
    missing = [v for v, need in enumerate(facts.needs) if need and v not in covered]
    if missing:
        raise PlanValidationError(
            f"graph {graph.name}: {len(missing)} ops are in no kernel, e.g. "
            f"{graph.nodes[missing[0]].name}")
    available: set[int] = set()
    for index, k in enumerate(kernels):
        writes, needs = kernel_io(graph, frozenset(k.members), io)
        for v in needs:
            if v not in available:
                raise PlanValidationError(
                    f"graph {graph.name}: kernel {index} ({graph.nodes[k.members[0]].name}...) "
                    f"runs before {graph.nodes[v].name} is written")
        available |= writes
    for o in graph.outputs:
        if facts.needs[o] and o not in available:
            raise PlanValidationError(f"graph {graph.name}: output "
                                      f"{graph.nodes[o].name} is never written")


@dataclass
class SideSummary:
    kernels: int = 0           # static kernel count (each planned launch once)
    mem_kernels: int = 0       # of those, not GEMM/conv
    launches: int = 0          # per module execution (loop trip counts)
    hbm_bytes: int = 0         # per module execution
    mem_hbm_bytes: int = 0     # of memory-intensive kernels
    modeled_us: float = 0.0    # per module execution
    mem_modeled_us: float = 0.0

    def add(self, plan: GraphPlan) -> None:
        for k in plan.kernels:
            if k.cost.launches == 0:
                continue
            self.kernels += 1
            self.launches += plan.weight
            self.hbm_bytes += k.cost.hbm_bytes * plan.weight
            self.modeled_us += k.cost.total_s * 1e6 * plan.weight
            if k.is_memory:
                self.mem_kernels += 1
                self.mem_hbm_bytes += k.cost.hbm_bytes * plan.weight
                self.mem_modeled_us += k.cost.total_s * 1e6 * plan.weight

    def as_dict(self) -> dict:
        return {"kernels": self.kernels, "mem_kernels": self.mem_kernels,
                "launches": self.launches, "hbm_bytes": self.hbm_bytes,
                "mem_hbm_bytes": self.mem_hbm_bytes,
                "modeled_us": round(self.modeled_us, 3),
                "mem_modeled_us": round(self.mem_modeled_us, 3)}


@dataclass
class PlannerReport:
    planner: str
    objective_s: float
    seconds: float
    status: str = "ok"
    gap: float | None = None
    detail: dict = field(default_factory=dict)
