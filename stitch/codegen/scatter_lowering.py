"""Scatters whose updates may collide, lowered at the end of their kernel.

Three forms, tried in order: column tiles (``hlo.grouped_scatter``: a block owns a
tile of element columns over a range of operand rows and combines each group of distinct
ids with plain loads and stores), runs over sorted ids (``hlo.sorted_runs``: a work
item combines a run of equal ids and adds the run's result atomically), and plain atomic
adds (threads walk the update elements grid-stride; an update whose window is not wholly
inside the operand is skipped, as XLA does).
"""
from __future__ import annotations

from dataclasses import dataclass

from stitch.hlo.graph import OpGraph, OpNode
from stitch.hlo.grouped_scatter import UNROLL_ROWS, GroupedScatter, grouped_scatter
from stitch.hlo.ir import Shape
from stitch.hlo.scatter_forms import scatter_batch_dims, scatter_window
from stitch.hlo.sorted_runs import RunScatter, run_scatter

from . import kir
from .errors import CodegenError
from .statement_order import loads_first
from .values import ValueEmitter, delinearize, iadd, idiv, imul, irem, leaf, linearize

_c = kir.i32


@dataclass(frozen=True)
class ScatterSite:
    """One scatter to generate: its node ``v`` in ``graph``, the kernel's buffer it writes,
    the kernel's threads per block and the scatter's combiner (``add``, ``maximum``...)."""
    graph: OpGraph
    v: int
    buffer: kir.Param
    block: int
    combiner: str | None


@dataclass(frozen=True)
class _ScatterParts:
    """A scatter's operands (node ids), its result, update and indices shapes and its
    index vector dim: what every scatter lowering starts from."""
    node: OpNode
    operand: int
    indices: int
    update: int
    shape: Shape
    ushape: Shape
    ishape: Shape
    vector_dim: int

    @staticmethod
    def of(graph: OpGraph, v: int) -> "_ScatterParts":
        node = graph.nodes[v]
        operand, indices, update = node.operands
        return _ScatterParts(node, operand, indices, update, leaf(node.shape),
                             leaf(graph.nodes[update].shape),
                             leaf(graph.nodes[indices].shape),
                             node.instruction.int("index_vector_dim"))


def _window_offsets(inst, rank: int, u: tuple[kir.Expr, ...]) -> dict[int, kir.Expr]:
    """Operand dim -> the offset inside the update window of scatter ``inst`` at update
    index ``u`` (the dims the window spans: all but inserted and batching dims)."""
    skipped = set(inst.ints("inserted_window_dims", ())) | \
        set(inst.ints("input_batching_dims", ()))
    spanned = [d for d in range(rank) if d not in skipped]
    return {d: u[p] for p, d in zip(inst.ints("update_window_dims", ()), spanned)}


def emit_scatter(em: ValueEmitter, site: ScatterSite, bid: kir.Expr, blocks: int) -> None:
    """Threads walk the update elements (grid-stride): element u of update batch b goes
    to operand position start(b) + window(u) when b's whole window lies inside the
    operand (XLA skips the others), added atomically (updates may collide). A
    scatter-add over sorted ids is added in runs (``emit_run_scatter``)."""
    graph, v = site.graph, site.v
    tiles = grouped_scatter(graph, v)
    if tiles is not None:
        emit_grouped_scatter(em, site, bid, blocks, tiles)
        return
    runs = run_scatter(graph, v)
    if runs is not None:
        emit_run_scatter(em, site, bid, blocks, runs)
        return
    parts = _ScatterParts.of(graph, v)
    node, inst = parts.node, parts.node.instruction
    indices_id, update_id = parts.indices, parts.update
    shape, ushape, ishape = parts.shape, parts.ushape, parts.ishape
    window = scatter_window(graph, node)
    vector_dim = parts.vector_dim
    tpb = site.block
    gtid = em.let("gtid", iadd(imul(bid, tpb), kir.ThreadIdx()))
    var = em.fresh("u")
    em.push(var)
    u = delinearize(kir.Ref(var, "i32"), ushape.dims)
    batch = [u[p] for p in scatter_batch_dims(node, graph)]
    offsets = _window_offsets(inst, shape.rank, u)
    starts: dict[int, kir.Expr] = {}
    for k, d in enumerate(inst.ints("scatter_dims_to_operand_dims", ())):
        at = list(batch)
        if vector_dim < ishape.rank:
            at.insert(vector_dim, _c(k))
        start = em.value(indices_id, tuple(at))
        starts[d] = start if start.dtype == "i64" else kir.Convert(start, "i64")
    batch_dims = [d for d in range(ishape.rank) if d != vector_dim]
    for d, idim in zip(inst.ints("input_batching_dims", ()),
                       inst.ints("scatter_indices_batching_dims", ())):
        starts[d] = kir.Convert(batch[batch_dims.index(idim)], "i64")
    inside: list[kir.Expr] = []
    position: list[kir.Expr] = []
    for d in range(shape.rank):
        start = starts.get(d, kir.i64(0))
        if window[d] > shape.dims[d]:
            inside.append(kir.Const(False, "i1"))       # never inside: every update skipped
        elif d in starts:
            start = em.let("start", start)
            inside += [kir.Compare("ge", start, kir.i64(0)),
                       kir.Compare("le", start, kir.i64(shape.dims[d] - window[d]))]
        offset = offsets.get(d, _c(0))
        position.append(iadd(kir.Convert(start, "i32"), offset) if d in starts else offset)
    em.push()
    value = em.value(update_id, u)
    em.emit(kir.AtomicAdd(site.buffer.name, linearize(tuple(position), shape.dims), value))
    add = em.pop()
    if inside:
        cond = inside[0]
        for c in inside[1:]:
            cond = kir.Binary("and", cond, c)
        em.emit(kir.If(cond, add))
    else:
        for stmt in add:
            em.emit(stmt)
    em.emit(kir.For(var, gtid, _c(ushape.num_elements), _c(blocks * tpb), em.pop()))

