"""Data movement: broadcast, reshape, transpose, bitcast, copy, slice, concatenate, pad,
iota, reverse.

All of these work on logical (row-major) values; only ``bitcast`` looks at layouts, because
it reinterprets the physical buffer.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import HloEvaluationError
from ..ir import PadDim, Shape, parse_padding, parse_slice
from .dtypes import numpy_dtype
from .registry import handles


def _dtype(inst) -> np.dtype:
    return numpy_dtype(inst.shape.element_type)


@handles("broadcast")
def broadcast(ev, inst, ops):
    x = np.asarray(ops[0])
    dims = inst.ints("dimensions", ())
    out_dims = inst.shape.dims
    if len(dims) != x.ndim:
        raise HloEvaluationError(
            f"{inst.name}: broadcast maps {len(dims)} dims but the operand has rank {x.ndim}")
    order = sorted(range(len(dims)), key=lambda i: dims[i])
    x = np.transpose(x, order)
    expanded = [1] * len(out_dims)
    for i in order:
        expanded[dims[i]] = ops[0].shape[i]
    return np.broadcast_to(x.reshape(expanded), out_dims)


@handles("reshape")
def reshape(ev, inst, ops):
    return np.reshape(ops[0], inst.shape.dims)


@handles("transpose")
def transpose(ev, inst, ops):
    return np.transpose(ops[0], inst.ints("dimensions"))


@handles("copy")
def copy(ev, inst, ops):
    return ops[0]


def physical(x: np.ndarray, shape: Shape) -> np.ndarray:
    """The buffer of logical value ``x`` laid out by ``shape``'s layout, as a flat array."""
    major_to_minor = tuple(reversed(shape.minor_to_major()))
    if x.ndim != len(major_to_minor):
        major_to_minor = tuple(range(x.ndim))
    return np.ascontiguousarray(np.transpose(x, major_to_minor)).reshape(-1)


def logical(flat: np.ndarray, shape: Shape) -> np.ndarray:
    """Inverse of ``physical``: the logical value whose buffer under ``shape`` is ``flat``."""
    major_to_minor = tuple(reversed(shape.minor_to_major()))
    physical_dims = [shape.dims[d] for d in major_to_minor]
    return np.transpose(flat.reshape(physical_dims), np.argsort(major_to_minor))


@handles("bitcast")
def bitcast(ev, inst, ops):
    x = np.asarray(ops[0])
    src = ev.shape_of(inst.operands[0])
    flat = physical(x, src)
    dtype = _dtype(inst)
    if flat.dtype != dtype:
        if flat.nbytes != inst.shape.num_elements * dtype.itemsize:
            raise HloEvaluationError(
                f"{inst.name}: bitcast from {src} to {inst.shape} changes the byte size")
        flat = flat.view(dtype)
    if flat.size != inst.shape.num_elements:
        raise HloEvaluationError(
            f"{inst.name}: bitcast from {src} to {inst.shape} changes the number of elements")
    return logical(flat, inst.shape)


@handles("slice")
def slice_(ev, inst, ops):
    dims = parse_slice(inst.attrs["slice"])
    return ops[0][tuple(slice(d.start, d.limit, d.stride) for d in dims)]


@handles("concatenate")
def concatenate(ev, inst, ops):
    return np.concatenate([np.asarray(o) for o in ops], axis=inst.ints("dimensions")[0])


def pad_array(x: np.ndarray, value: object, pads: Sequence[PadDim]) -> np.ndarray:
    """XLA pad: interior padding between elements, then low/high edge padding (negative
    edge padding removes elements)."""
    x = np.asarray(x)
    if len(pads) != x.ndim:
        raise HloEvaluationError(f"padding has {len(pads)} dims but the operand has rank {x.ndim}")
    if all(p.low == 0 and p.high == 0 and p.interior == 0 for p in pads):
        return x
    sizes = []
    for n, p in zip(x.shape, pads):
        dilated = n + max(n - 1, 0) * p.interior
        sizes.append(max(p.low, 0) + dilated + max(p.high, 0))
    out = np.full(sizes, value, dtype=x.dtype)
    target = tuple(slice(max(p.low, 0), max(p.low, 0) + n + max(n - 1, 0) * p.interior,
                         p.interior + 1) for n, p in zip(x.shape, pads))
    out[target] = x
    crop = tuple(slice(max(-p.low, 0), size - max(-p.high, 0)) for size, p in zip(sizes, pads))
    out = out[crop]
    if any(s < 0 for s in out.shape):
        raise HloEvaluationError("padding removes more elements than the operand has")
    return out


def unpad_array(grad: np.ndarray, sizes: Sequence[int], pads: Sequence[PadDim]) -> np.ndarray:
    """Adjoint of ``pad_array`` (value 0): the elements of ``grad`` that came from the
    operand of shape ``sizes``; elements the padding cropped away get 0."""
    out = grad
    for axis, (n, p) in enumerate(zip(sizes, pads)):
        positions = p.low + np.arange(n) * (p.interior + 1)
        valid = (positions >= 0) & (positions < out.shape[axis])
        taken = np.take(out, np.clip(positions, 0, max(out.shape[axis] - 1, 0)), axis=axis) \
            if out.shape[axis] else np.zeros(out.shape[:axis] + (n,) + out.shape[axis + 1:], out.dtype)
        mask_shape = [1] * out.ndim
        mask_shape[axis] = n
        out = np.where(valid.reshape(mask_shape), taken, 0).astype(grad.dtype)
    return out


@handles("pad")
def pad(ev, inst, ops):
    return pad_array(ops[0], np.asarray(ops[1]).reshape(()), parse_padding(inst.attrs["padding"]))


@handles("iota")
def iota(ev, inst, ops):
    dims = inst.shape.dims
    axis = inst.int("iota_dimension")
    values = np.arange(dims[axis]).astype(_dtype(inst))
    shape = [1] * len(dims)
    shape[axis] = dims[axis]
    return np.broadcast_to(values.reshape(shape), dims)


@handles("reverse")
def reverse(ev, inst, ops):
    dims = inst.ints("dimensions", ())
    return np.flip(ops[0], axis=dims) if dims else ops[0]


@handles("get-dimension-size")
def get_dimension_size(ev, inst, ops):
    dim = int(inst.attrs["dimensions"].strip("{} "))
    return np.asarray(np.asarray(ops[0]).shape[dim])
