"""The layout proof's array checks (stitch.codegen.row_layout): ``RowSplit.agrees``,
``join_row_ids`` and ``join_axes`` answer exactly as their definitions on full index arrays
do, which the proof used to build for values of millions of elements (transformer_train
full: 2M-element row ids, lowering 3.7 s of a 4.9 s pass); lean ids (int32, broadcasts
kept as views) prove what full int64 ones prove."""
from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest

import stitch.codegen.row_layout as row_layout
from stitch.codegen.lower import row_layouts
from stitch.codegen.row_layout import find_split, join_axes, join_row_ids
from stitch.codegen.row_mapping import RowSplit
from stitch.cost.gpu_specs import get_spec
from stitch.hlo import parse_hlo
from stitch.hlo.evaluator.interpreter import Evaluator
from stitch.hlo.graph import build_op_graphs
from stitch.schedule import schedule_kernel
from tests.fixtures import REDUCERS, forced_reduction_schedules, zoo_fixture


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


# ------------------------------------------- lean row ids against full int64 ones
# The proof holds row ids lean (``row_layout.LEAN_IDS``: int32 where they fit, broadcast
# results as read-only broadcasts of their distinct ids); with it off they are full int64
# arrays, as the proof first held them. Both must prove the same layouts and give the same
# reasons.

def _moving_rows_hlo(rng: np.random.Generator) -> str:
    """A row statistic taken back to its row's elements through a random chain of
    data-movement ops in a random element type (pred and 8-bit types move the ids in
    several digit planes), then reduced again per row: random rows and columns."""
    rows, cols = int(rng.integers(60, 700)), int(rng.choice([32, 48, 96]))
    t = str(rng.choice(["f32", "bf16", "f16", "s8", "s32", "pred"]))
    lines = [f"x = f32[{rows},{cols}] parameter(0)", "z = f32[] constant(0)",
             f"r = f32[{rows}] reduce(x, z), dimensions={{1}}, to_apply=add",
             f"c = {t}[{rows}] convert(r)",
             f"m0 = {t}[{rows},{cols}] broadcast(c), dimensions={{0}}"]
    moves = [
        [f"{{o}}t = {t}[{cols},{rows}] transpose({{i}}), dimensions={{{{1,0}}}}",
         f"{{o}} = {t}[{rows},{cols}] transpose({{o}}t), dimensions={{{{1,0}}}}"],
        [f"{{o}} = {t}[{rows},{cols}] reverse({{i}}), dimensions={{{{1}}}}"],
        [f"{{o}}r = {t}[{rows},{cols // 16},16] reshape({{i}})",
         f"{{o}} = {t}[{rows},{cols}] reshape({{o}}r)"],
        [f"{{o}}z = {t}[] constant(0)",
         f"{{o}}p = {t}[{rows},{cols + 5}] pad({{i}}, {{o}}z), padding=0_0x2_3",
         f"{{o}} = {t}[{rows},{cols}] slice({{o}}p), slice={{{{[0:{rows}], [2:{cols + 2}]}}}}"],
    ]
    last = "m0"
    for k, i in enumerate(rng.permutation(len(moves))[:int(rng.integers(1, 4))]):
        lines += [line.format(o=f"m{k + 1}", i=last) for line in moves[i]]
        last = f"m{k + 1}"
    lines += [f"f = f32[{rows},{cols}] convert({last})",
              f"d = f32[{rows},{cols}] subtract(x, f)",
              f"r2 = f32[{rows}] reduce(d, z), dimensions={{1}}, to_apply=add",
              f"ROOT o = (f32[{rows}], f32[{rows},{cols}]) tuple(r2, d)"]
    body = "\n  ".join(lines)
    return f"""HloModule m
{REDUCERS}
ENTRY e {{
  {body}
}}
"""


def _proofs(monkeypatch, graph, module, schedule, lean: bool, full_ids: int | None = None):
    with monkeypatch.context() as m:
        m.setattr(row_layout, "LEAN_IDS", lean)
        if full_ids is not None:
            m.setattr(row_layout, "FULL_IDS_ELEMENTS", full_ids)
        return [p if p is None or isinstance(p, str) else
                (p.reductions, p.splits, p.per_row)
                for p in row_layouts(graph, Evaluator(module), schedule, in_place=True)]


