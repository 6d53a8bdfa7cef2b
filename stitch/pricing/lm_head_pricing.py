"""The LM head + softmax cross-entropy forward (``hlo.lm_head_loss.LmHeadLoss``)
priced with the GEMM-tile model, against XLA's way of computing it.

stitch's kernel is a GEMM chain kernel whose second GEMM has two columns: it walks the
vocabulary with the logits tile in registers and an online softmax, and its "result" is
the two per-row values (lse, picked). ``loss_dims`` states it as such a chain (the label's
compare and select: two instructions per logit between the "GEMMs"; the labels an input of
4 bytes a row), so ``gemm_tile.chain_cost`` and the chain schedule search price it — the
tensor-core rates of ``gemm_rates`` for f32 (TF32) and bf16 operands included. The second
GEMM's 8-column work (one MMA fragment: the narrowest the schedule space has) stands for
the running sums the kernel keeps per row; its result bytes for lse and picked.

XLA's side (``xla_seconds``): the logits GEMM writing [rows, vocab] f32 (``gemm_cost`` at
the assumed library tile), then at least one memory-intensive kernel reading the logits
back (XLA's fused row reductions read them two or three times: a lower bound, so a
fused kernel priced to win here wins against XLA's real schedule).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from stitch.hlo.lm_head_loss import LmHeadLoss

from ..cost.gemm_tile import (LIBRARY_TILE, ChainDims, GemmChainSchedule, TileCost, gemm_cost,
                              warp_columns)
from ..cost.gpu_specs import GpuSpec

log = logging.getLogger(__name__)

# Schedules ptxas may strike before the search gives up.
SPILL_RETRIES = 6
# Thread instructions per logit beyond the online softmax: the label compare and select.
PICK_INSTRUCTIONS = 2.0
# The chain's result width: the least the tensor-core layouts take (one 8-column MMA
# fragment), for the kernel's two per-row results (lse, picked).
ROW_RESULTS = 8
# The vocabulary is priced rounded up to whole MMA k steps of the bf16 shape: the kernel
# computes the masked columns of its last step too.
VOCAB_STEP = 16


def loss_dims(loss: LmHeadLoss, grid_sync: bool = False) -> ChainDims:
    """The forward kernel as a GEMM chain of result width ``ROW_RESULTS`` (module
    docstring); ``grid_sync``: the vocabulary may be split across blocks."""
    vocab = -(-loss.vocab // VOCAB_STEP) * VOCAB_STEP
    return ChainDims(batch=1, m=loss.rows, n=vocab, k=loss.hidden, h=ROW_RESULTS,
                     operand_dtype=loss.operand_dtype, softmax=True,
                     between_instructions=PICK_INSTRUCTIONS, tf32=loss.tf32,
                     result_bytes=1, input_bytes=4.0 * loss.rows, grid_sync=grid_sync)


@dataclass(frozen=True)
class LossPrice:
    dims: ChainDims
    schedule: GemmChainSchedule
    stitched: TileCost          # the fused kernel at its best schedule
    xla_s: float                # XLA's GEMM + logits read back (a lower bound)
    logits_bytes: float         # the [rows, vocab] f32 logits XLA writes and reads

    @property
    def wins(self) -> bool:
        return self.stitched.seconds < self.xla_s


def xla_seconds(spec: GpuSpec, loss: LmHeadLoss) -> float:
    """XLA's logits GEMM (written in f32) and one read of the logits by a memory-intensive
    kernel at the HBM bandwidth, with its launch."""
    gemm = gemm_cost(spec, 1, loss.rows, loss.vocab, loss.hidden, LIBRARY_TILE,
                     loss.operand_dtype, loss.tf32, 4)
    read = 4.0 * loss.rows * loss.vocab / spec.hbm_bandwidth
    return gemm.seconds + read + spec.kernel_launch_overhead_s


def builds(schedule: GemmChainSchedule) -> bool:
    """Whether the loss kernel's codegen builds the schedule: the flat order ("n(k,h)"), no
    warp columns (tensor cores: threads = 2 * block_m)."""
    return schedule.expression == "n(k,h)" and warp_columns(schedule) == 1


def _built_as(s: GemmChainSchedule) -> tuple:
    return (s.block_m, s.block_n, s.block_k, s.threads, s.thread_m, s.thread_n, s.mma,
            s.n_split)


def loss_price(spec: GpuSpec, loss: LmHeadLoss, grid_sync: bool = False,
               method: str = "markov",
               spills: Callable[[GemmChainSchedule], bool] | None = None) -> LossPrice:
    """The fused forward at the best schedule the chain search finds among those the loss
    kernel builds (``builds``), and XLA's side. ``spills`` (the caller's ptxas check: the
    cost layer does not build kernels) strikes schedules ptxas spills, up to
    ``SPILL_RETRIES`` times (the register model misses the loss kernel's row state at 512
    threads). ValueError when none is left."""
    from ..schedule.gemm_chain_space import best_schedule
    dims = loss_dims(loss, grid_sync)
    found = best_schedule(spec, dims, method)
    rejected = frozenset(s for s in {found.schedule, *(found.costed or {})} if not builds(s))
    if found.schedule in rejected and all(s in rejected for s in found.costed or {}):
        # The guided search costed none the kernel builds: the whole pruned space.
        found = best_schedule(spec, dims, "exhaustive")
        rejected = frozenset(s for s in {found.schedule, *(found.costed or {})}
                             if not builds(s))
    for _ in range(SPILL_RETRIES + 1):
        if found.schedule not in rejected:
            if spills is None or not spills(found.schedule):
                break
            log.info("lm head loss on %s: ptxas spills at %s; settling again", spec.name,
                     found.schedule.text())
            # Schedules differing only in what codegen does not carry (stages, the A
            # hoisting) are the same kernel.
            built = _built_as(found.schedule)
            rejected |= {found.schedule} | {x for x in (found.costed or {})
                                            if _built_as(x) == built}
        found = found.without(spec, dims, rejected)
    else:
        raise ValueError("no spill-free schedule of the lm head loss kernel found")
    return LossPrice(dims, found.schedule, found.cost, xla_seconds(spec, loss),
                     4.0 * loss.rows * loss.vocab)
