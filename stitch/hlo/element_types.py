"""Which HLO element types stitch's kernels can hold, and which bit reinterpretations
between them are exact: the one rule codegen applies when it lowers a kernel and the
planner's feasibility asks before it offers one (so the planner never plans a kernel
codegen refuses for its types).

It lives in the HLO layer because both sides need it and ``stitch`` may not import
``codegen``. Codegen maps each HLO type to its kernel IR storage dtype through
``CODEGEN_STORAGE``; every other type (u64, s16, f8..., complex) has no kernel IR dtype.
"""
from __future__ import annotations

from .ir import Shape

# HLO element type -> kernel IR storage dtype (stitch.codegen.kir's names).
CODEGEN_STORAGE: dict[str, str] = {
    "f32": "f32", "f64": "f64", "f16": "f16", "bf16": "bf16", "s32": "i32", "s64": "i64",
    "s8": "i8", "u8": "u8", "u32": "u32", "pred": "i1"}

# Types a kernel holds in registers as something other than their stored bits (f16/bf16
# widen to f32; pred is a 1-bit predicate stored as a byte): no bit reinterpretation.
NOT_HELD_AS_BITS: frozenset[str] = frozenset({"f16", "bf16", "pred"})

# Bit widths of the types a kernel can reinterpret bit for bit (same width only).
REINTERPRET_WIDTHS: dict[str, int] = {"f32": 32, "s32": 32, "u32": 32, "f64": 64, "s64": 64,
                                      "s8": 8, "u8": 8}


def type_problem(element_type: str) -> str | None:
    """Why codegen cannot hold HLO element type ``element_type`` (None when it can)."""
    if element_type in CODEGEN_STORAGE:
        return None
    return f"element type {element_type} is not supported by codegen"


def shape_problem(shape: Shape) -> str | None:
    """The first leaf type of ``shape`` codegen cannot hold, as a reason (None if none)."""
    if not shape.is_tuple:
        return type_problem(shape.element_type)
    for leaf in shape.leaves():
        problem = type_problem(leaf.element_type)
        if problem:
            return problem
    return None


def reinterpret_problem(src: str, dst: str) -> str | None:
    """Why a kernel cannot reinterpret HLO element type ``src`` as ``dst`` bit for bit
    (None when it can: both held as their stored bits, of one width)."""
    for t in (src, dst):
        problem = type_problem(t)
        if problem:
            return problem
    if src in NOT_HELD_AS_BITS or dst in NOT_HELD_AS_BITS:
        return f"{src} or {dst} is not held as its stored bits"
    if REINTERPRET_WIDTHS[src] != REINTERPRET_WIDTHS[dst]:
        return f"{src} and {dst} differ in width"
    return None


def changes_element_type(opcode: str, operand: Shape, result: Shape) -> bool:
    """Whether ``opcode`` reads its operand's bits as another element type (XLA's
    bitcast-convert, or a ``bitcast`` whose element type differs)."""
    if opcode not in ("bitcast-convert", "bitcast") or operand.is_tuple or result.is_tuple:
        return False
    return operand.element_type != result.element_type
