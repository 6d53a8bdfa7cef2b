"""The evaluator on hand-written modules: miscellaneous opcodes, variadic scatter and
reduce-window with general combiners, batch norm, dot algorithms, erf, scalar bit ops and
widened float combiners, each against jax or numpy."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from stitch.hlo.evaluator import evaluate  # noqa: E402
from stitch.hlo.evaluator.dtypes import numpy_dtype  # noqa: E402
from stitch.hlo.parser import parse_hlo  # noqa: E402
from tests.test_evaluator import assert_close, normal, run  # noqa: E402

BF16 = ml_dtypes.bfloat16


def test_misc_opcodes():
    x = np.array([-2.0, -0.5, 0.5, 3.0], np.float32)
    out = run("""HloModule m, replica_count=1
double {
  p = f32[] parameter(0)
  q = f32[] parameter(1)
  m = f32[] multiply(p, q)
  ROOT a = f32[] add(m, p)
}
neg {
  p = f32[4]{0} parameter(0)
  ROOT n = f32[4]{0} negate(p)
}
sum {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}
ENTRY e {
  x = f32[4]{0} parameter(0)
  l = f32[4]{0} logistic(x)
  c = c64[4]{0} complex(x, l)
  i = f32[4]{0} imag(c)
  m = f32[4]{0} map(x, l), dimensions={0}, to_apply=double
  g = s32[] get-dimension-size(x), dimensions={0}
  s = ((f32[4]{0}), f32[4]{0}, u32[]) async-start(x), calls=neg
  d = f32[4]{0} async-done(s), calls=neg
  cs = (f32[4]{0}, f32[4]{0}, u32[]) copy-start(x)
  cd = f32[4]{0} copy-done(cs)
  ar = f32[4]{0} all-reduce(x), replica_groups={}, to_apply=sum
  ROOT t = (f32[4]{0}, f32[4]{0}, f32[4]{0}, s32[], f32[4]{0}, f32[4]{0}, f32[4]{0}) tuple(l, i, m, g, d, cd, ar)
}""", x)
    sigmoid = 1 / (1 + np.exp(-x.astype(np.float64)))
    np.testing.assert_allclose(out[0], sigmoid, rtol=1e-6)
    np.testing.assert_allclose(out[1], sigmoid, rtol=1e-6)
    np.testing.assert_allclose(out[2], x * out[0] + x, rtol=1e-6)
    assert out[3] == 4 and out[3].dtype == np.int32
    np.testing.assert_array_equal(out[4], -x)
    np.testing.assert_array_equal(out[5], x)
    np.testing.assert_array_equal(out[6], x)


def test_variadic_scatter_and_reduce_window_with_general_combiners():
    operand = np.arange(5, dtype=np.float32)
    count = np.zeros(5, np.int32)
    idx = np.array([[1], [3], [1], [1]], np.int32)
    upd = np.array([10, 20, 30, 40], np.float32)
    ones = np.ones(4, np.int32)
    x = np.array([3, 1, 4, 1, 5, 9, 2, 6], np.float32)
    text = """HloModule m
