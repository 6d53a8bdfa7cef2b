"""stitch.frontends.jax_ops against the numpy reference evaluator: every instruction of every
zoo tiny.pre.hlo (one jax.jit per model, so every handler is proven to trace), whole modules
through ``run_module``, and hand-written HLO for cases the zoo does not have.

XLA compile time dominates (2 shared cores), so programs compile with LLVM optimization
level 0 (the float semantics are the same) and identical instructions (same opcode, shapes,
attributes and called computations) are checked once per model."""
from __future__ import annotations

import numpy as np
import pytest

from hlo_passes import evaluate, parse_hlo
from hlo_passes.evaluator import Evaluator
from hlo_passes.evaluator.dtypes import numpy_dtype
from hlo_passes.ir import Shape
from hlo_passes.literals import literal_to_numpy
from tests.fixtures import DATA, REDUCERS

jax = pytest.importorskip("jax")
from stitch.frontends.jax_ops import JaxEmitError, JaxOpEmitter  # noqa: E402

MODELS = sorted(p.parent.name for p in DATA.glob("*/tiny.pre.hlo"))
_PLUMBING = frozenset({"parameter", "constant", "tuple", "get-tuple-element"})
# Ops that reorder sums (or contain ops that do) compare at 1e-4, the rest at 1e-5.
_HEAVY = frozenset({"reduce", "dot", "convolution", "reduce-window", "scatter", "call",
                    "fusion", "while", "conditional", "map", "select-and-scatter"})


_FAST_COMPILE = {"xla_backend_optimization_level": 0}


def run_jitted(fn, *args):
    """``jax.jit(fn)(*args)``, compiled for compile speed."""
    return jax.jit(fn).lower(*args).compile(compiler_options=_FAST_COMPILE)(*args)


def random_value(shape: Shape, rng: np.random.Generator) -> object:
    """Standard normal floats, integers in 0..2 (valid as indices), random preds."""
    if shape.is_tuple:
        return tuple(random_value(s, rng) for s in shape.tuple_shapes)
    dtype = numpy_dtype(shape.element_type)
    if dtype == np.bool_:
        return rng.random(shape.dims) < 0.5
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, 3, shape.dims).astype(dtype)
    return rng.standard_normal(shape.dims).astype(dtype)


def assert_close(out, ref, rtol: float, where: str) -> None:
    out, ref = np.asarray(out), np.asarray(ref)
    assert out.dtype == ref.dtype, f"{where}: dtype {out.dtype}, expected {ref.dtype}"
    assert out.shape == ref.shape, f"{where}: shape {out.shape}, expected {ref.shape}"
    if not np.issubdtype(ref.dtype, np.inexact):
        np.testing.assert_array_equal(out, ref, err_msg=where)
        return
    finite = np.isfinite(ref)
    scale = max(float(np.abs(ref[finite]).max(initial=0.0)), 1.0)
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=rtol * 0.1 * scale, equal_nan=True,
                               err_msg=where)


def _leaves(value) -> list:
    if isinstance(value, tuple):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


def _operand(operand, rng: np.random.Generator) -> object:
    """A constant operand keeps its literal (reduce init values must stay the reducer's
    identity: XLA may use them more than once); anything else is random."""
    if operand.opcode == "constant" and operand.shape.is_array:
        dtype = numpy_dtype(operand.shape.element_type)
        return literal_to_numpy(operand.literal, operand.shape, dtype)
    return random_value(operand.shape, rng)


def _cases(module, rng):
    """(computation, instruction, operands) for every distinct non-plumbing instruction."""
    cases = {}
    for comp, inst in module.instructions():
        if inst.opcode in _PLUMBING:
            continue
        table = comp.by_name()
        attrs = tuple(sorted((k, v) for k, v in inst.attrs.items() if k != "metadata"))
        operand_shapes = tuple(str(table[o].shape) for o in inst.operands)
        key = (inst.opcode, str(inst.shape), operand_shapes, attrs)
        if key not in cases:
            cases[key] = (comp, inst, [_operand(table[o], rng) for o in inst.operands])
    return list(cases.values())


