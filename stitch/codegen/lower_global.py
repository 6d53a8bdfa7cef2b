"""Lowering of a global-scope kernel (``stitch.schedule.global_scope``): one persistent
kernel whose phases are separated by ``kir.GridBarrier``s; values cross a barrier only
through ``kir.GlobalScratch`` buffers (partials and folded results).

- Reduction phase (stage k): every block walks work items grid-stride (the loop bounds
  depend only on the block: uniform, so block collectives may sit inside). A minor
  reduction's item is (output o, split s): the block's threads stride over the split's
  share of o's row, a warp butterfly and the shared-memory slots combine them, thread 0
  stores partial[o * S + s]. A column reduction's item is (32-column tile, split s): lane l
  owns column 32 t + l, the warps stride over the split's rows, the shared-memory slots
  (warp x column) combine them, warp 0 stores the partials of its columns.
- Combine step (a reduction with several outputs and splits): grid-stride over the outputs,
  each folded once into result[o] (and into the output buffer when the reduction is
  written; when that leaves the last phase nothing to store, the kernel ends there).
- Later phases read a reduction at any index: result[o], or partial[o] when it has one
  split per output, or — one output — every thread folds the partials once (loop-invariant,
  computed before the loops that use it).
- Last phase: every written value by thread composition, grid-stride.

The host target runs each phase for every block before the next (``stitch.codegen.host``); on a GPU
the schedule keeps the grid within the resident blocks (occupancy × SMs) and a cooperative
launch is the runtime's guarantee that they are co-resident.
"""
from __future__ import annotations

import math
from typing import Any, Protocol

from stitch.hlo.graph import OpGraph, OpNode

from . import kir
from .errors import CodegenError
from .row_mapping import RowSplit, RowUnit, kept_dims
from .values import ValueEmitter, iadd, imul, leaf, linearize

_c = kir.i32
# Reducers the block combine finishes (warp butterfly / plain ops in the slots).
_GLOBAL_REDUCERS = frozenset({"add", "multiply", "maximum", "minimum"})


class KernelBuilder(Protocol):
    """What a global-scope lowering uses of the kernel builder that owns it (``lower``'s):
    described here so that this module does not import the builder that imports it. The
    store and shared-memory combine are the builder's own helpers, which it lends this
    lowering."""
    schedule: Any                   # stitch's KernelSchedule (codegen does not import stitch)
    graph: OpGraph
    outputs: list[int]
    computed: frozenset[int]
    params: dict[int, kir.Param]

    def emitter(self) -> ValueEmitter: ...

    def reducer_kind(self, node: OpNode) -> str | None: ...

    def output_offset(self, v: int, logical: kir.Expr) -> kir.Expr: ...

    def _strided_store(self, em: ValueEmitter, v: int, start: kir.Expr, threads: int,
                       part=None) -> None: ...

    def _combine_shared(self, em: ValueEmitter, unit: RowUnit, value: kir.Expr, op: str
                        ) -> kir.Expr: ...


