"""Sorted fixed-length segments as rows inside the XLA pass (stitch.xla_pass.segment_rows):
XLA's optimized module keeps jax's segment_max / segment_sum as atomic scatters inside
fusions; the pass plans from the module with those fusion bodies rewritten as row
reductions, places its kernels into XLA's module by name, and prices XLA's own module for
the XLA side. Checked through the CPU pass on fresh random inputs of random sizes."""
from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from stitch.hlo import evaluate, parse_hlo, print_hlo  # noqa: E402
from stitch.hlo.segments_as_rows import fused_segments_as_rows  # noqa: E402

from tests.fixtures import DATA, compile_with_cpu_pass  # noqa: E402

RTOL, ATOL = 2e-5, 2e-6


def _compile(fn, *args):
    return compile_with_cpu_pass(fn, *args)


def _segment_softmax_grad(count: int, length: int):
    def forward(scores):
        ids = jnp.arange(count * length, dtype=jnp.int32) // length
        peak = jax.ops.segment_max(scores, ids, num_segments=count, indices_are_sorted=True)
        shifted = jnp.exp(scores - peak[ids])
        total = jax.ops.segment_sum(shifted, ids, num_segments=count,
                                    indices_are_sorted=True)
        return shifted / total[ids]

    def segment_softmax_grad(scores, upstream):
        _, vjp = jax.vjp(forward, scores)
        return vjp(upstream)[0]
    return segment_softmax_grad


def _placed_opcodes(report) -> set[str]:
    placed = set(report.placed)
    return {gp.graph.nodes[m].opcode for gp in report.plan.graphs
            for k in gp.stitched.kernels if k.name in placed for m in k.members}


def test_segment_softmax_grad_is_stitched_as_rows(monkeypatch):
    monkeypatch.delenv("STITCH_SEGMENT_ROWS", raising=False)
    rng = np.random.default_rng()
    count, length, width = (int(rng.integers(3, 50)), int(rng.integers(2, 40)),
                            int(rng.integers(1, 5)))
    fn = _segment_softmax_grad(count, length)
    scores = rng.standard_normal((count * length, width)).astype(np.float32) * 3
    upstream = rng.standard_normal((count * length, width)).astype(np.float32)
    report, compiled = _compile(fn, scores, upstream)
    where = f"{count} segments of {length} x {width}"
    np.testing.assert_allclose(np.asarray(compiled(scores, upstream)),
                               np.asarray(jax.jit(fn)(scores, upstream)),
                               rtol=RTOL, atol=ATOL, err_msg=where)
    # Both segment reductions of the forward pass and those of the gradient were rows...
    assert len(report.segment_rows) >= 4, (where, report.segment_rows)
    # ...and what was placed holds no scatter (no colliding atomic updates) and no gather.
    assert report.placed, (where, report.skipped, report.fallbacks)
    assert not _placed_opcodes(report) & {"scatter", "gather"}, where
    delivery = report.delivery
    assert delivery.delivered.mem_modeled_us < delivery.xla.mem_modeled_us, where
    assert delivery.delivered.mem_hbm_bytes < delivery.xla.mem_hbm_bytes, where
    assert report.kernels_stitched == 1 and report.kernels_after == 1, (where, report.skipped)

    # The XLA side is XLA's own module: the same figures as with segments as rows off,
    # whose plan keeps XLA's atomic scatters.
    monkeypatch.setenv("STITCH_SEGMENT_ROWS", "0")
    off, compiled_off = _compile(fn, scores, upstream)
    assert off.segment_rows == []
    assert off.kernels_xla == report.kernels_xla
    assert off.delivery.xla.mem_modeled_us == pytest.approx(delivery.xla.mem_modeled_us,
                                                            rel=1e-9)
    assert off.delivery.xla.mem_hbm_bytes == delivery.xla.mem_hbm_bytes
    assert delivery.delivered.mem_modeled_us < off.delivery.delivered.mem_modeled_us, where
    np.testing.assert_allclose(np.asarray(compiled_off(scores, upstream)),
                               np.asarray(jax.jit(fn)(scores, upstream)),
                               rtol=RTOL, atol=ATOL, err_msg=where)


