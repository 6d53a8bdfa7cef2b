"""Index propagation: the Kernel IR expression of an op's element at a given index.

``ValueEmitter.value(v, index)`` returns the expression of element ``index`` (one i32
expression per logical dimension) of op ``v``. Producers inside the kernel are computed
from their own operands at the propagated index (thread composition: every thread
recomputes what it needs, §4.1); values from outside the kernel are loaded from their
buffers (logical row-major). Gathers and dynamic slices read their operand at start
indices clamped as XLA clamps them (in a type wide enough for the index's own type).
Statements the expression needs (Lets, loops of a reduction, guarded loads of
concatenate/pad) are appended to the current statement list; results are
memoized per (op, index) in the current scope, so an element is computed once per thread
and scope, and computed before every enclosing loop whose variables its index does not
read (loop bodies pushed with their loop variable; guarded If bodies are never left).
``overrides`` lets a schedule substitute a shared value (a reduction a warp or a block
finished) for its recomputation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from stitch.hlo import combiners, element_types
from stitch.hlo.graph import OpGraph, OpNode
from stitch.hlo.ir import Shape, parse_padding, parse_slice, parse_window
from stitch.hlo.scatter_forms import scatter_batch_dims, scatter_form

from . import kir
from .kir import multiple_of
from .errors import CodegenError

Expr = kir.Expr

# HLO element types -> Kernel IR storage dtypes (the HLO layer's rule, which the
# planner's feasibility asks too).
STORAGE = element_types.CODEGEN_STORAGE

UNARY_OPS = {"negate": "neg", "abs": "abs", "exponential": "exp", "log": "log",
          "log-plus-one": "log1p", "exponential-minus-one": "expm1", "sqrt": "sqrt",
          "rsqrt": "rsqrt", "tanh": "tanh", "sine": "sin", "cosine": "cos", "tan": "tan",
          "erf": "erf", "floor": "floor", "ceil": "ceil",
          "round-nearest-even": "round_half_even", "round-nearest-afz": "round_half_away",
          "sign": "sign", "not": "not", "logistic": "logistic", "cbrt": "cbrt",
          "is-finite": "is_finite"}
BINARY_OPS = {"add": "add", "subtract": "sub", "multiply": "mul", "divide": "div",
           "remainder": "rem", "maximum": "max", "minimum": "min", "power": "pow",
           "atan2": "atan2", "and": "and", "or": "or", "xor": "xor",
           "shift-left": "shl", "shift-right-logical": "shr_logical",
           "shift-right-arithmetic": "shr_arith"}
COMPARE_OPS = {"EQ": "eq", "NE": "ne", "LT": "lt", "LE": "le", "GT": "gt", "GE": "ge"}
# Ops whose f16/bf16 result can need more bits than its element type holds (the others
# move, select or compare values that already are f16/bf16).
_ROUNDS = (frozenset(UNARY_OPS) - {"negate", "abs", "sign", "not", "floor", "ceil",
                                "round-nearest-even", "round-nearest-afz", "is-finite"}
           | frozenset(BINARY_OPS) - {"maximum", "minimum", "and", "or", "xor"}
           | {"convert", "iota", "reduce", "reduce-window", "scatter"})
# Scatter combiners (by the evaluator's binary kind; "assign" and "keep" pick a side): the
# HLO layer's rule, which the planner's feasibility asks too.
SCATTER_COMBINERS = combiners.GENERATED_SCATTER_COMBINERS
# Reducer computations (by the evaluator's binary kind) -> combining op: the HLO layer's
# rule, which the planner's feasibility asks too.
REDUCER = combiners.GENERATED_REDUCERS


def storage_dtype(shape: Shape) -> str:
    problem = element_types.type_problem(shape.element_type)
    if problem:
        raise CodegenError(problem)
    return STORAGE[shape.element_type]


def leaf(shape: Shape) -> Shape:
    """The first array leaf of a tuple shape (the shape itself for an array)."""
    if not shape.is_tuple:
        return shape
    for first in shape.leaves():
        return first
    raise CodegenError(f"the tuple shape {shape} has no array leaf")


# ----------------------------------------------------------------- i32 index arithmetic
def _c(value: int) -> kir.Const:
    return kir.i32(value)


def iadd(a: Expr, b: Expr) -> Expr:
    if isinstance(b, kir.Const) and b.value == 0:
        return a
    if isinstance(a, kir.Const) and a.value == 0:
        return b
    if isinstance(a, kir.Const) and isinstance(b, kir.Const):
        return _c(a.value + b.value)
    if _is_i32_const(b) and isinstance(a, kir.Binary) and a.op == "add" and \
            _is_i32_const(a.b):
        return iadd(a.a, _c(a.b.value + b.value))     # (x + c1) + c2 = x + (c1 + c2)
    return kir.Binary("add", a, b)


def _is_i32_const(e: Expr) -> bool:
    return isinstance(e, kir.Const) and e.dtype == "i32"


def isub(a: Expr, b: Expr) -> Expr:
    if isinstance(b, kir.Const) and b.value == 0:
        return a
    if isinstance(a, kir.Const) and isinstance(b, kir.Const):
        return _c(a.value - b.value)
    return kir.Binary("sub", a, b)


def imul(a: Expr, k: int) -> Expr:
    if k == 1:
        return a
    if k == 0:
        return _c(0)
    if isinstance(a, kir.Const):
        return _c(a.value * k)
    return kir.Binary("mul", a, _c(k))


def idiv(a: Expr, k: int) -> Expr:
    if k == 1:
        return a
    if isinstance(a, kir.Const):
        return _c(a.value // k)
    return kir.Binary("div", a, _c(k))


def irem(a: Expr, k: int) -> Expr:
    if k == 1:
        return _c(0)
    if isinstance(a, kir.Const):
        return _c(a.value % k)
    return kir.Binary("rem", a, _c(k))


def linearize(index: tuple[Expr, ...], dims: tuple[int, ...]) -> Expr:
    """Row-major linear offset of a logical index (non-negative i32 arithmetic).

    Components that are a whole ``delinearize(x, dims[a:b])`` (each maybe plus a
    constant) fold back to ``x`` (plus the constants times their strides): an element's
    offset reads the expression its index was made from, without the div/rem round trip.
    Besides saving the arithmetic, that keeps a thread's consecutive elements (``x + j``)
    provably consecutive and aligned, so the loads and stores of a vectorized walk merge
    into vector accesses. A run must end at delinearize's outermost component (``x /
    stride``, no remainder): a part of another value's index (a broadcast's operand reads
    the minor components of its result's index) keeps its remainders."""
    bases: list[Expr] = []
    strides: list[int] = []
    constant = 0
    stride = 1
    for i, n in zip(reversed(index), reversed(dims)):       # minor first
        while n != 1 and isinstance(i, kir.Binary) and i.op == "add" and _is_i32_const(i.b):
            constant += int(i.b.value) * stride
            i = i.a
        bases.append(i)
        strides.append(stride)
        stride *= n
    sizes = tuple(reversed(dims))
    out: Expr = _c(0)
    k = 0
    while k < len(bases):
        if sizes[k] == 1:
            k += 1
            continue
        run = _delinearized_run(bases, sizes, k)
        if run is None:
            out = iadd(out, imul(bases[k], strides[k]))
            k += 1
        else:
            source, k_end = run
            out = iadd(out, imul(source, strides[k]))
            k = k_end
    return iadd(out, _c(constant)) if constant else out


