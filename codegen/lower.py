"""Lowering of a stitched kernel's schedule (``stitch.schedule.KernelSchedule``) to Kernel IR.

Per part of the schedule (kernel packing: a part owns a range of the grid's blocks):

- *thread composition* (loop parts, ``unit == "thread"`` row parts): a grid-stride loop
  per written value; each element is computed by index propagation (``values.py``), a
  reduction by a loop of the thread itself;
- *warp composition*: one row per warp; each reduction is accumulated by the 32 lanes
  (strided over the row) and finished with a shuffle butterfly, so every lane holds the
  row's result in a register; per-row ops (e.g. rsqrt of the variance) are computed once
  per row; consumer elements of the row are then computed by the warp's lanes;
- *block composition*: one row per block; warp results go through shared memory
  (partials, a barrier, every thread combines them), then the same as a warp.

Warp/block composition is lowered for the canonical row layout: every reduction of the part
reduces trailing logical dims with one output per row, and every value downstream of a
reduction (and every written value) is laid out row after row. The layout is proven on
index arrays before lowering (``_row_layout``); where it does not hold, or for column
tiling, the part is lowered with thread composition and ``LoweredKernel.notes`` says why
(always legal: threads recompute what they need).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np

from hlo_passes.evaluator.dtypes import numpy_dtype
from hlo_passes.evaluator.interpreter import Evaluator
from hlo_passes.graph import OpGraph, OpNode
from hlo_passes.ir import HloModule
from hlo_passes.literals import literal_to_numpy
from hlo_passes.op_classes import OpClass

from . import kir
from .errors import CodegenError
from .values import ValueEmitter, delinearize, iadd, imul, leaf, storage_dtype

log = logging.getLogger(__name__)

_c = kir.i32
# Largest tensor whose row layout is checked on index arrays (8 bytes per element).
ROW_CHECK_ELEMENTS = 1 << 24
_LAYOUT_OPS = frozenset({"broadcast", "reshape", "bitcast", "transpose", "copy", "slice",
                         "reverse"})


@dataclass
class LoweredKernel:
    kernel: kir.Kernel
    inputs: list[int]               # node ids whose values the kernel reads, param order
    outputs: list[int]              # node ids the kernel writes, after the inputs
    schemes: list[str]              # per part: "thread" | "warp" | "block" as lowered
    notes: list[str] = field(default_factory=list)


def _literal(node: OpNode) -> np.ndarray:
    shape = leaf(node.shape)
    return literal_to_numpy(node.instruction.literal, shape, numpy_dtype(shape.element_type))


def _constant_scalar(node: OpNode) -> object | None:
    if node.opcode != "constant" or leaf(node.shape).rank != 0 or node.instruction.literal is None:
        return None
    shape = leaf(node.shape)
    item = _literal(node).reshape(()).item()
    return bool(item) if shape.element_type == "pred" else item


class _KernelBuilder:
    def __init__(self, graph: OpGraph, evaluator: Evaluator, schedule, name: str):
        self.graph = graph
        self.evaluator = evaluator
        self.schedule = schedule
        self.name = name
        self.members = frozenset(schedule.members)
        self.notes: list[str] = []
        self.params: dict[int, kir.Param] = {}
        self.inputs: list[int] = []
        self.outputs: list[int] = []
        # A get-tuple-element of a tuple made outside (a while's results) is read from
        # its own buffer: the kernel computes only from array values.
        taken = frozenset(v for v in self.members if graph.nodes[v].opcode == "get-tuple-element"
                          and any(o not in self.members or graph.nodes[o].shape.is_tuple
                                  for o in graph.nodes[v].operands))
        for v in sorted(taken):
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

    def _param(self, v: int, is_output: bool) -> None:
        node = self.graph.nodes[v]
        shape = leaf(node.shape)
        name = f"{'out' if is_output else 'in'}{len(self.params)}_" + "".join(
            ch if ch.isalnum() else "_" for ch in node.name)[:40]
        self.params[v] = kir.Param(name, storage_dtype(shape), max(shape.num_elements, 1),
                                   is_output)

    def reducer_kind(self, node: OpNode) -> str | None:
        comp = node.instruction.attrs.get("to_apply")
        return self.evaluator.binary_kind(comp) if comp else None

    def emitter(self) -> ValueEmitter:
        return ValueEmitter(self.graph, self.computed, self.params.get, self.reducer_kind,
                            _constant_scalar)

    # --- parts ---------------------------------------------------------------------------
    def build(self) -> LoweredKernel:
        sched = self.schedule
        body: list[kir.Stmt] = []
        schemes = []
        shared: list[kir.Shared] = []
        for index, part in enumerate(sched.parts):
            written = [v for v in self.outputs if v in set(part.members)]
            em = self.emitter()
            em.push()
            local_block = kir.Binary("sub", kir.BlockIdx(), _c(part.block_offset)) \
                if part.block_offset else kir.BlockIdx()
            bid = em.let("block", local_block)
            scheme = "thread"
            if part.kind == "row" and part.unit in ("warp", "block"):
                reason = self._row_layout(part)
                if reason is None:
                    scheme = part.unit
                    shared += self._unit_part(em, part, written, bid)
                else:
                    self.notes.append(f"part {index} ({part.unit} composition) lowered with "
                                      f"thread composition: {reason}")
            if scheme == "thread":
                self._thread_part(em, part, written, bid)
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
        kernel = kir.Kernel(self.name, params, shared, sched.grid, sched.block, body)
        kernel.validate()
        return LoweredKernel(kernel, list(self.inputs), list(self.outputs), schemes, self.notes)

    def _thread_part(self, em: ValueEmitter, part, written: list[int], bid: kir.Expr) -> None:
        tpb = self.schedule.block
        total = part.blocks * tpb
        gtid = em.let("gtid", iadd(imul(bid, tpb), kir.ThreadIdx()))
        for v in written:
            shape = leaf(self.graph.nodes[v].shape)
            n = max(shape.num_elements, 1)
            var = em.fresh("e")
            em.push()
            e = kir.Ref(var, "i32")
            value = em.value(v, delinearize(e, shape.dims))
            em.emit(kir.Store(self.params[v].name, e, value))
            loop = em.pop()
            em.emit(kir.For(var, gtid, _c(n), _c(total), loop))

    def _unit_part(self, em: ValueEmitter, part, written: list[int], bid: kir.Expr
                   ) -> list[kir.Shared]:
        graph = self.graph
        tpb = self.schedule.block
        warps = tpb // 32
        rows = part.rows
        tid = kir.ThreadIdx()
        lane = em.let("lane", kir.Binary("rem", tid, _c(32)))
        warp = em.let("warp", kir.Binary("div", tid, _c(32)))
        if part.unit == "warp":
            row = em.let("row", iadd(imul(bid, warps), warp))
            step, first = 32, lane
        else:
            row = bid
            step, first = tpb, tid
        # Every warp runs the collectives (uniform control flow); a warp past the last row
        # works on the last row and stores nothing.
        rowc = em.let("rowc", kir.Binary("min", row, _c(rows - 1)))
        valid = em.let("valid", kir.Compare("lt", row, _c(rows)))
        shared: list[kir.Shared] = []
        part_members = set(part.members)
        downstream = self._downstream(part_members)
        for v in sorted(part_members):
            node = graph.nodes[v]
            if node.opcode == "reduce":
                result = self._unit_reduce(em, node, rowc, rows, first, step, lane, warp,
                                           warps, part.unit, shared)
                em.overrides[v] = lambda idx, r=result: r
                if v in written:
                    em.push()
                    em.emit(kir.Store(self.params[v].name, rowc, result))
                    store = em.pop()
                    first_lane = kir.Compare("eq", first, _c(0))
                    em.emit(kir.If(kir.Binary("and", valid, first_lane), store))
            elif v in downstream and leaf(node.shape).num_elements == rows and \
                    not graph.is_free(v):
                # A per-row value (sub-root): computed once per row, not per element.
                value = em.value(v, delinearize(rowc, leaf(node.shape).dims))
                em.overrides[v] = lambda idx, r=value: r
        for v in written:
            node = graph.nodes[v]
            if node.opcode == "reduce":
                continue
            shape = leaf(node.shape)
            per_row = shape.num_elements // rows
            var = em.fresh("j")
            em.push()
            e = em.let("e", iadd(imul(rowc, per_row), kir.Ref(var, "i32")))
            value = em.value(v, delinearize(e, shape.dims))
            em.push()
            em.emit(kir.Store(self.params[v].name, e, value))
            store = em.pop()
            em.emit(kir.If(valid, store))
            loop = em.pop()
            em.emit(kir.For(var, first, _c(per_row), _c(step), loop))
        return shared

    def _unit_reduce(self, em: ValueEmitter, node: OpNode, rowc: kir.Expr, rows: int,
                     first: kir.Expr, step: int, lane: kir.Expr, warp: kir.Expr, warps: int,
                     unit: str, shared: list[kir.Shared]) -> kir.Expr:
        op = em.reducer(node)
        src = leaf(self.graph.nodes[node.operands[0]].shape)
        length = src.num_elements // rows
        init = em.value(node.operands[1], ())
        acc = em.fresh("acc")
        em.emit(kir.Local(acc, init.dtype, init))
        var = em.fresh("k")
        em.push()
        e = em.let("e", iadd(imul(rowc, length), kir.Ref(var, "i32")))
        x = em.value(node.operands[0], delinearize(e, src.dims))
        em.emit(kir.Assign(acc, kir.Binary(op, kir.Ref(acc, init.dtype), x)))
        loop = em.pop()
        em.emit(kir.For(var, first, _c(length), _c(step), loop))
        warp_total = em.fresh("wsum")
        em.emit(kir.WarpReduce(warp_total, kir.Ref(acc, init.dtype), op))
        total = kir.Ref(warp_total, init.dtype)
        if unit == "block" and warps > 1:
            buf = kir.Shared(em.fresh(f"partials_{node.name}"), init.dtype, warps)
            shared.append(buf)
            em.push()
            em.emit(kir.Store(buf.name, warp, total))
            em.emit(kir.If(kir.Compare("eq", lane, _c(0)), em.pop()))
            em.emit(kir.Barrier())
            block_acc = em.fresh("bacc")
            em.emit(kir.Local(block_acc, init.dtype, kir.Load(buf, _c(0))))
            w = em.fresh("w")
            em.push()
            em.emit(kir.Assign(block_acc, kir.Binary(op, kir.Ref(block_acc, init.dtype),
                                                     kir.Load(buf, kir.Ref(w, "i32")))))
            em.emit(kir.For(w, _c(1), _c(warps), _c(1), em.pop()))
            # The partials are read by every thread before any later reduction reuses them.
            em.emit(kir.Barrier())
            total = kir.Ref(block_acc, init.dtype)
        return em.let(f"row_{node.name}", total)

    # --- layout proof --------------------------------------------------------------------
    def _downstream(self, part_members: set[int]) -> set[int]:
        graph = self.graph
        out: set[int] = set()
        for v in sorted(part_members):
            node = graph.nodes[v]
            if node.opcode == "reduce" or any(o in out for o in node.operands):
                out.add(v)
        return out

    def _row_layout(self, part) -> str | None:
        """None when the part has the canonical row layout (see the module docstring),
        else why not. Row ids are pushed through the part on index arrays with the
        reference evaluator's own layout ops, so the proof follows HLO semantics."""
        graph = self.graph
        rows = part.rows
        if not part.minor:
            return "column tiling is not lowered yet"
        members = sorted(part.members)
        row_id: dict[int, np.ndarray] = {}
        for v in members:
            node = graph.nodes[v]
            shape = leaf(node.shape)
            if shape.num_elements > ROW_CHECK_ELEMENTS:
                return f"{node.name} is too large to prove the row layout on index arrays"
            if node.opcode == "reduce":
                kind = self.reducer_kind(node)
                if kind not in ("add", "multiply", "maximum", "minimum") or \
                        len(node.operands) != 2:
                    return f"{node.name}: reducer {kind} has no warp collective"
                src = leaf(graph.nodes[node.operands[0]].shape)
                reduced = sorted(node.instruction.ints("dimensions"))
                trailing = [d for d in range(src.rank - len(reduced), src.rank)]
                if [d for d in reduced if src.dims[d] != 1] != \
                        [d for d in trailing if src.dims[d] != 1] and reduced != trailing:
                    return f"{node.name} does not reduce trailing dimensions"
                if shape.num_elements != rows:
                    return f"{node.name} has several outputs per row"
                ids = row_id.get(node.operands[0])
                length = src.num_elements // rows
                if ids is not None and not np.array_equal(
                        ids.ravel(), np.arange(src.num_elements) // length):
                    return f"{node.name} reads values of other rows"
                row_id[v] = np.arange(rows).reshape(shape.dims)
                continue
            carried = [row_id[o] for o in node.operands if o in row_id]
            if not carried:
                continue
            if node.opcode in _LAYOUT_OPS:
                # Row ids travel in an integer type as wide as the data (bitcast checks
                # byte sizes).
                width = numpy_dtype(leaf(graph.nodes[node.operands[0]].shape).element_type
                                    ).itemsize
                as_type = {1: np.uint8, 2: np.uint16, 4: np.int32, 8: np.int64}[width]
                if rows > np.iinfo(as_type).max:
                    return f"{node.name}: too many rows to track in {width}-byte ids"
                ids = np.asarray(self.evaluator.apply_instruction(
                    node.computation, node.instruction, [carried[0].astype(as_type)]))
            elif node.op_class in (OpClass.LIGHT, OpClass.EXPENSIVE) or node.opcode in (
                    "compare", "select", "convert", "clamp"):
                first = carried[0]
                ids = first
                for other in carried[1:]:
                    if other.shape != first.shape or not np.array_equal(other, first):
                        return f"{node.name} joins values of different rows"
                if any(o not in row_id and leaf(graph.nodes[o].shape).rank
                       and leaf(graph.nodes[o].shape).dims != shape.dims
                       for o in node.operands):
                    return f"{node.name} broadcasts implicitly"
                if ids.shape != shape.dims:
                    ids = np.broadcast_to(ids, shape.dims)
            else:
                return f"{node.name} ({node.opcode}) moves values between rows"
            row_id[v] = ids
        for v in self.outputs:
            if v not in set(part.members):
                continue
            shape = leaf(graph.nodes[v].shape)
            n = shape.num_elements
            if n % rows:
                return f"{graph.nodes[v].name} does not split into {rows} rows"
            ids = row_id.get(v)
            if ids is not None and graph.nodes[v].opcode != "reduce" and not np.array_equal(
                    np.asarray(ids).ravel(), np.arange(n) // (n // rows)):
                return f"{graph.nodes[v].name} is not laid out row after row"
        return None


def lower_kernel(graph: OpGraph, module: HloModule | Evaluator, schedule, name: str
                 ) -> LoweredKernel:
    """Kernel IR for the stitched kernel ``schedule`` (a KernelSchedule) of ``graph``."""
    evaluator = module if isinstance(module, Evaluator) else Evaluator(module)
    safe = "".join(ch if ch.isalnum() else "_" for ch in name)
    if not safe or not (safe[0].isalpha() or safe[0] == "_"):
        safe = "k_" + safe
    try:
        return _KernelBuilder(graph, evaluator, schedule, safe).build()
    except CodegenError:
        raise
    except (KeyError, ValueError, IndexError) as exc:
        raise CodegenError(f"kernel {name}: cannot lower: {type(exc).__name__}: {exc}") from exc


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
                poison: bool = True) -> dict[int, np.ndarray]:
    """Compile ``lowered`` for the host target and run it on ``inputs`` (node id -> array,
    logical shapes); returns the written values by node id. Float outputs start as NaN so
    an element the kernel never writes cannot pass for a right one."""
    from .host import NUMPY_DTYPES, compile_host

    compiled = compile_host(lowered.kernel)
    params = lowered.kernel.params
    args = []
    for p, v in zip(params, lowered.inputs):
        args.append(np.ascontiguousarray(inputs[v], dtype=NUMPY_DTYPES[p.dtype]).reshape(-1))
    outs = []
    for p in params[len(lowered.inputs):]:
        out = np.empty(p.size, NUMPY_DTYPES[p.dtype])
        if poison and out.dtype.kind == "f":
            out[:] = np.nan
        elif poison:
            out[:] = 1
        outs.append(out)
    compiled(*args, *outs)
    return {v: out.reshape(leaf(graph.nodes[v].shape).dims)
            for v, out in zip(lowered.outputs, outs)}