@pytest.mark.parametrize("model", MODELS)
def test_every_instruction_matches_evaluator(model):
    module = parse_hlo((DATA / model / "tiny.pre.hlo").read_text())
    rng = np.random.default_rng(sum(map(ord, model)))
    cases = _cases(module, rng)
    emitter = JaxOpEmitter(module)

    def emit_all(all_operands):
        return [emitter.apply(comp, inst, ops)
                for (comp, inst, _), ops in zip(cases, all_operands)]

    outs = run_jitted(emit_all, [ops for _, _, ops in cases])
    evaluator = Evaluator(module)
    failures = []
    for (comp, inst, ops), out in zip(cases, outs):
        with np.errstate(all="ignore"):
            ref = evaluator.apply_instruction(comp, inst, ops)
        rtol = 1e-4 if inst.opcode in _HEAVY else 1e-5
        try:
            for i, (o, r) in enumerate(zip(_leaves(out), _leaves(ref), strict=True)):
                assert_close(o, r, rtol, f"{comp.name}/{inst.name} ({inst.opcode}) output {i}")
        except AssertionError as exc:
            failures.append(str(exc).strip())
    assert not failures, f"{model}: {len(failures)} instructions differ\n" + "\n".join(failures)


@pytest.mark.parametrize("model", MODELS)
def test_run_module_matches_evaluate(model):
    module = parse_hlo((DATA / model / "tiny.pre.hlo").read_text())
    rng = np.random.default_rng(1000 + sum(map(ord, model)))
    args = [random_value(p.shape, rng) for p in module.entry.parameters]
    outs = run_jitted(JaxOpEmitter(module).run_module, args)
    with np.errstate(all="ignore"):
        refs = evaluate(module, args)
    assert len(outs) == len(refs)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert_close(out, ref, 1e-4, f"{model} output {i}")


TF_MODULES = sorted(p.name for p in (DATA / "tf").glob("*.hlo"))


@pytest.mark.parametrize("name", TF_MODULES)
def test_tensorflow_modules_with_x64(name):
    """TensorFlow's pre-optimization HLO: s64 step counters (x64 on) and select-and-scatter."""
    module = parse_hlo((DATA / "tf" / name).read_text())
    rng = np.random.default_rng(5)
    args = [random_value(p.shape, rng) for p in module.entry.parameters]
    with jax.enable_x64(True):
        outs = run_jitted(JaxOpEmitter(module).run_module, args)
    with np.errstate(all="ignore"):
        refs = evaluate(module, args)
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert_close(out, ref, 1e-4, f"{name} output {i}")


def test_64_bit_types_need_x64():
    module = parse_hlo("""HloModule w
ENTRY e {
  x = s32[3] parameter(0)
  ROOT c = s64[3] convert(x)
}
""")
    if jax.config.jax_enable_x64:
        pytest.skip("x64 is on")
    with pytest.raises(JaxEmitError, match=r"'c' \(convert\).*jax_enable_x64"):
        JaxOpEmitter(module).run_module([np.zeros(3, np.int32)])


# --- hand-written modules -----------------------------------------------------------------
def check_module(text: str, args: list, rtol: float = 1e-5) -> list:
    """run_module under jax.jit equals hlo_passes.evaluate on ``args``."""
    module = parse_hlo(text)
    outs = run_jitted(JaxOpEmitter(module).run_module, args)
    with np.errstate(all="ignore"):
        refs = evaluate(module, args)
    assert len(outs) == len(refs)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert_close(out, ref, rtol, f"output {i}")
    return [np.asarray(o) for o in outs]


RNG = np.random.default_rng(7)


def normal(*dims: int) -> np.ndarray:
    return RNG.standard_normal(dims).astype(np.float32)


