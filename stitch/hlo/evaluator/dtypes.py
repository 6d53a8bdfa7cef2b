"""HLO element types <-> numpy dtypes, and the dtype each element type computes in.

Low-precision floats (bf16, f16, the f8/f4 family) compute in float32 and are rounded back
to their own type after every operation, as XLA does. Everything else computes in itself.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ..errors import HloEvaluationError


def _ml(name: str):
    value = getattr(ml_dtypes, name, None)
    return None if value is None else np.dtype(value)


_TABLE: dict[str, np.dtype | None] = {
    "pred": np.dtype(np.bool_),
    "s8": np.dtype(np.int8), "s16": np.dtype(np.int16), "s32": np.dtype(np.int32),
    "s64": np.dtype(np.int64),
    "u8": np.dtype(np.uint8), "u16": np.dtype(np.uint16), "u32": np.dtype(np.uint32),
    "u64": np.dtype(np.uint64),
    "s4": _ml("int4"), "u4": _ml("uint4"), "s2": _ml("int2"), "u2": _ml("uint2"),
    "f16": np.dtype(np.float16), "bf16": _ml("bfloat16"),
    "f32": np.dtype(np.float32), "f64": np.dtype(np.float64),
    "c64": np.dtype(np.complex64), "c128": np.dtype(np.complex128),
    "f8e4m3fn": _ml("float8_e4m3fn"), "f8e5m2": _ml("float8_e5m2"),
    "f8e4m3fnuz": _ml("float8_e4m3fnuz"), "f8e5m2fnuz": _ml("float8_e5m2fnuz"),
    "f8e4m3b11fnuz": _ml("float8_e4m3b11fnuz"), "f8e4m3": _ml("float8_e4m3"),
    "f8e3m4": _ml("float8_e3m4"), "f4e2m1fn": _ml("float4_e2m1fn"),
    "f8e8m0fnu": _ml("float8_e8m0fnu"),
}

_BY_DTYPE: dict[np.dtype, str] = {dt: name for name, dt in _TABLE.items() if dt is not None}

FLOAT_TYPES = frozenset({"f16", "bf16", "f32", "f64", "f8e4m3fn", "f8e5m2", "f8e4m3fnuz",
                         "f8e5m2fnuz", "f8e4m3b11fnuz", "f8e4m3", "f8e3m4", "f4e2m1fn",
                         "f8e8m0fnu"})
LOW_PRECISION_FLOATS = FLOAT_TYPES - {"f32", "f64"}
SIGNED_TYPES = frozenset({"s2", "s4", "s8", "s16", "s32", "s64"})
UNSIGNED_TYPES = frozenset({"u2", "u4", "u8", "u16", "u32", "u64"})
SUB_BYTE_INTS = frozenset({"s2", "s4", "u2", "u4"})
COMPLEX_TYPES = frozenset({"c64", "c128"})

_FLOAT_DTYPES = frozenset(_TABLE[t] for t in FLOAT_TYPES if _TABLE[t] is not None)
_LOW_FLOAT_DTYPES = frozenset(_TABLE[t] for t in LOW_PRECISION_FLOATS if _TABLE[t] is not None)
_SUB_BYTE_DTYPES = frozenset(_TABLE[t] for t in SUB_BYTE_INTS if _TABLE[t] is not None)

# Bit widths of the element types that have one (for shifts, clz, bitcast-convert).
BIT_WIDTH: dict[str, int] = {
    "pred": 8, "s2": 2, "s4": 4, "s8": 8, "s16": 16, "s32": 32, "s64": 64,
    "u2": 2, "u4": 4, "u8": 8, "u16": 16, "u32": 32, "u64": 64,
    "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
    "f8e4m3fn": 8, "f8e5m2": 8, "f8e4m3fnuz": 8, "f8e5m2fnuz": 8, "f8e4m3b11fnuz": 8,
    "f8e4m3": 8, "f8e3m4": 8, "f4e2m1fn": 4, "f8e8m0fnu": 8,
}


def numpy_dtype(element_type: str) -> np.dtype:
    """The numpy dtype holding ``element_type`` values (HloEvaluationError if none)."""
    dt = _TABLE.get(element_type)
    if dt is None:
        raise HloEvaluationError(f"element type {element_type!r} has no numpy equivalent")
    return dt


def element_type_of(dtype: np.dtype) -> str:
    """Inverse of ``numpy_dtype`` (HloEvaluationError for dtypes HLO does not have)."""
    name = _BY_DTYPE.get(np.dtype(dtype))
    if name is None:
        raise HloEvaluationError(f"numpy dtype {np.dtype(dtype)} is not an HLO element type")
    return name


def is_float(dtype: np.dtype) -> bool:
    return np.dtype(dtype) in _FLOAT_DTYPES


def is_low_float(dtype: np.dtype) -> bool:
    return np.dtype(dtype) in _LOW_FLOAT_DTYPES


def is_complex(dtype: np.dtype) -> bool:
    return np.dtype(dtype).kind == "c"


def is_signed_int(dtype: np.dtype) -> bool:
    dt = np.dtype(dtype)
    return dt.kind == "i" or dt in (_TABLE["s4"], _TABLE["s2"])


def is_unsigned_int(dtype: np.dtype) -> bool:
    dt = np.dtype(dtype)
    return dt.kind == "u" or dt in (_TABLE["u4"], _TABLE["u2"])


def is_int(dtype: np.dtype) -> bool:
    return is_signed_int(dtype) or is_unsigned_int(dtype)


def is_pred(dtype: np.dtype) -> bool:
    return np.dtype(dtype) == np.bool_


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype arithmetic on ``dtype`` is done in: f32 for low-precision floats, int8/uint8
    for sub-byte ints, the type itself otherwise."""
    dt = np.dtype(dtype)
    if dt in _LOW_FLOAT_DTYPES:
        return np.dtype(np.float32)
    if dt in _SUB_BYTE_DTYPES:
        return np.dtype(np.int8) if is_signed_int(dt) else np.dtype(np.uint8)
    return dt


def bit_width(dtype: np.dtype) -> int:
    return BIT_WIDTH[element_type_of(dtype)]


def int_of_width(bits: int, signed: bool) -> np.dtype:
    """numpy integer dtype with ``bits`` bits (8..64)."""
    return np.dtype(f"{'i' if signed else 'u'}{bits // 8}")


def int_limits(dtype: np.dtype) -> tuple[int, int]:
    """(min, max) of an integer element type, sub-byte types included."""
    et = element_type_of(dtype)
    bits = BIT_WIDTH[et]
    if et in SIGNED_TYPES:
        return -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return 0, (1 << bits) - 1


def contiguous(value: object) -> np.ndarray:
    """A C-contiguous array of ``value``'s shape (``np.ascontiguousarray`` makes a scalar 1-d,
    and a view of it then has the wrong shape)."""
    return np.ascontiguousarray(value).reshape(np.shape(value))


def as_type(value: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``value`` cast to ``dtype`` (no copy when it already is), always an ndarray."""
    value = np.asarray(value)
    if value.dtype != dtype:
        value = value.astype(dtype)
    return value
