"""Local refinement of a finished plan: recomputation (the move the BLP planner finds and
beam search cannot: patterns there are disjoint), splits at reductions and repacking (a
packed part moved into another kernel).

For a kernel K reading a value u written by another stitched kernel P, the move copies u
and its ancestors inside P into K, so K recomputes u from P's inputs instead of reading it
back from HBM; P then drops whatever nobody needs any more. A move is kept when it lowers
the modeled time of the two kernels, K stays convex and stitchable, and the plan still has
a launch order. Costs are context-free (``CostModel.kernel``), exactly as the BLP prices its
candidates, so the refined plan is comparable with the BLP optimum. Context-free pricing
means a donor that keeps u still pays for writing it, so in practice the kept moves are
those that take a producer chain over entirely (the donor drops it); true duplication would
need plan-aware write accounting (a kernel writes only what another kernel reads).

A split cuts a kernel at its reductions when the parts are faster apart.
"""
from __future__ import annotations

import logging

from stitch.hlo.graph import OpGraph
from stitch.hlo.op_classes import OpClass

from ..pricing.delta import CostModel
from .patterns import MAX_PATTERN_OPS, is_plannable
from .graph_plan import (KernelIO, PlannedKernel, PlanValidationError, kernel_writes, launch_indices,
                   launch_order, make_kernel, needs_kernel)

log = logging.getLogger(__name__)

# A move must save at least this much (seconds) to be kept: rounding noise in the cost
# model must not churn the plan.
MIN_SAVING_S = 1e-9
# Repacking tries every packed part against every kernel: plans with more movable kernels
# than this skip it (bounded candidate set).
REPACK_MAX_KERNELS = 48
REPACK_MAX_PARTS = 12
# Unions priced per repacking pass (bounded candidate set: bert_layer_train's plans would
# price about 2,000, ~1.5 s, for 0.2% of modeled time).
REPACK_MAX_PRICINGS = 300


def _feeders(graph: OpGraph, members: frozenset[int]) -> dict[int, frozenset[int]]:
    """Ops outside ``members`` that need a kernel and whose values the kernel reads, each
    with the free aliases (bitcasts) between it and the kernel."""
    found: dict[int, frozenset[int]] = {}
    for m in members:
        for o in graph.nodes[m].operands:
            if o in members:
                continue
            path: set[int] = set()
            stack = [o]
            while stack:
                v = stack.pop()
                if v in members or v in path:
                    continue
                if needs_kernel(graph, v):
                    found[v] = found.get(v, frozenset()) | frozenset(path)
                    continue
                if not graph.nodes[v].operands:      # a source: memory, not a kernel's value
                    continue
                path.add(v)
                stack.extend(graph.nodes[v].operands)
    return found


def _ancestors_within(graph: OpGraph, start: int, within: frozenset[int],
                      stop: frozenset[int] = frozenset()) -> frozenset[int]:
    """``start`` and its ancestors inside ``within``, not walking past ops in ``stop``."""
    seen = {start}
    stack = [start]
    while stack:
        for o in graph.nodes[stack.pop()].operands:
            if o in within and o not in seen and o not in stop:
                seen.add(o)
                stack.append(o)
    return frozenset(seen)


def _prune(graph: OpGraph, donor: frozenset[int], covered_elsewhere: frozenset[int]
           ) -> frozenset[int]:
    """Drop from ``donor`` the ops another kernel now computes and no remaining member uses."""
    kept = set(donor)
    for v in sorted(donor, reverse=True):            # consumers before producers
        if v in covered_elsewhere and not any(u in kept for u in graph.nodes[v].users):
            kept.discard(v)
    # Free aliases left without a member to alias are dropped too.
    for v in sorted(kept, reverse=True):
        if not needs_kernel(graph, v) and not any(o in kept for o in graph.nodes[v].operands) \
                and not any(u in kept for u in graph.nodes[v].users):
            kept.discard(v)
    return frozenset(kept)


def _stitchable(graph: OpGraph, cost: CostModel, members: frozenset[int]) -> bool:
    if len(members) > MAX_PATTERN_OPS or not all(is_plannable(graph, v) for v in members):
        return False
    if not graph.is_convex(members):
        return False
    return cost.stitchable(members)


