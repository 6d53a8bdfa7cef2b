"""The GEMM-chain recognizer on deep graphs: a residual stream links every layer's GEMMs to
all later ones, so candidate (first, second) pairs grow with the square of the layers. The
work per pair must not (each GEMM described once, one walk per first GEMM), and the nodes
found between two GEMMs must be what walking every path both ways finds. Structural
counts, no timings."""
from __future__ import annotations

import random

import pytest

from stitch.hlo import gemm_chain_search, gemm_chains
from stitch.hlo.gemm_chain_program import NotAChain
from stitch.hlo.gemm_chain_recognizer import Recognizer
from stitch.hlo.gemm_chain_search import ChainSearch, reachable_gemms
from stitch.hlo.graph import build_op_graphs
from stitch.hlo.op_classes import OpClass
from stitch.hlo.parser import parse_hlo
from tests.fixtures import DATA


def _residual_mlp(layers: int, seed: int = 0, side: bool = False) -> str:
    """x <- x + dot(act(dot(x, W1)), W2) per layer, acts drawn at random, a loss-like sum at
    the end. ``side``: the hidden value's row sums are added into the stream too, so no
    layer is a chain (its first result is read elsewhere) and every GEMM tries each later
    one it reaches."""
    rng = random.Random(seed)
    lines = ["HloModule deep", "add {", "  p = f32[] parameter(0)", "  q = f32[] parameter(1)",
             "  ROOT s = f32[] add(p, q)", "}", "ENTRY e {", "  x0 = f32[16,8] parameter(0)"]
    params = 1
    x = "x0"
    for i in range(layers):
        lines.append(f"  w1_{i} = f32[8,12] parameter({params})")
        lines.append(f"  w2_{i} = f32[12,8] parameter({params + 1})")
        params += 2
        lines.append(f"  h{i} = f32[16,12] dot({x}, w1_{i}), lhs_contracting_dims={{1}}, "
                     "rhs_contracting_dims={0}")
        act = rng.choice(["tanh", "exponential", "negate"])
        lines.append(f"  a{i} = f32[16,12] {act}(h{i})")
        lines.append(f"  o{i} = f32[16,8] dot(a{i}, w2_{i}), lhs_contracting_dims={{1}}, "
                     "rhs_contracting_dims={0}")
        if side:
            lines.append(f"  z{i} = f32[] constant(0)")
            lines.append(f"  r{i} = f32[16] reduce(h{i}, z{i}), dimensions={{1}}, to_apply=add")
            lines.append(f"  b{i} = f32[16,8] broadcast(r{i}), dimensions={{0}}")
            lines.append(f"  s{i} = f32[16,8] add(o{i}, b{i})")
            lines.append(f"  x{i + 1} = f32[16,8] add({x}, s{i})")
        else:
            lines.append(f"  x{i + 1} = f32[16,8] add({x}, o{i})")
        x = f"x{i + 1}"
    lines.append("  z = f32[] constant(0)")
    lines.append(f"  ROOT loss = f32[] reduce({x}, z), dimensions={{0,1}}, to_apply=add")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _all_paths_between(graph, start: int, second: int) -> set[int]:
    """The recognizer's set by its definition: descendants of ``start`` that are ancestors
    of ``second`` (every path walked both ways)."""
    below, stack = set(), [start]
    while stack:
        for u in graph.nodes[stack.pop()].users:
            if u not in below and u < second:
                below.add(u)
                stack.append(u)
    above, stack = set(), list(graph.nodes[second].operands)
    while stack:
        v = stack.pop()
        if v in above or v <= start:
            continue
        above.add(v)
        stack.extend(graph.nodes[v].operands)
    return below & above


