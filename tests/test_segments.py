"""Sorted fixed-length segments as rows (stitch.hlo.segments_as_rows): proved segment scatters
become reductions, their gathers broadcasts, and a segmented softmax (forward and
gradient, as jax writes it) stitches into one kernel whose host build matches jax and the
reference evaluator on fresh random inputs with poisoned outputs."""
from __future__ import annotations

import numpy as np
import pytest

from stitch.hlo import evaluate, parse_hlo, print_hlo
from stitch.hlo.graph import build_op_graphs
from stitch.hlo.segments_as_rows import rewrite_segments, segment_pattern
from stitch.explorer.planner import ExplorerOptions

COMBINER = {"add": "add", "max": "maximum", "min": "minimum"}
IDENTITY = {"add": "0", "max": "-inf", "min": "inf"}


def _segment_scatter(kind: str, rows: int, first: int, count: int, length: int, width: int,
                     init: str | None = None, ids: str = "divide", etype: str = "f32") -> str:
    """scatter-<kind> of ``count * length`` updates of ``width`` elements into ``rows``
    rows; update i lands on row first + i // length (``ids``: how the ids are built)."""
    n = count * length
    init = IDENTITY[kind] if init is None else init
    if ids == "divide":
        build = f"""i = s32[{n}] iota(), iota_dimension=0
  l = s32[] constant({length})
  lb = s32[{n}] broadcast(l), dimensions={{}}
  q = s32[{n}] divide(i, lb)
  f = s32[] constant({first})
  fb = s32[{n}] broadcast(f), dimensions={{}}
  ids = s32[{n}] add(q, fb)"""
    elif ids == "constant":
        values = first + np.arange(n) // length
        build = f"ids = s32[{n}] constant({{{', '.join(map(str, values))}}})"
    else:
        build = ids
    return f"""HloModule m
comb {{
  a = {etype}[] parameter(0)
  b = {etype}[] parameter(1)
  ROOT r = {etype}[] {COMBINER[kind]}(a, b)
}}
ENTRY e {{
  x = {etype}[{n},{width}] parameter(0)
  p = s32[{n}] parameter(1)
  z = {etype}[] constant({init})
  o = {etype}[{rows},{width}] broadcast(z), dimensions={{}}
  {build}
  idx = s32[{n},1] reshape(ids)
  ROOT s = {etype}[{rows},{width}] scatter(o, idx, x), update_window_dims={{1}}, inserted_window_dims={{0}}, scatter_dims_to_operand_dims={{0}}, index_vector_dim=1, indices_are_sorted=true, to_apply=comb
}}"""


def _inputs(module, rng) -> list[np.ndarray]:
    out = []
    for p in module.entry.parameters:
        dims = tuple(p.shape.dims)
        if p.shape.element_type == "s32":
            out.append(rng.integers(0, 4, dims).astype(np.int32))
        else:
            out.append(rng.standard_normal(dims).astype(np.float32))
    return out