class _Refiner:
    """The plan being refined: kernels as member sets (emptied when a move removes one)."""

    def __init__(self, graph: OpGraph, cost: CostModel, kernels: list[PlannedKernel],
                 max_ops: int = MAX_PATTERN_OPS):
        self.graph, self.cost = graph, cost
        self.groups: list[frozenset[int]] = [frozenset(k.members) for k in kernels]
        self.origins = [k.origin for k in kernels]
        # XLA groups holding an opaque op (kept whole), GEMM and control are not touched;
        # nor are kernels over ``max_ops`` (a bound on the work per move, see refine_plan).
        # Written and needed values per member set, for ordering trial plans.
        self.io: KernelIO = {}
        self.movable = [k.kind == "fused" and len(k.members) <= max_ops
                        and all(is_plannable(graph, v) for v in k.members)
                        for k in kernels]

    def time(self, members: frozenset[int]) -> float:
        return self.cost.kernel(members).total_s if members else 0.0

    def kernels(self) -> list[PlannedKernel]:
        return [make_kernel(self.graph, self.cost, g, o)
                for g, o in zip(self.groups, self.origins) if g]

    def try_apply(self, changes: dict[int, frozenset[int]], origin: str) -> bool:
        """Apply ``changes`` (kernel index -> new members; an index past the end adds a
        kernel) when the plan keeps a launch order."""
        trial = list(self.groups)
        for index, members in sorted(changes.items()):
            if index >= len(trial):
                trial.append(members)
            else:
                trial[index] = members
        try:
            launch_indices(self.graph, [g for g in trial if g], self.io)
        except PlanValidationError:
            return False
        for index, members in sorted(changes.items()):
            if index >= len(self.groups):
                self.groups.append(members)
                self.origins.append(origin)
                self.movable.append(True)
            else:
                if members != self.groups[index]:
                    self.origins[index] = origin
                self.groups[index] = members
        return True

    def recompute_moves(self) -> int:
        graph, moves = self.graph, 0
        # op -> the first movable kernel holding it; rebuilt only after a move changes
        # the kernels (rebuilding it per kernel made the pass quadratic).
        owner: dict[int, int] | None = None
        for ki in range(len(self.groups)):
            self.cost.poll()
            if not self.movable[ki] or not self.groups[ki]:
                continue
            if owner is None:
                owner = {}
                for gi, g in enumerate(self.groups):
                    if self.movable[gi]:
                        for v in g:
                            owner.setdefault(v, gi)
            best: tuple[float, int, frozenset[int], frozenset[int]] | None = None
            k_members = self.groups[ki]
            k_time = self.time(k_members)
            for u, aliases in _feeders(graph, k_members).items():
                pi = owner.get(u, -1)
                if pi < 0 or pi == ki:
                    continue
                donor = self.groups[pi]
                before = k_time + self.time(donor)
                # Recompute u from the donor's inputs, or only back to values the donor
                # writes anyway (the kernel then reads those).
                written = frozenset(kernel_writes(graph, set(donor))) - {u}
                for stop in (frozenset(), written):
                    grown = k_members | aliases | _ancestors_within(graph, u, donor, stop)
                    if len(grown) > MAX_PATTERN_OPS:
                        continue
                    shrunk = _prune(graph, donor, grown)
                    saving = before - self.time(grown) - self.time(shrunk)
                    if saving > MIN_SAVING_S and (best is None or saving > best[0]) and \
                            _stitchable(graph, self.cost, grown) and \
                            (not shrunk or graph.is_convex(shrunk)):
                        best = (saving, pi, grown, shrunk)
            if best is not None and self.try_apply({ki: best[2], best[1]: best[3]},
                                                   "recompute"):
                owner = None
                moves += 1
                log.debug("graph %s: recomputation saves %.3f us", graph.name, best[0] * 1e6)
        return moves

    def repack_moves(self) -> int:
        """Move a packed part (a connected component of a kernel packing independent
        parts) into another kernel when the two kernels are faster that way: packing by
        level fills kernels in launch order, and a part that joins a later or earlier
        kernel can balance the two (dien's GRU loop body: 7.9 -> 7.5 us, the BLP's
        packing). Only on plans of at most ``REPACK_MAX_KERNELS`` movable kernels, kernels of
        at most ``REPACK_MAX_PARTS`` parts, and ``REPACK_MAX_PRICINGS`` unions priced per
        pass (every part is tried against every kernel that stays convex with it)."""
        graph, moves = self.graph, 0
        movable = [i for i, g in enumerate(self.groups) if self.movable[i] and g]
        if len(movable) > REPACK_MAX_KERNELS or len(movable) < 2:
            return 0
        budget = REPACK_MAX_PRICINGS
        for ki in movable:
            self.cost.poll()
            members = self.groups[ki]
            if not members or budget <= 0:
                continue
            analysis = self.cost.analysis(members)
            if analysis is None or not 2 <= len(analysis.components) <= REPACK_MAX_PARTS:
                continue
            best: tuple[float, int, frozenset[int], frozenset[int]] | None = None
            k_time = self.time(members)
            for comp in analysis.components:
                part = frozenset(comp)
                if not any(needs_kernel(graph, v) for v in part):
                    continue
                rest = members - part
                # Convexity is cheap (bitmasks); pricing is not: find the kernels that can
                # take the part first.
                targets = [(ti, self.groups[ti] | part) for ti in movable
                           if ti != ki and self.groups[ti]
                           and graph.is_convex(self.groups[ti] | part)]
                if not targets or not graph.is_convex(rest):
                    continue
                rest_time = self.time(rest)
                # A kernel never gets faster by taking a part in, so a move saves at most
                # what the donor saves by losing it (most parts are not its bottleneck).
                if k_time - rest_time <= max(MIN_SAVING_S, best[0] if best else 0.0):
                    continue
                for ti, grown in targets:
                    budget -= 1
                    if budget < 0:
                        break
                    target = self.groups[ti]
                    saving = k_time + self.time(target) - rest_time - self.time(grown)
                    if saving > MIN_SAVING_S and (best is None or saving > best[0]) and \
                            _stitchable(graph, self.cost, grown):
                        best = (saving, ti, grown, rest)
            if best is not None and self.try_apply({best[1]: best[2], ki: best[3]}, "repack"):
                moves += 1
                log.debug("graph %s: repacking saves %.3f us", graph.name, best[0] * 1e6)
        return moves

    def split_moves(self) -> int:
        """Cut a kernel in two at a reduction (the reduction with its producers, and the
        rest) when the parts are faster apart: a reduction shared inside a kernel must be
        finished by one warp or block, which can starve a small reduction of threads."""
        graph, moves = self.graph, 0
        for ki in range(len(self.groups)):
            self.cost.poll()
            members = self.groups[ki]
            if not self.movable[ki] or len(members) < 2:
                continue
            best: tuple[float, list[frozenset[int]]] | None = None
            whole = self.time(members)
            cuts = [reduction_stages(graph, members)]
            for r in members:
                if graph.nodes[r].op_class is not OpClass.REDUCTION:
                    continue
                upstream = _ancestors_within(graph, r, members)
                for first in (upstream, members - (_descendants_within(graph, r, members)
                                                   - {r})):
                    cuts.append([first, members - first])
            for parts in cuts:
                if len(parts) < 2 or not all(any(needs_kernel(graph, v) for v in p)
                                             for p in parts):
                    continue
                saving = whole - sum(self.time(p) for p in parts)
                if saving > MIN_SAVING_S and (best is None or saving > best[0]) and \
                        all(_stitchable(graph, self.cost, p) for p in parts):
                    best = (saving, parts)
            if best is None:
                continue
            n = len(self.groups)
            changes = {ki: best[1][0]}
            changes.update({n + i: p for i, p in enumerate(best[1][1:])})
            if self.try_apply(changes, "split"):
                moves += 1
                log.debug("graph %s: split saves %.3f us", graph.name, best[0] * 1e6)
        return moves


