"""Plan selection by beam search (FusionStitching §5.3), and kernel packing of a plan.

Beam search keeps ``width`` partial plans ("buffer sets"). It visits vertices from producers
to consumers; at each vertex every buffer may take one of the candidate patterns whose first
op is that vertex, when the pattern overlaps nothing the buffer already holds and keeps the
kernel graph acyclic. The ``width`` buffers with the highest accumulated f survive.

A GEMM chain pattern (origin ``gemm_chain``) is offered at its first op and also where the
first pattern competing for its ops starts (the causal mask's iotas, XLA's mask kernel): offered
only at its own first op, a buffer that took the competitor earlier can no longer take it, so
the two were never compared. The look-ahead's per-op shares come from the other patterns:
a chain is weighed against what its ops could gain without it.

Packing merges kernels of a finished plan that no path connects (remote fusion's kernel
packing): kernels on the same level of the kernel DAG (longest path from the inputs) are
independent, so each level's stitchable kernels can become one launch without a cycle.
"""
from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass
from typing import Callable, Iterable

from stitch.hlo.graph import OpGraph

from ..pricing.delta import CostModel
from .kernel_reach import KernelMasks, KernelReach
from .patterns import MAX_PATTERN_OPS, Pattern

log = logging.getLogger(__name__)

# Above this many kernels, merge_adjacent scores the pairs a merge creates lazily.
LAZY_MERGE_KERNELS = 200
# Pattern.origin of a GEMM chain's pattern (stitch.explorer.planner.chain_patterns).
CHAIN_ORIGIN = "gemm_chain"


@dataclass
class Buffer:
    patterns: tuple[Pattern, ...]
    covered: int                  # bitmask of covered op ids
    gain: float
    owner: "Owners | None"        # op id -> index into patterns
    reach: int = -1               # the last op of any held pattern
    masks: tuple[KernelMasks, ...] = ()   # per held pattern (when the graph keeps them)
    # The union of ``masks``' units, kept as patterns are added (None: not kept).
    held_units: int | None = None

    def key(self) -> int:
        return self.covered

    def holds(self, nid: int) -> bool:
        """Is op ``nid`` covered? (A lookup: shifting ``covered``, an n-bit number, costs
        O(n) per question, quadratic over a deep graph's vertices.)"""
        return self.owner is not None and self.owner.get(nid) >= 0


class Owners:
    """op id -> pattern index, shared between buffers: a frozen base map plus the few
    entries added since, flattened once they grow (extending a buffer stays cheap)."""

    FLATTEN_AT = 512

    def __init__(self, base: dict[int, int] | None = None, delta: dict[int, int] | None = None):
        self.base = base or {}
        self.delta = delta or {}

    def get(self, nid: int) -> int:
        k = self.delta.get(nid)
        return self.base.get(nid, -1) if k is None else k

    def extended(self, members, index: int) -> "Owners":
        delta = dict(self.delta)
        for m in members:
            delta[m] = index
        if len(delta) > self.FLATTEN_AT:
            return Owners({**self.base, **delta}, {})
        return Owners(self.base, delta)


class KernelCycleError(ValueError):
    """Internal: a set of kernels whose launch order does not exist (a candidate to drop)."""


def _mask(members) -> int:
    m = 0
    for v in members:
        m |= 1 << v
    return m


