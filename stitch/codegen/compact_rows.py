"""Row ids of values too large to hold in full, for the row-layout proof of ``lower.py``.

The proof pushes every element's row id (-1: row-independent) through a kernel part on
index arrays. A value of more elements than the proof holds in full (the cross-entropy's
f32[4096, 32000] logits: 131M) is kept *compact*: an array of the value's rank whose
dims are the value's, or 1 along a dim where the ids do not change (``np.broadcast_to``
gives the full array). Row ids usually depend on a few dims only (the batch dim of a
row-wise op), so the compact form is small. The ops that carry such values in the zoo's
kernels — elementwise ops (numpy broadcasting), broadcast, row-major reshape/bitcast,
transpose, copy, pad (XLA pads a row to split its reduction in two), reductions and
gathers of a few elements per row — are transferred here;
anything else is refused by the caller as too large to prove.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from stitch.hlo.evaluator.shape_ops import pad_array
from stitch.hlo.graph import OpGraph, OpNode
from stitch.hlo.ir import PadDim, Shape
from stitch.hlo.scatter_forms import known_index_values


def fits(ids: np.ndarray, dims: tuple[int, ...]) -> bool:
    """Whether ``ids`` is a compact form of a value of shape ``dims``."""
    return ids.ndim == len(dims) and all(a in (1, n) for a, n in zip(ids.shape, dims))


def broadcast_size(*arrays: np.ndarray) -> int:
    """Elements of the array numpy broadcasting of ``arrays`` makes."""
    return math.prod(np.broadcast_shapes(*(a.shape for a in arrays)))


def is_row_major(shape: Shape) -> bool:
    return tuple(shape.minor_to_major()) == tuple(reversed(range(shape.rank)))


def broadcast(ids: np.ndarray, out_dims: tuple[int, ...], dimensions: tuple[int, ...]
              ) -> np.ndarray:
    """HLO broadcast: operand dim i becomes output dim ``dimensions[i]``; the new dims
    repeat the ids (size 1 in the compact form)."""
    order = np.argsort(dimensions)
    moved = np.transpose(ids, order) if ids.ndim > 1 else ids
    shape = [1] * len(out_dims)
    for i, d in enumerate(sorted(dimensions)):
        shape[d] = moved.shape[i]
    return moved.reshape(shape)


def reshape(ids: np.ndarray, in_dims: tuple[int, ...], out_dims: tuple[int, ...],
            limit: int) -> np.ndarray | None:
    """A row-major reshape of a compact array: the non-1 dims fall into groups of equal
    element counts that the reshape regroups; a group along which the ids do not change
    stays compact, the others are expanded (None: that would exceed ``limit``)."""
    src = [d for d in range(len(in_dims)) if in_dims[d] != 1]
    dst = [d for d in range(len(out_dims)) if out_dims[d] != 1]
    squeezed = ids.reshape([ids.shape[d] for d in src])
    groups: list[tuple[list[int], list[int]]] = []      # (positions in src, in dst)
    i = j = 0
    while i < len(src) and j < len(dst):
        a, b = [i], [j]
        pa, pb = in_dims[src[i]], out_dims[dst[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(src):
                pa *= in_dims[src[i]]
                a.append(i)
                i += 1
            elif pb < pa and j < len(dst):
                pb *= out_dims[dst[j]]
                b.append(j)
                j += 1
            else:
                return None
        groups.append((a, b))
    if i != len(src) or j != len(dst):
        return None
    expanded = list(squeezed.shape)
    target = [1] * len(dst)
    for a, b in groups:
        if any(squeezed.shape[p] > 1 for p in a):
            for p in a:
                expanded[p] = in_dims[src[p]]
            for q in b:
                target[q] = out_dims[dst[q]]
    if math.prod(expanded) > limit:
        return None
    flat = np.ascontiguousarray(np.broadcast_to(squeezed, expanded)).reshape(target)
    shape = [1] * len(out_dims)
    for q, d in enumerate(dst):
        shape[d] = target[q]
    return flat.reshape(shape)


def pad(ids: np.ndarray, pads: Sequence[PadDim], limit: int) -> np.ndarray | None:
    """HLO pad of a compact array (None: the result would exceed ``limit``). Along a dim
    where the ids do not change (extent 1) it stays compact: each padding element takes the
    id of the row around it. The padding value is row-independent, so that row's thread may
    compute it; claiming a row is only ever stricter than -1. Along a full dim the padding
    is -1 (row-independent), and edge cropping removes ids as it removes elements."""
    full = [p if n > 1 else PadDim(0, 0, 0) for n, p in zip(ids.shape, pads)]
    sizes = [max(p.low, 0) + n + max(n - 1, 0) * p.interior + max(p.high, 0)
             for n, p in zip(ids.shape, full)]
    if math.prod(sizes) > limit:
        return None
    return pad_array(ids, -1, full)


def dims_ids(dims: tuple[int, ...], row_dims: tuple[int, ...]) -> np.ndarray:
    """Compact ids of a value whose row is its coordinates on ``row_dims`` (major first)."""
    out = np.zeros((1,) * len(dims), np.int64)
    grid = np.indices(dims, sparse=True)
    for d in row_dims:
        out = out * dims[d] + grid[d]
    return out


def candidate_splits(ids: np.ndarray, dims: tuple[int, ...], rows: int, minor: bool
                     ) -> list[tuple[str, tuple[int, ...]]]:
    """(kind, row dims) of the splits a compact value may have, in ``row_layout.find_split``'s
    order of preference. "rows" ("columns") is the "dims" split whose row dims are a
    prefix (suffix) of the value's dims: the same elements, the thread mapping's index
    arithmetic of the small case."""
    out: list[tuple[str, tuple[int, ...]]] = []
    for k in range(len(dims) + 1):
        if math.prod(dims[:k]) == rows:
            out.append(("rows", tuple(range(k))))
            break
    for k in range(len(dims) + 1):
        if math.prod(dims[len(dims) - k:]) == rows:
            out.append(("columns", tuple(range(len(dims) - k, len(dims)))))
            break
    if not minor:
        out.reverse()
    strides: dict[int, int] = {}
    for d in range(ids.ndim):
        if ids.shape[d] < 2:
            continue
        a, b = np.moveaxis(ids, d, 0)[:-1], np.moveaxis(ids, d, 0)[1:]
        steps = (b - a)[(a >= 0) & (b >= 0) & (a != b)]
        if steps.size:
            strides[d] = int(np.abs(steps).max())
    if math.prod(dims[d] for d in strides) == rows:
        out.append(("dims", tuple(sorted(strides, key=lambda d: -strides[d]))))
    return out


def gather(graph: OpGraph, node: OpNode, ids: np.ndarray, out_dims: tuple[int, ...],
           limit: int) -> np.ndarray | str:
    """Row ids of a gather of a compact operand: element o takes the operand's ids at
    its start (clamped as XLA clamps it) plus its offset. Only the dims along which the
    operand's ids change need the start, so those start components must be known from
    the index construction (the loss's iota of the row); data starts (the label) may run
    only along dims where the ids do not change; a batching dim's start is the batch
    coordinate."""
    inst = node.instruction
    operand = graph.nodes[node.operands[0]].shape
    indices = graph.nodes[node.operands[1]].shape
    if math.prod(out_dims) > limit:
        return f"{node.name} is too large to prove the row layout on index arrays"
    if indices.num_elements > limit:
        return f"{node.name}: its indices are too large to prove the row layout"
    offset_dims = list(inst.ints("offset_dims", ()))
    collapsed = set(inst.ints("collapsed_slice_dims", ()))
    index_map = list(inst.ints("start_index_map"))
    sizes = inst.ints("slice_sizes")
    vector_dim = inst.int("index_vector_dim")
    batch = [p for p in range(len(out_dims)) if p not in offset_dims]
    batch_dims = [d for d in range(indices.rank) if d != vector_dim]
    operand_batching = list(inst.ints("operand_batching_dims", ()))
    indices_batching = list(inst.ints("start_indices_batching_dims", ()))
    window = [d for d in range(operand.rank) if d not in collapsed and d not in operand_batching]
    if len(batch) != len(batch_dims) or len(window) != len(offset_dims):
        return f"{node.name}: gather dimension numbers do not fit its shapes"
    grid = np.indices(out_dims, sparse=True)
    values, known = known_index_values(graph, node.operands[1])
    coords: list[np.ndarray | int] = []
    for d in range(operand.rank):
        if ids.shape[d] == 1:
            coords.append(0)
            continue
        start: np.ndarray | int = 0
        if d in index_map:
            at = tuple(index_map.index(d) if i == vector_dim else grid[batch[batch_dims.index(i)]]
                       for i in range(indices.rank))
            if not np.all(known[at]):
                return f"{node.name} gathers at data-dependent starts along a dim its " \
                       "operand's rows change on"
            start = np.clip(values[at], 0, max(operand.dims[d] - sizes[d], 0))
        elif d in operand_batching:
            # The batch coordinate itself (jax's take_along_axis form), clamped as XLA does.
            idim = indices_batching[operand_batching.index(d)]
            start = np.minimum(grid[batch[batch_dims.index(idim)]],
                               max(operand.dims[d] - sizes[d], 0))
        offset = grid[offset_dims[window.index(d)]] if d in window else 0
        coords.append(start + offset)
    return np.broadcast_to(ids[tuple(coords)], out_dims).astype(np.int64)
