"""The recognizer's walk for index values (iota masks, one-hot labels) with its per-graph
record of nodes where the walk surely fails (``ChainProgramBuilder.fails_clean``): the same
chains as the plain walk on the zoo and on residual stacks, every recorded failure one the
plain walk also fails at without building anything, and each node decided once however
many pairs ask (a residual stream's adds chain back through every layer)."""
from __future__ import annotations

import random

import pytest

from stitch.hlo import gemm_chains
from stitch.hlo.gemm_chain_program import OperandView
from stitch.hlo.gemm_chain_search import ChainSearch
from stitch.hlo.gemm_chain_values import ChainProgramBuilder
from stitch.hlo.graph import OpGraph, build_op_graphs
from stitch.hlo.op_classes import OpClass
from stitch.hlo.parser import parse_hlo
from tests.fixtures import DATA
from tests.test_gemm_chain_search_scaling import _residual_mlp


def _chains(graph: OpGraph, monkeypatch, recorded: bool) -> list:
    with monkeypatch.context() as m:
        if not recorded:
            m.setattr(ChainProgramBuilder, "fails_clean", lambda self, nid: False)
        return gemm_chains._find(graph)


def _recorded_failures_hold(graph: OpGraph, monkeypatch) -> int:
    """Every node ``fails_clean`` records as failing: the plain walk from it returns None
    and adds no op. Returns how many such nodes the graph has."""
    first = next(n.id for n in graph.nodes if n.op_class is OpClass.COMPUTE)
    search = ChainSearch.of(graph)
    recorded = ChainProgramBuilder(graph, first, first, search)
    failing = [n.id for n in graph.nodes if recorded.fails_clean(n.id)]
    with monkeypatch.context() as m:
        m.setattr(ChainProgramBuilder, "fails_clean", lambda self, nid: False)
        for nid in failing:
            plain = ChainProgramBuilder(graph, first, first, search)
            plain.dims = (1, 1, 1)
            plain.index_inputs = []
            nodes: set[int] = set()
            assert plain.index_value(nid, OperandView(-1, 0, 0, 0), "tile", nodes) is None
            assert plain.ops == [] and nodes == set() and plain.index_inputs == []
    return len(failing)


def test_same_chains_and_sound_failures_on_the_zoo(monkeypatch) -> None:
    found = failing = 0
    for path in sorted(DATA.glob("*/tiny.gpu-h100.hlo")):
        for graph in build_op_graphs(parse_hlo(path.read_text())):
            if sum(n.op_class is OpClass.COMPUTE for n in graph.nodes) < 2:
                continue
            chains = _chains(graph, monkeypatch, recorded=True)
            assert chains == _chains(graph, monkeypatch, recorded=False), path
            found += len(chains)
            failing += _recorded_failures_hold(graph, monkeypatch)
    assert found >= 20 and failing > 100


@pytest.mark.parametrize("seed", range(3))
def test_each_node_decided_once_on_residual_stacks(seed: int, monkeypatch) -> None:
    layers = random.Random(seed).randint(8, 16)
    # (Each layer's hidden row sums join the stream: pairs read outside values.)
    graph = build_op_graphs(parse_hlo(_residual_mlp(layers, seed=seed, side=True)))[0]
    decided: list[int] = []
    here = ChainProgramBuilder._fails_here
    monkeypatch.setattr(ChainProgramBuilder, "_fails_here",
                        lambda self, nid: decided.append(nid) or here(self, nid))
    chains = _chains(graph, monkeypatch, recorded=True)
    assert decided and len(decided) == len(set(decided)) <= len(graph.nodes)
    assert chains == _chains(graph, monkeypatch, recorded=False)
    assert _recorded_failures_hold(graph, monkeypatch) > layers
