"""Access order of buffers whose layout stitch chooses (``layouts.py``), for the tuner.

A value one stitched kernel writes and others read may be stored transposed (a *layout*:
its logical dims, major to minor). The latency-evaluator prices an access by how the
threads of a warp walk it: consecutive lanes on consecutive addresses (coalesced) or each
lane on a sector of its own (``WarpWork.sector_bytes``). This module says, for one kernel
part and the layouts under consideration, which reads and writes of those values are
strided, and which reductions now read their rows contiguously (a column reduction of a
value stored transposed is a row reduction of the buffer).

The lanes' direction is traced as one logical dim from where the part walks (a
reduction's rows, a written value's elements) back through the ops to the buffer
(``trace_dim``): elementwise ops keep it, a transpose permutes it, a bitcast/reshape maps
it to the operand dim its unit step lands in, a broadcast dim reads one element for every
lane (never strided). Only values present in ``layouts`` (the identity included: a
candidate at its default) are priced; every other access keeps the evaluator's old
assumption (coalesced), so a plan without layouts is costed as before.

Approximations (stated, not measured): a warp's store of a re-laid-out value in a row part
walks its logical last dim (thread composition in a loop part walks the buffer's own
physical order: ``stitch.codegen.lower``); a strided access moves one 32-byte sector per element,
served by the L2 (write-back merges the partial sectors before DRAM).
"""
from __future__ import annotations

import dataclasses
import math
from functools import lru_cache

from stitch.hlo.graph import OpGraph
from stitch.hlo.op_classes import OpClass

from ..analysis.feasibility import leaf_shape

Layout = tuple[int, ...]
SECTOR_BYTES = 32
UNKNOWN = -2          # the walk met an op it cannot follow: keep the old assumption
UNIFORM = -1          # every lane reads the same element (a broadcast dim)


def identity(rank: int) -> Layout:
    return tuple(range(rank))


