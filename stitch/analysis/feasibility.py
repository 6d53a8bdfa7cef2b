"""The conservative codegen feasibility predicate the explorer calls (paper §5.2: "it does
not form fusion patterns with cross-block communication requirement").

A pattern is stitchable when every value computed inside it can be produced in the block
that consumes it. Elementwise and layout ops are always fine: a thread recomputes what it
needs from the kernel's inputs (thread composition). The only values that cannot be
recomputed cheaply per thread are *shared reductions* — reductions with a consumer inside
the pattern. Their results are shared through shuffles or shared memory, so the block that
computes a reduction row must also hold every consumer element that reads it.

We track this with a *row map*: for each tensor downstream of a shared reduction, the
dimensions of that tensor that carry the reduction's kept coordinates (its "row"). Ops
transform row maps (broadcast, transpose, reshape...). A pattern is rejected when

- an op downstream of a shared reduction reduces over, slices, pads, gathers along or
  otherwise mixes row dimensions (the element would need another block's rows), or
- two operands of one op carry different row maps (two incompatible block partitions), or
- it contains a kernel boundary (GEMM/conv, opaque op, control flow) or a source.

The *global scope* (AStitch's global stitching scope) gets around the first two:
with ``analyze_pattern(..., allow_global=True)`` a pattern the block scopes refuse for
cross-block data is stitched as one persistent kernel with grid barriers between reduction
stages (``GlobalPhases``); kernel boundaries and atomic scatters still end a kernel
(``KernelEnds``). A pattern both scopes can stitch carries both and its schedule picks.
"""
from __future__ import annotations

import weakref

from dataclasses import dataclass, field
from typing import Callable, Iterable

from stitch.hlo.graph import OpGraph, OpNode
from stitch.hlo.ir import Shape, parse_padding, parse_slice
from stitch.hlo.op_classes import OpClass
from stitch.hlo.grouped_scatter import grouped_scatter
from stitch.hlo.scatter_forms import (IndexMap, gather_batch_dims, gather_index_map,
                                             scatter_batch_dims, scatter_form)

from .buildable import build_problem

class Infeasible(Exception):
    """Internal: raised with the reason a pattern cannot be stitched."""


class KernelEnds(Infeasible):
    """A reason no stitching scope gets around: a kernel boundary inside, or an atomic
    scatter that must end its kernel."""


@dataclass(frozen=True)
class SharedReduction:
    node: int
    rows: int            # kept elements (rows of the block partition)
    row_length: int      # reduced elements per row
    minor: bool          # row dims lead the physical order: a block's data is contiguous


@dataclass(frozen=True)
class GlobalPhases:
    """The global stitching scope of a pattern (AStitch's global scope): one persistent
    kernel whose phases are separated by grid barriers. Phase k reduces the stage-k
    reductions (stage = reductions on the longest path to an op inside the pattern) into
    per-block partials in global scratch; later phases fold the partials of any output
    they need, so a consumer may read a reduction's result at any index. The last phase
    computes the written values."""

    stages: tuple[tuple[int, ...], ...]     # reduce ids finished in phase k, k = 0, 1, ...

    @property
    def phases(self) -> int:
        return len(self.stages) + 1

    @property
    def reductions(self) -> tuple[int, ...]:
        return tuple(v for stage in self.stages for v in stage)


@dataclass
class PatternAnalysis:
    """What the cost model needs to know about a feasible pattern."""

    components: list[list[int]]                       # connected parts (packing if > 1)
    shared: list[SharedReduction] = field(default_factory=list)
    component_of: dict[int, int] = field(default_factory=dict)
    # "block": the row partition keeps every shared reduction in a block (warp/block
    # scopes); "global": only the global scope stitches it (``global_phases``).
    scope: str = "block"
    # The global scope's phases where it also applies (both scopes: the schedule picks);
    # see ``global_phases``.
    _global_phases: GlobalPhases | None = field(default=None, repr=False)
    # For a block-scope pattern with a reduce, the phases are found when first asked
    # (``analyze_pattern``): only the schedules of chosen kernels ask, and the explorer
    # analyzes thousands of patterns (perf only).
    _phases_of: Callable[[], GlobalPhases | str] | None = field(default=None, repr=False,
                                                                compare=False)

    @property
    def global_phases(self) -> GlobalPhases | None:
        if self._phases_of is not None:
            phases = self._phases_of()
            self._phases_of = None
            self._global_phases = None if isinstance(phases, str) else phases
        return self._global_phases

    @global_phases.setter
    def global_phases(self, phases: GlobalPhases | None) -> None:
        self._phases_of = None
        self._global_phases = phases


