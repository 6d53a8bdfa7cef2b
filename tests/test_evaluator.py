"""The numpy HLO evaluator against jax (XLA CPU), hand-written HLO and stored fixtures.

Every jax case is evaluated twice: from the HLO jax lowers to (``pre``) and from the
CPU-optimised HLO XLA compiles it to (``opt``), both against ``jax.jit(f)(*args)``.
"""
from __future__ import annotations

import functools
import zlib

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from stitch.hlo.errors import HloEvaluationError, UnsupportedOpcodeError  # noqa: E402
from stitch.hlo.evaluator import evaluate  # noqa: E402
from stitch.hlo.parser import parse_hlo  # noqa: E402
BF16 = ml_dtypes.bfloat16


# --- comparison ----------------------------------------------------------------------------
def assert_close(out: np.ndarray, ref: np.ndarray, tol: float, label: str = "") -> None:
    out, ref = np.asarray(out), np.asarray(ref)
    assert out.shape == ref.shape, f"{label}: shape {out.shape} != {ref.shape}"
    assert out.dtype == ref.dtype, f"{label}: dtype {out.dtype} != {ref.dtype}"
    if out.dtype == np.bool_ or np.issubdtype(out.dtype, np.integer):
        bad = np.flatnonzero(out != ref)
        assert bad.size == 0, f"{label}: {bad.size} elements differ, e.g. {out.flat[bad[0]]} != {ref.flat[bad[0]]}"
        return
    if np.iscomplexobj(ref):
        o, r = out.astype(np.complex128), ref.astype(np.complex128)
    else:
        o, r = out.astype(np.float64), ref.astype(np.float64)
        if out.dtype != np.float32 and out.dtype != np.float64:  # bf16 / f16: a few ulps
            tol = max(tol, 1e-2)
    nan_o, nan_r = np.isnan(o), np.isnan(r)
    assert np.array_equal(nan_o, nan_r), f"{label}: NaN positions differ"
    inf_r = np.isinf(r)
    assert np.array_equal(o[inf_r], r[inf_r]), f"{label}: infinities differ"
    finite = ~(nan_r | inf_r)
    o, r = o[finite], r[finite]
    scale = np.linalg.norm(r)
    err = np.linalg.norm(o - r)
    assert err <= tol * max(scale, 1e-30) or (scale < 1e-6 and err < 1e-6), \
        f"{label}: relative error {err / max(scale, 1e-30):.3g} > {tol}"