def emit_run_scatter(em: ValueEmitter, site: ScatterSite, bid: kir.Expr, blocks: int,
                     runs: RunScatter) -> None:
    """``stitch.hlo.sorted_runs``: work item (column j, chunk k) combines update
    rows k*R .. k*R + R-1 of element column j while their id stays the same, and
    combines each run's result atomically at its row (an atomic add, a compare-and-swap
    loop for max/min; skipped where the id lies outside the operand)."""
    parts = _ScatterParts.of(site.graph, site.v)
    inst = parts.node.instruction
    indices_id, update_id = parts.indices, parts.update
    shape, ushape, ishape = parts.shape, parts.ushape, parts.ishape
    vector_dim = parts.vector_dim
    rows, per_run = runs.rows, runs.run_rows
    tpb = site.block
    gtid = em.let("gtid", iadd(imul(bid, tpb), kir.ThreadIdx()))
    item = em.fresh("run")
    em.push(item)
    column = em.let("column", irem(kir.Ref(item, "i32"), runs.width))
    first = em.let("first", imul(idiv(kir.Ref(item, "i32"), runs.width), per_run))
    last = em.let("last", kir.Binary("min", iadd(first, _c(per_run)), _c(rows)))
    window = delinearize(column, tuple(ushape.dims[1:]))

    def update_index(b: kir.Expr) -> tuple[kir.Expr, ...]:
        return (b,) + tuple(window)

    def row_id(b: kir.Expr) -> kir.Expr:
        at = [b]
        if vector_dim < ishape.rank:
            at.insert(vector_dim, _c(0))
        got = em.value(indices_id, tuple(at))
        return got if got.dtype == "i64" else kir.Convert(got, "i64")

    offsets = _window_offsets(inst, shape.rank, update_index(_c(0)))

    def add_run(row: kir.Expr, total: kir.Expr) -> kir.Stmt:
        position = [iadd(kir.Convert(row, "i32"), offsets.get(0, _c(0)))] + \
            [offsets.get(d, _c(0)) for d in range(1, shape.rank)]
        inside = kir.Binary("and", kir.Compare("ge", row, kir.i64(0)),
                            kir.Compare("le", row, kir.i64(shape.dims[0] - 1)))
        return kir.If(inside, (kir.AtomicAdd(site.buffer.name,
                                             linearize(tuple(position), shape.dims),
                                             total, runs.op),))

    current, total = em.fresh("row"), em.fresh("total")
    first_id = row_id(first)
    first_value = em.value(update_id, update_index(first))
    em.emit(kir.Local(current, "i64", first_id))
    em.emit(kir.Local(total, first_value.dtype, first_value))
    row = em.fresh("b")
    em.push(row)
    b = kir.Ref(row, "i32")
    next_id = em.let("id", row_id(b))
    value = em.value(update_id, update_index(b))
    here, sum_ = kir.Ref(current, "i64"), kir.Ref(total, first_value.dtype)
    em.emit(kir.If(kir.Compare("ne", next_id, here),
                   (add_run(here, sum_), kir.Assign(current, next_id),
                    kir.Assign(total, value)),
                   (kir.Assign(total, kir.Binary(runs.op, sum_, value)),)))
    em.emit(kir.For(row, iadd(first, _c(1)), last, _c(1), em.pop()))
    em.emit(add_run(here, sum_))
    em.emit(kir.For(item, gtid, _c(runs.runs), _c(blocks * tpb), em.pop()))

