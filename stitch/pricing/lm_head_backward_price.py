"""The LM head + cross-entropy backward kernel (``codegen.lm_head_backward``) priced with
the attention backward's rule (``attention_backward_jobs.kernel_cost``: its GEMM work at
``stitch.cost.mma_efficiency``'s fraction of the tensor cores' or the f32 peak — measured
where the GPU kit calibrated the target, else assumed —, or its bytes, whichever is longer), against XLA's backward of the same loss.

The kernel's work: per phase the logits (2 rows vocab hidden flops) once per result block
of the hidden dim (``recompute_factor``) and the phase's result GEMM once; two phases (dH,
dE). Its bytes: H and E read by both phases, dH and dE written, lse / g / labels.
XLA's side (``xla_seconds``): the dlogits kernel reading the f32 logits and writing
dlogits (f32, 8 bytes a logit at HBM bandwidth) and the dH and dE GEMMs at the library
tile (``cost.gemm_tile.gemm_cost``), three launches. The forward's logits GEMM is not
counted on either side (the forward kernel prices it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stitch.codegen.attention_backward import BackwardTiling
from stitch.codegen.lm_head_backward import (LmHeadBackward, default_tiling,
                                             recompute_factor, uses_tensor_cores)

from ..cost.gemm_rates import FP32, peak_flops, precision_class
from ..cost.gemm_tile import LIBRARY_TILE, gemm_cost
from ..cost.mma_efficiency import kernel_efficiency
from .delta import KernelCost


@dataclass(frozen=True)
class BackwardPrice:
    tiling: BackwardTiling
    recompute: int          # logits computed this many times per phase
    kernel: Any             # its KernelCost
    xla_s: float            # XLA's dlogits kernel and two GEMMs

    @property
    def wins(self) -> bool:
        return self.kernel.total_s < self.xla_s


def kernel_cost(problem: LmHeadBackward, spec: Any, tiling: BackwardTiling) -> Any:
    """The one-launch kernel's modeled ``KernelCost`` at ``tiling`` (module docstring)."""
    r, v, d = problem.rows, problem.vocab, problem.hidden
    gemm = 2.0 * r * v * d
    flops = 2 * (recompute_factor(problem, tiling) + 1) * gemm
    width = 2 if problem.dtype in ("bf16", "f16") else 4
    moved = width * 2 * (r * d + v * d) + 12 * r
    unit = precision_class(spec, (problem.dtype,), problem.tf32) if tiling.mma else FP32
    rate = (peak_flops(spec, unit) or spec.fp32_flops) * kernel_efficiency(
        spec.name, unit, "lm_head_backward")
    compute_s, memory_s = flops / rate, moved / spec.hbm_bandwidth
    return KernelCost(int(moved), 1, memory_s, compute_s, 0,
                      max(compute_s, memory_s) + spec.kernel_launch_overhead_s)


def xla_seconds(problem: LmHeadBackward, spec: Any) -> float:
    """XLA's dlogits kernel (f32 logits read, dlogits written) and its dH and dE GEMMs."""
    r, v, d = problem.rows, problem.vocab, problem.hidden
    width = 2 if problem.dtype in ("bf16", "f16") else 4
    dlogits = 8.0 * r * v / spec.hbm_bandwidth
    dh = gemm_cost(spec, 1, r, d, v, LIBRARY_TILE, problem.dtype, problem.tf32, width)
    de = gemm_cost(spec, 1, v, d, r, LIBRARY_TILE, problem.dtype, problem.tf32, 4)
    return dlogits + dh.seconds + de.seconds + 3 * spec.kernel_launch_overhead_s


def backward_price(problem: LmHeadBackward, spec: Any, arch: str,
                   allow_tf32: bool = True, tiling: BackwardTiling | None = None
                   ) -> BackwardPrice:
    """The kernel at ``tiling`` (default: the one ``lower_lm_head_backward`` builds on
    ``arch``) and XLA's side."""
    tiling = tiling or default_tiling(problem, uses_tensor_cores(problem, arch, allow_tf32))
    return BackwardPrice(tiling, recompute_factor(problem, tiling),
                         kernel_cost(problem, spec, tiling), xla_seconds(problem, spec))