def creates_cycle(graph: OpGraph, buffer: Buffer, pattern: Pattern,
                  fast: KernelReach | None = None) -> bool:
    """Would adding ``pattern`` to the buffer's kernels close a cycle? A search forward from
    the pattern's outside users, jumping across kernels (reaching one member of a kernel
    reaches all its users). Nodes past the bound B* can never lead back: B* starts at the
    pattern's last op and grows to the last op of every kernel starting at or before it.
    ``fast`` (the buffer's ``masks`` filled) first tries to prove there is none with
    reachability bitmasks: with patterns spanning forward and backward the search covers
    most of the graph, and nearly every answer is no."""
    members = pattern.members
    if fast is not None and fast.surely_acyclic(buffer.masks, members, buffer.held_units):
        return False
    # The furthest op any held pattern reaches bounds the fixed point (a chain offered
    # early may start after this one; a larger bound only searches more): an op past it
    # is in no kernel, and edges only go to larger ids.
    bound = max(max(members), buffer.reach)
    owner = buffer.owner
    pats = buffer.patterns
    stack = [u for m in members for u in graph.nodes[m].users if u not in members]
    seen: set[int] = set()
    seen_kernels: set[int] = set()
    while stack:
        n = stack.pop()
        if n in seen or n > bound:
            continue
        seen.add(n)
        k = owner.get(n) if owner is not None else -1
        frontier = [n]
        if k >= 0 and k not in seen_kernels:
            seen_kernels.add(k)
            frontier = list(pats[k].members)
            seen.update(frontier)
        for x in frontier:
            for u in graph.nodes[x].users:
                if u in members:
                    return True
                if u not in seen and u <= bound:
                    stack.append(u)
    return False


def offer_points(pattern: Pattern, first_holding: dict[int, int]) -> tuple[int, ...]:
    """The vertices at which the beam offers ``pattern``: its first op; a GEMM chain also
    at the first op of the earliest pattern that shares ops with it (module docstring).
    ``first_holding``: ``chain_op_holders`` of the patterns offered."""
    if pattern.origin != CHAIN_ORIGIN:
        return (pattern.first,)
    earliest = min(pattern.first, min(first_holding[m] for m in pattern.members))
    return (pattern.first,) if earliest == pattern.first else (earliest, pattern.first)


def chain_op_holders(patterns: list[Pattern]) -> dict[int, int]:
    """Per op of a GEMM chain's pattern: the first op of the earliest pattern holding it
    (the chains' offer points, found in one pass: a pass over every pattern per chain grew
    with the square of the layers)."""
    chain_ops = frozenset().union(*(p.members for p in patterns if p.origin == CHAIN_ORIGIN))
    first: dict[int, int] = {}
    for q in patterns:
        for m in q.members & chain_ops:
            if first.get(m, q.first + 1) > q.first:
                first[m] = q.first
    return first


