"""reduce (incl. variadic), reduce-window, select-and-scatter, and the helpers scatter uses.

Reducers that are a single add/multiply/maximum/minimum/and/or/xor of their two parameters
use numpy ufunc reductions in the compute dtype (bf16/f16 accumulate in f32 and round once
at the end, as XLA's CPU/GPU backends do after float normalisation). Any other reducer is
applied vectorised in a pairwise tree over the reduced elements (adjacent pairs, so only
associativity is assumed), then combined with the init value.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import HloEvaluationError
from ..ir import PadDim, WindowDim, parse_computation_list, parse_window
from .dtypes import as_type, compute_dtype
from .registry import handles
from .shape_ops import pad_array

_UFUNCS = {"add": np.add, "multiply": np.multiply, "maximum": np.maximum,
           "minimum": np.minimum, "and": np.bitwise_and, "or": np.bitwise_or,
           "xor": np.bitwise_xor}
_BOOL_UFUNCS = {"add": np.logical_or, "multiply": np.logical_and, "maximum": np.logical_or,
                "minimum": np.logical_and, "and": np.logical_and, "or": np.logical_or,
                "xor": np.logical_xor}


def ufunc_for(kind: str | None, dtype: np.dtype) -> np.ufunc | None:
    if kind is None:
        return None
    table = _BOOL_UFUNCS if np.dtype(dtype) == np.bool_ else _UFUNCS
    return table.get(kind)


def _as_list(value: object) -> list[np.ndarray]:
    return list(value) if isinstance(value, tuple) else [value]


def reduce_arrays(ev, comp, inputs: Sequence[np.ndarray], inits: Sequence[np.ndarray],
                  axes: Sequence[int]) -> list[np.ndarray]:
    """Reduce ``inputs`` over ``axes`` with reducer ``comp`` (2N parameters: N accumulators
    then N values) starting from ``inits``; returns N arrays."""
    inputs = [np.asarray(x) for x in inputs]
    inits = [np.asarray(v).reshape(()) for v in inits]
    axes = tuple(sorted(axes))
    n = len(inputs)
    kind = ev.binary_kind(comp) if n == 1 else None
    x = inputs[0]
    keep = [d for d in range(x.ndim) if d not in axes]
    out_shape = tuple(x.shape[d] for d in keep)
    count = int(np.prod([x.shape[d] for d in axes], dtype=np.int64))
    if count == 0:
        return [np.broadcast_to(v, out_shape) for v in inits]
    ufunc = ufunc_for(kind, x.dtype)
    if ufunc is not None:
        cdt = compute_dtype(x.dtype)
        reduced = ufunc.reduce(as_type(x, cdt), axis=axes, dtype=cdt) if axes else as_type(x, cdt)
        return [as_type(ufunc(as_type(inits[0], cdt), reduced), x.dtype)]
    if kind == "keep":
        return [np.broadcast_to(inits[0], out_shape)]
    values = [np.transpose(v, keep + list(axes)).reshape(out_shape + (count,)) for v in inputs]
    while count > 1:
        half = count // 2
        left = [v[..., 0:2 * half:2] for v in values]
        right = [v[..., 1:2 * half:2] for v in values]
        combined = _as_list(ev.apply(comp, left + right))
        if count % 2:
            combined = [np.concatenate([c, v[..., -1:]], axis=-1) for c, v in zip(combined, values)]
        values = combined
        count = half + count % 2
    final = _as_list(ev.apply(comp, list(inits) + [v[..., 0] for v in values]))
    return [np.broadcast_to(f, out_shape) for f in final]


@handles("reduce")
def reduce(ev, inst, ops):
    n = len(ops) // 2
    result = reduce_arrays(ev, inst.called_computations[0], ops[:n], ops[n:],
                           inst.ints("dimensions", ()))
    return tuple(result) if inst.shape.is_tuple else result[0]


def _window(inst, rank: int) -> tuple[WindowDim, ...]:
    if "window" not in inst.attrs:
        return tuple(WindowDim() for _ in range(rank))
    window = parse_window(inst.attrs["window"], rank)
    if len(window) != rank:
        raise HloEvaluationError(f"{inst.name}: window has {len(window)} dims, operand rank {rank}")
    return window


def window_slices(padded_shape: Sequence[int], window: Sequence[WindowDim]):
    """(output dims, [(window offset, slices selecting that offset for every output)])."""
    out_dims = []
    for size, w in zip(padded_shape, window):
        effective = (w.size - 1) * w.rhs_dilate + 1
        out_dims.append(max(0, (size - effective) // w.stride + 1) if size >= effective else 0)
    pieces = []
    if all(o > 0 for o in out_dims):
        for offset in np.ndindex(*[w.size for w in window]):
            pieces.append((offset, tuple(
                slice(k * w.rhs_dilate, k * w.rhs_dilate + (o - 1) * w.stride + 1, w.stride)
                for k, w, o in zip(offset, window, out_dims))))
    return tuple(out_dims), pieces


def _identity(kind: str | None, dtype: np.dtype) -> object | None:
    """The value that leaves ``kind``'s result unchanged, or None (no known identity)."""
    dtype = np.dtype(dtype)
    if kind is None or dtype.kind == "c" and kind in ("maximum", "minimum"):
        return None
    if dtype == np.bool_:
        return {"add": False, "or": False, "xor": False, "maximum": False,
                "multiply": True, "and": True, "minimum": True}.get(kind)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return {"add": 0, "or": 0, "xor": 0, "multiply": 1, "and": -1 if dtype.kind == "i"
                else info.max, "maximum": info.min, "minimum": info.max}.get(kind)
    return {"add": 0.0, "multiply": 1.0, "maximum": -np.inf, "minimum": np.inf}.get(kind)