@lru_cache(maxsize=4096)
def reshape_dim(src: tuple[int, ...], dst: tuple[int, ...], k: int) -> int:
    """The dim of a row-major ``src`` that a unit step along dim k of ``dst`` (its
    row-major reshape) moves: the minor-most src dim the step's offset touches."""
    if dst[k] == 1:
        return UNIFORM
    step = math.prod(dst[k + 1:])
    for d in range(len(src) - 1, -1, -1):
        inner = math.prod(src[d + 1:])
        if step % inner == 0 and (step // inner) % src[d] != 0:
            return d
    return UNKNOWN


def trace_dim(graph: OpGraph, members: frozenset[int], start: int, dim: int, target: int,
              _seen: dict | None = None) -> int | None:
    """The dim of ``target`` that lanes moving along ``dim`` of ``start`` move along;
    ``UNIFORM`` for a broadcast dim, ``UNKNOWN`` past an op the walk does not follow,
    None when ``start`` does not read ``target`` through the part's ops."""
    seen = {} if _seen is None else _seen
    key = (start, dim)
    if key in seen:
        return seen[key]
    seen[key] = None
    if start == target:
        seen[key] = dim
        return dim
    if start not in members or dim < 0:
        return None
    node = graph.nodes[start]
    shape = leaf_shape(node.shape)
    found: int | None = None
    for position, o in enumerate(node.operands):
        odims = leaf_shape(graph.nodes[o].shape).dims
        op = node.opcode
        if op == "transpose":
            at = node.instruction.ints("dimensions")[dim]
        elif op == "broadcast":
            mapped = list(node.instruction.ints("dimensions"))
            at = mapped.index(dim) if dim in mapped else UNIFORM
        elif op in ("bitcast", "reshape"):
            at = reshape_dim(odims, shape.dims, dim) if \
                math.prod(odims) == shape.num_elements else UNKNOWN
        elif odims == shape.dims and node.op_class in (OpClass.LIGHT, OpClass.EXPENSIVE) \
                or op in ("copy", "convert"):
            at = dim
        elif not odims:
            continue                   # a scalar operand: the same for every lane
        else:
            at = UNKNOWN
        if at == UNIFORM:
            got = UNIFORM if _reads(graph, members, o, target) else None
        elif at == UNKNOWN:
            got = UNKNOWN if _reads(graph, members, o, target) else None
        else:
            got = trace_dim(graph, members, o, at, target, seen)
        if got is not None:
            found = got if found is None or found == got else UNKNOWN
    seen[key] = found
    return found


def _reads(graph: OpGraph, members: frozenset[int], start: int, target: int) -> bool:
    stack, seen = [start], set()
    while stack:
        v = stack.pop()
        if v == target:
            return True
        if v in seen or v not in members:
            continue
        seen.add(v)
        stack.extend(graph.nodes[v].operands)
    return False


def strided(layout: Layout, dim: int | None) -> bool:
    """Lanes moving along logical ``dim`` of a buffer laid out as ``layout`` touch one
    sector each (the dim is not the buffer's physical minor one)."""
    return dim is not None and dim >= 0 and len(layout) > 0 and dim != layout[-1]


def feeding_inputs(graph: OpGraph, members: frozenset[int], r: int) -> set[int]:
    """Outside values a reduction's operand is computed from, not through another
    reduction of the part."""
    out, stack, seen = set(), [graph.nodes[r].operands[0]], set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v not in members:
            out.add(v)
            continue
        if graph.nodes[v].opcode == "reduce":
            continue
        stack.extend(graph.nodes[v].operands)
    return out


def _lane_dim(graph: OpGraph, r: int, minor: bool) -> int:
    """The dim of a reduction's operand its unit's lanes walk: the last reduced dim for
    contiguous rows (``stitch.codegen.lower``'s row split), else the last kept dim (a lane per
    row)."""
    node = graph.nodes[r]
    src = leaf_shape(graph.nodes[node.operands[0]].shape)
    reduced = set(node.instruction.ints("dimensions"))
    dims = [d for d in range(src.rank) if (d in reduced) == minor and src.dims[d] != 1]
    return dims[-1] if dims else UNIFORM


def apply_layouts(graph: OpGraph, facts, layouts: dict[int, Layout]):
    """``facts`` (a ``space.PartFacts``) with the part's accesses priced by order where a
    buffer in ``layouts`` is involved: reductions reading such a buffer take the row
    orientation all their inputs read contiguously (a column reduction of a value stored
    transposed becomes a row reduction), and every strided read or write adds its sectors
    to ``sector_bytes``: reads feeding those reductions, per-element reads of a buffer in
    ``layouts`` or by a walk over one, writes of one by a unit part."""
    if not layouts:
        return facts
    members = frozenset(facts.members)
    inputs = sorted({o for m in members for o in graph.nodes[m].operands if o not in members})
    if not any(v in layouts for v in inputs) and not any(v in layouts for v in members):
        return facts

    def layout_of(v: int) -> Layout:
        return layouts.get(v, identity(leaf_shape(graph.nodes[v].shape).rank))

    def elements(v: int) -> int:
        return leaf_shape(graph.nodes[v].shape).num_elements

    sector_bytes = 0.0
    reductions = list(facts.reductions)
    priced: set[int] = set()
    for i, r in enumerate(reductions):
        operand = graph.nodes[r.node].operands[0]
        feeding = [v for v in feeding_inputs(graph, members, r.node)
                   if elements(v) == elements(operand)]
        if not any(v in layouts for v in feeding):
            continue

        def contiguous(v: int, minor: bool, r=r, operand=operand) -> bool:
            lane = _lane_dim(graph, r.node, minor)
            dim = trace_dim(graph, members, operand, lane, v) if lane >= 0 else UNIFORM
            return not strided(layout_of(v), dim)
        rows_ok = all(contiguous(v, True) for v in feeding)
        cols_ok = all(contiguous(v, False) for v in feeding)
        minor = True if rows_ok else False if cols_ok else r.minor
        if minor != r.minor:
            reductions[i] = dataclasses.replace(r, minor=minor)
        for v in feeding:
            if v not in priced:
                priced.add(v)
                if not contiguous(v, minor):
                    sector_bytes += elements(v) * SECTOR_BYTES
    loop = not facts.reductions
    written = [v for v in facts.members if not graph.is_free(v) and (
        v in graph.outputs or any(u not in members for u in graph.nodes[v].users))]
    for w in written:
        shape = leaf_shape(graph.nodes[w].shape)
        if shape.rank == 0:
            continue
        own = layout_of(w)
        if not loop and w in layouts and strided(own, shape.rank - 1):
            # A unit part stores along the value's logical last dim.
            sector_bytes += shape.num_elements * SECTOR_BYTES
        # Thread composition walks the buffer's own order, a unit part the logical one.
        walk = own[-1] if loop else shape.rank - 1
        relaid = w in layouts and own != identity(shape.rank)
        for v in inputs:
            if v in priced or graph.nodes[v].op_class is OpClass.SOURCE and \
                    graph.nodes[v].opcode == "constant" or \
                    leaf_shape(graph.nodes[v].shape).rank == 0:
                continue
            if not (relaid or v in layouts):
                continue            # neither side's layout is in question: as before
            dim = trace_dim(graph, members, w, walk, v)
            if strided(layout_of(v), dim):
                priced.add(v)
                sector_bytes += elements(v) * SECTOR_BYTES
    if not reductions:
        return dataclasses.replace(facts, sector_bytes=sector_bytes)
    # As space.part_facts: the largest reduction's rows, contiguous when any disagree.
    primary = max(reductions, key=lambda r: r.rows * r.row_length)
    mixed = any(r.minor != primary.minor for r in reductions)
    return dataclasses.replace(facts, reductions=reductions, minor=primary.minor or mixed,
                               mixed_layout=mixed, sector_bytes=sector_bytes)