# Most grid barriers a global-scope kernel may have (reduction stages).
MAX_GLOBAL_STAGES = 4


def global_phases(graph: OpGraph, members: Iterable[int]) -> GlobalPhases | str:
    """The global scope's phases of a pattern, or why it does not apply: every reduce must
    be a single-input one (partials fold with its reducer), no other reduction's result may
    be shared (reduce-window is computed per element as anywhere), at most
    ``MAX_GLOBAL_STAGES`` reduction stages, and at least one reduce with a consumer inside
    or a row partition too coarse to fill the machine (else the block scopes do it)."""
    member_set = set(members)
    stage: dict[int, int] = {}
    reduces: list[int] = []
    for v in sorted(member_set):
        node = graph.nodes[v]
        s = 0
        for o in node.operands:
            if o in member_set:
                s = max(s, stage[o] + (graph.nodes[o].opcode == "reduce"))
        stage[v] = s
        if node.opcode == "reduce":
            if len(node.operands) != 2:
                return f"{node.name}: a variadic reduce has no global partials"
            reduces.append(v)
        elif node.op_class is OpClass.REDUCTION and node.opcode != "reduce-window" and \
                any(u in member_set for u in node.users):
            return f"{node.name} ({node.opcode}) result cannot be shared inside a kernel"
        elif node.opcode == "scatter" and scatter_form(graph, v).kind != "row":
            return f"{node.name}: a scatter with colliding updates ends a block-scope kernel"
    if not reduces:
        return "no reduction: nothing for a grid barrier to separate"
    depth = max(stage[v] for v in reduces) + 1
    if depth > MAX_GLOBAL_STAGES:
        return f"{depth} reduction stages need more than {MAX_GLOBAL_STAGES - 1} grid barriers"
    return GlobalPhases(tuple(tuple(v for v in reduces if stage[v] == k) for k in range(depth)))


def leaf_shape(shape: Shape) -> Shape:
    return next(shape.leaves()) if shape.is_tuple else shape


def physical_order(shape: Shape) -> list[int]:
    """Logical dims from major to minor."""
    return list(reversed(shape.minor_to_major()))


# A row map entry: (dimension of this tensor, the shared-reduction row coordinates it carries
# as (reduction op id, position among that reduction's row dims)).
Label = frozenset[tuple[int, int]]
Entry = tuple[int, Label]
# What an op does to the entries of one operand: (output dim, positions of operand entries).
Mapping = list[tuple[int, tuple[int, ...]]]

# A shared reduction whose block partition collapses to one block is only accepted when one
# block can reduce it quickly: 1024 threads x 32 elements each.
SINGLE_BLOCK_ELEMENTS = 32 * 1024


class RowConflict(Exception):
    """An op cannot keep the given row-map entries apart (positions into the entries)."""

    def __init__(self, positions: tuple[int, ...] | None, reason: str):
        super().__init__(reason)
        self.positions = positions
        self.reason = reason


def _reshape_row_map(src: Shape, dst: Shape, dims: tuple[int, ...]) -> Mapping:
    """Carry row dims through a reshape/bitcast by matching blocks of physical dims with equal
    products. A block that mixes row and non-row dims is a conflict on its row dims."""
    src_order, dst_order = physical_order(src), physical_order(dst)
    src_sizes = [src.dims[d] for d in src_order]
    dst_sizes = [dst.dims[d] for d in dst_order]
    position_of = {src_order.index(d): k for k, d in enumerate(dims)}
    out: Mapping = []
    i = j = 0
    while i < len(src_sizes) or j < len(dst_sizes):
        if i < len(src_sizes) and src_sizes[i] == 1:
            i += 1
            continue
        if j < len(dst_sizes) and dst_sizes[j] == 1:
            j += 1
            continue
        if i >= len(src_sizes) or j >= len(dst_sizes):
            raise RowConflict(None, "reshape sizes do not match")
        si, dj = [i], [j]
        ps, pd = src_sizes[i], dst_sizes[j]
        i, j = i + 1, j + 1
        while ps != pd:
            if ps < pd and i < len(src_sizes):
                ps *= src_sizes[i]
                si.append(i)
                i += 1
            elif ps > pd and j < len(dst_sizes):
                pd *= dst_sizes[j]
                dj.append(j)
                j += 1
            else:
                raise RowConflict(None, "reshape sizes do not match")
        rows = tuple(position_of[x] for x in si if x in position_of)
        if rows and len(rows) != len([x for x in si if src_sizes[x] != 1]):
            raise RowConflict(rows, "reshape merges a row dimension with a non-row one")
        if rows:
            out.extend((dst_order[d], rows) for d in dj)
    return out


