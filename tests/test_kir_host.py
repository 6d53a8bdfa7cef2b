"""Kernel IR on the host target (SIMT on the CPU) against numpy.

The kernel builders here are reused by tests/test_kir_nvptx.py: the same IR must run right on
the host and assemble for the GPU.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from stitch.codegen import kir
from stitch.codegen.errors import CodegenError
from stitch.codegen.host import NUMPY_DTYPES, compile_host
from stitch.codegen.kir import (Assign, Barrier, Binary, BlockDim, BlockIdx, Compare, Const, Convert,
                                For, GridDim, If, Kernel, Let, Load, Local, Param, Ref, Select, Shared,
                                Store, ThreadIdx, Unary, WarpReduce, WarpShuffle, f32, i32)
from stitch.codegen.printer import format_kernel

RNG = np.random.default_rng


# ---------------------------------------------------------------- small IR helpers


def add(a: kir.Expr, b: kir.Expr) -> Binary:
    return Binary("add", a, b)


def mul(a: kir.Expr, b: kir.Expr) -> Binary:
    return Binary("mul", a, b)


def lt(a: kir.Expr, b: kir.Expr) -> Compare:
    return Compare("lt", a, b)


def eq(a: kir.Expr, b: kir.Expr) -> Compare:
    return Compare("eq", a, b)


def v32(name: str) -> Ref:
    return Ref(name, "i32")


def vf(name: str) -> Ref:
    return Ref(name, "f32")


GLOBAL_ID = Let("i", add(mul(BlockIdx(), BlockDim()), ThreadIdx()))
LANE = Let("lane", Binary("and", ThreadIdx(), i32(31)))
WARP = Let("warp", Binary("shr_logical", ThreadIdx(), i32(5)))


def poisoned(dtype: str, n: int) -> np.ndarray:
    """An output buffer full of NaN (floats) or a junk pattern (ints / bools)."""
    nd = NUMPY_DTYPES[dtype]
    if dtype in ("f32", "f64", "f16", "bf16"):
        return np.full(n, np.nan, nd)
    if dtype == "i1":
        return RNG(99).integers(0, 2, n).astype(nd)
    return np.full(n, 0x5A, nd)


# ---------------------------------------------------------------- kernel builders


def elementwise_kernel(name: str, in_dtypes: list[str], out_dtype: str, n: int, fn,
                       block: int = 128, grid_stride: bool = False) -> Kernel:
    """out[i] = fn(x0[i], x1[i], ...); one element per thread (If) or a grid-stride For."""
    params = [Param(f"x{j}", d, n) for j, d in enumerate(in_dtypes)]
    out = Param("out", out_dtype, n, is_output=True)
    idx = v32("i")
    store = Store(out, idx, fn(*[Load(p, idx) for p in params]))
    if grid_stride:
        grid = 3
        body = [For("i", add(mul(BlockIdx(), BlockDim()), ThreadIdx()), i32(n),
                    mul(BlockDim(), GridDim()), [store])]
    else:
        grid = (n + block - 1) // block
        body = [GLOBAL_ID, If(lt(idx, i32(n)), [store])]
    return Kernel(name, [*params, out], [], grid, block, body)


def warp_sum(value: kir.Expr, how: str, prefix: str) -> tuple[list[kir.Stmt], Ref]:
    """Statements summing `value` over the warp; every lane gets the sum."""
    if how == "reduce":
        return [WarpReduce(f"{prefix}_sum", value, "add")], vf(f"{prefix}_sum")
    stmts: list[kir.Stmt] = [Let(f"{prefix}_v32", value)]
    cur = vf(f"{prefix}_v32")
    for off in (16, 8, 4, 2, 1):
        mode = "xor" if how == "xor" else "down"
        stmts += [WarpShuffle(f"{prefix}_t{off}", cur, i32(off), mode),
                  Let(f"{prefix}_v{off}", add(cur, vf(f"{prefix}_t{off}")))]
        cur = vf(f"{prefix}_v{off}")
    if how == "down":  # lane 0 holds the sum; broadcast it
        stmts.append(WarpShuffle(f"{prefix}_sum", cur, i32(0), "idx"))
        return stmts, vf(f"{prefix}_sum")
    return stmts, cur


def warp_softmax_kernel(rows: int, length: int, how: str, block: int = 128) -> Kernel:
    """One warp per row: max (WarpReduce), exp and sum (`how`), divide; partial last block."""
    x = Param("x", "f32", rows * length)
    out = Param("out", "f32", rows * length, is_output=True)
    per_block = block // 32
    row, lane = v32("row"), v32("lane")
    limit = Select(lt(row, i32(rows)), i32(length), i32(0))
    base = mul(row, i32(length))
    elem = Load(x, add(base, v32("j")))
    body: list[kir.Stmt] = [
        LANE, WARP,
        Let("row", add(mul(BlockIdx(), i32(per_block)), v32("warp"))),
        Let("n", limit),  # rows past the end loop zero times (no collective is skipped)
        Local("m", "f32", f32(-np.inf)),
        For("j", lane, v32("n"), i32(32), [Assign("m", Binary("max", vf("m"), elem))]),
        WarpReduce("mx", vf("m"), "max"),
        Local("s", "f32", f32(0.0)),
        For("j", lane, v32("n"), i32(32),
            [Assign("s", add(vf("s"), Unary("exp", Binary("sub", elem, vf("mx")))))]),
    ]
    stmts, total = warp_sum(vf("s"), how, "sum")
    body += stmts
    body.append(For("j", lane, v32("n"), i32(32), [
        Store(out, add(base, v32("j")),
              Binary("div", Unary("exp", Binary("sub", elem, vf("mx"))), total))]))
    return Kernel(f"softmax_warp_{how}", [x, out], [], (rows + per_block - 1) // per_block,
                  block, body)


def block_reduce(value: kir.Expr, op: str, prefix: str, block: int, part: Shared,
                 total: Shared) -> tuple[list[kir.Stmt], Ref]:
    """warp partials -> shared -> (every warp) reduce -> thread 0 -> shared -> all threads."""
    nw = block // 32
    identity = {"add": 0.0, "max": -np.inf}[op]
    lane, warp = v32("lane"), v32("warp")
    in_range = lt(lane, i32(nw))
    stmts = [
        WarpReduce(f"{prefix}_w", value, op),
        If(eq(lane, i32(0)), [Store(part, warp, vf(f"{prefix}_w"))]),
        Barrier(),
        # Lanes past the warp count read element 0 (in bounds) and use the identity instead.
        Let(f"{prefix}_p", Select(in_range, Load(part, Select(in_range, lane, i32(0))),
                                  f32(identity))),
        WarpReduce(f"{prefix}_b", vf(f"{prefix}_p"), op),
        If(eq(ThreadIdx(), i32(0)), [Store(total, i32(0), vf(f"{prefix}_b"))]),
        Barrier(),
        Let(f"{prefix}_all", Load(total, i32(0))),
    ]
    return stmts, vf(f"{prefix}_all")


def block_softmax_kernel(rows: int, length: int, block: int = 256) -> Kernel:
    """One block per row: block max and block sum through shared memory and barriers."""
    x = Param("x", "f32", rows * length)
    out = Param("out", "f32", rows * length, is_output=True)
    part, total = Shared("part", "f32", block // 32), Shared("total", "f32", 1)
    base = mul(BlockIdx(), i32(length))
    elem = Load(x, add(base, v32("j")))
    body: list[kir.Stmt] = [
        LANE, WARP,
        Local("m", "f32", f32(-np.inf)),
        For("j", ThreadIdx(), i32(length), BlockDim(), [Assign("m", Binary("max", vf("m"), elem))]),
    ]
    stmts, mx = block_reduce(vf("m"), "max", "mx", block, part, total)
    body += stmts
    body += [Local("s", "f32", f32(0.0)),
             For("j", ThreadIdx(), i32(length), BlockDim(),
                 [Assign("s", add(vf("s"), Unary("exp", Binary("sub", elem, mx))))])]
    stmts, sm = block_reduce(vf("s"), "add", "sm", block, part, total)
    body += stmts
    body.append(For("j", ThreadIdx(), i32(length), BlockDim(), [
        Store(out, add(base, v32("j")), Binary("div", Unary("exp", Binary("sub", elem, mx)),
                                               sm))]))
    return Kernel("softmax_block", [x, out], [part, total], rows, block, body)


def tiled_sum_kernel(rows: int, length: int, block: int = 256) -> Kernel:
    """A For with barriers inside: tiles of the row go through shared memory and each thread
    reads the mirrored thread's element; per-thread partials and the block sum come out."""
    x = Param("x", "f32", rows * length)
    partials = Param("partials", "f32", rows * block, is_output=True)
    sums = Param("sums", "f32", rows, is_output=True)
    tile = Shared("tile", "f32", block)
    part, total = Shared("part", "f32", block // 32), Shared("total", "f32", 1)
    mirror = Binary("sub", i32(block - 1), ThreadIdx())
    body: list[kir.Stmt] = [
        LANE, WARP,
        Local("acc", "f32", f32(0.0)),
        For("c", i32(0), i32(length), i32(block), [
            Let("k", add(v32("c"), ThreadIdx())),
            If(lt(v32("k"), i32(length)),
               [Store(tile, ThreadIdx(), Load(x, add(mul(BlockIdx(), i32(length)), v32("k"))))],
               [Store(tile, ThreadIdx(), f32(0.0))]),
            Barrier(),
            Assign("acc", add(vf("acc"), Load(tile, mirror))),
            Barrier(),
        ]),
        Store(partials, add(mul(BlockIdx(), i32(block)), ThreadIdx()), vf("acc")),
    ]
    stmts, total_sum = block_reduce(vf("acc"), "add", "t", block, part, total)
    body += stmts
    body.append(If(eq(ThreadIdx(), i32(0)), [Store(sums, BlockIdx(), total_sum)]))
    return Kernel("tiled_sum", [x, partials, sums], [tile, part, total], rows, block, body)


def softmax_ref(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# ---------------------------------------------------------------- elementwise


def run_elementwise(in_arrays: list[np.ndarray], in_dtypes: list[str], out_dtype: str, fn,
                    **kw) -> np.ndarray:
    n = in_arrays[0].size
    k = elementwise_kernel("ew", in_dtypes, out_dtype, n, fn, **kw)
    out = poisoned(out_dtype, n)
    compile_host(k)(*in_arrays, out)
    return out


@pytest.mark.parametrize("grid_stride", [False, True])
def test_elementwise_fma_like(grid_stride: bool) -> None:
    rng = RNG(1)
    a, b = (rng.standard_normal(1000).astype(np.float32) for _ in range(2))
    out = run_elementwise([a, b], ["f32", "f32"], "f32",
                          lambda x, y: add(mul(x, y), Unary("tanh", x)), grid_stride=grid_stride)
    np.testing.assert_allclose(out, a * b + np.tanh(a), rtol=1e-5, atol=1e-6)


UNARY_CASES = {
    "neg": (lambda r: r.standard_normal(1000), np.negative),
    "abs": (lambda r: r.standard_normal(1000), np.abs),
    "exp": (lambda r: r.uniform(-10, 10, 1000), np.exp),
    "exp2": (lambda r: r.uniform(-10, 10, 1000), np.exp2),
    "log": (lambda r: r.uniform(0.01, 100, 1000), np.log),
    "log1p": (lambda r: r.uniform(-0.9, 10, 1000), np.log1p),
    "expm1": (lambda r: r.uniform(-3, 3, 1000), np.expm1),
    "sqrt": (lambda r: r.uniform(0, 100, 1000), np.sqrt),
    "rsqrt": (lambda r: r.uniform(0.01, 100, 1000), lambda x: 1 / np.sqrt(x)),
    "tanh": (lambda r: r.standard_normal(1000) * 3, np.tanh),
    "sin": (lambda r: r.uniform(-6, 6, 1000), np.sin),
    "cos": (lambda r: r.uniform(-6, 6, 1000), np.cos),
    "tan": (lambda r: r.uniform(-1.2, 1.2, 1000), np.tan),
    "erf": (lambda r: r.standard_normal(1000) * 2, np.vectorize(math.erf)),
    "cbrt": (lambda r: r.standard_normal(1000) * 10, np.cbrt),
    "floor": (lambda r: r.standard_normal(1000) * 10, np.floor),
    "ceil": (lambda r: r.standard_normal(1000) * 10, np.ceil),
    "round_half_even": (lambda r: np.concatenate([r.integers(-20, 20, 500) / 2,
                                                  r.standard_normal(500) * 10]), np.round),
    "round_half_away": (lambda r: np.concatenate([r.integers(-20, 20, 500) / 2,
                                                  r.standard_normal(500) * 10]),
                        lambda x: np.sign(x) * np.floor(np.abs(x) + 0.5)),
    "sign": (lambda r: np.concatenate([r.standard_normal(990), np.zeros(5), [np.nan] * 5]),
             np.sign),
    "logistic": (lambda r: r.standard_normal(1000) * 5, lambda x: 1 / (1 + np.exp(-x))),
}


@pytest.mark.parametrize("dtype", ["f32", "f64"])
@pytest.mark.parametrize("op", sorted(UNARY_CASES))
def test_unary_float(op: str, dtype: str) -> None:
    make, ref = UNARY_CASES[op]
    x = make(RNG(hash(op) % 1000)).astype(NUMPY_DTYPES[dtype])
    out = run_elementwise([x], [dtype], dtype, lambda a: Unary(op, a))
    expected = ref(x.astype(np.float64))
    rtol = 1e-5 if dtype == "f32" else 1e-12
    np.testing.assert_allclose(out, expected, rtol=rtol, atol=rtol / 10)


def test_is_finite_and_not() -> None:
    x = np.concatenate([RNG(2).standard_normal(990), [np.inf, -np.inf, np.nan] * 3, [0.0]])
    x = x.astype(np.float32)
    out = run_elementwise([x], ["f32"], "i1", lambda a: Unary("is_finite", a))
    np.testing.assert_array_equal(out, np.isfinite(x))
    out = run_elementwise([x], ["f32"], "i1", lambda a: Unary("not", Unary("is_finite", a)))
    np.testing.assert_array_equal(out, ~np.isfinite(x))


@pytest.mark.parametrize("dtype", ["i32", "i8", "i64"])
def test_unary_int(dtype: str) -> None:
    info = np.iinfo(NUMPY_DTYPES[dtype])
    x = RNG(3).integers(max(info.min + 1, -10**6), min(info.max, 10**6), 1000,
                        dtype=NUMPY_DTYPES[dtype])
    for op, ref in (("neg", np.negative), ("abs", np.abs), ("sign", np.sign),
                    ("not", np.invert)):
        out = run_elementwise([x], [dtype], dtype, lambda a, op=op: Unary(op, a))
        np.testing.assert_array_equal(out, ref(x), err_msg=op)


FLOAT_BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
    "rem": np.fmod, "min": np.minimum, "max": np.maximum, "pow": np.power, "atan2": np.arctan2,
}


@pytest.mark.parametrize("dtype", ["f32", "f64"])
@pytest.mark.parametrize("op", sorted(FLOAT_BINARY))
def test_binary_float(op: str, dtype: str) -> None:
    rng = RNG(4)
    nd = NUMPY_DTYPES[dtype]
    a = rng.standard_normal(1000).astype(nd) * 3
    b = rng.standard_normal(1000).astype(nd) * 3
    if op == "pow":
        a = np.abs(a) + nd.type(0.1)
    if op in ("min", "max"):  # NaN on either side (and both) propagates like numpy
        a[::7] = np.nan
        b[::5] = np.nan
    out = run_elementwise([a, b], [dtype, dtype], dtype, lambda x, y: Binary(op, x, y))
    rtol = 1e-5 if dtype == "f32" else 1e-12
    np.testing.assert_allclose(out, FLOAT_BINARY[op](a, b), rtol=rtol, atol=rtol / 10)
    if op in ("min", "max"):
        assert np.isnan(out[::5]).all() and np.isnan(out[::7]).all()


def _xla_divrem(a: np.ndarray, b: np.ndarray, unsigned: bool) -> tuple[np.ndarray, np.ndarray]:
    """Truncating division; x/0 = -1 (all ones), x%0 = x; MIN/-1 wraps to MIN."""
    a64, b64 = a.astype(np.int64), b.astype(np.int64)
    safe = np.where(b64 == 0, 1, b64)
    q = np.abs(a64) // np.abs(safe) * np.sign(a64) * np.sign(safe)
    q = np.where(b64 == 0, -1, q)
    r = np.where(b64 == 0, a64, a64 - q * safe)
    return q.astype(a.dtype) if not unsigned else q.astype(np.uint64).astype(a.dtype), \
        r.astype(a.dtype)


@pytest.mark.parametrize("dtype", ["i32", "u32", "i8", "u8"])
def test_binary_int(dtype: str) -> None:
    nd = NUMPY_DTYPES[dtype]
    info = np.iinfo(nd)
    rng = RNG(5)
    a = rng.integers(info.min, info.max, 1000, dtype=nd, endpoint=True)
    b = rng.integers(info.min, info.max, 1000, dtype=nd, endpoint=True)
    b[::9] = 0
    if info.min < 0:
        a[::11], b[::11] = info.min, -1
    small = rng.integers(-50, 50, 1000).astype(nd)  # keep mul in range of numpy's wrap too
    q, r = _xla_divrem(a, b, info.min == 0)
    bits = nd.itemsize * 8
    shift = rng.integers(0, bits + 8, 1000).astype(nd)  # some amounts past the width
    ua = a.astype(np.uint64) & np.uint64((1 << bits) - 1)
    s = np.minimum(shift.astype(np.uint64), 63)
    shl = np.where(shift >= bits, 0, (ua << s) & np.uint64((1 << bits) - 1))
    shr_l = np.where(shift >= bits, 0, ua >> s)
    signed = a.view(np.dtype(f"i{nd.itemsize}"))  # XLA: arithmetic shift acts on the bits
    shr_a = signed.astype(np.int64) >> np.minimum(shift.astype(np.int64), bits - 1)
    cases = {
        "add": (a, b, a + b), "sub": (a, b, a - b), "mul": (small, small, small * small),
        "div": (a, b, q), "rem": (a, b, r), "min": (a, b, np.minimum(a, b)),
        "max": (a, b, np.maximum(a, b)), "and": (a, b, a & b), "or": (a, b, a | b),
        "xor": (a, b, a ^ b), "shl": (a, shift, shl.astype(np.uint64).astype(nd)),
        "shr_logical": (a, shift, shr_l.astype(nd)), "shr_arith": (a, shift, shr_a.astype(nd)),
    }
    with np.errstate(over="ignore"):
        for op, (x, y, expected) in cases.items():
            out = run_elementwise([x, y], [dtype, dtype], dtype, lambda p, q_, op=op:
                                  Binary(op, p, q_))
            np.testing.assert_array_equal(out, expected.astype(nd), err_msg=op)


@pytest.mark.parametrize("dtype", ["f32", "i32", "u32", "f64"])
def test_compare(dtype: str) -> None:
    rng = RNG(6)
    nd = NUMPY_DTYPES[dtype]
    if dtype.startswith("f"):
        a = rng.integers(-3, 3, 1000).astype(nd)
        b = rng.integers(-3, 3, 1000).astype(nd)
        a[::7], b[::5] = np.nan, np.nan
    else:
        info = np.iinfo(nd)
        a = rng.integers(info.min, info.max, 1000, dtype=nd)
        b = np.where(rng.random(1000) < 0.3, a, rng.integers(info.min, info.max, 1000, dtype=nd))
    refs = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
            "gt": np.greater, "ge": np.greater_equal}
    for op, ref in refs.items():
        out = run_elementwise([a, b], [dtype, dtype], "i1", lambda x, y, op=op: Compare(op, x, y))
        np.testing.assert_array_equal(out, ref(a, b), err_msg=op)


