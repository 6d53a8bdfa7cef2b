"""Lowering of a GEMM chain (``stitch.hlo.gemm_chains.GemmChain``) to one Kernel IR kernel.

The kernel has FlashAttention's / MCFuser's shape. A block owns batch ``b``, rows
``m0 .. m0 + block_m`` and result columns ``h0 .. h0 + block_h``; it walks n in steps of
``block_n``:

1. the first GEMM's tile S[block_m, block_n]: k in steps of ``block_k``, the block loads A
   and B tiles into shared memory together (zeros past the edges), then every thread adds
   its register tile (f32 FMA, or tensor-core MMAs);
2. the chain program (scale, mask, activation...) on the thread's S elements, in registers;
3. with a softmax, the online softmax: the tile's row maximum (the ``lanes`` threads of a
   row are consecutive lanes of one warp: an xor-shuffle butterfly), a running maximum
   and sum per row, and the accumulator rescaled by exp(old max - new max);
4. P goes to shared memory, a C tile [block_n, block_h] next to it, and every thread adds
   P[its rows, :] x C[:, its columns] into its ``thread_m x thread_h`` accumulator.

At the end each thread stores its accumulator (divided by the row sum for a softmax). A
split-K reduce XLA put after the second GEMM needs nothing: the block sums all of n.

Splitting n across blocks (``ChainTiling.n_split`` = S > 1; not with a row reduction over
n other than a softmax's): S blocks share each output tile (the split index is the minor
digit of blockIdx), split i walking n steps i * c .. (i + 1) * c - 1 (c = ceil(steps / S)).
Phase 1 stores every block's f32 accumulators to a ``kir.GlobalScratch`` of partials
[S, batch, m, h] (after a softmax undivided, with the rows' running max and sum in a second
scratch [S, batch, m, 2]); a ``kir.GridBarrier``; phase 2, the combine: the grid strides
over the outputs, adding each one's S partials in split order (deterministic; no atomics)
— after a softmax weighted by exp(m_i - max m_i) and divided by the weighted sum of the
l_i, FlashDecoding's split-KV combine — applying the output scale and storing in the
output's type. The host runs the phases one after the
other; a GPU launches the kernel once per phase (``grid_sync="relaunch"``: stream order is
the barrier, so the grid need not be resident and ptxas keeps the chain's registers — the
persistent form caps them at nvptx.GRID_BARRIER_MAX_REGISTERS, where chain tiles spill).
The planner splits n only where the target runs grid-barrier kernels (STITCH_GRID_SYNC).
Rows, columns and contractions that do not fill a tile are handled by loading zeros (a
clamped index keeps every load in bounds), masking S columns past n (-inf before a softmax,
0 otherwise) and not storing rows / columns past the edges.

Two thread layouts. FMA (f32, or any type before sm_80): ``t = ty * lanes + tx``; thread
(ty, tx) owns tile rows ``ty * thread_m + i`` and tile columns ``tx + j * lanes``
(interleaved, so a warp's shared-memory reads of one row hit consecutive words); P goes
through shared memory. Tensor cores (``ChainTiling.mma``): ``kir.MmaSync`` m16n8k16 for
bf16/f16 operands, m16n8k8 TF32 for f32 operands (where the chain's dots allow TF32, as
XLA's DEFAULT precision does on sm_80+), a warp per 16 rows, S in the MMA's accumulator
layout, P handed to the second GEMM from registers (see ``MmaChainKernel``).

Row reductions that are not a softmax's (e.g. a layer norm over n) get a pass over n each
before the main one, S recomputed per pass: the row values are then known in the main pass.
"""
from __future__ import annotations

import logging

from stitch.hlo.gemm_chains import GemmChain, needs_row_pass, softmax_parts
from stitch.hlo.graph import OpGraph

from .errors import CodegenError
from .gemm_chain_fma import FmaChainKernel
from .gemm_chain_mma import MmaChainKernel
from .gemm_chain_tiling import SHARED_LIMIT, ChainTiling, sm_number
from .lower import LoweredKernel