ARGMAX = """HloModule argmax
argmax {
  av = f32[] parameter(0)
  ai = s32[] parameter(1)
  bv = f32[] parameter(2)
  bi = s32[] parameter(3)
  gt = pred[] compare(av, bv), direction=GT
  eq = pred[] compare(av, bv), direction=EQ
  lt_i = pred[] compare(ai, bi), direction=LT
  tie = pred[] and(eq, lt_i)
  keep = pred[] or(gt, tie)
  v = f32[] select(keep, av, bv)
  i = s32[] select(keep, ai, bi)
  ROOT r = (f32[], s32[]) tuple(v, i)
}
ENTRY e {
  x = f32[4,6] parameter(0)
  idx = s32[4,6] iota(), iota_dimension=1
  ninf = f32[] constant(-inf)
  zero = s32[] constant(0)
  ROOT r = (f32[4], s32[4]) reduce(x, idx, ninf, zero), dimensions={1}, to_apply=argmax
}
"""


def test_variadic_argmax_reduce():
    x = normal(4, 6)
    x[1, 4] = x[1, 1] = 9.0  # a tie: the lower index wins
    values, indices = check_module(ARGMAX, [x])
    np.testing.assert_array_equal(indices, np.argmax(x, axis=1))


def test_pad_negative_low_and_interior():
    text = """HloModule pad
ENTRY e {
  x = f32[3,4] parameter(0)
  v = f32[] constant(-1)
  ROOT p = f32[4,11] pad(x, v), padding=-1_0_1x2_-1_2
}
"""
    check_module(text, [normal(3, 4)])


def test_gather_index_vector_dim_first():
    text = """HloModule g
ENTRY e {
  x = f32[5,6] parameter(0)
  i = s32[2,3] parameter(1)
  ROOT g = f32[3,2,2] gather(x, i), offset_dims={1,2}, collapsed_slice_dims={}, start_index_map={0,1}, index_vector_dim=0, slice_sizes={2,2}
}
"""
    indices = np.array([[0, 4, 9], [1, 5, -2]], np.int32)  # out of range: clamped
    check_module(text, [normal(5, 6), indices])


def test_while_known_trip_count():
    text = """HloModule w
cond {
  s = (s32[], f32[4]) parameter(0)
  i = s32[] get-tuple-element(s), index=0
  n = s32[] constant(5)
  ROOT c = pred[] compare(i, n), direction=LT
}
body {
  s = (s32[], f32[4]) parameter(0)
  i = s32[] get-tuple-element(s), index=0
  x = f32[4] get-tuple-element(s), index=1
  one = s32[] constant(1)
  j = s32[] add(i, one)
  f = f32[] convert(j)
  b = f32[4] broadcast(f), dimensions={}
  y = f32[4] multiply(x, b)
  ROOT t = (s32[], f32[4]) tuple(j, y)
}
ENTRY e {
  x = f32[4] parameter(0)
  zero = s32[] constant(0)
  t = (s32[], f32[4]) tuple(zero, x)
  ROOT w = (s32[], f32[4]) while(t), condition=cond, body=body, backend_config={"known_trip_count":{"n":"5"}}
}
"""
    x = normal(4)
    count, y = check_module(text, [x])
    assert count == 5
    np.testing.assert_allclose(y, x * 120, rtol=1e-6)


SORTS = """HloModule s
gt_total {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  c = s32[] parameter(2)
  d = s32[] parameter(3)
  ROOT r = pred[] compare(a, b), direction=GT, type=TOTALORDER
}
by_abs {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  c = s32[] parameter(2)
  d = s32[] parameter(3)
  aa = f32[] abs(a)
  ab = f32[] abs(b)
  ROOT r = pred[] compare(aa, ab), direction=LT
}
second_desc {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  c = s32[] parameter(2)
  d = s32[] parameter(3)
  ROOT r = pred[] compare(c, d), direction=GT
}
ENTRY e {
  x = f32[3,7] parameter(0)
  y = f32[3,7] parameter(1)
  i = s32[3,7] iota(), iota_dimension=1
  s1 = (f32[3,7], s32[3,7]) sort(x, i), dimensions={1}, to_apply=gt_total
  s2 = (f32[3,7], s32[3,7]) sort(y, i), dimensions={1}, is_stable=true, to_apply=by_abs
  s3 = (f32[3,7], s32[3,7]) sort(x, i), dimensions={0}, is_stable=true, to_apply=second_desc
  ROOT t = ((f32[3,7], s32[3,7]), (f32[3,7], s32[3,7]), (f32[3,7], s32[3,7])) tuple(s1, s2, s3)
}
"""


