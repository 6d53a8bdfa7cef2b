"""Planning with XLA's instructions as the explorer's units (ExplorerOptions.xla_units), as
the XLA pass does: every candidate pattern, and so every stitched kernel, is a union of
whole XLA kernels, which is all snapping lets through to the rewrite anyway."""
from __future__ import annotations

import numpy as np
import pytest

from stitch.hlo import parse_hlo
from stitch.hlo.graph import build_op_graphs
from stitch.explorer.planner import ExplorerOptions, plan
from stitch.explorer.patterns import PatternExplorer, op_vertices, unit_vertices
from stitch.pricing.delta import CostModel
from stitch.cost.gpu_specs import get_spec

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from tests.fixtures import compile_with_cpu_pass  # noqa: E402
from stitch.frontends.verify import compare_trees  # noqa: E402
from tests.test_snap import MODULE as SNAP_MODULE  # noqa: E402

# A feeds B and D, both feed C; C's body is two ops (c1 = tanh(B), c2 = c1 + D).
MODULE = SNAP_MODULE


def _graph(text: str = MODULE):
    return build_op_graphs(parse_hlo(text))[0]


def _ids(graph) -> dict[str, int]:
    return {n.name: n.id for n in graph.nodes}


def test_unit_vertices_are_xla_instructions_in_topological_order():
    graph = _graph()
    vx = unit_vertices(graph, graph.baseline_groups().values())
    assert vx is not None
    names = [frozenset(graph.nodes[v].name for v in m) for m in vx.members]
    index = {n: i for i, n in enumerate(names)}
    a, b, d, c = (index[frozenset(s)] for s in ({"a"}, {"b"}, {"d"}, {"c1", "c2"}))
    assert set(vx.users[a]) == {b, d} and set(vx.operands[c]) == {b, d}
    position = {v: i for i, v in enumerate(vx.order)}
    assert position[a] < position[b] < position[c] and position[d] < position[c]
    assert all(vx.plannable[v] for v in (a, b, c, d))
    assert vx.op[c] == min(_ids(graph)[n] for n in ("c1", "c2"))


def test_units_whose_quotient_has_a_cycle_are_refused():
    graph = _graph()
    ids = _ids(graph)
    # {a, c1} -> {b} -> {a, c1}: no order of these units exists.
    units = [{ids["a"], ids["c1"]}, {ids["b"]}, {ids["d"]}, {ids["c2"]}]
    assert unit_vertices(graph, units) is None


def test_explorer_over_units_keeps_every_unit_whole():
    graph = _graph()
    cost = CostModel(graph, get_spec("h100"))
    groups = [frozenset(g) for g in graph.baseline_groups().values()]
    candidates = PatternExplorer(graph, cost, vertices=unit_vertices(graph, groups)).explore()
    patterns = candidates.all_patterns()
    assert any(len(p.members) > 2 for p in patterns), [sorted(p.members) for p in patterns]
    for p in patterns:
        for g in groups:
            assert g <= p.members or not g & p.members, (sorted(p.members), sorted(g))
    # Op vertices are the default and the same thing as before units existed.
    assert PatternExplorer(graph, cost).vertices.members == op_vertices(graph).members


def _dense_ln_mse_sgd(w, b, x, y):
    """One Dense layer, a hand-written layer norm, MSE loss and an SGD update."""
    def loss(params):
        w, b = params
        h = x @ w + b
        m = h.mean(-1, keepdims=True)
        v = ((h - m) ** 2).mean(-1, keepdims=True)
        h = (h - m) * jax.lax.rsqrt(v + 1e-5)
        return jnp.mean((jnp.tanh(h) - y) ** 2)
    value, (gw, gb) = jax.value_and_grad(loss)((w, b))
    return w - 0.1 * gw, b - 0.1 * gb, value


def _args(seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((64, 128), np.float32) * 0.1,
            rng.standard_normal((128,), np.float32) * 0.1,
            rng.standard_normal((32, 64), np.float32),
            rng.standard_normal((32, 128), np.float32))


def _whole(graph, kernels) -> list[str]:
    """XLA instructions a kernel holds only part of."""
    cut = []
    for name, members in graph.baseline_groups().items():
        ops = frozenset(members)
        for k in kernels:
            if ops & frozenset(k.members) and not ops <= frozenset(k.members):
                cut.append(f"{name} in {k.name}")
    return cut


def test_plan_of_xlas_module_with_units_cuts_no_xla_kernel():
    text = jax.jit(_dense_ln_mse_sgd).lower(*_args()).compile().as_text()
    units = plan(text, "h100", options=ExplorerOptions(xla_units=True))
    ops = plan(text, "h100", options=ExplorerOptions())
    (g_units,), (g_ops,) = units.graphs, ops.graphs
    assert not _whole(g_units.graph, g_units.stitched.kernels)
    assert g_units.stitched.objective_s <= g_units.baseline.objective_s
    # Fewer vertices, fewer patterns scored than the op-level explorer.
    assert g_units.report.detail["evaluations"] < g_ops.report.detail["evaluations"]
    assert "refinement" not in g_units.report.detail["choice"]
    assert g_units.report.detail["xla_units"] and not g_ops.report.detail["xla_units"]
    assert g_units.report.detail["vertices"] < len(g_units.graph.nodes)


def test_units_are_ignored_on_a_module_xla_did_not_fuse():
    text = jax.jit(_dense_ln_mse_sgd).lower(*_args()).as_text(dialect="hlo")
    units = plan(text, "h100", options=ExplorerOptions(xla_units=True))
    ops = plan(text, "h100", options=ExplorerOptions())
    assert [k.members for k in units.graphs[0].stitched.kernels] == \
        [k.members for k in ops.graphs[0].stitched.kernels]
    assert not units.graphs[0].report.detail["xla_units"]


def test_the_pass_plans_with_units_and_its_step_matches_jax():
    args = _args(3)
    report, compiled = compile_with_cpu_pass(_dense_ln_mse_sgd, *args)
    assert report.kernels_stitched >= 1, report.skipped
    for gp in report.plan.graphs:
        # (A plan from the disk cache has no explorer detail; its key holds the options.)
        assert gp.report.status == "cached" or gp.report.detail["xla_units"]
        assert not _whole(gp.graph, gp.stitched.kernels)
    got = compiled(*args)
    want = jax.jit(_dense_ln_mse_sgd)(*args)
    why = compare_trees(got, want, 1e-4)
    assert why is None, why


def test_what_the_pass_can_place_of_a_unit_plan_is_the_plan():
    """Nothing of a unit plan is lost to snapping: what the pass can place (bench.delivered.units'
    measure) models exactly the plan."""
    from bench.delivered.units import placed_modeled_us
    text = jax.jit(_dense_ln_mse_sgd).lower(*_args()).compile().as_text()
    module = parse_hlo(text)
    units = plan(module, "h100", options=ExplorerOptions(xla_units=True, gemm_chains=False))
    placed_us, placed = placed_modeled_us(module, units, get_spec("h100"))
    assert placed >= 1
    assert placed_us == pytest.approx(units.graphs[0].stitched.objective_s * 1e6, rel=1e-6)
