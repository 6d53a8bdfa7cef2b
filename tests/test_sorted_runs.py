"""Scatter-adds over sorted ids known only at run time, added in runs
(stitch.hlo.sorted_runs): variable-length segments (an embedding bag of any bag
sizes, a graph's incoming edges in CSR order) built on the host match jax and the
reference evaluator on fresh inputs with poisoned outputs — empty segments, ids outside
the operand, runs longer than a thread's chunk, and ids that break the sorted promise
(runs only get shorter); the cost model charges stitch's runs fewer atomics than XLA's
one per update; the XLA pass places the kernel in XLA's scatter fusion's stead."""
from __future__ import annotations

import numpy as np
import pytest

from stitch.hlo import evaluate, parse_hlo
from stitch.hlo.graph import build_op_graphs
from stitch.hlo.sorted_runs import RUN_ROWS, run_scatter

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from tests.fixtures import BF16_TOLERANCE, compile_with_cpu_pass  # noqa: E402


def _bag_sum(segments: int, dtype):
    def bag_sum(tokens, bags, table):
        rows = jnp.exp(table.astype(dtype)[tokens])
        return jax.ops.segment_sum(rows, bags, num_segments=segments,
                                   indices_are_sorted=True) * 2
    return bag_sum


def _ids(rng, n: int, segments: int, kind: str) -> np.ndarray:
    if kind == "sorted":          # empty segments between, ids outside on both ends
        return np.sort(rng.integers(-2, segments + 3, n)).astype(np.int32)
    if kind == "long":            # runs much longer than a thread's chunk
        return np.repeat(np.arange(3), [n // 2, 1, n - n // 2 - 1]).astype(np.int32)
    return rng.integers(0, segments, n).astype(np.int32)     # the promise broken


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_variable_length_segments_built_on_the_host(dtype):
    import stitch

    rng = np.random.default_rng()
    segments, vocab = int(rng.integers(5, 60)), int(rng.integers(10, 90))
    n, width = int(rng.integers(2 * RUN_ROWS, 900)), int(rng.integers(1, 9))
    dt = jnp.bfloat16 if dtype == "bf16" else jnp.float32
    fn = _bag_sum(segments, dt)
    tokens = rng.integers(0, vocab, n).astype(np.int32)
    table = (rng.standard_normal((vocab, width)) * 0.5).astype(np.float32)
    bags = _ids(rng, n, segments, "sorted")
    module = parse_hlo(jax.jit(fn).lower(tokens, bags, table).as_text(dialect="hlo"))
    graph = build_op_graphs(module)[0]
    runs = [run_scatter(graph, v) for v in range(len(graph.nodes))
            if graph.nodes[v].opcode == "scatter"]
    assert len(runs) == 1 and runs[0] is not None and runs[0].width == width
    exe = stitch.compile(module, "h100", poison_outputs=True, cache=False)
    assert not exe.fallbacks
    tolerance = BF16_TOLERANCE if dtype == "bf16" else 1e-5
    # The rows as jax rounds them, summed exactly: jax's and the evaluator's bf16 sums add
    # a segment's rows one by one in bf16 and drift once the sum outgrows the rows (a
    # segment of hundreds), so in bf16 the exact sum is the reference.
    rows = np.asarray(jnp.exp(jnp.asarray(table).astype(dt)[tokens]), np.float64)
    for kind in ("sorted", "long", "unsorted"):
        bags = _ids(rng, n, segments, kind)
        got = np.asarray(exe(tokens, bags, table)[0], np.float64)
        exact = np.zeros((segments, width))
        inside = (bags >= 0) & (bags < segments)
        np.add.at(exact, bags[inside], rows[inside])
        exact *= 2
        scale = max(np.abs(exact).max(), 1.0)
        assert np.abs(got - exact).max() <= tolerance * scale * 4, (kind, segments, n, width)
        if dtype == "bf16":
            continue
        want = np.asarray(jax.jit(fn)(tokens, bags, table), np.float64)
        assert np.abs(got - want).max() <= tolerance * scale * 4, (kind, segments, n, width)
        ref = np.asarray(evaluate(module, [tokens, bags, table])[0], np.float64)
        assert np.abs(got - ref).max() <= tolerance * scale * 4, (kind, segments, n, width)


def test_only_sorted_scatters_of_whole_rows_qualify():
    base = jax.jit(lambda x, ids: jax.ops.segment_sum(x, ids, num_segments=7,
                                                      indices_are_sorted=True))
    unsorted = jax.jit(lambda x, ids: jax.ops.segment_sum(x, ids, num_segments=7))
    peak = jax.jit(lambda x, ids: jax.ops.segment_max(x, ids, num_segments=7,
                                                      indices_are_sorted=True))
    # Constant ids of variable-length segments: sorted by proof, without the flag.
    rng = np.random.default_rng()
    sorted_ids = np.sort(rng.integers(0, 7, 40)).astype(np.int32)
    shuffled = rng.permutation(np.arange(40) % 7).astype(np.int32)
    constant_sorted = jax.jit(lambda x, ids: jax.ops.segment_sum(
        x, jnp.asarray(sorted_ids), num_segments=7))
    constant_shuffled = jax.jit(lambda x, ids: jax.ops.segment_sum(
        x, jnp.asarray(shuffled), num_segments=7))
    x, ids = np.ones((40, 3), np.float32), np.zeros(40, np.int32)
    found = {}
    for name, fn in (("base", base), ("unsorted", unsorted), ("max", peak),
                     ("constant sorted", constant_sorted),
                     ("constant shuffled", constant_shuffled)):
        graph = build_op_graphs(parse_hlo(fn.lower(x, ids).as_text(dialect="hlo")))[0]
        found[name] = [run_scatter(graph, v) for v in range(len(graph.nodes))
                       if graph.nodes[v].opcode == "scatter"]
    assert found["base"] and found["base"][0] is not None
    assert found["base"][0].rows == 40 and found["base"][0].width == 3
    assert found["constant sorted"][0] == found["base"][0]
    assert found["unsorted"] == [None] and found["constant shuffled"] == [None]
    assert found["max"][0] is not None and found["max"][0].op == "max"
    assert found["base"][0].op == "add"


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("kind", ["max", "min"])
def test_segment_max_and_min_in_runs_built_on_the_host(dtype, kind, monkeypatch):
    """segment_max / segment_min over sorted data ids: each run's result combined by a
    compare-and-swap loop. Empty segments keep the fill (-inf / +inf), ids outside are
    skipped, a NaN propagates, unsorted ids stay exact; equal to jax and the evaluator."""
    import stitch
    from stitch.codegen import scatter_lowering

    rng = np.random.default_rng()
    segments, n, width = int(rng.integers(5, 60)), int(rng.integers(2 * RUN_ROWS, 900)), \
        int(rng.integers(1, 9))
    dt = jnp.bfloat16 if dtype == "bf16" else jnp.float32
    reduce = jax.ops.segment_max if kind == "max" else jax.ops.segment_min

    def fn(x, ids):
        return reduce(x.astype(dt) * 2, ids, num_segments=segments, indices_are_sorted=True)
    x = rng.standard_normal((n, width)).astype(np.float32)
    ids = _ids(rng, n, segments, "sorted")
    module = parse_hlo(jax.jit(fn).lower(x, ids).as_text(dialect="hlo"))
    runs = []
    original = scatter_lowering.emit_run_scatter

    def spy(em, site, bid, blocks, found):
        runs.append(found)
        return original(em, site, bid, blocks, found)
    monkeypatch.setattr(scatter_lowering, "emit_run_scatter", spy)
    exe = stitch.compile(module, "h100", poison_outputs=True, cache=False)
    assert not exe.fallbacks and [r.op for r in runs] == [kind]
    for ids_kind in ("sorted", "long", "unsorted"):
        ids = _ids(rng, n, segments, ids_kind)
        x = rng.standard_normal((n, width)).astype(np.float32)
        x[rng.integers(0, n), rng.integers(0, width)] = np.nan
        got = np.asarray(exe(x, ids)[0], np.float64)
        want = np.asarray(jax.jit(fn)(x, ids), np.float64)
        ref = np.asarray(evaluate(module, [x, ids])[0], np.float64)
        # Max and min are exact: the same values, infinities and NaNs.
        np.testing.assert_array_equal(got, want, err_msg=ids_kind)
        np.testing.assert_array_equal(got, ref, err_msg=ids_kind)


def test_runs_are_priced_below_xla_atomics():
    from stitch.cost.contention import contention_seconds, scatter_contention
    from stitch.cost.gpu_specs import get_spec

    spec = get_spec("h100")
    fn = _bag_sum(4096, jnp.float32)
    args = (jax.ShapeDtypeStruct((131072,), jnp.int32),
            jax.ShapeDtypeStruct((131072,), jnp.int32),
            jax.ShapeDtypeStruct((1000, 128), jnp.float32))
    graph = build_op_graphs(parse_hlo(jax.jit(fn).lower(*args).as_text(dialect="hlo")))[0]
    scatter = next(v for v in range(len(graph.nodes)) if graph.nodes[v].opcode == "scatter")
    xla = contention_seconds(graph, [scatter], spec, runs=False)
    runs = contention_seconds(graph, [scatter], spec)
    assert xla == pytest.approx(scatter_contention(graph, scatter).seconds(spec))
    # Assumed uniform: 32 updates per bag; in runs of 16 about 3 atomics per element.
    assert 0 < runs < xla / 5


def test_the_pass_places_the_runs_kernel_in_xlas_scatter_fusions_stead(monkeypatch):
    rng = np.random.default_rng()
    segments, vocab, width = int(rng.integers(5, 50)), 60, int(rng.integers(1, 20))
    n = int(rng.integers(100, 800))
    fn = _bag_sum(segments, jnp.float32)
    tokens = rng.integers(0, vocab, n).astype(np.int32)
    bags = _ids(rng, n, segments, "sorted")
    table = rng.standard_normal((vocab, width)).astype(np.float32)
    report, compiled = compile_with_cpu_pass(fn, tokens, bags, table)
    where = f"{segments} bags, {n} tokens, width {width}"
    assert report.placed, (where, report.skipped, report.fallbacks)
    summary = report.summary()
    assert summary["delivered_mem_us"] < summary["xla_mem_us"], (where, summary)
    assert summary["delivered_mem_bytes"] <= summary["xla_mem_bytes"], (where, summary)
    for kind in ("sorted", "unsorted"):
        bags = _ids(rng, n, segments, kind)
        np.testing.assert_allclose(np.asarray(compiled(tokens, bags, table)),
                                   np.asarray(jax.jit(fn)(tokens, bags, table)),
                                   rtol=2e-5, atol=2e-5, err_msg=f"{where}, {kind} ids")


def test_gat_layer_with_variable_degrees_through_the_pass():
    """A GAT layer over a random graph, edges sorted by destination (in-degrees from 0 up),
    through the CPU pass: equal to jax, its segment sums placed as stitch's kernels."""
    rng = np.random.default_rng()
    nodes, heads, per_head = int(rng.integers(5, 40)), 2, 4
    edges = int(rng.integers(nodes, 12 * nodes))
    features = heads * per_head

    def gat(x, w, a_src, a_dst, src, dst):
        h = (x @ w).reshape(nodes, heads, per_head)
        logits = jax.nn.leaky_relu((h * a_src).sum(-1)[src] + (h * a_dst).sum(-1)[dst], 0.2)
        peak = jax.ops.segment_max(logits, dst, num_segments=nodes, indices_are_sorted=True)
        weights = jnp.exp(logits - peak[dst])
        total = jax.ops.segment_sum(weights, dst, num_segments=nodes, indices_are_sorted=True)
        out = jax.ops.segment_sum((weights / total[dst])[..., None] * h[src], dst,
                                  num_segments=nodes, indices_are_sorted=True)
        return out.reshape(nodes, features)

    args = (rng.standard_normal((nodes, features)).astype(np.float32),
            (rng.standard_normal((features, features)) * 0.3).astype(np.float32),
            rng.standard_normal((heads, per_head)).astype(np.float32),
            rng.standard_normal((heads, per_head)).astype(np.float32),
            rng.integers(0, nodes, edges).astype(np.int32),
            np.sort(rng.integers(0, nodes, edges)).astype(np.int32))
    report, compiled = compile_with_cpu_pass(gat, *args)
    where = f"{nodes} nodes, {edges} edges"
    assert report.placed, (where, report.skipped, report.fallbacks)
    assert report.summary()["delivered_mem_us"] < report.summary()["xla_mem_us"], where
    np.testing.assert_allclose(np.asarray(compiled(*args)), np.asarray(jax.jit(gat)(*args)),
                               rtol=2e-4, atol=2e-5, err_msg=where)


def test_segment_max_runs_priced_as_compare_and_swap_below_xla_atomics():
    from stitch.cost.contention import contention_seconds, scatter_contention
    from stitch.cost.gpu_specs import get_spec

    spec = get_spec("h100")

    def fn(x, ids):
        return jax.ops.segment_max(x, ids, num_segments=4096, indices_are_sorted=True)
    args = (jax.ShapeDtypeStruct((131072, 4), jnp.float32),
            jax.ShapeDtypeStruct((131072,), jnp.int32))
    graph = build_op_graphs(parse_hlo(jax.jit(fn).lower(*args).as_text(dialect="hlo")))[0]
    scatter = next(v for v in range(len(graph.nodes)) if graph.nodes[v].opcode == "scatter")
    xla_view = scatter_contention(graph, scatter)
    assert xla_view.native       # XLA's f32 maximum: one hardware atomic per update
    xla = contention_seconds(graph, [scatter], spec, runs=False)
    runs = contention_seconds(graph, [scatter], spec)
    # Stitch's runs: about 3 compare-and-swap rounds per address instead of 32 atomics.
    cas = xla_view.in_runs(RUN_ROWS)
    assert runs == pytest.approx(type(cas)(**{**cas.__dict__, "native": False}).seconds(spec))
    assert 0 < runs < xla
