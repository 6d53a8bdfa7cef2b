"""``MergeGraph.other_path`` answers no at once against an edge (b -> a) where the kernel
graph stays acyclic: the same answers as the plain two-sided search on random DAGs with
random kernels, before and through a run of merges; the acyclicity it relies on agrees with
a brute-force cycle check, and kernels sharing an op turn the shortcut off."""
from __future__ import annotations

import random

import pytest

from stitch.explorer.beam import MergeGraph, has_other_path
from tests.test_kernel_reach import _kernel_graph_has_cycle, _random_dag


def _random_kernels(rng: random.Random, n: int, far: bool = False) -> list[frozenset[int]]:
    """Disjoint runs of a few consecutive ops (acyclic: edges run up the ids), some ops left
    in no kernel; ``far``: now and then a run also takes a far later op (a cycle, often)."""
    kernels, v = [], 1
    while v < n - 1:
        size = rng.randint(1, 4)
        run = set(range(v, min(n, v + size)))
        v += size + rng.randint(0, 2)
        if far and rng.random() < 0.2 and v < n - 1:
            run.add(rng.randrange(v, n))
        kernels.append(run)
    taken: set[int] = set()
    out = []
    for k in kernels:
        k = frozenset(k - taken)
        taken |= k
        if k:
            out.append(k)
    return out


def _agrees(plan: MergeGraph) -> int:
    """Every pair of kernels joined by an edge, both ways: the plan's answer is the plain
    search's. Returns how many answers came from the shortcut."""
    shortcut = 0
    for a in list(plan.kernels):
        for b in plan.neighbours(a):
            want = has_other_path(a, b, plan.successors, plan.predecessors)
            assert plan.other_path(a, b) == want
            shortcut += plan.stays_acyclic and a in plan.successors(b)
    return shortcut


@pytest.mark.parametrize("seed", range(4))
def test_other_path_matches_the_plain_search_through_merges(seed: int) -> None:
    rng = random.Random(seed)
    graph = _random_dag(rng, 70)
    checked = shortcut = merges = 0
    for _ in range(20):
        kernels = _random_kernels(rng, len(graph.nodes))
        plan = MergeGraph(graph, kernels, [True] * len(kernels))
        assert plan.stays_acyclic == (not _kernel_graph_has_cycle(graph, kernels))
        if not plan.stays_acyclic:
            continue
        checked += 1
        shortcut += _agrees(plan)
        for _ in range(6):
            pairs = [(a, b) for a in plan.kernels for b in plan.neighbours(a) if a < b]
            rng.shuffle(pairs)
            for a, b in pairs:
                if not (plan.other_path(a, b) or plan.other_path(b, a)):
                    plan.merge(a, b, plan.kernels[a] | plan.kernels[b])
                    merges += 1
                    break
            assert not _kernel_graph_has_cycle(graph, list(plan.kernels.values()))
            shortcut += _agrees(plan)
    assert checked >= 3 and shortcut > 20 and merges > 10


def test_cycles_and_shared_ops_turn_the_shortcut_off() -> None:
    rng = random.Random(7)
    graph = _random_dag(rng, 40)
    cyclic = acyclic = 0
    for _ in range(40):
        kernels = _random_kernels(rng, len(graph.nodes), far=True)
        has_cycle = _kernel_graph_has_cycle(graph, kernels)
        assert MergeGraph(graph, kernels, [True] * len(kernels)).stays_acyclic != has_cycle
        cyclic += has_cycle
        acyclic += not has_cycle
        shared = kernels + [frozenset(list(kernels[0])[:1]) | kernels[1]]
        assert not MergeGraph(graph, shared, [True] * len(shared)).stays_acyclic
    assert cyclic and acyclic


def test_edges_read_through_merges_match_the_kernel_graph_rebuilt() -> None:
    """``successors`` / ``predecessors`` of every kernel and of ops in none, asked before
    and between random merges (cached sets kept or dropped as kernels merge), equal the
    kernel graph rebuilt from the current kernels (fresh seeds)."""
    rng = random.Random()
    compared = merges = 0
    for _ in range(12):
        graph = _random_dag(rng, 60)
        kernels = _random_kernels(rng, len(graph.nodes))
        plan = MergeGraph(graph, kernels, [True] * len(kernels))
        for _ in range(8):
            unit = {v: k for k, members in plan.kernels.items() for v in members}
            units = list(plan.kernels) + [-1 - v for v in range(len(graph.nodes))
                                          if v not in unit]
            for k in units:
                ops = plan.kernels[k] if k >= 0 else {-1 - k}
                succ = {unit.get(u, -1 - u) for v in ops for u in graph.nodes[v].users}
                pred = {unit.get(o, -1 - o) for v in ops for o in graph.nodes[v].operands}
                assert plan.successors(k) == succ - {k}
                assert plan.predecessors(k) == pred - {k}
                compared += 1
            pairs = [(a, b) for a in plan.kernels for b in plan.neighbours(a) if a < b]
            if not pairs:
                break
            a, b = rng.choice(pairs)
            plan.merge(a, b, plan.kernels[a] | plan.kernels[b])
            merges += 1
    assert compared > 500 and merges > 20
