"""Scatters whose update rows fall into groups of distinct ids, generated without atomics.

An expert-choice mixture-of-experts layer combines its experts' outputs with
``zeros.at[chosen.reshape(-1)].add(out.reshape(-1, d))``, where ``chosen`` [E, C] are the
indices ``lax.top_k`` returned per expert: a token several experts chose collects several
updates, so XLA adds every update element atomically. But the ids of one expert are a
top-k of a permutation, hence distinct: the update rows fall into E consecutive *groups*
of C rows, no two rows of a group sharing an id. Stitch generates such a scatter with
plain loads and stores: a block owns a tile of the operand's element columns over a range
of its rows (a work item of ``GroupedScatter``), writes the operand's values there, then
adds the groups one
after another with a block barrier between them, each row of a group whose id falls in
its range by one thread per column. No two threads of a group meet at an element, the
groups are ordered by the barriers, and no other block touches the tile, so there is no
atomic and no race. The operand may be computed in the same kernel (the zeros XLA fills
in a kernel of their own).

What qualifies (``grouped_scatter``): a colliding scatter of whole operand rows
(``scatter_forms.whole_rows_scatter``) whose combiner is add, multiply, maximum or
minimum, with one index component per update row and index values proved distinct within
consecutive runs of the update rows (``distinct_runs``):

- the indices output of a ``sort`` along the minor dim whose payload rows hold distinct
  known values (an ``iota`` along it: how XLA GPU lowers ``top_k``, and ``argsort``), of
  XLA's ``topk`` or of XLA CPU's ``TopK`` custom call: each row's values permuted, or the
  first k of them;
- slices of such rows along the minor dim (the first k of each), and reshapes, bitcasts
  and copies that keep the row-major order, converts to an integer type holding the range;
- jax's wrap of negative indices, ``select(x < 0, x + n, x)``, where x is proved
  non-negative (the select then is x).

Ids outside the operand's rows are skipped, as XLA skips their updates.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from .graph import OpGraph, OpNode
from .ir import Shape, parse_slice
from .scatter_forms import known_index_values, whole_rows_scatter

# Bytes of a tile's row segment: one 32-byte sector, the unit a row access moves.
TILE_BYTES = 32
# Threads of a block (one work item per block): the most a block may have, so that the
# items' rows are walked by as many threads as possible.
TILE_THREADS = 1024
# Rows a thread walks at once within a group: their ids, then their updates, are loaded
# together (one round trip each) before the read-modify-writes of the rows that hit.
UNROLL_ROWS = 8
# Work items (tile, row range) the tiling aims for: about two per SM of the largest parts.
TARGET_ITEMS = 256
# Fewest operand rows of a range (smaller ranges rescan the ids for little work).
MIN_RANGE_ROWS = 64
# Most bytes of ids the items read in all, in multiples of the updates' bytes.
ID_REREADS = 4
# Producers followed back from the indices.
MAX_DEPTH = 32

_COMBINERS = ("add", "multiply", "maximum", "minimum")
_ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                  "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_INT_BITS = {"s8": 8, "s16": 16, "s32": 32, "s64": 64, "u8": 8, "u16": 16, "u32": 32,
             "u64": 64}


@dataclass(frozen=True)
class Distinct:
    """Index values distinct within each consecutive run of ``run`` elements (row-major),
    all in [lo, hi]."""
    run: int
    lo: int
    hi: int


@dataclass(frozen=True)
class GroupedScatter:
    """A scatter generated in column tiles: ``rows`` update rows in ``groups`` groups of
    distinct ids, each row ``width`` elements; the operand has ``operand_rows`` rows. A work
    item is one tile of ``tile`` columns over ``range_rows`` operand rows."""
    rows: int
    groups: int
    width: int
    operand_rows: int
    tile: int
    range_rows: int

    @property
    def group_rows(self) -> int:
        return self.rows // self.groups

    @property
    def tiles(self) -> int:
        return -(-self.width // self.tile)

    @property
    def ranges(self) -> int:
        return -(-self.operand_rows // self.range_rows)

    @property
    def items(self) -> int:
        return self.tiles * self.ranges

    def chunks(self, threads: int = TILE_THREADS) -> int:
        """Rounds of ``UNROLL_ROWS`` rows a thread of a block of ``threads`` walks per
        group (``threads // tile`` threads per column stride over the group's rows)."""
        return -(-self.group_rows // (threads // self.tile * UNROLL_ROWS))

    @property
    def hit_share(self) -> float:
        """Share of a group's rows whose id falls in an item's range (ids spread evenly)."""
        return min(1.0, self.range_rows / self.operand_rows)


_CACHE: "weakref.WeakKeyDictionary[OpGraph, dict[int, GroupedScatter | None]]" = \
    weakref.WeakKeyDictionary()


def grouped_scatter(graph: OpGraph, v: int) -> GroupedScatter | None:
    """How scatter ``v`` is generated in column tiles, or None (module docstring). Cached
    per graph: the cost model asks for every pattern holding a scatter."""
    cache = _CACHE.setdefault(graph, {})
    if v not in cache:
        cache[v] = _grouped_scatter(graph, v)
    return cache[v]


def holds_grouped_scatter(graph: OpGraph, members) -> bool:
    """Whether ``members`` hold a scatter generated in column tiles (not XLA's atomics)."""
    return any(graph.nodes[v].opcode == "scatter" and grouped_scatter(graph, v) is not None
               for v in members)


def _grouped_scatter(graph: OpGraph, v: int) -> GroupedScatter | None:
    whole = whole_rows_scatter(graph, v)
    if whole is None or whole.kind not in _COMBINERS:
        return None
    node = graph.nodes[v]
    inst = node.instruction
    operand = node.shape
    indices = graph.nodes[node.operands[1]].shape
    vector_dim = inst.int("index_vector_dim")
    # One index component per update row, the rows in the indices' row-major order.
    if not (vector_dim == indices.rank or
            (vector_dim == indices.rank - 1 and indices.dims[-1] == 1)):
        return None
    rows, width = whole.rows, whole.width
    if operand.dims[0] < 1:
        return None
    proved = distinct_runs(graph, node.operands[1])
    if proved is None or proved.run < 2 or rows % proved.run:
        return None
    element = _ELEMENT_BYTES.get(operand.element_type)
    if element is None:
        return None
    tile = max(1, TILE_BYTES // element)
    tiles = -(-width // tile)
    ranges = max(1, min(operand.dims[0] // MIN_RANGE_ROWS, -(-TARGET_ITEMS // tiles),
                        # every item rereads the ids: at most ID_REREADS times the
                        # updates' own bytes in all
                        ID_REREADS * width * element // (4 * tiles)))
    range_rows = -(-operand.dims[0] // ranges)
    return GroupedScatter(rows, rows // proved.run, width, operand.dims[0], tile, range_rows)


# ----------------------------------------------------------------- distinct index runs
def distinct_runs(graph: OpGraph, v: int, depth: int = 0) -> Distinct | None:
    """What is proved of value ``v``'s distinct runs (module docstring), or None."""
    if depth > MAX_DEPTH:
        return None
    node = graph.nodes[v]
    shape = node.shape
    if shape.is_tuple or shape.element_type not in _INT_BITS:
        return None
    op = node.opcode
    if op == "get-tuple-element":
        return _permutation(graph, node)
    if op in ("bitcast", "reshape", "copy"):
        inner = distinct_runs(graph, node.operands[0], depth + 1)
        src = graph.nodes[node.operands[0]].shape
        if inner is None or (op == "bitcast" and not (_row_major(src) and _row_major(shape))):
            return None
        return inner
    if op == "convert":
        src = graph.nodes[node.operands[0]].shape
        inner = distinct_runs(graph, node.operands[0], depth + 1)
        if inner is None or src.element_type not in _INT_BITS or \
                not _fits(inner, shape.element_type):
            return None
        return inner
    if op == "slice":
        return _slice(graph, node, depth)
    if op == "select":
        chosen = _constant_predicate(graph, node.operands[0], depth)
        if chosen is None:
            return None
        return distinct_runs(graph, node.operands[1 if chosen else 2], depth + 1)
    return None


def _permutation(graph: OpGraph, node: OpNode) -> Distinct | None:
    """The indices a sort or a top-k (``topk``, XLA CPU's ``TopK`` custom call) returns:
    each row's payload values permuted along the minor dim (0..n-1 for a top-k, its first
    k of them)."""
    source = graph.nodes[node.operands[0]]
    index = node.instruction.int("index")
    if source.opcode == "sort" and source.shape.is_tuple:
        dims = source.instruction.ints("dimensions", ())
        if index >= len(source.operands) or len(dims) != 1:
            return None
        payload = graph.nodes[source.operands[index]].shape
        if payload.rank < 1 or dims[0] != payload.rank - 1 or payload.dims[-1] < 1:
            return None
        # The sort permutes each row: rows of distinct known values stay distinct.
        values, known = known_index_values(graph, source.operands[index])
        if values.size == 0 or not bool(known.all()):
            return None
        rows = np.sort(values.reshape(-1, payload.dims[-1]), axis=-1)
        if bool((rows[:, 1:] == rows[:, :-1]).any()):
            return None
        return Distinct(payload.dims[-1], int(values.min()), int(values.max()))
    if index == 1 and source.shape.is_tuple and (source.opcode == "topk" or (
            source.opcode == "custom-call" and
            source.instruction.string("custom_call_target", "") == "TopK")):
        operand = graph.nodes[source.operands[0]].shape
        out = node.shape
        if out.rank < 1 or operand.rank != out.rank:
            return None
        return Distinct(out.dims[-1], 0, operand.dims[-1] - 1)
    return None


def _slice(graph: OpGraph, node: OpNode, depth: int) -> Distinct | None:
    src = graph.nodes[node.operands[0]].shape
    inner = distinct_runs(graph, node.operands[0], depth + 1)
    if inner is None or src.rank < 1 or inner.run != src.dims[-1]:
        return None
    spec = parse_slice(node.instruction.attrs.get("slice", ""))
    if len(spec) != src.rank or spec[-1].stride != 1:
        return None
    return Distinct(node.shape.dims[-1], inner.lo, inner.hi)


def _constant_predicate(graph: OpGraph, v: int, depth: int) -> bool | None:
    """The value of predicate ``v`` where it is the same everywhere, proved from the ranges
    of a compare's operands; None otherwise."""
    node = graph.nodes[v]
    if node.opcode != "compare" or len(node.operands) != 2:
        return None
    a = _range(graph, node.operands[0], depth + 1)
    b = _range(graph, node.operands[1], depth + 1)
    if a is None or b is None:
        return None
    direction = node.instruction.attrs.get("direction", "").strip()
    (alo, ahi), (blo, bhi) = a, b
    always = {"LT": ahi < blo, "LE": ahi <= blo, "GT": alo > bhi, "GE": alo >= bhi}
    never = {"LT": alo >= bhi, "LE": alo > bhi, "GT": ahi <= blo, "GE": ahi < blo}
    if direction not in always:
        return None
    if always[direction]:
        return True
    if never[direction]:
        return False
    return None


def _range(graph: OpGraph, v: int, depth: int) -> tuple[int, int] | None:
    """[lo, hi] of integer value ``v``: a proved permutation's, or all its values known."""
    node = graph.nodes[v]
    if node.shape.is_tuple or node.shape.element_type not in _INT_BITS:
        return None
    got = distinct_runs(graph, v, depth)
    if got is not None:
        return got.lo, got.hi
    if node.opcode == "broadcast" or (node.opcode == "constant" and node.shape.rank == 0):
        values, known = known_index_values(graph, v)
        if values.size and bool(known.all()):
            return int(values.min()), int(values.max())
    return None


def _fits(d: Distinct, element_type: str) -> bool:
    bits = _INT_BITS[element_type]
    if element_type.startswith("u"):
        return d.lo >= 0 and d.hi < (1 << bits)
    return -(1 << (bits - 1)) <= d.lo and d.hi < (1 << (bits - 1))


def _row_major(shape: Shape) -> bool:
    dims = [d for d in reversed(shape.minor_to_major()) if shape.dims[d] != 1]
    return dims == sorted(dims)


__all__ = ["TILE_THREADS", "UNROLL_ROWS", "Distinct", "GroupedScatter", "distinct_runs",
           "grouped_scatter", "holds_grouped_scatter"]