def _ids_forms(count: int, length: int):
    """Segment reductions over sorted fixed-length ids, built the ways jax users build them."""
    n = count * length

    def repeat_softmax(x):
        ids = jnp.repeat(jnp.arange(count), length, total_repeat_length=n)
        total = jax.ops.segment_sum(jnp.exp(x), ids, num_segments=count)
        return jnp.exp(x) / total[ids]

    def at_add_centered(x):
        ids = jnp.arange(n) // length
        total = jnp.zeros((count,) + x.shape[1:], x.dtype).at[ids].add(x)
        return x - total[ids] / length

    def broadcast_ids_max_with_empty_segments(x):
        ids = jnp.broadcast_to(jnp.arange(count)[:, None], (count, length)).reshape(-1)
        peak = jax.ops.segment_max(x, ids, num_segments=count + 3)
        return x - jnp.take(peak, ids, axis=0)

    def segment_layer_norm(x):
        ids = jnp.arange(n) // length
        mean = jax.ops.segment_sum(x, ids, num_segments=count) / length
        centered = x - mean[ids]
        var = jax.ops.segment_sum(centered * centered, ids, num_segments=count) / length
        return centered * jax.lax.rsqrt(var[ids] + 1e-5)

    return [repeat_softmax, at_add_centered, broadcast_ids_max_with_empty_segments,
            segment_layer_norm]


def _check_one_kernel(form: int, x64: bool) -> None:
    rng = np.random.default_rng()
    count, length, width = (int(rng.integers(3, 40)), int(rng.integers(2, 30)),
                            int(rng.integers(1, 5)))
    fn = _ids_forms(count, length)[form]
    x = rng.standard_normal((count * length, width)).astype(np.float32)
    with jax.enable_x64(x64):
        report, compiled = _compile(fn, x)
        where = f"{fn.__name__}: {count} segments of {length} x {width}, x64={x64}"
        np.testing.assert_allclose(np.asarray(compiled(x)), np.asarray(jax.jit(fn)(x)),
                                   rtol=RTOL, atol=ATOL, err_msg=where)
    assert report.segment_rows, (where, report.summary())
    assert not _placed_opcodes(report) & {"scatter", "gather"}, where
    # Everything is stitched, in one kernel unless the model prices that one kernel higher
    # than the kernels chosen (a tiny layer norm's two row reductions, 37 rows of 6: one
    # kernel 3.3 us, two 2.6 us).
    assert report.kernels_stitched == report.kernels_after, (where, report.skipped)
    if report.kernels_after > 1:
        _one_kernel_priced_higher(report, where)


def _one_kernel_priced_higher(report, where: str) -> None:
    from stitch.cost.gpu_specs import get_spec
    from stitch.pricing.delta import CostModel
    (gp,) = [g for g in report.plan.graphs if g.graph.kind == "entry"]
    kernels = [k for k in gp.stitched.kernels if k.kind == "fused"]
    cost = CostModel(gp.graph, get_spec("h100"))
    union = frozenset().union(*(k.members for k in kernels))
    chosen = sum(cost.kernel(frozenset(k.members)).total_s for k in kernels)
    assert gp.graph.is_convex(union) and cost.stitchable(union), where
    assert cost.kernel(union).total_s >= chosen, (where, len(kernels))


@pytest.mark.parametrize("form", range(4))
def test_segment_id_forms_become_one_kernel(form, monkeypatch):
    """jnp.repeat ids (cumulative sums, a scatter of starts and a gather: proved by
    evaluating them), `.at[ids].add`, broadcast ids with empty trailing segments and a
    segmented layer norm: each step is one stitched kernel without atomics, equal to jax."""
    monkeypatch.delenv("STITCH_SEGMENT_ROWS", raising=False)
    _check_one_kernel(form, x64=False)


