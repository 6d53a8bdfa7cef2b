"""Result shapes of instructions written without one (``ROOT a = add(x, y)``).

XLA's parser accepts an instruction without a result shape and infers it from the operands
and attributes. ``infer_shape`` does the same for the opcodes whose result is determined that
way; for the others (broadcast, reshape, convert, parameter, custom-call...) the text must
give the shape, and it raises ValueError saying so. Inferred shapes carry no layout (XLA's
default, row-major).
"""
from __future__ import annotations

from typing import Callable, Sequence

from .ir import Instruction, Shape, parse_padding, parse_slice, parse_window
from .opcodes import BINARY_ELEMENTWISE, UNARY_ELEMENTWISE

_SAME_AS_OPERAND = (UNARY_ELEMENTWISE - {"convert", "bitcast-convert", "stochastic-convert",
                                          "real", "imag", "abs", "is-finite"}) | {
    "copy", "reverse", "while", "add-dependency", "optimization-barrier", "domain",
    "all-reduce", "collective-permute", "dynamic-update-slice", "reduce-precision",
    "cholesky", "triangular-solve"}
_SAME_AS_OPERAND_1 = frozenset({"select", "clamp"})
_COMPLEX_PART = {"c64": "f32", "c128": "f64"}
_COMPLEX_OF = {"f32": "c64", "f64": "c128"}


def _array(element_type: str, dims: Sequence[int]) -> Shape:
    return Shape(element_type, tuple(int(d) for d in dims))


def _reduced(inst: Instruction, operands: list[Shape]) -> Shape:
    half = len(operands) // 2
    drop = set(inst.ints("dimensions"))
    results = [_array(init.element_type, [d for i, d in enumerate(op.dims) if i not in drop])
               for op, init in zip(operands[:half], operands[half:])]
    return results[0] if len(results) == 1 else Shape("tuple", tuple_shapes=tuple(results))


def _windowed(inst: Instruction, operands: list[Shape]) -> Shape:
    half = len(operands) // 2
    window = parse_window(inst.attrs["window"], operands[0].rank)
    dims = []
    for size, w in zip(operands[0].dims, window):
        padded = (size - 1) * w.lhs_dilate + 1 + w.pad_low + w.pad_high if size else 0
        span = (w.size - 1) * w.rhs_dilate + 1
        dims.append(max((padded - span) // w.stride + 1, 0) if padded >= span else 0)
    results = [_array(init.element_type, dims) for init in operands[half:]]
    return results[0] if len(results) == 1 else Shape("tuple", tuple_shapes=tuple(results))


def _dot(inst: Instruction, lhs: Shape, rhs: Shape) -> Shape:
    lb, rb = inst.ints("lhs_batch_dims", ()), inst.ints("rhs_batch_dims", ())
    lc, rc = inst.ints("lhs_contracting_dims", ()), inst.ints("rhs_contracting_dims", ())
    dims = [lhs.dims[d] for d in lb]
    dims += [d for i, d in enumerate(lhs.dims) if i not in lb and i not in lc]
    dims += [d for i, d in enumerate(rhs.dims) if i not in rb and i not in rc]
    return _array(lhs.element_type, dims)


def _pad(inst: Instruction, operand: Shape) -> Shape:
    dims = []
    for size, p in zip(operand.dims, parse_padding(inst.attrs["padding"])):
        dims.append(max(p.low + p.high + size + max(size - 1, 0) * p.interior, 0))
    return _array(operand.element_type, dims)


def infer_shape(inst: Instruction, operands: list[Shape],
                callee_root: Callable[[str], Shape]) -> Shape:
    """The result shape XLA infers for ``inst`` from its ``operands``' shapes.

    ``callee_root(name)``: the root shape of a called computation. ValueError when the shape
    is not determined by the operands (the text must give it) or an attribute is missing."""
    op = inst.opcode
    first = operands[0] if operands else None
    try:
        if op == "tuple":
            return Shape("tuple", tuple_shapes=tuple(operands))
        if op == "get-tuple-element":
            return first.tuple_shapes[inst.int("index")]
        if op == "after-all":
            return Shape("token")
        if op in ("get-dimension-size", "partition-id", "replica-id"):
            return Shape("s32" if op == "get-dimension-size" else "u32")
        if op in ("call", "fusion", "map") or (op == "conditional" and
                                                "true_computation" in inst.attrs):
            key = {"call": "to_apply", "fusion": "calls", "map": "to_apply",
                   "conditional": "true_computation"}[op]
            root = callee_root(inst.string(key))
            if op == "map":
                return _array(root.element_type, first.dims)
            return root
        if op == "conditional":
            return callee_root(inst.attrs["branch_computations"].strip("{} ").split(",")[0])
        if first is None:
            raise ValueError("it has no operands")
        if op in _SAME_AS_OPERAND or (op in BINARY_ELEMENTWISE and op not in ("compare",
                                                                              "complex")):
            return first.without_layout()
        if op in _SAME_AS_OPERAND_1:
            return operands[1].without_layout()
        if op == "sort":
            shapes = tuple(s.without_layout() for s in operands)
            return shapes[0] if len(shapes) == 1 else Shape("tuple", tuple_shapes=shapes)
        if op in ("compare", "is-finite"):
            return _array("pred", first.dims)
        if op in ("real", "imag", "abs"):
            return _array(_COMPLEX_PART.get(first.element_type, first.element_type), first.dims)
        if op == "complex":
            return _array(_COMPLEX_OF[first.element_type], first.dims)
        if op == "transpose":
            return _array(first.element_type, [first.dims[d] for d in inst.ints("dimensions")])
        if op == "concatenate":
            axis = inst.ints("dimensions")[0]
            dims = list(first.dims)
            dims[axis] = sum(s.dims[axis] for s in operands)
            return _array(first.element_type, dims)
        if op == "slice":
            return _array(first.element_type,
                          [max((s.limit - s.start + s.stride - 1) // s.stride, 0)
                           for s in parse_slice(inst.attrs["slice"])])
        if op == "dynamic-slice":
            return _array(first.element_type, inst.ints("dynamic_slice_sizes"))
        if op == "pad":
            return _pad(inst, first)
        if op == "dot":
            return _dot(inst, first, operands[1])
        if op == "reduce":
            return _reduced(inst, operands)
        if op == "reduce-window":
            return _windowed(inst, operands)
    except (KeyError, IndexError, AttributeError, TypeError) as exc:
        raise ValueError(f"cannot infer the result shape of {op} {inst.name!r} from its "
                         f"operands and attributes ({type(exc).__name__}: {exc})") from None
    raise ValueError(f"{op} {inst.name!r} has no result shape, and XLA's rules do not "
                     f"determine it from the operands: write the shape")