def _same(dims: tuple[int, ...], new: list[int] | tuple[int, ...]) -> Mapping:
    return [(d, (k,)) for k, d in enumerate(new)]


def _first(entry: tuple) -> int:
    return entry[0]


# Per graph: (node, operand position, row dims) -> _transfer's mapping or its RowConflict.
# A pure function of the node, asked again for every pattern holding the node (perf only).
_TRANSFERS: "weakref.WeakKeyDictionary[OpGraph, dict]" = weakref.WeakKeyDictionary()


def _transfer_cached(graph: OpGraph, node: OpNode, position: int, dims: tuple[int, ...]
                     ) -> Mapping:
    memo = _TRANSFERS.get(graph)
    if memo is None:
        memo = _TRANSFERS[graph] = {}
    key = (node.id, position, dims)
    got = memo.get(key)
    if got is None:
        try:
            got = _transfer(graph, node, position, dims)
        except RowConflict as conflict:
            got = conflict
        memo[key] = got
    if isinstance(got, RowConflict):
        raise RowConflict(got.positions, got.reason)
    return got


def _transfer(graph: OpGraph, node: OpNode, position: int, dims: tuple[int, ...]) -> Mapping:
    """Where the row dims ``dims`` of operand ``position`` go in ``node``'s output."""
    op = node.opcode
    inst = node.instruction
    src = leaf_shape(graph.nodes[node.operands[position]].shape)
    out_shape = leaf_shape(node.shape)

    def forbid(bad: Iterable[int], what: str) -> None:
        hit = tuple(k for k, d in enumerate(dims) if d in set(bad))
        if hit:
            raise RowConflict(hit, f"{node.name} {what} row dimension(s) "
                              f"{[dims[k] for k in hit]}")

    if op == "reduce":
        if position >= len(node.operands) // 2:
            forbid(dims, "feeds a reduce init value with")
            return []
        reduced = set(inst.ints("dimensions"))
        forbid(reduced, "reduces over")
        kept = [d for d in range(src.rank) if d not in reduced]
        return _same(dims, [kept.index(d) for d in dims])
    if op == "reduce-window":
        if position >= len(node.operands) // 2:
            forbid(dims, "feeds a window init value with")
            return []
        from stitch.hlo.ir import parse_window
        window = parse_window(inst.attrs.get("window", "{}"), src.rank)
        forbid([d for d in dims if (window[d].size, window[d].stride, window[d].pad_low,
                                    window[d].pad_high, window[d].lhs_dilate) != (1, 1, 0, 0, 1)],
               "windows over")
        return _same(dims, dims)
    if op == "broadcast":
        table = inst.ints("dimensions", ())
        return _same(dims, [table[d] for d in dims])
    if op == "transpose":
        perm = list(inst.ints("dimensions"))
        return _same(dims, [perm.index(d) for d in dims])
    if op in ("reshape", "bitcast"):
        return _reshape_row_map(src, out_shape, dims)
    if op == "slice":
        spec = parse_slice(inst.attrs["slice"])
        forbid([d for d in dims if (spec[d].start, spec[d].limit, spec[d].stride)
                != (0, src.dims[d], 1)], "slices")
        return _same(dims, dims)
    if op in ("dynamic-slice", "dynamic-update-slice"):
        data_operands = 1 if op == "dynamic-slice" else 2
        if position >= data_operands:
            forbid(dims, "computes slice offsets from")
            return []
        # The slice (or update) must span every row dimension entirely.
        if op == "dynamic-slice":
            sizes, full = inst.ints("dynamic_slice_sizes"), src.dims
        else:
            sizes, full = leaf_shape(graph.nodes[node.operands[1]].shape).dims, out_shape.dims
        forbid([d for d in dims if sizes[d] != full[d]], "slices")
        return _same(dims, dims)
    if op == "pad":
        if position == 1:
            forbid(dims, "pads with a value carrying")
            return []
        pads = parse_padding(inst.attrs.get("padding", "{}"))
        forbid([d for d in dims if (pads[d].low, pads[d].high, pads[d].interior) != (0, 0, 0)],
               "pads")
        return _same(dims, dims)
    if op == "concatenate":
        forbid([inst.ints("dimensions")[0]], "concatenates along")
        return _same(dims, dims)
    if op == "reverse":
        forbid(inst.ints("dimensions"), "reverses")
        return _same(dims, dims)
    if op == "get-tuple-element":
        return _same(dims, dims)
    if node.op_class in (OpClass.LIGHT, OpClass.EXPENSIVE) or op in ("copy", "convert"):
        if src.rank == out_shape.rank:
            return _same(dims, dims)
        forbid(dims, "broadcasts a scalar carrying")
        return []
    if op == "gather" and position == 0:
        return _gather_rows(graph, node, src, dims, forbid)
    if op == "scatter" and position in (0, 2) and scatter_form(graph, node.id).kind == "row":
        return _scatter_rows(graph, node, position, src, dims, forbid)
    forbid(dims, f"({op}) indexes data-dependently along")
    return []


