"""GEMM prices at the target's tensor-core rate: one rule for every GEMM the cost models see.

A GEMM (a dot, XLA's GEMM fusion, a cuBLAS/cuDNN call) runs on the target's tensor cores at
a rate set by its operand type and the precision its dot asks for, or on the CUDA cores
where the target has no tensor cores for that type. Its time is a roofline:

    compute = flops / (peak(type) × ACHIEVABLE_GEMM_FRACTION)
    memory  = HBM bytes / bandwidth
    T       = launch + compute + memory − 0.95 · min(compute, memory)   (XLA's overlap rule)

Every GEMM outside a recognized chain is priced so (``delta.CostModel``); a chain kernel
and the chain's GEMMs as XLA runs them are priced by the GEMM-tile model
(``gemm_tile``), whose tensor-core rates are these peaks per SM and clock and whose times
are never below this roofline.

Precision (``precision_class``): f32 operands run as TF32 on sm_80+ unless the dot asks for
HIGHEST precision or an f32 algorithm (``stitch.hlo.gemm_chains.allows_tf32``); jax's
``jax_default_matmul_precision`` is unset by default, which lowers dots with DEFAULT operand
precision, and XLA GPU then lets cuBLAS/Triton use TF32. bf16/f16 operands take the
half-precision rate, f8 (e4m3/e5m2) the FP8 rate where the target has one. Any other type
(f64, integers) is priced on the CUDA cores at the FP32 rate (an assumption: no such GEMM
is in the steps this model is judged on).

Peak figures are NVIDIA's published *dense* numbers (the datasheets quote 2:4 sparse ones
first: those are halved here). Sources:
- V100 SXM2: "NVIDIA Tesla V100 GPU Accelerator" datasheet — 125 TFLOPS tensor (FP16),
  15.7 FP32; no TF32/BF16/FP8 tensor cores (bf16 and f32 dots run on CUDA cores).
- A100 SXM4 80GB: "NVIDIA A100 Tensor Core GPU" datasheet — BF16/FP16 312, TF32 156,
  FP32 19.5; no FP8.
- H100 SXM5: "NVIDIA H100 Tensor Core GPU" datasheet — BF16/FP16 1,979 sparse (989.5 dense),
  TF32 989 sparse (494.5 dense), FP8 3,958 sparse (1,979 dense), FP32 67.
- H200 SXM: "NVIDIA H200 Tensor Core GPU" datasheet — the same tensor figures as H100 SXM
  (same GH100 SM and clocks; only the memory differs).
The CUDA-core FP32 rate is ``GpuSpec.fp32_flops`` (SMs × FP32 lanes × 2 × clock), which
equals the datasheets' FP32 figures above.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from stitch.hlo.gemm_chains import allows_tf32
from stitch.hlo.graph import OpGraph, OpNode
from stitch.hlo.ir import Instruction, Shape

from .gpu_specs import XLA_MEMORY_COMPUTE_PARALLELISM, GpuSpec

TERA = 1e12

# The share of the published dense peak a large, well-tiled GEMM sustains: cuBLAS/cuBLASLt
# bf16 GEMMs at transformer sizes run at about 75% of the dense peak on H100 SXM
# (~740 of 989 TFLOP/s; FlashAttention-3 reports ~75% for its GEMM-bound kernels), and
# A100's cuBLAS reaches 70-80% of 312. One constant on every target and type, so it cancels
# in any comparison of two GEMM-bound plans; the roofline's memory term covers the small
# GEMMs that never reach it.
ACHIEVABLE_GEMM_FRACTION = 0.75

# Precision classes a GEMM can run in.
HALF = "f16/bf16"        # FP16 or BF16 tensor cores (f32 accumulate)
TF32 = "tf32"            # f32 operands rounded to TF32 on tensor cores
FP8 = "fp8"              # e4m3 / e5m2 tensor cores
FP32 = "f32"             # CUDA cores, no tensor cores

_F8_TYPES = frozenset({"f8e4m3fn", "f8e5m2", "f8e4m3", "f8e4m3fnuz", "f8e5m2fnuz",
                       "f8e4m3b11fnuz", "f8e3m4"})
# Wider types first: a mixed GEMM runs at the rate of its widest operand.
_WIDTH = {FP8: 0, HALF: 1, TF32: 2, FP32: 3}


@dataclass(frozen=True)
class TensorCoreRates:
    """Published dense tensor-core FLOP/s per precision class (absent: no tensor cores)."""
    half: float | None = None
    tf32: float | None = None
    fp8: float | None = None
    # bf16 runs on the tensor cores only where they take it (V100's take f16 alone).
    bf16_on_tensor_cores: bool = True


TENSOR_CORE_RATES: dict[str, TensorCoreRates] = {
    "v100": TensorCoreRates(half=125 * TERA, bf16_on_tensor_cores=False),
    "a100": TensorCoreRates(half=312 * TERA, tf32=156 * TERA),
    "h100": TensorCoreRates(half=989.5 * TERA, tf32=494.5 * TERA, fp8=1979 * TERA),
    "h200": TensorCoreRates(half=989.5 * TERA, tf32=494.5 * TERA, fp8=1979 * TERA),
}


def precision_class(spec: GpuSpec, operand_types: tuple[str, ...], tf32_allowed: bool) -> str:
    """The unit a GEMM with these operand element types runs on, on ``spec``."""
    rates = TENSOR_CORE_RATES.get(spec.name, TensorCoreRates())
    classes = []
    for t in operand_types or ("f32",):
        if t in _F8_TYPES:
            c = FP8 if rates.fp8 else HALF
        elif t == "f16" or (t == "bf16" and rates.bf16_on_tensor_cores):
            c = HALF
        elif t == "f32" and tf32_allowed:
            c = TF32
        else:
            c = FP32
        classes.append(c)
    widest = max(classes, key=_WIDTH.__getitem__)
    return widest if peak_flops(spec, widest) is not None or widest == FP32 else FP32


def peak_flops(spec: GpuSpec, cls: str) -> float | None:
    """Published dense FLOP/s of ``cls`` on ``spec`` (None: the target lacks that unit)."""
    if cls == FP32:
        return spec.fp32_flops
    rates = TENSOR_CORE_RATES.get(spec.name, TensorCoreRates())
    return {HALF: rates.half, TF32: rates.tf32, FP8: rates.fp8}[cls]


def achievable_flops(spec: GpuSpec, cls: str) -> float:
    """FLOP/s a large GEMM of ``cls`` sustains (CUDA cores where the unit is absent)."""
    peak = peak_flops(spec, cls)
    return (peak if peak is not None else spec.fp32_flops) * ACHIEVABLE_GEMM_FRACTION


@dataclass(frozen=True)
class GemmPrecision:
    """The unit a GEMM runs on and how many passes of it each product takes (XLA's
    multi-pass algorithms: bf16×3 emulates f32 with three bf16 products)."""
    unit: str
    passes: int = 1


# XLA's dot algorithms (PrecisionConfig.Algorithm; a dot prints ``algorithm=dot_bf16_bf16_f32_x3``,
# a cuBLAS call's backend config ``ALG_DOT_BF16_BF16_F32_X3``): the operand type each
# product is computed in (f32 with or without TF32) and the passes one product takes.
ALGORITHMS: dict[str, tuple[str, bool, int]] = {
    "dot_bf16_bf16_f32": ("bf16", False, 1), "dot_bf16_bf16_bf16": ("bf16", False, 1),
    "dot_f16_f16_f32": ("f16", False, 1), "dot_f16_f16_f16": ("f16", False, 1),
    "dot_bf16_bf16_f32_x3": ("bf16", False, 3), "dot_bf16_bf16_f32_x6": ("bf16", False, 6),
    "dot_bf16_bf16_f32_x9": ("bf16", False, 9),
    "dot_tf32_tf32_f32": ("f32", True, 1), "dot_tf32_tf32_f32_x3": ("f32", True, 3),
    "dot_f32_f32_f32": ("f32", False, 1),
    "dot_any_f8_any_f8_f32": ("f8e4m3fn", False, 1),
    "dot_any_f8_any_f8_f32_fast_accum": ("f8e4m3fn", False, 1),
}


def dot_algorithm(dot: Instruction) -> str:
    """The algorithm a dot or GEMM call names, normalized (``dot_bf16_bf16_f32_x3``); ""
    when it names none."""
    if dot.opcode == "custom-call":
        cfg = dot.backend_config.get("gemm_backend_config", {})
        config = cfg.get("precision_config", {}) if isinstance(cfg, dict) else {}
        text = str(config.get("algorithm", "")) if isinstance(config, dict) else ""
    else:
        text = str(dot.attrs.get("algorithm", ""))
    text = text.strip().lower().removeprefix("alg_")
    return "" if text in ("", "unset", "alg_unset") else text


@dataclass(frozen=True)
class GemmTime:
    precision: GemmPrecision
    compute_s: float
    memory_s: float
    total_s: float       # launch included


def gemm_time(spec: GpuSpec, flops: float, hbm_bytes: float,
              precision: GemmPrecision | str, launches: int = 1) -> GemmTime:
    """The roofline of one GEMM kernel: its flops (times the algorithm's passes) at the
    achievable rate of its unit, its HBM bytes at the peak bandwidth, overlapped as XLA's
    model overlaps them."""
    if isinstance(precision, str):
        precision = GemmPrecision(precision)
    compute_s = flops * precision.passes / achievable_flops(spec, precision.unit)
    memory_s = hbm_bytes / spec.hbm_bandwidth
    total = launches * spec.kernel_launch_overhead_s + compute_s + memory_s - \
        XLA_MEMORY_COMPUTE_PARALLELISM * min(compute_s, memory_s)
    return GemmTime(precision, compute_s, memory_s, total)


def gemm_dot(graph: OpGraph, node: OpNode) -> tuple[Instruction | None, tuple[Shape, ...]]:
    """The dot a GEMM node computes (itself, the dot in its fusion body, or the GEMM call
    itself) and the shapes of that dot's two operands as the dot reads them (a GEMM fusion
    may convert or transpose its parameters inside: the dot's operands are what count)."""
    if node.opcode in ("dot", "custom-call", "convolution"):
        return node.instruction, tuple(graph.nodes[o].shape for o in node.operands[:2])
    for name in node.instruction.called_computations:
        comp = graph.computations.get(name)
        if comp is None:
            continue
        for inst in comp.instructions:
            if inst.opcode == "dot":
                shapes = {i.name: i.shape for i in comp.instructions}
                return inst, tuple(shapes[o] for o in inst.operands[:2] if o in shapes)
    return None, ()


def dot_flops(dot: Instruction, operands: tuple[Shape, ...]) -> float | None:
    """2 × output elements × contracted size of a ``dot`` instruction; None for others."""
    if dot.opcode != "dot" or len(operands) < 2 or not operands[0].is_array or \
            "lhs_contracting_dims" not in dot.attrs or not dot.shape.is_array:
        return None
    lhs = operands[0]
    return 2.0 * dot.shape.num_elements * math.prod(
        lhs.dims[d] for d in dot.ints("lhs_contracting_dims"))


def gemm_precision(graph: OpGraph, node: OpNode, spec: GpuSpec) -> GemmPrecision:
    """How a GEMM node of ``graph`` runs on ``spec``: the algorithm its dot names where it
    names one the table knows (on CUDA cores where the target lacks that unit), else by its
    operand types and precision setting (``precision_class``; a GEMM whose dot is not
    found, a cuDNN fusion, as a TF32-allowed f32 one)."""
    dot, operands = gemm_dot(graph, node)
    named = ALGORITHMS.get(dot_algorithm(dot)) if dot is not None else None
    if named is not None:
        operand, tf32, passes = named
        unit = precision_class(spec, (operand,), tf32)
        # A multi-pass algorithm on CUDA cores computes each product once in f32.
        return GemmPrecision(unit, passes if unit != FP32 else 1)
    tf32 = dot is None or allows_tf32(dot)
    return GemmPrecision(precision_class(
        spec, tuple(s.element_type for s in operands if s.is_array), tf32))
