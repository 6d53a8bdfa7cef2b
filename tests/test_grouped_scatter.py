"""Scatters whose update rows fall into groups of distinct ids, generated without atomics
in column tiles (stitch.hlo.grouped_scatter): an expert-choice MoE combine, jax's
``top_k`` indices scattered back with ``.at[].add`` / ``.at[].max``, built on the host
with poisoned outputs and fresh inputs, matches jax and the reference evaluator — tokens
several experts chose, tokens none chose, row ranges and ragged column tiles, ids past the
operand; what is not proved distinct stays atomic; the cost model prices the tiles below
XLA's atomics and at least at their blocks' chain of round trips; the XLA pass places the
kernel in XLA's scatter fusion's stead."""
from __future__ import annotations

import numpy as np
import pytest

from stitch.hlo import evaluate, parse_hlo
from stitch.hlo.graph import build_op_graphs
from stitch.hlo.grouped_scatter import grouped_scatter

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from tests.fixtures import BF16_TOLERANCE, compile_with_cpu_pass  # noqa: E402


def _combine(capacity: int, rows: int, kind: str = "add", dtype=jnp.float32):
    """The MoE combine as users write it: each expert's top ``capacity`` tokens, their
    gate-weighted rows scattered back into ``rows`` token rows."""
    def combine(probs, out):
        gates, chosen = jax.lax.top_k(probs.T, capacity)           # [experts, capacity]
        weighted = (out.astype(dtype) * gates[..., None].astype(dtype))
        weighted = weighted.reshape(-1, out.shape[-1])
        zeros = jnp.zeros((rows, out.shape[-1]), dtype)
        at = zeros.at[chosen.reshape(-1)]
        return at.add(weighted) if kind == "add" else at.max(weighted)
    return combine


@pytest.fixture
def tiled(monkeypatch):
    """(scatter name, blocks, work items) of every scatter lowered in column tiles."""
    from stitch.codegen import scatter_lowering
    calls: list[tuple[str, int, int]] = []
    lowering = scatter_lowering.emit_grouped_scatter

    def spy(em, site, bid, blocks, tiles):
        calls.append((site.graph.nodes[site.v].name, blocks, tiles.items))
        return lowering(em, site, bid, blocks, tiles)
    monkeypatch.setattr(scatter_lowering, "emit_grouped_scatter", spy)
    return calls


def _scatters(module):
    graph = build_op_graphs(module)[0]
    return graph, [v for v in range(len(graph.nodes)) if graph.nodes[v].opcode == "scatter"]


@pytest.mark.parametrize("case", [
    # tokens, experts, capacity, width, operand rows, combiner, dtype
    (40, 4, 16, 24, 40, "add", "f32"),          # one range, 3 column tiles
    (300, 3, 200, 20, 300, "add", "f32"),       # several row ranges, a ragged tile
    (257, 5, 100, 33, 257, "max", "f32"),       # maximum, ragged
    (90, 4, 60, 9, 70, "add", "f32"),           # ids past the operand's 70 rows: dropped
    (200, 4, 120, 17, 200, "add", "bf16"),      # bf16 rows, combined in bf16
])
def test_grouped_scatter_built_on_the_host(case, tiled):
    import stitch

    tokens, experts, capacity, width, rows, kind, dtype = case
    dt = jnp.bfloat16 if dtype == "bf16" else jnp.float32
    rng = np.random.default_rng()
    fn = _combine(capacity, rows, kind, dt)
    probs = rng.random((tokens, experts)).astype(np.float32)
    out = rng.standard_normal((experts, capacity, width)).astype(np.float32)
    module = parse_hlo(jax.jit(fn).lower(probs, out).as_text(dialect="hlo"))
    graph, scatters = _scatters(module)
    tiles = [grouped_scatter(graph, v) for v in scatters]
    assert len(tiles) == 1 and tiles[0] is not None, module.name
    assert tiles[0].groups == experts and tiles[0].width == width
    exe = stitch.compile(module, "h100", poison_outputs=True, cache=False)
    assert tiled and not exe.fallbacks
    for _ in range(2):                       # fresh inputs each call
        probs = rng.random((tokens, experts)).astype(np.float32)
        out = rng.standard_normal((experts, capacity, width)).astype(np.float32)
        got = np.asarray(exe(probs, out)[0], np.float64)
        ref = np.asarray(evaluate(module, [probs, out])[0], np.float64)
        want = np.asarray(jax.jit(fn)(probs, out), np.float64)
        tolerance = BF16_TOLERANCE if dtype == "bf16" else 1e-5
        scale = max(np.abs(want).max(), 1.0)
        assert np.abs(got - ref).max() <= tolerance * scale * 4, case
        assert np.abs(got - want).max() <= tolerance * scale * 4, case
        # Tokens no expert chose keep the zero fill (not the poison).
        _, chosen = jax.lax.top_k(probs.T, capacity)
        untouched = np.setdiff1d(np.arange(rows), np.asarray(chosen))
        assert not np.any(got[untouched]), case


