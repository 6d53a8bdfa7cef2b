"""Kernel IR nodes: dtypes, buffers, expressions, statements, the walks over them and
builders of common expressions (the language is described in the package docstring)."""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import Iterator, Union

from stitch.codegen.errors import CodegenError
from stitch.hlo.combiners import ATOMIC_ADD_TYPES
from stitch.hlo.element_types import CODEGEN_STORAGE, REINTERPRET_WIDTHS

FLOAT_DTYPES = frozenset({"f32", "f64"})
SIGNED_DTYPES = frozenset({"i8", "i32", "i64"})
UNSIGNED_DTYPES = frozenset({"u8", "u32"})
INT_DTYPES = SIGNED_DTYPES | UNSIGNED_DTYPES
VALUE_DTYPES = FLOAT_DTYPES | INT_DTYPES | {"i1"}
STORAGE_DTYPES = VALUE_DTYPES | {"f16", "bf16"}
INDEX_DTYPES = frozenset({"i32", "i64"})

BINARY_OPS = frozenset({
    "add", "sub", "mul", "div", "rem", "min", "max", "pow", "atan2",
    "and", "or", "xor", "shl", "shr_logical", "shr_arith",
})
COMPARE_OPS = frozenset({"eq", "ne", "lt", "le", "gt", "ge"})
UNARY_OPS = frozenset({
    "neg", "abs", "exp", "exp2", "log", "log1p", "expm1", "sqrt", "rsqrt", "tanh", "sin",
    "cos", "tan", "erf", "floor", "ceil", "round_half_even", "round_half_away", "sign", "not",
    "is_finite", "logistic", "cbrt",
    # f32 -> the nearest f16 / bf16 value, widened back: XLA rounds every f16/bf16 result
    "round_to_f16", "round_to_bf16",
})
SHUFFLE_MODES = frozenset({"xor", "down", "idx"})
REDUCE_OPS = frozenset({"add", "max", "min", "mul"})

# Which value dtypes each op accepts (checked by validate()).
NUMERIC_DTYPES = FLOAT_DTYPES | INT_DTYPES
BINARY_DTYPES: dict[str, frozenset[str]] = {
    **{op: NUMERIC_DTYPES for op in ("add", "sub", "mul", "div", "rem", "min", "max")},
    "pow": FLOAT_DTYPES, "atan2": FLOAT_DTYPES,
    **{op: INT_DTYPES | {"i1"} for op in ("and", "or", "xor")},
    **{op: INT_DTYPES for op in ("shl", "shr_logical", "shr_arith")},
}
UNARY_DTYPES: dict[str, frozenset[str]] = {
    **{op: FLOAT_DTYPES for op in UNARY_OPS},
    "neg": NUMERIC_DTYPES, "abs": NUMERIC_DTYPES, "sign": NUMERIC_DTYPES, "not": INT_DTYPES | {"i1"},
    "round_to_f16": frozenset({"f32"}), "round_to_bf16": frozenset({"f32"}),
}

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def value_dtype(storage: str) -> str:
    """The dtype a Load of a `storage` buffer yields (f16/bf16 widen to f32)."""
    if storage not in STORAGE_DTYPES:
        raise CodegenError(f"unknown dtype {storage!r}")
    return "f32" if storage in ("f16", "bf16") else storage


def _check_dtype(dtype: str, allowed: frozenset[str], what: str) -> None:
    if dtype not in allowed:
        raise CodegenError(f"{what}: dtype {dtype!r} not one of {sorted(allowed)}")


# ---------------------------------------------------------------- buffers


# Index arithmetic (thread ids, element offsets) is i32 in the Kernel IR and in what the
# emitters generate: a kernel with a buffer or a thread count past this is refused.
MAX_INDEX_ELEMENTS = 2**31 - 1


@dataclass(frozen=True)
class Param:
    """A global-memory buffer of `size` elements passed to the kernel (a pointer)."""
    name: str
    dtype: str
    size: int
    is_output: bool = False


