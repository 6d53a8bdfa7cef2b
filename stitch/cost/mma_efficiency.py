"""The fraction of a unit's peak stitch's own GEMM-bound kernels (attention backward, LM-head
backward, GEMM chains) reach: the calibrated value where the target's table has one
(``stitch.cost.calibration``: the GPU kit's ``tensor_cores`` step timed them at real sizes
on that target), else the assumptions below.

    kernel_efficiency("h200", TF32)                      # any kind measured on TF32
    kernel_efficiency("h200", HALF, "lm_head_backward")  # that kind's own where measured

Units are ``stitch.cost.gemm_rates``' precision classes (``precision_class``): ``FP32`` is
the CUDA cores' FMA, every other class the tensor cores through mma.sync.
"""
from __future__ import annotations

import functools

from .calibration import Calibration, load_calibration
from .gemm_rates import FP32

# Assumed (not measured) fractions of the peak: f32 FMA kernels, and mma.sync tensor-core
# kernels (no software pipelining: well below cuBLAS).
FMA_EFFICIENCY = 0.5
MMA_EFFICIENCY = 0.2


def assumed_efficiency(unit: str) -> float:
    return FMA_EFFICIENCY if unit == FP32 else MMA_EFFICIENCY


@functools.lru_cache(maxsize=None)
def _table(target: str) -> Calibration | None:
    return load_calibration(target)


def kernel_efficiency(target: str, unit: str, kind: str | None = None) -> float:
    """The fraction of ``unit``'s peak on ``target`` a stitched GEMM-bound kernel (of
    ``kind``: "attention_backward", "lm_head_backward", "gemm_chain") reaches: measured
    where the target's calibration table has it, else ``assumed_efficiency``."""
    table = _table(target.strip().lower())
    measured = table.efficiency(unit, kind) if table is not None else None
    return measured if measured is not None and measured > 0 else assumed_efficiency(unit)


def forget_tables() -> None:
    """Read the calibration tables again on the next call (after an ingest, in tests)."""
    _table.cache_clear()