def test_only_proved_distinct_groups_qualify():
    rng = np.random.default_rng(0)
    probs = rng.random((64, 4)).astype(np.float32)
    out = rng.standard_normal((4 * 16, 8)).astype(np.float32)
    def sorted_ids(keys, dimension):
        iota = jax.lax.broadcasted_iota(jnp.int32, keys.shape, dimension)
        return jax.lax.sort((keys, iota), dimension=dimension, num_keys=1)[1]

    cases = {
        # a sort along the minor dim with an iota payload: a permutation per row, its
        # first 16 kept
        "sorted rows": (lambda p, u: jnp.zeros((64, 8)).at[
            sorted_ids(p.T, 1)[:, :16].reshape(-1)].add(u), True),
        "top_k": (lambda p, u: jnp.zeros((64, 8)).at[
            jax.lax.top_k(p.T, 16)[1].reshape(-1)].add(u), True),
        # data ids (an input): may repeat within a group
        "data ids": (lambda p, u: jnp.zeros((64, 8)).at[
            (p.T[:, :16] * 64).astype(jnp.int32).reshape(-1)].add(u), False),
        # a sort along the major dim: values repeat along the minor dim
        "major sort": (lambda p, u: jnp.zeros((64, 8)).at[
            sorted_ids(p.T, 0)[:, :16].reshape(-1)].add(u), False),
        # top-k indices shifted by data: distinctness is not proved
        "shifted": (lambda p, u: jnp.zeros((64, 8)).at[
            (jax.lax.top_k(p.T, 16)[1] + (p.T[:, :16] > 0.5)).reshape(-1)].add(u), False),
    }
    for name, (fn, expected) in cases.items():
        module = parse_hlo(jax.jit(fn).lower(probs, out).as_text(dialect="hlo"))
        graph, scatters = _scatters(module)
        assert len(scatters) == 1, name
        assert (grouped_scatter(graph, scatters[0]) is not None) is expected, name


def test_tiles_are_priced_below_xla_atomics_and_at_their_chain():
    from stitch.cost.contention import tiles_prices
    from stitch.pricing.delta import CostModel
    from stitch.cost.gpu_specs import get_spec
    from stitch.explorer.planner import holds_own_scatter
    from stitch.schedule.tuner import schedule_kernel

    fn = _combine(2048, 8192)
    probs = jax.ShapeDtypeStruct((8192, 8), jnp.float32)
    out = jax.ShapeDtypeStruct((8, 2048, 512), jnp.float32)
    module = parse_hlo(jax.jit(fn).lower(probs, out).as_text(dialect="hlo"))
    graph, scatters = _scatters(module)
    v = scatters[0]
    spec = get_spec("h100")
    members = frozenset({v})
    assert holds_own_scatter(graph, members)
    stitch_cost = CostModel(graph, spec).kernel(members)
    xla_cost = CostModel(graph, spec, xla_atomics=True).kernel(members)
    assert stitch_cost.total_s < xla_cost.total_s and xla_cost.contention_s > 0
    (tiles,) = tiles_prices(graph, members, spec)
    assert tiles.chain_s > 0 and tiles.extra_s > 0
    assert stitch_cost.total_s >= tiles.chain_s + tiles.extra_s
    schedule = schedule_kernel(graph, members, spec)
    tiling = grouped_scatter(graph, v)
    assert schedule.block == 1024 and schedule.grid == tiling.items
    assert schedule.modeled_us * 1e-6 >= tiles.chain_s