def test_select_and_bool_buffers() -> None:
    rng = RNG(7)
    c = rng.random(1000) < 0.5
    a, b = rng.standard_normal((2, 1000)).astype(np.float32)
    out = run_elementwise([c, a, b], ["i1", "f32", "f32"], "f32", lambda p, x, y: Select(p, x, y))
    np.testing.assert_array_equal(out, np.where(c, a, b))
    out = run_elementwise([c, c[::-1].copy()], ["i1", "i1"], "i1",
                          lambda p, q: Binary("xor", p, q))
    np.testing.assert_array_equal(out, c ^ c[::-1])


CONVERT_CASES = [
    # (src, dst, make input, reference)
    ("f32", "i32", lambda r: r.uniform(-1e6, 1e6, 1000), lambda x: np.trunc(x)),
    ("f32", "i64", lambda r: r.uniform(-1e6, 1e6, 1000), lambda x: np.trunc(x)),
    ("f32", "u8", lambda r: r.uniform(0, 255, 1000), lambda x: np.trunc(x)),
    ("f32", "i1", lambda r: np.concatenate([r.standard_normal(990), [0.0] * 5, [np.nan] * 5]),
     lambda x: x != 0),
    ("f32", "f64", lambda r: r.standard_normal(1000), lambda x: x.astype(np.float64)),
    ("f64", "f32", lambda r: r.standard_normal(1000), lambda x: x.astype(np.float32)),
    ("i32", "f32", lambda r: r.integers(-2**31, 2**31 - 1, 1000), lambda x: x.astype(np.float32)),
    ("u32", "f32", lambda r: r.integers(0, 2**32 - 1, 1000), lambda x: x.astype(np.float32)),
    ("i64", "i32", lambda r: r.integers(-2**40, 2**40, 1000), lambda x: x.astype(np.int32)),
    ("i8", "i32", lambda r: r.integers(-128, 127, 1000), lambda x: x.astype(np.int32)),
    ("u8", "i32", lambda r: r.integers(0, 255, 1000), lambda x: x.astype(np.int32)),
    ("i32", "u8", lambda r: r.integers(-1000, 1000, 1000), lambda x: x.astype(np.uint8)),
    ("i1", "f32", lambda r: r.random(1000) < 0.5, lambda x: x.astype(np.float32)),
    ("i32", "i1", lambda r: r.integers(-2, 2, 1000), lambda x: x != 0),
]


