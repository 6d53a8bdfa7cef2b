"""Finishing a plan (stitch.explorer.beam.merge_adjacent, launch order and validation) with
its caches gives the answers a from-scratch computation gives: the greedy merge against a
reference that rebuilds the kernel graph and rescores every pair before each merge, and
validation with the launch order's shared kernel inputs/outputs against validation alone."""
from __future__ import annotations

import random

import pytest

from stitch.pricing.delta import CostModel
from stitch.cost.gpu_specs import get_spec
from stitch.explorer import beam
from stitch.explorer.beam import MergeGraph, merge_adjacent
from stitch.explorer.graph_plan import (KernelIO, PlanValidationError, launch_order, make_kernel,
                                  validate)
from stitch.explorer.planner import baseline_groups
from stitch.hlo import parse_hlo
from stitch.hlo.graph import OpGraph, build_op_graphs
from tests.fixtures import DATA

MODELS = ("bert_layer_train", "dien_train")


def _graph(model: str) -> OpGraph:
    return build_op_graphs(parse_hlo((DATA / model / "full.gpu-h100.hlo").read_text()))[0]


def _reference_merge(graph: OpGraph, cost: CostModel, groups: list[frozenset[int]],
                     mergeable: list[bool], max_ops: int) -> list[frozenset[int]]:
    """The greedy merge, nothing cached: before every merge the kernel graph is built
    again and every adjacent pair scored; the best saving (lowest ids on ties) is taken
    unless another path joins the two (then that pair is never taken)."""
    kernels = dict(enumerate(groups))
    ok = dict(enumerate(mergeable))
    next_id = len(groups)
    rejected: set[tuple[int, int]] = set()
    while True:
        owner = [-1] * len(graph.nodes)
        for k, g in kernels.items():
            for v in g:
                owner[v] = k

        def unit(v: int) -> int:
            return owner[v] if owner[v] >= 0 else -1 - v

        def successors(k: int) -> set[int]:
            ops = kernels[k] if k >= 0 else (-1 - k,)
            return {unit(u) for v in ops for u in graph.nodes[v].users} - {k}

        def other_path(a: int, b: int) -> bool:
            stack = [c for c in successors(a) if c != b]
            seen = set(stack)
            while stack:
                c = stack.pop()
                for d in successors(c):
                    if d == b:
                        return True
                    if d not in seen and d != a:
                        seen.add(d)
                        stack.append(d)
            return False

        candidates = []
        for a, g in kernels.items():
            if not ok[a]:
                continue
            near = {owner[w] for v in g for w in list(graph.nodes[v].users) +
                    graph.nodes[v].operands if owner[w] >= 0}
            for b in near:
                if b <= a or not ok[b] or (a, b) in rejected:
                    continue
                union = kernels[a] | kernels[b]
                if len(union) > max_ops or not cost.stitchable(union):
                    continue
                s = cost.kernel(kernels[a]).total_s + cost.kernel(kernels[b]).total_s - \
                    cost.kernel(union).total_s
                if s > 0:
                    candidates.append((-s, a, b))
        if not candidates:
            return list(kernels.values())
        _, a, b = min(candidates)
        first, second = (a, b) if min(kernels[a]) <= min(kernels[b]) else (b, a)
        if other_path(first, second) or other_path(second, first):
            rejected.add((a, b))
            continue
        kernels[next_id] = kernels.pop(a) | kernels.pop(b)
        ok[next_id] = True
        next_id += 1


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("seed", range(2))
def test_merging_equals_a_from_scratch_greedy(model: str, seed: int, monkeypatch) -> None:
    """Same kernels as the uncached greedy, with a random share of XLA's kernels held
    out of merging (other merge orders, other paths between kernels)."""
    # Score every pair at once (the reference's greedy; lazy scoring is another order).
    monkeypatch.setattr(beam, "LAZY_MERGE_KERNELS", 10 ** 9)
    graph = _graph(model)
    rng = random.Random(seed)
    groups = baseline_groups(graph, "xla")
    spec = get_spec("h100")
    probe = CostModel(graph, spec)
    mergeable = [probe.stitchable(g) and rng.random() < 0.8 for g in groups]
    max_ops = rng.choice((8, 32, 128))
    merged = merge_adjacent(graph, CostModel(graph, spec), groups, mergeable, max_ops)
    expected = _reference_merge(graph, CostModel(graph, spec), groups, mergeable, max_ops)
    assert len(merged) < len(groups), "nothing merged: the test proves nothing"
    assert sorted(map(sorted, merged)) == sorted(map(sorted, expected))