def beam_search(graph: OpGraph, patterns: list[Pattern], width: int = 3,
                trim: Callable[[frozenset[int]], Pattern | None] | None = None,
                lookahead: bool = True, poll: Callable[[], None] | None = None
                ) -> list[Buffer]:
    """The ``width`` best sets of disjoint patterns, best first. ``trim`` scores what is
    left of a pattern that overlaps a buffer's earlier picks (None when that is no pattern:
    not convex or not stitchable).

    Buffers are ranked by accumulated f plus an optimistic estimate of what the ops not yet
    decided can still gain (each op's best share, gain per op, over the patterns holding
    it). Accumulated f alone favours a pattern that starts early and swallows ops a better
    pattern further on would have used; the estimate charges each pick for the ops it takes.
    """
    if width < 1:
        raise ValueError(f"beam width must be at least 1, got {width}")
    n = len(graph.nodes)
    share = [0.0] * n
    by_first: dict[int, list[Pattern]] = {}
    useful = [p for p in patterns if len(p.members) > 1 and p.gain > 0]
    masks = {p.members: _mask(p.members) for p in useful}
    first_holding = chain_op_holders(useful)
    for p in useful:
        for v in offer_points(p, first_holding):
            by_first.setdefault(v, []).append(p)
        if p.origin != CHAIN_ORIGIN:
            per_op = p.gain / len(p.members)
            for m in p.members:
                share[m] = max(share[m], per_op)
    for pats in by_first.values():
        pats.sort(key=lambda p: -p.gain)
    suffix = [0.0] * (n + 1)
    for v in range(n - 1, -1, -1):
        suffix[v] = suffix[v + 1] + share[v]
    # Per buffer (by its index in ``beams``; no two hold the same ops): the shares of the
    # ops it has taken (all / before v). Not keyed by ``covered``: hashing an n-bit mask
    # per buffer and vertex grew with the square of the graph.
    fast = KernelReach.of(graph)
    beams = [Buffer((), 0, 0.0, None, held_units=0)]
    taken: list[float] = [0.0]
    passed: list[float] = [0.0]
    for v in graph.topological_order():
        if poll is not None:
            poll()
        if share[v]:                # adding a zero share changes nothing: not asked
            for bi, buf in enumerate(beams):
                if buf.holds(v):
                    passed[bi] += share[v]
        options = by_first.get(v)
        if not options:
            continue

        def score(bi: int, gain: float, extra_share: float) -> float:
            if not lookahead:
                return gain
            future = suffix[v] - (taken[bi] - passed[bi]) - extra_share
            return gain + future

        proposals: list[tuple[float, float, int, Pattern | None]] = []
        for bi, buf in enumerate(beams):
            proposals.append((score(bi, buf.gain, share[v]), buf.gain, bi, None))
            if buf.holds(v):
                continue
            for p in options:
                cand: Pattern | None = p
                if buf.covered & masks[p.members]:
                    cand = None
                    if trim is not None:
                        # The pattern overlaps earlier picks: offer what is left of it.
                        rest = frozenset(m for m in p.members if not buf.holds(m))
                        cand = trim(rest) if len(rest) > 1 else None
                        if cand is not None and cand.gain <= 0:
                            cand = None
                        if cand is not None:
                            masks.setdefault(cand.members, _mask(cand.members))
                if cand is not None:
                    # A chain offered before its first op leaves v to no kernel here.
                    extra = sum(share[m] for m in cand.members) + \
                        (0.0 if v in cand.members else share[v])
                    proposals.append((score(bi, buf.gain + cand.gain, extra),
                                      buf.gain + cand.gain, bi, cand))
        proposals.sort(key=lambda t: -t[0])
        next_beams: list[Buffer] = []
        next_covered: set[int] = set()
        next_taken: list[float] = []
        next_passed: list[float] = []
        for _, gain, bi, p in proposals:
            if len(next_beams) == width:
                break
            buf = beams[bi]
            if p is None:
                if buf.covered in next_covered:
                    continue
                next_covered.add(buf.covered)
                next_taken.append(taken[bi])
                next_passed.append(passed[bi])
                next_beams.append(buf)
                continue
            covered = buf.covered | masks[p.members]
            if covered in next_covered or creates_cycle(graph, buf, p, fast):
                continue
            owner = (buf.owner or Owners()).extended(p.members, len(buf.patterns))
            next_covered.add(covered)
            next_taken.append(taken[bi] + sum(share[m] for m in p.members))
            next_passed.append(passed[bi] + (share[v] if v in p.members else 0.0))
            added = fast.masks(p.members)[0] if fast is not None else None
            held = buf.masks + (added,) if added is not None else ()
            held_units = buf.held_units | added.units \
                if added is not None and buf.held_units is not None else None
            next_beams.append(Buffer(buf.patterns + (p,), covered, gain, owner,
                                     max(buf.reach, max(p.members)), held, held_units))
        beams, taken, passed = next_beams, next_taken, next_passed
    return sorted(beams, key=lambda b: -b.gain)


