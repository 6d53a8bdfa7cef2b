"""The GEMM-tile cost model (stitch.cost.gemm_tile): the chain kernel and XLA's GEMMs
respond to what they should (bytes, flops, tensor cores, occupancy), on every target."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from stitch.cost.gemm_tile import (ChainDims, GemmChainSchedule, GemmTile, chain_cost,
                                   chain_registers, chain_smem_bytes, gemm_cost,
                                   tensor_flops_per_clock_per_sm, xla_gemm_tile)
from stitch.cost.gpu_specs import get_spec

ATTENTION = ChainDims(12, 512, 512, 64, 64, softmax=True)
FLAT = GemmChainSchedule("n(k,h)", 64, 64, 64, 64, 128, 4, 8, False, 2, True)


@pytest.mark.parametrize("target", ["v100", "a100", "h100"])
def test_chain_cost_is_finite_and_scales_with_batch(target):
    spec = get_spec(target)
    one = chain_cost(spec, replace(ATTENTION, batch=1), FLAT)
    many = chain_cost(spec, ATTENTION, FLAT)
    assert math.isfinite(one.seconds) and one.seconds > spec.kernel_launch_overhead_s
    # 12x the work: more than 6x the time above launch once the GPU is full, never more
    # than 13x.
    assert many.seconds > one.seconds
    assert many.hbm_bytes == pytest.approx(12 * one.hbm_bytes)
    assert many.flops == pytest.approx(12 * one.flops)


def test_tensor_cores_only_on_sm80_and_sm90():
    assert tensor_flops_per_clock_per_sm(get_spec("v100"), "bf16") is None
    # The whitepaper's per-SM rates, from the published peaks over SMs x clock.
    assert tensor_flops_per_clock_per_sm(get_spec("a100"), "bf16") == pytest.approx(2048, rel=1e-3)
    assert tensor_flops_per_clock_per_sm(get_spec("a100"), "f32") == pytest.approx(1024, rel=1e-3)
    assert not ATTENTION.mma_allowed(get_spec("v100"))
    assert ATTENTION.mma_allowed(get_spec("a100"))
    assert not replace(ATTENTION, tf32=False).mma_allowed(get_spec("h100"))


def test_mma_is_faster_than_fma_on_a_compute_heavy_chain():
    spec = get_spec("a100")
    dims = ChainDims(8, 1024, 1024, 128, 128)
    fma = chain_cost(spec, dims, FLAT)
    mma = chain_cost(spec, dims, replace(FLAT, mma=True, thread_m=1, thread_n=1))
    assert mma.seconds < fma.seconds
    assert fma.bound in ("fma", "shared", "issue")


def test_hoisting_a_removes_its_rereads():
    spec = get_spec("h100")
    plain = chain_cost(spec, ATTENTION, replace(FLAT, hoist_a=False))
    hoisted = chain_cost(spec, ATTENTION, FLAT)
    assert hoisted.l2_bytes < plain.l2_bytes
    assert hoisted.hbm_bytes == pytest.approx(plain.hbm_bytes)


def test_chain_reads_operands_once_and_never_writes_the_scores():
    spec = get_spec("a100")
    cost = chain_cost(spec, ATTENTION, FLAT)
    d = ATTENTION
    # A, B, D read from HBM once, the result written once (operands fit in L2).
    expected = 4 * d.batch * (d.m * d.k + d.k * d.n + d.n * d.h + d.m * d.h)
    assert cost.hbm_bytes == pytest.approx(expected, rel=1e-6)
    # XLA's first GEMM alone writes the score matrix.
    xla = gemm_cost(spec, d.batch, d.m, d.n, d.k, GemmTile())
    assert xla.hbm_bytes >= 4 * d.batch * d.m * d.n


def test_shared_memory_and_registers_limit_the_launch():
    spec = get_spec("a100")
    big = replace(FLAT, block_m=256, block_n=256, threads=1024, thread_m=8, thread_n=8)
    assert chain_smem_bytes(ATTENTION, big) > spec.shared_memory_per_block_optin
    assert chain_cost(spec, ATTENTION, big).bound == "cannot launch"
    assert chain_registers(ATTENTION, FLAT) < 255


def test_small_xla_tiles_reread_operands_through_l2():
    spec = get_spec("h100")
    small = gemm_cost(spec, 12, 512, 512, 64, GemmTile(16, 8, 16, 2, 1))
    large = gemm_cost(spec, 12, 512, 512, 64, GemmTile(128, 128, 32, 8, 3))
    assert small.l2_bytes > 10 * large.l2_bytes
    assert small.seconds > large.seconds


def test_xla_tile_from_backend_config():
    nested = {"fusion_backend_config": {"kind": "__triton_nested_gemm_fusion",
                                        "block_level_fusion_config": {
                                            "num_warps": "2", "num_stages": 1,
                                            "output_tiles": [{"sizes": ["1", "16", "8"]}]}}}
    tile = xla_gemm_tile(nested)
    assert (tile.block_m, tile.block_n, tile.warps, tile.stages) == (16, 8, 2, 1)
    legacy = {"fusion_backend_config": {"kind": "__triton_gemm", "triton_gemm_config": {
        "block_m": "64", "block_n": "32", "block_k": "16", "split_k": "2", "num_stages": "3",
        "num_warps": "4"}}}
    tile = xla_gemm_tile(legacy)
    assert (tile.block_m, tile.block_n, tile.block_k, tile.split_k, tile.warps) == \
        (64, 32, 16, 2, 4)
    assert xla_gemm_tile({}).source == "assumed"


def test_other_inputs_of_the_ops_between_are_read():
    spec = get_spec("a100")
    masked = replace(ATTENTION, input_bytes=4.0 * ATTENTION.batch * ATTENTION.m * ATTENTION.n)
    plain, more = chain_cost(spec, ATTENTION, FLAT), chain_cost(spec, masked, FLAT)
    assert more.hbm_bytes - plain.hbm_bytes == pytest.approx(masked.input_bytes)
    assert more.seconds > plain.seconds


def test_executed_flops_count_the_deep_tilings_recompute():
    spec = get_spec("h100")
    deep = replace(FLAT, expression="nk", block_h=16, hoist_a=True)
    flat = chain_cost(spec, ATTENTION, FLAT)
    assert flat.flops == pytest.approx(ATTENTION.flops)
    # Four h-blocks each compute the first GEMM for their rows.
    d = ATTENTION
    first, second = 2.0 * d.batch * d.m * d.n * d.k, 2.0 * d.batch * d.m * d.n * d.h
    assert chain_cost(spec, ATTENTION, deep).flops == pytest.approx(4 * first + second)