# --- the jax case table ----------------------------------------------------------------------
def normal(rng, shape, dtype=np.float32, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def nonzero_ints(rng, shape, lo=-20, hi=20, dtype=np.int32):
    v = rng.integers(lo, hi, shape)
    return np.where(v == 0, 3, v).astype(dtype)


CASES: dict[str, tuple] = {}


def case(name: str, tol: float = 1e-5):
    """Register ``build(rng) -> (f, args)`` as a jax case."""
    def register(build):
        CASES[name] = (build, tol)
        return build
    return register


@case("float_arith")
def _(rng):
    def f(x, y):
        return (x + y, x - y, x * y, x / y, jnp.maximum(x, y), jnp.minimum(x, y), -x, jnp.abs(x),
                jnp.sign(x), x ** 2, jnp.power(jnp.abs(x) + 0.5, y), jnp.fmod(x, y))
    return f, [normal(rng, (3, 5)), normal(rng, (3, 5))]


@case("transcendental")
def _(rng):
    def f(x, y):
        ax = jnp.abs(x)
        return (jnp.exp(x), jnp.expm1(x), jnp.log(ax + 0.1), jnp.log1p(ax), jnp.tanh(x),
                jax.nn.sigmoid(x * 4), lax.erf(x), jnp.sqrt(ax), lax.rsqrt(ax + 0.1), jnp.cbrt(x),
                jnp.sin(x), jnp.cos(x), jnp.tan(x * 0.5), jnp.arctan2(x, y), jax.nn.gelu(x),
                jax.nn.softplus(x))
    return f, [normal(rng, (4, 6)), normal(rng, (4, 6))]


@case("rounding_and_predicates")
def _(rng):
    halves = np.array([0.5, 1.5, -0.5, -2.5, 2.5, 0.49999997, -1.5, 3.0], np.float32)

    def f(x, y):
        z = x / jnp.where(y > 0.5, 0.0, y)  # some infinities
        return (jnp.floor(x), jnp.ceil(x), jnp.round(x), lax.round(x, lax.RoundingMethod.AWAY_FROM_ZERO),
                jnp.isfinite(z), x < y, x <= y, x > y, x >= y, x == y, x != y, jnp.where(x > y, x, y),
                jnp.clip(x, -0.5, 0.5), lax.clamp(-0.3, x, 0.3))
    x = np.concatenate([normal(rng, (8,), scale=3), halves]).reshape(2, 8)
    return f, [x, normal(rng, (2, 8))]


@case("nan_handling")
def _(rng):
    def f(x, y):
        return jnp.maximum(x, y), jnp.minimum(x, y), jnp.max(x, axis=1), x < y, jnp.isnan(x)
    x = normal(rng, (3, 4))
    x[0, 1] = np.nan
    x[2, 3] = np.nan
    return f, [x, normal(rng, (3, 4))]


@case("int_arith")
def _(rng):
    def f(a, b):
        return (a + b, a - b, a * b, lax.div(a, b), lax.rem(a, b), a // b, a % b, jnp.maximum(a, b),
                jnp.minimum(a, b), -a, jnp.abs(a), jnp.sign(a), a & b, a | b, a ^ b, ~a, a ** 3,
                a.astype(jnp.float32) * 0.5)
    return f, [nonzero_ints(rng, (3, 7)), nonzero_ints(rng, (3, 7))]


@case("int_bits")
def _(rng):
    def f(a, s, u, v):
        return (lax.shift_left(a, s), lax.shift_right_logical(a, s), lax.shift_right_arithmetic(a, s),
                lax.population_count(a), lax.clz(a), u // v, u % v, lax.shift_right_logical(u, v),
                lax.shift_left(u, v), u * v)
    a = nonzero_ints(rng, (12,), -1000, 1000)
    s = rng.integers(0, 40, (12,)).astype(np.int32)
    u = rng.integers(1, 2 ** 32 - 1, (12,), dtype=np.uint64).astype(np.uint32)
    v = rng.integers(1, 40, (12,)).astype(np.uint32)
    return f, [a, s, u, v]


@case("int_division_corner_cases")
def _(rng):
    def f(a, b):
        return lax.div(a, b), lax.rem(a, b)
    a = np.array([7, -7, 5, -2 ** 31, 9, 3, -9, 11], np.int32)
    b = np.array([0, 0, -1, -1, 2, -2, 4, -5], np.int32)
    return f, [a, b]


@case("convert")
def _(rng):
    def f(x, a, p):
        return (x.astype(BF16), x.astype(jnp.float16), (x * 100).astype(jnp.int32),
                (x * 100).astype(jnp.uint8), (x * 1e10).astype(jnp.int32), a.astype(jnp.float32),
                a.astype(jnp.bool_), p.astype(jnp.float32), (a * 1000).astype(jnp.int8),
                x.astype(BF16).astype(jnp.float32), x.astype(jnp.float16).astype(jnp.int32),
                a.astype(jnp.uint32), x.astype(jnp.float64) if False else x.astype(jnp.int16))
    x = normal(rng, (3, 6), scale=4)
    x[0, 0], x[0, 1], x[0, 2] = np.nan, np.inf, -np.inf
    return f, [x, nonzero_ints(rng, (3, 6)), rng.random((3, 6)) > 0.5]


@case("bf16_math", tol=1e-2)
def _(rng):
    def f(x, y):
        return (x * y + x, x / y, jnp.exp(x), jnp.tanh(x), jax.nn.sigmoid(x), jnp.sqrt(jnp.abs(x)),
                jnp.sum(x, axis=1), jnp.max(x), (x @ y.T), x.astype(jnp.float32) * 2)
    return f, [normal(rng, (4, 8), BF16), normal(rng, (4, 8), BF16)]


@case("f16_math", tol=1e-2)
def _(rng):
    def f(x, y):
        return x * y - x, jnp.exp(x), jnp.log1p(jnp.abs(y)), jnp.mean(x, axis=0), x.astype(BF16)
    return f, [normal(rng, (4, 8), np.float16), normal(rng, (4, 8), np.float16)]


@case("bitcast_convert_reduce_precision")
def _(rng):
    def f(x, b):
        return (lax.bitcast_convert_type(x, jnp.int32), lax.bitcast_convert_type(x, jnp.uint8),
                lax.bitcast_convert_type(b, jnp.float32), lax.reduce_precision(x, 5, 10),
                lax.reduce_precision(x, 8, 7), lax.reduce_precision(x * 1e5, 5, 2),
                lax.reduce_precision(x * 1e-6, 4, 3), lax.bitcast_convert_type(x, jnp.uint16))
    b = rng.integers(0, 255, (3, 5, 4)).astype(np.uint8)
    b[..., 3] = 0x3F  # keep the floats finite and moderate
    return f, [normal(rng, (3, 5)), b]


@case("complex")
def _(rng):
    def f(x, y):
        c = lax.complex(x, y)
        return c * c + c, jnp.abs(c), jnp.real(c * 2), jnp.imag(c), jnp.exp(c), c / (c + 1)
    return f, [normal(rng, (2, 5)), normal(rng, (2, 5))]


@case("broadcast_reshape_transpose")
def _(rng):
    def f(x, y):
        return (x[:, None, :] + y[None], x.reshape(2, 3, 4).transpose(2, 0, 1), x.T @ jnp.ones((6,)),
                jnp.broadcast_to(y[0], (5, 4)), jnp.expand_dims(x, 0).reshape(-1))
    return f, [normal(rng, (6, 4)), normal(rng, (3, 4))]


@case("slicing")
def _(rng):
    def f(x):
        return (x[1:3, ::2], x[::-1, 1:], lax.slice(x, (0, 1), (5, 7), (2, 3)), jnp.flip(x, 1),
                lax.rev(x, (0, 1)), x[..., -1], x[3])
    return f, [normal(rng, (5, 7))]


@case("concat_pad_iota")
def _(rng):
    def f(x, y):
        return (jnp.concatenate([x, y, x], 1), lax.pad(x, 0.0, [(1, 2, 0), (-1, 1, 2)]),
                lax.pad(x, 1.5, [(-1, -1, 1), (2, -3, 0)]), jnp.arange(4) * 2.0 + x[:1, :],
                lax.broadcasted_iota(jnp.int32, (3, 4), 1), jnp.pad(x, ((1, 1), (2, 0)), mode="reflect"))
    return f, [normal(rng, (3, 4)), normal(rng, (3, 2))]


@case("dynamic_slice_in_loop")
def _(rng):
    def f(x, k):
        def body(i, carry):
            row = lax.dynamic_slice(carry, (i, 0), (1, 5)) * 2.0
            return lax.dynamic_update_slice(carry, row + 1.0, (i + 1, 0))
        y = lax.fori_loop(0, 5, body, x)
        clamped = lax.dynamic_slice(x, (k + 4, k), (3, 2))  # start out of range: clamped
        updated = lax.dynamic_update_slice(x, jnp.ones((2, 2)), (k - 9, k + 9))
        return y, clamped, updated
    return f, [normal(rng, (6, 5)), np.int32(2)]


@case("reductions", tol=1e-4)
def _(rng):
    def f(x, a):
        return (jnp.sum(x), jnp.sum(x, axis=(0, 2)), jnp.max(x, axis=1), jnp.min(x, axis=2),
                jnp.prod(x[0], axis=0), jnp.mean(x, axis=-1), jnp.argmax(x, axis=1), jnp.argmin(x, axis=2),
                jnp.any(x > 1.0, axis=0), jnp.all(x > -2.0, axis=1), jnp.sum(a, axis=0), jnp.max(a),
                jax.nn.logsumexp(x, axis=1), jnp.var(x, axis=0), jax.nn.softmax(x, axis=-1))
    return f, [normal(rng, (3, 4, 5)), nonzero_ints(rng, (4, 3))]


@case("variadic_reduce", tol=1e-4)
def _(rng):
    def f(x, y):
        s, m = lax.reduce((x, y), (np.float32(0), np.float32(-np.inf)),
                          lambda a, b: (a[0] + b[0], jnp.maximum(a[1], b[1])), (1,))
        logaddexp = lax.reduce(x, np.float32(-np.inf), jnp.logaddexp, (0,))
        return s, m, logaddexp
    return f, [normal(rng, (4, 9)), normal(rng, (4, 9))]


@case("reduce_window", tol=1e-4)
def _(rng):
    def f(x):
        maxpool = lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        avgpool = lax.reduce_window(x, 0.0, lax.add, (1, 3, 3, 1), (1, 1, 1, 1), "SAME") / 9.0
        dilated = lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1), (1, 1, 2, 1), [(0, 0), (1, 0), (0, 2), (0, 0)],
                                    base_dilation=(1, 2, 1, 1), window_dilation=(1, 1, 2, 1))
        return (maxpool, avgpool, dilated, jnp.cumsum(x, axis=2), jnp.cumprod(x[0, 0], axis=0),
                lax.cummax(x, axis=1))
    return f, [normal(rng, (2, 6, 6, 3))]