def test_the_pass_places_the_tiles_in_xlas_scatter_fusions_stead(tiled):
    """XLA CPU's module (its top-k a ``TopK`` custom call): the pass's kernel holds the
    grouped scatter and the module it returns matches jax."""
    from stitch.models.segment_models import moe_layer

    rng = np.random.default_rng()
    tokens, dim, hidden, experts, capacity = 300, 20, 12, 3, 200

    def fn(x, router, w_in, w_out):
        return moe_layer(x, router, w_in, w_out, capacity)
    args = [rng.standard_normal(s).astype(np.float32) for s in
            [(tokens, dim), (dim, experts), (experts, dim, hidden), (experts, hidden, dim)]]
    report, compiled = compile_with_cpu_pass(fn, *args, name="moe_combine")
    assert tiled and report.kernels_stitched >= 1, report.summary()
    assert report.summary()["delivered_mem_us"] < report.summary()["xla_mem_us"]
    for _ in range(2):
        args = [rng.standard_normal(a.shape).astype(np.float32) for a in args]
        got = np.asarray(compiled(*args))
        want = np.asarray(jax.jit(fn)(*args))
        assert np.abs(got - want).max() <= 1e-5 * max(np.abs(want).max(), 1.0)


def test_scatters_too_large_to_prove_are_atomic_without_computing_their_indices():
    """Index tensors of billions of elements (as in XLA's own scatter tests) are unknown
    without being allocated: every proof declines, the scatter stays atomic."""
    from stitch.cost.contention import scatter_contention
    from stitch.hlo.scatter_forms import scatter_form
    from stitch.hlo.sorted_runs import run_scatter

    text = """HloModule huge_indices

add {
  lhs = f32[] parameter(0)
  rhs = f32[] parameter(1)
  ROOT sum = f32[] add(lhs, rhs)
}

ENTRY main {
  operand = f32[4096,4096,64] parameter(0)
  indices = s32[2048,2048,1024,3] parameter(1)
  updates = f32[2048,2048,1024] parameter(2)
  ROOT scattered = f32[4096,4096,64] scatter(operand, indices, updates),
    update_window_dims={}, inserted_window_dims={0,1,2},
    scatter_dims_to_operand_dims={0,1,2}, index_vector_dim=3, to_apply=add
}
"""
    graph, scatters = _scatters(parse_hlo(text))
    (v,) = scatters
    assert scatter_form(graph, v).kind == "atomic"
    assert grouped_scatter(graph, v) is None and run_scatter(graph, v) is None
    contention = scatter_contention(graph, v)
    assert contention is not None and not contention.proved


def test_blocks_taking_several_items_in_turn(monkeypatch, tiled):
    """A grid smaller than the work items: each block walks several (tile, range) items,
    its barriers inside the item loop; the result is the same."""
    import stitch
    from stitch.schedule import tuner

    original = tuner._loop_work

    def fewer_blocks(facts, tpb, vw, tiles=None):
        got = original(facts, tpb, vw, tiles)
        if tiles is None or isinstance(got, str):
            return got
        return got[0], max(1, tiles.items // 3)
    monkeypatch.setattr(tuner, "_loop_work", fewer_blocks)
    rng = np.random.default_rng()
    tokens, experts, capacity, width = 300, 3, 200, 40
    fn = _combine(capacity, tokens)
    probs = rng.random((tokens, experts)).astype(np.float32)
    out = rng.standard_normal((experts, capacity, width)).astype(np.float32)
    module = parse_hlo(jax.jit(fn).lower(probs, out).as_text(dialect="hlo"))
    graph, (v,) = _scatters(module)
    assert grouped_scatter(graph, v).items >= 6
    exe = stitch.compile(module, "h100", poison_outputs=True, cache=False)
    assert not exe.fallbacks
    assert tiled and all(blocks * 2 < items for _, blocks, items in tiled), tiled
    got = np.asarray(exe(probs, out)[0], np.float64)
    want = np.asarray(jax.jit(fn)(probs, out), np.float64)
    assert np.abs(got - want).max() <= 1e-5 * max(np.abs(want).max(), 1.0)