def _identity_rows(imap: IndexMap, src: Shape, dims: tuple[int, ...], operand_side: bool,
                   forbid) -> dict[int, tuple[int, ...]]:
    """Row dims carried between the identity operand dims of a scatter/gather and its batch:
    {batch position: row positions} when ``operand_side`` (operand rows), else {operand dim:
    row positions} (rows on the updates' batch dims). A block of dims that become one
    another (like a reshape) must be all rows or none."""
    out: dict[int, tuple[int, ...]] = {}
    covered: set[int] = set()
    for operand_dims, batch in imap.blocks():
        side = operand_dims if operand_side else batch
        rows = tuple(k for k, d in enumerate(dims) if d in side)
        covered |= set(side)
        if not rows:
            continue
        if len(rows) != len(side):
            forbid([dims[k] for k in rows], "mixes row and non-row dims in its index of")
        for target in (batch if operand_side else operand_dims):
            out[target] = rows
    # Size-1 row dims carry a single coordinate: nothing to keep apart.
    forbid([d for d in dims if d not in covered and src.dims[d] != 1],
           "indexes data-dependently along")
    return out


def _gather_rows(graph: OpGraph, node: OpNode, src: Shape, dims: tuple[int, ...],
                 forbid) -> Mapping:
    """A gather keeps operand rows apart where their starts are the batch point itself
    (the loss's gather of one logit per row: row r reads row r), or where the slice spans
    the whole dim from 0 (an offset dim of the output)."""
    imap = gather_index_map(graph, node.id)
    if imap is None or not imap.proved:
        forbid(dims, "(gather) indexes data-dependently along")
        return []
    inst = node.instruction
    sizes = inst.ints("slice_sizes")
    removed = set(inst.ints("collapsed_slice_dims", ())) | \
        set(inst.ints("operand_batching_dims", ()))
    loaded = {d for d, _ in imap.data}
    whole = [d for d in dims if d not in imap.identity and d not in loaded
             and d not in removed and sizes[d] == src.dims[d]]
    offset_of = dict(zip([d for d in range(src.rank) if d not in removed],
                         inst.ints("offset_dims", ())))
    mapping: Mapping = [(offset_of[d], (dims.index(d),)) for d in whole]
    batch_out = gather_batch_dims(node)
    rest = tuple(d for d in dims if d not in whole)
    carried = _identity_rows(imap, src, rest, True, forbid)
    mapping += [(batch_out[b], tuple(dims.index(rest[k]) for k in ks))
                for b, ks in carried.items()]
    return mapping


def _scatter_rows(graph: OpGraph, node: OpNode, position: int, src: Shape,
                  dims: tuple[int, ...], forbid) -> Mapping:
    """A scatter whose updates land one per element (form "row"): element p is operand p
    with the update of p's batch point, so operand rows stay where they are and rows on
    the updates' batch dims go to the identity dims."""
    if position == 0:
        return _same(dims, dims)
    imap = scatter_form(graph, node.id).index_map
    assert imap is not None
    batch_dims = scatter_batch_dims(node, graph)
    as_batch = [batch_dims.index(d) if d in batch_dims else -1 for d in dims]
    forbid([d for d, b in zip(dims, as_batch) if b < 0 and src.dims[d] != 1],
           "scatters window rows of")
    keep = [k for k, b in enumerate(as_batch) if b >= 0]
    carried = _identity_rows(imap, Shape(src.element_type, tuple(
        imap.batch_shape)), tuple(as_batch[k] for k in keep), False, forbid)
    return [(d, tuple(keep[k] for k in ks)) for d, ks in carried.items()]