def test_sorts_simple_and_custom_comparators():
    x = np.round(normal(3, 7))  # integers: many ties, which must keep their order
    x[0, :4] = [0.0, -0.0, np.nan, -np.nan]  # TOTALORDER: -NaN < -0 < +0 < NaN
    check_module(SORTS, [x, np.round(normal(3, 7))])


def test_jax_argsort_comparator_becomes_one_lax_sort():
    argsort = jax.jit(lambda v: jax.numpy.argsort(v, axis=1))
    text = argsort.lower(normal(3, 9)).as_text(dialect="hlo")
    x = np.round(normal(3, 9))
    x[0, :5] = [0.0, -0.0, np.nan, -np.nan, 0.0]  # jax's order: -0 == +0, NaNs last
    (out,) = check_module(text, [x])
    np.testing.assert_array_equal(out, np.asarray(jax.numpy.argsort(x, axis=1)))
    emitted = jax.jit(JaxOpEmitter(parse_hlo(text)).run_module).lower([x]).as_text(dialect="hlo")
    assert emitted.count(" sort(") == 1 and " gather(" not in emitted  # no sorting network


def test_scatter_with_non_binary_combiner_and_variadic():
    text = """HloModule sc
comb {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  m = f32[] multiply(a, b)
  ROOT r = f32[] add(m, b)
}
comb2 {
  a0 = f32[] parameter(0)
  a1 = s32[] parameter(1)
  b0 = f32[] parameter(2)
  b1 = s32[] parameter(3)
  s = f32[] add(a0, b0)
  m = s32[] maximum(a1, b1)
  ROOT r = (f32[], s32[]) tuple(s, m)
}
ENTRY e {
  x = f32[6,3] parameter(0)
  y = s32[6,3] parameter(1)
  i = s32[4,1] parameter(2)
  u = f32[4,3] parameter(3)
  v = s32[4,3] parameter(4)
  a = f32[6,3] scatter(x, i, u), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=comb
  b = (f32[6,3], s32[6,3]) scatter(x, y, i, u, v), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=comb2
  ROOT t = (f32[6,3], (f32[6,3], s32[6,3])) tuple(a, b)
}
"""
    indices = np.array([[1], [4], [1], [9]], np.int32)  # a repeat and an out-of-bounds window
    ints = RNG.integers(-5, 5, (6, 3)).astype(np.int32)
    check_module(text, [normal(6, 3), ints, indices, normal(4, 3),
                        RNG.integers(-5, 5, (4, 3)).astype(np.int32)])


def test_elementwise_corner_cases():
    text = """HloModule ew
ENTRY e {
  a = s32[8] parameter(0)
  b = s32[8] parameter(1)
  f = f32[8] parameter(2)
  g = f32[8] parameter(3)
  p = pred[8] parameter(4)
  div = s32[8] divide(a, b)
  rem = s32[8] remainder(a, b)
  pow = s32[8] power(a, b)
  shl = s32[8] shift-left(a, b)
  shr = s32[8] shift-right-logical(a, b)
  sra = s32[8] shift-right-arithmetic(a, b)
  ltu = pred[8] compare(a, b), direction=LT, type=UNSIGNED
  lto = pred[8] compare(f, g), direction=LT, type=TOTALORDER
  pc = s32[8] popcnt(a)
  padd = pred[8] add(p, p)
  fpow = f32[8] power(f, g)
  rem2 = f32[8] remainder(f, g)
  at = f32[8] atan2(f, g)
  cl = f32[8] clamp(g, f, g)
  bf = bf16[8] convert(f)
  back = f32[8] convert(bf)
  toi = s32[8] convert(f)
  tob = pred[8] convert(f)
  fromb = f32[8] convert(p)
  bits = s32[8] bitcast-convert(f)
  afz = f32[8] round-nearest-afz(f)
  rne = f32[8] round-nearest-even(f)
  lg = f32[8] logistic(f)
  em1 = f32[8] exponential-minus-one(f)
  l1p = f32[8] log-plus-one(f)
  ROOT t = (s32[8], s32[8], s32[8], s32[8], s32[8], s32[8], pred[8], pred[8], s32[8], pred[8],
            f32[8], f32[8], f32[8], f32[8], f32[8], s32[8], pred[8], f32[8], s32[8], f32[8],
            f32[8], f32[8], f32[8], f32[8]) tuple(div, rem, pow, shl, shr, sra, ltu, lto, pc, padd, fpow, rem2, at, cl, back, toi, tob, fromb, bits, afz, rne, lg, em1, l1p)
}
"""
    a = np.array([7, -7, -2147483648, 5, 0, 3, -1, 2], np.int32)
    b = np.array([2, 2, -1, 0, 3, 33, -3, 31], np.int32)
    f = np.array([0.5, -2.5, np.nan, -0.0, 1.5, 3e9, -1e-3, 2.0], np.float32)
    g = np.array([0.0, 2.0, 1.0, 0.0, -1.5, 2.0, 0.5, 3.0], np.float32)
    p = np.array([True, False, True, False, True, True, False, False])
    check_module(text, [a, b, f, g, p])


