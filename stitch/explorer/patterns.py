"""PatternReduction (FusionStitching §5.2): candidate patterns per vertex by approximate DP,
and remote fusion through a virtual producer of all vertices.

Vertices are visited in post-order (consumers first). The candidates of vertex v are
patterns whose producer is v: v alone, or v joined with one candidate pattern of each of
some of its consumers. Enumerating every combination is exponential in the number of
consumers, so consumers are split in halves recursively (divide and conquer): a group of at
most ``group_size`` consumers enumerates its combinations, and two halves are combined by
pairing their top-k lists. Each step keeps the top k patterns by the delta-evaluator's f;
every kept pattern is convex (fusing it creates no cycle) and accepted by the feasibility
predicate. The work per vertex is O(deg * k^2) pattern evaluations.

Remote fusion adds a virtual vertex h whose consumers are all vertices (in topological
order) and runs the same reduction on it; since h itself is not an op, its patterns are
unions of candidate patterns of different vertices — patterns sharing producers, and
non-adjacent patterns that become one kernel by packing. Every intermediate result of that
reduction is kept as a candidate too.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Iterable

from stitch.hlo.graph import OpGraph
from stitch.hlo.op_classes import OpClass

from ..pricing.delta import CostModel
from ..analysis.feasibility import Infeasible

log = logging.getLogger(__name__)

PLANNABLE_CLASSES = (OpClass.LIGHT, OpClass.EXPENSIVE, OpClass.REDUCTION, OpClass.LAYOUT)
CONTROL_OPCODES = frozenset({"while", "conditional"})
# Ops per stitched kernel. Kernels this large already strain registers and compile time;
# the cap also keeps high fan-out vertices (a broadcast constant used by every layer) from
# producing graph-wide unions whose checks would cost O(V) each.
MAX_PATTERN_OPS = 256
MAX_JOINED_NEIGHBOURS = 16


@dataclass(frozen=True)
class Pattern:
    members: frozenset[int]
    gain: float            # f: modeled seconds saved against running each op alone
    origin: str = "dp"     # "dp" | "remote" | "baseline" | "packing"

    @cached_property
    def first(self) -> int:
        # Asked for every pattern at each chain's offer points: min once per pattern.
        return min(self.members)


@dataclass
class ExplorerStats:
    evaluations: int = 0
    rejected_cycle: int = 0
    rejected_infeasible: int = 0
    # Evaluations that reached the feasibility verdict and kernel cost (the rest were
    # rejected by size or convexity), and those of them an earlier pattern of the same
    # structure answered (a repeated layer's): scored - reused is the scoring work the
    # distinct structure costs.
    scored: int = 0
    reused: int = 0
    seconds: float = 0.0


@dataclass
class Candidates:
    per_vertex: dict[int, list[Pattern]]
    remote: list[Pattern]
    # (producer, consumer) -> why no kept pattern of the producer includes the consumer.
    reasons: dict[tuple[int, int], str] = field(default_factory=dict)
    stats: ExplorerStats = field(default_factory=ExplorerStats)

    def all_patterns(self) -> list[Pattern]:
        seen: dict[frozenset[int], Pattern] = {}
        for pats in self.per_vertex.values():
            for p in pats:
                seen.setdefault(p.members, p)
        for p in self.remote:
            seen.setdefault(p.members, p)
        return list(seen.values())


@dataclass
class Vertices:
    """What PatternReduction walks: the graph's ops, or (``unit_vertices``) units of ops
    that stay together — XLA's instructions, a fusion whole. Vertex v holds ``members[v]``;
    ``order`` is topological; ``users``/``operands`` are the neighbouring vertices;
    ``op[v]`` is the op that names v (in reasons and pattern order)."""
    members: list[frozenset[int]]
    users: list[list[int]]
    operands: list[list[int]]
    order: list[int]
    plannable: list[bool]
    op: list[int]


def op_vertices(graph: OpGraph) -> Vertices:
    """Every op its own vertex (vertex id = op id)."""
    return Vertices([frozenset((n.id,)) for n in graph.nodes],
                    [list(n.users) for n in graph.nodes],
                    [list(dict.fromkeys(n.operands)) for n in graph.nodes],
                    graph.topological_order(),
                    [is_plannable(graph, n.id) for n in graph.nodes],
                    [n.id for n in graph.nodes])


def unit_vertices(graph: OpGraph, units: Iterable[Iterable[int]]) -> Vertices | None:
    """Each unit (a set of op ids) one vertex; ops in no unit are no vertex (boundaries).
    A unit is plannable when all its ops are. None when the units' quotient graph has a
    cycle (units that are not instructions of one computation)."""
    members = [frozenset(u) for u in units if u]
    owner: dict[int, int] = {}
    for i, m in enumerate(members):
        for v in m:
            owner[v] = i
    users: list[list[int]] = []
    operands: list[list[int]] = [[] for _ in members]
    for i, m in enumerate(members):
        out = dict.fromkeys(owner[u] for v in sorted(m) for u in graph.nodes[v].users
                            if u in owner and owner[u] != i)
        users.append(list(out))
        for j in out:
            operands[j].append(i)
    # Kahn's order over the units, the unit with the first op first among the ready ones.
    first = [min(m) for m in members]
    waiting = [len(ops) for ops in operands]
    ready = [(first[i], i) for i in range(len(members)) if waiting[i] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        _, i = heapq.heappop(ready)
        order.append(i)
        for j in users[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(ready, (first[j], j))
    if len(order) != len(members):
        return None
    return Vertices(members, users, operands, order,
                    [all(is_plannable(graph, v) for v in m) for m in members],
                    [min((v for v in m if not is_plannable(graph, v)), default=min(m))
                     for m in members])


def is_plannable(graph: OpGraph, nid: int) -> bool:
    """Ops a stitched kernel may contain: memory-intensive ones and free aliases."""
    node = graph.nodes[nid]
    return node.op_class in PLANNABLE_CLASSES and node.opcode not in CONTROL_OPCODES


class PatternExplorer:
    def __init__(self, graph: OpGraph, cost: CostModel, top_k: int = 3, group_size: int = 2,
                 remote_fusion: bool = True,
                 check: Callable[[OpGraph, Iterable[int]], object] | None = None,
                 max_pattern_ops: int = MAX_PATTERN_OPS, vertices: Vertices | None = None):
        if top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {top_k}")
        if group_size < 1:
            raise ValueError(f"group_size must be at least 1, got {group_size}")
        self.graph = graph
        self.cost = cost
        self.top_k = top_k
        self.group_size = group_size
        self.remote_fusion = remote_fusion
        self.check = check
        self.max_pattern_ops = max_pattern_ops
        # Ops by default; units (unit_vertices) make every pattern a union of whole units.
        self.vertices = vertices or op_vertices(graph)
        self.stats = ExplorerStats()
        self.reasons: dict[tuple[int, int], str] = {}
        self._valid: dict[frozenset[int], Pattern | str] = {}

    # --- evaluation --------------------------------------------------------------------
    def evaluate(self, members: frozenset[int], origin: str = "dp") -> Pattern | str:
        """A scored pattern, or the reason it is rejected (cached)."""
        hit = self._valid.get(members)
        if hit is not None:
            return hit
        self.stats.evaluations += 1
        result: Pattern | str
        if len(members) > self.max_pattern_ops:
            result = (f"pattern of {len(members)} ops exceeds the limit of "
                      f"{self.max_pattern_ops} ops per kernel")
        elif len(members) > 1 and not self.graph.is_convex(members):
            self.stats.rejected_cycle += 1
            result = "fusing would create a cycle (a path leaves the pattern and re-enters)"
        elif self.check is not None:
            try:
                analysis = self.check(self.graph, members)
            except Infeasible as exc:
                analysis = str(exc)
            if isinstance(analysis, str):
                self.stats.rejected_infeasible += 1
                result = f"not stitchable: {analysis}"
            else:
                result = Pattern(members, self.cost.gain(members, analysis), origin)
        else:
            # The default check is the cost model's feasibility verdict, which (like the
            # kernel times) a set of the same structure answered before answers again.
            self.stats.scored += 1
            fresh = self.cost.fresh
            reason = self.cost.verdict(members)
            if reason is not None:
                self.stats.rejected_infeasible += 1
                result = f"not stitchable: {reason}"
            else:
                result = Pattern(members, self.cost.gain(members), origin)
            if self.cost.fresh == fresh:
                self.stats.reused += 1
        self._valid[members] = result
        return result

    def _top(self, patterns: Iterable[Pattern]) -> list[Pattern]:
        unique: dict[frozenset[int], Pattern] = {}
        for p in patterns:
            unique.setdefault(p.members, p)
        return _ranked(unique.values(), self.top_k)

    # --- PatternReduction --------------------------------------------------------------
    def explore(self) -> Candidates:
        start = time.perf_counter()
        graph = self.graph
        vx = self.vertices
        down = self._propagate(consumers_first=True)
        up = self._propagate(consumers_first=False)
        per_vertex: dict[int, list[Pattern]] = {
            v: self._top(down.get(v, []) + up.get(v, []))
            for v in set(down) | set(up)}
        remote: list[Pattern] = []
        if self.remote_fusion:
            order = [v for v in vx.order if v in per_vertex]
            pool: list[Pattern] = []
            self._reduce(frozenset(), [per_vertex[v] for v in order], order, origin="remote",
                         pool=pool)
            singles = {p.members for pats in per_vertex.values() for p in pats}
            remote = [p for p in self._top_all(pool) if p.members not in singles]
        per_vertex = {v: self._top(down.get(v, [])) + self._top(up.get(v, []))
                      for v in per_vertex}
        self.stats.seconds = time.perf_counter() - start
        log.debug("explored %s: %d vertices, %d evaluations, %d remote patterns in %.3f s",
                  graph.name, len(per_vertex), self.stats.evaluations, len(remote),
                  self.stats.seconds)
        return Candidates(per_vertex, remote, self.reasons, self.stats)

    def _propagate(self, consumers_first: bool) -> dict[int, list[Pattern]]:
        """PatternReduction over the graph. ``consumers_first`` is the paper's direction:
        post-order, each vertex joined with its consumers' patterns (the vertex is the
        pattern's producer). The mirror image (producers first, each vertex joined with its
        producers' patterns) finds what XLA's consumer-rooted fusion finds: a reduction with
        every elementwise chain feeding it, which no single producer reaches."""
        graph = self.graph
        vx = self.vertices
        found: dict[int, list[Pattern]] = {}
        for v in (reversed(vx.order) if consumers_first else vx.order):
            self.cost.poll()
            if not vx.plannable[v]:
                continue
            neighbours = vx.users[v] if consumers_first else vx.operands[v]
            joined = [u for u in neighbours if u in found]
            if len(joined) > MAX_JOINED_NEIGHBOURS:
                # A broadcast constant read by every layer: joining all its consumers can
                # only give graph-wide unions (non-convex across the layers' GEMMs), each
                # costing O(V) to reject. Join its first neighbours only.
                joined = joined[:MAX_JOINED_NEIGHBOURS]
            if consumers_first:
                for u in neighbours:
                    if u not in found:
                        self.reasons.setdefault((vx.op[v], vx.op[u]),
                                                _boundary_reason(graph, vx.op[u]))
            kept = self._reduce(vx.members[v], [found[u] for u in joined], joined,
                                origin="dp", consumers_first=consumers_first)
            found[v] = kept
            if consumers_first:
                for u in joined:
                    if not any(vx.op[u] in p.members for p in kept):
                        self.reasons.setdefault(
                            (vx.op[v], vx.op[u]),
                            "kept patterns of the producer score higher without it")
        return found

    def _reduce(self, base: frozenset[int], lists: list[list[Pattern]], consumers: list[int],
                origin: str, pool: list[Pattern] | None = None,
                consumers_first: bool = True) -> list[Pattern]:
        """Top-k patterns made of ``base`` plus at most one pattern from each list."""
        if len(lists) <= self.group_size:
            results: list[Pattern] = []
            for combo in itertools.product(*[[None] + lst for lst in lists]):
                members = base.union(*(p.members for p in combo if p is not None))
                if not members:
                    continue
                got = self.evaluate(members, origin)
                if isinstance(got, Pattern):
                    results.append(got)
                else:
                    for p, u in zip(combo, consumers):
                        if p is not None and base:
                            u = self.vertices.op[u]
                            pair = (min(base), u) if consumers_first else (u, min(base))
                            self.reasons.setdefault(pair, got)
            top = self._top(results)
        else:
            mid = len(lists) // 2
            left = self._reduce(base, lists[:mid], consumers[:mid], origin, pool,
                                consumers_first)
            right = self._reduce(base, lists[mid:], consumers[mid:], origin, pool,
                                 consumers_first)
            results = list(left) + list(right)
            for a, b in itertools.product(left, right):
                members = a.members | b.members
                got = self.evaluate(members, origin)
                if isinstance(got, Pattern):
                    results.append(got)
            top = self._top(results)
        if pool is not None:
            pool.extend(top)
        return top

    @staticmethod
    def _top_all(pool: list[Pattern]) -> list[Pattern]:
        unique: dict[frozenset[int], Pattern] = {}
        for p in pool:
            if len(p.members) > 1 and p.gain > 0:
                unique.setdefault(p.members, p)
        return list(unique.values())


def _ranked(patterns: Iterable[Pattern], k: int) -> list[Pattern]:
    """The k best patterns by gain; ties broken by size then by members, so results do
    not depend on set order. The members are sorted only for patterns tied on gain and
    size (sorting every pattern's members for its key dominated this on large graphs)."""
    ranked = sorted(patterns, key=lambda p: (-p.gain, -len(p.members)))
    out: list[Pattern] = []
    i = 0
    while i < len(ranked) and len(out) < k:
        j = i + 1
        head = ranked[i]
        while j < len(ranked) and ranked[j].gain == head.gain and \
                len(ranked[j].members) == len(head.members):
            j += 1
        tied = ranked[i:j]
        if len(tied) > 1:
            tied.sort(key=lambda p: sorted(p.members))
        out.extend(tied)
        i = j
    return out[:k]


def _boundary_reason(graph: OpGraph, consumer: int) -> str:
    node = graph.nodes[consumer]
    if node.opcode in CONTROL_OPCODES:
        return f"consumer {node.name} is control flow ({node.opcode}): a kernel boundary"
    if node.op_class is OpClass.COMPUTE:
        return f"consumer {node.name} is a GEMM/convolution: a kernel boundary"
    return f"consumer {node.name} ({node.opcode}) is opaque: a kernel boundary"