@dataclass(frozen=True)
class Shared:
    """A block-shared buffer (addrspace 3 on NVPTX, a per-block array on the host)."""
    name: str
    dtype: str
    size: int


@dataclass(frozen=True)
class GlobalScratch:
    """A kernel-owned global-memory buffer every block sees (values that cross a
    `GridBarrier`: per-block partials of a reduction). Not a param: NVPTX makes it a module
    global (addrspace 1), the host carves it from the call's scratch. Its contents are
    undefined when the kernel starts: a kernel writes an element before it reads it."""
    name: str
    dtype: str
    size: int


Buffer = Union[Param, Shared, GlobalScratch]


def _buffer_name(buffer: "str | Buffer") -> str:
    return buffer.name if isinstance(buffer, (Param, Shared, GlobalScratch)) else buffer


# ---------------------------------------------------------------- expressions


class Expr:
    """Base of all expressions; every subclass has a `dtype` (a value dtype)."""
    dtype: str

    def __getstate__(self) -> dict:
        # A memoized hash (``_cached_hash``) is not carried to another process: str hashes
        # differ between interpreters (PYTHONHASHSEED).
        state = dict(self.__dict__)
        for memo in _EXPR_MEMOS:
            state.pop(memo, None)
        return state


# Per-object memos kept in an expression's __dict__ (not fields: equality, repr and keys
# ignore them): its hash, the variables it reads, whether it reads the thread index.
_EXPR_MEMOS = ("_hash", "_refs", "_thread")


def _cached_hash(cls: type) -> type:
    """Memoize a frozen expression dataclass's hash per object. Lowered expressions are DAGs
    (one index expression feeds many loads, a concatenate's arms share theirs): the
    generated hash walks every path, exponential in the sharing; lowering keys its value
    memo by index expressions (a transformer step's kernels spent minutes hashing)."""
    fields_hash = cls.__hash__

    def __hash__(self: Expr) -> int:
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = fields_hash(self)
            object.__setattr__(self, "_hash", cached)
        return cached

    cls.__hash__ = __hash__
    return cls


@dataclass(frozen=True)
class Const(Expr):
    value: float | int | bool
    dtype: str

    def __post_init__(self) -> None:
        _check_dtype(self.dtype, VALUE_DTYPES, "Const")


@dataclass(frozen=True)
class Ref(Expr):
    """Reads a Let / Local / loop / shuffle variable."""
    name: str
    dtype: str

    def __post_init__(self) -> None:
        _check_dtype(self.dtype, VALUE_DTYPES, f"Ref({self.name})")


@dataclass(frozen=True)
class ThreadIdx(Expr):
    dtype: str = field(default="i32", init=False)


@dataclass(frozen=True)
class BlockIdx(Expr):
    dtype: str = field(default="i32", init=False)


@dataclass(frozen=True)
class BlockDim(Expr):
    dtype: str = field(default="i32", init=False)


@dataclass(frozen=True)
class GridDim(Expr):
    dtype: str = field(default="i32", init=False)


@_cached_hash
@dataclass(frozen=True)
class Load(Expr):
    """buffer[index]. `buffer` may be given as the Param/Shared itself (dtype follows) or
    as its name plus `dtype` (storage or value dtype; normalised to the value dtype)."""
    buffer: str
    index: Expr
    dtype: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.buffer, (Param, Shared, GlobalScratch)):
            object.__setattr__(self, "dtype", value_dtype(self.buffer.dtype))
            object.__setattr__(self, "buffer", self.buffer.name)
        elif not self.dtype:
            raise CodegenError(f"Load({self.buffer!r}) needs the buffer object or a dtype")
        else:
            object.__setattr__(self, "dtype", value_dtype(self.dtype))