@case("maxpool_grad", tol=1e-4)
def _(rng):
    def f(x):
        def pool(v):
            return lax.reduce_window(v, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
        return jax.grad(lambda v: jnp.sum(pool(v) ** 2))(x)
    return f, [normal(rng, (2, 7, 7, 2))]


@case("gather")
def _(rng):
    def f(x, idx, ids, table, order):
        return (x[idx], jnp.take_along_axis(x, order, axis=1), table[ids], x[:, idx],
                x[idx, 2], x[idx[:2], idx[2:]], jnp.take(x, idx + 3, axis=0, mode="clip"),
                x[jnp.array([-1, 0])])
    idx = np.array([3, 0, 2, 3], np.int32)
    return f, [normal(rng, (5, 6)), idx, rng.integers(0, 10, (2, 4)).astype(np.int32),
               normal(rng, (10, 3)), np.argsort(rng.random((5, 6)), axis=1).astype(np.int32)]


@case("scatter", tol=1e-5)
def _(rng):
    def f(x, idx, v, w):
        return (x.at[idx].add(v), x.at[jnp.array([2, 0, 4])].set(v[:3]), x.at[idx].max(v),
                x.at[idx].mul(v), x.at[:, jnp.array([1, 1, 3])].add(w),
                x.at[jnp.array([1, 10, 4, -9])].add(v, mode="drop"), x.at[idx].min(v))
    idx = np.array([1, 3, 1, 4], np.int32)  # duplicates accumulate
    return f, [normal(rng, (5, 3)), idx, normal(rng, (4, 3)), normal(rng, (5, 3))]


@case("gather_grad", tol=1e-5)
def _(rng):
    def f(table, ids, w):
        return jax.grad(lambda t: jnp.sum(jnp.tanh(t[ids]) * w))(table)
    return f, [normal(rng, (7, 4)), rng.integers(0, 7, (3, 5)).astype(np.int32), normal(rng, (3, 5, 4))]


@case("batched_gather_scatter_grad", tol=1e-5)
def _(rng):
    def f(x, order, w):
        def loss(v):
            return jnp.sum(jnp.take_along_axis(v, order, axis=2) * w)
        return jax.grad(loss)(x), jnp.take_along_axis(x, order, axis=2)
    order = rng.integers(0, 6, (2, 3, 4)).astype(np.int32)  # repeats: the gradient accumulates
    return f, [normal(rng, (2, 3, 6)), order, normal(rng, (2, 3, 4))]


@case("dot", tol=1e-4)
def _(rng):
    def f(x, w, b, q, k, i, j, h):
        return (jnp.dot(x, w), jnp.einsum("bij,bjk->bik", b, b.transpose(0, 2, 1)),
                jnp.einsum("bhqd,bhkd->bhqk", q, k), i @ j, x @ w[:, 0],
                jnp.dot(h, h.T, preferred_element_type=jnp.float32), jnp.dot(h, h.T))
    return f, [normal(rng, (4, 6)), normal(rng, (6, 3)), normal(rng, (2, 3, 5)),
               normal(rng, (2, 2, 4, 8)), normal(rng, (2, 2, 5, 8)), nonzero_ints(rng, (3, 4)),
               nonzero_ints(rng, (4, 2)), normal(rng, (3, 8), BF16)]


@case("conv_nhwc", tol=1e-4)
def _(rng):
    def f(x, w):
        return lax.conv_general_dilated(x, w, (2, 1), [(1, 1), (0, 2)], lhs_dilation=(1, 2), rhs_dilation=(2, 1),
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=2)
    return f, [normal(rng, (2, 8, 8, 4)), normal(rng, (3, 3, 2, 6))]


@case("conv_nchw_depthwise_1d", tol=1e-4)
def _(rng):
    def f(x, w, dw, x1, w1):
        same = lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"))
        depthwise = lax.conv_general_dilated(x, dw, (2, 2), "VALID", dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                             feature_group_count=3)
        one_d = lax.conv_general_dilated(x1, w1, (1,), [(2, 0)], dimension_numbers=("NWC", "WIO", "NWC"))
        return same, depthwise, one_d
    return f, [normal(rng, (2, 3, 7, 6)), normal(rng, (4, 3, 3, 2)), normal(rng, (6, 1, 3, 3)),
               normal(rng, (2, 9, 3)), normal(rng, (3, 3, 5))]


@case("conv_batch_groups", tol=1e-4)
def _(rng):
    def f(x, w):
        return lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                        batch_group_count=2)
    return f, [normal(rng, (4, 5, 5, 3)), normal(rng, (2, 2, 3, 6))]


