"""dynamic-slice, dynamic-update-slice, gather, scatter.

Start indices are clamped into range for dynamic-slice, dynamic-update-slice and gather (as
XLA does); scatter skips every update whose whole window is not inside the operand.
"""
from __future__ import annotations

import numpy as np

from ..errors import HloEvaluationError
from .registry import handles
from .reductions import accumulate


def _start_indices(operand: np.ndarray, index_ops: list, sizes) -> list[int]:
    """Scalar start operands (or one legacy index vector) clamped to [0, dim - size]."""
    if len(index_ops) == 1 and np.ndim(index_ops[0]) == 1:
        starts = [int(v) for v in np.asarray(index_ops[0]).reshape(-1)]
    else:
        starts = [int(np.asarray(v).reshape(())) for v in index_ops]
    if len(starts) != operand.ndim:
        raise HloEvaluationError(f"{len(starts)} start indices for an operand of rank {operand.ndim}")
    return [min(max(s, 0), dim - size) for s, dim, size in zip(starts, operand.shape, sizes)]


@handles("dynamic-slice")
def dynamic_slice(ev, inst, ops):
    operand = np.asarray(ops[0])
    sizes = inst.ints("dynamic_slice_sizes")
    starts = _start_indices(operand, ops[1:], sizes)
    return operand[tuple(slice(s, s + n) for s, n in zip(starts, sizes))]


@handles("dynamic-update-slice")
def dynamic_update_slice(ev, inst, ops):
    operand, update = np.asarray(ops[0]), np.asarray(ops[1])
    starts = _start_indices(operand, ops[2:], update.shape)
    out = operand.copy()
    out[tuple(slice(s, s + n) for s, n in zip(starts, update.shape))] = update
    return out


def _index_vectors(indices: np.ndarray, index_vector_dim: int) -> tuple[np.ndarray, tuple, list[int]]:
    """Start-index vectors as (batch..., K), the batch shape, and for every dimension of the
    original indices array its position among the batch dims (-1 for index_vector_dim)."""
    indices = np.asarray(indices).astype(np.int64)
    if index_vector_dim == indices.ndim:
        vectors = indices[..., None]
        positions = list(range(indices.ndim))
    else:
        vectors = np.moveaxis(indices, index_vector_dim, -1)
        positions = [d if d < index_vector_dim else d - 1 for d in range(indices.ndim)]
        positions[index_vector_dim] = -1
    return vectors, vectors.shape[:-1], positions


def _full_starts(operand_rank: int, vectors: np.ndarray, batch_shape: tuple, positions: list[int],
                 index_map, operand_batching, indices_batching) -> np.ndarray:
    """(B, operand_rank) start of every slice/window: mapped index components, batch
    coordinates for batching dims, 0 elsewhere."""
    count = int(np.prod(batch_shape, dtype=np.int64))
    flat = vectors.reshape(count, vectors.shape[-1])
    starts = np.zeros((count, operand_rank), np.int64)
    if len(index_map) != flat.shape[1]:
        raise HloEvaluationError(
            f"index vectors have {flat.shape[1]} components but the index map has {len(index_map)}")
    for k, d in enumerate(index_map):
        starts[:, d] = flat[:, k]
    if operand_batching:
        coords = np.indices(batch_shape).reshape(len(batch_shape), count)
        for od, idim in zip(operand_batching, indices_batching):
            starts[:, od] = coords[positions[idim]]
    return starts