def _delinearized_run(bases: list[Expr], sizes: tuple[int, ...], k: int
                      ) -> tuple[Expr, int] | None:
    """(x, end) when ``bases[k:end]`` (minor first) are all of ``delinearize(x, ...)``
    over ``sizes[k:end]``: ``x % sizes[k]``, ``x / sizes[k] % sizes[k+1]``, ..., and last
    ``x / span`` (size-1 dims, whose component is 0, may sit in between); else None."""
    first = bases[k]
    if not (isinstance(first, kir.Binary) and first.op == "rem"
            and isinstance(first.b, kir.Const) and first.b.value == sizes[k]):
        return None
    source = first.a
    span = sizes[k]
    end = k + 1
    while end < len(bases):
        if sizes[end] == 1:
            end += 1
            continue
        if bases[end] == idiv(source, span):
            return source, end + 1
        if bases[end] != irem(idiv(source, span), sizes[end]):
            return None
        span *= sizes[end]
        end += 1
    return None

def physical_offset(index: tuple[Expr, ...], dims: tuple[int, ...],
                    layout: tuple[int, ...] | None) -> Expr:
    """Linear offset of a logical index in a buffer laid out as ``layout`` (the logical
    dims, major to minor; None or the identity: row-major). A buffer stitch lays out
    between two of its kernels (``stitch.schedule.layouts``) holds the transpose of the
    value by ``layout``."""
    if layout is None:
        return linearize(index, dims)
    return linearize(tuple(index[d] for d in layout), tuple(dims[d] for d in layout))


def logical_index(offset: Expr, dims: tuple[int, ...], layout: tuple[int, ...] | None
                  ) -> tuple[Expr, ...]:
    """The logical index stored at ``offset`` of a buffer laid out as ``layout``."""
    if layout is None:
        return delinearize(offset, dims)
    physical = delinearize(offset, tuple(dims[d] for d in layout))
    out: list[Expr] = [_c(0)] * len(dims)
    for position, d in enumerate(layout):
        out[d] = physical[position]
    return tuple(out)


