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

The schedules issue replaces this with the real predicate of its schedule space.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from hlo_passes.graph import OpGraph, OpNode
from hlo_passes.ir import Shape, parse_padding, parse_slice
from hlo_passes.op_classes import OpClass

RowMap = tuple[int, ...]


class Infeasible(Exception):
    """Internal: raised with the reason a pattern cannot be stitched."""


@dataclass(frozen=True)
class SharedReduction:
    node: int
    rows: int            # kept elements (rows of the block partition)
    row_length: int      # reduced elements per row
    minor: bool          # reduced dims are the physically minor-most ones (coalesced rows)


@dataclass
class PatternAnalysis:
    """What the cost model needs to know about a feasible pattern."""

    components: list[list[int]]                       # connected parts (packing if > 1)
    shared: list[SharedReduction] = field(default_factory=list)
    component_of: dict[int, int] = field(default_factory=dict)


def _leaf(shape: Shape) -> Shape:
    return next(shape.leaves()) if shape.is_tuple else shape


def _physical_order(shape: Shape) -> list[int]:
    """Logical dims from major to minor."""
    return list(reversed(shape.minor_to_major()))


def _reduced_dims_are_minor(shape: Shape, reduced: Iterable[int]) -> bool:
    reduced = set(reduced)
    order = _physical_order(shape)
    tail = [d for d in order if shape.dims[d] != 1]
    k = len([d for d in reduced if shape.dims[d] != 1])
    return set(tail[len(tail) - k:]) == {d for d in reduced if shape.dims[d] != 1}


def _reshape_row_map(src: Shape, dst: Shape, om: RowMap) -> RowMap:
    """Carry a row map through a reshape/bitcast by matching blocks of physical dims with
    equal products. Row dims must form whole blocks, in physical major-to-minor order."""
    src_order, dst_order = _physical_order(src), _physical_order(dst)
    src_sizes = [src.dims[d] for d in src_order]
    dst_sizes = [dst.dims[d] for d in dst_order]
    rows = [src_order.index(d) for d in om if src.dims[d] != 1]
    if rows != sorted(rows):
        raise Infeasible("reshape of rows that are not in physical order")
    row_set = set(rows)
    out: list[int] = []
    i = j = 0
    while i < len(src_sizes) or j < len(dst_sizes):
        if i < len(src_sizes) and src_sizes[i] == 1:
            i += 1
            continue
        if j < len(dst_sizes) and dst_sizes[j] == 1:
            j += 1
            continue
        si, dj = [i], [j]
        if i >= len(src_sizes) or j >= len(dst_sizes):
            raise Infeasible("reshape sizes do not match")
        ps, pd = src_sizes[i], dst_sizes[j]
        i, j = i + 1, j + 1
        while ps != pd:
            if ps < pd:
                if i >= len(src_sizes):
                    raise Infeasible("reshape sizes do not match")
                ps *= src_sizes[i]
                si.append(i)
                i += 1
            else:
                if j >= len(dst_sizes):
                    raise Infeasible("reshape sizes do not match")
                pd *= dst_sizes[j]
                dj.append(j)
                j += 1
        inside = [s in row_set for s in si if src_sizes[s] != 1]
        if any(inside) and not all(inside):
            raise Infeasible("reshape splits a row dimension from a non-row one")
        if any(inside):
            out.extend(dst_order[d] for d in dj)
    return tuple(out)


