"""Op classes: how the planner sees each HLO instruction.

FusionStitching (§4.2) plans memory-intensive work with three kinds of op — light
elementwise, expensive elementwise and reduction — and stops fusion at compute-intensive
and library ops. We add LAYOUT (data movement without arithmetic, the ops whose index maps
matter to codegen), OPAQUE (anything we cannot stitch) and SOURCE (no kernel at all).
"""
from __future__ import annotations

import enum
from typing import Callable

from .ir import Computation, HloModule, Instruction


class OpClass(enum.Enum):
    LIGHT = "light"            # cheap elementwise: recomputing it per thread is free
    EXPENSIVE = "expensive"    # transcendental / multi-instruction elementwise
    REDUCTION = "reduction"
    LAYOUT = "layout"          # moves or re-indexes data, no arithmetic
    COMPUTE = "compute"        # GEMM / convolution (library or Triton GEMM kernels)
    OPAQUE = "opaque"          # we cannot stitch it: control flow, sort, collectives...
    SOURCE = "source"          # parameters and constants: no kernel


LIGHT_OPS = frozenset({
    "add", "subtract", "multiply", "maximum", "minimum", "compare", "select", "clamp",
    "convert", "negate", "abs", "and", "or", "not", "xor", "shift-left",
    "shift-right-arithmetic", "shift-right-logical", "sign", "floor", "ceil",
    "round-nearest-afz", "round-nearest-even", "is-finite", "bitcast-convert",
    "reduce-precision", "real", "imag", "complex", "popcnt", "count-leading-zeros",
    "stochastic-convert",
})

# Divide and rsqrt look like one op but are not one instruction on a GPU: an IEEE f32
# divide is a reciprocal approximation plus Newton refinement and special-case handling
# (and integer divide/remainder a long sequence), rsqrt/sqrt go through the quarter-rate
# special-function unit with range fixes. Recomputing them in every thread that needs them
# (XLA's thread composition) costs real time, which is why FusionStitching §4.2 enumerates
# expensive elementwise ops both as sub-roots (computed once, shared) and as plain ops.
EXPENSIVE_OPS = frozenset({
    "exponential", "exponential-minus-one", "log", "log-plus-one", "logistic", "tanh",
    "erf", "rsqrt", "sqrt", "cbrt", "power", "divide", "remainder", "atan2", "sine",
    "cosine", "tan",
})

REDUCTION_OPS = frozenset({"reduce", "reduce-window"})

LAYOUT_OPS = frozenset({
    "broadcast", "reshape", "bitcast", "transpose", "copy", "slice", "dynamic-slice",
    "dynamic-update-slice", "concatenate", "pad", "iota", "reverse", "gather",
    # Scatter: its element p is the operand's combined with the updates landing on p
    # (stitched when they land one per element, else a kernel of its own with atomics;
    # stitch.hlo.scatter_forms decides which).
    "scatter",
    # Pure forwarding: they name a value, nothing is computed.
    "get-tuple-element", "tuple", "add-dependency", "domain",
})

COMPUTE_OPS = frozenset({"dot", "convolution", "ragged-dot"})

SOURCE_OPS = frozenset({"parameter", "constant", "after-all", "partition-id", "replica-id"})

# Library kernels for GEMMs and convolutions.
COMPUTE_CALL_PREFIXES = ("__cublas", "__cudnn")
# fusion_backend_config.kind of XLA's GEMM fusions (Triton or library).
COMPUTE_FUSION_KINDS = ("__triton_gemm", "__triton_nested_gemm_fusion", "__cublas", "__cudnn")

# Summary order when a fusion/call is classed by its contents (strongest first).
_SUMMARY_ORDER = (OpClass.COMPUTE, OpClass.OPAQUE, OpClass.REDUCTION, OpClass.EXPENSIVE,
                  OpClass.LIGHT, OpClass.LAYOUT, OpClass.SOURCE)

Lookup = Callable[[str], Computation]


def is_kernel_boundary(op_class: OpClass) -> bool:
    """COMPUTE and OPAQUE ops are never stitched into a memory-intensive kernel."""
    return op_class in (OpClass.COMPUTE, OpClass.OPAQUE)


def classify(inst: Instruction, module: HloModule | None = None) -> OpClass:
    """The class of ``inst``; ``module`` is needed to look inside fusions and calls."""
    lookup = module.computation if module is not None else None
    return classify_with(inst, lookup)


# Opcodes whose class does not depend on attributes or called computations.
_CLASS_OF_OPCODE: dict[str, OpClass] = {
    op: cls
    for cls, ops in ((OpClass.LIGHT, LIGHT_OPS), (OpClass.EXPENSIVE, EXPENSIVE_OPS),
                     (OpClass.REDUCTION, REDUCTION_OPS), (OpClass.LAYOUT, LAYOUT_OPS),
                     (OpClass.COMPUTE, COMPUTE_OPS), (OpClass.SOURCE, SOURCE_OPS))
    for op in ops
}


def classify_with(inst: Instruction, lookup: Lookup | None,
                  cache: dict[str, OpClass] | None = None) -> OpClass:
    """``classify`` with a computation lookup (and an optional per-computation cache)."""
    op = inst.opcode
    fixed = _CLASS_OF_OPCODE.get(op)
    if fixed is not None:
        return fixed
    if op == "custom-call":
        target = inst.string("custom_call_target", "")
        return OpClass.COMPUTE if target.startswith(COMPUTE_CALL_PREFIXES) else OpClass.OPAQUE
    if op == "fusion":
        backend = inst.backend_config.get("fusion_backend_config", {})
        kind = backend.get("kind", "") if isinstance(backend, dict) else ""
        if isinstance(kind, str) and kind.startswith(COMPUTE_FUSION_KINDS):
            return OpClass.COMPUTE
        return _summary(inst, lookup, cache)
    if op == "call":
        return _summary(inst, lookup, cache)
    # sort, rng*, fft, while, conditional, select-and-scatter, collectives,
    # async ops, map, unknown opcodes...
    return OpClass.OPAQUE


def _summary(inst: Instruction, lookup: Lookup | None,
             cache: dict[str, OpClass] | None) -> OpClass:
    """A fusion or call classed by its strongest op: any GEMM inside makes it COMPUTE
    (XLA wraps lone dots in kLoop fusions: ``wrapped_dot``), then OPAQUE, REDUCTION..."""
    if lookup is None or not inst.called_computations:
        return OpClass.OPAQUE
    name = inst.called_computations[0]
    if cache is not None and name in cache:
        return cache[name]
    comp = lookup(name)
    found = {classify_with(i, lookup, cache) for i in comp.instructions}
    result = next((c for c in _SUMMARY_ORDER if c in found), OpClass.SOURCE)
    if cache is not None:
        cache[name] = result
    return result