@_cached_hash
@dataclass(frozen=True)
class Binary(Expr):
    op: str
    a: Expr
    b: Expr
    dtype: str = field(default="", init=False)

    def __post_init__(self) -> None:
        if self.op not in BINARY_OPS:
            raise CodegenError(f"unknown binary op {self.op!r}")
        object.__setattr__(self, "dtype", self.a.dtype)


@_cached_hash
@dataclass(frozen=True)
class Compare(Expr):
    """Floats: ordered compares except `ne`, which is unordered (NaN != NaN is true)."""
    op: str
    a: Expr
    b: Expr
    dtype: str = field(default="i1", init=False)

    def __post_init__(self) -> None:
        if self.op not in COMPARE_OPS:
            raise CodegenError(f"unknown compare op {self.op!r}")


@_cached_hash
@dataclass(frozen=True)
class Unary(Expr):
    op: str
    a: Expr
    dtype: str = field(default="", init=False)

    def __post_init__(self) -> None:
        if self.op not in UNARY_OPS:
            raise CodegenError(f"unknown unary op {self.op!r}")
        object.__setattr__(self, "dtype", "i1" if self.op == "is_finite" else self.a.dtype)


@_cached_hash
@dataclass(frozen=True)
class Select(Expr):
    """cond ? a : b (both sides are evaluated: never guard a Load with it)."""
    cond: Expr
    a: Expr
    b: Expr
    dtype: str = field(default="", init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", self.a.dtype)


@_cached_hash
@dataclass(frozen=True)
class Convert(Expr):
    """float->int truncates toward zero (saturating, NaN -> 0); x->i1 is x != 0."""
    a: Expr
    dtype: str

    def __post_init__(self) -> None:
        _check_dtype(self.dtype, VALUE_DTYPES, "Convert")


# Value dtypes of equal bit width, between which a Bitcast reinterprets the bits.
# The HLO layer's widths under the kernel IR's names.
BITCAST_WIDTHS: dict[str, int] = {CODEGEN_STORAGE[t]: w for t, w in REINTERPRET_WIDTHS.items()}


def bitcast_problem(src: str, dst: str) -> str | None:
    """Why a value of dtype ``src`` cannot be reinterpreted as ``dst`` bit for bit (None
    when it can: both value dtypes of one width, ``BITCAST_WIDTHS``). The one rule the
    Bitcast expression, the HLO lowering (``values``) and the planner's feasibility ask."""
    if src not in BITCAST_WIDTHS or dst not in BITCAST_WIDTHS:
        return f"no bit reinterpretation between {src} and {dst}"
    if BITCAST_WIDTHS[src] != BITCAST_WIDTHS[dst]:
        return f"{src} and {dst} differ in width"
    return None


@_cached_hash
@dataclass(frozen=True)
class Bitcast(Expr):
    """The bits of ``a`` read as ``dtype`` (same width: XLA's bitcast-convert, e.g. the u32
    random bits a dropout mask turns into f32). Never a value conversion."""
    a: Expr
    dtype: str

    def __post_init__(self) -> None:
        _check_dtype(self.dtype, VALUE_DTYPES, "Bitcast")
        problem = bitcast_problem(self.a.dtype, self.dtype)
        if problem:
            raise CodegenError(f"Bitcast: {problem}")


# ---------------------------------------------------------------- statements


class Stmt:
    """Base of all statements."""


def as_tuple(body: object) -> tuple:
    return tuple(body)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Let(Stmt):
    """Immutable variable, visible to the rest of its scope."""
    name: str
    expr: Expr


@dataclass(frozen=True)
class Local(Stmt):
    """Mutable variable (zero-initialised when `init` is None)."""
    name: str
    dtype: str
    init: Expr | None = None


@dataclass(frozen=True)
class Assign(Stmt):
    name: str
    expr: Expr


@dataclass(frozen=True)
class Store(Stmt):
    buffer: str
    index: Expr
    value: Expr

    def __post_init__(self) -> None:
        object.__setattr__(self, "buffer", _buffer_name(self.buffer))


@dataclass(frozen=True)
class AtomicAdd(Stmt):
    """buffer[index] = op(buffer[index], value) as one atomic read-modify-write (relaxed
    ordering): threads of any block may combine into the same element (a scatter whose
    updates collide). ``op`` "add": global buffers of f32/f64/i32/i64/u32 (`atomicrmw
    add/fadd` on both targets) and bf16/f16 (a compare-and-swap loop on the element's 16
    bits; the value is f32, each add rounds to the buffer's type). "max"/"min": a
    compare-and-swap loop on the element's bits for every type, the op as `Binary` computes
    it (NaN propagates as XLA's maximum does)."""
    buffer: str
    index: Expr
    value: Expr
    op: str = "add"

    def __post_init__(self) -> None:
        object.__setattr__(self, "buffer", _buffer_name(self.buffer))


ATOMIC_DTYPES = frozenset(CODEGEN_STORAGE[t] for t in ATOMIC_ADD_TYPES)
ATOMIC_OPS = frozenset({"add", "max", "min"})


@dataclass(frozen=True)
class For(Stmt):
    """for (var = start; var < stop; var += step) body. start/stop/step are evaluated once
    at loop entry; step must be positive. var's dtype is start's (i32 or i64)."""
    var: str
    start: Expr
    stop: Expr
    step: Expr
    body: tuple[Stmt, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "body", as_tuple(self.body))


@dataclass(frozen=True)
class If(Stmt):
    cond: Expr
    then: tuple[Stmt, ...]
    orelse: tuple[Stmt, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "then", as_tuple(self.then))
        object.__setattr__(self, "orelse", as_tuple(self.orelse))


@dataclass(frozen=True)
class Barrier(Stmt):
    """Block barrier (__syncthreads)."""


@dataclass(frozen=True)
class WarpShuffle(Stmt):
    """dest = value read from another lane of the warp (full mask). xor: lane ^ `lane`;
    down: lane + `lane` (own value past lane 31); idx: lane `lane` & 31."""
    dest: str
    value: Expr
    lane: Expr
    mode: str

    def __post_init__(self) -> None:
        if self.mode not in SHUFFLE_MODES:
            raise CodegenError(f"unknown shuffle mode {self.mode!r}")


@dataclass(frozen=True)
class WarpReduce(Stmt):
    """dest = op over `value` of all 32 lanes (xor butterfly); every lane gets the result."""
    dest: str
    value: Expr
    op: str

    def __post_init__(self) -> None:
        if self.op not in REDUCE_OPS:
            raise CodegenError(f"unknown warp reduce op {self.op!r}")


MMA_DTYPES = frozenset({"bf16", "f16", "tf32"})
# (m, n, k) of the PTX mma.sync shape each operand type uses.
MMA_SHAPES = {"bf16": (16, 8, 16), "f16": (16, 8, 16), "tf32": (16, 8, 8)}


@dataclass(frozen=True)
class MmaSync(Stmt):
    """Warp-wide D = A x B + C on tensor cores (PTX ``mma.sync.aligned.row.col``, f32
    accumulate). Every lane passes its fragment as f32 values, A's and B's rounded to
    ``dtype`` first; ``dest`` names the lane's four D values (f32). g = lane >> 2,
    q = lane & 3 (PTX ISA, "Matrix Fragments for mma.m16n8k16 / m16n8k8").

    bf16 / f16: m16n8k16, A 16x16, B 16x8, inputs rounded to nearest even.
    a[0..1] = A[g][2q..2q+1], a[2..3] = A[g+8][2q..2q+1], a[4..5] = A[g][2q+8..2q+9],
    a[6..7] = A[g+8][2q+8..2q+9]; b[0..1] = B[2q..2q+1][g], b[2..3] = B[2q+8..2q+9][g].

    tf32: m16n8k8, A 16x8, B 8x8, inputs rounded as ``cvt.rna.tf32.f32`` (10 mantissa bits,
    to nearest, ties away from zero). a[0] = A[g][q], a[1] = A[g+8][q], a[2] = A[g][q+4],
    a[3] = A[g+8][q+4]; b[0] = B[q][g], b[1] = B[q+4][g].

    Both: c[0..1] / dest[0..1] = C[g][2q..2q+1], c[2..3] / dest[2..3] = C[g+8][2q..2q+1]."""
    dest: tuple[str, ...]
    a: tuple[Expr, ...]
    b: tuple[Expr, ...]
    c: tuple[Expr, ...]
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        for attr in ("dest", "a", "b", "c"):
            object.__setattr__(self, attr, as_tuple(getattr(self, attr)))
        if self.dtype not in MMA_DTYPES:
            raise CodegenError(f"MmaSync dtype {self.dtype!r} not one of {sorted(MMA_DTYPES)}")

    @property
    def shape(self) -> tuple[int, int, int]:
        """(m, n, k) of one MMA."""
        return MMA_SHAPES[self.dtype]

    @property
    def fragment_sizes(self) -> dict[str, int]:
        """Values per lane of each operand: A has m k / 32, B k n / 32, C and D 4."""
        m, n, k = self.shape
        return {"a": m * k // 32, "b": k * n // 32, "c": 4, "dest": 4}


@dataclass(frozen=True)
class GridBarrier(Stmt):
    """Grid-wide barrier: every block's writes before it are visible to every block after
    it. Only in the kernel's top-level statement list (uniform across the grid), and no
    variable crosses it (values go through a `GlobalScratch` or an output). Valid only when
    every block of the grid is resident at once: the schedule keeps the grid within the
    occupancy limit (a cooperative launch is the runtime's guarantee on a GPU); the host
    target runs the phases between grid barriers one after another for every block."""


COLLECTIVES = (Barrier, WarpShuffle, WarpReduce, MmaSync)


# "barrier": one persistent launch, a software grid barrier between phases (every block must
# be resident: a cooperative launch). "relaunch": the launcher launches the kernel once per
# phase on one stream; each launch runs the next phase (stream order is the barrier), so any
# grid runs, at a launch per phase instead of a barrier.
GRID_SYNC_MODES = ("barrier", "relaunch")


def grid_phases(body: tuple[Stmt, ...]) -> list[tuple[Stmt, ...]]:
    """The top-level statements between grid barriers, in order (one phase without any)."""
    phases: list[tuple[Stmt, ...]] = [()]
    for s in body:
        if isinstance(s, GridBarrier):
            phases.append(())
        else:
            phases[-1] = (*phases[-1], s)
    return phases


def has_collective(stmt: Stmt) -> bool:
    """True if `stmt` is or contains a Barrier / WarpShuffle / WarpReduce."""
    if isinstance(stmt, COLLECTIVES):
        return True
    return any(has_collective(s) for body in child_bodies(stmt) for s in body)


def child_bodies(stmt: Stmt) -> tuple[tuple[Stmt, ...], ...]:
    if isinstance(stmt, For):
        return (stmt.body,)
    if isinstance(stmt, If):
        return (stmt.then, stmt.orelse)
    return ()


def walk_stmts(body: tuple[Stmt, ...]) -> Iterator[Stmt]:
    """Every statement in `body`, nested ones included, in program order."""
    for s in body:
        yield s
        for child in child_bodies(s):
            yield from walk_stmts(child)


def sub_exprs(e: Expr) -> tuple[Expr, ...]:
    """The expression operands of ``e`` (none for leaves)."""
    operands = _OPERANDS.get(type(e))
    if operands is None:
        # A subclass of a node type: its nearest base's operands (leaves: none).
        operands = next((_OPERANDS[c] for c in type(e).__mro__ if c in _OPERANDS),
                        _no_operands)
    return operands(e)


def _no_operands(e: Expr) -> tuple[Expr, ...]:
    return ()


# The operands of each node type, found by one lookup of its exact type (walks visit every
# node of DAGs of thousands).
_OPERANDS = {Load: lambda e: (e.index,), Binary: lambda e: (e.a, e.b),
             Compare: lambda e: (e.a, e.b), Unary: lambda e: (e.a,),
             Convert: lambda e: (e.a,), Bitcast: lambda e: (e.a,),
             Select: lambda e: (e.cond, e.a, e.b),
             **{leaf: _no_operands for leaf in (Const, Ref, ThreadIdx, BlockIdx, BlockDim,
                                                 GridDim)}}


def expr_refs(e: Expr) -> frozenset[tuple[str, str]]:
    """(name, dtype) of every variable ``e`` reads; memoized per expression object (they
    are DAGs, shared between statements)."""
    got = e.__dict__.get("_refs")
    if got is None:
        if isinstance(e, Ref):
            got = frozenset(((e.name, e.dtype),))
        else:
            # Mostly one operand reads variables: its set is shared, not copied.
            got = _NO_REFS
            for sub in sub_exprs(e):
                refs = expr_refs(sub)
                if refs and refs is not got:
                    got = got | refs if got else refs
        # (Through setattr, not the dict: an instance dict keeps the keys its class shares.)
        object.__setattr__(e, "_refs", got)
    return got


_NO_REFS: frozenset[tuple[str, str]] = frozenset()


def reads_thread_idx(e: Expr) -> bool:
    """Whether ``e`` reads ``ThreadIdx`` (memoized per expression object)."""
    got = e.__dict__.get("_thread")
    if got is None:
        got = isinstance(e, ThreadIdx) or any(map(reads_thread_idx, sub_exprs(e)))
        object.__setattr__(e, "_thread", got)
    return got


# ---------------------------------------------------------------- helpers


@functools.lru_cache(maxsize=1 << 16)
def multiple_of(e: Expr) -> int:
    """A number every value of the non-negative index expression ``e`` is a multiple of
    (0: e is 0), from its arithmetic: a loop's step index times the vector width, the
    remainders and sums of such. 1 where nothing is known."""
    if isinstance(e, Const):
        return abs(int(e.value)) if e.dtype == "i32" else 1
    if not isinstance(e, Binary) or not (isinstance(e.b, Const) and e.b.dtype == "i32"):
        if isinstance(e, Binary) and e.op == "add":
            return math.gcd(multiple_of(e.a), multiple_of(e.b))
        return 1
    k = int(e.b.value)
    if e.op == "mul":
        return multiple_of(e.a) * abs(k)
    if e.op == "add":
        return math.gcd(multiple_of(e.a), abs(k))
    if e.op == "rem" and k > 0:
        return math.gcd(multiple_of(e.a), k)
    return 1


def const(value: float | int | bool, dtype: str = "f32") -> Const:
    return Const(value, dtype)


def i32(value: int) -> Const:
    return Const(int(value), "i32")


def i64(value: int) -> Const:
    return Const(int(value), "i64")


def f32(value: float) -> Const:
    return Const(float(value), "f32")


def add(a: Expr, b: Expr) -> Binary:
    return Binary("add", a, b)


def mul(a: Expr, b: Expr) -> Binary:
    return Binary("mul", a, b)


def minimum(a: Expr, b: Expr) -> Binary:
    return Binary("min", a, b)


def logical_and(a: Expr, b: Expr) -> Binary:
    return Binary("and", a, b)


def less(a: Expr, b: Expr) -> Compare:
    return Compare("lt", a, b)


def load(buffer: Buffer, index: Expr) -> Load:
    return Load(buffer, index)  # type: ignore[arg-type]


def ref(stmt: "Let | Local", dtype: str | None = None) -> Ref:
    """A Ref to the variable a Let / Local defines."""
    if isinstance(stmt, Let):
        return Ref(stmt.name, stmt.expr.dtype)
    return Ref(stmt.name, dtype or stmt.dtype)


def is_identifier(name: str) -> bool:
    return bool(_IDENT.match(name))