def test_lean_ids_prove_as_int64_ids_on_random_moves(monkeypatch):
    rng = np.random.default_rng()
    proved = 0
    for _ in range(6):
        text = _moving_rows_hlo(rng)
        module = parse_hlo(text)
        graph = build_op_graphs(module)[0]
        members = [n.id for n in graph.nodes
                   if n.opcode not in ("parameter", "constant", "tuple")]
        for unit in ("block", "warp"):
            schedule = schedule_kernel(graph, members, get_spec("h100"), force={"unit": unit})
            lean = _proofs(monkeypatch, graph, module, schedule, True)
            assert lean == _proofs(monkeypatch, graph, module, schedule, False), text
            proved += sum(1 for p in lean if p is not None and not isinstance(p, str))
    assert proved          # the chains are proved, not only refused alike


ZOO_KERNELS = ["log_softmax_xent_train", "layer_norm_nonminor", "bert_layer_train",
               "transformer_train_bf16", "dien_train"]


@pytest.mark.parametrize("model", ZOO_KERNELS)
def test_lean_ids_prove_as_int64_ids_on_zoo_kernels(monkeypatch, model):
    """Every warp/block part of a tiny zoo plan (h100), each forced unit, full and compact
    ids: the same layouts and the same reasons with lean ids as with full int64 ones."""
    module = parse_hlo(zoo_fixture(model, "tiny", "pre").read_text())
    compared = 0
    for graph, _, forced in forced_reduction_schedules(module):
        for full_ids in (None, 0):
            lean = _proofs(monkeypatch, graph, module, forced, True, full_ids)
            assert lean == _proofs(monkeypatch, graph, module, forced, False, full_ids)
            compared += sum(1 for p in lean if p is not None)
    assert compared


def test_join_axes_of_narrow_ids_is_its_definition():
    """A reduction's outputs take their inputs' row (None: two rows meet), for int32 ids
    as for int64 ones (the fill for row-independent elements is the dtype's own)."""
    rng = np.random.default_rng()
    outcomes = set()
    for _ in range(40):
        dims = tuple(int(d) for d in rng.integers(1, 5, int(rng.integers(1, 4))))
        axes = tuple(d for d in range(len(dims)) if rng.random() < 0.5)
        rows = np.arange(math.prod(dims)).reshape(dims) // max(1, int(rng.integers(1, 4)))
        ids = np.where(rng.random(dims) < 0.3, -1, rows)
        if rng.random() < 0.3:
            ids.flat[int(rng.integers(ids.size))] = int(rng.integers(0, ids.size))
        node = SimpleNamespace(instruction=SimpleNamespace(ints=lambda _, a=axes: a))
        # Reference: per output element, the row ids of its inputs that have one.
        want = None if axes else ids
        if axes:
            moved = np.moveaxis(ids, axes, range(len(axes))).reshape(-1, *[
                n for d, n in enumerate(dims) if d not in axes])
            known = [set(col[col >= 0].tolist()) for col in moved.reshape(moved.shape[0], -1).T]
            if all(len(k) <= 1 for k in known):
                want = np.array([k.pop() if k else -1 for k in known]).reshape(moved.shape[1:])
        for dtype in (np.int64, np.int32):
            got = join_axes(node, ids.astype(dtype))
            outcomes.add(want is None)
            if want is None:
                assert got is None, (ids, axes)
            else:
                assert got is not None and np.array_equal(got, want), (ids, axes, dtype)
    assert outcomes == {True, False}


def test_join_of_broadcast_ids_is_its_definition():
    """Lean ids are often broadcasts (a row statistic taken back to its row's elements):
    their join is computed on the distinct ids and must be the join of the full arrays."""
    rng = np.random.default_rng()
    outcomes = set()
    for _ in range(60):
        dims = tuple(int(d) for d in rng.integers(1, 5, 3))
        views = []
        for _ in range(2):
            kept = [d if rng.random() < 0.5 else 1 for d in dims]
            small = rng.integers(-1, 3, kept)
            views.append(np.broadcast_to(small, dims) if rng.random() < 0.8 else
                         np.ascontiguousarray(np.broadcast_to(small, dims)))
        if rng.random() < 0.3:
            views[1] = views[0]
        a, b = views
        want, got = _reference_join(a.copy(), b.copy()), join_row_ids(a, b)
        outcomes.add(want is None)
        if want is None:
            assert got is None
        else:
            assert got is not None and got.shape == want.shape and np.array_equal(got, want)
    assert outcomes == {True, False}