@pytest.mark.parametrize("src,dst,make,ref", CONVERT_CASES,
                         ids=[f"{s}->{d}" for s, d, *_ in CONVERT_CASES])
def test_convert(src: str, dst: str, make, ref) -> None:
    x = np.asarray(make(RNG(8))).astype(NUMPY_DTYPES[src])
    out = run_elementwise([x], [src], dst, lambda a: Convert(a, dst))
    np.testing.assert_array_equal(out, np.asarray(ref(x)).astype(NUMPY_DTYPES[dst]))


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_half_edges(dtype: str) -> None:
    """Loads widen to f32 exactly; stores round to nearest even (numpy / ml_dtypes casts)."""
    nd = NUMPY_DTYPES[dtype]
    rng = RNG(9)
    x = (rng.standard_normal(1000) * 4).astype(nd)
    y = rng.standard_normal(1000).astype(np.float32)
    x[::50] = np.nan
    out = run_elementwise([x, y], [dtype, "f32"], dtype, lambda a, b: add(mul(a, b), f32(0.5)))
    expected = (x.astype(np.float32) * y + np.float32(0.5)).astype(nd)
    np.testing.assert_array_equal(out.astype(np.float32), expected.astype(np.float32))
    wide = run_elementwise([x], [dtype], "f32", lambda a: a)
    np.testing.assert_array_equal(wide, x.astype(np.float32))


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_half_rounding_ties(dtype: str) -> None:
    """f32 values exactly halfway between two f16 / bf16 values round to the even one."""
    rng = RNG(14)
    if dtype == "bf16":
        high = rng.integers(0x0080, 0x7F00, 1000).astype(np.uint32) << 16
        low = rng.choice(np.array([0x8000, 0x7FFF, 0x8001], np.uint32), 1000)
        x = (high | low).view(np.float32)
    else:
        h = rng.uniform(-1000, 1000, 1000).astype(np.float16)
        x = (h.astype(np.float32) + np.spacing(h).astype(np.float32) / 2).astype(np.float32)
    x[rng.random(1000) < 0.5] *= -1
    out = run_elementwise([x], ["f32"], dtype, lambda a: a)
    np.testing.assert_array_equal(out.astype(np.float32),
                                  x.astype(NUMPY_DTYPES[dtype]).astype(np.float32))