__all__ = ["SHARED_LIMIT", "ChainTiling", "layout_class", "lower_gemm_chain", "sm_number"]

log = logging.getLogger(__name__)

_F32 = "f32"


def _math_note(chain: GemmChain, tiling: ChainTiling) -> str:
    if not tiling.mma:
        return ""
    return ", TF32 tensor cores" if chain.operand_dtype == _F32 else ", tensor cores"


def lower_gemm_chain(graph: OpGraph, chain: GemmChain, tiling: ChainTiling | None = None,
                     name: str = "gemm_chain", arch: str = "sm_80") -> LoweredKernel:
    """One Kernel IR kernel computing ``chain`` (params: ``chain.inputs`` then the output)."""
    tiling = tiling or ChainTiling.default_for(chain, arch)
    tiling.check(chain.operand_dtype)
    if tiling.mma and sm_number(arch) < 80:
        raise CodegenError(f"{name}: tensor-core MMA (mma.sync bf16/f16/tf32) needs sm_80+, "
                           f"not {arch}")
    if tiling.mma and chain.operand_dtype == _F32 and not chain.tf32:
        raise CodegenError(f"{name}: the chain's dots ask for full f32 precision (HIGHEST or "
                           f"an f32 algorithm): no TF32 tensor cores")
    if tiling.warp_cols > 1 and softmax_parts(chain.program) is None and any(
            op.kind == "reduce" for op in chain.program):
        raise CodegenError(f"{name}: warp columns split n, and a row reduction other than a "
                           f"softmax's needs all of n in one warp")
    if tiling.n_split > 1 and softmax_parts(chain.program) is None and any(
            op.kind == "reduce" for op in chain.program):
        raise CodegenError(f"{name}: n is split across blocks, and a row reduction over n "
                           f"other than a softmax's needs every block's share of the row")
    if chain.extra_outputs and (tiling.n_split > 1 or tiling.warp_cols > 1):
        raise CodegenError(f"{name}: the chain also writes values read outside, which needs "
                           f"all of n in one warp and one block (no warp columns, no n split)")
    layout = MmaChainKernel if tiling.mma else FmaChainKernel
    kernel = layout(graph, chain, tiling, name).build()
    softmax = ("softmax, row pass first" if needs_row_pass(chain) and softmax_parts(
        chain.program, through_convert=True) is not None else
               "online softmax" if chain.softmax else "no softmax")
    also = f", also writes {len(chain.extra_outputs)} value(s)" if chain.extra_outputs else ""
    note = (f"gemm chain {chain.batch}x{chain.m}x{chain.n}x{chain.k}x{chain.h} "
            f"({softmax}{also}), tiles "
            f"m{tiling.block_m} n{tiling.block_n} k{tiling.block_k} h{tiling.block_h}, "
            f"{tiling.threads} threads{_math_note(chain, tiling)}"
            f"{f', n split over {tiling.n_split} blocks' if tiling.n_split > 1 else ''}")
    log.debug("%s: %s", name, note)
    return LoweredKernel(kernel, list(chain.inputs),
                         [chain.output, *(out.node for out in chain.extra_outputs)],
                         ["gemm_chain"], [note])


def layout_class(tiling: ChainTiling) -> type:
    """The thread layout a tiling asks for (tensor cores or FMA): its S tile on the threads,
    its first GEMM and its row reductions over lanes. Kernels that walk the first GEMM's
    columns without a second GEMM (``codegen/lm_head_loss.py``) subclass it; they set the
    attributes ``layout``/``first_gemm`` read (``chain.a/.b/.m/.n/.k/.operand_dtype``,
    ``t``, ``params``, ``sa``/``sb``, ``batch``, ``m0``, ``h0``) themselves."""
    return MmaChainKernel if tiling.mma else FmaChainKernel
