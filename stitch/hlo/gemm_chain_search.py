"""The search for GEMM pairs a chain may join (``stitch.hlo.gemm_chains``), once per
graph: which GEMMs / opaque ops each node reaches, the second GEMMs each first one may pair
with, the walks between them, each GEMM's description.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass, field

from .gemm_chain_operands import (GemmDot, describe_gemm, finish_result, free_dims,
                                   holdable)
from .gemm_chain_program import NotAChain
from .graph import OpGraph
from .op_classes import OpClass

_BARRIERS = (OpClass.COMPUTE, OpClass.OPAQUE)


@dataclass(frozen=True)
class ChainSearch:
    """What the recognizer asks of one graph for many (first, second) GEMM pairs, computed
    once: which GEMMs / opaque ops ("barriers") each node reaches (``bits[v]`` has bit
    ``position[x]`` set when there is a path v -> ... -> x; one pass over the edges in
    reverse topological order), the walk from each first GEMM's result, each GEMM's
    description. A residual stream links every layer's GEMMs to all later ones, so pairs
    grow with the square of the layers; their work no longer does."""
    position: dict[int, int]
    bits: list[int]
    # The other way: ``above[v]`` has bit ``position[x]`` set when barrier x reaches v.
    above: list[int] = field(default_factory=list)
    holdable: dict[int, bool] = field(default_factory=dict)   # node -> ``holdable``
    # A first GEMM's result node -> its last candidate second GEMM (bounds ``walk``).
    limits: dict[int, int] = field(default_factory=dict)
    # start -> (descendants reached without walking through a barrier, barriers among them)
    walks: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)
    dots: dict[int, object] = field(default_factory=dict)    # node -> GemmDot or its refusal
    # node -> whether ``ChainProgramBuilder.index_value`` surely fails there before it
    # builds anything (``ChainProgramBuilder.fails_clean``); the same for every pair.
    index_failures: dict[int, bool] = field(default_factory=dict)

    @staticmethod
    def of(graph: OpGraph) -> "ChainSearch":
        position = {n.id: i for i, n in enumerate(
            n for n in graph.nodes if n.op_class in _BARRIERS)}
        bits = _barrier_bits(reversed(graph.nodes), "users", position, len(graph.nodes))
        above = _barrier_bits(graph.nodes, "operands", position, len(graph.nodes))
        return ChainSearch(position, bits, above)

    def reaches(self, v: int, barrier: int) -> bool:
        return bool(self.bits[v] >> self.position[barrier] & 1)

    def gemm(self, graph: OpGraph, nid: int) -> "GemmDot":
        """``describe_gemm`` + ``finish_result`` of ``nid`` (its refusal re-raised), once
        per node: a GEMM is a candidate of many pairs. A copy: the recognizer's own."""
        got = self.dots.get(nid)
        if got is None:
            try:
                got = describe_gemm(graph, nid)
                finish_result(graph, got)
            except NotAChain as why:
                got = why
            self.dots[nid] = got
        if isinstance(got, NotAChain):
            raise NotAChain(str(got))
        return dataclasses.replace(got, lb=list(got.lb), lc=list(got.lc), rb=list(got.rb),
                                   rc=list(got.rc),
                                   split=None if got.split is None else list(got.split))

    def second_candidates(self, graph: OpGraph, first: int) -> list[int]:
        """The GEMMs a chain from ``first`` may end at, nearest first: those reached from it
        through values a chain can hold between its GEMMs (``holdable`` ops of tile, row
        or scalar size, and the first GEMM's own result ops) that no GEMM or opaque op met
        on the way reaches (the walk stops at both). Every other pair is refused by
        ``Recognizer.run``; walking through every op instead made the pairs grow with the
        square of the layers."""
        try:
            d1 = self.gemm(graph, first)
            # A value between is a tile (the first result's count), a row or a scalar.
            tile = graph.nodes[d1.result].shape.num_elements
            n = math.prod(d1.rhs_shape.dims[d] for d in free_dims(d1.rhs_shape, d1.rb, d1.rc))
        except (NotAChain, KeyError, ValueError, IndexError, TypeError, ZeroDivisionError):
            # No description: every pair is refused the same way; keep the plain walk.
            return reachable_gemms(graph, first)
        passable = set(d1.extra)
        counts = {tile, 1} | ({tile // n} if n and tile % n == 0 else set())
        found: list[int] = []
        # Barriers the walk meets (bits by ``position``). One that reaches a node sits
        # between the first GEMM and every GEMM past that node (``nodes_between`` refuses
        # the pair): in a residual stream the next layer's GEMM, which reaches all later
        # ones, so the walk stops there. In id order, so such a barrier is met first.
        met = 0
        heap = list(graph.nodes[first].users)
        heapq.heapify(heap)
        seen = set(heap)
        while heap:
            v = heapq.heappop(heap)
            if self.above[v] & met:
                continue
            node = graph.nodes[v]
            if node.op_class in _BARRIERS:
                met |= 1 << self.position[v]
                if node.op_class is OpClass.COMPUTE:
                    found.append(v)
                continue
            if v not in passable and not (self.is_holdable(node)
                                          and node.shape.num_elements in counts):
                continue
            for u in node.users:
                if u not in seen:
                    seen.add(u)
                    heapq.heappush(heap, u)
        if found:
            self.limits[d1.result] = max(self.limits.get(d1.result, -1), found[-1])
        return found

    def is_holdable(self, node) -> bool:
        got = self.holdable.get(node.id)
        if got is None:
            got = self.holdable[node.id] = holdable(node)
        return got

    def walk(self, graph: OpGraph, start: int) -> tuple[list[int], list[int]]:
        """Descendants of ``start`` reached without going through a barrier (barriers
        included, not walked through), and the barriers among them; once per start. Up to
        the last second GEMM ``second_candidates`` found for the first GEMM (``limits``):
        nothing past it is between that GEMM and any of its candidates."""
        got = self.walks.get(start)
        if got is None:
            limit = self.limits.get(start, len(graph.nodes))
            seen: set[int] = set()
            barriers: list[int] = []
            stack = [start]
            while stack:
                v = stack.pop()
                for u in graph.nodes[v].users:
                    if u not in seen and u <= limit:
                        seen.add(u)
                        if graph.nodes[u].op_class in _BARRIERS:
                            barriers.append(u)
                        else:
                            stack.append(u)
            got = self.walks[start] = (sorted(seen), barriers)
        return got



def _barrier_bits(order, links: str, position: dict[int, int], count: int) -> list[int]:
    """Per node, the barriers (bits by ``position``) met following ``links`` ("users":
    those it reaches; "operands": those reaching it), nodes visited in ``order`` so each
    node's neighbours along ``links`` come before it."""
    bits = [0] * count
    for node in order:
        reach = 0
        for u in getattr(node, links):
            reach |= bits[u]
            at = position.get(u)
            if at is not None:
                reach |= 1 << at
        bits[node.id] = reach
    return bits


def reachable_gemms(graph: OpGraph, first: int) -> list[int]:
    """COMPUTE nodes reachable from ``first`` through non-COMPUTE nodes, nearest first."""
    found: list[int] = []
    stack = list(graph.nodes[first].users)
    seen = set(stack)
    while stack:
        v = stack.pop()
        node = graph.nodes[v]
        if node.op_class is OpClass.COMPUTE:
            found.append(v)
            continue
        if node.op_class is OpClass.OPAQUE:
            continue
        for u in node.users:
            if u not in seen:
                seen.add(u)
                stack.append(u)
    return sorted(found)
