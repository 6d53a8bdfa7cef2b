"""Global stitching scope (issue 19 item 2): the Kernel IR grid barrier and global scratch on
the host target and NVPTX, and stitched kernels whose consumers need every block's data —
lowered as persistent kernels with grid barriers — run on the host against the reference
evaluator with poisoned outputs and fresh random inputs."""
from __future__ import annotations

import numpy as np
import pytest

from codegen import kir
from codegen.errors import CodegenError
from codegen.host import compile_host
from codegen.kir import (Binary, Compare, For, GlobalScratch, GridBarrier, If, Kernel, Let,
                         Load, Local, Assign, Param, Ref, Store, ThreadIdx, WarpReduce, i32)
from codegen.printer import format_kernel

# ---------------------------------------------------------------- Kernel IR


def normalize_kernel(n: int, grid: int, block: int) -> Kernel:
    """out = x / sum(x) with one grid barrier: phase 1, each block reduces its grid-stride
    share (warp reduce, lane 0 of every warp adds into a block slot of the scratch... here
    simply one partial per warp); phase 2, every thread folds the partials and scales."""
    x = Param("x", "f32", n)
    out = Param("out", "f32", n, is_output=True)
    warps = block // 32
    partials = GlobalScratch("partials", "f32", grid * warps)
    tid = ThreadIdx()
    gtid = Binary("add", Binary("mul", kir.BlockIdx(), i32(block)), tid)
    phase1 = (
        Local("acc", "f32", kir.f32(0.0)),
        For("e", gtid, i32(n), i32(grid * block), (
            Assign("acc", Binary("add", Ref("acc", "f32"), Load(x, Ref("e", "i32")))),)),
        WarpReduce("wsum", Ref("acc", "f32"), "add"),
        If(Compare("eq", Binary("rem", tid, i32(32)), i32(0)), (
            Store("partials", Binary("add", Binary("mul", kir.BlockIdx(), i32(warps)),
                                     Binary("div", tid, i32(32))), Ref("wsum", "f32")),)),
    )
    phase2 = (
        Local("total", "f32", kir.f32(0.0)),
        For("p", i32(0), i32(grid * warps), i32(1), (
            Assign("total", Binary("add", Ref("total", "f32"),
                                   Load(partials, Ref("p", "i32")))),)),
        For("e", Binary("add", Binary("mul", kir.BlockIdx(), i32(block)), tid), i32(n),
            i32(grid * block), (
                Store("out", Ref("e", "i32"),
                      Binary("div", Load(x, Ref("e", "i32")), Ref("total", "f32"))),)),
    )
    return Kernel("normalize", (x, out), (), grid, block, (*phase1, GridBarrier(), *phase2),
                  (partials,))


def two_barrier_kernel(n: int, grid: int, block: int) -> Kernel:
    """Three phases: block b writes its index into scratch; after a grid barrier every
    block reads the neighbour's slot (another block's write) into a second scratch; after a
    second barrier every thread writes the sum of all of them — wrong unless both barriers
    hold across blocks."""
    out = Param("out", "i32", n, is_output=True)
    a = GlobalScratch("a", "i32", grid)
    c = GlobalScratch("c", "i32", grid)
    tid = ThreadIdx()
    first = Compare("eq", tid, i32(0))
    b = kir.BlockIdx()
    phase1 = (If(first, (Store("a", b, Binary("add", Binary("mul", b, i32(3)), i32(1))),)),)
    phase2 = (If(first, (Store("c", b, Load(a, Binary("rem", Binary("add", b, i32(1)),
                                                          i32(grid)))),)),)
    phase3 = (
        Local("s", "i32", i32(0)),
        For("p", i32(0), i32(grid), i32(1), (
            Assign("s", Binary("add", Ref("s", "i32"), Load(c, Ref("p", "i32")))),)),
        For("e", Binary("add", Binary("mul", b, i32(block)), tid), i32(n), i32(grid * block),
            (Store("out", Ref("e", "i32"), Binary("add", Ref("s", "i32"), Ref("e", "i32"))),)),
    )
    return Kernel("two_barriers", (out,), (), grid, block,
                  (*phase1, GridBarrier(), *phase2, GridBarrier(), *phase3), (a, c))


def test_grid_barrier_on_host_with_phases_and_blocks():
    rng = np.random.default_rng()
    n, grid, block = 5000, 7, 64
    x = rng.random(n, dtype=np.float32) + 0.5
    out = np.full(n, np.nan, np.float32)
    host = compile_host(normalize_kernel(n, grid, block).validate())
    host(x, out, threads=4)          # asks for 4 workers: the grid still runs as one
    np.testing.assert_allclose(out, x / x.astype(np.float64).sum(), rtol=1e-5)


def test_two_grid_barriers_on_host():
    n, grid, block = 1000, 5, 32
    out = np.full(n, -7, np.int32)
    compile_host(two_barrier_kernel(n, grid, block))(out)
    total = sum(3 * ((b + 1) % grid) + 1 for b in range(grid))
    np.testing.assert_array_equal(out, total + np.arange(n))


def test_grid_barrier_validation():
    k = normalize_kernel(256, 2, 32)
    text = format_kernel(k)
    assert "grid_sync()" in text and "global scratch" in text
    # Nested in control flow: refused.
    nested = Kernel("nested", k.params, (), 2, 32,
                    (If(Compare("eq", kir.BlockIdx(), i32(0)), (GridBarrier(),)),), k.scratch)
    with pytest.raises(CodegenError, match="top-level"):
        nested.validate()
    # A variable defined before a grid barrier is not visible after it.
    crossing = Kernel("crossing", k.params, (), 2, 32,
                      (Let("v", kir.f32(1.0)), GridBarrier(),
                       Store("out", i32(0), Ref("v", "f32"))), k.scratch)
    with pytest.raises(CodegenError, match="undefined variable 'v'"):
        crossing.validate()
    with pytest.raises(CodegenError, match="value dtype"):
        Kernel("bad", k.params, (), 2, 32, (), (GlobalScratch("s", "f16", 4),)).validate()


@pytest.mark.parametrize("arch", ["sm_70", "sm_80", "sm_90"])
def test_grid_barrier_ptx_assembles_without_spills(arch):
    from codegen.nvptx import default_libdevice_path, emit_ptx
    if default_libdevice_path() is None:
        pytest.skip("no libdevice")
    from tests.test_kir_nvptx import assemble
    for kernel in (normalize_kernel(4096, 8, 128), two_barrier_kernel(512, 4, 64)):
        ptx = emit_ptx(kernel, arch)
        # The arrival counter's atomic add, the spin on the generation, the gpu fence.
        assert "atom" in ptx and ("fence" in ptx or "membar" in ptx), ptx
        assert f"{kernel.name}__grid_sync" in ptx
        info = assemble(ptx, arch)
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0