def delinearize(offset: Expr, dims: tuple[int, ...]) -> tuple[Expr, ...]:
    """Logical index of a row-major linear offset. An offset ``x + c`` whose x is a
    multiple of g (``multiple_of``) with c < g and g dividing the minor dim's size
    keeps c on the minor digit (x + c lies in x's run of that dim): a thread's vector
    group of consecutive elements stays one digit apart through reshapes, whole."""
    if isinstance(offset, kir.Binary) and offset.op == "add" and _is_i32_const(offset.b):
        minor = max((d for d, n in enumerate(dims) if n != 1), default=None)
        c = int(offset.b.value)
        if minor is not None and 0 < c < math.gcd(multiple_of(offset.a), dims[minor]):
            out = list(delinearize(offset.a, dims))
            out[minor] = iadd(out[minor], _c(c))
            return tuple(out)
    out: list[Expr] = []
    stride = math.prod(dims)
    outermost = True
    for n in dims:
        stride //= n
        if n == 1:
            out.append(_c(0))
        elif outermost:
            # The offset is in range: its outermost digit needs no remainder (and its
            # absence marks a whole delinearization for ``linearize`` to fold back).
            out.append(idiv(offset, stride))
        else:
            out.append(irem(idiv(offset, stride), n))
        outermost = outermost and n == 1
    return tuple(out)


def _physical_linear(index: tuple[Expr, ...], shape: Shape) -> Expr:
    order = list(reversed(shape.minor_to_major()))
    return linearize(tuple(index[d] for d in order), tuple(shape.dims[d] for d in order))


def _from_physical(offset: Expr, shape: Shape) -> tuple[Expr, ...]:
    order = list(reversed(shape.minor_to_major()))
    parts = delinearize(offset, tuple(shape.dims[d] for d in order))
    index: list[Expr] = [_c(0)] * shape.rank
    for d, e in zip(order, parts):
        index[d] = e
    return tuple(index)


@dataclass
class _Scope:
    stmts: list[kir.Stmt]
    memo: dict[tuple, Expr] = field(default_factory=dict)
    # A loop body that runs its statements for every iteration of ``binds`` (the loop
    # variable): values that do not depend on what it defines can be computed before
    # the loop instead (loop-invariant code motion). Guarded bodies (If) never are: an
    # index valid only under the guard must stay under it.
    hoistable: bool = False
    defined: set[str] = field(default_factory=set)


def _all(conds: list[Expr]) -> Expr:
    out = conds[0]
    for c in conds[1:]:
        out = kir.Binary("and", out, c)
    return out


def _names(e: Expr, out: set[str]) -> set[str]:
    """Names of the variables ``e`` reads (``kir.expr_refs``: memoized per expression
    object, index expressions being DAGs shared by many values)."""
    out.update(name for name, _ in kir.expr_refs(e))
    return out


