"""Deviceless XLA GPU (H100): the segmented softmax forward+gradient step (10k segments of
64 members, 4 heads) through stitch's pass. XLA's module keeps its segment reductions as
atomic scatters inside input_scatter fusions; with segments as rows the pass returns
stitched kernels without a scatter in their place, modeled >= 4x faster than XLA's
memory-intensive kernels (contention of XLA's atomics priced)."""
from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from stitch.hlo_passes import parse_hlo  # noqa: E402
from stitch.integration import deviceless  # noqa: E402

from .conftest import TARGET  # noqa: E402

SEGMENTS, LENGTH, HEADS = 10_000, 64, 4


def _step(scores, upstream):
    def forward(s):
        ids = jnp.arange(SEGMENTS * LENGTH, dtype=jnp.int32) // LENGTH
        peak = jax.ops.segment_max(s, ids, num_segments=SEGMENTS, indices_are_sorted=True)
        shifted = jnp.exp(s - peak[ids])
        total = jax.ops.segment_sum(shifted, ids, num_segments=SEGMENTS,
                                    indices_are_sorted=True)
        return shifted / total[ids]
    _, vjp = jax.vjp(forward, scores)
    return vjp(upstream)[0]


def _compile(h100_mesh):
    spec = jax.ShapeDtypeStruct((SEGMENTS * LENGTH, HEADS), jnp.float32,
                                sharding=NamedSharding(h100_mesh, P()))
    return deviceless.compile_with_pass(jax.jit(_step).lower(spec, spec),
                                        "segment_softmax_grad", TARGET)


def test_segmented_softmax_step_is_stitched_without_atomics(h100_mesh, monkeypatch):
    monkeypatch.delenv("STITCH_SEGMENT_ROWS", raising=False)
    result = _compile(h100_mesh)
    report = result.report
    summary = report.summary()
    assert report.segment_rows, summary
    assert report.placed, (summary, report.skipped, report.fallbacks)
    # Every atomic scatter fusion of XLA's is replaced (XLA's gathers may stay in the
    # elementwise fusion the pass leaves to XLA: they collide on nothing).
    final = parse_hlo(result.text)
    assert not [i for _, i in final.instructions() if i.opcode == "scatter"]
    assert summary["delivered_mem_us"] * 4 <= summary["xla_mem_us"], summary


def test_segment_rows_off_keeps_xla_scatters_and_prices_xla_alike(h100_mesh, monkeypatch):
    monkeypatch.delenv("STITCH_SEGMENT_ROWS", raising=False)
    on = _compile(h100_mesh).report.summary()
    monkeypatch.setenv("STITCH_SEGMENT_ROWS", "0")
    off = _compile(h100_mesh)
    assert off.report.segment_rows == []
    assert off.report.summary()["xla_mem_us"] == pytest.approx(on["xla_mem_us"])
    assert on["delivered_mem_us"] < off.report.summary()["delivered_mem_us"]