def _transfer(graph: OpGraph, node: OpNode, position: int, om: RowMap) -> RowMap:
    """The row map of ``node``'s output given the row map of its operand at ``position``."""
    op = node.opcode
    inst = node.instruction
    src = _leaf(graph.nodes[node.operands[position]].shape)
    out_shape = _leaf(node.shape)
    if op == "reduce":
        n_inputs = len(node.operands) // 2
        if position >= n_inputs:
            if om:
                raise Infeasible("reduce init value carries rows")
            return om
        reduced = set(inst.ints("dimensions"))
        if reduced & set(om):
            raise Infeasible(f"{node.name} reduces over the rows of a shared reduction "
                             "(needs cross-block data)")
        kept = [d for d in range(src.rank) if d not in reduced]
        return tuple(kept.index(d) for d in om)
    if op == "reduce-window":
        if position >= len(node.operands) // 2:
            return om
        from hlo_passes.ir import parse_window
        window = parse_window(inst.attrs.get("window", "{}"), src.rank)
        for d in om:
            w = window[d]
            if (w.size, w.stride, w.pad_low, w.pad_high, w.lhs_dilate) != (1, 1, 0, 0, 1):
                raise Infeasible(f"{node.name} windows over row dimension {d}")
        return om
    if op == "broadcast":
        dims = inst.ints("dimensions", ())
        return tuple(dims[i] for i in om)
    if op == "transpose":
        perm = list(inst.ints("dimensions"))
        return tuple(perm.index(i) for i in om)
    if op in ("reshape", "bitcast"):
        return _reshape_row_map(src, out_shape, om)
    if op == "slice":
        spec = parse_slice(inst.attrs["slice"])
        for d in om:
            s = spec[d]
            if (s.start, s.limit, s.stride) != (0, src.dims[d], 1):
                raise Infeasible(f"{node.name} slices row dimension {d}")
        return om
    if op in ("dynamic-slice", "dynamic-update-slice"):
        data_operands = 1 if op == "dynamic-slice" else 2
        if position >= data_operands:
            if om:
                raise Infeasible(f"{node.name}: slice offsets depend on rows")
            return ()
        # The slice (or update) must span every row dimension entirely.
        if op == "dynamic-slice":
            sizes, full = inst.ints("dynamic_slice_sizes"), src.dims
        else:
            sizes, full = _leaf(graph.nodes[node.operands[1]].shape).dims, out_shape.dims
        for d in om:
            if sizes[d] != full[d]:
                raise Infeasible(f"{node.name} slices row dimension {d}")
        return om
    if op == "pad":
        if position == 1:
            if om:
                raise Infeasible("pad value carries rows")
            return om
        pads = parse_padding(inst.attrs.get("padding", "{}"))
        for d in om:
            p = pads[d]
            if (p.low, p.high, p.interior) != (0, 0, 0):
                raise Infeasible(f"{node.name} pads row dimension {d}")
        return om
    if op == "concatenate":
        if inst.ints("dimensions")[0] in om:
            raise Infeasible(f"{node.name} concatenates along a row dimension")
        return om
    if op == "reverse":
        if set(inst.ints("dimensions")) & set(om):
            raise Infeasible(f"{node.name} reverses a row dimension")
        return om
    if op == "get-tuple-element":
        return om
    if node.op_class in (OpClass.LIGHT, OpClass.EXPENSIVE) or op in ("copy", "convert"):
        if src.rank == out_shape.rank:
            return om
        if src.rank == 0 and not om:   # scalar operand of clamp/select
            return om
        raise Infeasible(f"{node.name}: operand rank differs from its output")
    raise Infeasible(f"{node.name} ({op}) cannot carry reduction rows")


def analyze_pattern(graph: OpGraph, members: Iterable[int]) -> PatternAnalysis:
    """The analysis of a stitchable pattern; raises Infeasible(reason) otherwise."""
    members = sorted(set(members))
    member_set = set(members)
    row_maps: dict[int, RowMap] = {}
    shared: list[SharedReduction] = []
    for v in members:
        node = graph.nodes[v]
        if node.op_class in (OpClass.COMPUTE, OpClass.OPAQUE, OpClass.SOURCE):
            raise Infeasible(f"{node.name} ({node.opcode}) is a kernel boundary")
        result: RowMap | None = None
        for position, o in enumerate(node.operands):
            om = row_maps.get(o)
            if om is None:
                continue
            mapped = _transfer(graph, node, position, om)
            if result is not None and mapped != result:
                raise Infeasible(f"{node.name} joins values partitioned by different rows "
                                 f"(dims {result} vs {mapped})")
            result = mapped
        is_shared = (node.op_class is OpClass.REDUCTION
                     and any(u in member_set for u in node.users))
        if is_shared:
            if node.opcode != "reduce":
                raise Infeasible(f"{node.name} ({node.opcode}) result cannot be shared "
                                 "inside a kernel")
            src = _leaf(graph.nodes[node.operands[0]].shape)
            out = _leaf(node.shape)
            reduced = node.instruction.ints("dimensions")
            shared.append(SharedReduction(
                v, max(out.num_elements, 1), max(src.num_elements // max(out.num_elements, 1), 1),
                _reduced_dims_are_minor(src, reduced)))
            if result is None:
                result = tuple(range(out.rank))
        if result is not None:
            row_maps[v] = result
    analysis = PatternAnalysis(components=_components(graph, members, member_set), shared=shared)
    for index, comp in enumerate(analysis.components):
        for v in comp:
            analysis.component_of[v] = index
    return analysis


def infeasible_reason(graph: OpGraph, members: Iterable[int]) -> str | None:
    """None when the pattern can be stitched, else why not."""
    try:
        analyze_pattern(graph, members)
    except Infeasible as exc:
        return str(exc)
    return None


def _components(graph: OpGraph, members: list[int], member_set: set[int]) -> list[list[int]]:
    """Weakly connected components through edges inside the pattern."""
    parent = {v: v for v in members}

    def find(v: int) -> int:
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    for v in members:
        for o in graph.nodes[v].operands:
            if o in member_set:
                a, b = find(v), find(o)
                if a != b:
                    parent[a] = b
    groups: dict[int, list[int]] = {}
    for v in members:
        groups.setdefault(find(v), []).append(v)
    return list(groups.values())
