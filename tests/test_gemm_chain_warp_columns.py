"""Warp columns in the tensor-core chain kernel (stitch.codegen.gemm_chain, ``ChainTiling.warp_cols``):
several warps share the same 16 rows, each on its own slice of every n step, and the first
folds the others' partial results in at the end (a sum; after a softmax FlashAttention's
split-KV combine of row maxima and sums). Run on the host target with fresh random inputs
and NaN-poisoned outputs against the reference evaluator (bf16 2e-2, TF32 at
``tf32_tolerance``), with slices that are partly and wholly past n; chains with a row
reduction other than a softmax are refused; full-size kernels assemble for sm_80 / sm_90
without spills."""
from __future__ import annotations

import pytest

from stitch.codegen.errors import CodegenError
from stitch.codegen.gemm_chain import ChainTiling, lower_gemm_chain
from stitch.codegen.nvptx import emit_ptx
from stitch.codegen.toolchain import assemble
from tests.test_lowering_gemm_chain import (_EDGE, _GATED, _NORMALIZED, _check, _check_tf32,
                                            _fixture, _load, _narrow, _ptxas_or_skip)

# m=20, n=24, k=10, h=6 in the edge chains. Two warp columns of 16-wide slices (the second
# partly past n); four of 16 (two wholly past n: their rows' maxima stay -inf).
_TWO = ChainTiling(block_m=16, block_n=32, threads=64, thread_m=1, thread_n=1, block_k=16,
                   block_h=8, mma=True)
_FOUR = ChainTiling(block_m=16, block_n=64, threads=128, thread_m=1, thread_n=1, block_k=16,
                    block_h=8, mma=True)
# TF32: two warp rows x two warp columns of 8-wide slices, k stages of 8.
_TF32_GRID = ChainTiling(block_m=32, block_n=16, threads=128, thread_m=1, thread_n=1,
                         block_k=8, block_h=8, mma=True)


def test_warp_columns_from_threads():
    assert (_TWO.warp_cols, _FOUR.warp_cols, _TF32_GRID.warp_cols) == (2, 4, 2)
    assert ChainTiling(block_m=64, block_n=32, threads=128, block_k=16, block_h=64,
                       mma=True).warp_cols == 1
    with pytest.raises(CodegenError):       # three warp columns: not a power of two
        ChainTiling(block_m=16, block_n=48, threads=96, block_k=16, block_h=8,
                    mma=True).check("bf16")
    with pytest.raises(CodegenError):       # 16-wide slices of a 16-wide step: one each
        ChainTiling(block_m=16, block_n=16, threads=64, block_k=16, block_h=8,
                    mma=True).check("bf16")


@pytest.mark.parametrize("tiling", (_TWO, _FOUR), ids=("two", "four"))
@pytest.mark.parametrize("text", (_EDGE, _GATED), ids=("softmax", "gated"))
def test_bf16_warp_columns_match_the_evaluator(text: str, tiling: ChainTiling) -> None:
    _check(_narrow(text, "bf16"), seed=31, tol=2e-2, tiling=tiling)


@pytest.mark.parametrize("text", (_EDGE, _GATED), ids=("softmax", "gated"))
def test_tf32_warp_columns_match_the_evaluator(text: str, monkeypatch) -> None:
    _check_tf32(text, 32, monkeypatch, _TF32_GRID)


@pytest.mark.parametrize("model", ("attention_bert_base", "attention_mlp_mixer_s",
                                   "gemm_chain_g4", "gemm_chain_g9"))
def test_tiny_zoo_chains_with_warp_columns(model: str, monkeypatch) -> None:
    text = _fixture(model, "tiny", "gpu-h100")
    _, _, chain = _load(text)
    tiling = ChainTiling(block_m=16, block_n=16, threads=64, thread_m=1, thread_n=1,
                         block_k=8, block_h=8, mma=True)
    _check_tf32(text, 33 + len(model), monkeypatch, tiling)


def test_row_reduction_refuses_warp_columns() -> None:
    _, graph, chain = _load(_narrow(_NORMALIZED, "bf16"))
    with pytest.raises(CodegenError, match="warp columns"):
        lower_gemm_chain(graph, chain, _TWO)


@pytest.mark.parametrize("arch", ("sm_80", "sm_90"))
@pytest.mark.parametrize("model", ("attention_vit_huge", "gemm_chain_g4"))
def test_full_size_warp_columns_assemble_without_spills(model: str, arch: str) -> None:
    _ptxas_or_skip(arch)
    _, graph, chain = _load(_fixture(model, "full", "gpu-h100"))
    # Two warp columns of 32-wide slices over four warp rows. (ptxas spills 20 B on sm_80
    # at 80 registers with block_m=32, 128 threads here: the chain pricing's spill check
    # strikes such schedules.)
    tiling = ChainTiling(block_m=64, block_n=64, threads=256, thread_m=1, thread_n=1,
                         block_k=16, block_h=16, mma=True)
    assert tiling.warp_cols == 2
    kernel = lower_gemm_chain(graph, chain, tiling, "chain", arch).kernel
    report = assemble(emit_ptx(kernel, arch), arch, kernel_name="chain")["chain"]
    assert report.spill_store_bytes == report.spill_load_bytes == 0
    assert report.registers <= 255


def test_search_space_holds_warp_columns_only_where_codegen_builds_them() -> None:
    from dataclasses import replace

    from stitch.cost.gemm_tile import ChainDims, chain_cost, warp_columns
    from stitch.cost.gpu_specs import get_spec
    from stitch.schedule.gemm_chain_space import enumerate_schedules
    spec = get_spec("h100")
    dims = ChainDims(16, 256, 256, 80, 80, softmax=True)
    columns = [s for s in enumerate_schedules(spec, dims) if warp_columns(s) > 1]
    assert columns, "warp-column schedules are searched"
    s = columns[0]
    one = replace(s, threads=2 * s.block_m)
    # Same flops and grid, more threads, the fold's shared memory on top.
    assert chain_cost(spec, dims, s).flops == chain_cost(spec, dims, one).flops
    assert chain_cost(spec, dims, s).blocks == chain_cost(spec, dims, one).blocks
    assert chain_cost(spec, dims, s).smem_bytes > chain_cost(spec, dims, one).smem_bytes
    normalized = replace(dims, softmax=False, row_reductions=True)
    assert not any(warp_columns(x) > 1 for x in enumerate_schedules(spec, normalized))
