"""The busiest thread of a kernel as built (stitch.codegen.thread_work) and the bound it puts
on the kernel's time (stitch.cost.latency.thread_bound_seconds): counts on hand-built
kernels whose loops, packed parts and branches give known answers."""
from __future__ import annotations

import pytest

from stitch.codegen import kir
from stitch.codegen.kir import (Binary, BlockIdx, Compare, For, If, Kernel, Let, Load, Local,
                                Param, Ref, Store, ThreadIdx, i32)
from stitch.codegen.thread_work import busiest_thread
from stitch.cost.gpu_specs import get_spec
from stitch.cost.latency import UNROLL, thread_bound_seconds
from tests.test_kir_host import add, elementwise_kernel, mul, warp_softmax_kernel


def _row_stats_then_column_sum(rows: int, cols: int, block: int = 32) -> Kernel:
    """What thread composition of a column reduction over row statistics is: one thread a
    column, and for each row of its column the row's mean recomputed by a loop."""
    x = Param("x", "f32", rows * cols)
    out = Param("out", "f32", cols, is_output=True)
    col = Ref("c", "i32")
    row = Ref("r", "i32")
    k = Ref("k", "i32")
    acc, total = Ref("acc", "f32"), Ref("total", "f32")
    mean_loop = For("k", i32(0), i32(cols), i32(1), [
        kir.Assign("acc", add(acc, Load(x, add(mul(row, i32(cols)), k))))])
    row_loop = For("r", i32(0), i32(rows), i32(1), [
        Local("acc", "f32", kir.f32(0.0)), mean_loop,
        kir.Assign("total", add(total, Binary("sub", Load(x, add(mul(row, i32(cols)), col)),
                                              acc)))])
    body = [Let("c", add(mul(BlockIdx(), i32(block)), ThreadIdx())),
            If(Compare("lt", col, i32(cols)), [Local("total", "f32", kir.f32(0.0)), row_loop,
                                               Store(out, col, total)])]
    return Kernel("colsum", [x, out], [], (cols + block - 1) // block, block, body)


def test_nested_recomputation_multiplies_the_loops() -> None:
    k = _row_stats_then_column_sum(16, 32)
    k.validate()
    work = busiest_thread(k)
    # Per row: the mean loop's 32 loads and the row's own element.
    assert work.loads == 16 * (32 + 1)
    assert work.thread in (0, 31) and work.block == 0


def test_a_thread_past_the_guard_does_nothing() -> None:
    k = _row_stats_then_column_sum(16, 20)          # 32 threads, 20 columns
    assert busiest_thread(k).thread == 0             # thread 31 fails the guard


def test_grid_stride_loop_counts_the_threads_share() -> None:
    n = 100_000
    k = elementwise_kernel("ew", ["f32", "f32"], "f32", n, lambda a, b: add(mul(a, b), a),
                           grid_stride=True)         # 3 blocks of 128
    work = busiest_thread(k)
    stride = 3 * 128
    assert work.loads == 2 * -(-n // stride)         # thread 0: the most iterations


def test_packed_parts_are_told_apart_by_their_block_ranges() -> None:
    x = Param("x", "f32", 4096)
    out = Param("out", "f32", 1, is_output=True)
    light = [Store(out, i32(0), Load(x, i32(0)))]
    heavy = [Local("s", "f32", kir.f32(0.0)),
             For("i", i32(0), i32(4096), i32(1), [
                 kir.Assign("s", add(Ref("s", "f32"), Load(x, Ref("i", "i32"))))]),
             Store(out, i32(0), Ref("s", "f32"))]
    inside = Binary("and", Compare("ge", BlockIdx(), i32(5)), Compare("lt", BlockIdx(), i32(6)))
    body = [If(Compare("lt", BlockIdx(), i32(5)), light), If(inside, heavy)]
    k = Kernel("packed", [x, out], [], 6, 32, body)
    work = busiest_thread(k)
    assert work.block == 5 and work.loads == 4096


def test_warp_kernels_are_light_per_thread() -> None:
    k = warp_softmax_kernel(50, 333, "reduce")
    work = busiest_thread(k)
    assert 0 < work.loads < 50 * 333 / 4             # lanes share each row


def test_the_bound_follows_the_busier_resource() -> None:
    spec = get_spec("h100")
    launch = spec.kernel_launch_overhead_s
    l1 = 33
    assert thread_bound_seconds(spec, 1000, 0) == pytest.approx(
        launch + 1000 * l1 / UNROLL / spec.clock_hz)
    assert thread_bound_seconds(spec, 10, 1e6) == pytest.approx(launch + 1e6 / spec.clock_hz)
    assert thread_bound_seconds(spec, 0, 0) == pytest.approx(launch)
