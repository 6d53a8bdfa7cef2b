"""Colliding scatter atomics priced by their collisions per address (stitch.cost.contention),
for XLA's kernels (the delta-evaluator prices the baseline, ``xla_atomics``: an atomic per
update element) and stitch's (the latency-evaluator's schedules; a scatter-add over sorted
ids in runs, stitch.hlo.sorted_runs); index values proved through integer
arithmetic."""
from __future__ import annotations

import numpy as np
import pytest

from stitch.hlo import parse_hlo
from stitch.hlo.graph import build_op_graphs
from stitch.hlo.scatter_forms import known_index_values
from stitch.cost.contention import scatter_contention
from stitch.hlo.sorted_runs import RUN_ROWS
from stitch.pricing.delta import CostModel
from stitch.cost.gpu_specs import get_spec
from stitch.schedule import schedule_kernel

COMBINERS = {
    "add": "ROOT r = f32[] add(a, b)",
    "max": "ROOT r = f32[] maximum(a, b)",
    "mul": "ROOT r = f32[] multiply(a, b)",
}


def _scatter(updates: int, rows: int, ids: str, combiner: str = "add", sorted_: bool = True
             ) -> str:
    return f"""HloModule m
comb {{
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  {COMBINERS[combiner]}
}}
ENTRY e {{
  x = f32[{updates}] parameter(0)
  p = s32[{updates}] parameter(1)
  z = f32[] constant(0)
  o = f32[{rows}] broadcast(z), dimensions={{}}
  {ids}
  idx = s32[{updates},1] reshape(ids)
  ROOT s = f32[{rows}] scatter(o, idx, x), update_window_dims={{}}, inserted_window_dims={{0}}, scatter_dims_to_operand_dims={{0}}, index_vector_dim=1, indices_are_sorted={'true' if sorted_ else 'false'}, to_apply=comb
}}"""


def _segments(updates: int, length: int) -> str:
    return f"""i = s32[{updates}] iota(), iota_dimension=0
  l = s32[] constant({length})
  lb = s32[{updates}] broadcast(l), dimensions={{}}
  ids = s32[{updates}] divide(i, lb)"""


def _permutation(updates: int, seed: int) -> str:
    perm = np.random.default_rng(seed).permutation(updates)
    return f"ids = s32[{updates}] constant({{{', '.join(map(str, perm))}}})"


def _graph_and_scatter(text: str):
    graph = build_op_graphs(parse_hlo(text))[0]
    return graph, next(n.id for n in graph.nodes if n.opcode == "scatter")


def test_sorted_segments_cost_more_than_distinct_updates_of_the_same_bytes():
    n, length = 10_000 * 64, 64
    spec = get_spec("h100")
    seg_graph, seg = _graph_and_scatter(_scatter(n, n, _segments(n, length)))
    got = scatter_contention(seg_graph, seg)
    assert got is not None and got.proved and got.native
    assert got.collisions == pytest.approx(length) and got.addresses == n // length
    # A constant permutation: proved distinct, still an atomic scatter by form (the
    # constant is data the row proof does not read as an identity).
    seed = int(np.random.default_rng().integers(1 << 30))
    perm_graph, perm = _graph_and_scatter(_scatter(4096, 4096, _permutation(4096, seed)))
    uncontended = scatter_contention(perm_graph, perm)
    assert uncontended is not None and uncontended.collisions == pytest.approx(1.0)
    assert uncontended.seconds(spec) == 0.0
    sorted_cost = CostModel(seg_graph, spec, xla_atomics=True).kernel([seg])
    # Stitch adds the sorted segments in runs: a fraction of XLA's atomics wait.
    runs_cost = CostModel(seg_graph, spec).kernel([seg])
    assert 0.0 < runs_cost.contention_s < sorted_cost.contention_s / 4
    # The same scatter with ids the proof cannot read (a parameter), into as many rows as
    # updates: assumed one update per address, the same bytes.
    free_graph, free = _graph_and_scatter(_scatter(n, n, f"ids = s32[{n}] copy(p)"))
    free_cost = CostModel(free_graph, spec, xla_atomics=True).kernel([free])
    assert sorted_cost.hbm_bytes == free_cost.hbm_bytes
    assert free_cost.contention_s == 0.0
    assert sorted_cost.contention_s > 0.0
    assert sorted_cost.total_s > 1.5 * free_cost.total_s


