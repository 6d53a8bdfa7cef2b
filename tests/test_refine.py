"""Plan refinement (recomputation moves of producer chains, split moves), the packed-kernel cost rule, and the
BLP's warm start and lower bound."""
from __future__ import annotations

import pytest

import stitch
from stitch.hlo import parse_hlo
from stitch.hlo.graph import build_op_graphs
from stitch.pricing.delta import CostModel
from stitch.cost.gpu_specs import get_spec
from stitch.explorer.blp import solve_blp
from stitch.explorer.graph_plan import make_kernel, validate
from stitch.explorer.refine import refine_plan

ADD = """
add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}
"""


def _graph(body: str):
    text = f"HloModule m\n{ADD}\nENTRY main {{\n{body}\n}}\n"
    return build_op_graphs(parse_hlo(text))[0]


def _ids(graph, *names):
    return frozenset(graph.node(n).id for n in names)


def _objective(kernels) -> float:
    return sum(k.cost.total_s for k in kernels)


# A packed kernel makes bb = broadcast(b) (16 MiB) next to an unrelated negate; a
# multiply in another kernel reads bb. Recomputing bb in the multiply's kernel from b
# (4 KiB) lets the packed kernel drop it: 32 MiB less traffic.
RECOMPUTE = """
  b = f32[1024] parameter(0)
  x2 = f32[4096,1024] parameter(1)
  x3 = f32[4096,1024] parameter(2)
  bb = f32[4096,1024] broadcast(b), dimensions={1}
  n = f32[4096,1024] negate(x2)
  m = f32[4096,1024] multiply(x3, bb)
  ROOT t = (f32[4096,1024], f32[4096,1024]) tuple(n, m)
"""

# A column reduction over few columns shared with its consumers: one block per 32
# columns leaves the GPU nearly idle, so the reduction alone (many threads) plus an
# elementwise kernel is faster.
NARROW_COLUMNS = """
  x = f32[65536,64] parameter(0)
  zero = f32[] constant(0)
  s = f32[64] reduce(x, zero), dimensions={0}, to_apply=add
  sb = f32[65536,64] broadcast(s), dimensions={1}
  ROOT y = f32[65536,64] multiply(x, sb)
"""


def test_recomputation_move_takes_a_producer_chain_into_its_consumer():
    graph = _graph(RECOMPUTE)
    cost = CostModel(graph, get_spec("h100"))
    start = [make_kernel(graph, cost, _ids(graph, "bb", "n"), "packing"),
             make_kernel(graph, cost, _ids(graph, "m"), "single")]
    refined, moves = refine_plan(graph, cost, start)
    validate(graph, refined)
    assert moves >= 1
    assert _objective(refined) < _objective(start)
    (holding,) = [k for k in refined if graph.node("bb").id in k.members]
    assert graph.node("m").id in holding.members and graph.node("n").id not in holding.members
    saved = sum(k.cost.hbm_bytes for k in start) - sum(k.cost.hbm_bytes for k in refined)
    assert saved == 2 * 4096 * 1024 * 4            # bb no longer written nor read back


def test_split_move_frees_a_starved_column_reduction():
    graph = _graph(NARROW_COLUMNS)
    cost = CostModel(graph, get_spec("h100"))
    whole = make_kernel(graph, cost, _ids(graph, "s", "sb", "y"), "dp")
    refined, moves = refine_plan(graph, cost, [whole])
    validate(graph, refined)
    assert moves >= 1 and len(refined) == 2
    assert _objective(refined) < whole.cost.total_s
    reduce_kernel = next(k for k in refined if graph.node("s").id in k.members)
    assert graph.node("y").id not in reduce_kernel.members


def test_refinement_keeps_a_plan_without_improving_moves():
    graph = _graph(RECOMPUTE)
    cost = CostModel(graph, get_spec("h100"))
    start = [make_kernel(graph, cost, _ids(graph, "bb", "m"), "dp"),
             make_kernel(graph, cost, _ids(graph, "n"), "single")]
    refined, moves = refine_plan(graph, cost, start)
    assert moves == 0 and [k.members for k in refined] == [k.members for k in start]


def test_packed_parts_cannot_borrow_each_others_threads():
    """A packed kernel runs no faster than its slowest part would alone."""
    graph = _graph("""
  small = f32[64,65536] parameter(0)
  big = f32[8388608] parameter(1)
  zero = f32[] constant(0)
  s = f32[64] reduce(small, zero), dimensions={1}, to_apply=add
  sb = f32[64,65536] broadcast(s), dimensions={0}
  y = f32[64,65536] subtract(small, sb)
  e = f32[8388608] exponential(big)
  ROOT t = (f32[64,65536], f32[8388608]) tuple(y, e)
""")
    cost = CostModel(graph, get_spec("h100"))
    part = cost.kernel(_ids(graph, "s", "sb", "y"))
    packed = cost.kernel(_ids(graph, "s", "sb", "y", "e"))
    assert packed.threads > part.threads
    assert packed.memory_s >= part.memory_s - part.memory_s * 1e-9
    assert packed.total_s >= part.total_s


def test_blp_starts_from_the_beam_plan_and_bounds_the_optimum():
    graph = _graph(RECOMPUTE)
    cost = CostModel(graph, get_spec("h100"))
    initial = [_ids(graph, "bb", "n"), _ids(graph, "m")]
    result = solve_blp(graph, cost, [], time_limit_s=5.0, initial=initial)
    start = sum(cost.kernel(c).total_s for c in initial)
    assert result.objective_s <= start + 1e-12
    assert 0 < result.lower_bound_s <= result.objective_s + 1e-12
    if result.status == "optimal":
        assert result.lower_bound_s == pytest.approx(result.objective_s, rel=1e-6)


def test_planner_reports_refinement_in_its_choice():
    """Whatever wins, the report names it and the refined plans were considered."""
    p = stitch.plan(f"HloModule m\n{ADD}\nENTRY main {{\n{RECOMPUTE}\n}}\n", target="h100")
    report = p.graphs[0].report
    assert report.detail["choice"]
    off = stitch.plan(f"HloModule m\n{ADD}\nENTRY main {{\n{RECOMPUTE}\n}}\n", target="h100",
                      options=stitch.ExplorerOptions(recompute=False))
    assert p.graphs[0].stitched.objective_s <= off.graphs[0].stitched.objective_s + 1e-12