@case("conv_grad", tol=1e-4)
def _(rng):
    def f(x, w):
        def loss(x, w):
            y = lax.conv_general_dilated(x, w, (2, 2), [(1, 2), (0, 1)], dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                         feature_group_count=2)
            return jnp.sum(jnp.tanh(y))
        return jax.grad(loss, argnums=(0, 1))(x, w)
    return f, [normal(rng, (2, 7, 6, 4)), normal(rng, (3, 2, 2, 6))]


@case("scan_while", tol=1e-4)
def _(rng):
    def f(xs, h0, w):
        def step(h, x):
            h = jnp.tanh(h @ w + x)
            return h, h.sum()
        h, ys = lax.scan(step, h0, xs)

        def cond(c):
            return (c[0] < 10) & (jnp.sum(c[1]) < 100.0)

        def body(c):
            return c[0] + 1, c[1] * 1.5 + 0.1
        n, grown = lax.while_loop(cond, body, (0, jnp.abs(h0)))
        return h, ys, n, grown
    return f, [normal(rng, (6, 2, 4)), normal(rng, (2, 4)), normal(rng, (4, 4), scale=0.5)]


@case("cond_switch")
def _(rng):
    def f(x, k):
        a = lax.cond(jnp.sum(x) > 0, lambda v: v * 2.0, lambda v: v - 1.0, x)
        b = lax.cond(jnp.sum(x) < 0, lambda v: jnp.sin(v), lambda v: jnp.cos(v), x)
        branches = [lambda v: v + 1.0, lambda v: v * v, lambda v: -v]
        return a, b, lax.switch(k, branches, x), lax.switch(k + 7, branches, x), lax.switch(k - 9, branches, x)
    return f, [normal(rng, (3, 3)), np.int32(1)]


@case("sort")
def _(rng):
    def f(x, a, b, v):
        k1, k2, vals = lax.sort((a, b, v), num_keys=2)
        return (jnp.sort(x, axis=0), jnp.argsort(x, axis=1), jnp.sort(x, axis=1, descending=True),
                jnp.sort(a), jnp.argsort(a, stable=True), k1, k2, vals, lax.top_k(x, 3))
    x = normal(rng, (5, 9))
    x[1, 2] = np.nan
    x[3, 4] = -0.0
    x[3, 5] = 0.0
    a = rng.integers(0, 3, (11,)).astype(np.int32)  # many ties
    b = rng.integers(0, 3, (11,)).astype(np.int32)
    return f, [x, a, b, normal(rng, (11,))]