# ---------------------------------------------------------------- warp and block reductions


@pytest.mark.parametrize("how", ["reduce", "xor", "down"])
@pytest.mark.parametrize("length", [32, 33, 100, 300])
def test_warp_softmax(length: int, how: str) -> None:
    rows = 10  # 4 rows per block: the last block has 2 rows past the end
    x = (RNG(length).standard_normal((rows, length)) * 3).astype(np.float32)
    out = poisoned("f32", rows * length)
    compile_host(warp_softmax_kernel(rows, length, how))(x.ravel(), out)
    np.testing.assert_allclose(out.reshape(rows, length), softmax_ref(x), rtol=1e-4, atol=1e-7)


def test_shuffle_modes_lane_by_lane() -> None:
    """xor / down (own value past lane 31) / idx (lane & 31) with a thread-dependent lane."""
    n, block = 256, 128
    x = RNG(10).standard_normal(n).astype(np.float32)
    outs = {m: Param(f"o_{m}", "f32", n, is_output=True) for m in ("xor", "down", "idx")}
    xp = Param("x", "f32", n)
    lane_arg = Binary("rem", ThreadIdx(), i32(7))  # varies per thread
    idx_arg = add(ThreadIdx(), i32(45))  # wraps past 31
    body: list[kir.Stmt] = [GLOBAL_ID, Let("v", Load(xp, v32("i")))]
    for mode, arg in (("xor", lane_arg), ("down", lane_arg), ("idx", idx_arg)):
        body += [WarpShuffle(f"s_{mode}", vf("v"), arg, mode), Store(outs[mode], v32("i"),
                                                                     vf(f"s_{mode}"))]
    k = Kernel("shuffles", [xp, *outs.values()], [], n // block, block, body)
    results = {m: poisoned("f32", n) for m in outs}
    compile_host(k)(x, *results.values())
    t = np.arange(n)
    lane, base, arg = t % 32, t - t % 32, (t % block) % 7
    src = {"xor": lane ^ arg, "down": lane + arg, "idx": ((t % block) + 45) % 32}
    for mode, s in src.items():
        s = np.where(s <= 31, s, lane)
        np.testing.assert_array_equal(results[mode], x[base + s], err_msg=mode)


@pytest.mark.parametrize("dtype,op", [("f64", "add"), ("i32", "max"), ("i64", "min"),
                                      ("u8", "add"), ("f32", "mul")])
def test_warp_reduce_dtypes(dtype: str, op: str) -> None:
    n = 128
    nd = NUMPY_DTYPES[dtype]
    x = (RNG(11).integers(1, 5, n) if dtype[0] in "iu" else RNG(11).uniform(0.8, 1.2, n)).astype(nd)
    xp, o = Param("x", dtype, n), Param("o", dtype, n, is_output=True)
    k = Kernel("wr", [xp, o], [], 1, n, [GLOBAL_ID, WarpReduce("r", Load(xp, v32("i")), op),
                                        Store(o, v32("i"), Ref("r", dtype))])
    out = poisoned(dtype, n)
    compile_host(k)(x, out)
    ref = {"add": np.sum, "max": np.max, "min": np.min, "mul": np.prod}[op]
    expected = np.repeat([ref(w, dtype=nd) if op in ("add", "mul") else ref(w)
                          for w in x.reshape(-1, 32)], 32).astype(nd)
    np.testing.assert_allclose(out, expected, rtol=1e-5)


@pytest.mark.parametrize("length", [4096, 32000])
def test_block_softmax(length: int) -> None:
    rows = 3
    x = (RNG(length).standard_normal((rows, length)) * 4).astype(np.float32)
    out = poisoned("f32", rows * length)
    compile_host(block_softmax_kernel(rows, length))(x.ravel(), out)
    np.testing.assert_allclose(out.reshape(rows, length), softmax_ref(x), rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("length", [4096, 32000])
def test_tiled_sum_for_with_barriers(length: int) -> None:
    rows, block = 3, 256
    x = RNG(12).standard_normal((rows, length)).astype(np.float32)
    partials, sums = poisoned("f32", rows * block), poisoned("f32", rows)
    compile_host(tiled_sum_kernel(rows, length, block))(x.ravel(), partials, sums)
    padded = np.zeros((rows, -(-length // block) * block), np.float64)
    padded[:, :length] = x
    tiles = padded.reshape(rows, -1, block)
    np.testing.assert_allclose(partials.reshape(rows, block), tiles.sum(axis=1)[:, ::-1],
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(sums, x.astype(np.float64).sum(axis=1), rtol=1e-4, atol=1e-3)


def test_many_blocks_on_worker_threads() -> None:
    rows, length = 64, 512
    x = (RNG(13).standard_normal((rows, length)) * 2).astype(np.float32)
    hk = compile_host(block_softmax_kernel(rows, length, block=128), threads=4)
    assert hk.threads == 4
    out4, out1 = poisoned("f32", rows * length), poisoned("f32", rows * length)
    hk(x.ravel(), out4)
    hk(x.ravel(), out1, threads=1)
    np.testing.assert_array_equal(out4, out1)
    np.testing.assert_allclose(out4.reshape(rows, length), softmax_ref(x), rtol=1e-4, atol=1e-9)


# ---------------------------------------------------------------- errors


def _kernel(body: list[kir.Stmt], block: int = 64, params=None, shared=()) -> Kernel:
    params = params or [Param("x", "f32", 64), Param("o", "f32", 64, is_output=True)]
    return Kernel("bad", params, list(shared), 1, block, body)


BAD_KERNELS = {
    "barrier under tid If": (_kernel([If(lt(ThreadIdx(), i32(3)), [Barrier()])]),
                             "thread-dependent control flow"),
    "reduce in tid For": (_kernel([For("j", ThreadIdx(), i32(64), i32(64),
                                       [WarpReduce("r", f32(1.0), "add")])]),
                          "bounds depend on threadIdx"),
    "barrier under If on a Local made varying later": (_kernel([
        Local("flag", "i1", Const(False, "i1")),
        For("j", i32(0), i32(2), i32(1), [
            If(Ref("flag", "i1"), [Barrier()]),
            Assign("flag", lt(ThreadIdx(), i32(5)))])]), "thread-dependent control flow"),
    "barrier under If on a Local set under a tid If": (_kernel([
        Local("flag", "i1", Const(False, "i1")),
        If(lt(ThreadIdx(), i32(5)), [Assign("flag", Const(True, "i1"))]),
        If(Ref("flag", "i1"), [Barrier()])]), "thread-dependent control flow"),
    "shuffle under If on a Let from a Load at tid": (_kernel([
        Let("v", Load("x", ThreadIdx(), "f32")),
        If(Compare("gt", vf("v"), f32(0.0)), [WarpShuffle("s", vf("v"), i32(1), "xor")])]),
        "thread-dependent control flow"),
    "undefined ref": (_kernel([Store("o", i32(0), vf("nope"))]), "undefined variable 'nope'"),
    "dtype mismatch": (_kernel([Let("a", add(f32(1.0), i32(1)))]), "operands f32 vs i32"),
    "let redefined": (_kernel([Let("a", f32(1.0)), Let("a", f32(2.0))]), "already defined"),
    "store to input": (_kernel([Store("x", i32(0), f32(1.0))]), "not marked is_output"),
    "unknown buffer": (_kernel([Let("a", Load("zz", i32(0), "f32"))]), "unknown buffer 'zz'"),
    "float index": (_kernel([Store("o", f32(0.0), f32(1.0))]), "need i32/i64"),
    "assign to let": (_kernel([Let("a", f32(1.0)), Assign("a", f32(2.0))]), "only Locals"),
    "block size": (_kernel([], block=48), "multiple of 32"),
    "int pow": (_kernel([Let("a", Binary("pow", i32(2), i32(3)))]), "does not take i32"),
}


@pytest.mark.parametrize("case", sorted(BAD_KERNELS))
def test_validation_errors(case: str) -> None:
    kernel, message = BAD_KERNELS[case]
    with pytest.raises(CodegenError, match=message) as info:
        compile_host(kernel)
    assert "'bad'" in str(info.value)


def test_uniform_collectives_are_valid() -> None:
    """A Local assigned only uniform values stays uniform; barriers under it are fine."""
    k = _kernel([Local("flag", "i1", Const(True, "i1")),
                 For("j", i32(0), i32(2), i32(1), [If(Ref("flag", "i1"), [Barrier()]),
                                                   Assign("flag", lt(BlockIdx(), i32(5)))])])
    k.validate()


def test_validation_walks_again_only_for_a_stale_uniform_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Local made varying before any read settles in one walk; one read as uniform earlier
    in the walk (a loop's back edge) takes a second, which finds the barrier it guards. A
    Let computed from that stale read carries it too."""
    walks: list[str] = []
    real_body = kir.KernelChecker._body

    def counting_body(self, body, scopes, divergent, path, frame=None):
        if path == "body":
            walks.append(path)
        return real_body(self, body, scopes, divergent, path, frame)

    monkeypatch.setattr(kir.KernelChecker, "_body", counting_body)
    _kernel([Local("acc", "f32", f32(0.0)),
             For("j", i32(0), i32(2), i32(1), [
                 Assign("acc", add(vf("acc"), Load("x", ThreadIdx(), "f32")))]),
             Store("o", ThreadIdx(), vf("acc"))]).validate()
    # acc was read as uniform before it turned varying, but beside the thread index: the
    # read decided nothing.
    assert len(walks) == 1
    walks.clear()
    _kernel([Local("acc", "f32", f32(0.0)),
             For("j", i32(0), i32(2), i32(1), [
                 Let("old", vf("acc")),
                 Assign("acc", add(vf("old"), Load("x", ThreadIdx(), "f32")))]),
             Store("o", ThreadIdx(), vf("acc"))]).validate()
    assert len(walks) == 2          # old was uniform from the stale read
    walks.clear()
    _kernel([Local("acc", "f32", f32(0.0)),
             Assign("acc", Load("x", ThreadIdx(), "f32")),
             Store("o", ThreadIdx(), vf("acc"))]).validate()
    assert len(walks) == 1
    walks.clear()
    stale_let = _kernel([
        Local("flag", "i1", Const(False, "i1")),
        For("j", i32(0), i32(2), i32(1), [
            Let("guard", Ref("flag", "i1")),
            If(Ref("guard", "i1"), [Barrier()]),
            Assign("flag", lt(ThreadIdx(), i32(5)))])])
    with pytest.raises(CodegenError, match="thread-dependent control flow"):
        stale_let.validate()
    assert len(walks) == 2


def _random_divergence_kernel(rng: np.random.Generator) -> Kernel:
    """Locals and Lets of thread-dependent or uniform predicates, assigned in loops and
    branches, read by branches around collectives: whether each collective is in divergent
    code depends on the fixed point of the varying set."""
    names = iter(range(10 ** 6))

    def pred(visible: list[str]) -> kir.Expr:
        pick = rng.random()
        if pick < 0.15:
            return lt(ThreadIdx(), i32(int(rng.integers(1, 64))))
        if pick < 0.3 or not visible:
            return lt(BlockIdx(), i32(int(rng.integers(1, 4)))) if rng.random() < 0.5 else \
                Const(bool(rng.random() < 0.5), "i1")
        if pick < 0.45:
            return Binary(str(rng.choice(["and", "or"])), pred(visible), pred(visible))
        return Ref(str(rng.choice(visible)), "i1")

    def body(depth: int, visible: list[str], locals_: list[str]) -> list:
        visible, stmts = list(visible), []
        for _ in range(int(rng.integers(1, 5))):
            kind = rng.random()
            if kind < 0.2:
                name = f"l{next(names)}"
                stmts.append(Local(name, "i1", pred(visible)))
                visible.append(name)
                locals_.append(name)
            elif kind < 0.35:
                name = f"v{next(names)}"
                stmts.append(Let(name, pred(visible)))
                visible.append(name)
            elif kind < 0.55 and locals_:
                target = str(rng.choice([n for n in locals_ if n in visible] or [None]))
                if target != "None":
                    stmts.append(Assign(target, pred(visible)))
            elif kind < 0.65:
                stmts.append(Barrier() if rng.random() < 0.5 else
                             WarpReduce(f"r{next(names)}", f32(1.0), "add"))
            elif kind < 0.82 and depth:
                stmts.append(For(f"j{next(names)}", i32(0), i32(2), i32(1),
                                 body(depth - 1, visible, locals_)))
            elif depth:
                stmts.append(If(pred(visible), body(depth - 1, visible, locals_),
                                body(depth - 1, visible, locals_)))
        return stmts

    return _kernel(body(3, [], []))


def test_walks_repeat_only_for_reads_that_decided_something(monkeypatch) -> None:
    """Repeating the walk only for a Local read as uniform by an expression that came out
    uniform answers as repeating for every such read does: the same kernels pass, the
    same errors on the others."""
    rng = np.random.default_rng()
    answers = set()
    for _ in range(300):
        k = _random_divergence_kernel(rng)
        outcome = []
        for relevant_only in (True, False):
            monkeypatch.setattr(kir.check, "RELEVANT_READS_ONLY", relevant_only)
            try:
                kir.KernelChecker(k).run()
                outcome.append("valid")
            except CodegenError as exc:
                outcome.append(str(exc))
        assert outcome[0] == outcome[1], format_kernel(k)
        answers.add(outcome[0] == "valid")
    assert answers == {True, False}


def test_param_mismatch_errors() -> None:
    k = elementwise_kernel("ew", ["f32"], "f32", 100, lambda a: a)
    hk = compile_host(k)
    x, out = np.ones(100, np.float32), np.zeros(100, np.float32)
    with pytest.raises(CodegenError, match="param 'x0' wants f32"):
        hk(x.astype(np.float64), out)
    with pytest.raises(CodegenError, match="param 'out' wants 100 elements"):
        hk(x, np.zeros(99, np.float32))
    with pytest.raises(CodegenError, match="2 params"):
        hk(x)
    with pytest.raises(CodegenError, match="param 'out' must be a C-contiguous"):
        hk(x, np.zeros(200, np.float32)[::2])


def test_out_of_bounds_is_caught() -> None:
    xp, o = Param("x", "f32", 64), Param("o", "f32", 64, is_output=True)
    k = Kernel("oob", [xp, o], [], 1, 64, [Store(o, ThreadIdx(),
                                                 Load(xp, add(ThreadIdx(), i32(3))))])
    with pytest.raises(CodegenError, match=r"out-of-bounds access x\[64\].*thread 61"):
        compile_host(k)(np.ones(64, np.float32), np.zeros(64, np.float32))


def test_printer() -> None:
    text = format_kernel(tiled_sum_kernel(2, 1000))
    for needle in ("grid=2 block=256", "__shared__ float tile[256];", "__syncthreads();",
                   "warp_reduce_add(", "float* partials /*[512] out*/", "for (int c = 0;"):
        assert needle in text, needle
