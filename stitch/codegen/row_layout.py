"""The row layout of a warp or block part, proved on index arrays.

Warp/block composition is lowered where the part's row layout is proven: the row id of
every element (or -1 where the element does not depend on any row's result) is pushed
from the reductions through the part with the reference evaluator's own data-movement
ops; elementwise ops must not join two rows; a reduction finished by the unit must read
only its own row; and every written value must split into the part's rows (row after row,
column after column, or rows on some dims in some order). Values too large to hold in full
keep compact ids (``compact_rows``). A proof is made once per part equal but for names
and node ids (``site_keys.proof_key``) and renumbered for the others.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from stitch.hlo.evaluator.dtypes import numpy_dtype
from stitch.hlo.evaluator.interpreter import Evaluator
from stitch.hlo.graph import OpGraph, OpNode
from stitch.hlo.ir import parse_padding
from stitch.hlo.op_classes import OpClass
from stitch.hlo.scatter_forms import gather_index_map, known_index_values, scatter_form

from . import compact_rows, site_keys
from .row_mapping import RowSplit, RowUnit, kept_dims
from .values import leaf

# Largest tensor whose row layout is checked on index arrays (8 bytes per element).
ROW_CHECK_ELEMENTS = 1 << 24
# Largest value whose row ids the proof holds in full; larger ones are kept compact
# (``compact_rows``). Tests lower it to prove small kernels the compact way.
FULL_IDS_ELEMENTS = ROW_CHECK_ELEMENTS
# A row part's layout proof is made once per part equal but for names and node ids, and
# renumbered for the others (``RowLayoutProof.proved``).
REUSE_ROW_LAYOUTS = True
# Most start positions of a dynamic-(update-)slice the layout proof tries one by one.
MAX_DYNAMIC_STARTS = 256
# Row ids held lean: as int32 where they fit (they lie in [-1, rows)), and a data-movement
# op's broadcast result as a read-only broadcast of its distinct ids (a row statistic taken
# back to its row's millions of elements is neither copied nor converted element by element).
# Tests turn it off to compare with full int64 arrays.
LEAN_IDS = True


# Reducers with a warp collective (minor rows); column rows combine with plain ops.
WARP_REDUCERS = frozenset({"add", "multiply", "maximum", "minimum"})
# Ops that only move elements: row ids go through the evaluator's own op.
_MOVING_OPS = frozenset({"broadcast", "reshape", "bitcast", "transpose", "copy", "slice",
                         "reverse", "concatenate", "pad"})
# Integer bits each element type holds exactly (row ids cross data-movement ops in digits
# of this many bits, so casts to the op's element type keep them).
_EXACT_BITS = {"pred": 1, "s8": 7, "u8": 8, "s16": 15, "u16": 16, "s32": 31, "u32": 32,
               "s64": 62, "u64": 62, "f16": 11, "bf16": 8, "f32": 24, "f64": 53}


def find_split(ids: np.ndarray, rows: int, minor: bool, dims: tuple[int, ...]
               ) -> RowSplit | None:
    """A split whose row ids agree with ``ids`` (of a value of shape ``dims``, maybe in
    compact form) wherever the element is row-dependent (ids >= 0), preferring the one
    the part's thread mapping reads contiguously."""
    if ids.shape != dims:
        return _find_compact_split(ids, rows, minor, dims)
    if ids.size % rows:
        return None
    per_row = ids.size // rows
    candidates = [RowSplit("rows", rows, per_row), RowSplit("columns", rows, per_row)]
    if not minor:
        candidates.reverse()
    for split in candidates:
        if split.agrees(ids):
            return split
    # Neither: the row dims, found from how the row id steps along each dim.
    strides: dict[int, int] = {}        # dims the row changes along -> its step there
    for d in range(ids.ndim):
        a, b = np.moveaxis(ids, d, 0)[:-1], np.moveaxis(ids, d, 0)[1:]
        steps = (b - a)[(a >= 0) & (b >= 0) & (a != b)]
        if steps.size:
            strides[d] = int(np.abs(steps).max())
    if math.prod(ids.shape[d] for d in strides) == rows:
        # Row dims major to minor (a transposed per-row value has them out of order).
        split = RowSplit("dims", rows, per_row, tuple(sorted(strides, key=lambda d: -strides[d])))
        if split.agrees(ids):
            return split
    return None


