"""The layout proof's array checks (stitch.codegen.row_layout): ``RowSplit.agrees`` and ``join_row_ids`` answer
exactly as their definitions on full index arrays do, which the proof used to build for
values of millions of elements (transformer_train full: 2M-element row ids, lowering 3.7 s
of a 4.9 s pass)."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from stitch.codegen.row_layout import find_split, join_row_ids
from stitch.codegen.row_mapping import RowSplit


def _reference_ids(split: RowSplit, dims: tuple[int, ...]) -> np.ndarray:
    """The row of every element of a value of shape ``dims`` under ``split``, built in full
    (the proof's former definition; independent of compact_rows)."""
    n = math.prod(dims)
    if split.kind == "rows":
        return (np.arange(n) // split.per_row).reshape(dims)
    if split.kind == "columns":
        return (np.arange(n) % split.rows).reshape(dims)
    out = np.zeros(dims, np.int64)
    grid = np.indices(dims, sparse=True)
    for d in split.row_dims:
        out = out * dims[d] + grid[d]
    return out


def _reference_agrees(split: RowSplit, ids: np.ndarray) -> bool:
    known = ids >= 0
    return np.array_equal(_reference_ids(split, ids.shape)[known], ids[known])


def _reference_join(a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    if np.any((a >= 0) & (b >= 0) & (a != b)):
        return None
    return np.where(a >= 0, a, b)


SHAPES = [(6,), (4, 6), (2, 3, 4), (3, 1, 4, 2)]


def _splits(dims: tuple[int, ...]):
    """Every split of a value of shape ``dims`` the proof can meet."""
    n = math.prod(dims)
    for rows in (r for r in range(1, n + 1) if n % r == 0):
        yield RowSplit("rows", rows, n // rows)
        yield RowSplit("columns", rows, n // rows)
    for k in range(1, len(dims) + 1):
        for row_dims in itertools.permutations(range(len(dims)), k):
            rows = math.prod(dims[d] for d in row_dims)
            yield RowSplit("dims", rows, n // rows, row_dims)


@pytest.mark.parametrize("dims", SHAPES)
def test_agrees_is_the_split_compared_where_known(dims):
    rng = np.random.default_rng(len(dims))
    checked = agreed = 0
    for split in _splits(dims):
        exact = _reference_ids(split, dims).copy()
        variants = [exact, np.where(rng.random(dims) < 0.3, -1, exact),
                    np.full(dims, -1, np.int64)]
        wrong = exact.copy()
        wrong.flat[rng.integers(wrong.size)] = split.rows          # a row that is not there
        variants.append(wrong)
        if split.rows > 1:
            moved = exact.copy()
            moved.flat[0] = (moved.flat[0] + 1) % split.rows        # one element misplaced
            variants.append(moved)
        for ids in variants:
            for form in (ids, np.ascontiguousarray(ids.T).T):       # a non-contiguous view too
                got = split.agrees(form)
                assert got == _reference_agrees(split, form), (split, form)
                checked += 1
                agreed += got
    assert agreed and checked - agreed        # both answers happen


@pytest.mark.parametrize("dims", SHAPES)
def test_find_split_finds_every_split_it_is_given(dims):
    """A value laid out by a split is found to split the same way (the proof's row ids of
    a written value), or by an equivalent split (the same ids: tried in a fixed order)."""
    for split in _splits(dims):
        ids = np.ascontiguousarray(_reference_ids(split, dims))
        for minor in (True, False):
            found = find_split(ids, split.rows, minor, dims)
            if found is None:
                # Only a "dims" split whose row dims are not major-to-minor by stride in
                # the value, which the proof never makes, may go unfound.
                assert split.kind == "dims"
                continue
            assert np.array_equal(_reference_ids(found, dims), ids), (split, found)


def test_join_is_its_definition_with_shortcuts_for_equal_ids():
    rng = np.random.default_rng(7)
    a = rng.integers(-1, 5, (8, 16))
    cases = [(a, a), (a, a.copy()), (a, np.where(a >= 0, a, 3)), (a, np.where(a < 0, a, 1)),
             (a, np.full_like(a, -1)), (a, a.astype(np.int32)), (a[:1], a),
             (np.full((8, 16), -1), rng.integers(0, 5, (8, 16)))]
    outcomes = set()
    for x, y in cases:
        want, got = _reference_join(x, y), join_row_ids(x, y)
        outcomes.add(want is None)
        if want is None:
            assert got is None
        else:
            assert got is not None and got.dtype == want.dtype
            assert np.array_equal(np.broadcast_to(got, want.shape), want)
    assert outcomes == {True, False}
