"""sort with an arbitrary comparator, and topk.

The comparator (2N scalar parameters: lhs/rhs of each operand) is only ever applied to whole
arrays: a bottom-up merge sort whose merges place every element by a vectorised binary search
in the other run, for all rows at once. Merges keep equal elements in order, so the result
is always stable (a valid result for ``is_stable=false`` too).
"""
from __future__ import annotations

import numpy as np

from ..errors import HloEvaluationError
from .dtypes import is_float
from .elementwise import total_order_key
from .registry import handles


def _run_search(x: np.ndarray, runs: np.ndarray, pred) -> np.ndarray:
    """For each x (rows, blocks, width): how many leading elements y of the sorted run in
    the same block satisfy ``pred(y, x)`` (true on a prefix of the run)."""
    rows, blocks, width = x.shape
    lo = np.zeros(x.shape, np.int64)
    hi = np.full(x.shape, width, np.int64)
    for _ in range(width.bit_length()):
        active = lo < hi
        if not active.any():
            break
        mid = (lo + hi) // 2
        cand = np.take_along_axis(runs, np.minimum(mid, width - 1), axis=2)
        ok = pred(cand.reshape(rows, -1), x.reshape(rows, -1)).reshape(x.shape)
        lo = np.where(active & ok, mid + 1, lo)
        hi = np.where(active & ~ok, mid, hi)
    return lo


def sort_order(ev, comp, keys: list[np.ndarray]) -> np.ndarray:
    """(rows, n) permutation that stably sorts each row of ``keys`` by comparator ``comp``."""
    rows, n = keys[0].shape
    if n <= 1:
        return np.zeros((rows, n), np.int64)
    size = 1 << (n - 1).bit_length()
    row_index = np.arange(rows)[:, None]

    def less(pa: np.ndarray, pb: np.ndarray) -> np.ndarray:
        """comp(element at pa, element at pb); positions >= n are +infinity sentinels."""
        ca, cb = np.minimum(pa, n - 1), np.minimum(pb, n - 1)
        args = []
        for key in keys:
            args += [key[row_index, ca], key[row_index, cb]]
        result = np.asarray(ev.apply(comp, args), bool)
        return np.where(pa >= n, False, np.where(pb >= n, True, result))

    order = np.broadcast_to(np.arange(size), (rows, size)).copy()
    width = 1
    while width < size:
        blocks = size // (2 * width)
        runs = order.reshape(rows, blocks, 2, width)
        left, right = runs[:, :, 0, :], runs[:, :, 1, :]
        before_left = _run_search(left, right, lambda cand, x: less(cand, x))
        before_right = _run_search(right, left, lambda cand, x: ~less(x, cand))
        position = np.arange(width)
        merged = np.empty((rows, blocks, 2 * width), np.int64)
        left_pos = position + before_left
        right_pos = position + before_right
        np.put_along_axis(merged, left_pos, left, axis=2)
        np.put_along_axis(merged, right_pos, right, axis=2)
        check = np.zeros((rows, blocks, 2 * width), np.int8)
        np.put_along_axis(check, left_pos, 1, axis=2)
        np.put_along_axis(check, right_pos, 1, axis=2)
        if not check.all():
            raise HloEvaluationError("the sort comparator is not a strict weak order")
        order = merged.reshape(rows, size)
        width *= 2
    return order[:, :n]


@handles("sort")
def sort(ev, inst, ops):
    arrays = [np.asarray(o) for o in ops]
    dim = inst.ints("dimensions")[0]
    moved = [np.moveaxis(a, dim, -1) for a in arrays]
    n = moved[0].shape[-1]
    rows = int(np.prod(moved[0].shape[:-1], dtype=np.int64))
    keys = [m.reshape(rows, n) for m in moved]
    order = sort_order(ev, inst.called_computations[0], keys)
    out = [np.moveaxis(np.take_along_axis(k, order, axis=1).reshape(m.shape), -1, dim)
           for k, m in zip(keys, moved)]
    return tuple(out) if inst.shape.is_tuple else out[0]


@handles("topk")
def topk(ev, inst, ops):
    """The k largest (or smallest) elements of the last dimension and their s32 indices;
    ties keep the lower index first; floats use the total order."""
    x = np.asarray(ops[0])
    k = inst.int("k")
    largest = inst.attrs.get("largest", "true") != "false"
    key = total_order_key(x).astype(np.int64) if is_float(x.dtype) else x.astype(np.int64)
    order = np.argsort(-key if largest else key, axis=-1, kind="stable")[..., :k]
    return (np.take_along_axis(x, order, axis=-1), order.astype(np.int32))


def topk_custom_call(ev, inst, ops):
    """custom-call TopK: the first k elements of the last dimension in the order of the
    comparator in ``called_computations`` (a "greater than"), with their s32 indices."""
    x = np.asarray(ops[0])
    comparator = inst.called_computations[0]
    k = inst.shape.tuple_shapes[0].dims[-1]
    n = x.shape[-1]
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    order = sort_order(ev, comparator, [x.reshape(rows, n)])[:, :k]
    values = np.take_along_axis(x.reshape(rows, n), order, axis=1)
    lead = x.shape[:-1]
    return values.reshape(lead + (k,)), order.astype(np.int32).reshape(lead + (k,))
