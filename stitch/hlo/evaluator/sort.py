"""sort with an arbitrary comparator, and topk.

The comparator (2N scalar parameters: lhs/rhs of each operand) is only ever applied to whole
arrays: a bottom-up merge sort whose merges place every element by a vectorised binary search
in the other run, for all rows at once. Merges keep equal elements in order, so the result
is always stable (a valid result for ``is_stable=false`` too).

Most comparators are one ``compare`` (LT or GT) of the same elementwise function of one
operand's lhs and rhs (jax's: NaNs and -0 canonicalized, then a TOTALORDER LT): those are
sorted by numpy's stable argsort of that function's values (``key_order``), the same
permutation the merge sort gives, in milliseconds instead of tens of seconds for a
[64, 8732] sort. A float compare without TOTALORDER takes that path only where the keys
hold no NaN (the comparator is then no strict weak order, and the merge sort decides).
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np

from ..errors import HloEvaluationError
from ..ir import Computation, Instruction
from .dtypes import is_float, is_pred
from .elementwise import total_order_key
from .registry import handles

log = logging.getLogger(__name__)
# Past this many elements a merge sort (its comparator applied ~log2(n)^2 times to every
# element) takes seconds to minutes: said once per sort.
SLOW_MERGE_ELEMENTS = 1 << 16


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


@dataclasses.dataclass(frozen=True)
class KeyCompare:
    """A comparator that is ``compare(f(lhs_k), f(rhs_k))``: operand ``k``, ``f`` as a
    one-parameter computation, descending for GT, ``total`` for TOTALORDER."""
    operand: int
    key: Computation
    descending: bool
    total: bool


def key_compare(comp: Computation) -> KeyCompare | None:
    """The comparator as a ``KeyCompare``, or None when it is anything else."""
    by_name = {i.name: i for i in comp.instructions}
    root = comp.root
    direction = root.attrs.get("direction")
    if root.opcode != "compare" or direction not in ("LT", "GT") or len(root.operands) != 2:
        return None
    lhs, rhs = (by_name.get(o) for o in root.operands)
    if lhs is None or rhs is None:
        return None
    params: dict[str, int] = {}
    if not _mirrored(lhs, rhs, by_name, params, set()):
        return None
    p_lhs, p_rhs = params.get("lhs"), params.get("rhs")
    if p_lhs is None or p_rhs is None or {p_lhs, p_rhs} != {2 * (p_lhs // 2),
                                                           2 * (p_lhs // 2) + 1}:
        return None
    descending = (direction == "GT") != (p_lhs > p_rhs)    # compare(rhs, lhs) flips it
    side = lhs if p_lhs < p_rhs else rhs
    key = _side_computation(comp, side, by_name)
    return KeyCompare(p_lhs // 2, key, descending, root.attrs.get("type") == "TOTALORDER")


def _mirrored(a: Instruction, b: Instruction, by_name: dict[str, Instruction],
              params: dict[str, int], seen: set[tuple[str, str]]) -> bool:
    """Whether ``a`` and ``b`` compute the same function, of one parameter each."""
    if (a.name, b.name) in seen:
        return True
    seen.add((a.name, b.name))
    if a.opcode == "parameter" or b.opcode == "parameter":
        if a.opcode != b.opcode or a.shape != b.shape:
            return False
        return (params.setdefault("lhs", a.parameter_number) == a.parameter_number
                and params.setdefault("rhs", b.parameter_number) == b.parameter_number)
    if (a.opcode != b.opcode or a.shape != b.shape or a.attrs != b.attrs
            or a.literal != b.literal or len(a.operands) != len(b.operands)
            or a.opcode in ("call", "fusion", "map", "rng", "custom-call")):
        return False
    for x, y in zip(a.operands, b.operands):
        if x == y and _constant_tree(by_name.get(x), by_name):
            continue                      # one shared constant on both sides
        xa, yb = by_name.get(x), by_name.get(y)
        if xa is None or yb is None or not _mirrored(xa, yb, by_name, params, seen):
            return False
    return True


def _constant_tree(inst: Instruction | None, by_name: dict[str, Instruction]) -> bool:
    if inst is None or inst.opcode == "parameter":
        return False
    return all(_constant_tree(by_name.get(o), by_name) for o in inst.operands) and \
        inst.opcode not in ("rng", "custom-call", "call", "fusion", "map")


def _side_computation(comp: Computation, side: Instruction,
                      by_name: dict[str, Instruction]) -> Computation:
    """``side``'s expression as a computation of one parameter (number 0)."""
    needed, stack = set(), [side.name]
    while stack:
        name = stack.pop()
        if name not in needed:
            needed.add(name)
            stack.extend(by_name[name].operands)
    insts = [dataclasses.replace(i, is_root=i.name == side.name,
                                 parameter_number=0 if i.opcode == "parameter" else None)
             for i in comp.instructions if i.name in needed]
    return Computation(f"{comp.name}.sort_key", insts)


def key_order(ev, compare: KeyCompare, keys: list[np.ndarray]) -> np.ndarray | None:
    """The stable permutation for a ``KeyCompare`` comparator by numpy's argsort; None where
    it does not apply (a plain float compare meeting a NaN)."""
    values = np.asarray(ev.apply(compare.key, [keys[compare.operand]]))
    if is_float(values.dtype):
        if compare.total:
            values = total_order_key(values).astype(np.int64)
        elif np.isnan(values.astype(np.float64)).any():
            return None
        else:
            values = values.astype(np.float64)
    elif is_pred(values.dtype):
        values = values.astype(np.int8)
    elif values.dtype.kind not in "iu":
        return None
    if compare.descending:
        # Exact reversals: ~k for integers (no overflow), -x for NaN-free floats.
        values = -values if values.dtype.kind == "f" else ~values
    return np.argsort(values, axis=1, kind="stable")


def sort_order(ev, comp, keys: list[np.ndarray]) -> np.ndarray:
    """(rows, n) permutation that stably sorts each row of ``keys`` by comparator ``comp``."""
    rows, n = keys[0].shape
    if n <= 1:
        return np.zeros((rows, n), np.int64)
    compare = key_compare(ev.computation(comp))
    if compare is not None:
        order = key_order(ev, compare, keys)
        if order is not None:
            return order
    if rows * n >= SLOW_MERGE_ELEMENTS:
        log.info("sort of %d x %d by comparator %s: %s; the merge sort applies it "
                 "(slow at this size)", rows, n, ev.computation(comp).name,
                 "a plain float compare meets a NaN" if compare is not None
                 else "not one compare of one operand's keys")
    return merge_sort_order(ev, comp, keys)


def merge_sort_order(ev, comp, keys: list[np.ndarray]) -> np.ndarray:
    """``sort_order`` for any comparator: the vectorised merge sort (module docstring)."""
    rows, n = keys[0].shape
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