def kernel_levels(graph: OpGraph, groups: list[frozenset[int]],
                  weights: list[int] | None = None) -> list[int]:
    """Longest-path level of each group in the DAG of kernels. Ops in no group are units of
    their own with weight 0 (free ops: they pass dependencies on without adding a level),
    groups weigh 1 (or ``weights``), so two groups on one level have no path between them.
    Raises ValueError when the groups form a cycle."""
    n_groups = len(groups)
    n_units = n_groups + len(graph.nodes)
    sets = [set(g) for g in groups]
    outputs = graph.output_set()
    holders: list[list[int]] = [[] for _ in graph.nodes]
    for gi, g in enumerate(groups):
        for v in g:
            holders[v].append(gi)

    # A value held by several groups (a recomputed producer) comes from those that write
    # it (use it outside themselves); an op in no group is a unit of its own. Found once
    # per value (every reader asks).
    found_sources: list[list[int] | None] = [None] * len(graph.nodes)

    def sources(o: int) -> list[int]:
        got = found_sources[o]
        if got is None:
            held = holders[o]
            if not held:
                got = [n_groups + o]
            elif len(held) == 1:
                got = held
            else:
                writing = [h for h in held
                           if any(u not in sets[h] for u in graph.nodes[o].users)
                           or o in outputs]
                got = writing or held
            found_sources[o] = got
        return got

    weight = [1] * n_groups + [0] * len(graph.nodes)
    if weights is not None:
        weight[:n_groups] = weights
    succ: list[set[int]] = [set() for _ in range(n_units)]
    indegree = [0] * n_units
    nodes = graph.nodes
    for gi, g in enumerate(groups):
        inside = sets[gi]
        for m in g:
            for o in nodes[m].operands:
                if o not in inside:
                    for h in sources(o):
                        if h != gi and gi not in succ[h]:
                            succ[h].add(gi)
                            indegree[gi] += 1
    for node in nodes:
        if not holders[node.id]:
            unit = n_groups + node.id
            for o in node.operands:
                for h in sources(o):
                    if h != unit and unit not in succ[h]:
                        succ[h].add(unit)
                        indegree[unit] += 1
    level = [0] * n_units
    ready = [x for x in range(n_units) if indegree[x] == 0]
    seen = 0
    while ready:
        x = ready.pop()
        seen += 1
        for y in succ[x]:
            level[y] = max(level[y], level[x] + weight[x])
            indegree[y] -= 1
            if indegree[y] == 0:
                ready.append(y)
    if seen != n_units:
        raise KernelCycleError(f"graph {graph.name}: the kernels form a cycle")
    return level[:len(groups)]


def pack_levels(graph: OpGraph, cost: CostModel, groups: list[frozenset[int]],
                packable: list[bool], max_ops: int = MAX_PATTERN_OPS
                ) -> list[tuple[frozenset[int], bool]]:
    """Merge packable groups that sit on the same level when the merge saves time.

    Returns (members, merged?) per resulting kernel."""
    levels = kernel_levels(graph, groups)
    by_level: dict[int, list[int]] = {}
    for gi, level in enumerate(levels):
        if packable[gi]:
            by_level.setdefault(level, []).append(gi)
    merged_into: dict[int, frozenset[int]] = {}
    result: list[tuple[frozenset[int], bool]] = []
    for level, members in by_level.items():
        current: frozenset[int] | None = None
        parts = 0
        for gi in sorted(members, key=lambda g: min(groups[g])):
            g = groups[gi]
            if current is None:
                current, parts = g, 1
                continue
            union = current | g
            # Same level means no path between the two in the kernel graph; with recomputed
            # producers the op graph can still leave and re-enter the union (the validator's
            # convexity rule), so that is checked too.
            if len(union) > max_ops or not graph.is_convex(union):
                result.append((current, parts > 1))
                current, parts = g, 1
                continue
            if not cost.stitchable(union, (current, g)):
                result.append((current, parts > 1))
                current, parts = g, 1
                continue
            saved = cost.kernel(current).total_s + cost.kernel(g).total_s - \
                cost.kernel(union).total_s
            if saved > 0:
                current, parts = union, parts + 1
            else:
                result.append((current, parts > 1))
                current, parts = g, 1
        if current is not None:
            result.append((current, parts > 1))
        for gi in members:
            merged_into[gi] = frozenset()
    for gi, g in enumerate(groups):
        if gi not in merged_into:
            result.append((g, False))
    return result