comb {
  a = f32[] parameter(0)
  b = s32[] parameter(1)
  c = f32[] parameter(2)
  d = s32[] parameter(3)
  h = f32[] constant(0.5)
  ac = f32[] multiply(a, h)
  s = f32[] add(ac, c)
  n = s32[] add(b, d)
  ROOT t = (f32[], s32[]) tuple(s, n)
}
argmax {
  a = f32[] parameter(0)
  i = s32[] parameter(1)
  b = f32[] parameter(2)
  j = s32[] parameter(3)
  ge = pred[] compare(a, b), direction=GE
  v = f32[] select(ge, a, b)
  k = s32[] select(ge, i, j)
  ROOT t = (f32[], s32[]) tuple(v, k)
}
ENTRY e {
  o = f32[5]{0} parameter(0)
  n = s32[5]{0} parameter(1)
  idx = s32[4,1]{1,0} parameter(2)
  u = f32[4]{0} parameter(3)
  w = s32[4]{0} parameter(4)
  sc = (f32[5]{0}, s32[5]{0}) scatter(o, n, idx, u, w), update_window_dims={}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=comb
  x = f32[8]{0} parameter(5)
  io = s32[8]{0} iota(), iota_dimension=0
  ninf = f32[] constant(-inf)
  z = s32[] constant(-1)
  rw = (f32[4]{0}, s32[4]{0}) reduce-window(x, io, ninf, z), window={size=3 stride=2 pad=1_0}, to_apply=argmax
  ROOT t = ((f32[5]{0}, s32[5]{0}), (f32[4]{0}, s32[4]{0})) tuple(sc, rw)
}"""
    vals, counts, best, where = run(text, operand, count, idx, upd, ones, x)
    expected = operand.copy()
    for i, u in zip(idx[:, 0], upd):  # sequential application in update order
        expected[i] = expected[i] * 0.5 + u
    np.testing.assert_allclose(vals, expected)
    np.testing.assert_array_equal(counts, [0, 3, 0, 1, 0])
    # windows over [-inf, 3, 1, 4, 1, 5, 9, 2, 6] (one low pad) with stride 2
    np.testing.assert_array_equal(best, [3, 4, 9, 9])
    np.testing.assert_array_equal(where, [0, 2, 5, 5])


BATCH_NORM = """HloModule m
ENTRY e {
  x = f32[4,3,5]{2,1,0} parameter(0)
  s = f32[3]{0} parameter(1)
  o = f32[3]{0} parameter(2)
  dy = f32[4,3,5]{2,1,0} parameter(3)
  t = (f32[4,3,5]{2,1,0}, f32[3]{0}, f32[3]{0}) batch-norm-training(x, s, o), epsilon=0.001, feature_index=1
  y = f32[4,3,5]{2,1,0} get-tuple-element(t), index=0
  m = f32[3]{0} get-tuple-element(t), index=1
  v = f32[3]{0} get-tuple-element(t), index=2
  i = f32[4,3,5]{2,1,0} batch-norm-inference(x, s, o, m, v), epsilon=0.001, feature_index=1
  g = (f32[4,3,5]{2,1,0}, f32[3]{0}, f32[3]{0}) batch-norm-grad(x, s, m, v, dy), epsilon=0.001, feature_index=1
  ROOT r = ((f32[4,3,5]{2,1,0}, f32[3]{0}, f32[3]{0}), f32[4,3,5]{2,1,0}, (f32[4,3,5]{2,1,0}, f32[3]{0}, f32[3]{0})) tuple(t, i, g)
}"""


def test_batch_norm_ops_match_jax():
    rng = np.random.default_rng(16)
    x, s, o, dy = normal(rng, (4, 3, 5)), normal(rng, (3,)), normal(rng, (3,)), normal(rng, (4, 3, 5))

    def train(x, s, o):
        mean = x.mean(axis=(0, 2))
        var = ((x - mean[None, :, None]) ** 2).mean(axis=(0, 2))
        y = (x - mean[None, :, None]) * lax.rsqrt(var[None, :, None] + 1e-3) * s[None, :, None] + o[None, :, None]
        return y, mean, var
    (y, mean, var), vjp = jax.vjp(train, x, s, o)
    gx, gs, go = vjp((dy, jnp.zeros(3), jnp.zeros(3)))
    out = run(BATCH_NORM, x, s, o, dy)
    for got, want in zip(out, [y, mean, var, y, gx, gs, go]):
        assert_close(got, np.asarray(want), 1e-5)


def test_dot_algorithm_rounds_operands():
    rng = np.random.default_rng(17)
    a, b = normal(rng, (4, 8)), normal(rng, (8, 3))
    plain, bf16 = run("""HloModule m
