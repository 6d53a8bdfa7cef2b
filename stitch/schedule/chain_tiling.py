"""A planned GEMM-chain schedule as the tiling codegen builds (stitch.codegen.gemm_chain).

The planner's schedule (stitch.cost.gemm_tile.GemmChainSchedule) names MCFuser's tiling
expression; codegen's ``ChainTiling`` has the same tiles. The flat expression "n(k,h)"
keeps every result column of its m rows in one block (``block_h`` = h); the deep "nk"
binds h-tiles to blocks, which codegen does whenever ``block_h`` < h (each block recomputes
the first GEMM); ``n_split`` blocks share each output tile, each on its share of n (the
cross-block combine after a grid barrier). The search only keeps schedules codegen can build (``buildable``), so the
kernel that runs is the one the cost model priced.

Not carried over: ``stages`` (codegen stages each tile once, no cp.async pipeline) and
``hoist_a`` (codegen reloads A's k-slices per n step); both change speed, not results.
"""
from __future__ import annotations

from typing import Any

from stitch.codegen.errors import CodegenError
from stitch.codegen.gemm_chain import ChainTiling, lower_gemm_chain
from stitch.codegen.lower import LoweredKernel, kernel_identifier
from stitch.hlo.gemm_chains import GemmChain, chain_of
from stitch.hlo.graph import OpGraph

from ..cost.gemm_tile import ChainDims, GemmChainSchedule, warp_columns


def tiling_for(schedule: GemmChainSchedule, h: int) -> ChainTiling:
    """The codegen tiling of ``schedule`` for a chain with ``h`` result columns."""
    block_h = h if schedule.expression != "nk" else schedule.block_h
    return ChainTiling(block_m=schedule.block_m, block_n=schedule.block_n,
                       threads=schedule.threads, thread_m=schedule.thread_m,
                       thread_n=schedule.thread_n, block_k=schedule.block_k,
                       block_h=block_h, mma=schedule.mma, n_split=schedule.n_split)


def buildable(dims: ChainDims, schedule: GemmChainSchedule) -> bool:
    """Whether codegen builds ``schedule`` as planned: its tiling passes codegen's checks
    for the operand type (tensor cores: bf16/f16 m16n8k16; f32 as TF32 m16n8k8, only where
    ``dims.tf32`` — the dots allow it and the caller asked for it)."""
    if schedule.mma and dims.operand_dtype == "f32" and not dims.tf32:
        return False
    if dims.row_reductions and warp_columns(schedule) > 1:
        return False            # codegen refuses: the reduction needs all of n in one warp
    try:
        tiling_for(schedule, dims.h).check(dims.operand_dtype)
    except CodegenError:
        return False
    return True


def lower_planned_chain(graph: OpGraph, kernel: Any, arch: str, *, fma: bool = False,
                        chain: GemmChain | None = None) -> LoweredKernel:
    """A planned ``gemm_chain`` kernel (a ``PlannedKernel``) in Kernel IR, tiled as the
    planner scheduled it; ``fma``: codegen's default FMA tiling instead of tensor cores (a
    kernel that runs on the host in production, where emulated MMA only costs time);
    ``chain``: the kernel's chain as the caller changed it (fewer values written), else
    recognized from its members. Used by ``stitch.compile`` and the XLA pass alike."""
    chain = chain if chain is not None else chain_of(graph, tuple(kernel.members))
    if chain is None:
        raise CodegenError(f"{kernel.name}: its members are no longer one GEMM chain")
    tiling = tiling_for(kernel.chain_schedule, chain.h) \
        if kernel.chain_schedule is not None else None
    if fma and (tiling is None or tiling.mma):
        tiling = ChainTiling.default_for(chain, "sm_70")
    return lower_gemm_chain(graph, chain, tiling, kernel_identifier(kernel.name), arch)