def _hides_a_read_value(graph: OpGraph, kernels: dict[int, frozenset[int]], a: int, b: int,
                        union: frozenset[int]) -> bool:
    """Would the union stop writing a value another kernel reads? A kernel writes the
    members used outside it; when a reader is recomputed in several kernels, taking one
    copy inside hides the value from the other copies (kernel 0 reads rsqrt.26, which no
    kernel writes: fuzz seed 619)."""
    outputs = graph.output_set()
    # Members no longer written: every user is inside the union.
    hidden = [m for m in union if m not in outputs
              and all(u in union for u in graph.nodes[m].users)]
    if not hidden:
        return False
    for k, g in kernels.items():
        # Only a kernel sharing ops with the union can hold a user of a hidden member.
        if k in (a, b) or g.isdisjoint(union):
            continue
        if any(m not in g and any(u in g for u in graph.nodes[m].users) for m in hidden):
            return True
    return False


def _closes_cycle(graph: OpGraph, kernels: dict[int, frozenset[int]], a: int, b: int,
                  union: frozenset[int]) -> bool:
    rest = [g for k, g in kernels.items() if k not in (a, b)]
    try:
        kernel_levels(graph, rest + [union])
    except ValueError:
        return True
    return False


def has_other_path(a: int, b: int, succ: Callable[[int], Iterable[int]],
                   pred: Callable[[int], Iterable[int]]) -> bool:
    """In a DAG given by ``succ`` / ``pred``: is there a path a -> c -> ... -> b with c != b?
    Searched from both ends at once, always growing the smaller frontier: the answer is no
    as soon as either side runs out, and one side is small (a kernel late in the graph
    reaches little, one early is reached by little) where one-sided searches from an early
    kernel covered most of a deep graph."""
    ahead = {c for c in succ(a) if c != b}
    behind = {c for c in pred(b) if c != a}
    if ahead & behind:
        return True
    front_ahead, front_behind = list(ahead), list(behind)
    while front_ahead and front_behind:
        if len(front_ahead) <= len(front_behind):
            nxt = []
            for k in front_ahead:
                for c in succ(k):
                    if c in behind:
                        return True
                    if c not in ahead and c != b and c != a:
                        ahead.add(c)
                        nxt.append(c)
            front_ahead = nxt
        else:
            nxt = []
            for k in front_behind:
                for c in pred(k):
                    if c in ahead:
                        return True
                    if c not in behind and c != a and c != b:
                        behind.add(c)
                        nxt.append(c)
            front_behind = nxt
    return False


