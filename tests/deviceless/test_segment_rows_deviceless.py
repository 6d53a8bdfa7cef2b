"""Deviceless XLA GPU (H100): the segmented softmax forward+gradient step (10k segments of
64 members with 4 heads, the zoo's size; 50k segments of 128 with one score, jax#37511's)
through stitch's pass. XLA's module keeps its segment reductions as atomic scatters inside
input_scatter fusions; with segments as rows the pass returns one stitched kernel for the
whole step, without a scatter, modeled >= 4x faster than XLA's memory-intensive kernels
(contention of XLA's atomics priced)."""
from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from stitch.hlo import parse_hlo  # noqa: E402
from stitch.xla_pass import deviceless  # noqa: E402

from .conftest import TARGET, assert_no_spills  # noqa: E402

ZOO = (10_000, 64, 4)
ISSUE = (50_000, 128, 1)


def _step(segments: int, length: int):
    def forward(s):
        ids = jnp.arange(segments * length, dtype=jnp.int32) // length
        peak = jax.ops.segment_max(s, ids, num_segments=segments, indices_are_sorted=True)
        shifted = jnp.exp(s - peak[ids])
        total = jax.ops.segment_sum(shifted, ids, num_segments=segments,
                                    indices_are_sorted=True)
        return shifted / total[ids]

    def step(scores, upstream):
        _, vjp = jax.vjp(forward, scores)
        return vjp(upstream)[0]
    return step


def _compile(h100_mesh, size=ZOO, dtype=jnp.float32):
    segments, length, heads = size
    spec = jax.ShapeDtypeStruct((segments * length, heads), dtype,
                                sharding=NamedSharding(h100_mesh, P()))
    return deviceless.compile_with_pass(jax.jit(_step(segments, length)).lower(spec, spec),
                                        "segment_softmax_grad", TARGET)


@pytest.mark.parametrize("size,dtype", [(ZOO, jnp.float32), (ISSUE, jnp.float32),
                                        (ZOO, jnp.bfloat16)],
                         ids=["10kx64x4-f32", "50kx128-f32", "10kx64x4-bf16"])
def test_segmented_softmax_step_is_one_kernel_without_atomics(h100_mesh, monkeypatch, size,
                                                              dtype):
    monkeypatch.delenv("STITCH_SEGMENT_ROWS", raising=False)
    result = _compile(h100_mesh, size, dtype)
    report = result.report
    summary = report.summary()
    assert len(report.segment_rows) == 5, summary        # 2 forward, 3 in the gradient
    assert report.placed, (summary, report.skipped, report.fallbacks)
    # The whole step is one stitched kernel: XLA's scatter fusions, its elementwise fusion
    # and the id, mask and fill fusions nothing reads any more are gone.
    final = parse_hlo(result.text)
    calls = [i for _, i in final.instructions() if i.opcode == "custom-call"]
    assert len(calls) == 1 and summary["kernels_after"] == 1, (summary, report.skipped)
    assert not [i for _, i in final.instructions() if i.opcode in ("scatter", "fusion")]
    assert summary["delivered_mem_us"] * 4 <= summary["xla_mem_us"], summary
    # Reads scores and upstream once, writes the gradient once (nothing in between).
    itemsize = jnp.dtype(dtype).itemsize
    assert summary["delivered_mem_bytes"] <= 3 * itemsize * size[0] * size[1] * size[2] \
        + 1024, summary
    assert_no_spills(report)


def test_segment_rows_off_keeps_xla_scatters_and_prices_xla_alike(h100_mesh, monkeypatch):
    monkeypatch.delenv("STITCH_SEGMENT_ROWS", raising=False)
    on = _compile(h100_mesh).report.summary()
    monkeypatch.setenv("STITCH_SEGMENT_ROWS", "0")
    off = _compile(h100_mesh)
    assert off.report.segment_rows == []
    assert off.report.summary()["xla_mem_us"] == pytest.approx(on["xla_mem_us"])
    assert on["delivered_mem_us"] < off.report.summary()["delivered_mem_us"]