@handles("reduce-window")
def reduce_window(ev, inst, ops):
    """Padding and base-dilation holes are not elements: each window reduces its real
    elements, starting once from the init value (as XLA does; padding with the init
    would apply a non-identity init once per padding element)."""
    n = len(ops) // 2
    inputs = [np.asarray(x) for x in ops[:n]]
    inits = [np.asarray(v).reshape(()) for v in ops[n:]]
    window = _window(inst, inputs[0].ndim)
    pads = [PadDim(w.pad_low, w.pad_high, w.lhs_dilate - 1) for w in window]
    comp = inst.called_computations[0]
    holes = any(p.low > 0 or p.high > 0 or p.interior > 0 for p in pads)
    fillers = [_identity(ev.binary_kind(comp), x.dtype) if n == 1 else None for x in inputs]
    if not holes or all(f is not None for f in fillers):
        padded = [pad_array(x, init if f is None else f, pads)
                  for x, init, f in zip(inputs, inits, fillers)]
        out_dims, pieces = window_slices(padded[0].shape, window)
        if not pieces:
            result = [np.broadcast_to(v, out_dims) for v in inits]
        else:
            stacked = [np.stack([p[sl] for _, sl in pieces], axis=-1) for p in padded]
            result = reduce_arrays(ev, comp, stacked, inits, (len(out_dims),))
        return tuple(result) if inst.shape.is_tuple else result[0]
    # A reducer without a known identity: fold the window positions in order, each one
    # only where it holds a real element.
    padded = [pad_array(x, init, pads) for x, init in zip(inputs, inits)]
    real = pad_array(np.ones(inputs[0].shape, np.bool_), False, pads)
    out_dims, pieces = window_slices(padded[0].shape, window)
    accs = [np.broadcast_to(v, out_dims).copy() for v in inits]
    for _, sl in pieces:
        new = _as_list(ev.apply(comp, accs + [p[sl] for p in padded]))
        accs = [np.where(real[sl], as_type(np.asarray(v), a.dtype), a) for v, a in zip(new, accs)]
    return tuple(accs) if inst.shape.is_tuple else accs[0]


def accumulate(ev, comp, outs: list[np.ndarray], index: np.ndarray,
               updates: list[np.ndarray]) -> None:
    """``outs[k][index[i]] = comp(outs..[index[i]], updates..[i])`` for every i in order
    (flat, writable ``outs``). Fast paths for assignment and single-op combiners."""
    if index.size == 0:
        return
    kind = ev.binary_kind(comp) if len(outs) == 1 else None
    if kind == "keep":
        return
    if kind == "assign":
        outs[0][index] = updates[0]
        return
    ufunc = ufunc_for(kind, outs[0].dtype)
    if ufunc is not None:
        try:
            ufunc.at(outs[0], index, as_type(updates[0], outs[0].dtype))
            return
        except TypeError:  # no ufunc loop for this dtype: use the general path
            pass
    remaining = np.arange(index.size)
    while remaining.size:
        _, first = np.unique(index[remaining], return_index=True)
        chosen = remaining[first]
        targets = index[chosen]
        new = _as_list(ev.apply(comp, [o[targets] for o in outs] + [u[chosen] for u in updates]))
        for out, value in zip(outs, new):
            out[targets] = value
        mask = np.ones(remaining.size, bool)
        mask[first] = False
        remaining = remaining[mask]


@handles("select-and-scatter")
def select_and_scatter(ev, inst, ops):
    operand, source, init = (np.asarray(v) for v in ops)
    select_comp = parse_computation_list(inst.attrs["select"])[0]
    scatter_comp = parse_computation_list(inst.attrs["scatter"])[0]
    window = _window(inst, operand.ndim)
    if any(w.pad_low < 0 or w.pad_high < 0 or w.lhs_dilate != 1 or w.rhs_dilate != 1 for w in window):
        raise HloEvaluationError(f"{inst.name}: select-and-scatter needs non-negative padding "
                                 "and no dilation")
    pads = [PadDim(w.pad_low, w.pad_high) for w in window]
    padded = pad_array(operand, np.zeros((), operand.dtype), pads)
    valid = pad_array(np.ones(operand.shape, bool), False, pads)
    flat_index = np.arange(padded.size).reshape(padded.shape)
    out_dims, pieces = window_slices(padded.shape, window)
    if tuple(out_dims) != source.shape:
        raise HloEvaluationError(f"{inst.name}: source shape {source.shape} does not match the "
                                 f"{tuple(out_dims)} windows")
    selected = chosen = have = None
    for _, sl in pieces:
        cand, cand_valid, cand_index = padded[sl], valid[sl], flat_index[sl]
        if selected is None:
            selected, chosen, have = cand, cand_index, cand_valid
            continue
        keep = np.asarray(ev.apply(select_comp, [selected, cand]), bool)
        take = cand_valid & (~have | ~keep)
        selected = np.where(take, cand, selected)
        chosen = np.where(take, cand_index, chosen)
        have = have | cand_valid
    out = np.full(padded.size, init.reshape(()), dtype=operand.dtype)
    if selected is not None:
        accumulate(ev, scatter_comp, [out], chosen[have].reshape(-1),
                   [source[have].reshape(-1)])
    out = out.reshape(padded.shape)
    crop = tuple(slice(p.low, p.low + n) for p, n in zip(pads, operand.shape))
    return out[crop]