@pytest.mark.parametrize("layers, side", [(3, False), (12, False), (12, True)])
def test_each_gemm_described_and_walked_once(layers: int, side: bool, monkeypatch) -> None:
    graph = build_op_graphs(parse_hlo(_residual_mlp(layers, side=side)))[0]
    described, searches = [], []
    describe, of = gemm_chain_search.describe_gemm, ChainSearch.of
    monkeypatch.setattr(gemm_chain_search, "describe_gemm",
                        lambda g, nid: described.append(nid) or describe(g, nid))
    monkeypatch.setattr(ChainSearch, "of",
                        staticmethod(lambda g: searches.append(of(g)) or searches[-1]))
    pairs = []
    run = Recognizer.run
    monkeypatch.setattr(Recognizer, "run",
                        lambda self: pairs.append((self.first, self.second)) or run(self))
    chains = gemm_chains._find(graph)
    gemms = [n.id for n in graph.nodes if n.op_class is OpClass.COMPUTE]
    assert len(gemms) == 2 * layers
    if side:
        assert chains == []
    else:
        assert len(chains) == layers               # dot -> act -> dot, per layer
    # The residual stream's pairs (layers^2 of them) are pruned before any is tried: the
    # next GEMM met on the stream lies between a GEMM and every later one.
    assert len(pairs) <= len(gemms)
    assert len(described) == len(set(described)) <= len(gemms)
    (search,) = searches
    assert len(search.walks) <= len(gemms)


def _tried_pairs(graph, monkeypatch, pruned: bool) -> tuple[list, list[tuple[int, int]]]:
    """The chains ``_find`` returns and the (first, second) pairs it hands the recognizer,
    with the pruned candidates or with every GEMM reached through non-GEMM ops."""
    pairs: list[tuple[int, int]] = []
    with monkeypatch.context() as m:
        run = Recognizer.run
        m.setattr(Recognizer, "run",
                  lambda self: pairs.append((self.first, self.second)) or run(self))
        if not pruned:
            m.setattr(ChainSearch, "second_candidates",
                      lambda self, g, first: reachable_gemms(g, first))
        chains = gemm_chains._find(graph)
    return chains, pairs


def _pruning_agrees(graph, monkeypatch) -> int:
    """Same chains with and without pruning; every pruned pair is one the recognizer
    refuses. Returns how many pairs the pruning dropped."""
    chains, kept = _tried_pairs(graph, monkeypatch, pruned=True)
    want, every = _tried_pairs(graph, monkeypatch, pruned=False)
    assert chains == want
    assert set(kept) <= set(every)
    search = ChainSearch.of(graph)
    for first, second in set(every) - set(kept):
        with pytest.raises((NotAChain, KeyError, ValueError, IndexError,
                            TypeError, ZeroDivisionError)):
            Recognizer(graph, first, second, search).run()
    return len(every) - len(kept)


@pytest.mark.parametrize("seed", range(4))
def test_pruned_pairs_find_the_same_chains_on_residual_stacks(seed: int, monkeypatch) -> None:
    layers = random.Random(seed).randint(4, 9)
    side = seed % 2 == 1        # no chains: every GEMM meets each later one on the stream
    graph = build_op_graphs(parse_hlo(_residual_mlp(layers, seed=seed, side=side)))[0]
    assert _pruning_agrees(graph, monkeypatch) >= (layers if side else 0)


def test_pruned_pairs_find_the_same_chains_on_the_zoo(monkeypatch) -> None:
    """Every tiny zoo fixture (one stage): chains of attention, MCFuser's chains, training
    steps whose backward reads the scores."""
    dropped = found = 0
    for path in sorted(DATA.glob("*/tiny.gpu-h100.hlo")):
        for graph in build_op_graphs(parse_hlo(path.read_text())):
            if sum(n.op_class is OpClass.COMPUTE for n in graph.nodes) < 2:
                continue
            dropped += _pruning_agrees(graph, monkeypatch)
            found += len(gemm_chains.find_gemm_chains(graph))
    assert found >= 20 and dropped > 0


def test_nodes_between_is_every_path_both_ways() -> None:
    graph = build_op_graphs(parse_hlo(_residual_mlp(6, seed=3, side=True)))[0]
    search = ChainSearch.of(graph)
    gemms = [n.id for n in graph.nodes if n.op_class is OpClass.COMPUTE]
    checked = refused = 0
    for first in gemms:
        for second in gemms:
            if second <= first:
                continue
            recognizer = Recognizer(graph, first, second, search)
            want = _all_paths_between(graph, first, second)
            barrier = any(graph.nodes[v].op_class in (OpClass.COMPUTE, OpClass.OPAQUE)
                          for v in want)
            reads = any(o in want or o == first for o in graph.nodes[second].operands)
            if barrier or not reads:
                with pytest.raises(NotAChain):
                    recognizer.nodes_between(first, None)
                refused += 1
            else:
                assert recognizer.nodes_between(first, None) == want
                checked += 1
    assert checked >= 6 and refused >= 30