def test_data_movement_and_windows():
    text = """HloModule dm
""" + REDUCERS + """
ENTRY e {
  x = f32[2,3,8,8] parameter(0)
  k = f32[3,3,1,6] parameter(1)
  i = s32[] parameter(2)
  zero = f32[] constant(0)
  ninf = f32[] constant(-inf)
  rw = f32[2,3,4,4] reduce-window(x, ninf), window={size=1x1x3x3 stride=1x1x2x2 pad=0_0x0_0x1_1x1_1}, to_apply=max
  rw2 = f32[2,3,15,4] reduce-window(x, zero), window={size=1x1x2x2 stride=1x1x1x2 lhs_dilate=1x1x2x1 pad=0_0x0_0x1_0x0_0}, to_apply=add
  cv = f32[2,6,8,8] convolution(x, k), window={size=3x3 pad=1_1x1_1 rhs_reversal=0x1}, dim_labels=bf01_01io->bf01, feature_group_count=3
  ds = f32[2,3,4,8] dynamic-slice(x, i, i, i, i), dynamic_slice_sizes={2,3,4,8}
  rv = f32[2,3,8,8] reverse(x), dimensions={1,3}
  tr = f32[8,2,8,3] transpose(x), dimensions={3,0,2,1}
  sl = f32[1,3,3,4] slice(x), slice={[1:2], [0:3], [1:8:3], [0:8:2]}
  bc = f32[4,8,3] broadcast(k), dimensions={}
  ROOT t = (f32[2,3,4,4], f32[2,3,15,4], f32[2,6,8,8], f32[2,3,4,8], f32[2,3,8,8], f32[8,2,8,3], f32[1,3,3,4]) tuple(rw, rw2, cv, ds, rv, tr, sl)
}
"""
    text = text.replace("  bc = f32[4,8,3] broadcast(k), dimensions={}\n", "")
    check_module(text, [normal(2, 3, 8, 8), normal(3, 3, 1, 6), np.int32(-3)], rtol=1e-4)


def test_select_and_scatter():
    text = """HloModule ss
""" + REDUCERS + """
ge {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT r = pred[] compare(a, b), direction=GE
}
last_wins {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  m = f32[] multiply(a, b)
  ROOT r = f32[] add(m, b)
}
ENTRY e {
  x = f32[2,7,6] parameter(0)
  g = f32[2,3,3] parameter(1)
  h = f32[2,4,3] parameter(2)
  zero = f32[] constant(0)
  one = f32[] constant(1)
  a = f32[2,7,6] select-and-scatter(x, g, zero), window={size=1x3x2 stride=1x2x2}, select=ge, scatter=add
  b = f32[2,7,6] select-and-scatter(x, h, one), window={size=1x3x3 stride=1x2x2 pad=0_0x1_1x1_1}, select=ge, scatter=last_wins
  ROOT t = (f32[2,7,6], f32[2,7,6]) tuple(a, b)
}
"""
    x = np.round(normal(2, 7, 6))  # ties: the first element of the window wins
    check_module(text, [x, normal(2, 3, 3), normal(2, 4, 3)])