class MergeGraph:
    """The kernel graph ``merge_adjacent`` works on: kernels by id, each op's kernel, and
    the kernel-graph edges read through the merges so far. Merged ids point to the merge's
    id (a union-find), so an edge set cached before a merge stays right once resolved."""

    def __init__(self, graph: OpGraph, groups: list[frozenset[int]], mergeable: list[bool]):
        self.graph = graph
        self.kernels: dict[int, frozenset[int]] = dict(enumerate(groups))
        self.ok = dict(enumerate(mergeable))
        self.owner = [-1] * len(graph.nodes)
        for ki, g in self.kernels.items():
            for v in g:
                self.owner[v] = ki
        # Each kernel's first op (asked at every merge tried; a kernel's members never
        # change, a merge makes a new id).
        self.first = {ki: min(g, default=-1) for ki, g in self.kernels.items()}
        self.next_id = len(groups)
        self.merged_into: dict[int, int] = {}
        # Per direction (True: successors): raw edge sets by kernel (ids as they were when
        # first asked), and resolved ones (current ids); a merge drops the resolved sets
        # naming either merged kernel (those of its neighbours), the others stay right.
        self._raw: dict[bool, dict[int, frozenset[int]]] = {True: {}, False: {}}
        self._resolved: dict[bool, dict[int, set[int]]] = {True: {}, False: {}}
        # Whether the kernel graph is a DAG that merges keep one: each op in one kernel at
        # most (a recomputed op's owner is one of its copies, and a merge rewrites it) and
        # no cycle to start with. Then ``other_path`` against an edge is no at once.
        self.stays_acyclic = (sum(len(g) for g in groups) == len(self.owned_ops())
                              and self._acyclic())

    def owned_ops(self) -> set[int]:
        """The ops some kernel holds."""
        return {v for v, k in enumerate(self.owner) if k >= 0}

    def _acyclic(self) -> bool:
        """Kahn's algorithm on the kernel graph (kernels and the ops in none)."""
        owner = self.owner
        unit = [k if k >= 0 else -1 - v for v, k in enumerate(owner)]
        succ: dict[int, set[int]] = {}
        indegree: dict[int, int] = dict.fromkeys(unit, 0)
        for node in self.graph.nodes:
            a = unit[node.id]
            for u in node.users:
                b = unit[u]
                if b != a:
                    out = succ.setdefault(a, set())
                    if b not in out:
                        out.add(b)
                        indegree[b] += 1
        ready = [x for x, d in indegree.items() if d == 0]
        done = 0
        while ready:
            x = ready.pop()
            done += 1
            for y in succ.get(x, ()):
                indegree[y] -= 1
                if indegree[y] == 0:
                    ready.append(y)
        return done == len(indegree)

    def neighbours(self, ki: int) -> set[int]:
        """Mergeable kernels joined to ``ki`` by an edge either way."""
        out: set[int] = set()
        nodes, owner, ok = self.graph.nodes, self.owner, self.ok
        for v in self.kernels[ki]:
            node = nodes[v]
            for w in list(node.users) + node.operands:
                k = owner[w]
                if k >= 0 and k != ki and ok.get(k):
                    out.add(k)
        return out

    def find(self, k: int) -> int:
        merged_into = self.merged_into
        root = k
        while root in merged_into:
            root = merged_into[root]
        while k != root:                      # path compression
            nxt = merged_into[k]
            merged_into[k] = root
            k = nxt
        return root

    def _adjacent(self, k: int, forward: bool) -> set[int]:
        """Kernel-graph successors (``forward``) or predecessors of kernel ``k``; an op in
        no kernel is a unit of its own, id ``-1 - op``."""
        resolved = self._resolved[forward]
        got = resolved.get(k)
        if got is not None:
            return got
        raw_cache = self._raw[forward]
        raw = raw_cache.get(k)
        if raw is None:
            nodes, owner = self.graph.nodes, self.owner
            if forward:
                ends = (u for v in self.kernels[k] for u in nodes[v].users) if k >= 0 \
                    else iter(nodes[-1 - k].users)
            else:
                ends = (o for v in self.kernels[k] for o in nodes[v].operands) if k >= 0 \
                    else iter(nodes[-1 - k].operands)
            raw = raw_cache[k] = frozenset(owner[x] if owner[x] >= 0 else -1 - x
                                           for x in ends)
        find = self.find
        out = {find(x) for x in raw}
        out.discard(k)
        resolved[k] = out
        return out

    def successors(self, k: int) -> set[int]:
        return self._adjacent(k, True)

    def predecessors(self, k: int) -> set[int]:
        return self._adjacent(k, False)

    def other_path(self, a: int, b: int) -> bool:
        """Is b reachable from a other than through a direct edge? No bound by op ids: a
        kernel holding a late op may also hold an early one, so a path can come back down
        (x -> scatter -> y -> a kernel that also reads before b). In a graph that stays
        acyclic, never where b -> a is an edge: the search would walk all a reaches."""
        if self.stays_acyclic and a in self.successors(b):
            return False
        return has_other_path(a, b, self.successors, self.predecessors)

    def merge(self, a: int, b: int, union: frozenset[int]) -> int:
        """Replace kernels ``a`` and ``b`` by ``union``; its id."""
        # The resolved edge sets naming a or b: a's and b's own, and in each direction
        # those of the kernels on the other side (x lists a as a successor exactly when a
        # lists x as a predecessor).
        around = {forward: [x for k in (a, b) for x in self._adjacent(k, forward)]
                  for forward in (True, False)}
        for forward in (True, False):
            resolved = self._resolved[forward]
            for x in around[not forward]:
                resolved.pop(x, None)
            resolved.pop(a, None)
            resolved.pop(b, None)
        new = self.next_id
        self.next_id += 1
        del self.kernels[a], self.kernels[b]
        self.merged_into[a] = self.merged_into[b] = new
        self.kernels[new] = union
        self.first[new] = min(self.first[a], self.first[b])
        self.ok[new] = True
        for v in union:
            self.owner[v] = new
        return new