class GlobalLowering:
    def __init__(self, builder: KernelBuilder, part) -> None:
        self.b = builder
        self.part = part
        self.scope = part.scope
        self.grid = builder.schedule.grid
        self.tpb = builder.schedule.block
        self.scratch: dict[str, kir.GlobalScratch] = {}
        self.partials: dict[int, kir.GlobalScratch] = {}
        self.results: dict[int, kir.GlobalScratch] = {}
        self.ready: list = []           # reductions whose results later phases may read
        self.stored: set[int] = set()   # outputs a combine step already stored

    # --- scratch -----------------------------------------------------------------------
    def _buffer(self, kind: str, v: int, dtype: str, size: int) -> kir.GlobalScratch:
        name = f"{kind}{len(self.scratch)}_" + "".join(
            ch if ch.isalnum() else "_" for ch in self.b.graph.nodes[v].name)[:32]
        buf = kir.GlobalScratch(name, dtype, max(size, 1))
        self.scratch[name] = buf
        return buf

    # --- phases ------------------------------------------------------------------------
    def body(self) -> tuple[list[kir.Stmt], list[kir.GlobalScratch]]:
        body: list[kir.Stmt] = []
        for stage in range(self.scope.stages):
            mine = [r for r in self.scope.reductions if r.stage == stage]
            em = self._emitter()
            for r in mine:
                self._reduce(em, r)
            body += em.pop()
            body.append(kir.GridBarrier())
            combined = [r for r in mine if r.combine]
            if combined:
                em = self._emitter()
                for r in combined:
                    self._combine(em, r)
                body += em.pop()
                body.append(kir.GridBarrier())
            self.ready += mine
        rest = [v for v in self.b.outputs if v not in self.stored]
        if not rest:
            body.pop()      # the combine steps stored every output: no phase after them
            return body, list(self.scratch.values())
        em = self._emitter()
        gtid = em.let("gtid", iadd(imul(kir.BlockIdx(), self.tpb), kir.ThreadIdx()))
        for v in rest:
            self.b._strided_store(em, v, gtid, self.grid * self.tpb)
        body += em.pop()
        return body, list(self.scratch.values())

    def _emitter(self) -> ValueEmitter:
        """A fresh emitter per phase (no variable crosses a grid barrier), reading the
        reductions of earlier phases from the scratch."""
        em = self.b.emitter()
        em.push()
        for r in self.ready:
            em.overrides[r.node] = (lambda index, r=r, em=em: self._read(em, r, index))
        return em

    def _init(self, em: ValueEmitter, r) -> kir.Expr:
        node = self.b.graph.nodes[r.node]
        kind = self.b.reducer_kind(node)
        if kind not in _GLOBAL_REDUCERS:
            raise CodegenError(f"{node.name}: the global scope combines add/multiply/max/min "
                               f"reductions (reducer {kind or 'not a single op'})")
        return em.value(node.operands[1], ())

    def _reduce(self, em: ValueEmitter, r) -> None:
        """Partials of reduction ``r``: one per work item (see the module docstring)."""
        graph = self.b.graph
        node = graph.nodes[r.node]
        op = em.reducer(node)
        init = self._init(em, r)
        dtype = init.dtype
        partials = self.partials[r.node] = self._buffer("gp", r.node, dtype,
                                                        r.outputs * r.splits)
        src = leaf(graph.nodes[node.operands[0]].shape)
        split = RowSplit("dims", r.outputs, r.row_length, kept_dims(node, src.rank))
        chunk = math.ceil(r.row_length / r.splits)
        tpb, warps = self.tpb, self.tpb // 32
        tid = kir.ThreadIdx()
        lane = em.let("lane", kir.Binary("rem", tid, _c(32)))
        warp = em.let("warp", kir.Binary("div", tid, _c(32)))
        w = em.fresh("item")
        em.push(w)
        item = kir.Ref(w, "i32")
        unit_index = em.let("unit", kir.Binary("div", item, _c(r.splits)))
        s = em.let("split", kir.Binary("rem", item, _c(r.splits)))
        lo = em.let("lo", imul(s, chunk))
        hi = em.let("hi", kir.Binary("min", iadd(lo, _c(chunk)), _c(r.row_length)))
        if r.minor:
            out = unit_index
            valid: kir.Expr = kir.Const(True, "i1")
            first, step = iadd(lo, tid), tpb
            unit = RowUnit(row=out, first=tid, step=tpb, lanes_per_row=32, slots=warps,
                         share=warp, share_writer=kir.Compare("eq", lane, _c(0)))
            writer = kir.Compare("eq", tid, _c(0))
        else:
            column = em.let("column", iadd(imul(unit_index, 32), lane))
            valid = em.let("valid", kir.Compare("lt", column, _c(r.outputs)))
            out = em.let("col", kir.Binary("min", column, _c(r.outputs - 1)))
            first, step = iadd(lo, warp), warps
            unit = RowUnit(row=out, first=warp, step=warps, lanes_per_row=1, slots=warps,
                         columns=32, share=warp, column=lane)
            writer = kir.Binary("and", kir.Compare("eq", warp, _c(0)), valid)
        acc = em.fresh("acc")
        em.emit(kir.Local(acc, dtype, init))
        k = em.fresh("k")
        em.push(k)
        x = em.value(node.operands[0], split.index(out, kir.Ref(k, "i32"), src.dims))
        em.emit(kir.Assign(acc, kir.Binary(op, kir.Ref(acc, dtype), x)))
        em.emit(kir.For(k, first, hi, _c(step), em.pop()))
        total: kir.Expr = kir.Ref(acc, dtype)
        if unit.lanes_per_row == 32:
            wsum = em.fresh("wsum")
            em.emit(kir.WarpReduce(wsum, total, op))
            total = kir.Ref(wsum, dtype)
        if unit.slots > 1:
            total = self.b._combine_shared(em, unit, total, op)
        em.push()
        em.emit(kir.Store(partials.name, iadd(imul(out, r.splits), s), total))
        em.emit(kir.If(writer, em.pop()))
        units = r.outputs if r.minor else math.ceil(r.outputs / 32)
        em.emit(kir.For(w, kir.BlockIdx(), _c(units * r.splits), _c(self.grid), em.pop()))

    def _combine(self, em: ValueEmitter, r) -> None:
        """result[o] = the fold of o's partials, grid-stride over the outputs; a written
        reduction is stored to its output here too (and a result buffer only kept when a
        later phase reads it)."""
        graph = self.b.graph
        node = graph.nodes[r.node]
        op = em.reducer(node)
        init = self._init(em, r)
        read_later = any(u in self.b.computed for u in node.users)
        written = r.node in self.b.outputs
        gtid = em.let("gtid", iadd(imul(kir.BlockIdx(), self.tpb), kir.ThreadIdx()))
        o = em.fresh("o")
        em.push(o)
        folded = self._fold(em, r, kir.Ref(o, "i32"), init, op)
        if read_later or not written:
            result = self.results[r.node] = self._buffer("gr", r.node, init.dtype, r.outputs)
            em.emit(kir.Store(result.name, kir.Ref(o, "i32"), folded))
        if written:
            element = leaf(node.shape).element_type
            value = kir.Unary(f"round_to_{element}", folded) \
                if element in ("f16", "bf16") and folded.dtype == "f32" else folded
            em.emit(kir.Store(self.b.params[r.node].name,
                              self.b.output_offset(r.node, kir.Ref(o, "i32")), value))
            self.stored.add(r.node)
        em.emit(kir.For(o, gtid, _c(r.outputs), _c(self.grid * self.tpb), em.pop()))

    def _fold(self, em: ValueEmitter, r, out: kir.Expr, init: kir.Expr, op: str) -> kir.Expr:
        acc = em.fresh("fold")
        em.emit(kir.Local(acc, init.dtype, init))
        s = em.fresh("s")
        em.push(s)
        part = kir.Load(self.partials[r.node], iadd(imul(out, r.splits), kir.Ref(s, "i32")))
        em.emit(kir.Assign(acc, kir.Binary(op, kir.Ref(acc, init.dtype), part)))
        em.emit(kir.For(s, _c(0), _c(r.splits), _c(1), em.pop()))
        return kir.Ref(acc, init.dtype)

    def _read(self, em: ValueEmitter, r, index: tuple[kir.Expr, ...]) -> kir.Expr:
        """Reduction ``r``'s result at ``index`` in a later phase, rounded to an f16/bf16
        result type as XLA rounds it (the partials are folded in f32)."""
        got = self._result(em, r, index)
        element = leaf(self.b.graph.nodes[r.node].shape).element_type
        if element in ("f16", "bf16") and got.dtype == "f32":
            return kir.Unary(f"round_to_{element}", got)
        return got

    def _result(self, em: ValueEmitter, r, index: tuple[kir.Expr, ...]) -> kir.Expr:
        dims = leaf(self.b.graph.nodes[r.node].shape).dims
        if r.node in self.results:
            return kir.Load(self.results[r.node], linearize(index, dims))
        if r.splits == 1:
            return kir.Load(self.partials[r.node], linearize(index, dims))
        # Fold the partials here, computed before every loop whose variables the index
        # does not read (one output: once per thread and phase).
        home = em._home(index)
        inner = em.scopes[home + 1:]
        del em.scopes[home + 1:]
        try:
            node = self.b.graph.nodes[r.node]
            folded = self._fold(em, r, linearize(index, dims), self._init(em, r),
                                em.reducer(node))
            return em.let("folded", folded)
        finally:
            em.scopes.extend(inner)