def test_conditional_map_and_bitcast():
    text = """HloModule cm
neg_branch {
  x = f32[4] parameter(0)
  ROOT n = f32[4] negate(x)
}
exp_branch {
  x = f32[4] parameter(0)
  ROOT n = f32[4] exponential(x)
}
sq {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT m = f32[] multiply(a, b)
}
ENTRY e {
  k = s32[] parameter(0)
  x = f32[4] parameter(1)
  y = f32[2,3] parameter(2)
  c = f32[4] conditional(k, x, x), branch_computations={neg_branch, exp_branch}
  m = f32[4] map(x, x), dimensions={0}, to_apply=sq
  t = f32[2,3]{0,1} copy(y)
  b = f32[3,2]{1,0} bitcast(t)
  ROOT r = (f32[4], f32[4], f32[3,2]) tuple(c, m, b)
}
"""
    for k in (0, 1, 7, -1):
        check_module(text, [np.int32(k), normal(4), normal(2, 3)])


def test_remaining_unary_ops_topk_fusion_and_pred_conditional():
    text = """HloModule rest
or_red {
  a = pred[] parameter(0)
  b = pred[] parameter(1)
  ROOT r = pred[] or(a, b)
}
fused {
  a = f32[6] parameter(0)
  b = f32[6] parameter(1)
  ROOT m = f32[6] multiply(a, b)
}
yes {
  x = f32[6] parameter(0)
  ROOT s = f32[6] sqrt(x)
}
no {
  x = f32[6] parameter(0)
  ROOT c = f32[6] cbrt(x)
}
ENTRY e {
  f = f32[6] parameter(0)
  n = s32[6] parameter(1)
  p = pred[] parameter(2)
  q = pred[2,6] parameter(3)
  fl = f32[6] floor(f)
  ce = f32[6] ceil(f)
  sg = f32[6] sign(f)
  ab = f32[6] abs(f)
  tn = f32[6] tan(f)
  fin = pred[6] is-finite(f)
  rp = f32[6] reduce-precision(f), exponent_bits=5, mantissa_bits=10
  cx = c64[6] complex(f, fl)
  re = f32[6] real(cx)
  im = f32[6] imag(cx)
  pc = s32[6] popcnt(n)
  cz = s32[6] count-leading-zeros(n)
  nt = s32[6] not(n)
  xo = s32[6] xor(n, pc)
  fa = pred[] constant(false)
  any = pred[6] reduce(q, fa), dimensions={0}, to_apply=or_red
  tk = (f32[3], s32[3]) topk(f), k=3, largest=true
  fu = f32[6] fusion(f, ce), kind=kLoop, calls=fused
  sh = f32[6] custom-call(fu), custom_call_target="Sharding", sharding={replicated}
  ob = f32[6] optimization-barrier(sh)
  cd = f32[6] conditional(p, ab, ab), true_computation=yes, false_computation=no
  ds = s32[] get-dimension-size(f), dimensions={0}
  ROOT t = (f32[6], f32[6], f32[6], f32[6], f32[6], pred[6], f32[6], f32[6], f32[6], s32[6],
            s32[6], s32[6], s32[6], pred[6], (f32[3], s32[3]), f32[6], f32[6], s32[]) tuple(fl, ce, sg, ab, tn, fin, rp, re, im, pc, cz, nt, xo, any, tk, ob, cd, ds)
}
"""
    f = np.array([1.5, -2.5, 0.0, np.inf, 7e4, -0.3], np.float32)
    n = np.array([0, -1, 7, 1 << 20, 255, -2147483648], np.int32)
    q = RNG.random((2, 6)) < 0.3
    for p in (True, False):
        check_module(text, [f, n, np.bool_(p), q])


def test_unsupported_opcode_raises():
    text = """HloModule u
ENTRY e {
  x = f32[4] parameter(0)
  ROOT r = f32[4] rng(x, x), distribution=rng_uniform
}
"""
    module = parse_hlo(text)
    with pytest.raises(JaxEmitError, match=r"'r' \(rng\)"):
        JaxOpEmitter(module).run_module([normal(4)])
