"""Kernel IR: a small structured SIMT language that both code generators (host, NVPTX) consume.

A `Kernel` is the body one GPU thread runs, with a 1-D grid of 1-D blocks. Expressions are
immutable and typed at construction (`dtype` on every node); statements are structured
(no goto / break / return), so every Let dominates the rest of its scope. `Kernel.validate()`
checks names, types, buffers and that block collectives sit in uniform control flow.

Value dtypes (what expressions compute in): f32 f64 i1 i8 i32 i64 u8 u32. Storage dtypes
add f16 and bf16, which only appear as buffer element types: a Load of an f16/bf16 buffer
yields f32 and a Store into one takes f32 (converted at the edge, round to nearest even).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Iterator, Union

from stitch.codegen.errors import CodegenError
from stitch.hlo_passes.combiners import ATOMIC_ADD_TYPES
from stitch.hlo_passes.element_types import CODEGEN_STORAGE, REINTERPRET_WIDTHS

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
_NUMERIC = FLOAT_DTYPES | INT_DTYPES
_BINARY_DTYPES: dict[str, frozenset[str]] = {
    **{op: _NUMERIC for op in ("add", "sub", "mul", "div", "rem", "min", "max")},
    "pow": FLOAT_DTYPES, "atan2": FLOAT_DTYPES,
    **{op: INT_DTYPES | {"i1"} for op in ("and", "or", "xor")},
    **{op: INT_DTYPES for op in ("shl", "shr_logical", "shr_arith")},
}
_UNARY_DTYPES: dict[str, frozenset[str]] = {
    **{op: FLOAT_DTYPES for op in UNARY_OPS},
    "neg": _NUMERIC, "abs": _NUMERIC, "sign": _NUMERIC, "not": INT_DTYPES | {"i1"},
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


def _tuple(body: object) -> tuple:
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
        object.__setattr__(self, "body", _tuple(self.body))


@dataclass(frozen=True)
class If(Stmt):
    cond: Expr
    then: tuple[Stmt, ...]
    orelse: tuple[Stmt, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "then", _tuple(self.then))
        object.__setattr__(self, "orelse", _tuple(self.orelse))


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
            object.__setattr__(self, attr, _tuple(getattr(self, attr)))
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


def has_atomics(kernel: "Kernel") -> bool:
    """True if the kernel adds atomically into an output (an in-place scatter: its output
    buffer may be one of its inputs' buffers, ``LoweredKernel.initial``)."""
    return any(isinstance(s, AtomicAdd) for s in walk_stmts(kernel.body))


def has_grid_barrier(kernel: "Kernel") -> bool:
    """True if the kernel synchronises its grid (its blocks must all be resident)."""
    return any(isinstance(s, GridBarrier) for s in kernel.body)


# "barrier": one persistent launch, a software grid barrier between phases (every block must
# be resident: a cooperative launch). "relaunch": the launcher launches the kernel once per
# phase on one stream; each launch runs the next phase (stream order is the barrier), so any
# grid runs, at a launch per phase instead of a barrier.
GRID_SYNC_MODES = ("barrier", "relaunch")


def launches(kernel: "Kernel") -> int:
    """Launches a GPU makes of the kernel per call (a phase each in "relaunch" mode)."""
    if kernel.grid_sync == "relaunch" and has_grid_barrier(kernel):
        return len(grid_phases(kernel.body))
    return 1


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
    if isinstance(e, Load):
        return (e.index,)
    if isinstance(e, (Binary, Compare)):
        return (e.a, e.b)
    if isinstance(e, (Unary, Convert, Bitcast)):
        return (e.a,)
    if isinstance(e, Select):
        return (e.cond, e.a, e.b)
    return ()


def expr_refs(e: Expr) -> frozenset[tuple[str, str]]:
    """(name, dtype) of every variable ``e`` reads; memoized per expression object (they
    are DAGs, shared between statements)."""
    got = e.__dict__.get("_refs")
    if got is None:
        if isinstance(e, Ref):
            got = frozenset(((e.name, e.dtype),))
        else:
            subs = sub_exprs(e)
            got = frozenset().union(*map(expr_refs, subs)) if subs else frozenset()
        object.__setattr__(e, "_refs", got)
    return got


def reads_thread_idx(e: Expr) -> bool:
    """Whether ``e`` reads ``ThreadIdx`` (memoized per expression object)."""
    got = e.__dict__.get("_thread")
    if got is None:
        got = isinstance(e, ThreadIdx) or any(map(reads_thread_idx, sub_exprs(e)))
        object.__setattr__(e, "_thread", got)
    return got


# ---------------------------------------------------------------- kernel


@dataclass(frozen=True)
class Kernel:
    name: str
    params: tuple[Param, ...]
    shared: tuple[Shared, ...]
    grid: int
    block: int
    body: tuple[Stmt, ...]
    scratch: tuple[GlobalScratch, ...] = ()
    # How a GPU meets the grid barriers (`GRID_SYNC_MODES`); the host ignores it.
    grid_sync: str = "barrier"
    # Registers per thread ptxas may use (PTX .maxnreg); None leaves the choice to ptxas.
    register_budget: int | None = None

    def __post_init__(self) -> None:
        for attr in ("params", "shared", "body", "scratch"):
            object.__setattr__(self, attr, _tuple(getattr(self, attr)))

    @property
    def buffers(self) -> dict[str, Buffer]:
        return {b.name: b for b in (*self.params, *self.shared, *self.scratch)}

    def validate(self) -> "Kernel":
        """Raise CodegenError (naming the kernel and the statement) if the kernel is malformed.
        A kernel is immutable: once it passed, later calls (lowering, each build) are free."""
        if not self.__dict__.get("_valid", False):
            _Checker(self).run()
            object.__setattr__(self, "_valid", True)
        return self

    def renamed(self, name: str) -> "Kernel":
        """This kernel called ``name``. Validity does not depend on the name once it is an
        identifier, so a validated kernel's copy is not checked again."""
        copy = dataclasses.replace(self, name=name)
        if self.__dict__.get("_valid", False) and is_identifier(name):
            object.__setattr__(copy, "_valid", True)
        return copy


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


# ---------------------------------------------------------------- validation


@dataclass
class _Var:
    dtype: str
    kind: str        # "let" | "local" | "loop" | "lane" (shuffle / reduce result)
    varying: bool    # may differ between threads of a block
    key: int         # id() of the defining statement (Locals' varying-ness is a fixed point)


_INT_RANGES = {"i8": (-2**7, 2**7 - 1), "i32": (-2**31, 2**31 - 1), "i64": (-2**63, 2**63 - 1),
               "u8": (0, 2**8 - 1), "u32": (0, 2**32 - 1), "i1": (0, 1)}


def _describe(stmt: Stmt) -> str:
    key = getattr(stmt, "name", None) or getattr(stmt, "dest", None) or getattr(stmt, "var", None) \
        or getattr(stmt, "buffer", None)
    return f"{type(stmt).__name__}({key})" if key else type(stmt).__name__


class _Checker:
    """Walks a kernel with a scope stack. Locals assigned thread-dependent values (or under
    thread-dependent control flow) are varying; that is a fixed point, so the walk repeats
    until no Local changes, and only the last walk reports collectives in divergent code."""

    def __init__(self, kernel: Kernel) -> None:
        self.k = kernel
        self.buffers: dict[str, Buffer] = {}
        self.varying_locals: set[int] = set()
        self.changed = False
        self.final = False
        self._checked: dict[int, Expr] = {}      # expressions whose scope-free checks passed
        self._read_uniform: set[int] = set()     # Locals this walk read while uniform

    def fail(self, where: str, msg: str) -> None:
        raise CodegenError(f"kernel {self.k.name!r}: {where}: {msg}")

    def run(self) -> None:
        """Walk the body until the varying set settles; the pass that changes nothing saw
        the settled set and is the final one. A Local that turns varying only counts as a
        change when this walk read it earlier as uniform (a loop's back edge): reads after
        the change saw it varying already, so most kernels take one walk. The final-only
        check (a collective under thread-dependent control flow) runs in every pass:
        divergence only grows as the varying set does, so what fails in an early pass fails
        in the final one too."""
        self._header()
        self.final = True
        for _ in range(len(list(walk_stmts(self.k.body))) + 2):
            self.changed = False
            self._read_uniform.clear()
            self._body(self.k.body, [], None, "body")
            if not self.changed:
                return
        self._body(self.k.body, [], None, "body")

    def _header(self) -> None:
        k = self.k
        if not isinstance(k.name, str) or not is_identifier(k.name):
            raise CodegenError(f"kernel name {k.name!r} is not an identifier")
        if not isinstance(k.grid, int) or k.grid < 1:
            self.fail("launch", f"grid {k.grid!r} must be a positive int")
        if not isinstance(k.block, int) or k.block % 32 or not 32 <= k.block <= 1024:
            self.fail("launch", f"block {k.block!r} must be a multiple of 32 in [32, 1024]")
        if k.grid_sync not in GRID_SYNC_MODES:
            self.fail("launch", f"grid_sync {k.grid_sync!r} is not one of {GRID_SYNC_MODES}")
        if k.register_budget is not None and not 16 <= k.register_budget <= 255:
            self.fail("launch", f"register budget {k.register_budget} is outside 16..255")
        for kind, bufs in (("param", k.params), ("shared", k.shared), ("scratch", k.scratch)):
            for b in bufs:
                cls = {"param": Param, "shared": Shared, "scratch": GlobalScratch}[kind]
                if not isinstance(b, cls):
                    self.fail(kind, f"{b!r} is not a {cls.__name__}")
                if not is_identifier(b.name):
                    self.fail(kind, f"buffer name {b.name!r} is not an identifier")
                if b.name in self.buffers:
                    self.fail(kind, f"buffer {b.name!r} defined twice")
                if b.dtype not in STORAGE_DTYPES:
                    self.fail(kind, f"buffer {b.name!r} has unknown dtype {b.dtype!r}")
                if kind == "scratch" and b.dtype not in VALUE_DTYPES - {"i1"}:
                    self.fail(kind, f"scratch {b.name!r} must hold a value dtype, not {b.dtype}")
                if not isinstance(b.size, int) or b.size < 1:
                    self.fail(kind, f"buffer {b.name!r} size {b.size!r} must be a positive int")
                if b.size > MAX_INDEX_ELEMENTS:
                    self.fail(kind, f"buffer {b.name!r} has {b.size:,} elements, over 2^31 - 1: "
                                    "index arithmetic is 32-bit (i32 offsets would wrap to an "
                                    "illegal address); refused, left to XLA")
                self.buffers[b.name] = b
        if k.grid * k.block > MAX_INDEX_ELEMENTS:
            self.fail("launch", f"{k.grid} blocks x {k.block} threads is over 2^31 - 1: thread "
                                "ids are 32-bit; refused, left to XLA")

    # ------------------------------------------------------------ scopes

    @staticmethod
    def _lookup(scopes: list[dict[str, _Var]], name: str) -> _Var | None:
        for frame in reversed(scopes):
            if name in frame:
                return frame[name]
        return None

    def _define(self, scopes: list[dict[str, _Var]], name: str, var: _Var, where: str) -> None:
        if not isinstance(name, str) or not is_identifier(name):
            self.fail(where, f"variable name {name!r} is not an identifier")
        if name in scopes[-1]:
            self.fail(where, f"{name!r} is already defined in this scope")
        scopes[-1][name] = var

    # ------------------------------------------------------------ expressions

    def _expr(self, e: Expr, scopes: list[dict[str, _Var]], where: str) -> bool:
        """Type-check `e`; return whether its value may differ between threads: it reads
        the thread index or a varying variable.

        The checks that need no scope (dtypes, constants, buffers) run once per expression
        object in the whole validation: lowered expressions are DAGs shared between
        statements, and the body is walked until the varying set settles. The variables it
        reads are looked up where it is used."""
        self._check_structure(e, where)
        varying = reads_thread_idx(e)
        for name, dtype in sorted(expr_refs(e)):
            var = self._lookup(scopes, name)
            if var is None:
                self.fail(where, f"undefined variable {name!r}")
            if var.dtype != dtype:
                self.fail(where, f"Ref({name}) has dtype {dtype}, variable is {var.dtype}")
            if var.kind == "local" and not var.varying:
                self._read_uniform.add(var.key)
            varying = varying or var.varying
        return varying

    def _check_structure(self, e: Expr, where: str) -> None:
        stack = [e]
        while stack:
            x = stack.pop()
            if id(x) in self._checked:
                continue
            if not isinstance(x, Expr):
                self.fail(where, f"{x!r} is not an expression")
            subs = sub_exprs(x)
            for sub in subs:
                if not isinstance(sub, Expr):
                    self.fail(where, f"{sub!r} is not an expression")
            self._check_node(x, where)
            self._checked[id(x)] = x        # kept alive: ids stay unique
            stack.extend(subs)

    def _check_node(self, e: Expr, where: str) -> None:
        """The scope-free checks of one expression node (its operands are expressions)."""
        if e.dtype not in VALUE_DTYPES:
            self.fail(where, f"{type(e).__name__} has non-value dtype {e.dtype!r}")
        if isinstance(e, Const):
            self._const(e, where)
            return
        if isinstance(e, (Ref, ThreadIdx, BlockIdx, BlockDim, GridDim)):
            return
        if isinstance(e, Load):
            buf = self.buffers.get(e.buffer)
            if buf is None:
                self.fail(where, f"Load from unknown buffer {e.buffer!r}")
            if e.dtype != value_dtype(buf.dtype):
                self.fail(where, f"Load({e.buffer}) dtype {e.dtype} but buffer is {buf.dtype}")
            if e.index.dtype not in INDEX_DTYPES:
                self.fail(where, f"Load({e.buffer}) index has dtype {e.index.dtype}, need i32/i64")
        elif isinstance(e, (Binary, Compare)):
            if e.a.dtype != e.b.dtype:
                self.fail(where, f"{type(e).__name__}({e.op}) operands {e.a.dtype} vs {e.b.dtype}")
            if isinstance(e, Binary) and e.a.dtype not in _BINARY_DTYPES[e.op]:
                self.fail(where, f"Binary({e.op}) does not take {e.a.dtype}")
        elif isinstance(e, Unary):
            if e.a.dtype not in _UNARY_DTYPES[e.op]:
                self.fail(where, f"Unary({e.op}) does not take {e.a.dtype}")
        elif isinstance(e, Select):
            if e.cond.dtype != "i1":
                self.fail(where, f"Select condition has dtype {e.cond.dtype}, need i1")
            if e.a.dtype != e.b.dtype:
                self.fail(where, f"Select branches {e.a.dtype} vs {e.b.dtype}")
        elif isinstance(e, Bitcast):
            if bitcast_problem(e.a.dtype, e.dtype):
                self.fail(where, f"Bitcast {e.a.dtype} -> {e.dtype}")
        elif not isinstance(e, Convert):
            self.fail(where, f"unknown expression {type(e).__name__}")

    def _const(self, e: Const, where: str) -> None:
        v = e.value
        if e.dtype in FLOAT_DTYPES:
            ok = isinstance(v, numbers.Real) and not isinstance(v, bool)
        else:
            lo, hi = _INT_RANGES[e.dtype]
            ok = isinstance(v, numbers.Integral) and lo <= int(v) <= hi
        if not ok:
            self.fail(where, f"Const {v!r} does not fit dtype {e.dtype}")

    # ------------------------------------------------------------ statements

    def _body(self, body: tuple[Stmt, ...], scopes: list[dict[str, _Var]],
              divergent: str | None, path: str, frame: dict[str, _Var] | None = None) -> None:
        top = not scopes
        scopes = [*scopes, dict(frame or {})]
        for i, s in enumerate(body):
            if isinstance(s, GridBarrier):
                if not top:
                    self.fail(f"{path}[{i}] GridBarrier", "a grid barrier must be a top-level "
                              "statement of the kernel (uniform across the grid)")
                # No variable crosses a grid barrier: values go through global memory.
                scopes = [{}]
                continue
            self._stmt(s, scopes, divergent, f"{path}[{i}]")

    def _stmt(self, s: Stmt, scopes: list[dict[str, _Var]], divergent: str | None,
              path: str) -> None:
        if not isinstance(s, Stmt):
            self.fail(path, f"{s!r} is not a statement")
        where = f"{path} {_describe(s)}"
        if isinstance(s, Let):
            varying = self._expr(s.expr, scopes, where)
            self._define(scopes, s.name, _Var(s.expr.dtype, "let", varying, id(s)), where)
        elif isinstance(s, Local):
            if s.dtype not in VALUE_DTYPES:
                self.fail(where, f"Local dtype {s.dtype!r} is not a value dtype")
            varying = id(s) in self.varying_locals
            if s.init is not None:
                varying |= self._expr(s.init, scopes, where)
                if s.init.dtype != s.dtype:
                    self.fail(where, f"init has dtype {s.init.dtype}, Local is {s.dtype}")
            self._define(scopes, s.name, _Var(s.dtype, "local", varying, id(s)), where)
        elif isinstance(s, Assign):
            var = self._lookup(scopes, s.name)
            if var is None:
                self.fail(where, f"assignment to undefined variable {s.name!r}")
            if var.kind != "local":
                self.fail(where, f"{s.name!r} is a {var.kind} variable, only Locals are mutable")
            varying = self._expr(s.expr, scopes, where)
            if s.expr.dtype != var.dtype:
                self.fail(where, f"value has dtype {s.expr.dtype}, {s.name!r} is {var.dtype}")
            if (varying or divergent) and not var.varying:
                var.varying = True
                self.varying_locals.add(var.key)
                # Only a read that saw it uniform is stale; later reads see it varying.
                self.changed = self.changed or var.key in self._read_uniform
        elif isinstance(s, Store):
            self._store(s, scopes, where)
        elif isinstance(s, AtomicAdd):
            self._atomic(s, scopes, where)
        elif isinstance(s, For):
            self._for(s, scopes, divergent, path, where)
        elif isinstance(s, If):
            if self._expr(s.cond, scopes, where):
                divergent = divergent or f"{where} (condition depends on threadIdx)"
            if s.cond.dtype != "i1":
                self.fail(where, f"condition has dtype {s.cond.dtype}, need i1")
            self._body(s.then, scopes, divergent, f"{path}.then")
            self._body(s.orelse, scopes, divergent, f"{path}.orelse")
        elif isinstance(s, COLLECTIVES):
            self._collective(s, scopes, divergent, where)
        else:
            self.fail(where, "unknown statement")

    def _store(self, s: Store, scopes: list[dict[str, _Var]], where: str) -> None:
        buf = self.buffers.get(s.buffer)
        if buf is None:
            self.fail(where, f"Store to unknown buffer {s.buffer!r}")
        if isinstance(buf, Param) and not buf.is_output:
            self.fail(where, f"Store to param {s.buffer!r}, which is not marked is_output")
        self._expr(s.index, scopes, where)
        self._expr(s.value, scopes, where)
        if s.index.dtype not in INDEX_DTYPES:
            self.fail(where, f"index has dtype {s.index.dtype}, need i32/i64")
        if s.value.dtype != value_dtype(buf.dtype):
            self.fail(where, f"value has dtype {s.value.dtype}, buffer {buf.name!r} "
                             f"({buf.dtype}) takes {value_dtype(buf.dtype)}")

    def _atomic(self, s: AtomicAdd, scopes: list[dict[str, _Var]], where: str) -> None:
        buf = self.buffers.get(s.buffer)
        if not isinstance(buf, Param) or not buf.is_output:
            self.fail(where, f"AtomicAdd needs an output param, {s.buffer!r} is not one")
        if buf.dtype not in ATOMIC_DTYPES:
            self.fail(where, f"AtomicAdd does not take {buf.dtype} buffers")
        if s.op not in ATOMIC_OPS:
            self.fail(where, f"AtomicAdd op {s.op!r} is not one of {sorted(ATOMIC_OPS)}")
        self._expr(s.index, scopes, where)
        self._expr(s.value, scopes, where)
        if s.index.dtype not in INDEX_DTYPES:
            self.fail(where, f"index has dtype {s.index.dtype}, need i32/i64")
        if s.value.dtype != value_dtype(buf.dtype):
            self.fail(where, f"value has dtype {s.value.dtype}, buffer {buf.name!r} "
                             f"({buf.dtype}) takes {value_dtype(buf.dtype)}")

    def _for(self, s: For, scopes: list[dict[str, _Var]], divergent: str | None, path: str,
             where: str) -> None:
        varying = any([self._expr(e, scopes, where) for e in (s.start, s.stop, s.step)])
        dtypes = {s.start.dtype, s.stop.dtype, s.step.dtype}
        if len(dtypes) != 1 or s.start.dtype not in INDEX_DTYPES:
            self.fail(where, f"start/stop/step dtypes {sorted(dtypes)} must all be i32 or i64")
        if isinstance(s.step, Const) and s.step.value <= 0:
            self.fail(where, f"step {s.step.value} must be positive")
        if varying:
            divergent = divergent or f"{where} (bounds depend on threadIdx)"
        frame = {}
        self._define([frame], s.var, _Var(s.start.dtype, "loop", varying, id(s)), where)
        self._body(s.body, scopes, divergent, f"{path}.body", frame)

    def _collective(self, s: Stmt, scopes: list[dict[str, _Var]], divergent: str | None,
                    where: str) -> None:
        if divergent and self.final:
            self.fail(where, f"block/warp collective in thread-dependent control flow: {divergent}")
        if isinstance(s, WarpShuffle):
            self._expr(s.value, scopes, where)
            self._expr(s.lane, scopes, where)
            if s.lane.dtype != "i32":
                self.fail(where, f"lane has dtype {s.lane.dtype}, need i32")
            self._define(scopes, s.dest, _Var(s.value.dtype, "lane", True, id(s)), where)
        elif isinstance(s, WarpReduce):
            self._expr(s.value, scopes, where)
            if s.value.dtype not in _NUMERIC:
                self.fail(where, f"WarpReduce does not take {s.value.dtype}")
            self._define(scopes, s.dest, _Var(s.value.dtype, "lane", True, id(s)), where)
        elif isinstance(s, MmaSync):
            m, n, k = s.shape
            for part, want in s.fragment_sizes.items():
                if len(getattr(s, part)) != want:
                    self.fail(where, f"MmaSync {part} has {len(getattr(s, part))} values, "
                                     f"m{m}n{n}k{k} ({s.dtype}) takes {want}")
            for e in (*s.a, *s.b, *s.c):
                self._expr(e, scopes, where)
                if e.dtype != "f32":
                    self.fail(where, f"MmaSync fragment value has dtype {e.dtype}, need f32")
            for name in s.dest:
                self._define(scopes, name, _Var("f32", "lane", True, id(s)), where)