def merge_adjacent(graph: OpGraph, cost: CostModel, groups: list[frozenset[int]],
                   mergeable: list[bool], max_ops: int = MAX_PATTERN_OPS
                   ) -> list[frozenset[int]]:
    """Greedy refinement of a plan: merge two kernels joined by an edge while the merge saves
    modeled time, best saving first. A merge must be stitchable and must not close a cycle
    (no other path between the two kernels). Beam search decides pattern by pattern in
    graph order; this pass repairs the splits its early decisions leave."""
    plan = MergeGraph(graph, groups, mergeable)
    kernels = plan.kernels
    # With recomputed ops (a producer copied into several kernels) ``owner`` cannot name
    # one kernel per op and the path search may miss a cycle: check merges exactly.
    duplicated = sum(len(g) for g in groups) != len(frozenset().union(*groups)) if groups \
        else False

    def saving(a: int, b: int) -> tuple[float, frozenset[int]] | None:
        union = kernels[a] | kernels[b]
        if len(union) > max_ops:
            return None
        if not cost.stitchable(union, (kernels[a], kernels[b])):
            return None
        s = cost.kernel(kernels[a]).total_s + cost.kernel(kernels[b]).total_s - \
            cost.kernel(union).total_s
        return (s, union) if s > 0 else None

    # Heap entries: (-saving, a, b, exact). With many kernels, the pairs a merge creates
    # enter with the saving their parts had (an estimate) and are scored when they reach
    # the top (lazy greedy): scoring every neighbour of a growing kernel after each merge
    # made merging quadratic in its degree. Small plans score every pair at once.
    lazy = len(groups) > LAZY_MERGE_KERNELS
    known: dict[tuple[int, int], float] = {}
    heap: list[tuple[float, int, int, bool]] = []

    def propose(a: int, partners: Iterable[int], parts: tuple[int, ...] = ()) -> None:
        """Queue the pairs (a, c): scored now, or, for a merge of ``parts`` (lazy), at the
        best saving a part had with c."""
        for c in partners:
            pair = (min(a, c), max(a, c))
            if parts:
                guess = max(known.get((min(p, c), max(p, c)), 0.0) for p in parts)
                if guess > 0:
                    known[pair] = guess
                    heapq.heappush(heap, (-guess, pair[0], pair[1], False))
                    continue
            got = saving(a, c)
            if got:
                known[pair] = got[0]
                heapq.heappush(heap, (-got[0], pair[0], pair[1], True))

    for a in list(kernels):
        if plan.ok[a]:
            propose(a, [b for b in plan.neighbours(a) if a < b])
    while heap:
        cost.poll()
        _, a, b, exact = heapq.heappop(heap)
        if a not in kernels or b not in kernels:
            continue
        if not exact:
            propose(a, (b,))
            continue
        first, second = (a, b) if plan.first[a] <= plan.first[b] else (b, a)
        if plan.other_path(first, second) or plan.other_path(second, first):
            continue
        got = saving(a, b)
        if not got:
            continue
        union = got[1]
        if duplicated and (not graph.is_convex(union)
                           or _hides_a_read_value(graph, kernels, a, b, union)
                           or _closes_cycle(graph, kernels, a, b, union)):
            continue
        merged = plan.merge(a, b, union)
        propose(merged, plan.neighbours(merged), (a, b) if lazy else ())
    return list(kernels.values())
