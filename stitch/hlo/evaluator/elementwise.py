"""Elementwise opcodes: arithmetic, math functions, bit ops, compare/select/clamp, convert.

Every handler works on operands that numpy can broadcast (scalar computations run on whole
arrays, see interpreter). Arithmetic is done in ``compute_dtype`` (f32 for bf16/f16/f8) and
rounded to the instruction's element type after each op.

Integer corner cases follow XLA: ``x / 0`` is -1 for signed and all-ones for unsigned types,
``INT_MIN / -1`` is INT_MIN, ``x % 0`` is x, ``INT_MIN % -1`` is 0; shifts by at least the
bit width give 0 (or the sign fill for arithmetic right shifts); integer ``power`` with a
negative exponent is 1 for base 1, +-1 for base -1 and 0 otherwise.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from ..errors import HloEvaluationError, UnsupportedOpcodeError
from .dtypes import (as_type, bit_width, contiguous, compute_dtype, int_limits, int_of_width, is_complex,
                     is_float, is_int, is_signed_int, numpy_dtype)
from .registry import handles



@functools.lru_cache(maxsize=1)
def _scipy_erf():
    """scipy's vectorised erf (accurate), or None without scipy. Imported on first use:
    scipy.special costs 0.2 s to import, and most modules evaluated have no erf."""
    try:
        from scipy.special import erf
    except ImportError:  # pragma: no cover - depends on the environment
        return None
    return erf


def out_dtype(inst) -> np.dtype:
    return numpy_dtype(inst.shape.element_type)


def _cast_in(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    return as_type(x, compute_dtype(x.dtype))


# --- unary -----------------------------------------------------------------------------
def _logistic(x: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype, copy=False)


def _erf_float64(x: np.ndarray) -> np.ndarray:
    """erf in float64 without scipy: Taylor series for |x| <= 3, continued fraction above."""
    x = np.asarray(x, np.float64)
    out = np.empty_like(x)
    ax = np.abs(x)
    small = ax <= 3.0
    xs = x[small]
    term = xs.copy()
    total = xs.copy()
    x2 = xs * xs
    for n in range(1, 80):  # sum (-1)^n x^(2n+1) / (n! (2n+1))
        term = term * (-x2) / n
        total += term / (2 * n + 1)
    out[small] = total * (2 / math.sqrt(math.pi))
    xl = ax[~small]
    # erfc(x) = exp(-x^2)/sqrt(pi) * 1/(x + 1/2/(x + 1/(x + 3/2/(x + ...)))), evaluated bottom up
    frac = np.zeros_like(xl)
    for k in range(60, 0, -1):
        frac = (k / 2) / (xl + frac)
    erfc = np.exp(-xl * xl) / math.sqrt(math.pi) / (xl + frac)
    out[~small] = np.sign(x[~small]) * (1 - erfc)
    out[np.isnan(x)] = np.nan
    return out


def _erf(x: np.ndarray) -> np.ndarray:
    erf = _scipy_erf()
    if erf is not None:
        return np.asarray(erf(x)).astype(x.dtype, copy=False)
    return _erf_float64(x).astype(x.dtype, copy=False)


def _round_afz(x: np.ndarray) -> np.ndarray:
    t = np.trunc(x)
    frac = x - t  # exact
    return t + np.where(np.abs(frac) >= 0.5, np.copysign(np.ones_like(x), x), 0).astype(x.dtype)


def _sign(x: np.ndarray) -> np.ndarray:
    if is_complex(x.dtype):
        mag = np.abs(x)
        return np.where(mag == 0, 0, x / np.where(mag == 0, 1, mag)).astype(x.dtype)
    if x.dtype == np.bool_:
        return x
    return np.sign(x)


def _rsqrt(x: np.ndarray) -> np.ndarray:
    return (1 / np.sqrt(x)).astype(x.dtype, copy=False)


_FLOAT_UNARY = {
    "exponential": np.exp, "exponential-minus-one": np.expm1, "log": np.log,
    "log-plus-one": np.log1p, "logistic": _logistic, "tanh": np.tanh, "erf": _erf,
    "sqrt": np.sqrt, "rsqrt": _rsqrt, "cbrt": np.cbrt, "sine": np.sin, "cosine": np.cos,
    "tan": np.tan, "floor": np.floor, "ceil": np.ceil, "round-nearest-afz": _round_afz,
    "round-nearest-even": np.rint, "abs": np.abs, "negate": np.negative, "sign": _sign,
}


@handles(*_FLOAT_UNARY, elementwise=True)
def unary(ev, inst, ops):
    x = _cast_in(ops[0])
    if inst.opcode in ("erf", "logistic", "cbrt", "floor", "ceil", "round-nearest-afz",
                       "round-nearest-even") and is_complex(x.dtype):
        raise HloEvaluationError(f"{inst.opcode} is not defined for complex values")
    return as_type(_FLOAT_UNARY[inst.opcode](x), out_dtype(inst))


@handles("is-finite", elementwise=True)
def is_finite(ev, inst, ops):
    return np.isfinite(_cast_in(ops[0]))


@handles("not", elementwise=True)
def not_(ev, inst, ops):
    x = _cast_in(ops[0])
    return as_type(np.logical_not(x) if x.dtype == np.bool_ else np.invert(x), out_dtype(inst))


@handles("real", "imag", elementwise=True)
def real_imag(ev, inst, ops):
    x = np.asarray(ops[0])
    part = np.real(x) if inst.opcode == "real" else np.imag(x)
    return as_type(part, out_dtype(inst))


@handles("popcnt", elementwise=True)
def popcnt(ev, inst, ops):
    x = np.asarray(ops[0])
    bits = bit_width(x.dtype)
    u = _unsigned_view(x)
    if bits < 8:
        u = u & ((1 << bits) - 1)
    return as_type(_bit_count(u), out_dtype(inst))


def _bit_count(u: np.ndarray) -> np.ndarray:
    if hasattr(np, "bitwise_count"):  # numpy >= 2.0
        return np.bitwise_count(u)
    count = np.zeros(u.shape, np.int64)
    for _ in range(u.dtype.itemsize * 8):
        count += (u & u.dtype.type(1)).astype(np.int64)
        u = u >> u.dtype.type(1)
    return count


@handles("count-leading-zeros", elementwise=True)
def count_leading_zeros(ev, inst, ops):
    x = np.asarray(ops[0])
    width = bit_width(x.dtype)
    u = _unsigned_view(x)
    if width < 8:
        u = u & ((1 << width) - 1)
    length = np.zeros(u.shape, np.int64)
    shift = max(int(u.dtype.itemsize) * 8, 8) // 2
    while shift >= 1:
        top = u >> u.dtype.type(shift)
        moved = top != 0
        length += np.where(moved, shift, 0)
        u = np.where(moved, top, u)
        shift //= 2
    length += (u != 0)
    return as_type(width - length, out_dtype(inst))


def _unsigned_view(x: np.ndarray) -> np.ndarray:
    """Integers/preds reinterpreted as unsigned ints of the same storage width."""
    x = contiguous(x)
    if x.dtype == np.bool_:
        return x.astype(np.uint8)
    if is_int(x.dtype) and x.dtype.kind not in "iu":  # ml_dtypes sub-byte ints
        return x.astype(np.int8).view(np.uint8) if is_signed_int(x.dtype) else x.astype(np.uint8)
    return x.view(int_of_width(x.dtype.itemsize * 8, False))


# --- binary arithmetic -------------------------------------------------------------------
def _int_divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    zero = b == 0
    if is_signed_int(a.dtype):
        lo, _ = int_limits(a.dtype)
        overflow = (a == lo) & (b == -1)
        safe = np.where(zero | overflow, 1, b).astype(a.dtype)
        q = a // safe
        r = a - q * safe
        q = q + ((r != 0) & ((a < 0) != (safe < 0))).astype(a.dtype)
        q = np.where(overflow, a, q)
        return np.where(zero, a.dtype.type(-1), q).astype(a.dtype)
    safe = np.where(zero, 1, b).astype(a.dtype)
    return np.where(zero, np.iinfo(a.dtype).max, a // safe).astype(a.dtype)


def _int_remainder(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    zero = b == 0
    safe = np.where(zero, 1, b).astype(a.dtype)
    if is_signed_int(a.dtype):
        safe = np.where(safe == -1, 1, safe).astype(a.dtype)  # x % -1 == 0, avoids INT_MIN % -1
    return np.where(zero, a, np.fmod(a, safe)).astype(a.dtype)


def _int_power(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.broadcast_arrays(a, b)
    dtype = a.dtype
    result = np.ones(a.shape, dtype)
    base = a.copy()
    exp = np.where(b < 0, 0, b).astype(dtype) if is_signed_int(dtype) else b.astype(dtype)
    one = dtype.type(1)
    while np.any(exp != 0):
        result = np.where((exp & one) != 0, result * base, result)
        base = base * base
        exp = exp >> one
    if is_signed_int(dtype):
        negative = np.where(a == 1, 1, np.where(a == -1, np.where((b & one) != 0, -1, 1), 0))
        result = np.where(b < 0, negative, result).astype(dtype)
    return result


def _complex_divide(a, b):
    """numpy's quotient, with the NaNs that should be infinities or zeros recovered as
    C99 (Annex G) and XLA do: x/0 is an infinity, inf/finite an infinity, finite/inf a zero."""
    q = np.asarray(np.divide(a, b))
    bad = np.isnan(q.real) & np.isnan(q.imag)
    if not bad.any():
        return q
    a, b = np.broadcast_to(a, q.shape), np.broadcast_to(b, q.shape)
    x, y, c, d = a.real, a.imag, b.real, b.imag
    part = x.dtype.type
    re_, im = q.real.copy(), q.imag.copy()
    a_nan = np.isnan(x) | np.isnan(y)
    zero_den = bad & (c == 0) & (d == 0) & ~a_nan
    inf = np.copysign(part(np.inf), c)
    re_ = np.where(zero_den, inf * x, re_)
    im = np.where(zero_den, inf * y, im)
    a_inf = bad & ~zero_den & (np.isinf(x) | np.isinf(y)) & np.isfinite(c) & np.isfinite(d)
    xs = np.copysign(np.where(np.isinf(x), part(1), part(0)), x)
    ys = np.copysign(np.where(np.isinf(y), part(1), part(0)), y)
    re_ = np.where(a_inf, part(np.inf) * (xs * c + ys * d), re_)
    im = np.where(a_inf, part(np.inf) * (ys * c - xs * d), im)
    b_inf = bad & ~zero_den & ~a_inf & (np.isinf(c) | np.isinf(d)) & np.isfinite(x) & np.isfinite(y)
    cs = np.copysign(np.where(np.isinf(c), part(1), part(0)), c)
    ds = np.copysign(np.where(np.isinf(d), part(1), part(0)), d)
    re_ = np.where(b_inf, part(0) * (x * cs + y * ds), re_)
    im = np.where(b_inf, part(0) * (y * cs - x * ds), im)
    return _complex(re_, im, q.dtype)


def _complex(real, imag, dtype):
    out = np.empty(np.shape(real), dtype)
    out.real, out.imag = real, imag
    return out


def _divide(a, b):
    if is_int(a.dtype):
        return _int_divide(a, b)
    if np.dtype(a.dtype).kind == "c":
        return _complex_divide(a, b)
    return np.divide(a, b)


def _remainder(a, b):
    return _int_remainder(a, b) if is_int(a.dtype) else np.fmod(a, b)


def _power(a, b):
    return _int_power(a, b) if is_int(a.dtype) else np.power(a, b)


def _logical(int_fn, bool_fn):
    def fn(a, b):
        return bool_fn(a, b) if a.dtype == np.bool_ else int_fn(a, b)
    return fn


_BINARY = {
    "add": np.add, "subtract": np.subtract, "multiply": np.multiply, "divide": _divide,
    "remainder": _remainder, "maximum": np.maximum, "minimum": np.minimum, "power": _power,
    "atan2": np.arctan2,
    "and": _logical(np.bitwise_and, np.logical_and), "or": _logical(np.bitwise_or, np.logical_or),
    "xor": _logical(np.bitwise_xor, np.logical_xor),
}


@handles(*_BINARY, elementwise=True)
def binary(ev, inst, ops):
    a, b = _cast_in(ops[0]), _cast_in(ops[1])
    if a.dtype != b.dtype:
        b = b.astype(a.dtype)
    if a.dtype == np.bool_ and inst.opcode in ("add", "subtract", "multiply", "divide"):
        a, b = a.astype(np.uint8), b.astype(np.uint8)
    return as_type(_BINARY[inst.opcode](a, b), out_dtype(inst))


@handles("shift-left", "shift-right-logical", "shift-right-arithmetic", elementwise=True)
def shift(ev, inst, ops):
    a = np.asarray(ops[0])
    dtype = a.dtype
    width = bit_width(dtype)
    amount = _unsigned_view(np.asarray(ops[1])).astype(np.uint64)
    in_range = amount < width
    safe = np.where(in_range, amount, 0)
    store = compute_dtype(dtype)
    a = as_type(a, store)
    signed = int_of_width(store.itemsize * 8, True)
    unsigned = int_of_width(store.itemsize * 8, False)
    if inst.opcode == "shift-left":
        value = np.left_shift(a.view(unsigned), safe.astype(unsigned)).view(store)
        result = np.where(in_range, value, 0)
    elif inst.opcode == "shift-right-logical":
        u = a.view(unsigned)
        if width < 8:
            u = u & unsigned.type((1 << width) - 1)
        result = np.where(in_range, np.right_shift(u, safe.astype(unsigned)), 0).astype(unsigned).view(store)
    else:
        s = a.view(signed)
        if width < 8 and not is_signed_int(dtype):  # sign-extend a sub-byte unsigned value
            s = ((s << (8 - width)).astype(signed) >> (8 - width)).astype(signed)
        fill = np.where(s < 0, -1, 0).astype(signed)
        result = np.where(in_range, np.right_shift(s, safe.astype(signed)), fill).astype(signed).view(store)
    return as_type(result, out_dtype(inst))


# --- compare / select / clamp ------------------------------------------------------------
def total_order_key(x: np.ndarray) -> np.ndarray:
    """Integers ordering floats as -NaN < -inf < ... < -0 < +0 < ... < inf < +NaN."""
    x = contiguous(x)
    if is_complex(x.dtype):
        raise HloEvaluationError("TOTALORDER compare is not defined for complex values")
    signed = int_of_width(x.dtype.itemsize * 8, True)
    bits = x.view(signed)
    width = bit_width(x.dtype)
    if width < x.dtype.itemsize * 8:  # f4 stored in a byte
        bits = (bits << (8 - width)).astype(signed)
    return np.where(bits < 0, bits ^ np.iinfo(signed).max, bits)


_COMPARE = {"EQ": np.equal, "NE": np.not_equal, "LT": np.less, "LE": np.less_equal,
            "GT": np.greater, "GE": np.greater_equal}


@handles("compare", elementwise=True)
def compare(ev, inst, ops):
    a, b = np.asarray(ops[0]), np.asarray(ops[1])
    direction = inst.string("direction")
    kind = inst.string("type", "")
    fn = _COMPARE.get(direction)
    if fn is None:
        raise HloEvaluationError(f"{inst.name}: unknown compare direction {direction!r}")
    if is_float(a.dtype) and kind == "TOTALORDER":
        a, b = total_order_key(a), total_order_key(np.asarray(b, a.dtype))
    elif kind == "UNSIGNED" and is_signed_int(a.dtype):
        a, b = _unsigned_view(a), _unsigned_view(np.asarray(b, a.dtype))
    elif kind == "SIGNED" and is_int(a.dtype) and not is_signed_int(a.dtype):
        width = a.dtype.itemsize * 8
        a = _unsigned_view(a).view(int_of_width(width, True))
        b = _unsigned_view(np.asarray(b, ops[0].dtype)).view(int_of_width(width, True))
    else:
        a, b = _cast_in(a), _cast_in(b)
    return fn(a, b)


@handles("select", elementwise=True)
def select(ev, inst, ops):
    return as_type(np.where(np.asarray(ops[0], bool), ops[1], ops[2]), out_dtype(inst))


@handles("clamp", elementwise=True)
def clamp(ev, inst, ops):
    lo, x, hi = (_cast_in(v) for v in ops)
    return as_type(np.minimum(np.maximum(x, lo.astype(x.dtype)), hi.astype(x.dtype)), out_dtype(inst))


@handles("complex", elementwise=True)
def make_complex(ev, inst, ops):
    dtype = out_dtype(inst)
    real = np.asarray(ops[0])
    imag = np.asarray(ops[1])
    out = np.empty(np.broadcast_shapes(real.shape, imag.shape), dtype)
    out.real = real
    out.imag = imag
    return out


# --- conversions ------------------------------------------------------------------------
def convert_array(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """XLA ``convert``: float->int truncates toward zero, saturates, NaN -> 0; ->pred is !=0;
    complex->real keeps the real part."""
    x = np.asarray(x)
    if x.dtype == dtype:
        return x
    if dtype == np.bool_:
        return x != 0
    if is_complex(x.dtype) and not is_complex(dtype):
        x = np.real(x)
    if is_int(dtype) and (is_float(x.dtype) or x.dtype.kind == "f"):
        f = np.trunc(x.astype(np.float64))
        lo, hi = int_limits(dtype)
        wide = np.int64 if is_signed_int(dtype) else np.uint64
        f = np.where(np.isnan(f), 0.0, f)
        low, high = f <= float(lo), f >= float(hi)
        middle = np.where(low | high, 0.0, f).astype(wide)
        result = np.where(high, wide(hi), np.where(low, wide(lo), middle))
        return result.astype(wide).astype(dtype)
    if is_int(dtype) and x.dtype == np.bool_:
        return x.astype(np.uint8).astype(dtype)
    return x.astype(dtype)


@handles("convert", elementwise=True)
def convert(ev, inst, ops):
    return convert_array(ops[0], out_dtype(inst))


@handles("bitcast-convert", elementwise=True)
def bitcast_convert(ev, inst, ops):
    x = contiguous(ops[0])
    dtype = out_dtype(inst)
    src_bits = bit_width(x.dtype)
    dst_bits = bit_width(dtype)
    if src_bits < 8 or dst_bits < 8:
        raise UnsupportedOpcodeError("bitcast-convert (sub-byte types)", inst.name)
    if src_bits == dst_bits:
        return x.view(dtype)
    if ev.vectorized:
        raise HloEvaluationError(f"{inst.name}: a width-changing bitcast-convert is not elementwise")
    if src_bits > dst_bits:  # one more minor dimension of src/dst elements
        return x.reshape(x.shape + (1,)).view(dtype).reshape(inst.shape.dims)
    return x.view(dtype).reshape(inst.shape.dims)  # the last dim (ratio) collapses


# (exponent bits, mantissa bits) of the types reduce-precision rounds through their own bits.
_FLOAT_LAYOUT = {np.dtype(np.float32): (8, 23, np.uint32), np.dtype(np.float64): (11, 52, np.uint64)}


def reduce_precision_array(x: np.ndarray, exponent_bits: int, mantissa_bits: int) -> np.ndarray:
    """Round ``x`` to a float format with the given exponent/mantissa bits (RNE on the
    mantissa, overflow to inf, values below the smallest normal flushed to signed zero)."""
    dtype = x.dtype
    work = x if dtype in _FLOAT_LAYOUT else x.astype(np.float32)
    src_exp, src_mant, utype = _FLOAT_LAYOUT[work.dtype]
    bits = contiguous(work).view(utype).copy()
    u = utype
    if mantissa_bits < src_mant:
        drop = src_mant - mantissa_bits
        last_bit = u(1) << u(drop)
        half_minus_one = (last_bit >> u(1)) - u(1)
        bias = ((bits >> u(drop)) & u(1)) + half_minus_one
        bits = (bits + bias) & ~(last_bit - u(1))
    if exponent_bits < src_exp:
        exp_mask = u(((1 << src_exp) - 1) << src_mant)
        sign_mask = u(1) << u(src_exp + src_mant)
        src_bias = (1 << (src_exp - 1)) - 1
        reduced_bias = (1 << (exponent_bits - 1)) - 1
        max_exp = u((src_bias + reduced_bias) << src_mant)
        min_exp = u((src_bias - reduced_bias) << src_mant)
        exponent = bits & exp_mask
        signed_zero = bits & sign_mask
        bits = np.where(exponent > max_exp, signed_zero | exp_mask,
                        np.where(exponent <= min_exp, signed_zero, bits)).astype(utype)
    result = bits.view(work.dtype)
    result = np.where(np.isnan(work), work, result)
    return result.astype(dtype, copy=False)


@handles("reduce-precision", elementwise=True)
def reduce_precision(ev, inst, ops):
    x = np.asarray(ops[0])
    if not is_float(x.dtype):
        raise HloEvaluationError(f"{inst.name}: reduce-precision needs a float operand")
    return reduce_precision_array(x, inst.int("exponent_bits"), inst.int("mantissa_bits"))


@handles("map", elementwise=True)
def map_(ev, inst, ops):
    return ev.apply(inst.called_computations[0], ops)
