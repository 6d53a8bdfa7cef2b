"""Lowering of a stitched kernel's schedule (``stitch.schedule.KernelSchedule``) to Kernel IR.

Per part of the schedule (kernel packing: a part owns a range of the grid's blocks):

- *thread composition* (loop parts, ``unit == "thread"`` row parts): a grid-stride loop
  per written value; each element is computed by index propagation (``values.py``), a
  reduction by a loop of the thread itself;
- *warp composition*, contiguous ("minor") rows: one row per warp; each reduction is
  accumulated by the 32 lanes (strided over the row) and finished with a shuffle
  butterfly, so every lane holds the row's result in a register; per-row ops (e.g. rsqrt
  of the variance) are computed once per row; consumer elements of the row are then
  computed by the warp's lanes;
- *block composition*, minor rows: one row per block; warp results go through shared
  memory (partials, a barrier, every thread combines them), then the same as a warp;
- a *split row reduction* (XLA GPU's reduce over b of [rows, a, b], then over a, both with
  the same combiner and identity inits, the partials read by nothing else) is lowered as
  one reduction over the row's a*b elements: the warp's or block's threads stride over
  them (consecutive threads, consecutive elements), not one serial partial per thread;
- column rows (rows strided in memory, e.g. a reduction over dim 0): lanes own
  consecutive rows, so loads are coalesced across the warp. A warp gives each thread a row
  of its own (no collectives); a block owns 32 rows (column tiling): lane l works on row
  32 b + l, the warps stride over its elements, and the warps' partials meet in shared
  memory (a slot per warp and row, a barrier, each thread folds its row's slots, a
  barrier before the buffer is reused).

A part of kind "global" (the global stitching scope: a persistent kernel with grid barriers
between reduction stages, partials in global scratch) is lowered by ``lower_global.py``.

Warp/block composition is lowered where the part's row layout is proven on index arrays
(``row_layout``). Reductions with several outputs per row are reduced per element by the
threads that need them, row-independent written values by all the part's threads. Where no
layout is proven the part is lowered with thread composition and ``LoweredKernel.notes``
says why (always legal: threads recompute what they need).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np

from stitch.hlo import combiners
from stitch.hlo.evaluator.dtypes import numpy_dtype
from stitch.hlo.evaluator.interpreter import Evaluator
from stitch.hlo.graph import OpGraph, OpNode
from stitch.hlo.ir import HloModule, Shape
from stitch.hlo.literals import literal_to_numpy
from stitch.hlo.op_classes import OpClass
from stitch.hlo.grouped_scatter import grouped_scatter
from stitch.hlo.sorted_runs import run_scatter
from stitch.hlo.scatter_forms import scatter_form

from . import kir
from .errors import CodegenError
from .row_layout import WARP_REDUCERS, RowLayout, RowLayoutProof
from .row_mapping import RowSplit, RowUnit, kept_dims
from .scatter_lowering import ScatterSite, emit_scatter
from .statement_order import loads_first
from .values import (ValueEmitter, delinearize, iadd, imul, leaf, logical_index,
                     physical_offset, storage_dtype)

log = logging.getLogger(__name__)

_c = kir.i32


def _group(first: tuple[kir.Expr, ...], dims: tuple[int, ...], step_dim: int | None,
           width: int, index_of) -> list[tuple[kir.Expr, ...]]:
    """The indices of a thread's ``width`` consecutive elements whose first is at index
    ``first``: offsets added on ``step_dim`` (the group lies inside one run of it), else
    ``index_of(j)`` for each (the digits may carry)."""
    if step_dim is None:
        return [index_of(j) for j in range(width)]
    return [first[:step_dim] + (iadd(first[step_dim], _c(j)),) + first[step_dim + 1:]
            for j in range(width)]


@dataclass
class LoweredKernel:
    kernel: kir.Kernel
    inputs: list[int]               # node ids whose values the kernel reads, param order
    outputs: list[int]              # node ids the kernel writes, after the inputs
    schemes: list[str]              # per part: "thread" | "warp" | "block" as lowered
    notes: list[str] = field(default_factory=list)
    # Written values whose buffer must hold a copy of an input before the launch (output
    # node -> input node): a scatter whose colliding updates are added atomically in place.
    initial: dict[int, int] = field(default_factory=dict)
    # Params (node ids) whose buffer is laid out by stitch (``stitch.schedule.layouts``):
    # logical dims, major to minor. Every other buffer is row-major.
    layouts: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # Unit reductions lowered as one walk over a split row (``_split_row_source``): the
    # reduction's name -> how many levels were merged into it.
    split_rows: dict[str, int] = field(default_factory=dict)


def _literal(node: OpNode) -> np.ndarray:
    shape = leaf(node.shape)
    return literal_to_numpy(node.instruction.literal, shape, numpy_dtype(shape.element_type))


def _constant_scalar(node: OpNode) -> object | None:
    if node.opcode != "constant" or leaf(node.shape).rank != 0 or node.instruction.literal is None:
        return None
    shape = leaf(node.shape)
    item = _literal(node).reshape(()).item()
    return bool(item) if shape.element_type == "pred" else item


def _identity(kind: str, element_type: str) -> object:
    """The init that leaves a value unchanged under reducer ``kind`` (None: none known)."""
    dtype = numpy_dtype(element_type)
    if kind == "add":
        return 0
    if kind == "multiply":
        return 1
    if kind in ("maximum", "minimum"):
        if dtype.kind == "f":
            return -math.inf if kind == "maximum" else math.inf
        if dtype.kind in "iu":
            info = np.iinfo(dtype)
            return int(info.min if kind == "maximum" else info.max)
    return None


class _KernelBuilder:
    def __init__(self, graph: OpGraph, evaluator: Evaluator, schedule, name: str,
                 in_place: bool = False, layouts: dict[int, tuple[int, ...]] | None = None):
        self.in_place = in_place
        self.graph = graph
        self.evaluator = evaluator
        self.schedule = schedule
        self.name = name
        self.members = frozenset(schedule.members)
        self.notes: list[str] = []
        self.split_rows: dict[str, int] = {}
        self.shared_sizes: dict[str, int] = {}      # dtype -> elements of its partials
        self.params: dict[int, kir.Param] = {}
        self.inputs: list[int] = []
        self.outputs: list[int] = []
        # A get-tuple-element of a tuple made outside (a while's results) is read from
        # its own buffer: the kernel computes only from array values.
        taken = frozenset(v for v in self.members if graph.nodes[v].opcode == "get-tuple-element"
                          and any(o not in self.members or graph.nodes[o].shape.is_tuple
                                  for o in graph.nodes[v].operands))
        for v in sorted(taken):
            inner = [o for o in graph.nodes[v].operands if o in self.members]
            if inner:
                # Its tuple is made in this kernel (a tuple copy): reading the element from a
                # buffer would need the kernel's own result first.
                raise CodegenError(f"{graph.nodes[v].name}: get-tuple-element of the tuple "
                                   f"{graph.nodes[inner[0]].name}, which this kernel computes")
            self._param(v, False)
            self.inputs.append(v)
        self.computed = self.members - taken
        members = self.computed
        outputs = set(graph.outputs)
        for v in sorted(members):
            for o in graph.nodes[v].operands:
                if o not in members and o not in self.params and \
                        _constant_scalar(graph.nodes[o]) is None:
                    self._param(o, False)
                    self.inputs.append(o)
        for v in sorted(members):
            node = graph.nodes[v]
            if node.op_class is OpClass.SOURCE:
                continue
            if v in outputs or any(u not in members for u in node.users):
                self._param(v, True)
                self.outputs.append(v)
        # Scatters generated in column tiles (``scatter_lowering``): no initial copy.
        self.tiled: set[int] = set()
        self.atomic = self._atomic_scatters()
        self.layouts = self._check_layouts(layouts or {})
        self.layout_proof = RowLayoutProof(graph, evaluator, schedule.block, self.outputs,
                                           self.reducer_kind)

    def _check_layouts(self, layouts: dict[int, tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
        """The given layouts of this kernel's params (identity layouts dropped); a layout
        that is not a permutation of the value's dims, or one of an atomic scatter's
        buffers, is refused."""
        mine: dict[int, tuple[int, ...]] = {}
        for v, layout in layouts.items():
            if v not in self.params:
                continue
            layout = tuple(layout)
            rank = leaf(self.graph.nodes[v].shape).rank
            if sorted(layout) != list(range(rank)):
                raise CodegenError(f"{self.graph.nodes[v].name}: layout {layout} is not a "
                                   f"permutation of {rank} dims")
            if layout == tuple(range(rank)):
                continue
            if v in self.atomic or v in self.atomic.values() or v in self.tiled:
                raise CodegenError(f"{self.graph.nodes[v].name}: an atomic scatter's buffer "
                                   "keeps the row-major layout")
            mine[v] = layout
        return mine

    def output_offset(self, v: int, logical: kir.Expr) -> kir.Expr:
        """Where the element at row-major offset ``logical`` of written value v goes in its
        buffer (v's layout)."""
        layout = self.layouts.get(v)
        if layout is None:
            return logical
        dims = leaf(self.graph.nodes[v].shape).dims
        return physical_offset(delinearize(logical, dims), dims, layout)

    def _atomic_scatters(self) -> dict[int, int]:
        """Scatters whose updates may collide (form "atomic"): scatter -> its operand. The
        kernel ends at them: threads walk the updates and add them atomically into the
        written buffer, which starts as a copy of the operand (``LoweredKernel.initial``)."""
        graph = self.graph
        found: dict[int, int] = {}
        for v in sorted(self.computed):
            node = graph.nodes[v]
            if node.opcode != "scatter" or scatter_form(graph, v).kind == "row":
                continue
            form = scatter_form(graph, v)
            if form.kind != "atomic":
                raise CodegenError(f"{node.name}: scatter not generated ({form.reason})")
            # Colliding assignments keep an unspecified one in XLA: only add is generated
            # (stitch.hlo.combiners' rule, which the planner's feasibility asks too);
            # in column tiles the updates of an element meet in order, without atomics.
            tiled = grouped_scatter(graph, v) is not None
            problem = combiners.scatter_problem(self.reducer_kind(node), not tiled,
                                                leaf(node.shape).element_type,
                                                run_scatter(graph, v) is not None)
            if problem:
                raise CodegenError(f"{node.name}: {problem}")
            if v not in self.outputs or any(u in self.computed for u in node.users):
                raise CodegenError(f"{node.name}: a scatter with colliding updates must end "
                                   "its kernel (its result is complete only after every block)")
            if tiled:
                # Column tiles: each block writes its tile of the operand itself.
                self.tiled.add(v)
                continue
            operand = node.operands[0]
            if operand in self.computed:
                raise CodegenError(f"{node.name}: the scatter's operand is computed in the same "
                                   "kernel (it must be in the buffer before any update lands)")
            if operand not in self.params:
                self._param(operand, False)
                self.inputs.append(operand)
            if not self.in_place:
                raise CodegenError(f"{node.name}: scatter with colliding updates needs its "
                                   "output buffer to start as the operand (in_place lowering)")
            found[v] = operand
        return found

    def _param(self, v: int, is_output: bool) -> None:
        node = self.graph.nodes[v]
        if node.shape.is_tuple and sum(1 for _ in node.shape.leaves()) > 1:
            # A buffer is one array; read or written whole (a copy of a sort's tuple), a
            # tuple would be bound as its first leaf only. Such a kernel runs through the
            # evaluator (refused here, at compile time, never at the call).
            raise CodegenError(f"{node.name}: a kernel {'output' if is_output else 'input'} "
                               f"that is a tuple of several arrays ({node.shape})")
        shape = leaf(node.shape)
        if shape.num_elements == 0:
            # An empty buffer (a gather's s32[0] indices) has no element to bind; such a
            # kernel runs through the evaluator.
            raise CodegenError(f"{node.name}: a kernel {'output' if is_output else 'input'} "
                               f"with no elements ({shape})")
        name = f"{'out' if is_output else 'in'}{len(self.params)}_" + "".join(
            ch if ch.isalnum() else "_" for ch in node.name)[:40]
        self.params[v] = kir.Param(name, storage_dtype(shape), max(shape.num_elements, 1),
                                   is_output)

    def reducer_kind(self, node: OpNode) -> str | None:
        comp = node.instruction.attrs.get("to_apply")
        return self.evaluator.binary_kind(comp) if comp else None

    def emitter(self) -> ValueEmitter:
        em = ValueEmitter(self.graph, self.computed, self.params.get, self.reducer_kind,
                          _constant_scalar)
        em.layouts = {v: layout for v, layout in self.layouts.items() if v in self.inputs}
        return em

    # --- parts ---------------------------------------------------------------------------
    def build(self) -> LoweredKernel:
        sched = self.schedule
        if any(p.kind == "global" for p in sched.parts):
            return self._build_global()
        body: list[kir.Stmt] = []
        schemes = []
        # A written value in no part (a free op, e.g. a reshape of a parameter the module
        # returns) is stored by the part with the most blocks: it depends on no part.
        owned = set().union(*(p.members for p in sched.parts))
        orphans = [v for v in self.outputs if v not in owned]
        host_part = max(range(len(sched.parts)), key=lambda i: sched.parts[i].blocks) \
            if sched.parts else -1
        for index, part in enumerate(sched.parts):
            written = [v for v in self.outputs if v in set(part.members)]
            if index == host_part:
                written += orphans
            atomic = [v for v in written if v in self.atomic or v in self.tiled]
            written = [v for v in written if v not in atomic]
            self._check_vector_width(index, part)
            em = self.emitter()
            em.push()
            local_block = kir.Binary("sub", kir.BlockIdx(), _c(part.block_offset)) \
                if part.block_offset else kir.BlockIdx()
            bid = em.let("block", local_block)
            scheme = "thread"
            if part.kind == "row" and part.unit in ("warp", "block"):
                layout = self.layout_proof.proved(part)
                if isinstance(layout, RowLayout):
                    scheme = part.unit
                    self._unit_part(em, part, layout, written, bid)
                else:
                    self.notes.append(f"part {index} ({part.unit} composition) lowered with "
                                      f"thread composition: {layout}")
            if scheme == "thread":
                self._thread_part(em, part, written, bid)
            # The updates are walked in any order: no value may come from a unit's row
            # (the row proof already refuses atomic scatters in warp/block parts).
            em.overrides.clear()
            for v in atomic:
                emit_scatter(em, ScatterSite(self.graph, v, self.params[v], sched.block,
                                             self.reducer_kind(self.graph.nodes[v])),
                             bid, part.blocks)
            schemes.append(scheme)
            stmts = em.pop()
            if len(sched.parts) > 1:
                inside = kir.Binary("and",
                                    kir.Compare("ge", kir.BlockIdx(), _c(part.block_offset)),
                                    kir.Compare("lt", kir.BlockIdx(),
                                                _c(part.block_offset + part.blocks)))
                body.append(kir.If(inside, stmts))
            else:
                body.extend(stmts)
        params = [self.params[v] for v in self.inputs] + [self.params[v] for v in self.outputs]
        shared = [kir.Shared(f"partials_{dtype}", dtype, size)
                  for dtype, size in sorted(self.shared_sizes.items())]
        kernel = kir.Kernel(self.name, params, shared, sched.grid, sched.block, body,
                            register_budget=register_budget(sched))
        return LoweredKernel(kernel, list(self.inputs), list(self.outputs), schemes, self.notes,
                             dict(self.atomic), dict(self.layouts), dict(self.split_rows))

    def _build_global(self) -> LoweredKernel:
        """A global-scope kernel: phases and grid barriers (``lower_global``)."""
        from .lower_global import GlobalLowering
        sched = self.schedule
        if len(sched.parts) != 1:
            raise CodegenError(f"kernel {self.name}: a global-scope kernel has one part")
        if self.atomic or self.tiled:
            raise CodegenError(f"kernel {self.name}: atomic scatters are not generated in a "
                               "global-scope kernel")
        body, scratch = GlobalLowering(self, sched.parts[0]).body()
        params = [self.params[v] for v in self.inputs] + [self.params[v] for v in self.outputs]
        shared = [kir.Shared(f"partials_{dtype}", dtype, size)
                  for dtype, size in sorted(self.shared_sizes.items())]
        kernel = kir.Kernel(self.name, params, shared, sched.grid, sched.block, body, scratch)
        return LoweredKernel(kernel, list(self.inputs), list(self.outputs), ["global"],
                             self.notes, {}, dict(self.layouts))

    def _thread_part(self, em: ValueEmitter, part, written: list[int], bid: kir.Expr) -> None:
        tpb = self.schedule.block
        gtid = em.let("gtid", iadd(imul(bid, tpb), kir.ThreadIdx()))
        for v in written:
            self._strided_store(em, v, gtid, part.blocks * tpb, part)

    # --- vector widths ---------------------------------------------------------------------
    def _check_vector_width(self, index: int, part) -> None:
        """The schedule's vector width is one codegen can honour: the tuner offers vw > 1
        only where a part's element count (loops) or row length (contiguous rows) is a
        multiple of it, and never for column rows (their lanes own rows, not elements)."""
        vw = part.vector_width
        if vw < 1 or vw & (vw - 1):
            raise CodegenError(f"kernel {self.name} part {index}: vector width {vw} is not a "
                               "power of two")
        if vw == 1 or part.kind == "global":
            return
        if part.kind == "row" and not part.minor:
            raise CodegenError(f"kernel {self.name} part {index}: vector width {vw} on column "
                               "rows (lanes own rows there: width 1)")
        count = part.row_length if part.kind == "row" else part.rows
        if count % vw:
            raise CodegenError(f"kernel {self.name} part {index}: {count} "
                               f"{'row elements' if part.kind == 'row' else 'elements'} are "
                               f"not a multiple of vector width {vw}")

    def _width(self, part, count: int, what: str) -> int:
        """Elements a thread takes at once on a walk over ``count`` elements (per row or in
        all): the part's vector width, or for a walk it does not divide (a written value
        smaller than the part's largest) the widest power of two that divides both."""
        vw = max(part.vector_width, 1)
        width = math.gcd(vw, max(count, 1))
        if width != vw:
            self.notes.append(f"{what}: {count} elements walked {width} at a time, not "
                              f"{vw} (the part's vector width does not divide them)")
        return width

    def _unit_part(self, em: ValueEmitter, part, layout: "RowLayout", written: list[int],
                   bid: kir.Expr) -> None:
        graph = self.graph
        tpb = self.schedule.block
        rows = part.rows
        tid = kir.ThreadIdx()
        unit = RowUnit.of(part, tpb, em, bid)
        # Every warp runs the collectives (uniform control flow); a unit past the last row
        # works on the last row and stores nothing.
        rowc = em.let("rowc", kir.Binary("min", unit.row, _c(rows - 1)))
        valid = em.let("valid", kir.Compare("lt", unit.row, _c(rows)))
        for v in sorted(part.members):
            node = graph.nodes[v]
            if v in layout.reductions:
                result = self._unit_reduce(em, node, unit, rowc, rows, part)
                em.overrides[v] = lambda idx, r=result: r
                if v in written:
                    em.push()
                    em.emit(kir.Store(self.params[v].name, self.output_offset(v, rowc), result))
                    store = em.pop()
                    owner = kir.Compare("eq", unit.first, _c(0))
                    em.emit(kir.If(kir.Binary("and", valid, owner), store))
            elif v in layout.per_row:
                # A per-row value (sub-root): computed once per row, not per element.
                value = em.value(v, delinearize(rowc, leaf(node.shape).dims))
                em.overrides[v] = lambda idx, r=value: r
        for v in written:
            if v in layout.reductions:
                continue
            shape = leaf(graph.nodes[v].shape)
            split = layout.splits.get(v)
            if split is None:
                # Independent of every row: the part's threads share it out element-wise.
                self._strided_store(em, v, iadd(imul(bid, tpb), tid), part.blocks * tpb,
                                    part)
                continue
            width = self._width(part, split.per_row, graph.nodes[v].name)
            var = em.fresh("j")
            em.push(var)
            first = imul(kir.Ref(var, "i32"), width)
            indices = _group(split.index(rowc, first, shape.dims), shape.dims,
                             split.step_dim(shape.dims, width), width,
                             lambda j: split.index(rowc, iadd(first, _c(j)), shape.dims))
            values = [em.value(v, index) for index in indices]
            em.push()
            for index, value in zip(indices, values):
                em.emit(kir.Store(self.params[v].name,
                                  physical_offset(index, shape.dims, self.layouts.get(v)),
                                  value))
            store = em.pop()
            em.emit(kir.If(valid, store))
            loop = loads_first(em.pop())
            em.emit(kir.For(var, unit.first, _c(split.per_row // width), _c(unit.step), loop))

    def _strided_store(self, em: ValueEmitter, v: int, start: kir.Expr, threads: int,
                       part=None) -> None:
        """Threads ``start``, ``start + threads``, ... each write ``width`` consecutive
        elements of v per step (step s: elements width*s .. width*s + width-1; the part's
        vector width, 1 without a part), as the schedule's vector width assumes:
        straight-line accesses at provably consecutive, aligned offsets, which the NVPTX
        back end merges into vector loads and stores."""
        shape = leaf(self.graph.nodes[v].shape)
        n = max(shape.num_elements, 1)
        width = 1 if part is None else self._width(part, n, self.graph.nodes[v].name)
        layout = self.layouts.get(v)
        var = em.fresh("e")
        em.push(var)
        first = imul(kir.Ref(var, "i32"), width)
        # A buffer in a layout of stitch's choosing is walked in its own (physical) order:
        # the stores stay coalesced, the loads follow the logical index.
        minor = (layout[-1] if layout else len(shape.dims) - 1) if shape.dims else None
        if minor is not None and shape.dims[minor] % width:
            minor = None
        indices = _group(logical_index(first, shape.dims, layout), shape.dims, minor, width,
                         lambda j: logical_index(iadd(first, _c(j)), shape.dims, layout))
        values = [em.value(v, index) for index in indices]
        for j, value in enumerate(values):
            em.emit(kir.Store(self.params[v].name, iadd(first, _c(j)), value))
        em.emit(kir.For(var, start, _c(n // width), _c(threads), loads_first(em.pop())))

    def _unit_reduce(self, em: ValueEmitter, node: OpNode, unit: "RowUnit", rowc: kir.Expr,
                     rows: int, part) -> kir.Expr:
        """This thread's share of row ``rowc`` (with vector width w: elements w*first ..
        w*first + w-1, then w*(first + step) ..., each group loaded at once), then the
        unit's threads combine their shares."""
        op = em.reducer(node)
        source, src, row_dims = self._split_row_source(node)
        split = RowSplit("dims", rows, src.num_elements // rows, row_dims)
        width = self._width(part, split.per_row, node.name)
        init = em.value(node.operands[1], ())
        acc = em.fresh("acc")
        em.emit(kir.Local(acc, init.dtype, init))
        var = em.fresh("k")
        em.push(var)
        first = imul(kir.Ref(var, "i32"), width)
        indices = _group(split.index(rowc, first, src.dims), src.dims,
                         split.step_dim(src.dims, width), width,
                         lambda j: split.index(rowc, iadd(first, _c(j)), src.dims))
        # All loads of the group first (one vector access), then the combines.
        xs = [em.value(source, index) for index in indices]
        for x in xs:
            em.emit(kir.Assign(acc, kir.Binary(op, kir.Ref(acc, init.dtype), x)))
        loop = loads_first(em.pop())
        em.emit(kir.For(var, unit.first, _c(split.per_row // width), _c(unit.step), loop))
        total: kir.Expr = kir.Ref(acc, init.dtype)
        if unit.lanes_per_row == 32:
            warp_total = em.fresh("wsum")
            em.emit(kir.WarpReduce(warp_total, total, op))
            total = kir.Ref(warp_total, init.dtype)
        if unit.slots > 1:
            total = self._combine_shared(em, unit, total, op)
        return em.let(f"row_{node.name}", total)

    def _split_row_source(self, node: OpNode) -> tuple[int, Shape, tuple[int, ...]]:
        """What a unit reduction walks: (value, its shape, its dims that index the row).
        A split row reduction (XLA GPU's [rows, a*b] -> bitcast [rows, a, b] -> reduce b ->
        reduce a) is walked as ONE row of a*b elements of the first level's input, so the
        unit's threads stride over consecutive elements (coalesced, as the schedule's
        latency model assumes) instead of each thread reducing b consecutive elements
        serially (stride b between neighbouring threads). Levels merge while
        ``_merges_into`` holds; otherwise the reduction walks its own operand."""
        graph = self.graph
        source = node.operands[0]
        src = leaf(graph.nodes[source].shape)
        row_dims = kept_dims(node, src.rank)
        reader = node
        while self._merges_into(graph.nodes[source], reader, node):
            inner = reader = graph.nodes[source]
            source = inner.operands[0]
            src = leaf(graph.nodes[source].shape)
            inner_kept = kept_dims(inner, src.rank)   # inner's result dim d is src dim kept[d]
            row_dims = tuple(inner_kept[d] for d in row_dims)
            self.split_rows[node.name] = self.split_rows.get(node.name, 1) + 1
        return source, src, row_dims

    def _merges_into(self, inner: OpNode, reader: OpNode, outer: OpNode) -> bool:
        """Whether reduction ``inner`` can be folded into the unit reduction ``outer`` that
        reads it through ``reader`` (``outer`` itself or a level already merged into it).
        Needs: computed here, read by ``reader`` alone (as the reduced operand) and not
        written — a partial with other readers keeps the per-partial lowering, since they
        would recompute it serially anyway and merging would read the row twice; the same
        associative, commutative combiner (add/multiply/max/min, XLA GPU's widened bf16
        ones included); an init that leaves a partial unchanged (the identity, or for
        max/min the outer init: they are idempotent). Then reducing all its inputs at once
        gives the same value up to the order of the float operations (the order XLA's
        split already changed) and, for a bf16 first level, without rounding each partial
        to bf16 (the row is accumulated in f32 throughout)."""
        if inner.opcode != "reduce" or len(inner.operands) != 2 or \
                inner.id not in self.computed or inner.id in self.outputs or \
                set(inner.users) != {reader.id} or reader.operands[1] == inner.id:
            return False
        kind = self.reducer_kind(outer)
        if kind not in WARP_REDUCERS or self.reducer_kind(inner) != kind:
            return False
        init = self._init_value(inner.operands[1])
        if init is None:
            return False
        element = leaf(inner.shape).element_type
        if init == _identity(kind, element):
            return True
        return kind in ("maximum", "minimum") and init == self._init_value(outer.operands[1])

    def _init_value(self, v: int) -> object | None:
        """A reduction's scalar init when it is a constant, or a constant converted (XLA
        GPU widens a bf16 reduction's init: convert(bf16 -inf) to f32)."""
        node = self.graph.nodes[v]
        if node.opcode == "convert" and len(node.operands) == 1 and leaf(node.shape).rank == 0:
            value = self._init_value(node.operands[0])
            if value is None or isinstance(value, bool):
                return None
            return np.asarray(value).astype(numpy_dtype(leaf(node.shape).element_type)).item()
        return _constant_scalar(node)

    def _combine_shared(self, em: ValueEmitter, unit: "RowUnit", value: kir.Expr, op: str
                        ) -> kir.Expr:
        """Partials of a row meet in shared memory: the thread of share ``s`` of a row
        writes slot (s, column), a barrier, every thread folds its row's slots, and a
        second barrier before a later reduction reuses the buffer. One buffer per dtype
        (a row's partial slots: warps of the block, or warps x 32 columns)."""
        # Parts own disjoint blocks: they share the buffers too.
        size = max(self.shared_sizes.get(value.dtype, 0), unit.slots * unit.columns)
        self.shared_sizes[value.dtype] = size
        buf = kir.Shared(f"partials_{value.dtype}", value.dtype, size)
        write = kir.Store(buf.name, iadd(imul(unit.share, unit.columns), unit.column), value)
        em.emit(write if unit.share_writer is None else kir.If(unit.share_writer, (write,)))
        em.emit(kir.Barrier())
        total = em.fresh("bacc")
        em.emit(kir.Local(total, value.dtype, kir.Load(buf, unit.column)))
        w = em.fresh("w")
        em.push()
        slot = iadd(imul(kir.Ref(w, "i32"), unit.columns), unit.column)
        em.emit(kir.Assign(total, kir.Binary(op, kir.Ref(total, value.dtype),
                                             kir.Load(buf, slot))))
        em.emit(kir.For(w, _c(1), _c(unit.slots), _c(1), em.pop()))
        em.emit(kir.Barrier())
        return kir.Ref(total, value.dtype)

    # --- layout proof --------------------------------------------------------------------
def kernel_identifier(name: str) -> str:
    """A planned kernel's name (``main.3.k0``) as a Kernel IR / PTX identifier."""
    safe = "".join(ch if ch.isalnum() else "_" for ch in name)
    if not safe or not (safe[0].isalpha() or safe[0] == "_"):
        safe = "k_" + safe
    return safe


# Schedules estimated above this many registers per thread tell ptxas their budget: below
# it ptxas's own heuristic is left alone (it moved 16 of 199 zoo kernels' counts either way
# under a blanket .maxnreg 255, none of them spilling).
REGISTER_HINT_ABOVE = 64
REGISTER_FILE = 65536          # 32-bit registers per SM, sm_70 .. sm_90


def register_budget(schedule) -> int | None:
    """The registers per thread the schedule's occupancy leaves each thread (its blocks per
    SM all resident), in ptxas's granularity of 8 and at most 255, for schedules estimated
    above REGISTER_HINT_ABOVE registers; else None."""
    estimate = getattr(schedule, "regs_estimate", 0) or 0
    occupancy = getattr(schedule, "occupancy", None)
    blocks = getattr(occupancy, "blocks_per_sm", 0) or 0
    if estimate <= REGISTER_HINT_ABOVE or blocks <= 0:
        return None
    budget = min(255, REGISTER_FILE // (schedule.block * blocks) // 8 * 8)
    return budget if budget >= estimate else None


def lower_kernel(graph: OpGraph, module: HloModule | Evaluator, schedule, name: str,
                 in_place: bool = False, layouts: dict[int, tuple[int, ...]] | None = None,
                 validate: bool = True) -> LoweredKernel:
    """Kernel IR for the stitched kernel ``schedule`` (a KernelSchedule) of ``graph``.
    ``in_place``: the caller fills the buffers of ``LoweredKernel.initial`` before the
    launch, so scatters with colliding updates are generated (else refused). ``layouts``:
    values between stitched kernels whose buffers stitch lays out (node -> logical dims,
    major to minor; ``stitch.schedule.layouts``): this kernel's loads and stores of them
    index through the permutation; the caller keeps every other reader off them.
    ``validate=False`` leaves ``Kernel.validate`` to whatever builds the kernel (every
    emitter validates first): a caller that may drop the kernel unbuilt skips the check."""
    evaluator = module if isinstance(module, Evaluator) else Evaluator(module)
    safe = kernel_identifier(name)
    try:
        lowered = _KernelBuilder(graph, evaluator, schedule, safe, in_place, layouts).build()
        if validate:
            lowered.kernel.validate()
        return lowered
    except CodegenError:
        raise
    except (KeyError, ValueError, IndexError) as exc:
        raise CodegenError(f"kernel {name}: cannot lower: {type(exc).__name__}: {exc}") from exc


def row_layouts(graph: OpGraph, module: HloModule | Evaluator, schedule,
                in_place: bool = False) -> list[RowLayout | str | None]:
    """Each part's row layout proved afresh as lowering proves it (or why there is none);
    None for parts that are not warp or block rows."""
    evaluator = module if isinstance(module, Evaluator) else Evaluator(module)
    proof = _KernelBuilder(graph, evaluator, schedule, "layouts", in_place).layout_proof
    return [proof.prove(p) if p.kind == "row" and p.unit in ("warp", "block") else None
            for p in schedule.parts]


def reference_values(graph: OpGraph, module: HloModule | Evaluator, members: list[int],
                     inputs: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """The reference evaluator's values of ``members`` given the kernel's input values (the
    oracle for lowered kernels)."""
    evaluator = module if isinstance(module, Evaluator) else Evaluator(module)
    values = dict(inputs)
    for v in sorted(members):
        node = graph.nodes[v]
        inst = node.instruction
        if v in values:             # an input (a parameter, a tuple element made outside)
            continue
        if inst.opcode == "get-tuple-element" and len(node.operands) == 1 \
                and node.operands[0] in values:
            values[v] = values[node.operands[0]]      # operands are already tuple leaves
            continue
        if inst.opcode == "constant":
            values[v] = _literal(node)
            continue
        ops = []
        for o in node.operands:
            if o not in values:
                if graph.nodes[o].opcode != "constant":
                    raise CodegenError(f"no value for {graph.nodes[o].name}")
                values[o] = _literal(graph.nodes[o])
            ops.append(values[o])
        value = evaluator.apply_instruction(node.computation, inst, ops)
        if isinstance(value, tuple):
            raise CodegenError(f"{node.name}: tuple-valued ops are not supported")
        shape = leaf(node.shape)
        values[v] = np.asarray(value).astype(numpy_dtype(shape.element_type)).reshape(
            shape.dims)
    return values


def run_on_host(lowered: LoweredKernel, graph: OpGraph, inputs: dict[int, np.ndarray],
                poison: bool = True, opt: int = 2) -> dict[int, np.ndarray]:
    """Compile ``lowered`` for the host target (LLVM speed level ``opt``: 0 builds ~3x
    faster, for tests of the lowering itself) and run it on ``inputs`` (node id -> array,
    logical shapes; buffers in ``lowered.layouts`` are transposed into and out of their
    layout here); returns the written values by node id, logical shapes. Float outputs start as NaN so
    an element the kernel never writes cannot pass for a right one."""
    from .host import NUMPY_DTYPES, compile_host

    compiled = compile_host(lowered.kernel, opt=opt)
    params = lowered.kernel.params
    args = []
    for p, v in zip(params, lowered.inputs):
        value = np.asarray(inputs[v])
        if v in lowered.layouts:        # the buffer holds the value transposed by its layout
            value = np.transpose(value.reshape(leaf(graph.nodes[v].shape).dims),
                                 lowered.layouts[v])
        args.append(np.ascontiguousarray(value, dtype=NUMPY_DTYPES[p.dtype]).reshape(-1))
    outs = []
    for p, v in zip(params[len(lowered.inputs):], lowered.outputs):
        out = np.empty(p.size, NUMPY_DTYPES[p.dtype])
        if v in lowered.initial:
            out[:] = np.asarray(inputs[lowered.initial[v]]).reshape(-1)
        elif poison and out.dtype.kind == "f":
            out[:] = np.nan
        elif poison:
            out[:] = 1
        outs.append(out)
    compiled(*args, *outs)
    values = {}
    for v, out in zip(lowered.outputs, outs):
        dims = leaf(graph.nodes[v].shape).dims
        layout = lowered.layouts.get(v)
        values[v] = out.reshape(dims) if layout is None else np.transpose(
            out.reshape(tuple(dims[d] for d in layout)), np.argsort(layout))
    return values
