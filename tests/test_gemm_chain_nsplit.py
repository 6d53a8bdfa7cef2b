"""n split across blocks in the GEMM chain kernel: ``n_split`` blocks
share each output tile, each summing the second GEMM over its share of n; their f32 partials
go to global scratch, and after a grid barrier the grid adds them in split order and stores
the result (stitch.codegen.gemm_chain, module docstring). Tiny chains with an elementwise op between
the GEMMs and sizes that fill no tile, and a masked softmax (FlashDecoding's split-KV
combine by the splits' row maxima and sums), run on the host target (fresh random inputs, NaN-poisoned
outputs) against the reference evaluator (f32 1e-4, bf16 2e-2); the PTX assembles for sm_80 /
sm_90 without spills; the schedule space and the cost model price the split (more blocks,
the partials' traffic, the combine); and the planner splits n for gemm_chain_g4 on H100 only
where grid sync is allowed."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from stitch.codegen import kir
from stitch.codegen.errors import CodegenError
from stitch.codegen.gemm_chain import ChainTiling, lower_gemm_chain
from stitch.hlo.evaluator import evaluate
from stitch.cost.gemm_tile import (ChainDims, GemmChainSchedule, chain_cost, chain_grid,
                                   partial_bytes)
from stitch.cost.gpu_specs import get_spec
from stitch.schedule.chain_tiling import tiling_for
from stitch.schedule.gemm_chain_space import (ChainSearchSpace, enumerate_schedules,
                                              exhaustive, markov_search)
from tests.test_lowering_gemm_chain import (_EDGE, _GATED, _NORMALIZED, _check, _check_tf32,
                                            _fixture, _load, _narrow, _ptxas_or_skip,
                                            _random_args, run_chain)

# m=19, n=45, k=11, h=7: no tile divides any of them. exp and a gate between the GEMMs.
_ODD = """HloModule odd
ENTRY e {
  a = f32[3,19,11] parameter(0)
  b = f32[3,11,45] parameter(1)
  c = f32[3,45,7] parameter(2)
  gate = f32[3,19,45] parameter(3)
  s = f32[3,19,45] dot(a, b), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
  k = f32[] constant(0.25)
  kb = f32[3,19,45] broadcast(k), dimensions={}
  sc = f32[3,19,45] multiply(s, kb)
  t = f32[3,19,45] tanh(sc)
  p = f32[3,19,45] multiply(t, gate)
  ROOT o = f32[3,19,7] dot(p, c), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}
