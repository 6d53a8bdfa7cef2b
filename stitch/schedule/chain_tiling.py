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

from stitch.codegen.errors import CodegenError
from stitch.codegen.gemm_chain import ChainTiling

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
