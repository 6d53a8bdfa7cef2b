"""Random memory-intensive HLO modules for differential fuzzing of the compiler
(tests/test_fuzz_codegen.py): f32 parameters of small random shapes, elementwise unary and
binary ops (cheap and expensive: exp, log, rsqrt, tanh, divide, each kept finite), broadcast,
reduce (add / max) over random axes including non-minor ones, the reduce-broadcast-back
pattern of softmax and the two dependent reductions of layer norm, reshape, transpose,
slice, concatenate, reverse, pad and compare + select; on some seeds (a separate random
stream, so the modules of the other seeds are unchanged) a scatter or gather with s32 index
parameters: the cross-entropy backward (scatter-add or scatter-max of one value per row at
iota/label index vectors: the "row" form, labels out of range on both sides), an embedding
gradient (scatter-add with colliding and out-of-range ids: the atomic form) or the loss's
gather of one element per row of a row-normalized value. ``module(seed)`` is a pure function
of the seed."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


# add/max reducers with names unique across the module (XLA's own parser renames repeated
# instruction names, so a module saved as a fixture would not round-trip through it).
REDUCERS = """add {
  add_a = f32[] parameter(0)
  add_b = f32[] parameter(1)
  ROOT add_s = f32[] add(add_a, add_b)
}
max {
  max_a = f32[] parameter(0)
  max_b = f32[] parameter(1)
  ROOT max_s = f32[] maximum(max_a, max_b)
}
"""
DIM_SIZES = (1, 2, 3, 4, 5, 7, 8, 16, 17, 32, 33, 40, 64, 100)
MAX_ELEMENTS = 6000


@dataclass
class _Value:
    name: str
    dims: tuple[int, ...]


@dataclass(frozen=True)
class IndexArg:
    """An s32 index parameter: random integers in [low, high)."""
    dims: tuple[int, ...]
    low: int
    high: int


def _shape(dims: tuple[int, ...]) -> str:
    return f"f32[{','.join(map(str, dims))}]"


@dataclass
class HloBuilder:
    """Appends instructions to an ENTRY computation; every value is f32."""
    rng: np.random.Generator
    lines: list[str] = field(default_factory=list)
    values: list[_Value] = field(default_factory=list)
    params: list[_Value] = field(default_factory=list)
    index_params: list[IndexArg] = field(default_factory=list)
    _n: int = 0

    def _emit(self, op: str, dims: tuple[int, ...], rest: str, keep: bool = True) -> _Value:
        self._n += 1
        v = _Value(f"{op.replace('-', '_')}.{self._n}", dims)
        self.lines.append(f"  {v.name} = {_shape(dims)} {op}{rest}")
        if keep:
            self.values.append(v)
        return v

    # --- leaves ----------------------------------------------------------------------
    def parameter(self, dims: tuple[int, ...]) -> _Value:
        v = self._emit("parameter", dims, f"({len(self.params)})")
        self.params.append(v)
        return v

    def constant(self, value: float, dims: tuple[int, ...]) -> _Value:
        self._n += 1
        scalar = f"c.{self._n}"
        self.lines.append(f"  {scalar} = f32[] constant({value!r})")
        if not dims:
            return _Value(scalar, ())
        return self._emit("broadcast", dims, f"({scalar}), dimensions={{}}", keep=False)

    # --- ops -------------------------------------------------------------------------
    def unary(self, op: str, x: _Value, keep: bool = True) -> _Value:
        return self._emit(op, x.dims, f"({x.name})", keep)

    def binary(self, op: str, a: _Value, b: _Value, keep: bool = True) -> _Value:
        assert a.dims == b.dims
        return self._emit(op, a.dims, f"({a.name}, {b.name})", keep)

    def plus_one_abs(self, x: _Value) -> _Value:
        """|x| + 1 (>= 1: log, rsqrt and divide stay finite)."""
        a = self.unary("abs", x, keep=False)
        return self.binary("add", a, self.constant(1.0, x.dims), keep=False)

    def broadcast(self, x: _Value, dims: tuple[int, ...], mapping: tuple[int, ...]) -> _Value:
        return self._emit("broadcast", dims,
                          f"({x.name}), dimensions={{{','.join(map(str, mapping))}}}")

    def reduce(self, x: _Value, axes: tuple[int, ...], kind: str) -> _Value:
        init = self.constant(0.0 if kind == "add" else float("-inf"), ())
        dims = tuple(d for i, d in enumerate(x.dims) if i not in axes)
        return self._emit("reduce", dims, f"({x.name}, {init.name}), dimensions="
                          f"{{{','.join(map(str, axes))}}}, to_apply={kind}")

    def reshape(self, x: _Value, dims: tuple[int, ...]) -> _Value:
        assert math.prod(dims) == math.prod(x.dims)
        return self._emit("reshape", dims, f"({x.name})")

    def transpose(self, x: _Value, perm: tuple[int, ...]) -> _Value:
        dims = tuple(x.dims[p] for p in perm)
        return self._emit("transpose", dims,
                          f"({x.name}), dimensions={{{','.join(map(str, perm))}}}")

    def slice(self, x: _Value, starts: tuple[int, ...], limits: tuple[int, ...]) -> _Value:
        dims = tuple(b - a for a, b in zip(starts, limits))
        spec = ", ".join(f"[{a}:{b}]" for a, b in zip(starts, limits))
        return self._emit("slice", dims, f"({x.name}), slice={{{spec}}}")

    def concatenate(self, a: _Value, b: _Value, axis: int) -> _Value:
        dims = tuple(d + (b.dims[i] if i == axis else 0) for i, d in enumerate(a.dims))
        return self._emit("concatenate", dims, f"({a.name}, {b.name}), dimensions={{{axis}}}")

    def reverse(self, x: _Value, axes: tuple[int, ...]) -> _Value:
        return self._emit("reverse", x.dims,
                          f"({x.name}), dimensions={{{','.join(map(str, axes))}}}")

    def pad(self, x: _Value, low: tuple[int, ...], high: tuple[int, ...]) -> _Value:
        zero = self.constant(0.0, ())
        dims = tuple(d + a + b for d, a, b in zip(x.dims, low, high))
        spec = "x".join(f"{a}_{b}" for a, b in zip(low, high))
        return self._emit("pad", dims, f"({x.name}, {zero.name}), padding={spec}")

    def select_greater(self, a: _Value, b: _Value) -> _Value:
        """select(a > b, a, b) through a pred compare."""
        self._n += 1
        pred = f"gt.{self._n}"
        dims = ",".join(map(str, a.dims))
        self.lines.append(f"  {pred} = pred[{dims}] compare({a.name}, {b.name}), "
                          "direction=GT")
        return self._emit("select", a.dims, f"({pred}, {a.name}, {b.name})")

    def raw(self, line: str) -> None:
        """An instruction that is not an f32 value (index computations)."""
        self.lines.append(f"  {line}")

    def fresh(self, hint: str) -> str:
        self._n += 1
        return f"{hint}.{self._n}"

    def index_parameter(self, dims: tuple[int, ...], low: int, high: int) -> str:
        """An s32 parameter numbered after the f32 ones (their numbers stay)."""
        name = self.fresh("ids")
        self.index_params.append(IndexArg(dims, low, high))
        self.raw(f"{name} = s32[{','.join(map(str, dims))}] parameter(INDEX_PARAM_"
                 f"{len(self.index_params) - 1})")
        return name

    def text(self, outputs: list[_Value]) -> str:
        body = "\n".join(self.lines)
        if len(outputs) == 1:
            root = f"  ROOT out = {_shape(outputs[0].dims)} copy({outputs[0].name})"
        else:
            types = ", ".join(_shape(v.dims) for v in outputs)
            root = f"  ROOT out = ({types}) tuple({', '.join(v.name for v in outputs)})"
        for k in range(len(self.index_params)):
            body = body.replace(f"parameter(INDEX_PARAM_{k})",
                                f"parameter({len(self.params) + k})")
        return f"HloModule fuzz\n\n{REDUCERS}\nENTRY main {{\n{body}\n{root}\n}}\n"


# ------------------------------------------------------------------------------ generator

def _random_dims(rng: np.random.Generator, rank: int | None = None) -> tuple[int, ...]:
    rank = int(rng.integers(1, 4)) if rank is None else rank
    while True:
        dims = tuple(int(d) for d in rng.choice(DIM_SIZES, rank))
        if math.prod(dims) <= MAX_ELEMENTS:
            return dims


def _factorizations(dims: tuple[int, ...], rng: np.random.Generator) -> tuple[int, ...]:
    """Another shape with the same element count: merge two adjacent dims, split one, or
    drop/add a 1."""
    choices = []
    if len(dims) >= 2:
        i = int(rng.integers(0, len(dims) - 1))
        choices.append(dims[:i] + (dims[i] * dims[i + 1],) + dims[i + 2:])
    splittable = [i for i, d in enumerate(dims) if d > 1 and any(d % f == 0 for f in (2, 4, 5))]
    if splittable and len(dims) < 4:
        i = int(rng.choice(splittable))
        f = next(f for f in (4, 2, 5) if dims[i] % f == 0)
        choices.append(dims[:i] + (dims[i] // f, f) + dims[i + 1:])
    if len(dims) < 4:
        i = int(rng.integers(0, len(dims) + 1))
        choices.append(dims[:i] + (1,) + dims[i:])
    return choices[int(rng.integers(0, len(choices)))]


UNARY = ("negate", "abs", "exponential", "log", "rsqrt", "tanh", "sqrt")
BINARY = ("add", "subtract", "multiply", "maximum", "minimum", "divide")
KINDS = ("unary", "binary", "binary", "broadcast", "reduce", "reduce_back", "reduce_back",
         "norm", "reshape", "transpose", "slice", "concatenate", "reverse", "pad", "select")


def _op(b: HloBuilder, rng: np.random.Generator) -> None:
    kind = KINDS[int(rng.integers(0, len(KINDS)))]
    # Recent values more often: chains, not only fans from the parameters.
    weights = np.arange(1, len(b.values) + 1, dtype=float) ** 1.5
    x = b.values[int(rng.choice(len(b.values), p=weights / weights.sum()))]
    if kind == "unary":
        op = UNARY[int(rng.integers(0, len(UNARY)))]
        if op == "exponential":          # exp(tanh x): bounded
            b.unary("exponential", b.unary("tanh", x, keep=False))
        elif op in ("log", "rsqrt", "sqrt"):
            b.unary(op, b.plus_one_abs(x))
        else:
            b.unary(op, x)
    elif kind == "binary":
        same = [v for v in b.values if v.dims == x.dims]
        y = same[int(rng.integers(0, len(same)))]
        op = BINARY[int(rng.integers(0, len(BINARY)))]
        b.binary(op, x, b.plus_one_abs(y) if op == "divide" else y)
    elif kind == "broadcast":
        if len(x.dims) >= 3:
            return
        pos = int(rng.integers(0, len(x.dims) + 1))
        size = int(rng.choice(DIM_SIZES[:10]))
        dims = x.dims[:pos] + (size,) + x.dims[pos:]
        if math.prod(dims) > MAX_ELEMENTS:
            return
        mapping = tuple(i if i < pos else i + 1 for i in range(len(x.dims)))
        b.broadcast(x, dims, mapping)
    elif kind in ("reduce", "reduce_back"):
        if not x.dims:
            return
        n = int(rng.integers(1, len(x.dims) + 1))
        axes = tuple(sorted(int(a) for a in rng.choice(len(x.dims), n, replace=False)))
        red = "add" if rng.random() < 0.6 else "max"
        r = b.reduce(x, axes, red)
        if kind == "reduce_back":
            kept = tuple(i for i in range(len(x.dims)) if i not in axes)
            back = b.broadcast(r, x.dims, kept)
            op = ("subtract", "multiply", "divide", "add")[int(rng.integers(0, 4))]
            b.binary(op, x, b.plus_one_abs(back) if op == "divide" else back)
    elif kind == "norm":
        # Layer norm over random axes: two reductions of the same rows, the second of a
        # value derived from the first's result.
        if not x.dims:
            return
        n = int(rng.integers(1, len(x.dims) + 1))
        axes = tuple(sorted(int(a) for a in rng.choice(len(x.dims), n, replace=False)))
        kept = tuple(i for i in range(len(x.dims)) if i not in axes)
        count = math.prod(x.dims[a] for a in axes)
        mean = b.reduce(x, axes, "add")
        mean = b.binary("multiply", mean, b.constant(1.0 / count, mean.dims), keep=False)
        centered = b.binary("subtract", x, b.broadcast(mean, x.dims, kept), keep=False)
        var = b.reduce(b.binary("multiply", centered, centered, keep=False), axes, "add")
        scale = b.unary("rsqrt", b.plus_one_abs(var), keep=False)
        b.binary("multiply", centered, b.broadcast(scale, x.dims, kept))
    elif kind == "reverse":
        if not x.dims:
            return
        n = int(rng.integers(1, len(x.dims) + 1))
        b.reverse(x, tuple(sorted(int(a) for a in rng.choice(len(x.dims), n, replace=False))))
    elif kind == "pad":
        if not x.dims:
            return
        low = tuple(int(v) for v in rng.integers(0, 3, len(x.dims)))
        high = tuple(int(v) for v in rng.integers(0, 3, len(x.dims)))
        if math.prod(d + a + c for d, a, c in zip(x.dims, low, high)) <= MAX_ELEMENTS:
            b.pad(x, low, high)
    elif kind == "select":
        same = [v for v in b.values if v.dims == x.dims]
        b.select_greater(x, same[int(rng.integers(0, len(same)))])
    elif kind == "reshape":
        b.reshape(x, _factorizations(x.dims, rng))
    elif kind == "transpose":
        if len(x.dims) < 2:
            return
        b.transpose(x, tuple(int(p) for p in rng.permutation(len(x.dims))))
    elif kind == "slice":
        if not x.dims or max(x.dims) < 2:
            return
        axis = int(rng.choice([i for i, d in enumerate(x.dims) if d >= 2]))
        lo = int(rng.integers(0, x.dims[axis] - 1))
        hi = int(rng.integers(lo + 1, x.dims[axis] + 1))
        starts = tuple(lo if i == axis else 0 for i in range(len(x.dims)))
        limits = tuple(hi if i == axis else d for i, d in enumerate(x.dims))
        b.slice(x, starts, limits)
    elif kind == "concatenate":
        if not x.dims:
            return
        axis = int(rng.integers(0, len(x.dims)))
        others = [v for v in b.values if len(v.dims) == len(x.dims) and all(
            d == e for i, (d, e) in enumerate(zip(v.dims, x.dims)) if i != axis)]
        y = others[int(rng.integers(0, len(others)))]
        if math.prod(x.dims) + math.prod(y.dims) <= MAX_ELEMENTS:
            b.concatenate(x, y, axis)


# Share of seeds that get a scatter or gather (drawn from a stream of their own).
INDEX_OP_SHARE = 0.4
INDEX_KINDS = ("row_scatter", "atomic_scatter", "row_gather")


def _rows_of(b: HloBuilder, x: _Value) -> _Value:
    """x as a rank-2 value (rows, columns): reshaped when it has another rank."""
    if len(x.dims) == 2:
        return x
    rows = x.dims[0] if len(x.dims) > 1 else 1
    return b.reshape(x, (rows, math.prod(x.dims) // rows))


def _row_indices(b: HloBuilder, rows: int, columns: int) -> str:
    """s32[rows, 2] index vectors (r, label[r]) as jax writes take_along_axis: labels out of
    range below and above."""
    labels = b.index_parameter((rows,), -2, columns + 2)
    iota, lab, cat = b.fresh("iota"), b.fresh("lab"), b.fresh("idx")
    b.raw(f"{iota} = s32[{rows},1] iota(), iota_dimension=0")
    b.raw(f"{lab} = s32[{rows},1] reshape({labels})")
    b.raw(f"{cat} = s32[{rows},2] concatenate({iota}, {lab}), dimensions={{1}}")
    return cat


def _index_op(b: HloBuilder, rng: np.random.Generator) -> _Value | None:
    kind = INDEX_KINDS[int(rng.integers(0, len(INDEX_KINDS)))]
    x = _rows_of(b, b.values[int(rng.integers(0, len(b.values)))])
    rows, columns = x.dims
    if kind == "row_scatter":
        # Cross-entropy backward: one update per row (a row reduction, so the updates carry
        # rows, or a constant) scattered into zeros or into x, then added to x.
        idx = _row_indices(b, rows, columns)
        if rng.random() < 0.5:
            update = b.reduce(x, (1,), "add" if rng.random() < 0.7 else "max")
        else:
            update = b.constant(-1.0 / rows, (rows,))
        operand = x if rng.random() < 0.3 else b.constant(0.0, x.dims)
        combiner = "add" if rng.random() < 0.8 else "max"
        if rng.random() < 0.5:
            upd = b.reshape(update, (rows, 1, 1))
            numbers = "update_window_dims={1,2}, inserted_window_dims={}"
        else:
            upd = update
            numbers = "update_window_dims={}, inserted_window_dims={0,1}"
        sc = b._emit("scatter", x.dims, f"({operand.name}, {idx}, {upd.name}), {numbers}, "
                     f"scatter_dims_to_operand_dims={{0,1}}, index_vector_dim=1, "
                     f"to_apply={combiner}", keep=False)
        return b.binary("add", sc, x)
    if kind == "atomic_scatter":
        # Embedding gradient: rows of x added into a table at ids that repeat.
        table = int(rng.integers(2, 9))
        ids = b.index_parameter((rows,), -2, table + 2)
        operand = b.parameter((table, columns))
        return b._emit("scatter", (table, columns), f"({operand.name}, {ids}, {x.name}), "
                       "update_window_dims={1}, inserted_window_dims={0}, "
                       "scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=add")
    # The loss: log-softmax-like rows, one element of each gathered, then summed.
    m = b.reduce(x, (1,), "max")
    centered = b.binary("subtract", x, b.broadcast(m, x.dims, (0,)), keep=False)
    idx = _row_indices(b, rows, columns)
    g = b._emit("gather", (rows, 1, 1), f"({centered.name}, {idx}), offset_dims={{1,2}}, "
                "collapsed_slice_dims={}, start_index_map={0,1}, index_vector_dim=1, "
                "slice_sizes={1,1}", keep=False)
    return b.reduce(g, (0, 1, 2), "add")


def module(seed: int, index_ops: bool = True) -> tuple[str, list]:
    """(HLO text, parameter shapes: f32 dims, then ``IndexArg``s) of the module of ``seed``;
    ``index_ops=False`` gives the module the seed had before scatters/gathers existed."""
    rng = np.random.default_rng(seed)
    b = HloBuilder(rng)
    first = _random_dims(rng)
    b.parameter(first)
    for _ in range(int(rng.integers(0, 3))):
        # Extra parameters share the first one's shape half the time (binary ops need it).
        b.parameter(first if rng.random() < 0.5 else _random_dims(rng))
    for _ in range(int(rng.integers(3, 15))):
        _op(b, rng)
    computed = [v for v in b.values if v not in b.params] or b.values[:1]
    outputs = [computed[-1]]
    extra = [v for v in computed[:-1] if rng.random() < 0.25]
    outputs += extra[:2]
    extra_rng = np.random.default_rng(seed + 7_000_003)
    if index_ops and extra_rng.random() < INDEX_OP_SHARE:
        made = _index_op(b, extra_rng)
        if made is not None:
            outputs.append(made)
    return b.text(outputs), [p.dims for p in b.params] + list(b.index_params)


def random_args(shapes: list, seed: int) -> list[np.ndarray]:
    """Fresh N(0, 1) inputs (never zeros); index parameters uniform in their range (out of
    range on both sides, repeats)."""
    rng = np.random.default_rng(seed + 1_000_003)
    out = [rng.standard_normal(s).astype(np.float32) for s in shapes
           if not isinstance(s, IndexArg)]
    for s in shapes:
        if isinstance(s, IndexArg):
            out.append(rng.integers(s.low, s.high, s.dims).astype(np.int32))
    return out