@pytest.mark.parametrize("form", [0, 3])
def test_segment_id_forms_under_x64_become_one_kernel(form, monkeypatch):
    """The same with jax_enable_x64: s64 ids, and jnp.repeat's proof walks about a hundred
    producers (clamps to the s64 range, a convert to s32)."""
    monkeypatch.delenv("STITCH_SEGMENT_ROWS", raising=False)
    _check_one_kernel(form, x64=True)


@pytest.mark.parametrize("ids", ["modulo", "data"])
def test_other_scatters_are_left_as_they_were(ids, monkeypatch):
    """Ids that are not sorted fixed-length segments (proved otherwise, or data even with
    indices_are_sorted=True) stay scatters: nothing is planned as rows."""
    monkeypatch.delenv("STITCH_SEGMENT_ROWS", raising=False)
    rng = np.random.default_rng()
    count, length = int(rng.integers(3, 30)), int(rng.integers(2, 20))
    n = count * length
    x = rng.standard_normal((n, 3)).astype(np.float32)
    if ids == "modulo":
        def scatter_modulo(x):
            seg = jnp.arange(n, dtype=jnp.int32) % count
            total = jax.ops.segment_sum(jnp.exp(x), seg, num_segments=count)
            return jnp.exp(x) / total[seg]
        fn, args = scatter_modulo, (x,)
    else:
        seg = np.sort(rng.integers(0, count, n)).astype(np.int32)

        def scatter_data(x, seg):
            total = jax.ops.segment_sum(jnp.exp(x), seg, num_segments=count,
                                        indices_are_sorted=True)
            return jnp.exp(x) / total[seg]
        fn, args = scatter_data, (x, seg)
    report, compiled = _compile(fn, *args)
    assert report.segment_rows == []
    np.testing.assert_allclose(np.asarray(compiled(*args)), np.asarray(jax.jit(fn)(*args)),
                               rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("target", ["h100", "v100"])
def test_xla_gpu_module_rewritten_in_fusion_bodies_only(target):
    """XLA GPU's deviceless module of the segmented softmax step: every scatter is proved
    (its ids computed in its own fusion, the bounds mask in a zero-operand fusion), the
    top-level instructions are unchanged, and the rewritten module computes the same."""
    path = DATA / "segment_softmax_grad" / f"tiny.gpu-{target}.hlo"
    module = parse_hlo(path.read_text())
    rewrite = fused_segments_as_rows(module)
    scatters = [i.name for c in module.computations for i in c.instructions
                if i.opcode == "scatter"]
    assert sorted(rewrite.reductions) == sorted(scatters) and scatters
    assert not any(i.opcode in ("scatter", "gather") for c in rewrite.module.computations
                   for i in c.instructions)
    # Top-level instructions keep their names and called computations (fusions no longer
    # reading XLA's id fusions drop those operands, and the id fusions go), and their
    # shapes, or the same bytes in the segments' shape: the softmax's output fusion
    # returns [count, length, heads] (so the planner's rows reach the kernel's output).
    top = {i.name: i for i in module.entry.instructions}
    kept = {i.name: i for i in rewrite.module.entry.instructions}
    assert all(name in top and top[name].attrs.get("calls") == inst.attrs.get("calls")
               for name, inst in kept.items())
    reshaped = {name for name, inst in kept.items() if inst.shape != top[name].shape}
    assert "loop_add_fusion" in rewrite.rows_outputs and reshaped <= set(rewrite.rows_outputs)
    for name in reshaped:
        assert kept[name].shape.byte_size == top[name].shape.byte_size
        assert kept[name].shape.dims[0] * kept[name].shape.dims[1] == top[name].shape.dims[0]
    assert {i.name for i in module.entry.instructions if i.opcode == "fusion" and
            any(c in i.attrs.get("calls", "") for c in ("scatter", "fused_add"))} <= set(kept)
    rng = np.random.default_rng()
    args = [rng.standard_normal(tuple(p.shape.dims)).astype(np.float32)
            for p in module.entry.parameters]
    want = evaluate(module, args)[0]
    got = evaluate(parse_hlo(print_hlo(rewrite.module)), args)[0]
    np.testing.assert_allclose(np.asarray(got).reshape(want.shape), want,
                               rtol=RTOL, atol=ATOL)