def _atomic_scatter_problem(graph: OpGraph, v: int, member_set: set[int]) -> str | None:
    """A scatter whose updates may collide ends its kernel: its threads walk the updates and
    add them atomically into a buffer that already holds the operand."""
    node = graph.nodes[v]
    form = scatter_form(graph, v)
    if form.kind == "row":
        return None
    if form.kind != "atomic":
        return f"{node.name}: {form.reason}"
    if any(u in member_set for u in node.users):
        return f"{node.name} (scatter with colliding updates) must end its kernel"
    # In column tiles (groups of distinct ids) each block writes its tile of the operand
    # before its updates: the operand may be computed here.
    if node.operands[0] in member_set and grouped_scatter(graph, v) is None:
        return (f"{node.name} (scatter with colliding updates) adds into its operand, which "
                "would have to be complete before any block starts")
    return None


def analyze_pattern(graph: OpGraph, members: Iterable[int], allow_global: bool = False,
                    buildable: bool = True) -> PatternAnalysis:
    """The analysis of a stitchable pattern; raises Infeasible(reason) otherwise.
    ``allow_global``: a pattern the block scopes cannot stitch (its consumers need data
    from every block, reductions partitioning differently) is stitched by the global scope
    (``global_phases``) where that applies; a pattern both can stitch carries both.
    ``buildable``: a member codegen cannot build (``buildable.build_problem``) ends it;
    False only to price a kernel that is not stitch's to build (XLA's own)."""
    members = sorted(set(members))
    try:
        analysis = _analyze_block_scope(graph, members, buildable)
    except Infeasible as exc:
        if not allow_global or isinstance(exc, KernelEnds):
            raise
        phases = global_phases(graph, members)
        if isinstance(phases, str):
            raise Infeasible(f"{exc}; global scope: {phases}") from None
        analysis = PatternAnalysis(components=[members], scope="global")
        analysis.global_phases = phases
        analysis.component_of = {v: 0 for v in members}
        return analysis
    if allow_global and any(graph.nodes[v].opcode == "reduce" for v in members):
        analysis._phases_of = lambda: global_phases(graph, members)
    return analysis



_BOUNDARY_CLASSES = (OpClass.COMPUTE, OpClass.OPAQUE, OpClass.SOURCE)

