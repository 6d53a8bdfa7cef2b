"""The bitmask proof that a new kernel closes no cycle (stitch.explorer.kernel_reach) against
a brute-force cycle check of the kernel graph, on random DAGs (op-level masks) and on a real
XLA module with unit-level masks; the beam's ``creates_cycle`` must give the brute-force
answer with and without it."""
from __future__ import annotations

import random

import pytest

import stitch.hlo.graph as graph_module
from stitch.explorer.beam import Buffer, Owners, creates_cycle
from stitch.explorer.kernel_reach import KernelReach
from stitch.explorer.patterns import Pattern
from stitch.hlo.graph import OpGraph, build_op_graphs
from stitch.hlo.op_classes import OpClass
from stitch.hlo.parser import parse_hlo
from tests.fixtures import DATA


def _kernel_graph_has_cycle(graph: OpGraph, kernels: list[frozenset[int]]) -> bool:
    """A depth-first search for a back edge on the graph whose nodes are the kernels and
    every other op (a method of its own: the code under test sorts topologically)."""
    where = {op: ("k", i) for i, k in enumerate(kernels) for op in k}
    succ: dict[object, set[object]] = {}
    for node in graph.nodes:
        a = where.get(node.id, ("o", node.id))
        succ.setdefault(a, set())
        succ[a].update(b for b in (where.get(u, ("o", u)) for u in node.users) if b != a)
    state: dict[object, str] = {}          # "open" while on the path, "done" after
    for root in succ:
        if root in state:
            continue
        state[root] = "open"
        path = [(root, iter(succ[root]))]
        while path:
            x, rest = path[-1]
            y = next(rest, None)
            if y is None:
                state[x] = "done"
                path.pop()
            elif state.get(y) == "open":
                return True
            elif y not in state:
                state[y] = "open"
                path.append((y, iter(succ.get(y, ()))))
    return False


def _random_dag(rng: random.Random, n: int) -> OpGraph:
    lines = ["p0 = f32[2] parameter(0)"]
    for i in range(1, n):
        # Mostly near operands (layers), now and then a far one (a residual / a backward).
        picks = [max(0, i - rng.randint(1, 4)) if rng.random() < 0.8 else rng.randrange(i)
                 for _ in range(2)]
        args = ", ".join("p0" if j == 0 else f"n{j}" for j in picks)
        lines.append(f"n{i} = f32[2] add({args})")
    lines[-1] = "ROOT " + lines[-1]
    text = "HloModule r\nENTRY main {\n" + "\n".join(lines) + "\n}\n"
    return build_op_graphs(parse_hlo(text))[0]


def _blocks(graph: OpGraph, by_units: bool) -> list[list[int]]:
    """What kernels are made of, in graph order: single ops, or whole units (an XLA fusion's
    ops, every other op alone; the planner's vertices on large graphs). Sources never."""
    out: dict[object, list[int]] = {}
    for n in graph.nodes:
        if n.op_class is not OpClass.SOURCE:
            out.setdefault(n.xla_group if by_units and n.xla_group else n.id, []).append(n.id)
    return sorted(out.values())


def _random_kernel(rng: random.Random, blocks: list[list[int]], used: set[int]
                   ) -> frozenset[int]:
    """A few blocks near a random one; sometimes joined by a few far later ones (a pattern
    spanning forward and backward)."""
    last = len(blocks) - 1
    start = rng.randrange(len(blocks))
    picked = {min(last, start + rng.randint(0, 6)) for _ in range(rng.randint(2, 5))}
    if rng.random() < 0.3:
        far = rng.randint(start, last)
        picked |= {min(last, far + rng.randint(0, 3)) for _ in range(rng.randint(1, 3))}
    return frozenset(v for b in picked for v in blocks[b] if v not in used)


def _check_against_brute_force(graph: OpGraph, rng: random.Random, cases: int,
                               by_units: bool) -> tuple[int, int]:
    """(acyclic cases, those the bitmasks proved). Raises AssertionError on a wrong answer."""
    fast = KernelReach.of(graph)
    assert fast is not None
    blocks = _blocks(graph, by_units)
    acyclic = proved = shortcut = 0
    for _ in range(cases):
        held: list[frozenset[int]] = []
        used: set[int] = set()
        for _ in range(rng.randint(1, 12)):
            k = _random_kernel(rng, blocks, used)
            if len(k) > 1 and not _kernel_graph_has_cycle(graph, held + [k]):
                held.append(k)
                used |= k
        pattern = _random_kernel(rng, blocks, used)
        if len(pattern) < 2:
            continue
        owner = Owners({v: i for i, k in enumerate(held) for v in k})
        covered = sum(1 << v for v in used)
        reach = max((max(k) for k in held), default=-1)
        plain = Buffer(tuple(Pattern(k, 1.0) for k in held), covered, 0.0, owner, reach)
        with_masks = Buffer(plain.patterns, covered, 0.0, owner, reach,
                            tuple(fast.masks(k)[0] for k in held))
        held_units = 0
        for k in with_masks.masks:
            held_units |= k.units
        with_union = Buffer(plain.patterns, covered, 0.0, owner, reach, with_masks.masks,
                            held_units)
        want = _kernel_graph_has_cycle(graph, held + [pattern])
        assert creates_cycle(graph, plain, Pattern(pattern, 1.0)) == want
        assert creates_cycle(graph, with_masks, Pattern(pattern, 1.0), fast) == want
        assert creates_cycle(graph, with_union, Pattern(pattern, 1.0), fast) == want
        sure = fast.surely_acyclic(with_masks.masks, pattern)
        assert not (sure and want), (held, pattern)
        # The held kernels' union short-cuts the closure, never changing its answer.
        assert fast.surely_acyclic(with_masks.masks, pattern, held_units) == sure
        shortcut += sure and not fast.masks(pattern)[1] & (held_units | fast.masks(
            pattern)[0].units)
        acyclic += not want
        proved += sure
    assert shortcut > 0
    return acyclic, proved


@pytest.mark.parametrize("seed", range(3))
def test_op_level_proofs_agree_with_brute_force_on_random_dags(seed: int) -> None:
    rng = random.Random(seed)
    graph = _random_dag(rng, 60)
    assert graph.reachability() is not None
    acyclic, proved = _check_against_brute_force(graph, rng, 150, by_units=False)
    # Op-level masks are exact: every acyclic answer is proved without a search.
    assert acyclic >= 30 and proved == acyclic


def test_unit_level_proofs_agree_with_brute_force_on_an_xla_module(monkeypatch) -> None:
    """Above REACHABILITY_MAX_NODES the masks are between units (XLA fusions, other ops
    alone): an over-approximation that may leave an answer to the search, never a wrong
    one. Kernels of whole units, as the planner's vertices are on such graphs."""
    text = (DATA / "bert_layer_train" / "tiny.gpu-h100.hlo").read_text()
    graph = build_op_graphs(parse_hlo(text))[0]
    units = {n.xla_group if n.xla_group and n.op_class is not OpClass.SOURCE else n.id
             for n in graph.nodes}
    assert len(units) < len(graph.nodes)
    monkeypatch.setattr(graph_module, "REACHABILITY_MAX_NODES", len(units))
    assert graph.reachability() is None and graph.unit_reachability() is not None
    acyclic, proved = _check_against_brute_force(graph, random.Random(5), 120, by_units=True)
    assert acyclic >= 30 and proved >= acyclic // 2