ENTRY e {
  a = f32[4,8]{1,0} parameter(0)
  b = f32[8,3]{1,0} parameter(1)
  p = f32[4,3]{1,0} dot(a, b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  q = f32[4,3]{1,0} dot(a, b), lhs_contracting_dims={1}, rhs_contracting_dims={0}, algorithm=dot_bf16_bf16_f32
  ROOT t = (f32[4,3]{1,0}, f32[4,3]{1,0}) tuple(p, q)
}""", a, b)
    np.testing.assert_allclose(plain, a @ b, rtol=1e-5, atol=1e-6)
    rounded = a.astype(BF16).astype(np.float32) @ b.astype(BF16).astype(np.float32)
    np.testing.assert_allclose(bf16, rounded, rtol=1e-5, atol=1e-6)
    assert not np.allclose(bf16, plain, rtol=1e-6, atol=0)


def test_erf_without_scipy_is_accurate():
    import math

    from stitch.hlo.evaluator.elementwise import _erf_float64
    grid = np.concatenate([np.linspace(-6, 6, 2001), [0.0, -0.0, 1e-30, 2.9999, 3.0, 3.0001, 30.0, -30.0]])
    want = np.array([math.erf(v) for v in grid])
    got = _erf_float64(grid)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
    assert np.isnan(_erf_float64(np.array([np.nan])))[0]


@pytest.mark.parametrize("body, args, want", [
    ("ROOT r = u64[] shift-left(a, b)", ("u64", 5, 3), 40),
    ("ROOT r = s32[] shift-right-logical(a, b)", ("s32", -40, 3), (2**32 - 40) >> 3),
    ("ROOT r = s32[] shift-right-arithmetic(a, b)", ("s32", -40, 3), -5),
    ("ROOT r = pred[] compare(a, b), direction=LT, type=TOTALORDER", ("f32", 1.5, -0.0), False),
])
def test_scalar_bit_ops_keep_the_scalar_shape(body, args, want):
    """A scalar went 1-d through np.ascontiguousarray (tf2xla's philox seeding shifts u64[])."""
    t, x, y = args
    module = parse_hlo(f"HloModule s\nENTRY e {{\n  a = {t}[] parameter(0)\n"
                       f"  b = {t}[] parameter(1)\n  {body}\n}}\n")
    dtype = {"u64": np.uint64, "s32": np.int32, "f32": np.float32}[t]
    got, = evaluate(module, [np.array(x, dtype), np.array(y, dtype)])
    assert np.shape(got) == () and got == want


def _combiner_module(narrow: str, wide: str, op: str, swap: bool = False,
                     same_param: bool = False) -> str:
    first, second = ("b", "a") if swap else ("a", "b")
    if same_param:
        second = first
    return f"""HloModule m
comb {{
  a = {narrow}[] parameter(0)
  b = {narrow}[] parameter(1)
  wa = {wide}[] convert({first})
  wb = {wide}[] convert({second})
  r = {wide}[] {op}(wa, wb)
  ROOT n = {narrow}[] convert(r)
}}
ENTRY e {{
  x = {narrow}[8,64] parameter(0)
  z = {narrow}[] constant(0)
  ROOT s = {narrow}[8] reduce(x, z), dimensions={{1}}, to_apply=comb
}}"""


@pytest.mark.parametrize("narrow,wide,op,swap,same,want", [
    ("bf16", "f32", "add", False, False, "add"),        # XLA GPU's bf16 scatter-add combiner
    ("bf16", "f32", "maximum", True, False, "maximum"),
    ("f16", "f32", "multiply", False, False, "multiply"),
    ("f32", "f64", "add", False, False, "add"),
    ("f16", "bf16", "add", False, False, None),         # bf16 is narrower than f16's 2p+2
    ("bf16", "f32", "subtract", False, False, None),    # not a reduction op
    ("bf16", "f32", "add", False, True, None),          # a + a is not the combiner
])
def test_widened_float_combiner_is_its_op(narrow, wide, op, swap, same, want):
    """convert(op(convert(a), convert(b))) computed in a float wide enough to round once is
    the narrow op correctly rounded: recognized as that op (codegen then lowers XLA GPU's bf16
    scatter-adds and reductions), and the evaluator's fast path agrees with interpreting it."""
    from stitch.hlo.evaluator.interpreter import Evaluator
    module = parse_hlo(_combiner_module(narrow, wide, op, swap, same))
    assert Evaluator(module).binary_kind("comb") == want
    if want is None:
        return
    dtype = numpy_dtype(narrow)
    x = np.random.default_rng().standard_normal((8, 64)).astype(dtype)
    (got,) = evaluate(module, [x])
    got = np.asarray(got).astype(np.float64)
    ufunc = {"add": np.add, "maximum": np.maximum, "multiply": np.multiply}[op]
    x64 = x.astype(np.float64)
    ref = ufunc.reduce(np.concatenate([np.zeros((8, 1)), x64], axis=1), axis=1)
    tol = {"bf16": 2e-2, "f16": 2e-3, "f32": 1e-6}[narrow]
    if op == "multiply":         # zero init: the product is zero, whatever the rounding
        assert not got.any()
    else:
        np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * np.abs(x64).sum(1).max())