def test_unknown_ids_assume_updates_over_operand_rows():
    n, rows = 8192, 128
    graph, v = _graph_and_scatter(_scatter(n, rows, f"ids = s32[{n}] copy(p)"))
    got = scatter_contention(graph, v)
    assert got is not None and not got.proved
    assert got.collisions == pytest.approx(n / rows)
    assert got.seconds(get_spec("h100")) > 0.0


def test_longer_segments_and_cas_loops_cost_more():
    spec = get_spec("a100")
    n = 1 << 18
    times = {}
    for length in (16, 64, 256):
        graph, v = _graph_and_scatter(_scatter(n, n, _segments(n, length)))
        times[length] = CostModel(graph, spec, xla_atomics=True).kernel([v]).total_s
    assert times[16] < times[64] < times[256]
    graph, v = _graph_and_scatter(_scatter(n, n, _segments(n, 64), combiner="mul"))
    cas = scatter_contention(graph, v, spec.compute_capability[0])
    assert cas is not None and not cas.native
    assert CostModel(graph, spec, xla_atomics=True).kernel([v]).total_s > 2 * times[64]


def test_latency_evaluator_charges_contention_of_stitch_kernels():
    spec = get_spec("h100")
    n = 1 << 18
    seg_graph, seg = _graph_and_scatter(_scatter(n, n, _segments(n, 64)))
    free_graph, free = _graph_and_scatter(_scatter(n, n, f"ids = s32[{n}] copy(p)"))
    contended = schedule_kernel(seg_graph, [seg], spec).modeled_us
    plain = schedule_kernel(free_graph, [free], spec).modeled_us
    # Stitch's kernel adds the sorted segments in runs (sorted_runs.RUN_ROWS per thread).
    expected = scatter_contention(seg_graph, seg).in_runs(RUN_ROWS).seconds(spec) * 1e6
    assert expected > 0.1
    assert contended == pytest.approx(plain + expected, rel=0.05)


def test_known_index_values_through_integer_arithmetic():
    rng = np.random.default_rng()
    n, length = int(rng.integers(50, 300)), int(rng.integers(2, 9))
    text = f"""HloModule m
ENTRY e {{
  i = s32[{n}] iota(), iota_dimension=0
  l = s32[] constant({length})
  lb = s32[{n}] broadcast(l), dimensions={{}}
  q = s32[{n}] divide(i, lb)
  r = s32[{n}] remainder(i, lb)
  zero = s32[] constant(0)
  zb = s32[{n}] broadcast(zero), dimensions={{}}
  neg = s32[{n}] subtract(zb, q)
  lt = pred[{n}] compare(neg, zb), direction=LT
  k = s32[] constant(1000)
  kb = s32[{n}] broadcast(k), dimensions={{}}
  wrapped = s32[{n}] add(neg, kb)
  sel = s32[{n}] select(lt, wrapped, neg)
  p = s32[{n}] parameter(0)
  mixed = s32[{n}] add(q, p)
  ROOT t = (s32[{n}], s32[{n}], s32[{n}], s32[{n}]) tuple(q, r, sel, mixed)
}}"""
    graph = build_op_graphs(parse_hlo(text))[0]
    by_name = {node.name: node.id for node in graph.nodes}
    i = np.arange(n)
    for name, want in (("q", i // length), ("r", i % length),
                       ("sel", np.where(-(i // length) < 0, 1000 - i // length, 0))):
        values, known = known_index_values(graph, by_name[name])
        assert known.all(), name
        np.testing.assert_array_equal(values, want, err_msg=name)
    assert not known_index_values(graph, by_name["mixed"])[1].any()


@pytest.mark.parametrize("length", [4, 64, 512])
def test_a_scatter_kernel_reads_every_update_however_few_rows_it_writes(length):
    from stitch.cost.hbm_traffic import kernel_hbm_bytes
    n = int(np.random.default_rng().integers(1 << 12, 1 << 16)) // length * length
    graph, v = _graph_and_scatter(_scatter(n, n // length, _segments(n, length)))
    members = frozenset(w for w in range(len(graph.nodes))
                        if graph.nodes[w].opcode not in ("parameter",))
    moved = kernel_hbm_bytes(graph, members)
    # Every f32 update read once, the rows written once (ids computed in the kernel).
    assert moved >= 4 * n + 4 * (n // length)
    assert moved <= 4 * n + 4 * (n // length) + 64