@pytest.mark.parametrize("kind", ["add", "max", "min"])
@pytest.mark.parametrize("ids", ["divide", "constant"])
def test_segment_scatters_become_reductions_with_the_same_values(kind, ids):
    rng = np.random.default_rng()
    length = int(rng.integers(1, 9))
    count = int(rng.integers(1, 7))
    first = int(rng.integers(0, 3))
    rows = first + count + int(rng.integers(0, 3))    # rows no update reaches: empty segments
    text = _segment_scatter(kind, rows, first, count, length, int(rng.integers(1, 5)),
                            init="1.5", ids=ids)
    module = parse_hlo(text)
    rewrite = rewrite_segments(module)
    assert rewrite.reductions == ["s"], (length, count, first, rows)
    opcodes = {i.opcode for i in rewrite.module.entry.instructions}
    assert "scatter" not in opcodes and "reduce" in opcodes
    assert "divide" not in opcodes          # the index arithmetic is gone
    assert "scatter" in {i.opcode for i in module.entry.instructions}   # input untouched
    args = _inputs(module, rng)
    want = evaluate(module, args)[0]
    got = evaluate(parse_hlo(print_hlo(rewrite.module)), args)[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("ids", [
    "ids = s32[12] copy(p)",                                          # data
    "ids = s32[12] constant({0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 2})",   # not sorted
    "ids = s32[12] constant({0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3})",   # variable length
])
def test_ids_that_are_not_fixed_sorted_segments_stay_scatters(ids):
    text = _segment_scatter("add", 4, 0, 4, 3, 2, ids=ids)
    rewrite = rewrite_segments(parse_hlo(text))
    assert not rewrite.changed
    assert "scatter" in {i.opcode for i in rewrite.module.entry.instructions}


def test_segment_pattern_reads_iota_floor_division():
    text = """HloModule m
ENTRY e {
  i = s32[24] iota(), iota_dimension=0
  l = s32[] constant(6)
  lb = s32[24] broadcast(l), dimensions={}
  q = s32[24] divide(i, lb)
  ROOT r = s32[24,1] reshape(q)
}"""
    graph = build_op_graphs(parse_hlo(text))[0]
    root = graph.outputs[0]
    pattern = segment_pattern(graph, root, 1)
    assert (pattern.first, pattern.count, pattern.length) == (0, 4, 6)


def _segmented_softmax(segments: int, length: int):
    import jax
    import jax.numpy as jnp
    n = segments * length

    def fn(x):
        ids = jnp.arange(n, dtype=jnp.int32) // length
        m = jax.ops.segment_max(x, ids, num_segments=segments, indices_are_sorted=True)
        e = jnp.exp(x - m[ids])
        s = jax.ops.segment_sum(e, ids, num_segments=segments, indices_are_sorted=True)
        return e / s[ids]

    return fn, n


@pytest.mark.parametrize("stage", ["forward", "gradient"])
def test_segmented_softmax_stitches_into_one_kernel_on_the_host(stage):
    import jax
    import jax.numpy as jnp

    import stitch

    fn, n = _segmented_softmax(48, 32)
    if stage == "gradient":
        weights = np.random.default_rng().standard_normal(n).astype(np.float32)
        fn = jax.grad(lambda x, f=fn: (f(x) * weights).sum())
    module = parse_hlo(jax.jit(fn).lower(jnp.zeros((n,), jnp.float32)).as_text(dialect="hlo"))
    # stitch.plan and stitch.compile rewrite the segments themselves (the default).
    plan = stitch.plan(module, "h100")
    kernels = [k for g in plan.graphs for k in g.stitched.kernels if k.cost.launches]
    assert len(kernels) == 1
    assert all(node.opcode != "scatter" for g in plan.graphs for node in g.graph.nodes)
    kept = stitch.plan(module, "h100", options=ExplorerOptions(segments_as_rows=False))
    assert any(node.opcode == "scatter" for g in kept.graphs for node in g.graph.nodes)
    assert len([k for g in kept.graphs for k in g.stitched.kernels if k.cost.launches]) > 1
    exe = stitch.compile(module, "h100", poison_outputs=True, cache=False)
    assert len(exe.kernels) == 1 and not exe.fallbacks
    x = np.random.default_rng().standard_normal(n).astype(np.float32) * 3
    got = exe(x)[0]
    np.testing.assert_allclose(got, np.asarray(fn(x)), rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(got, evaluate(module, [x])[0], rtol=2e-5, atol=1e-6)


def test_segmented_softmax_step_is_one_kernel_moving_its_inputs_and_outputs_once():
    """Forward and gradient in one module at a size where a warp holds a segment: the
    elementwise ops between the reductions are computed in the segments' shape, so the
    whole step is one kernel reading scores and upstream and writing both results once."""
    import jax

    import stitch
    from bench.plans.segments import measure, segmented_softmax_step_hlo

    segments, length = 500, 64
    n = segments * length
    module = parse_hlo(segmented_softmax_step_hlo(segments, length))
    plan = stitch.plan(module, "h100")
    kernels = [k for g in plan.graphs for k in g.stitched.kernels if k.cost.launches]
    assert len(kernels) == 1
    assert kernels[0].cost.hbm_bytes == pytest.approx(4 * n * 4, rel=1e-3)
    assert kernels[0].schedule is not None
    exe = stitch.compile(module, "h100", poison_outputs=True, cache=False)
    assert len(exe.kernels) == 1 and not exe.fallbacks
    rng = np.random.default_rng()
    scores = (rng.standard_normal(n) * 3).astype(np.float32)
    upstream = rng.standard_normal(n).astype(np.float32)
    got = exe(scores, upstream)
    want = evaluate(module, [scores, upstream])
    ref = jax.jit(lambda s, u: jax.vjp(
        lambda x: _segmented_softmax(segments, length)[0](x), s)[1](u)[0])(scores, upstream)
    np.testing.assert_allclose(got[0], want[0], rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(got[1], want[1], rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose(got[1], np.asarray(ref), rtol=2e-4, atol=1e-6)
    base, kept, rows = measure(50, 16)
    assert base.contention_us > 0 and kept.contention_us > 0 and rows.contention_us == 0
    assert rows.kernels == 1 and rows.modeled_us < kept.modeled_us <= base.modeled_us


def test_modules_xla_optimized_are_left_as_they_are():
    from stitch.hlo.segments_as_rows import segments_as_rows

    text = _segment_scatter("add", 4, 0, 4, 3, 2)
    module = parse_hlo(text)
    assert segments_as_rows(module) is not module
    module.attrs["is_scheduled"] = "true"
    assert segments_as_rows(module) is module


@pytest.mark.parametrize("first,extra", [(0, 0), (2, 1)])
def test_segment_gathers_become_broadcasts_with_the_same_values(first, extra):
    rng = np.random.default_rng()
    count, length, width = int(rng.integers(1, 6)), int(rng.integers(1, 7)), 3
    rows, n = first + count + extra, count * length
    text = f"""HloModule m
ENTRY e {{
  t = f32[{rows},{width}] parameter(0)
  i = s32[{n}] iota(), iota_dimension=0
  l = s32[] constant({length})
  lb = s32[{n}] broadcast(l), dimensions={{}}
  q = s32[{n}] divide(i, lb)
  f = s32[] constant({first})
  fb = s32[{n}] broadcast(f), dimensions={{}}
  ids = s32[{n}] add(q, fb)
  idx = s32[{n},1] reshape(ids)
  ROOT g = f32[{n},{width}] gather(t, idx), offset_dims={{1}}, collapsed_slice_dims={{0}}, start_index_map={{0}}, index_vector_dim=1, slice_sizes={{1,{width}}}
}}"""
    module = parse_hlo(text)
    rewrite = rewrite_segments(module)
    assert rewrite.broadcasts == ["g"]
    opcodes = [i.opcode for i in rewrite.module.entry.instructions]
    assert "gather" not in opcodes and "broadcast" in opcodes
    assert ("slice" in opcodes) == (first != 0 or extra != 0)
    table = rng.standard_normal((rows, width)).astype(np.float32)
    want = evaluate(module, [table])[0]
    got = evaluate(parse_hlo(print_hlo(rewrite.module)), [table])[0]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("etype,kind", [("s32", "add"), ("s32", "max"), ("bf16", "add"),
                                        ("f32", "min")])
def test_segment_scatters_of_other_types(etype, kind):
    rng = np.random.default_rng()
    count, length = int(rng.integers(1, 6)), int(rng.integers(1, 7))
    identity = {"add": "0", "max": "-2147483648" if etype == "s32" else "-inf",
                "min": "inf"}[kind]
    text = _segment_scatter(kind, count + 1, 1, count, length, 2, init=identity, etype=etype)
    module = parse_hlo(text)
    rewrite = rewrite_segments(module)
    assert rewrite.reductions == ["s"]
    ops = {i.opcode for i in rewrite.module.entry.instructions}
    assert "scatter" not in ops and COMBINER[kind] not in ops   # identity fill: no combine
    n = count * length
    if etype == "s32":
        x = rng.integers(-1000, 1000, (n, 2)).astype(np.int32)
    else:
        from stitch.hlo.evaluator.dtypes import numpy_dtype
        x = rng.standard_normal((n, 2)).astype(numpy_dtype(etype))
    ids = np.zeros(n, np.int32)
    want = evaluate(module, [x, ids])[0]
    got = evaluate(parse_hlo(print_hlo(rewrite.module)), [x, ids])[0]
    tol = 1e-2 if etype == "bf16" else 1e-6
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                               rtol=tol, atol=tol)


def test_repeat_ids_are_proved_by_evaluating_their_construction():
    """``jnp.repeat(arange(S), L, total_repeat_length=n)`` builds the ids with cumulative
    sums (reduce-window), a scatter of the segment starts and a gather: the index proof
    evaluates those on known operands, so the segmented softmax over them is one kernel
    without atomics, equal to jax and to the evaluator (poisoned outputs, fresh inputs)."""
    import jax
    import jax.numpy as jnp

    import stitch

    rng = np.random.default_rng()
    count, length = int(rng.integers(3, 30)), int(rng.integers(2, 20))
    n = count * length

    def fn(x):
        ids = jnp.repeat(jnp.arange(count), length, total_repeat_length=n)
        total = jax.ops.segment_sum(jnp.exp(x), ids, num_segments=count)
        return jnp.exp(x) / total[ids]

    module = parse_hlo(jax.jit(fn).lower(jnp.zeros((n, 2), jnp.float32)).as_text(dialect="hlo"))
    assert any(i.opcode == "reduce-window" for c in module.computations for i in c.instructions)
    rewrite = rewrite_segments(module)
    assert rewrite.reductions and rewrite.broadcasts, (count, length)
    exe = stitch.compile(module, "h100", poison_outputs=True, cache=False)
    assert len(exe.kernels) == 1 and not exe.fallbacks
    x = rng.standard_normal((n, 2)).astype(np.float32)
    got = exe(x)[0]
    np.testing.assert_allclose(got, np.asarray(fn(x)), rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(got, evaluate(module, [x])[0], rtol=2e-5, atol=1e-6)
