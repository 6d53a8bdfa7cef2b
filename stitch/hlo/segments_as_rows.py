"""Sorted fixed-length segments as rows: a scatter-reduce over them becomes a reduce, the
matching gather a broadcast.

``jax.ops.segment_sum(x, ids, S, indices_are_sorted=True)`` is a scatter-add of x's rows
into S rows at ``ids``; ``m[ids]`` gathers a segment's value back to its members. When the
index values follow from the module (``scatter_forms.known_index_values``: ``iota // L``,
a constant array) and are ``first + i // L`` for update i — sorted segments of L updates
each — the scatter is exactly

    combine(operand, pad(reduce(reshape(updates, [K, L, ...]), dims={1}), identity))

(K = updates / L segments from row ``first``; rows no update reaches keep the operand,
which the identity padding gives), and the gather is ``reshape(broadcast(slice(table)))``.
Both are ordinary row reductions and broadcasts: the planner stitches a segmented softmax
as it stitches a row softmax, one kernel and no atomics. The reduce adds the members of a
segment in a tree instead of one after another: a float sum may round differently, as XLA's
own atomics (in no fixed order) do.

What is rewritten: a scatter with one index component into operand dim 0, updates
``[N, *operand.dims[1:]]`` (whole rows), an add/multiply/max/min combiner, no batching
dims; a gather of whole rows of dim 0 with one index component. Anything else, and index
values that are data or not a fixed-length sorted pattern, stays as it is (variable-length
segments, CSR offsets, are not rewritten). ``indices_are_sorted`` is not needed: the values
are proved.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import numpy as np

from .combiners import combiner_kind
from .graph import OpGraph, OpNode, build_op_graphs
from .ir import Computation, HloModule, Instruction, Shape
from .scatter_forms import known_index_values, uniform_predicate
from .segment_outputs import fusions_return_rows
from .segment_shape import shape_segments

log = logging.getLogger(__name__)

_FLOAT_TYPES = {"f16", "bf16", "f32", "f64"}
_INT_LIMITS = {"s8": 8, "s16": 16, "s32": 32, "s64": 64}
_COMBINE_OPCODE = {"add": "add", "multiply": "multiply", "maximum": "maximum",
                   "minimum": "minimum"}


@dataclass(frozen=True)
class SegmentPattern:
    """Update i lands on row ``first + i // length``: ``count`` segments of ``length``."""
    first: int
    count: int
    length: int


@dataclass
class SegmentRewrite:
    """The rewritten module and what was turned into reductions and broadcasts."""
    module: HloModule
    reductions: list[str] = field(default_factory=list)   # scatters now reduces
    broadcasts: list[str] = field(default_factory=list)   # gathers now broadcasts
    selects: list[str] = field(default_factory=list)      # selects on proved predicates
    # Computations rewritten -> the one (count, length) split per number of updates n.
    splits: dict[str, dict[int, tuple[int, int]]] = field(default_factory=dict)
    # Fusions returning the segments' shape (``segment_outputs``; XLA's modules only).
    rows_outputs: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.reductions or self.broadcasts)