@handles("gather")
def gather(ev, inst, ops):
    operand, indices = np.asarray(ops[0]), np.asarray(ops[1])
    offset_dims = inst.ints("offset_dims", ())
    collapsed = inst.ints("collapsed_slice_dims", ())
    operand_batching = inst.ints("operand_batching_dims", ())
    indices_batching = inst.ints("start_indices_batching_dims", ())
    slice_sizes = inst.ints("slice_sizes")
    vectors, batch_shape, positions = _index_vectors(indices, inst.int("index_vector_dim"))
    starts = _full_starts(operand.ndim, vectors, batch_shape, positions,
                          inst.ints("start_index_map"), operand_batching, indices_batching)
    starts = np.clip(starts, 0, np.maximum(np.array(operand.shape) - np.array(slice_sizes), 0))
    count = starts.shape[0]
    rank = operand.ndim
    grids = []
    for d in range(rank):
        shape = [1] * (rank + 1)
        shape[0] = count
        shape[d + 1] = slice_sizes[d]
        offsets = np.arange(slice_sizes[d]).reshape([1] * (d + 1) + [slice_sizes[d]] + [1] * (rank - d - 1))
        grids.append(starts[:, d].reshape([count] + [1] * rank) + offsets)
    slices = operand[tuple(grids)] if operand.size else np.zeros((count, *slice_sizes), operand.dtype)
    removed = set(collapsed) | set(operand_batching)
    offset_shape = tuple(s for d, s in enumerate(slice_sizes) if d not in removed)
    slices = slices.reshape(tuple(batch_shape) + offset_shape)
    out_rank = len(batch_shape) + len(offset_shape)
    if len(offset_dims) != len(offset_shape):
        raise HloEvaluationError(f"{inst.name}: {len(offset_dims)} offset dims for "
                                 f"{len(offset_shape)} slice dims")
    perm = []
    batch_axis = 0
    for p in range(out_rank):
        if p in offset_dims:
            perm.append(len(batch_shape) + offset_dims.index(p))
        else:
            perm.append(batch_axis)
            batch_axis += 1
    return np.transpose(slices, perm)


@handles("scatter")
def scatter(ev, inst, ops):
    n = (len(ops) - 1) // 2
    operands = [np.asarray(o) for o in ops[:n]]
    indices = np.asarray(ops[n])
    updates = [np.asarray(u) for u in ops[n + 1:]]
    window_dims = inst.ints("update_window_dims", ())
    inserted = inst.ints("inserted_window_dims", ())
    input_batching = inst.ints("input_batching_dims", ())
    indices_batching = inst.ints("scatter_indices_batching_dims", ())
    operand = operands[0]
    rank = operand.ndim
    vectors, batch_shape, positions = _index_vectors(indices, inst.int("index_vector_dim"))
    starts = _full_starts(rank, vectors, batch_shape, positions,
                          inst.ints("scatter_dims_to_operand_dims"), input_batching,
                          indices_batching)
    update = updates[0]
    scatter_dims = [d for d in range(update.ndim) if d not in window_dims]
    window_operand_dims = [d for d in range(rank) if d not in inserted and d not in input_batching]
    if len(window_operand_dims) != len(window_dims):
        raise HloEvaluationError(f"{inst.name}: {len(window_dims)} update window dims for "
                                 f"{len(window_operand_dims)} operand window dims")
    window_shape = tuple(update.shape[d] for d in window_dims)
    full_window = np.ones(rank, np.int64)
    for d, size in zip(window_operand_dims, window_shape):
        full_window[d] = size
    in_bounds = np.all((starts >= 0) & (starts + full_window <= np.array(operand.shape)), axis=1)
    # operand index of every (scatter index, window element) pair, row-major in that order
    wcount = int(np.prod(window_shape, dtype=np.int64))
    window_coords = np.indices(window_shape).reshape(len(window_shape), wcount)
    full = np.repeat(starts[:, None, :], wcount, axis=1)  # (count, wcount, rank)
    for k, d in enumerate(window_operand_dims):
        full[:, :, d] += window_coords[k][None, :]
    keep = np.repeat(in_bounds, wcount)
    linear = np.ravel_multi_index(tuple(full.reshape(-1, rank)[keep].T), operand.shape) \
        if rank else np.zeros(int(keep.sum()), np.int64)
    perm = scatter_dims + list(window_dims)
    values = [np.transpose(u, perm).reshape(-1)[keep] for u in updates]
    outs = [o.copy().reshape(-1) for o in operands]
    accumulate(ev, inst.called_computations[0], outs, linear, values)
    result = [o.reshape(operand.shape) for o in outs]
    return tuple(result) if inst.shape.is_tuple else result[0]