@case("mlp_grad", tol=1e-4)
def _(rng):
    def f(params, x, labels):
        def loss(p):
            h = jax.nn.gelu(x @ p["w1"] + p["b1"])
            h = jax.nn.relu(h @ p["w2"] + p["b2"])
            logits = h @ p["w3"]
            logp = jax.nn.log_softmax(logits)
            return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))
        value, grads = jax.value_and_grad(loss)(params)
        return value, grads
    params = {"w1": normal(rng, (8, 16), scale=0.3), "b1": normal(rng, (16,)),
              "w2": normal(rng, (16, 16), scale=0.3), "b2": normal(rng, (16,)),
              "w3": normal(rng, (16, 5), scale=0.3)}
    return f, [params, normal(rng, (6, 8)), rng.integers(0, 5, (6,)).astype(np.int32)]


@case("attention_block", tol=1e-4)
def _(rng):
    def f(x, wq, wk, wv, mask):
        q, k, v = x @ wq, x @ wk, x @ wv
        q = q.reshape(2, 8, 4, 8).transpose(0, 2, 1, 3)
        k = k.reshape(2, 8, 4, 8).transpose(0, 2, 1, 3)
        v = v.reshape(2, 8, 4, 8).transpose(0, 2, 1, 3)
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(8.0)
        s = jnp.where(mask, s, -1e9)
        o = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)
        o = o.transpose(0, 2, 1, 3).reshape(2, 8, 32)
        mu = o.mean(-1, keepdims=True)
        return (o - mu) * lax.rsqrt(((o - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
    mask = np.tril(np.ones((8, 8), bool))
    return f, [normal(rng, (2, 8, 32)), normal(rng, (32, 32), scale=0.2), normal(rng, (32, 32), scale=0.2),
               normal(rng, (32, 32), scale=0.2), mask]


@functools.lru_cache(maxsize=None)
def _prepared(name: str):
    build, tol = CASES[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    f, args = build(rng)
    leaves = jax.tree_util.tree_leaves(args)
    lowered = jax.jit(f).lower(*args)
    compiled = lowered.compile()
    ref = [np.asarray(r) for r in jax.tree_util.tree_leaves(compiled(*args))]
    texts = {"pre": lowered.as_text(dialect="hlo"), "opt": compiled.as_text()}
    return [np.asarray(a) for a in leaves], ref, texts, tol


@pytest.mark.parametrize("stage", ["pre", "opt"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_jax(name, stage):
    args, ref, texts, tol = _prepared(name)
    out = evaluate(parse_hlo(texts[stage]), args)
    assert len(out) == len(ref)
    for i, (o, r) in enumerate(zip(out, ref)):
        assert_close(o, r, tol, f"{name}/{stage} output {i}")


def test_accepts_text_and_keeps_arguments_unchanged():
    args, ref, texts, _ = _prepared("scatter")
    before = [a.copy() for a in args]
    out = evaluate(texts["pre"], args)
    for o, r in zip(out, ref):
        assert_close(o, r, 1e-5)
    for a, b in zip(args, before):
        assert np.array_equal(a, b)


# --- hand-written HLO --------------------------------------------------------------------
def run(text: str, *args):
    return evaluate(parse_hlo(text), list(args))


def test_bitcast_is_a_transpose_through_layouts():
    x = np.arange(128 * 32, dtype=np.float32).reshape(128, 32)
    out, = run("""HloModule m
ENTRY e {
  p = f32[128,32]{1,0} parameter(0)
  ROOT b = f32[32,128]{0,1} bitcast(p)
}""", x)
    np.testing.assert_array_equal(out, x.T)


def test_bitcast_reshapes_the_physical_buffer():
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    flat, back, same_bits = run("""HloModule m
ENTRY e {
  p = f32[4,6]{0,1} parameter(0)
  a = f32[24]{0} bitcast(p)
  b = f32[3,2,4]{0,2,1} bitcast(a)
  c = s32[4,6]{0,1} bitcast(p)
  ROOT t = (f32[24]{0}, f32[3,2,4]{0,2,1}, s32[4,6]{0,1}) tuple(a, b, c)
}""", x)
    np.testing.assert_array_equal(flat, x.T.reshape(-1))  # column-major buffer
    # b's physical order is dims (1, 2, 0): logical b[i,j,k] = flat[j*12 + k*3 + i]
    expected = flat.reshape(2, 4, 3).transpose(2, 0, 1)
    np.testing.assert_array_equal(back, expected)
    np.testing.assert_array_equal(same_bits, x.view(np.int32))


GEMM = """HloModule m
ENTRY e {
  a = f32[4,8]{1,0} parameter(0)
  b = f32[8,5]{1,0} parameter(1)
  c = f32[4,5]{1,0} parameter(2)
  g = (f32[4,5]{1,0}, s8[1024]{0}) custom-call(a, b, c), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"alpha_real":2,"alpha_imag":0,"beta":0.5,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"precision_config":{"operand_precision":["DEFAULT","DEFAULT"]},"epilogue":"DEFAULT"}}
  r = f32[4,5]{1,0} get-tuple-element(g), index=0
  ws = s8[1024]{0} get-tuple-element(g), index=1
  bias = f32[5]{0} parameter(3)
  bt = f32[8,4]{1,0} transpose(a), dimensions={1,0}
  l = (f32[4,5]{1,0}, s8[0]{0}) custom-call(bt, b, bias), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"alpha_real":1,"alpha_imag":0,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["0"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"epilogue":"BIAS_RELU"}}
  lr = f32[4,5]{1,0} get-tuple-element(l), index=0
  ROOT t = (f32[4,5]{1,0}, s8[1024]{0}, f32[4,5]{1,0}) tuple(r, ws, lr)
}"""


def test_cublas_gemm_alpha_beta_and_bias_epilogue():
    rng = np.random.default_rng(11)
    a, b, c, bias = normal(rng, (4, 8)), normal(rng, (8, 5)), normal(rng, (4, 5)), normal(rng, (5,))
    out, workspace, relu = run(GEMM, a, b, c, bias)
    np.testing.assert_allclose(out, 2 * (a @ b) + 0.5 * c, rtol=1e-5, atol=1e-5)
    assert workspace.shape == (1024,) and workspace.dtype == np.int8 and not workspace.any()
    np.testing.assert_allclose(relu, np.maximum(a @ b + bias, 0), rtol=1e-5, atol=1e-5)


def test_cublas_batched_gelu_epilogue():
    rng = np.random.default_rng(12)
    a, b = normal(rng, (2, 3, 4)), normal(rng, (2, 5, 4))
    out, = run("""HloModule m
ENTRY e {
  a = f32[2,3,4]{2,1,0} parameter(0)
  b = f32[2,5,4]{2,1,0} parameter(1)
  g = (f32[2,3,5]{2,1,0}, s8[16]{0}) custom-call(a, b), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["2"],"rhs_contracting_dimensions":["2"],"lhs_batch_dimensions":["0"],"rhs_batch_dimensions":["0"]},"epilogue":"GELU"}}
  ROOT r = f32[2,3,5]{2,1,0} get-tuple-element(g), index=0
}""", a, b)
    np.testing.assert_allclose(out, np.asarray(jax.nn.gelu(jnp.einsum("bik,bjk->bij", a, b), approximate=True)),
                               rtol=1e-5, atol=1e-5)


CUDNN = """HloModule m
ENTRY e {
  x = f32[2,7,6,4]{3,2,1,0} parameter(0)
  w = f32[3,2,2,6]{3,2,1,0} parameter(1)
  dy = f32[2,4,3,6]{3,2,1,0} parameter(2)
  f = (f32[2,4,3,6]{3,2,1,0}, u8[0]{0}) custom-call(x, w), window={size=3x2 stride=2x2 pad=1_2x0_1}, dim_labels=b01f_01io->b01f, feature_group_count=2, custom_call_target="__cudnn$convForward", backend_config={"cudnn_conv_backend_config":{"conv_result_scale":1,"activation_mode":"kNone"}}
  fy = f32[2,4,3,6]{3,2,1,0} get-tuple-element(f), index=0
  bi = (f32[2,7,6,4]{3,2,1,0}, u8[0]{0}) custom-call(dy, w), window={size=3x2 stride=2x2 pad=1_2x0_1}, dim_labels=b01f_01io->b01f, feature_group_count=2, custom_call_target="__cudnn$convBackwardInput", backend_config={"cudnn_conv_backend_config":{"conv_result_scale":1}}
  dx = f32[2,7,6,4]{3,2,1,0} get-tuple-element(bi), index=0
  bf = (f32[3,2,2,6]{3,2,1,0}, u8[0]{0}) custom-call(x, dy), window={size=3x2 stride=2x2 pad=1_2x0_1}, dim_labels=b01f_01io->b01f, feature_group_count=2, custom_call_target="__cudnn$convBackwardFilter", backend_config={"cudnn_conv_backend_config":{"conv_result_scale":1}}
  dw = f32[3,2,2,6]{3,2,1,0} get-tuple-element(bf), index=0
  bias = f32[6]{0} parameter(3)
  ba = (f32[2,4,3,6]{3,2,1,0}, u8[0]{0}) custom-call(x, w, bias), window={size=3x2 stride=2x2 pad=1_2x0_1}, dim_labels=b01f_01io->b01f, feature_group_count=2, custom_call_target="__cudnn$convBiasActivationForward", backend_config={"cudnn_conv_backend_config":{"conv_result_scale":0.5,"activation_mode":"kRelu","side_input_scale":0}}
  bay = f32[2,4,3,6]{3,2,1,0} get-tuple-element(ba), index=0
  ROOT t = (f32[2,4,3,6]{3,2,1,0}, f32[2,7,6,4]{3,2,1,0}, f32[3,2,2,6]{3,2,1,0}, f32[2,4,3,6]{3,2,1,0}) tuple(fy, dx, dw, bay)
}"""


def test_cudnn_convolutions_match_jax_conv_and_its_vjp():
    rng = np.random.default_rng(13)
    x, w, dy, bias = normal(rng, (2, 7, 6, 4)), normal(rng, (3, 2, 2, 6)), normal(rng, (2, 4, 3, 6)), normal(rng, (6,))

    def conv(x, w):
        return lax.conv_general_dilated(x, w, (2, 2), [(1, 2), (0, 1)], dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                        feature_group_count=2)
    y, vjp = jax.vjp(conv, x, w)
    dx, dw = vjp(dy)
    fy, gx, gw, fused = run(CUDNN, x, w, dy, bias)
    assert_close(fy, np.asarray(y), 1e-5, "forward")
    assert_close(gx, np.asarray(dx), 1e-5, "backward input")
    assert_close(gw, np.asarray(dw), 1e-5, "backward filter")
    assert_close(fused, np.maximum(0.5 * np.asarray(y) + bias, 0), 1e-5, "bias activation")


def test_custom_fusion_with_nested_fusion_and_dot():
    rng = np.random.default_rng(14)
    a, b = normal(rng, (4, 8)), normal(rng, (8, 3))
    out, = run("""HloModule m
neg {
  p = f32[4,8]{1,0} parameter(0)
  ROOT n = f32[4,8]{1,0} negate(p)
}
triton_gemm {
  p0 = f32[4,8]{1,0} parameter(0)
  p1 = f32[8,3]{1,0} parameter(1)
  f = f32[4,8]{1,0} fusion(p0), kind=kLoop, calls=neg
  ROOT d = f32[4,3]{1,0} dot(f, p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
ENTRY e {
  a = f32[4,8]{1,0} parameter(0)
  b = f32[8,3]{1,0} parameter(1)
  ROOT g = f32[4,3]{1,0} fusion(a, b), kind=kCustom, calls=triton_gemm, backend_config={"fusion_backend_config":{"kind":"__triton_gemm","triton_gemm_config":{"block_m":"16"}}}
}""", a, b)
    np.testing.assert_allclose(out, -(a @ b), rtol=1e-5, atol=1e-6)


def test_sharding_custom_calls_are_identities():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    out, = run("""HloModule m
ENTRY e {
  x = f32[2,3]{1,0} parameter(0)
  s = f32[2,3]{1,0} custom-call(x), custom_call_target="Sharding", sharding={replicated}
  f = f32[2,3]{1,0} custom-call(s), custom_call_target="SPMDFullToShardShape", sharding={manual}
  ROOT b = f32[2,3]{1,0} custom-call(f), custom_call_target="SPMDShardToFullShape", sharding={replicated}
}""", x)
    np.testing.assert_array_equal(out, x)


def test_unsupported_opcode_names_the_opcode():
    text = """HloModule m
ENTRY e {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT r = f32[4]{0} rng(a, b), distribution=rng_uniform
}"""
    with pytest.raises(UnsupportedOpcodeError) as info:
        run(text, np.float32(0), np.float32(1))
    assert info.value.opcode == "rng"
    assert "'rng'" in str(info.value) and "r" == info.value.instruction


def test_unknown_custom_call_target_is_unsupported():
    text = """HloModule m
ENTRY e {
  a = f32[4]{0} parameter(0)
  ROOT r = f32[4]{0} custom-call(a), custom_call_target="my_secret_kernel"
}"""
    with pytest.raises(UnsupportedOpcodeError, match="my_secret_kernel"):
        run(text, np.ones(4, np.float32))


SIMPLE = """HloModule m
ENTRY e {
  y = s32[3]{0} parameter(1)
  x = f32[2,3]{1,0} parameter(0)
  c = f32[3]{0} convert(y)
  b = f32[2,3]{1,0} broadcast(c), dimensions={1}
  ROOT r = f32[2,3]{1,0} add(x, b)
}"""


def test_arguments_follow_parameter_numbers():
    x = np.ones((2, 3), np.float32)
    y = np.array([1, 2, 3], np.int32)
    out, = evaluate(SIMPLE, [x, y])
    np.testing.assert_array_equal(out, x + y)


@pytest.mark.parametrize("args, message", [
    ([np.ones((3, 2), np.float32), np.ones(3, np.int32)], "parameter 0"),
    ([np.ones((2, 3), np.float64), np.ones(3, np.int32)], "parameter 0"),
    ([np.ones((2, 3), np.float32), np.ones(4, np.int32)], "parameter 1"),
    ([np.ones((2, 3), np.float32)], "takes 2 arguments"),
])
def test_wrong_arguments_are_rejected(args, message):
    with pytest.raises(HloEvaluationError, match=message):
        evaluate(SIMPLE, args)


def test_integer_and_conversion_corner_cases():
    a = np.array([7, -7, -2 ** 31, 5], np.int32)
    b = np.array([0, 0, -1, 3], np.int32)
    x = np.array([np.nan, 1e20, -1e20, -2.9], np.float32)
    q, r, c, u = run("""HloModule m
ENTRY e {
  a = s32[4]{0} parameter(0)
  b = s32[4]{0} parameter(1)
  x = f32[4]{0} parameter(2)
  q = s32[4]{0} divide(a, b)
  r = s32[4]{0} remainder(a, b)
  c = s32[4]{0} convert(x)
  u = u8[4]{0} convert(x)
  ROOT t = (s32[4]{0}, s32[4]{0}, s32[4]{0}, u8[4]{0}) tuple(q, r, c, u)
}""", a, b, x)
    np.testing.assert_array_equal(q, [-1, -1, -2 ** 31, 1])
    np.testing.assert_array_equal(r, [7, -7, 0, 2])
    np.testing.assert_array_equal(c, [0, 2 ** 31 - 1, -2 ** 31, -2])
    np.testing.assert_array_equal(u, [0, 255, 0, 0])


def test_reduce_precision_matches_ml_dtypes_rounding():
    rng = np.random.default_rng(15)
    x = normal(rng, (1000,), scale=10)
    as_bf16, as_f16 = run("""HloModule m
ENTRY e {
  x = f32[1000]{0} parameter(0)
  a = f32[1000]{0} reduce-precision(x), exponent_bits=8, mantissa_bits=7
  b = f32[1000]{0} reduce-precision(x), exponent_bits=5, mantissa_bits=10
  ROOT t = (f32[1000]{0}, f32[1000]{0}) tuple(a, b)
}""", x)
    np.testing.assert_array_equal(as_bf16, x.astype(BF16).astype(np.float32))
    np.testing.assert_array_equal(as_f16, x.astype(np.float16).astype(np.float32))


def test_conditional_index_out_of_range_takes_the_last_branch():
    text = """HloModule m
b0 {
  p = f32[] parameter(0)
  ROOT r = f32[] add(p, p)
}
b1 {
  p = f32[] parameter(0)
  ROOT r = f32[] negate(p)
}
ENTRY e {
  i = s32[] parameter(0)
  x = f32[] parameter(1)
  ROOT c = f32[] conditional(i, x, x), branch_computations={b0, b1}
}"""
    x = np.float32(3)
    assert run(text, np.int32(0), np.asarray(x))[0] == 6
    assert run(text, np.int32(1), np.asarray(x))[0] == -3
    assert run(text, np.int32(5), np.asarray(x))[0] == -3
    assert run(text, np.int32(-1), np.asarray(x))[0] == -3


def test_tokens_barriers_and_ids():
    out = run("""HloModule m
ENTRY e {
  x = f32[3]{0} parameter(0)
  t = token[] after-all()
  d = f32[3]{0} add-dependency(x, t)
  tb = (f32[3]{0}) tuple(d)
  b = (f32[3]{0}) optimization-barrier(tb)
  g = f32[3]{0} get-tuple-element(b), index=0
  p = u32[] partition-id()
  ROOT r = (f32[3]{0}, u32[]) tuple(g, p)
}""", np.arange(3, dtype=np.float32))
    np.testing.assert_array_equal(out[0], [0, 1, 2])
    assert out[1] == 0 and out[1].dtype == np.uint32


def test_sort_with_hand_written_comparator_is_stable():
    keys = np.array([3, 1, 2, 1, 3, 2, 1], np.int32)
    vals = np.arange(7, dtype=np.float32)
    k, v = run("""HloModule m
cmp {
  a = s32[] parameter(0)
  b = s32[] parameter(1)
  c = f32[] parameter(2)
  d = f32[] parameter(3)
  ROOT gt = pred[] compare(a, b), direction=GT
}
ENTRY e {
  k = s32[7]{0} parameter(0)
  v = f32[7]{0} parameter(1)
  ROOT s = (s32[7]{0}, f32[7]{0}) sort(k, v), dimensions={0}, is_stable=true, to_apply=cmp
}""", keys, vals)
    order = np.argsort(-keys, kind="stable")
    np.testing.assert_array_equal(k, keys[order])
    np.testing.assert_array_equal(v, vals[order])


def test_non_elementwise_reducer_falls_back_per_element():
    # A reducer with a rank-1 intermediate cannot run on whole arrays; it still works.
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    out, = run("""HloModule m
add_via_vector {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  va = f32[1]{0} broadcast(a), dimensions={}
  vb = f32[1]{0} broadcast(b), dimensions={}
  s = f32[1]{0} add(va, vb)
  ROOT r = f32[] reshape(s)
}
ENTRY e {
  x = f32[3,4]{1,0} parameter(0)
  z = f32[] constant(0)
  ROOT r = f32[3]{0} reduce(x, z), dimensions={1}, to_apply=add_via_vector
}""", x)
    np.testing.assert_array_equal(out, x.sum(axis=1))


@case("fft", tol=1e-4)
def _(rng):
    def f(x, c):
        return jnp.fft.fft(c), jnp.fft.ifft2(c), jnp.fft.rfft(x), jnp.fft.irfft(jnp.fft.rfft(x), n=8)
    return f, [normal(rng, (3, 8)), (normal(rng, (3, 8)) + 1j * normal(rng, (3, 8))).astype(np.complex64)]
