"""What a combiner computation (a reduce's or scatter's ``to_apply``) computes, and which
reductions stitch's kernels generate: the one rule the evaluator's fast paths, codegen and
the planner's feasibility read (the planner never offers a kernel holding a reduction
codegen refuses, such as argmax's variadic (value, index) reduce).

It lives in the HLO layer because ``stitch`` may not import ``codegen``.
"""
from __future__ import annotations

from .element_types import CODEGEN_STORAGE
from .ir import Computation

# Binary ops a two-parameter computation may consist of.
BINARY_KINDS = frozenset({"add", "multiply", "maximum", "minimum", "and", "or", "xor"})

# Combiner kind -> kernel IR binary op, for the reductions codegen generates (reduce and
# reduce-window with one input and one init).
GENERATED_REDUCERS: dict[str, str] = {"add": "add", "multiply": "mul", "maximum": "max",
                                      "minimum": "min", "and": "and", "or": "or"}

# Scatter combiner kind -> kernel IR binary op ("assign" and "keep" pick a side), for the
# scatters codegen generates; where updates may collide only "add", atomically, for the
# element types with an atomic add (ATOMIC_ADD_TYPES; kir.ATOMIC_DTYPES is this set).
GENERATED_SCATTER_COMBINERS: dict[str, str] = {
    "add": "add", "multiply": "mul", "maximum": "max", "minimum": "min", "and": "and",
    "or": "or", "assign": "", "keep": ""}
ATOMIC_ADD_TYPES: frozenset[str] = frozenset({"f32", "f64", "s32", "s64", "u32", "bf16", "f16"})
assert ATOMIC_ADD_TYPES <= set(CODEGEN_STORAGE)

# Float significand bits: an op computed in a type with at least 2p + 2 of them and rounded
# back equals the op correctly rounded in the narrow type (+ and *; max/min are exact).
_FLOAT_BITS = {"f16": 11, "bf16": 8, "f32": 24, "f64": 53}
_WIDENED_KINDS = frozenset({"add", "multiply", "maximum", "minimum"})


def combiner_kind(comp: Computation) -> str | None:
    """``add``/``multiply``/``maximum``/``minimum``/``and``/``or``/``xor`` when the
    two-parameter computation is exactly that op on its parameters — or, for floats, that
    op on the parameters widened to a wider float and converted back (XLA GPU computes a
    bf16 combiner in f32 that way: the same correctly rounded result); ``assign`` when it
    returns parameter 1, ``keep`` for parameter 0; None otherwise (several ops, several
    outputs)."""
    params = comp.parameters
    root = comp.root
    if len(params) != 2 or not all(p.shape.is_array and p.shape.rank == 0 for p in params):
        return None
    p0, p1 = params[0].name, params[1].name
    same_type = (params[0].shape.element_type == params[1].shape.element_type
                 == root.shape.element_type)
    if root.opcode == "parameter":
        return "assign" if root.name == p1 else "keep"
    if same_type and root.opcode in BINARY_KINDS and sorted(root.operands) == sorted([p0, p1]):
        return root.opcode
    if same_type:
        return _widened_float_kind(comp, p0, p1)
    return None


def _widened_float_kind(comp: Computation, p0: str, p1: str) -> str | None:
    """The op of ``convert(op(convert(p0), convert(p1)))`` computed in a float wide enough
    to round exactly once (bf16 in f32), else None."""
    root = comp.root
    narrow = root.shape.element_type
    if root.opcode != "convert" or narrow not in _FLOAT_BITS:
        return None
    by_name = comp.by_name()
    inner = by_name.get(root.operands[0])
    if inner is None or inner.opcode not in _WIDENED_KINDS:
        return None
    wide = inner.shape.element_type
    if wide not in _FLOAT_BITS or _FLOAT_BITS[wide] < 2 * _FLOAT_BITS[narrow] + 2:
        return None
    widened = []
    for name in inner.operands:
        op = by_name.get(name)
        if op is None or op.opcode != "convert" or op.shape.element_type != wide:
            return None
        widened.append(op.operands[0])
    return inner.opcode if sorted(widened) == sorted([p0, p1]) else None


def reduction_problem(operands: int, kind: str | None) -> str | None:
    """Why codegen does not generate a reduce / reduce-window with ``operands`` operands
    and combiner ``kind`` (None when it does): one input and its init, a single-op
    add/multiply/max/min/and/or combiner."""
    if operands != 2 or kind not in GENERATED_REDUCERS:
        return ("only single-output reductions with an add/multiply/max/min/and/or reducer "
                f"are generated (reducer {kind or 'not a single op'}"
                + (f", {operands // 2} inputs)" if operands != 2 else ")"))
    return None


def scatter_problem(kind: str | None, colliding: bool, element_type: str,
                    in_runs: bool = False) -> str | None:
    """Why codegen does not generate a scatter with combiner ``kind`` (None when it does):
    per element (``colliding`` False: no two updates land on one element) any single-op
    combiner or assign/keep; with colliding updates only an atomic add of a type that has
    one (XLA keeps an unspecified one of colliding assignments) — or, added in runs of equal
    ids (``in_runs``, ``sorted_runs``), also maximum and minimum (each run's result combined
    by a compare-and-swap loop)."""
    if kind not in GENERATED_SCATTER_COMBINERS:
        return f"scatter combiner {kind or 'not a single op'} is not generated"
    if colliding and in_runs and kind in ("maximum", "minimum"):
        return None if element_type in ATOMIC_ADD_TYPES else \
            f"atomic scatter-{kind} of {element_type} is not generated"
    if colliding and kind != "add":
        return (f"scatter with combiner {kind} and colliding updates is not generated "
                "(only add is)")
    if colliding and element_type not in ATOMIC_ADD_TYPES:
        return f"atomic scatter-add of {element_type} is not generated"
    return None