"""


def _fma(split: int, block_h: int = 8) -> ChainTiling:
    """FMA tiles of 32 rows x 8 n columns (4 lanes per row), k in stages of 4."""
    return ChainTiling(block_m=32, block_n=8, threads=32, thread_m=4, thread_n=2, block_k=4,
                       block_h=block_h, n_split=split)


def _narrow_n(split: int) -> ChainTiling:
    """4-wide n steps (2 lanes per row, 64 rows): n=45 is 12 steps, 3 per split of 4 (the
    last split's last step partly past n)."""
    return ChainTiling(block_m=64, block_n=4, threads=32, thread_m=4, thread_n=2, block_k=4,
                       block_h=8, n_split=split)


def _mma(split: int) -> ChainTiling:
    return ChainTiling(block_m=16, block_n=16, threads=32, thread_m=1, thread_n=1,
                       block_k=16, block_h=8, mma=True, n_split=split)


@pytest.mark.parametrize("split", (2, 4))
@pytest.mark.parametrize("text", (_ODD, _GATED), ids=("odd", "gated"))
def test_f32_split_matches_the_evaluator(text: str, split: int) -> None:
    # n=45 in 8-wide steps: 6 steps, 3 / 2 per split; n=24: 3 steps, the 4th split empty.
    _check(text, seed=40 + split, tol=1e-4, tiling=_fma(split))


@pytest.mark.parametrize("split", (2, 4))
def test_f32_split_every_share_busy_matches_the_evaluator(split: int) -> None:
    _check(_ODD, seed=45 + split, tol=1e-4, tiling=_narrow_n(split))
    _check(_narrow(_ODD, "bf16"), seed=47 + split, tol=2e-2, tiling=_narrow_n(split))


@pytest.mark.parametrize("split", (2, 4))
def test_f32_split_with_h_tiles_matches_the_evaluator(split: int) -> None:
    # block_h 4 < h 7: the deep tiling's h-blocks times the n-splits.
    _check(_ODD, seed=50 + split, tol=1e-4, tiling=_fma(split, block_h=4))


@pytest.mark.parametrize("split", (2, 4))
@pytest.mark.parametrize("text", (_ODD, _GATED), ids=("odd", "gated"))
def test_bf16_split_on_tensor_cores_matches_the_evaluator(text: str, split: int) -> None:
    _check(_narrow(text, "bf16"), seed=60 + split, tol=2e-2, tiling=_mma(split))


@pytest.mark.parametrize("split", (2, 4))
def test_bf16_split_fma_matches_the_evaluator(split: int) -> None:
    _check(_narrow(_ODD, "bf16"), seed=70 + split, tol=2e-2, tiling=_fma(split))


def test_tf32_split_matches_the_evaluator(monkeypatch) -> None:
    tiling = ChainTiling(block_m=16, block_n=8, threads=32, thread_m=1, thread_n=1,
                         block_k=8, block_h=8, mma=True, n_split=4)
    _check_tf32(_ODD, 81, monkeypatch, tiling)


def test_split_kernel_shape_and_determinism() -> None:
    """Phase 1 on tiles x splits blocks, a grid barrier, the combine; the same bits on every
    run and the unsplit kernel's result up to f32 rounding of the sum's order."""
    module, graph, chain = _load(_ODD)
    lowered = lower_gemm_chain(graph, chain, _fma(4), name="chain")
    k = lowered.kernel
    assert k.grid == 3 * 1 * 1 * 4                      # batch x m-tiles x h-tiles x splits
    assert kir.has_grid_barrier(k) and len(kir.grid_phases(k.body)) == 2
    assert k.grid_sync == "relaunch" and kir.launches(k) == 2   # no residency, no maxnreg
    assert [s.size for s in k.scratch] == [4 * 3 * 19 * 7]
    unsplit = lower_gemm_chain(graph, chain, _fma(1), name="chain").kernel
    assert unsplit.grid == 3 and not unsplit.scratch and not kir.has_grid_barrier(unsplit)
    args = _random_args(module, np.random.default_rng(90))
    first = run_chain(module, graph, chain, args, _fma(4))
    again = run_chain(module, graph, chain, args, _fma(4))
    assert np.array_equal(first, again)
    whole = run_chain(module, graph, chain, args, _fma(1))
    np.testing.assert_allclose(first, whole, rtol=1e-5, atol=1e-5)
    want = evaluate(module, args)[0].astype(np.float64).reshape(-1)
    assert np.abs(first - want).max() < 1e-4


@pytest.mark.parametrize("split", (2, 4))
def test_softmax_split_kv_matches_the_evaluator(split: int) -> None:
    """After a masked softmax the splits are combined by their row maxima and sums
    (FlashDecoding); n=24 in 8-wide steps leaves split 4 of 4 empty (max -inf, weight 0)."""
    _check(_EDGE, seed=20 + split, tol=1e-4, tiling=_fma(split))
    _check(_narrow(_EDGE, "bf16"), seed=22 + split, tol=2e-2, tiling=_mma(split))
    # Two warp columns per 16 rows, folded before the block's row state is stored.
    two = ChainTiling(block_m=16, block_n=32, threads=64, thread_m=1, thread_n=1,
                      block_k=16, block_h=8, mma=True, n_split=split)
    _check(_narrow(_EDGE, "bf16"), seed=24 + split, tol=2e-2, tiling=two)
    _, graph, chain = _load(_EDGE)
    kernel = lower_gemm_chain(graph, chain, _fma(split), name="chain").kernel
    assert sorted(b.name for b in kernel.scratch) == ["partials", "row_stats"]


def test_softmax_split_kv_tf32(monkeypatch) -> None:
    tiling = ChainTiling(block_m=16, block_n=8, threads=32, thread_m=1, thread_n=1,
                         block_k=8, block_h=8, mma=True, n_split=2)
    _check_tf32(_EDGE, 83, monkeypatch, tiling)


def test_other_row_reductions_over_n_refuse_the_split() -> None:
    _, graph, chain = _load(_NORMALIZED)
    with pytest.raises(CodegenError, match="split"):
        lower_gemm_chain(graph, chain, _fma(2))


@pytest.mark.parametrize("arch", ("sm_80", "sm_90"))
@pytest.mark.parametrize("dtype", ("f32", "bf16"))
@pytest.mark.parametrize("model", ("gemm_chain_g4", "attention_vit_huge"))
def test_full_size_split_assembles_without_spills(model: str, dtype: str, arch: str) -> None:
    _ptxas_or_skip(arch)
    from stitch.codegen.nvptx import emit_ptx
    from stitch.codegen.toolchain import assemble
    text = _fixture(model, "full", "gpu-h100")
    _, graph, chain = _load(_narrow(text, dtype) if dtype != "f32" else text)
    tiling = ChainTiling(block_m=64, block_n=64, threads=128, thread_m=1, thread_n=1,
                         block_k=16, block_h=64, mma=True, n_split=8) if dtype == "bf16" else \
        ChainTiling(block_m=64, block_n=64, threads=256, thread_m=4, thread_n=4, block_k=16,
                    block_h=64, n_split=8)
    kernel = lower_gemm_chain(graph, chain, tiling, name="chain", arch=arch).kernel
    ptx = emit_ptx(kernel, arch)
    report = assemble(ptx, arch, kernel_name="chain")["chain"]
    assert report.spill_store_bytes == 0 and report.spill_load_bytes == 0, report
    assert 0 < report.registers <= 255


# ------------------------------------------------------------------ schedules and cost

_G4 = dict(batch=1, m=512, n=512, k=256, h=256, operand_dtype="f32")


def test_space_splits_n_only_with_grid_sync_and_no_row_reduction() -> None:
    spec = get_spec("h100")
    for dims in (ChainDims(**_G4), ChainDims(**_G4, grid_sync=True, row_reductions=True)):
        assert not dims.n_splittable
        assert all(s.n_split == 1 for s in enumerate_schedules(spec, dims))
    assert ChainDims(**_G4, grid_sync=True, softmax=True).n_splittable
    dims = ChainDims(**_G4, grid_sync=True)
    splits = {s.n_split for s in enumerate_schedules(spec, dims)}
    assert splits == {1, 2, 4, 8, 16}
    assert all(s.n_split * s.block_n <= dims.n for s in enumerate_schedules(spec, dims))
    # Gensor's construction has the action.
    space = ChainSearchSpace(spec, dims)
    names = {name for name, _ in space.actions(space.initial(), 0)}
    assert "split n" in names
    split = replace(space.initial(), n_split=4)
    assert {"split n", "unsplit n"} <= {name for name, _ in space.actions(split, 0)}


def test_cost_prices_blocks_partials_and_combine() -> None:
    spec = get_spec("h100")
    dims = ChainDims(**_G4, grid_sync=True)
    one = GemmChainSchedule("nk", 64, 64, 16, 128, 128, 1, 1, True, 2, False)
    four = replace(one, n_split=4)
    c1, c4 = chain_cost(spec, dims, one), chain_cost(spec, dims, four)
    assert c4.blocks == 4 * c1.blocks == chain_grid(dims, four)
    assert c4.flops == pytest.approx(c1.flops)             # the same flops, on more SMs
    assert partial_bytes(dims, four) == 4 * 512 * 256 * 4
    assert "combine" in c4.pipes and c4.pipes["combine"] > 0
    # The partials replace the result's write: their f32 tiles written, then read back.
    assert c4.hbm_bytes + c4.l2_bytes > c1.hbm_bytes + partial_bytes(dims, four)
    assert c4.seconds < c1.seconds                          # 16 -> 64 busy SMs
    assert math.isfinite(c4.seconds)
    # The combine is a second launch: its overhead and its pass over the partials.
    assert c4.seconds > 2 * spec.kernel_launch_overhead_s + c4.pipes["combine"] / spec.clock_hz


def test_searches_find_the_split_on_h100() -> None:
    spec = get_spec("h100")
    unsplit = exhaustive(spec, ChainDims(**_G4))
    dims = ChainDims(**_G4, grid_sync=True)
    markov = markov_search(spec, dims)
    assert markov.schedule.n_split > 1
    assert markov.cost.seconds < 0.8 * unsplit.cost.seconds
    assert tiling_for(markov.schedule, dims.h).n_split == markov.schedule.n_split


def test_planner_splits_g4_only_with_grid_sync() -> None:
    import stitch
    from stitch.explorer.planner import ExplorerOptions
    from tests.fixtures import DATA
    text = (DATA / "gemm_chain_g4" / "full.gpu-h100.hlo").read_text()

    def planned(grid_sync: bool) -> GemmChainSchedule:
        plan = stitch.plan(text, "h100", options=ExplorerOptions(
            chain_tf32=True, chain_grid_sync=grid_sync))
        (k,) = [k for g in plan.graphs for k in g.stitched.kernels if k.kind == "gemm_chain"]
        return k.chain_schedule

    assert planned(True).n_split > 1
    assert planned(False).n_split == 1