def reduction_stages(graph: OpGraph, members: frozenset[int]) -> list[frozenset[int]]:
    """``members`` cut after every reduction: an op's stage is the largest number of
    reductions on a path to it inside the kernel (a reduction closes its stage). Stages are
    convex when the kernel is: stage numbers never decrease along a path."""
    stage: dict[int, int] = {}
    for v in sorted(members):
        s = 0
        for o in graph.nodes[v].operands:
            if o in members:
                s = max(s, stage[o] + (graph.nodes[o].op_class is OpClass.REDUCTION))
        stage[v] = s
    parts: dict[int, set[int]] = {}
    for v, s in stage.items():
        parts.setdefault(s, set()).add(v)
    return [frozenset(parts[s]) for s in sorted(parts)]


def _descendants_within(graph: OpGraph, start: int, within: frozenset[int]) -> frozenset[int]:
    seen = {start}
    stack = [start]
    while stack:
        for u in graph.nodes[stack.pop()].users:
            if u in within and u not in seen:
                seen.add(u)
                stack.append(u)
    return frozenset(seen)


def refine_plan(graph: OpGraph, cost: CostModel, kernels: list[PlannedKernel],
                max_rounds: int = 4, max_ops: int = MAX_PATTERN_OPS
                ) -> tuple[list[PlannedKernel], int]:
    """Apply improving split and recomputation moves until none is left (or
    ``max_rounds``). Returns the kernels in launch order and the number of moves kept.

    Kernels of more than ``max_ops`` ops are neither split nor moved into or out of: every
    move prices the kernels it touches afresh, in time linear in their size, and on large
    graphs packed kernels of hundreds of ops made refinement the costliest phase while its
    moves there saved a few hundredths of a percent."""
    refiner = _Refiner(graph, cost, kernels, max_ops)
    moves = 0
    for _ in range(max_rounds):
        made = refiner.split_moves() + refiner.recompute_moves()
        if not made:
            # Repacking prices every part against every kernel: only once the cheaper
            # moves are done.
            made = refiner.repack_moves()
        moves += made
        if not made:
            break
    return launch_order(graph, refiner.kernels()), moves