def _find_compact_split(ids: np.ndarray, rows: int, minor: bool, dims: tuple[int, ...]
                        ) -> RowSplit | None:
    """``find_split`` of a compact value: only splits along whole dims can agree."""
    n = math.prod(dims)
    if n % rows:
        return None
    for kind, row_dims in compact_rows.candidate_splits(ids, dims, rows, minor):
        want = compact_rows.dims_ids(dims, row_dims)
        if compact_rows.broadcast_size(want, ids) > ROW_CHECK_ELEMENTS:
            continue
        if np.all((want == ids) | (ids < 0)):
            return RowSplit(kind, rows, n // rows, row_dims if kind == "dims" else ())
    return None


def distinct_ids(ids: np.ndarray) -> np.ndarray:
    """``ids`` without the repeats of a broadcast: extent 1 along the dims it does not
    change on by construction (stride 0), so it broadcasts back to ``ids`` and an
    elementwise comparison with it answers as one with ``ids`` does."""
    if not ids.size or 0 not in ids.strides:
        return ids
    return ids[tuple(slice(0, 1) if step == 0 else slice(None) for step in ids.strides)]


def join_row_ids(a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """Row ids of elements that need both ``a``'s and ``b``'s (None: two different rows)."""
    if a is b:
        return a
    full = a.shape
    # Elementwise, so lean ids join on their distinct ids (broadcasts of a row statistic)
    # and the answer is broadcast back (compact ids of two shapes join as they are).
    lean = LEAN_IDS and b.shape == full
    if lean:
        a, b = distinct_ids(a), distinct_ids(b)
    if a.dtype == b.dtype and np.array_equal(a, b):
        # Mostly so (the operands of an elementwise op come from the same rows): one pass
        # over arrays of up to millions of elements instead of six.
        return np.broadcast_to(a, full) if lean and a.shape != full else a
    if np.any((a >= 0) & (b >= 0) & (a != b)):
        return None
    joined = np.where(a >= 0, a, b)
    return np.broadcast_to(joined, full) if lean and joined.shape != full else joined


def join_axes(node: OpNode, ids: np.ndarray) -> np.ndarray | None:
    """Row ids of a reduction's outputs: its inputs' rows joined over the reduced dims."""
    axes = tuple(node.instruction.ints("dimensions"))
    if not axes:
        return ids
    top = ids.max(axis=axes)
    # (The fill is the ids' own dtype's: a larger Python int would wrap to -1.)
    low = np.where(ids >= 0, ids, np.iinfo(ids.dtype).max).min(axis=axes)
    if np.any((top >= 0) & (low != top)):
        return None
    return top




@dataclass
class RowLayout:
    reductions: set[int] = field(default_factory=set)         # finished once per row
    splits: dict[int, RowSplit] = field(default_factory=dict)   # row-dependent written values
    per_row: set[int] = field(default_factory=set)            # one element per row, row r at r




class RowLayoutProof:
    """Proves row layouts of one kernel's warp/block parts: the kernel's graph, the
    evaluator whose data-movement ops move the row ids, the block size, the values the
    kernel writes and how its reductions combine."""

    def __init__(self, graph: OpGraph, evaluator: Evaluator, block: int,
                 outputs: list[int], reducer_kind: Callable[[OpNode], str | None]):
        self.graph = graph
        self.evaluator = evaluator
        self.block = block
        self.outputs = outputs
        self.reducer_kind = reducer_kind

    def proved(self, part) -> "RowLayout | str":
        """``prove(part)``, from an earlier proof of a part equal but for names and
        node ids (``site_keys.proof_key``: the part's nodes, what the proof reads of
        the schedule, which members the kernel writes) where one is kept
        (``REUSE_ROW_LAYOUTS``), renumbered to this part's nodes."""
        key = None
        if REUSE_ROW_LAYOUTS:
            facts = (part.rows, part.blocks, part.unit, part.minor, self.block,
                     ROW_CHECK_ELEMENTS, FULL_IDS_ELEMENTS)
            key = site_keys.proof_key(self.graph, frozenset(part.members), facts,
                                      set(self.outputs), "row-layout")
        if key is not None:
            kept = site_keys.kept_proof(key, self.graph)
            if kept is not None:
                ids, names, proof = kept
                if isinstance(proof, str):
                    return site_keys.renamed_texts([proof], names)[0]
                return RowLayout({ids[v] for v in proof.reductions},
                                 {ids[v]: split for v, split in proof.splits.items()},
                                 {ids[v] for v in proof.per_row})
        layout = self.prove(part)
        if key is not None:
            # A copy: the proof kept is nobody's to change.
            site_keys.keep_proof(key, self.graph, layout if isinstance(layout, str) else
                                 RowLayout(set(layout.reductions), dict(layout.splits),
                                           set(layout.per_row)))
        return layout

    def prove(self, part) -> "RowLayout | str":
        """The part's row layout (see the module docstring), or why it has none. Row ids
        (-1: row-independent) are pushed through the part on index arrays with the
        reference evaluator's own data-movement ops, so the proof follows HLO semantics."""
        graph = self.graph
        rows = part.rows
        per_block = RowUnit.rows_per_block(part, self.block)
        if per_block * part.blocks < rows:
            return f"{part.blocks} blocks of {per_block} rows do not cover {rows} rows"
        layout = RowLayout()
        ids_of: dict[int, np.ndarray] = {}
        # (The proof compares values, never dtypes: ids of both widths may meet.)
        id_dtype = np.int32 if LEAN_IDS and rows < 2 ** 31 - 1 else np.int64
        for v in sorted(part.members):
            node = graph.nodes[v]
            shape = leaf(node.shape)
            if node.opcode == "reduce" and self._unit_reduction(node, part):
                reason = self._check_reduce(node, ids_of.get(node.operands[0]))
                if reason:
                    return reason
                layout.reductions.add(v)
                ids_of[v] = np.arange(rows, dtype=id_dtype).reshape(shape.dims)
                continue
            if not any(o in ids_of for o in node.operands):
                continue        # row-independent: any thread can compute it
            if shape.num_elements > FULL_IDS_ELEMENTS or any(
                    o in ids_of and ids_of[o].shape != leaf(graph.nodes[o].shape).dims
                    for o in node.operands):
                # Too large to hold in full: compact ids (``compact_rows``), kept compact
                # while the value is large.
                got = self._compact_ids(node, ids_of)
                if not isinstance(got, str) and shape.num_elements <= FULL_IDS_ELEMENTS:
                    got = np.broadcast_to(got, shape.dims).astype(id_dtype)
            elif node.opcode in _MOVING_OPS:
                got = self._move_ids(node, [ids_of.get(o) for o in node.operands])
            elif node.opcode in ("dynamic-slice", "dynamic-update-slice"):
                got = self._dynamic_ids(node, [ids_of.get(o) for o in node.operands])
            elif node.opcode == "gather":
                got = self._gather_ids(node, ids_of)
            elif node.opcode == "scatter":
                got = self._scatter_ids(node, ids_of)
            elif node.opcode == "reduce":
                # Several outputs per row: reduced per element by the threads needing it.
                got = join_axes(node, ids_of[node.operands[0]]) \
                    if node.operands[0] in ids_of and len(node.operands) == 2 else None
                got = f"{node.name} reduces values of different rows" if got is None else got
            elif node.op_class in (OpClass.LIGHT, OpClass.EXPENSIVE):
                got = self._join_ids(node, ids_of)
            else:
                got = f"{node.name} ({node.opcode}) moves values between rows"
            if isinstance(got, str):
                return got
            ids_of[v] = got
        if not layout.reductions:
            return "no reduction has one output per row"
        for v in self.outputs:
            node = graph.nodes[v]
            if v not in set(part.members) or v in layout.reductions or v not in ids_of:
                continue
            split = find_split(ids_of[v], rows, part.minor, leaf(node.shape).dims)
            if split is None:
                return f"{node.name} does not split into {rows} rows"
            layout.splits[v] = split
        for v, ids in ids_of.items():
            # (A compact value is large: never one element per row.)
            if v not in layout.reductions and ids.size == rows and not graph.is_free(v) \
                    and leaf(graph.nodes[v].shape).num_elements == rows \
                    and np.array_equal(ids.ravel(), np.arange(rows)):
                layout.per_row.add(v)
        return layout

    def _unit_reduction(self, node: OpNode, part) -> bool:
        """A reduction the unit finishes once per row (one output per row, a reducer the
        unit can combine)."""
        kind = self.reducer_kind(node)
        allowed = WARP_REDUCERS if part.minor else WARP_REDUCERS | {"and", "or"}
        return kind in allowed and len(node.operands) == 2 and \
            leaf(node.shape).num_elements == part.rows

    def _check_reduce(self, node: OpNode, operand_ids: np.ndarray | None) -> str | None:
        src = leaf(self.graph.nodes[node.operands[0]].shape)
        if operand_ids is None:
            return None         # row-independent input: every row may read it
        # Broadcastable (extent 1 off the kept dims): compared with the operand's ids, full
        # or compact, as they are.
        want = compact_rows.dims_ids(src.dims, kept_dims(node, src.rank))
        if operand_ids.shape != src.dims and \
                compact_rows.broadcast_size(want, operand_ids) > ROW_CHECK_ELEMENTS:
            return f"{node.name} is too large to prove the row layout on index arrays"
        if want.size and operand_ids.dtype != want.dtype and \
                int(want.max()) <= np.iinfo(operand_ids.dtype).max:
            want = want.astype(operand_ids.dtype)   # one dtype: no per-element cast
        # Elementwise, so the distinct ids of a broadcast compare as all of them do.
        operand_ids = distinct_ids(operand_ids)
        # Mostly every element is row-dependent: one comparison settles it.
        if (operand_ids == want).all():
            return None
        if not np.all((operand_ids == want) | (operand_ids < 0)):
            return f"{node.name} reads values of other rows"
        return None

    def _join_ids(self, node: OpNode, ids_of: dict[int, np.ndarray], compact: bool = False
                  ) -> np.ndarray | str:
        """Elementwise ops: an element belongs to the row of its row-dependent operands
        (which must agree); row-independent operands (-1) fit any row. ``compact``: the
        ids may be compact (``compact_rows``) and so is the result."""
        dims = leaf(node.shape).dims
        out: np.ndarray | None = None
        for o in node.operands:
            ids = ids_of.get(o)
            if ids is None:
                odims = leaf(self.graph.nodes[o].shape).dims
                if odims and odims != dims:
                    return f"{node.name} broadcasts implicitly"
                continue
            if ids.shape != dims:
                if compact and (ids.ndim == 0 or compact_rows.fits(ids, dims)):
                    ids = ids.reshape(ids.shape or (1,) * len(dims))
                elif ids.ndim:
                    return f"{node.name} changes the shape of its operands"
                else:
                    ids = np.broadcast_to(ids, dims)
            if compact and out is not None and \
                    compact_rows.broadcast_size(out, ids) > ROW_CHECK_ELEMENTS:
                return f"{node.name} is too large to prove the row layout on index arrays"
            out = ids if out is None else join_row_ids(out, ids)
            if out is None:
                return f"{node.name} joins values of different rows"
        return out

    def _compact_ids(self, node: OpNode, ids_of: dict[int, np.ndarray]) -> np.ndarray | str:
        """Row ids of an op with a large result or operand, in compact form
        (``compact_rows``); ops it does not know are too large to prove."""
        graph = self.graph
        shape = leaf(node.shape)
        too_large = f"{node.name} is too large to prove the row layout on index arrays"
        first = ids_of.get(node.operands[0]) if node.operands else None
        if node.opcode in ("bitcast", "reshape", "copy", "transpose", "broadcast") and \
                len(node.operands) == 1 and first is not None:
            src = leaf(graph.nodes[node.operands[0]].shape)
            if node.opcode == "copy":
                return first
            if node.opcode == "transpose":
                return np.transpose(first, node.instruction.ints("dimensions"))
            if node.opcode == "broadcast":
                return compact_rows.broadcast(first, shape.dims,
                                              tuple(node.instruction.ints("dimensions", ())))
            if node.opcode == "bitcast" and (
                    src.element_type != shape.element_type or
                    not (compact_rows.is_row_major(src) and compact_rows.is_row_major(shape))):
                return too_large    # a bitcast that is not a row-major reshape
            got = compact_rows.reshape(first, src.dims, shape.dims, ROW_CHECK_ELEMENTS)
            return too_large if got is None else got
        if node.opcode == "pad" and first is not None:
            if node.operands[1] in ids_of:
                return f"{node.name} pads with a row-dependent value"
            got = compact_rows.pad(first, parse_padding(node.instruction.attrs["padding"]),
                                   ROW_CHECK_ELEMENTS)
            return too_large if got is None else got
        if node.opcode == "reduce":
            got = join_axes(node, first) if first is not None and len(node.operands) == 2 \
                else None
            return f"{node.name} reduces values of different rows" if got is None else got
        if node.opcode == "gather" and first is not None:
            if node.operands[1] in ids_of:
                return f"{node.name} gathers at row-dependent indices"
            return compact_rows.gather(graph, node, first, shape.dims, ROW_CHECK_ELEMENTS)
        if node.op_class in (OpClass.LIGHT, OpClass.EXPENSIVE) and node.opcode not in \
                _MOVING_OPS and node.opcode not in ("gather", "scatter", "dynamic-slice",
                                                    "dynamic-update-slice", "reduce"):
            return self._join_ids(node, ids_of, compact=True)
        return too_large

    def _gather_ids(self, node: OpNode, ids_of: dict[int, np.ndarray]) -> np.ndarray | str:
        """A gather whose loaded starts run along dims where the operand's rows do not
        change (the loss's gather of one logit per row: the row is the batch point, the
        column is data): any start gives the same ids, so they are moved by the evaluator's
        gather with the proved index values (0 for the data ones)."""
        operand, indices = node.operands[:2]
        if indices in ids_of:
            return f"{node.name} gathers at row-dependent indices"
        imap = gather_index_map(self.graph, node.id)
        ids = ids_of[operand]
        if imap is None:
            return f"{node.name}: gather dimension numbers not readable"
        for d, _ in imap.data:
            if ids.shape[d] > 1 and not np.array_equal(ids.max(axis=d), ids.min(axis=d)):
                return f"{node.name} gathers along a dim its operand's rows change on"
        ishape = leaf(self.graph.nodes[indices].shape)
        if ishape.num_elements > ROW_CHECK_ELEMENTS:
            return f"{node.name} is too large to prove the row layout on index arrays"
        values, known = known_index_values(self.graph, indices)
        starts = np.where(known, values, 0).astype(numpy_dtype(ishape.element_type))
        return self._move_ids(node, [ids, None], {1: starts})

    def _scatter_ids(self, node: OpNode, ids_of: dict[int, np.ndarray]) -> np.ndarray | str:
        """A scatter of form row: element p joins the operand's row at p and the row of the
        update of p's batch point (whose ids must not change over its window)."""
        graph = self.graph
        operand, indices, update = node.operands
        form = scatter_form(graph, node.id)
        if form.kind != "row" or form.index_map is None:
            return f"{node.name}: updates may collide"
        if indices in ids_of:
            return f"{node.name} scatters at row-dependent indices"
        dims = leaf(node.shape).dims
        out = ids_of.get(operand, np.full(dims, -1, np.int64))
        if update not in ids_of:
            return out
        imap = form.index_map
        uids = ids_of[update]
        window = tuple(node.instruction.ints("update_window_dims", ()))
        if window:
            if not np.array_equal(uids.max(axis=window), uids.min(axis=window)):
                return f"{node.name}: an update window spans several rows"
            uids = uids.max(axis=window)
        per_batch = uids.reshape(-1)
        grid = np.indices(dims, sparse=True)
        number = np.zeros((1,) * len(dims), np.int64)
        reach = np.ones(dims, bool)
        for d, n in zip(imap.identity, imap.radices):
            number = number * n + grid[d]
            reach &= grid[d] < n
        placed = np.where(reach, per_batch[np.where(reach, number, 0)], -1)
        joined = join_row_ids(np.broadcast_to(out, dims), placed)
        return f"{node.name} joins rows of its operand and its updates" if joined is None \
            else joined

    def _dynamic_ids(self, node: OpNode, operand_ids: list[np.ndarray | None]
                     ) -> np.ndarray | str:
        """dynamic-(update-)slice: the start is data, so the ids of every possible
        (clamped) start are joined; an element is row-dependent if any start makes it so,
        and the starts must not disagree on its row."""
        first = 1 if node.opcode == "dynamic-slice" else 2
        if any(ids is not None for ids in operand_ids[first:]):
            return f"{node.name} starts at a row-dependent index"
        if len(node.operands) == first + 1 and \
                leaf(self.graph.nodes[node.operands[first]].shape).rank == 1:
            return f"{node.name} takes its starts as one index vector (the older form)"
        shapes = [leaf(self.graph.nodes[o].shape) for o in node.operands]
        if node.opcode == "dynamic-slice":
            full, sizes = shapes[0].dims, node.instruction.ints("dynamic_slice_sizes")
        else:
            full, sizes = shapes[0].dims, shapes[1].dims
        ranges = [range(max(n - k, 0) + 1) for n, k in zip(full, sizes)]
        if math.prod(len(r) for r in ranges) > MAX_DYNAMIC_STARTS:
            return f"{node.name} has too many possible starts to prove the row layout"
        out: np.ndarray | None = None
        for starts in itertools.product(*ranges):
            fixed = {first + i: np.asarray(s, numpy_dtype(shapes[first + i].element_type))
                     for i, s in enumerate(starts)}
            got = self._move_ids(node, operand_ids, fixed)
            if isinstance(got, str):
                return got
            out = got if out is None else join_row_ids(out, got)
            if out is None:
                return f"{node.name} moves values between rows"
        return out

    def _move_ids(self, node: OpNode, operand_ids: list[np.ndarray | None],
                  fixed: dict[int, np.ndarray] | None = None) -> np.ndarray | str:
        """Row ids of a data-movement op, moved by the evaluator's own op (operands in
        ``fixed`` are passed as given: start indices). Ids travel as digits every element
        type involved holds exactly (so dtype casts keep them); 0 marks row-independent
        elements."""
        graph = self.graph
        fixed = fixed or {}
        shapes = [leaf(graph.nodes[o].shape) for o in node.operands]
        types = {s.element_type for i, s in enumerate(shapes) if i not in fixed} | \
            {leaf(node.shape).element_type}
        if node.opcode == "bitcast" and len(types) > 1:
            return f"{node.name} bitcasts between element types"
        if any(t not in _EXACT_BITS for t in types):
            return f"{node.name}: row ids cannot travel in {sorted(types)}"
        if any(s.num_elements > ROW_CHECK_ELEMENTS for s in shapes):
            return f"{node.name} is too large to prove the row layout on index arrays"
        bits = min(_EXACT_BITS[t] for t in types)
        # Ids plus one (0: row-independent) in the ids' own dtype, each operand once (lean:
        # its distinct ids, broadcast back as digit planes).
        encoded = {i: (distinct_ids(ids) if LEAN_IDS else ids) + 1
                   for i, ids in enumerate(operand_ids) if ids is not None and i not in fixed}
        top = max((int(e.max(initial=0)) for e in encoded.values()), default=0)
        width = max(top.bit_length(), 1)
        # The moved digits are operands' digits, so the result is below 2 ** width.
        acc = np.int32 if LEAN_IDS and width <= 31 else np.int64
        zeros = {i: np.broadcast_to(np.zeros((), numpy_dtype(s.element_type)), s.dims)
                 if LEAN_IDS else np.zeros(s.dims, numpy_dtype(s.element_type))
                 for i, s in enumerate(shapes) if i not in fixed and i not in encoded}

        def plane(i: int, shift: int) -> np.ndarray:
            digits = encoded[i] if width <= bits else (encoded[i] >> shift) & ((1 << bits) - 1)
            digits = digits.astype(numpy_dtype(shapes[i].element_type))
            full = operand_ids[i].shape
            return digits if digits.shape == full else np.broadcast_to(digits, full)

        out: np.ndarray | None = None
        for shift in range(0, width, bits):
            planes = [fixed[i] if i in fixed else zeros[i] if i in zeros else plane(i, shift)
                      for i in range(len(shapes))]
            moved = np.asarray(self.evaluator.apply_instruction(
                node.computation, node.instruction, planes))
            full = moved.shape
            # Lean: the distinct digits converted (a broadcast stays one), in place after.
            digits = (distinct_ids(moved) if LEAN_IDS else moved).astype(acc)
            if shift:
                digits <<= shift
            if out is None:
                out = digits
            elif out.shape == digits.shape:
                out |= digits
            else:
                out = np.broadcast_to(out, full) | np.broadcast_to(digits, full)
        out -= 1
        # (Read-only where broadcast: the proof only reads ids.)
        return out if out.shape == full else np.broadcast_to(out, full)