def _analyze_block_scope(graph: OpGraph, members: list[int], buildable: bool = True
                         ) -> PatternAnalysis:
    """The block scopes' analysis (warp/block units own rows; see ``analyze_pattern``).

    Each shared reduction starts with every kept dimension as a row dimension. When an op
    downstream cannot keep some rows apart (it reduces over them, slices them, joins two
    different partitions...), those row coordinates are dropped from the reductions they
    came from — a block then owns several rows, which is always legal — and the analysis
    runs again. It fails only when a large reduction would collapse into a single block:
    its consumers need data from every block.
    """
    members = sorted(set(members))
    member_set = set(members)
    nodes = graph.nodes
    # One pass (perf only): kernel boundaries raise at once, in member order; the first
    # non-reduce reduction shared inside is raised only after them, as before.
    # A reduce-window is computed per output element by the thread that needs it (thread
    # composition, as XLA's loop fusions do): only reduce results are shared.
    shared_ids: list[int] = []
    unshareable: OpNode | None = None
    for v in members:
        node = nodes[v]
        op_class = node.op_class
        if op_class in _BOUNDARY_CLASSES:
            raise KernelEnds(f"{node.name} ({node.opcode}) is a kernel boundary")
        problem = build_problem(graph, v) if buildable else None
        if problem:
            raise KernelEnds(problem)
        opcode = node.opcode
        if opcode == "scatter":
            problem = _atomic_scatter_problem(graph, v, member_set)
            if problem:
                raise KernelEnds(problem)
        if opcode == "reduce":
            if any(u in member_set for u in node.users):
                shared_ids.append(v)
        elif op_class is OpClass.REDUCTION and opcode != "reduce-window" and \
                unshareable is None and any(u in member_set for u in node.users):
            unshareable = node
    if unshareable is not None:
        raise Infeasible(f"{unshareable.name} ({unshareable.opcode}) result cannot be shared "
                         "inside a kernel")
    dropped: set[tuple[int, int]] = set()
    last_reason = ""
    row_maps: dict[int, tuple[Entry, ...]] = {}
    # Without a shared reduction no row map starts anywhere: nothing to propagate.
    for _ in range(4 * len(members) + 8 if shared_ids else 0):
        try:
            row_maps = _propagate(graph, members, member_set, set(shared_ids), dropped)
        except _Drop as drop:
            if drop.labels <= dropped:
                raise Infeasible(drop.reason) from None
            dropped |= drop.labels
            last_reason = drop.reason
            continue
        break
    else:
        if shared_ids:
            raise Infeasible(last_reason or "row partition does not settle")
    shared: list[SharedReduction] = []
    for v in shared_ids:
        node = graph.nodes[v]
        src = leaf_shape(graph.nodes[node.operands[0]].shape)
        out = leaf_shape(node.shape)
        # The row dims are the ones its row map carries: a reduction downstream of another
        # shared reduction inherits that partition (its own kept dims are not all rows:
        # log-softmax's two-level max then sum(exp) over [rows,128,250] own whole rows).
        kept_rows = [d for d, _ in row_maps.get(v, ())]
        rows = 1
        for k in kept_rows:
            rows *= out.dims[k]
        if rows == 1 and src.num_elements > SINGLE_BLOCK_ELEMENTS:
            raise Infeasible(f"consumers of {node.name} need data from every block "
                             f"(cross-block): {last_reason or 'it reduces to one row'}")
        reduced = node.instruction.ints("dimensions")
        kept = [d for d in range(src.rank) if d not in set(reduced)]
        row_dims_in = [kept[k] for k in kept_rows]
        shared.append(SharedReduction(v, rows, max(src.num_elements // rows, 1),
                                      _rows_are_major(src, row_dims_in)))
    analysis = PatternAnalysis(components=_components(graph, members, member_set), shared=shared)
    for index, comp in enumerate(analysis.components):
        for v in comp:
            analysis.component_of[v] = index
    _check_one_partition(graph, analysis)
    return analysis


def reduction_rows(graph: OpGraph, v: int, analysis: PatternAnalysis) -> tuple[int, bool]:
    """(rows, contiguous?) of the block partition a reduction needs: a shared one's from
    the row maps, a root's from its own kept dimensions."""
    known = next((r for r in analysis.shared if r.node == v), None)
    if known is not None:
        return known.rows, known.minor
    node = graph.nodes[v]
    src = leaf_shape(graph.nodes[node.operands[0]].shape)
    reduced = set(node.instruction.ints("dimensions"))
    order = [d for d in physical_order(src) if src.dims[d] != 1]
    kept = [d for d in order if d not in reduced]
    return leaf_shape(node.shape).num_elements, order[:len(kept)] == kept


def _check_one_partition(graph: OpGraph, analysis: PatternAnalysis) -> None:
    """The locality rule of the schedules: one unit (warp or block) owns a row of every
    reduction of a connected part, so all of them must agree on the partition. Two
    reductions partitioning differently (rows vs columns of the same input, or different
    row counts) would need another block's data."""
    for comp in analysis.components:
        # reduce-window roots are loops (a thread per output window), not row reductions.
        reductions = [v for v in comp if graph.nodes[v].opcode == "reduce"]
        if len(reductions) < 2:
            continue
        parts = {v: reduction_rows(graph, v, analysis)[0] for v in reductions}
        first = reductions[0]
        for v in reductions[1:]:
            # Equal row counts are one partition (unit r owns row r of each), even when one
            # reduction reads its rows contiguously and another strided.
            if parts[v] != parts[first]:
                raise Infeasible(
                    f"{graph.nodes[v].name} and {graph.nodes[first].name} need different "
                    f"block partitions ({parts[v]} vs {parts[first]} rows): no block "
                    "can own a row of both")


class _Drop(Exception):
    def __init__(self, labels: set[tuple[int, int]], reason: str):
        super().__init__(reason)
        self.labels = labels
        self.reason = reason


def _rows_are_major(shape: Shape, row_dims: list[int]) -> bool:
    """A block's rows are contiguous when the row dims lead the physical order."""
    order = [d for d in physical_order(shape) if shape.dims[d] != 1]
    rows = [d for d in row_dims if shape.dims[d] != 1]
    return order[:len(rows)] == rows


# Per graph: (node, operand position, row dims) -> the transfer's mapping sorted by output
# dim (stably, as the row maps are kept) with its output dims, or the RowConflict (perf only:
# ``_propagate`` runs for every pattern scored that shares a reduction).
_SORTED_TRANSFERS: "weakref.WeakKeyDictionary[OpGraph, dict]" = weakref.WeakKeyDictionary()


def _propagate(graph: OpGraph, members: list[int], member_set: set[int], shared: set[int],
               dropped: set[tuple[int, int]]) -> dict[int, tuple[Entry, ...]]:
    memo = _SORTED_TRANSFERS.get(graph)
    if memo is None:
        memo = _SORTED_TRANSFERS[graph] = {}
    nodes = graph.nodes
    row_maps: dict[int, tuple[Entry, ...]] = {}
    row_dims: dict[int, tuple[int, ...]] = {}       # the dims of each row map, in order
    for v in members:
        node = nodes[v]
        result: tuple[Entry, ...] | None = None
        result_dims: tuple[int, ...] = ()
        for position, o in enumerate(node.operands):
            entries = row_maps.get(o)
            if entries is None:
                continue
            key = (v, position, row_dims[o])
            got = memo.get(key)
            if got is None:
                try:
                    mapping = _transfer_cached(graph, node, position, row_dims[o])
                    ordered = sorted(mapping, key=_first)
                    got = (ordered, tuple(d for d, _ in ordered))
                except RowConflict as conflict:
                    got = conflict
                memo[key] = got
            if isinstance(got, RowConflict):
                positions = got.positions
                if positions is None:
                    positions = tuple(range(len(entries)))
                raise _Drop({lab for k in positions for lab in entries[k][1]}, got.reason)
            ordered, out_dims = got
            # (A one-position entry keeps its label set as is: perf only.)
            mapped = tuple([(d, entries[ks[0]][1] if len(ks) == 1
                             else frozenset().union(*(entries[k][1] for k in ks)))
                            for d, ks in ordered])
            if result is None:
                result, result_dims = mapped, out_dims
            elif out_dims != result_dims:
                common = set(out_dims) & set(result_dims)
                odd = {lab for d, labels in mapped + result if d not in common for lab in labels}
                raise _Drop(odd, f"{node.name} joins values partitioned by different rows")
            else:
                result = tuple([(d, a | b) for (d, a), (_, b) in zip(result, mapped)])
        if v in shared and result is None:
            out = leaf_shape(node.shape)
            result = tuple((k, frozenset({(v, k)})) for k in range(out.rank)
                           if (v, k) not in dropped)
        if result is not None:
            # Entries whose every coordinate was dropped no longer partition anything.
            if dropped:
                result = tuple([(d, labels) for d, labels in result if labels - dropped])
            elif not all(labels for _, labels in result):
                result = tuple([(d, labels) for d, labels in result if labels])
            row_maps[v] = result
            row_dims[v] = tuple([d for d, _ in result])
    return row_maps


def infeasible_reason(graph: OpGraph, members: Iterable[int], allow_global: bool = False
                      ) -> str | None:
    """None when the pattern can be stitched (by the block scopes; ``allow_global``: by
    any scope), else why not."""
    try:
        analyze_pattern(graph, members, allow_global)
    except Infeasible as exc:
        return str(exc)
    return None


def _components(graph: OpGraph, members: list[int], member_set: set[int]) -> list[list[int]]:
    """Weakly connected components through edges inside the pattern (in the order of their
    first member, each ascending; ``members`` ascending)."""
    # Union-find inlined (perf only: this runs for every pattern scored).
    parent: dict[int, int] = {}
    nodes = graph.nodes
    for v in members:
        root = v
        for o in nodes[v].operands:
            if o in member_set and o in parent:
                r = o
                while parent[r] != r:
                    parent[r] = parent[parent[r]]
                    r = parent[r]
                if root == v:
                    root = r
                elif r != root:
                    parent[r] = root
        parent[v] = root
    groups: dict[int, list[int]] = {}
    for v in members:
        r = v
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        got = groups.get(r)
        if got is None:
            groups[r] = [v]
        else:
            got.append(v)
    return list(groups.values())