@pytest.mark.parametrize("seed", range(3))
def test_merge_graph_edges_after_merges_equal_a_fresh_build(seed: int) -> None:
    """The kernel graph's cached, resolved edge sets name the same kernels as edges built
    from the current kernels, after every one of a run of random merges."""
    graph = _graph("bert_layer_train")
    rng = random.Random(seed)
    groups = baseline_groups(graph, "xla")
    kernels = MergeGraph(graph, groups, [True] * len(groups))
    for _ in range(40):
        owner = kernels.owner

        def unit(v: int) -> int:
            return owner[v] if owner[v] >= 0 else -1 - v

        alive = sorted(kernels.kernels)
        for k in rng.sample(alive, min(len(alive), 30)):
            g = kernels.kernels[k]
            assert kernels.successors(k) == \
                {unit(u) for v in g for u in graph.nodes[v].users} - {k}
            assert kernels.predecessors(k) == \
                {unit(o) for v in g for o in graph.nodes[v].operands} - {k}
        a = rng.choice(alive)
        near = sorted(kernels.neighbours(a))
        if near:
            b = rng.choice(near)
            kernels.merge(a, b, kernels.kernels[a] | kernels.kernels[b])
    assert len(kernels.kernels) < len(groups)


@pytest.mark.parametrize("seed", range(3))
def test_validation_with_the_launch_orders_io_flags_what_validation_alone_flags(
        seed: int) -> None:
    """A valid launch order passes both ways; orders with two kernels swapped fail
    exactly when validation without the shared cache fails."""
    graph = _graph("bert_layer_train")
    cost = CostModel(graph, get_spec("h100"))
    rng = random.Random(seed)
    kernels = [make_kernel(graph, cost, g, "baseline") for g in baseline_groups(graph, "xla")]
    io: KernelIO = {}
    order = launch_order(graph, kernels, io)
    validate(graph, order, io)
    failed = 0
    for _ in range(20):
        i, j = sorted(rng.sample(range(len(order)), 2))
        swapped = list(order)
        swapped[i], swapped[j] = swapped[j], swapped[i]
        try:
            validate(graph, swapped)
            alone = None
        except PlanValidationError as exc:
            alone = str(exc)
        try:
            validate(graph, swapped, io)
            shared = None
        except PlanValidationError as exc:
            shared = str(exc)
        assert shared == alone
        failed += alone is not None
    assert failed, "no swap broke the order: the test proves nothing"


def _levels_reference(graph: OpGraph, groups: list[frozenset[int]]) -> list[int] | None:
    """Longest-path levels of the kernel graph built edge by edge from every member's
    operands (a recomputed value from the groups writing it), walked in topological order
    by repeated scans; None on a cycle."""
    n_groups = len(groups)
    holders: dict[int, list[int]] = {}
    for gi, g in enumerate(groups):
        for v in g:
            holders.setdefault(v, []).append(gi)

    def unit_sources(o: int) -> list[int]:
        held = holders.get(o, [])
        if not held:
            return [n_groups + o]
        writing = [h for h in held if o in graph.outputs
                   or any(u not in groups[h] for u in graph.nodes[o].users)]
        return writing or held

    units = list(range(n_groups)) + [n_groups + v for v in range(len(graph.nodes))
                                     if v not in holders]
    preds: dict[int, set[int]] = {u: set() for u in units}
    for u in units:
        ops = groups[u] if u < n_groups else {u - n_groups}
        for m in ops:
            for o in graph.nodes[m].operands:
                if u < n_groups and o in groups[u]:
                    continue
                preds[u].update(h for h in unit_sources(o) if h != u)
    level: dict[int, int] = {}
    while len(level) < len(units):
        ready = [u for u in units if u not in level and preds[u] <= set(level)]
        if not ready:
            return None
        for u in ready:
            level[u] = max((level[p] + (1 if p < n_groups else 0) for p in preds[u]),
                           default=0)
    return [level[i] for i in range(n_groups)]


@pytest.mark.parametrize("model", MODELS)
def test_kernel_levels_match_the_reference(model):
    """``kernel_levels`` on XLA's kernels and random unions of them, with a few ops copied
    into a second kernel (recomputed producers), fresh seeds: the reference's levels, or
    both refuse a cycle."""
    graph = _graph(model)
    groups = sorted(baseline_groups(graph, "xla"), key=min)
    rng = random.Random()
    checked = cycles = 0
    for attempt in range(8):
        trial = list(groups)
        # Unions of kernels next to each other in op order (often acyclic), then copies.
        for _ in range(rng.randint(1, 8) if attempt else 0):
            i = rng.randrange(len(trial) - 1)
            trial[i:i + 2] = [trial[i] | trial[i + 1]]
        for _ in range(rng.randint(1, 6) if attempt else 0):
            # A producer copied into the kernel holding all its users (recomputed there):
            # its first holder still writes it, the copy does not.
            j = rng.randrange(len(trial))
            copies = sorted({o for m in trial[j] for o in graph.nodes[m].operands
                             if o not in trial[j] and graph.nodes[o].users
                             and all(u in trial[j] for u in graph.nodes[o].users)
                             and any(o in g for g in trial)})
            if copies:
                trial[j] = trial[j] | {rng.choice(copies)}
        rng.shuffle(trial)
        want = _levels_reference(graph, trial)
        if want is None:
            with pytest.raises(ValueError):
                beam.kernel_levels(graph, trial)
            cycles += 1
        else:
            assert beam.kernel_levels(graph, trial) == want
            checked += 1
    assert checked >= 1 and len(groups) > 20