def emit_grouped_scatter(em: ValueEmitter, site: ScatterSite, bid: kir.Expr, blocks: int,
                         tiles: GroupedScatter) -> None:
    """``stitch.hlo.grouped_scatter``: a block takes work items (a tile of
    ``tiles.tile`` element columns over a range of operand rows) one after another;
    lane ``t % tile`` of the block owns a column, slot ``t // tile`` strides over rows.
    It stores the operand's values of the tile, then each group in turn: every update
    row of the group whose id lies in the range is combined into its row with a plain
    load and store (ids are distinct within a group), a block barrier after each."""
    parts = _ScatterParts.of(site.graph, site.v)
    node = parts.node
    operand_id, indices_id, update_id = parts.operand, parts.indices, parts.update
    shape, ushape, ishape = parts.shape, parts.ushape, parts.ishape
    vector_dim = parts.vector_dim
    kind = site.combiner
    op = {"add": "add", "multiply": "mul", "maximum": "max", "minimum": "min"}.get(kind)
    tpb = site.block
    if op is None or tpb % tiles.tile:
        raise CodegenError(f"{node.name}: column tiles of {tiles.tile} need a {kind!r} "
                           f"combiner and a block size divisible by them (block {tpb})")
    slots = tpb // tiles.tile
    buffer = site.buffer
    element = shape.element_type
    lane = em.let("lane", irem(kir.ThreadIdx(), tiles.tile))
    slot = em.let("slot", idiv(kir.ThreadIdx(), tiles.tile))
    item = em.fresh("item")
    em.push(item)
    it = kir.Ref(item, "i32")
    column = em.let("column", iadd(imul(irem(it, tiles.tiles), tiles.tile), lane))
    low = em.let("low", imul(idiv(it, tiles.tiles), tiles.range_rows))
    high = em.let("high", kir.Binary("min", iadd(low, _c(tiles.range_rows)),
                                     _c(tiles.operand_rows)))
    has_column = kir.Compare("lt", column, _c(tiles.width))
    row_dims = tuple(shape.dims[1:])
    update_dims = tuple(ushape.dims[1:])

    def at(row: kir.Expr) -> tuple[kir.Expr, ...]:
        return (row,) + tuple(delinearize(column, row_dims))

    # The operand's values of the tile.
    row = em.fresh("r")
    em.push(row)
    r = kir.Ref(row, "i32")
    em.push()
    em.emit(kir.Store(buffer.name, linearize(at(r), shape.dims),
                      em.value(operand_id, at(r))))
    em.emit(kir.If(has_column, em.pop()))
    em.emit(kir.For(row, iadd(low, slot), high, _c(slots), em.pop()))
    em.emit(kir.Barrier())
    # The groups in order, a barrier after each. A thread walks its rows of a group in
    # chunks of UNROLL_ROWS: the chunk's ids, then its updates (clamped to a valid row
    # and column, so always loadable), then the read-modify-writes of the rows that hit.
    group = em.fresh("g")
    em.push(group)
    first = em.let("first", imul(kir.Ref(group, "i32"), tiles.group_rows))
    end = iadd(first, _c(tiles.group_rows))
    last_row = iadd(first, _c(tiles.group_rows - 1))
    safe_column = kir.Binary("min", column, _c(tiles.width - 1))
    chunk = em.fresh("chunk")
    em.push(chunk)
    base = em.let("base", iadd(iadd(first, slot),
                               imul(kir.Ref(chunk, "i32"), slots * UNROLL_ROWS)))
    hits, targets, updates = [], [], []
    for k in range(UNROLL_ROWS):
        b = em.let("b", iadd(base, _c(k * slots)))
        valid = kir.Compare("lt", b, end)
        row_b = em.let("row", kir.Binary("min", b, last_row))
        at_index = [row_b]
        if vector_dim < ishape.rank:
            at_index.insert(vector_dim, _c(0))
        got = em.value(indices_id, tuple(at_index))
        target = em.let("id", got if got.dtype == "i64" else kir.Convert(got, "i64"))
        hits.append(em.let("hit", kir.Binary("and", kir.Binary("and", valid, has_column),
                                             kir.Binary("and", kir.Compare(
                                                 "ge", target, kir.Convert(low, "i64")),
                                                 kir.Compare("lt", target,
                                                             kir.Convert(high, "i64"))))))
        targets.append(target)
        updates.append(em.let("update", em.value(
            update_id, (row_b,) + tuple(delinearize(safe_column, update_dims)))))
    for hit, target, update in zip(hits, targets, updates):
        em.push()
        offset = em.let("at", linearize(at(kir.Convert(target, "i32")), shape.dims))
        combined = kir.Binary(op, kir.Load(buffer, offset), update)
        if element in ("f16", "bf16") and combined.dtype == "f32":
            combined = kir.Unary(f"round_to_{element}", combined)
        em.emit(kir.Store(buffer.name, offset, combined))
        em.emit(kir.If(hit, em.pop()))
    em.emit(kir.For(chunk, _c(0), _c(tiles.chunks(tpb)), _c(1), loads_first(em.pop())))
    em.emit(kir.Barrier())
    em.emit(kir.For(group, _c(0), _c(tiles.groups), _c(1), em.pop()))
    em.emit(kir.For(item, bid, _c(tiles.items), _c(blocks), em.pop()))