def segment_pattern(graph: OpGraph, indices: int, vector_dim: int) -> SegmentPattern | None:
    """The sorted fixed-length segments index tensor ``indices`` proves (one component per
    index vector), or None."""
    shape = graph.nodes[indices].shape
    if shape.is_tuple:
        return None
    dims = tuple(shape.dims)
    if vector_dim == len(dims):
        if len(dims) != 1:
            return None
    elif not (len(dims) == 2 and vector_dim == 1 and dims[1] == 1):
        return None
    values, known = known_index_values(graph, indices)
    values = values.reshape(-1)
    if values.size == 0 or not bool(known.all()):
        return None
    first = int(values[0])
    length = int(np.argmax(values != first)) if bool((values != first).any()) else values.size
    if first < 0 or values.size % length:
        return None
    want = first + np.arange(values.size, dtype=np.int64) // length
    if not np.array_equal(values, want):
        return None
    return SegmentPattern(first, values.size // length, length)


def _identity_literal(kind: str, element_type: str) -> str | None:
    if kind == "add":
        return "0"
    if kind == "multiply":
        return "1"
    if element_type in _FLOAT_TYPES:
        return {"maximum": "-inf", "minimum": "inf"}.get(kind)
    bits = _INT_LIMITS.get(element_type)
    if bits is None:
        return None
    return str(-(1 << (bits - 1))) if kind == "maximum" else str((1 << (bits - 1)) - 1)


def _shape(element_type: str, dims: tuple[int, ...]) -> Shape:
    return Shape(element_type, tuple(dims))


def _int_set(values: tuple[int, ...]) -> str:
    return "{" + ",".join(str(v) for v in values) + "}"


class _Rewriter:
    def __init__(self, module: HloModule):
        self.module = module
        self.names = {i.name for c in module.computations for i in c.instructions}
        self.result = SegmentRewrite(module)
        # computation -> {removed instruction: the one its users read instead}
        self.aliases: dict[str, dict[str, str]] = {}
        # computation -> {updates n: the (count, length) splits proved for it}
        self.splits: dict[str, dict[int, set[tuple[int, int]]]] = {}

    def note_split(self, node: OpNode, count: int, length: int) -> None:
        self.splits.setdefault(node.computation, {}).setdefault(
            count * length, set()).add((count, length))

    def fresh(self, base: str) -> str:
        name = f"{base}.seg"
        n = 0
        while name in self.names:
            n += 1
            name = f"{base}.seg{n}"
        self.names.add(name)
        return name

    # --- scatter ------------------------------------------------------------------------
    def scatter(self, graph: OpGraph, node: OpNode) -> list[Instruction] | None:
        inst = node.instruction
        if len(node.operands) != 3 or node.shape.is_tuple:
            return None
        operand = graph.nodes[node.operands[0]]
        updates = graph.nodes[node.operands[2]]
        oshape, ushape = operand.shape, updates.shape
        rank = oshape.rank
        # jax's form inserts the row dim; XLA's canonical form keeps it as a window dim of 1.
        inserted = inst.ints("inserted_window_dims", ()) == (0,) and \
            inst.ints("update_window_dims", ()) == tuple(range(1, rank)) and \
            tuple(ushape.dims[1:]) == tuple(oshape.dims[1:])
        kept = inst.ints("inserted_window_dims", ()) == () and \
            inst.ints("update_window_dims", ()) == tuple(range(1, rank + 1)) and \
            tuple(ushape.dims[1:]) == (1,) + tuple(oshape.dims[1:])
        if not (inserted or kept) or \
                inst.ints("scatter_dims_to_operand_dims", ()) != (0,) or \
                inst.ints("input_batching_dims", ()):
            return None
        names = [n.lstrip("%") for n in inst.called_computations]
        comp = graph.computations.get(names[0]) if names else None
        kind = combiner_kind(comp) if comp is not None else None
        if kind not in _COMBINE_OPCODE:
            return None
        etype = oshape.element_type
        identity = _identity_literal(kind, etype)
        if identity is None or ushape.element_type != etype:
            return None
        pattern = segment_pattern(graph, node.operands[1], inst.int("index_vector_dim"))
        rows = oshape.dims[0]
        if pattern is None or pattern.first + pattern.count > rows or \
                pattern.count * pattern.length != ushape.dims[0]:
            return None
        tail = tuple(oshape.dims[1:])
        k, length = pattern.count, pattern.length
        self.note_split(node, k, length)
        out: list[Instruction] = []
        init = Instruction(self.fresh(f"{inst.name}.identity"), _shape(etype, ()), "constant",
                           literal=identity)
        grouped = Instruction(self.fresh(f"{inst.name}.segments"),
                              _shape(etype, (k, length) + tail), "reshape", [inst.operands[2]])
        reduced = Instruction(self.fresh(f"{inst.name}.reduce"), _shape(etype, (k,) + tail),
                              "reduce", [grouped.name, init.name],
                              {"dimensions": "{1}", "to_apply": inst.attrs["to_apply"]})
        out += [init, grouped, reduced]
        value = reduced
        if k != rows:
            padding = "x".join([f"{pattern.first}_{rows - k - pattern.first}"] +
                               ["0_0"] * len(tail))
            value = Instruction(self.fresh(f"{inst.name}.rows"), _shape(etype, tuple(oshape.dims)),
                                "pad", [reduced.name, init.name], {"padding": padding})
            out.append(value)
        if _fills_with(graph, operand, identity, etype):
            # The reduced (or padded) value is the result: it takes the scatter's name.
            out.pop()
            value.name, value.shape = inst.name, node.shape
            value.is_root = inst.is_root
            self.result.reductions.append(inst.name)
            return out + [value]
        else:
            final = Instruction(inst.name, node.shape, _COMBINE_OPCODE[kind],
                                [inst.operands[0], value.name])
        final.is_root = inst.is_root
        out.append(final)
        self.result.reductions.append(inst.name)
        return out

    # --- gather -------------------------------------------------------------------------
    def gather(self, graph: OpGraph, node: OpNode) -> list[Instruction] | None:
        inst = node.instruction
        if len(node.operands) != 2 or node.shape.is_tuple:
            return None
        table = graph.nodes[node.operands[0]]
        tshape = table.shape
        rank = tshape.rank
        tail = tuple(tshape.dims[1:])
        # jax's form collapses the row dim; XLA's canonical one keeps it as an offset dim
        # of 1 (output [n, 1, ...]).
        collapsed = inst.ints("collapsed_slice_dims", ()) == (0,) and \
            inst.ints("offset_dims", ()) == tuple(range(1, rank))
        kept = inst.ints("collapsed_slice_dims", ()) == () and \
            inst.ints("offset_dims", ()) == tuple(range(1, rank + 1))
        if not (collapsed or kept) or \
                inst.ints("start_index_map", ()) != (0,) or \
                inst.ints("operand_batching_dims", ()) or \
                inst.ints("slice_sizes", ()) != (1,) + tail:
            return None
        pattern = segment_pattern(graph, node.operands[1], inst.int("index_vector_dim"))
        if pattern is None or pattern.first + pattern.count > tshape.dims[0]:
            return None
        k, length = pattern.count, pattern.length
        if tuple(node.shape.dims) != (k * length,) + (() if collapsed else (1,)) + tail:
            return None
        etype = tshape.element_type
        self.note_split(node, k, length)
        out: list[Instruction] = []
        source = inst.operands[0]
        if pattern.first != 0 or k != tshape.dims[0]:
            spec = ", ".join([f"[{pattern.first}:{pattern.first + k}]"] +
                             [f"[0:{d}]" for d in tail])
            sliced = Instruction(self.fresh(f"{inst.name}.segments"), _shape(etype, (k,) + tail),
                                 "slice", [source], {"slice": "{" + spec + "}"})
            out.append(sliced)
            source = sliced.name
        spread = Instruction(self.fresh(f"{inst.name}.members"),
                             _shape(etype, (k, length) + tail), "broadcast", [source],
                             {"dimensions": _int_set((0,) + tuple(range(2, rank + 1)))})
        final = Instruction(inst.name, node.shape, "reshape", [spread.name])
        final.is_root = inst.is_root
        out += [spread, final]
        self.result.broadcasts.append(inst.name)
        return out

    # --- select on a proved predicate ----------------------------------------------------
    def select(self, graph: OpGraph, node: OpNode) -> list[Instruction] | None:
        """``select(p, a, b)`` whose predicate is proved all true (or all false) from the
        module (jax's in-bounds mask around a gather of proved indices): the chosen side."""
        inst = node.instruction
        if len(inst.operands) != 3 or graph.nodes[node.operands[0]].shape.rank == 0:
            return None
        # Proved on the value the predicate spreads (a broadcast of a [n] mask to
        # [n, 1, heads] may be too large to evaluate; every element is one of its source's).
        source = node.operands[0]
        while graph.nodes[source].opcode in _SPREADS and graph.nodes[source].operands:
            source = graph.nodes[source].operands[0]
        verdict = uniform_predicate(graph, source)
        if verdict is None:
            return None
        chosen = inst.operands[1] if verdict else inst.operands[2]
        self.result.selects.append(inst.name)
        if not inst.is_root:
            self.aliases.setdefault(node.computation, {})[inst.name] = chosen
            return []
        return [Instruction(inst.name, node.shape, "copy", [chosen], is_root=True)]


def _fills_with(graph: OpGraph, node: OpNode, literal: str, etype: str) -> bool:
    """Whether ``node`` is a broadcast of a scalar constant equal to ``literal`` (through
    copies: XLA's fills of several scatters are copies of one broadcast)."""
    while node.opcode == "copy" and node.operands:
        node = graph.nodes[node.operands[0]]
    if node.opcode != "broadcast" or not node.operands:
        return False
    src = graph.nodes[node.operands[0]]
    if src.opcode != "constant" or src.shape.rank != 0 or src.instruction.literal is None:
        return False
    try:
        return float(src.instruction.literal.strip()) == float(literal)
    except ValueError:
        return False


def _resolve(aliases: dict[str, str], name: str) -> str:
    while name in aliases:
        name = aliases[name]
    return name


def _drop_dead(comp: Computation, seeds: set[str]) -> None:
    """Remove the instructions only the replaced ones read (their index arithmetic)."""
    by_name = {i.name: i for i in comp.instructions}
    users: dict[str, int] = {}
    for inst in comp.instructions:
        for o in inst.operands:
            users[o] = users.get(o, 0) + 1
    dead: set[str] = set()
    stack = [s for s in seeds if s in by_name]
    while stack:
        name = stack.pop()
        inst = by_name[name]
        if name in dead or users.get(name, 0) or inst.is_root or inst.opcode == "parameter":
            continue
        dead.add(name)
        for o in inst.operands:
            users[o] -= 1
            stack.append(o)
    comp.instructions = [i for i in comp.instructions if i.name not in dead]


# Ops whose every element is an element of their first operand.
_SPREADS = ("broadcast", "bitcast", "reshape", "copy")

_REWRITES = {"scatter": "scatter", "gather": "gather", "select": "select"}


def _fusion_bodies(module: HloModule) -> set[str]:
    """Fused computations a rewrite may change without changing what their fusion returns:
    called by exactly one fusion instruction and by nothing else; the rewrite keeps the
    name and shape of the root (or of each element of a root tuple)."""
    calls: dict[str, int] = {}
    by_fusion: set[str] = set()
    for comp in module.computations:
        for inst in comp.instructions:
            for name in inst.called_computations:
                name = name.lstrip("%")
                calls[name] = calls.get(name, 0) + 1
                if inst.opcode == "fusion":
                    by_fusion.add(name)
    bodies = set()
    for comp in module.computations:
        root = comp.root
        if comp.name in by_fusion and calls.get(comp.name) == 1 and root is not None and \
                (not root.shape.is_tuple or root.opcode == "tuple"):
            bodies.add(comp.name)
    return bodies


def rewrite_segments(module: HloModule, fusion_bodies: bool = False) -> SegmentRewrite:
    """``module`` with its proved segment scatters and gathers as reductions and
    broadcasts: a new module sharing the unchanged computations and instructions
    (``module`` itself is not changed; returned as it is when nothing is proved).

    ``fusion_bodies`` (XLA's optimized modules): rewrite only ops inside fusions called
    once with one result, proved on the flattened op graph (the ids may come from
    another fusion); every top-level instruction keeps its name, operands and shape and
    every fusion returns what it returned, so XLA's module and the rewritten one differ in
    fusion bodies alone (``fused_segments_as_rows`` then lets some return the same bytes
    in the segments' shape)."""
    rewriter = _Rewriter(module)
    if not any(i.opcode in ("scatter", "gather") for c in module.computations
               for i in c.instructions):
        return rewriter.result
    bodies = _fusion_bodies(module) if fusion_bodies else set()
    replaced: dict[int, list[Instruction]] = {}
    seeds: dict[str, set[str]] = {}
    for graph in build_op_graphs(module):
        for node in graph.nodes:
            if node.opcode not in _REWRITES or (node.computation not in bodies
                                                if fusion_bodies
                                                else node.computation != graph.name):
                continue
            if node.opcode == "select" and graph.nodes[node.operands[0]].opcode not in \
                    ("reduce", "and", "compare", "broadcast"):
                continue
            try:
                got = getattr(rewriter, _REWRITES[node.opcode])(graph, node)
            except (KeyError, ValueError) as exc:
                log.debug("%s left as it is: %s", node.name, exc)
                got = None
            if got is not None:
                replaced[id(node.instruction)] = got
                seeds.setdefault(node.computation, set()).update(node.instruction.operands)
    if not replaced:
        return rewriter.result
    comps: list[Computation] = []
    for comp in module.computations:
        if any(id(i) in replaced for i in comp.instructions):
            new: list[Instruction] = []
            aliases = rewriter.aliases.get(comp.name, {})
            for inst in comp.instructions:
                for got in replaced.get(id(inst), [inst]):
                    if any(o in aliases for o in got.operands):
                        got = dataclasses.replace(
                            got, operands=[_resolve(aliases, o) for o in got.operands])
                    new.append(got)
            comp = dataclasses.replace(comp, instructions=new)
            _drop_dead(comp, seeds.get(comp.name, set()))
            split = {n: next(iter(ways)) for n, ways in
                     rewriter.splits.get(comp.name, {}).items() if len(ways) == 1}
            if split:
                rewriter.result.splits[comp.name] = split
                comp = shape_segments(comp, split, rewriter.names)
        comps.append(comp)
    rewriter.result.module = dataclasses.replace(module, computations=comps)
    log.debug("segments as rows: %d scatters reduced, %d gathers broadcast",
              len(rewriter.result.reductions), len(rewriter.result.broadcasts))
    return rewriter.result


def fused_segments_as_rows(module: HloModule) -> SegmentRewrite:
    """``rewrite_segments`` of an XLA-optimized module, in its fusion bodies only (the XLA
    pass plans from the result and places its kernels into ``module`` by name). The
    rewritten fusions then stop reading XLA's id and mask fusions: their unread parameters
    are dropped and the top-level instructions nothing reads any more with them, so the
    plan holds no dead kernel; every instruction left keeps its name, and its shape or
    the same bytes in the segments' shape (``segment_outputs``)."""
    rewrite = rewrite_segments(module, fusion_bodies=True)
    if rewrite.changed:
        rewrite.module = _without_unread(module, rewrite.module)
        names = {i.name for c in (*module.computations, *rewrite.module.computations)
                 for i in c.instructions}
        rewrite.module, rewrite.rows_outputs = fusions_return_rows(
            rewrite.module, rewrite.splits, names)
    return rewrite


# Top-level instructions dropped from the planned module where nothing reads them.
_DROPPABLE = {"bitcast", "copy", "broadcast", "reshape", "iota", "constant",
              "get-tuple-element"}


def _without_unread(original: HloModule, rewritten: HloModule) -> HloModule:
    """``rewritten`` with the parameters its changed fusion bodies no longer read dropped
    (from the body and from the calling fusion's operands) and then the top-level
    instructions no one reads (loop and input fusions, data movement)."""
    before = {c.name: c for c in original.computations}
    changed = {c.name: c for c in rewritten.computations if before.get(c.name) is not c}
    comps = {c.name: c for c in rewritten.computations}
    # fusion body -> positions of the parameters it still reads
    kept: dict[str, list[int]] = {}
    for name, comp in changed.items():
        read = {o for i in comp.instructions for o in i.operands}
        params = comp.parameters
        keep = [p.parameter_number for p in params if p.name in read]
        if len(keep) == len(params):
            continue
        kept[name] = keep
        renumber = {n: k for k, n in enumerate(keep)}
        comps[name] = dataclasses.replace(comp, instructions=[
            dataclasses.replace(i, parameter_number=renumber[i.parameter_number])
            if i.opcode == "parameter" else i
            for i in comp.instructions if i.opcode != "parameter" or i.name in read])
    for cname, comp in list(comps.items()):
        if not any(i.opcode == "fusion" and i.called_computations and
                   i.called_computations[0].lstrip("%") in kept for i in comp.instructions):
            continue
        out = []
        for inst in comp.instructions:
            body = inst.called_computations[0].lstrip("%") \
                if inst.opcode == "fusion" and inst.called_computations else None
            if body in kept:
                inst = dataclasses.replace(inst, operands=[inst.operands[k]
                                                           for k in kept[body]])
            out.append(inst)
        comps[cname] = _drop_unread_tops(dataclasses.replace(comp, instructions=out))
    return dataclasses.replace(rewritten, computations=[
        comps[c.name] for c in rewritten.computations])


def _drop_unread_tops(comp: Computation) -> Computation:
    users: dict[str, int] = {}
    for inst in comp.instructions:
        for o in inst.operands:
            users[o] = users.get(o, 0) + 1
    keep = [True] * len(comp.instructions)
    for k in range(len(comp.instructions) - 1, -1, -1):
        inst = comp.instructions[k]
        pure = inst.opcode in _DROPPABLE or (
            inst.opcode == "fusion" and inst.attrs.get("kind", "").strip() in
            ("kLoop", "kInput"))
        if users.get(inst.name, 0) or inst.is_root or not pure:
            continue
        keep[k] = False
        for o in inst.operands:
            users[o] -= 1
    return dataclasses.replace(comp, instructions=[
        i for i, k in zip(comp.instructions, keep) if k])


def segments_as_rows(module: HloModule) -> HloModule:
    """``rewrite_segments(module).module`` for a module XLA has not optimized (jax's
    pre-optimization HLO, what ``stitch.plan`` and ``stitch.compile`` plan from); an
    optimized one (scheduled, or holding fusions: the XLA pass's input, whose instructions
    the pass replaces by name) is returned as it is."""
    if module.attrs.get("is_scheduled", "").strip().lower() == "true" or any(
            i.opcode == "fusion" for c in module.computations for i in c.instructions):
        return module
    return rewrite_segments(module).module


__all__ = ["SegmentPattern", "SegmentRewrite", "segment_pattern", "rewrite_segments",
           "fused_segments_as_rows", "segments_as_rows"]