class ValueEmitter:
    """Builds element expressions of ops of ``members``; see the module docstring."""

    def __init__(self, graph: OpGraph, members: frozenset[int],
                 buffer_of: Callable[[int], kir.Param | None],
                 reducer_kind: Callable[[OpNode], str | None],
                 constant_of: Callable[[OpNode], object | None]):
        self.graph = graph
        self.members = members
        self.buffer_of = buffer_of            # node -> input buffer (None: not an input)
        self.reducer_kind = reducer_kind
        self.constant_of = constant_of        # scalar constants -> python value, else None
        self.scopes: list[_Scope] = []
        self.overrides: dict[int, Callable[[tuple[Expr, ...]], Expr]] = {}
        # Input buffers in a layout of stitch's choosing (node -> logical dims, major to
        # minor); the others are row-major.
        self.layouts: dict[int, tuple[int, ...]] = {}
        self._names = 0

    # --- scopes ---------------------------------------------------------------------
    def push(self, loop_var: str | None = None) -> list[kir.Stmt]:
        """A new statement list; ``loop_var``: it is the body of a loop over that variable
        whose invariant values may move before the loop (see ``value``)."""
        scope = _Scope([], hoistable=loop_var is not None,
                       defined={loop_var} if loop_var else set())
        self.scopes.append(scope)
        return scope.stmts

    def pop(self) -> tuple[kir.Stmt, ...]:
        return tuple(self.scopes.pop().stmts)

    def emit(self, stmt: kir.Stmt) -> None:
        scope = self.scopes[-1]
        scope.stmts.append(stmt)
        if isinstance(stmt, (kir.Let, kir.Local)):
            scope.defined.add(stmt.name)
        elif isinstance(stmt, (kir.WarpReduce, kir.WarpShuffle)):
            scope.defined.add(stmt.dest)

    def _home(self, index: tuple[Expr, ...]) -> int:
        """The outermost scope an element at ``index`` can be computed in: out of every
        enclosing loop body that defines none of the variables the index reads (a
        thread's reduction over a row need not be redone for each element it feeds)."""
        names: set[str] = set()
        for e in index:
            _names(e, names)
        at = len(self.scopes) - 1
        while at > 0 and self.scopes[at].hoistable and not names & self.scopes[at].defined:
            at -= 1
        return at

    def fresh(self, hint: str) -> str:
        self._names += 1
        clean = "".join(ch if ch.isalnum() else "_" for ch in hint)[:24]
        return f"{clean}_{self._names}"

    def let(self, hint: str, expr: Expr) -> Expr:
        if isinstance(expr, (kir.Const, kir.Ref, kir.ThreadIdx, kir.BlockIdx)):
            return expr
        name = self.fresh(hint)
        self.emit(kir.Let(name, expr))
        return kir.Ref(name, expr.dtype)

    # --- values -------------------------------------------------------------------------
    def value(self, v: int, index: tuple[Expr, ...]) -> Expr:
        key = (v, index)       # expressions are frozen dataclasses: hashed by structure
        for scope in reversed(self.scopes):
            got = scope.memo.get(key)
            if got is not None:
                return got
        node = self.graph.nodes[v]
        if v in self.overrides:
            got = self.let(node.opcode, self.overrides[v](index))
            self.scopes[-1].memo[key] = got
            return got
        home = self._home(index)
        inner = self.scopes[home + 1:]
        del self.scopes[home + 1:]      # compute (operands too) in the home scope
        try:
            got = self.let(node.opcode, self._rounded(node, self._compute(node, index)))
            self.scopes[-1].memo[key] = got
        finally:
            self.scopes.extend(inner)
        return got

    def _rounded(self, node: OpNode, expr: Expr) -> Expr:
        """An f16/bf16 result computed in f32, rounded to its element type as XLA rounds
        every op's result (without it, f16 divide -> convert f32 kept f32 digits)."""
        element = leaf(node.shape).element_type
        if (element not in ("f16", "bf16") or node.id not in self.members
                or node.opcode not in _ROUNDS or expr.dtype != "f32"):
            return expr
        return kir.Unary(f"round_to_{element}", expr)

    def _input(self, node: OpNode, index: tuple[Expr, ...]) -> Expr:
        scalar = self.constant_of(node)
        if scalar is not None:
            return kir.Const(scalar, kir.value_dtype(storage_dtype(node.shape)))
        param = self.buffer_of(node.id)
        if param is None:
            raise CodegenError(f"{node.name} ({node.opcode}) is neither computed in the kernel "
                               "nor one of its inputs")
        return kir.Load(param, physical_offset(index, leaf(node.shape).dims,
                                               self.layouts.get(node.id)))

    def _compute(self, node: OpNode, index: tuple[Expr, ...]) -> Expr:
        if node.id not in self.members:
            return self._input(node, index)
        op = node.opcode
        inst = node.instruction
        ops = node.operands
        shape = leaf(node.shape)
        if op in UNARY_OPS:
            return kir.Unary(UNARY_OPS[op], self.value(ops[0], index))
        if op in BINARY_OPS:
            return kir.Binary(BINARY_OPS[op], self.value(ops[0], index), self.value(ops[1], index))
        if op == "compare":
            direction = COMPARE_OPS[inst.attrs.get("direction", "EQ")]
            return kir.Compare(direction, self.value(ops[0], index), self.value(ops[1], index))
        if op == "select":
            return kir.Select(self.value(ops[0], index), self.value(ops[1], index),
                              self.value(ops[2], index))
        if op == "clamp":
            lo, x, hi = (self.value(o, index) for o in ops)
            return kir.Binary("min", kir.Binary("max", x, lo), hi)
        if op == "convert":
            return kir.Convert(self.value(ops[0], index),
                               kir.value_dtype(storage_dtype(shape)))
        if op in ("copy", "get-tuple-element") and len(ops) == 1:
            return self.value(ops[0], index)
        if op == "broadcast":
            table = inst.ints("dimensions", ())
            return self.value(ops[0], tuple(index[d] for d in table))
        if op == "reshape":
            src = leaf(self.graph.nodes[ops[0]].shape)
            return self.value(ops[0], delinearize(linearize(index, shape.dims), src.dims))
        if op == "bitcast":
            src = leaf(self.graph.nodes[ops[0]].shape)
            value = self.value(ops[0], _from_physical(_physical_linear(index, shape), src))
            if src.element_type != shape.element_type:
                # XLA's same-width bitcast-convert written as a bitcast (dropout's u32 bits
                # as f32): the bits reinterpreted, never the value converted.
                return _reinterpreted(node.name, value, src, shape)
            return value
        if op == "bitcast-convert":
            src = leaf(self.graph.nodes[ops[0]].shape)
            if src.dims != shape.dims:
                raise CodegenError(f"{node.name}: a width-changing bitcast-convert "
                                   f"({src.element_type} -> {shape.element_type})")
            return _reinterpreted(node.name, self.value(ops[0], index), src, shape)
        if op == "transpose":
            perm = inst.ints("dimensions")
            src_index: list[Expr] = [_c(0)] * len(perm)
            for i, p in enumerate(perm):
                src_index[p] = index[i]
            return self.value(ops[0], tuple(src_index))
        if op == "slice":
            spec = parse_slice(inst.attrs["slice"])
            return self.value(ops[0], tuple(iadd(_c(s.start), imul(i, s.stride))
                                            for i, s in zip(index, spec)))
        if op == "reverse":
            dims = set(inst.ints("dimensions"))
            return self.value(ops[0], tuple(isub(_c(n - 1), i) if d in dims else i
                                            for d, (i, n) in enumerate(zip(index, shape.dims))))
        if op == "iota":
            dim = inst.int("iota_dimension")
            return kir.Convert(index[dim], kir.value_dtype(storage_dtype(shape)))
        if op == "concatenate":
            return self._concatenate(node, index)
        if op == "pad":
            return self._pad(node, index)
        if op == "dynamic-slice":
            starts = self._starts(node, ops[1:], leaf(self.graph.nodes[ops[0]].shape).dims,
                                  shape.dims)
            return self.value(ops[0], tuple(iadd(s, i) for s, i in zip(starts, index)))
        if op == "dynamic-update-slice":
            return self._dynamic_update_slice(node, index)
        if op == "gather":
            return self._gather(node, index)
        if op == "scatter":
            return self._scatter(node, index)
        if op == "reduce":
            return self._reduce(node, index)
        if op == "reduce-window":
            return self._reduce_window(node, index)
        raise CodegenError(f"{node.name}: opcode {op} is not supported by codegen")

    # --- ops that need control flow -------------------------------------------------------
    def _guarded(self, node: OpNode, branches: list[tuple[Expr | None, Callable[[], Expr]]]
                 ) -> Expr:
        """A Local set by the first branch whose condition holds (None = else); each branch
        computes its value inside its own If body, so no load runs out of bounds."""
        dtype = kir.value_dtype(storage_dtype(leaf(node.shape)))
        name = self.fresh(node.opcode)
        self.emit(kir.Local(name, dtype))

        def build(rest: list[tuple[Expr | None, Callable[[], Expr]]]) -> tuple[kir.Stmt, ...]:
            cond, make = rest[0]
            self.push()
            self.emit(kir.Assign(name, make()))
            body = self.pop()
            if cond is None or len(rest) == 1:
                if cond is None:
                    return body
                return (kir.If(cond, body),)
            return (kir.If(cond, body, build(rest[1:])),)

        for stmt in build(branches):
            self.emit(stmt)
        return kir.Ref(name, dtype)

    def _concatenate(self, node: OpNode, index: tuple[Expr, ...]) -> Expr:
        dim = node.instruction.ints("dimensions")[0]
        branches = []
        offset = 0
        for k, o in enumerate(node.operands):
            size = leaf(self.graph.nodes[o].shape).dims[dim]
            shifted = tuple(isub(i, _c(offset)) if d == dim else i for d, i in enumerate(index))
            last = k == len(node.operands) - 1
            cond = None if last else kir.Compare("lt", index[dim], _c(offset + size))
            branches.append((cond, lambda o=o, shifted=shifted: self.value(o, shifted)))
            offset += size
        return self._guarded(node, branches)

    def _pad(self, node: OpNode, index: tuple[Expr, ...]) -> Expr:
        src = leaf(self.graph.nodes[node.operands[0]].shape)
        pads = parse_padding(node.instruction.attrs.get("padding", "{}"))
        conds: list[Expr] = []
        src_index: list[Expr] = []
        for d, (i, p) in enumerate(zip(index, pads)):
            shifted = isub(i, _c(p.low))
            step = p.interior + 1
            if p.low or p.high or p.interior:
                conds.append(kir.Compare("ge", shifted, _c(0)))
                conds.append(kir.Compare("lt", shifted, _c((src.dims[d] - 1) * step + 1)))
                if step > 1:
                    conds.append(kir.Compare("eq", irem(shifted, step), _c(0)))
            src_index.append(idiv(shifted, step))
        if not conds:
            return self.value(node.operands[0], tuple(src_index))
        inside = conds[0]
        for c in conds[1:]:
            inside = kir.Binary("and", inside, c)
        return self._guarded(node, [(inside, lambda: self.value(node.operands[0],
                                                                 tuple(src_index))),
                                    (None, lambda: self.value(node.operands[1], ()))])

    def _clamped_start(self, start: Expr, dim: int, size: int) -> Expr:
        """An integer start index clamped to [0, dim - size] as XLA does, as i32. The clamp
        runs in a type that holds every value of the index's type (u32 and i64 indices
        beyond the i32 range clamp to the top, not wrap)."""
        wide = start.dtype in ("i64", "u32")
        work = "i64" if wide else "i32"
        if start.dtype != work:
            start = kir.Convert(start, work)
        zero, top = kir.Const(0, work), kir.Const(max(dim - size, 0), work)
        clamped = kir.Binary("min", kir.Binary("max", start, zero), top)
        return self.let("start", kir.Convert(clamped, "i32") if wide else clamped)

    def _starts(self, node: OpNode, start_ops: list[int], full: tuple[int, ...],
                sizes: tuple[int, ...]) -> list[Expr]:
        """Dynamic start indices, clamped into range as XLA does: one scalar operand per
        dimension, or (the older form) one s32[rank] vector operand."""
        if len(start_ops) == 1 and leaf(self.graph.nodes[start_ops[0]].shape).rank == 1:
            vector = leaf(self.graph.nodes[start_ops[0]].shape)
            if vector.dims[0] != len(full):
                raise CodegenError(f"{node.name}: {vector.dims[0]} start indices for rank "
                                   f"{len(full)}")
            starts = [self.value(start_ops[0], (_c(k),)) for k in range(len(full))]
        else:
            if len(start_ops) != len(full):
                raise CodegenError(f"{node.name}: {len(start_ops)} start indices for rank "
                                   f"{len(full)}")
            starts = [self.value(o, ()) for o in start_ops]
        return [self._clamped_start(v, n, s) for v, n, s in zip(starts, full, sizes)]

    def _gather(self, node: OpNode, index: tuple[Expr, ...]) -> Expr:
        """XLA gather: output dims not in offset_dims index the start-index vectors (the
        indices' dims but index_vector_dim, in order); offset_dims index the slice's dims
        that are neither collapsed nor batching, in order."""
        inst = node.instruction
        operand, indices = (leaf(self.graph.nodes[o].shape) for o in node.operands[:2])
        offset_dims = inst.ints("offset_dims", ())
        collapsed = set(inst.ints("collapsed_slice_dims", ()))
        operand_batching = inst.ints("operand_batching_dims", ())
        indices_batching = inst.ints("start_indices_batching_dims", ())
        index_map = inst.ints("start_index_map")
        sizes = inst.ints("slice_sizes")
        vector_dim = inst.int("index_vector_dim")
        batch = [index[p] for p in range(len(index)) if p not in offset_dims]
        batch_dims = [d for d in range(indices.rank) if d != vector_dim]
        window = [d for d in range(operand.rank)
                  if d not in collapsed and d not in operand_batching]
        components = indices.dims[vector_dim] if vector_dim < indices.rank else 1
        if len(batch) != len(batch_dims) or len(window) != len(offset_dims) or \
                len(index_map) != components or len(sizes) != operand.rank:
            raise CodegenError(f"{node.name}: gather dimension numbers do not fit its shapes")
        coord = dict(zip(batch_dims, batch))       # indices dim -> output coordinate

        def component(k: int) -> Expr:
            at = tuple(_c(k) if d == vector_dim else coord[d] for d in range(indices.rank))
            return self.value(node.operands[1], at)

        starts: list[Expr] = [_c(0)] * operand.rank
        for k, d in enumerate(index_map):
            starts[d] = self._clamped_start(component(k), operand.dims[d], sizes[d])
        for d, idim in zip(operand_batching, indices_batching):
            # The batch coordinate itself, clamped only where it can leave the range.
            top = max(operand.dims[d] - sizes[d], 0)
            starts[d] = coord[idim] if indices.dims[idim] - 1 <= top else \
                kir.Binary("min", coord[idim], _c(top))
        src = [iadd(s, index[offset_dims[window.index(d)]]) if d in window else s
               for d, s in enumerate(starts)]
        return self.value(node.operands[0], tuple(src))

    def _scatter(self, node: OpNode, index: tuple[Expr, ...]) -> Expr:
        """A scatter whose updates land at most one per element (form "row" of
        ``stitch.hlo.scatter_forms``: the starts on the identity dims are the update's own
        batch number), computed in the result's index space: element p is the operand's,
        combined with the one update whose window covers p, if that update's window lies
        inside the operand (XLA skips the others). No atomics: no two updates collide."""
        form = scatter_form(self.graph, node.id)
        if form.kind != "row" or form.index_map is None:
            raise CodegenError(f"{node.name}: scatter of form {form.kind} is not computed per "
                               f"element ({form.reason})")
        kind = self.reducer_kind(node)
        problem = combiners.scatter_problem(kind, False, leaf(node.shape).element_type)
        if problem:
            raise CodegenError(f"{node.name}: {problem}")
        imap = form.index_map
        operand_id, indices_id, update_id = node.operands
        shape = leaf(node.shape)
        inst = node.instruction
        dtype = kir.value_dtype(storage_dtype(shape))
        base = self.value(operand_id, index)
        if any(w > n for w, n in zip(imap.window, shape.dims)):
            return base                         # every window leaves the operand: skipped
        # The batch point whose window may cover p, and whether there is one.
        reach: list[Expr] = []
        number: Expr = _c(0)
        for d, n in zip(imap.identity, imap.radices):
            if n < shape.dims[d]:
                reach.append(kir.Compare("lt", index[d], _c(n)))
            number = iadd(imul(number, n), index[d])
        data_dims = dict(imap.data)
        for d, (w, n) in enumerate(zip(imap.window, shape.dims)):
            if d not in data_dims and d not in imap.identity and w < n:
                reach.append(kir.Compare("lt", index[d], _c(w)))     # window starts at 0
        result = self.fresh("scatter")
        self.emit(kir.Local(result, dtype, base))
        self.push()
        batch = delinearize(number, imap.batch_shape)
        irank = leaf(self.graph.nodes[indices_id].shape).rank
        inside: list[Expr] = []
        window_at: dict[int, Expr] = {}
        for d, k in imap.data:
            at = list(batch)
            if imap.index_vector_dim < irank:
                at.insert(imap.index_vector_dim, _c(k))
            start = self.value(indices_id, tuple(at))
            work = "i64" if start.dtype in ("i64", "u32") else "i32"
            start = self.let("start", start if start.dtype == work else kir.Convert(start, work))
            pos = index[d] if work == "i32" else kir.Convert(index[d], "i64")
            zero, top = kir.Const(0, work), kir.Const(shape.dims[d] - imap.window[d], work)
            inside += [kir.Compare("ge", start, zero), kir.Compare("le", start, top),
                       kir.Compare("ge", pos, start),
                       kir.Compare("lt", pos, kir.Binary("add", start,
                                                         kir.Const(imap.window[d], work)))]
            offset = kir.Binary("sub", pos, start)
            window_at[d] = offset if work == "i32" else kir.Convert(offset, "i32")
        skipped = set(inst.ints("inserted_window_dims", ())) | \
            set(inst.ints("input_batching_dims", ()))
        spanned = [d for d in range(shape.rank) if d not in skipped]
        update_index: list[Expr] = [_c(0)] * leaf(self.graph.nodes[update_id].shape).rank
        for p, b in zip(scatter_batch_dims(node, self.graph), batch):
            update_index[p] = b
        for p, d in zip(inst.ints("update_window_dims", ()), spanned):
            update_index[p] = window_at.get(d, _c(0) if d in imap.identity else index[d])
        self.push()
        update = self.value(update_id, tuple(update_index))
        current = kir.Ref(result, dtype)
        combined = update if kind == "assign" else current if kind == "keep" else \
            kir.Binary(SCATTER_COMBINERS[kind], current, update)
        self.emit(kir.Assign(result, combined))
        hit = self.pop()
        if inside:
            self.emit(kir.If(_all(inside), hit))
        else:
            for s in hit:
                self.emit(s)
        body = self.pop()
        if reach:
            self.emit(kir.If(_all(reach), body))
        else:
            for s in body:
                self.emit(s)
        return kir.Ref(result, dtype)

    def _dynamic_update_slice(self, node: OpNode, index: tuple[Expr, ...]) -> Expr:
        base, update = node.operands[0], node.operands[1]
        sizes = leaf(self.graph.nodes[update].shape).dims
        starts = self._starts(node, node.operands[2:], leaf(node.shape).dims, sizes)
        inside: Expr | None = None
        for i, s, n in zip(index, starts, sizes):
            c = kir.Binary("and", kir.Compare("ge", i, s), kir.Compare("lt", i, iadd(s, _c(n))))
            inside = c if inside is None else kir.Binary("and", inside, c)
        shifted = tuple(isub(i, s) for i, s in zip(index, starts))
        return self._guarded(node, [(inside, lambda: self.value(update, shifted)),
                                    (None, lambda: self.value(base, index))])

    def reducer(self, node: OpNode) -> str:
        kind = self.reducer_kind(node)
        problem = combiners.reduction_problem(len(node.operands), kind)
        if problem:
            raise CodegenError(f"{node.name}: {problem}")
        return REDUCER[kind]

    def _reduce(self, node: OpNode, index: tuple[Expr, ...]) -> Expr:
        """Thread composition: this thread reduces the element's whole row itself."""
        op = self.reducer(node)
        src = leaf(self.graph.nodes[node.operands[0]].shape)
        reduced = sorted(node.instruction.ints("dimensions"))
        kept = [d for d in range(src.rank) if d not in set(reduced)]
        init = self.value(node.operands[1], ())
        acc = self.fresh("acc")
        self.emit(kir.Local(acc, init.dtype, init))
        total = math.prod(src.dims[d] for d in reduced)
        var = self.fresh("k")
        # An empty reduction's body never runs: nothing may move out of it.
        self.push(var if total > 0 else None)
        parts = delinearize(kir.Ref(var, "i32"), tuple(src.dims[d] for d in reduced))
        src_index: list[Expr] = [_c(0)] * src.rank
        for d, i in zip(kept, index):
            src_index[d] = i
        for d, i in zip(reduced, parts):
            src_index[d] = i
        x = self.value(node.operands[0], tuple(src_index))
        self.emit(kir.Assign(acc, kir.Binary(op, kir.Ref(acc, init.dtype), x)))
        body = self.pop()
        self.emit(kir.For(var, _c(0), _c(total), _c(1), body))
        return kir.Ref(acc, init.dtype)

    def _reduce_window(self, node: OpNode, index: tuple[Expr, ...]) -> Expr:
        op = self.reducer(node)
        src = leaf(self.graph.nodes[node.operands[0]].shape)
        window = parse_window(node.instruction.attrs.get("window", "{}"), src.rank)
        if any(w.lhs_dilate != 1 for w in window):
            raise CodegenError(f"{node.name}: base-dilated windows are not generated")
        init = self.value(node.operands[1], ())
        acc = self.fresh("acc")
        self.emit(kir.Local(acc, init.dtype, init))
        sizes = tuple(w.size for w in window)
        var = self.fresh("w")
        self.push(var if math.prod(sizes) > 0 else None)
        offsets = delinearize(kir.Ref(var, "i32"), sizes)
        src_index = []
        inside: Expr | None = None
        for d, (i, w, k) in enumerate(zip(index, window, offsets)):
            pos = isub(iadd(imul(i, w.stride), imul(k, w.rhs_dilate)), _c(w.pad_low))
            src_index.append(pos)
            if w.pad_low or w.pad_high:
                c = kir.Binary("and", kir.Compare("ge", pos, _c(0)),
                               kir.Compare("lt", pos, _c(src.dims[d])))
                inside = c if inside is None else kir.Binary("and", inside, c)
        self.push()
        x = self.value(node.operands[0], tuple(src_index))
        self.emit(kir.Assign(acc, kir.Binary(op, kir.Ref(acc, init.dtype), x)))
        update = self.pop()
        if inside is None:
            for s in update:
                self.emit(s)
        else:
            self.emit(kir.If(inside, update))
        body = self.pop()
        self.emit(kir.For(var, _c(0), _c(math.prod(sizes)), _c(1), body))
        return kir.Ref(acc, init.dtype)


def _reinterpreted(name: str, value: Expr, src: Shape, dst: Shape) -> Expr:
    """``value`` (an element of ``src``'s type) with its bits read as ``dst``'s element type
    (kir.Bitcast). Types whose register value is not their stored bits (f16/bf16 widen to
    f32, pred) or of different widths are refused (CodegenError: the kernel stays with
    XLA), never converted."""
    reason = reinterpret_problem(src.element_type, dst.element_type)
    if reason:
        raise CodegenError(f"{name}: bitcast from {src.element_type} to {dst.element_type}: "
                           f"{reason}")
    return kir.Bitcast(value, kir.value_dtype(storage_dtype(dst)))


def reinterpret_problem(src: str, dst: str) -> str | None:
    """Why codegen cannot reinterpret HLO element type ``src`` as ``dst`` bit for bit (None
    when it can): ``stitch.hlo.element_types``' rule, the one the planner's feasibility asks
    too (kir.Bitcast checks the same widths on the register values)."""
    return element_types.reinterpret_problem(src, dst)

