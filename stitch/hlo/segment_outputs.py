"""Fusions that return a segment-shaped value in the segments' shape (the XLA pass's
planned module only).

``segment_shape`` computes the elementwise work of a rewritten fusion body as
``[count, length, ...]``, but a fusion that returns ``[n, ...]`` (the softmax's output,
a gradient) still ends in a reshape merging the segment dim with the member dim. In a
stitched kernel that reshape sits downstream of the segment reductions, and the planner's
row analysis cannot keep a row inside a merged dim: the kernel's rows collapse to the
trailing dims and it no longer pays (or is split at every reduce).

A row-major ``[count, length, ...]`` array and its ``[n, ...]`` reshape are the same bytes.
So the planned module lets such a fusion return the segments' shape: the body's root is
the rows version under the root's name, the fusion and its readers' parameters take the
new shape (a reader's body gets the flat value back by a reshape, which ``segment_shape``
then folds into its own rows work). Placement wires buffers with the shapes of XLA's own
instructions (by name), so a kernel writing the segments' shape writes exactly the bytes
XLA's instruction holds. Only fusions whose readers are fusions (or that are the entry
computation's root) change; anything else keeps reading ``[n, ...]``.
"""
from __future__ import annotations

import dataclasses
import logging
import math

from .ir import Computation, HloModule, Instruction, Shape
from .segment_shape import Split, shape_segments

log = logging.getLogger(__name__)


def _row_major(shape: Shape) -> bool:
    return shape.layout is None or \
        shape.minor_to_major() == tuple(range(shape.rank - 1, -1, -1))


def _segments_shape(flat: Shape, rows: Shape, split: Split) -> bool:
    """Whether ``rows`` is ``flat`` = [n, ...] as [count, length, ...] (``split``'s)."""
    if flat.is_tuple or rows.is_tuple or flat.rank == 0 or \
            flat.element_type != rows.element_type or \
            not (_row_major(flat) and _row_major(rows)):
        return False
    got = split.get(flat.dims[0])
    if got is None:
        return False
    tail = tuple(d for d in flat.dims[1:] if d != 1)
    return tuple(rows.dims) == got + tail and \
        math.prod(rows.dims) == math.prod(flat.dims)


def _rows_source(body: Computation, by_name: dict[str, Instruction], name: str,
                 split: Split) -> Instruction | None:
    """The rows version ``name`` (a returned value) reshapes, where only it reads it."""
    flat = by_name.get(name)
    if flat is None or flat.opcode not in ("reshape", "bitcast") or len(flat.operands) != 1:
        return None
    source = by_name.get(flat.operands[0])
    if source is None or source.opcode == "parameter" or \
            not _segments_shape(flat.shape, source.shape, split):
        return None
    # Both read by nothing else in the body (the flat value only by the root tuple):
    # the rows version then takes the flat one's name and place.
    if sum(1 for i in body.instructions if source.name in i.operands) != 1 or \
            sum(1 for i in body.instructions if name in i.operands and not i.is_root) != 0:
        return None
    return source


def _returned_as_rows(body: Computation, split: Split, elements: set[int] | None
                      ) -> tuple[Computation, dict[int | None, Shape]] | None:
    """``body`` returning the rows version of its root (``elements`` None) or of those
    root tuple elements that have one, each under the name of the value it replaces; and
    the shapes now returned (tuple index or None -> shape)."""
    root = body.root
    if root is None:
        return None
    by_name = body.by_name()
    returned = [None] if elements is None else [
        i for i in sorted(elements) if i < len(root.operands) and
        root.operands.count(root.operands[i]) == 1]
    swaps: dict[str, Instruction] = {}          # reshape replaced -> rows source
    shapes: dict[int | None, Shape] = {}
    for index in returned:
        name = root.name if index is None else root.operands[index]
        source = _rows_source(body, by_name, name, split)
        if source is not None:
            swaps[name] = source
            shapes[index] = source.shape
    if not swaps:
        return None
    renamed = {source.name: flat for flat, source in swaps.items()}
    out = []
    for inst in body.instructions:
        if inst.name in swaps:
            continue
        if inst.name in renamed:
            inst = dataclasses.replace(inst, name=renamed[inst.name],
                                       is_root=elements is None)
        if any(o in renamed for o in inst.operands):
            inst = dataclasses.replace(inst, operands=[renamed.get(o, o)
                                                       for o in inst.operands])
        if inst.is_root and elements is not None:
            inst = dataclasses.replace(inst, shape=Shape("tuple", tuple_shapes=tuple(
                shapes.get(i, s) for i, s in enumerate(inst.shape.tuple_shapes))))
        out.append(inst)
    return dataclasses.replace(body, instructions=out, signature=None), shapes


def _reads_rows(body: Computation, positions: set[int], shape: Shape, split: Split,
                names: set[str]) -> Computation:
    """``body`` whose parameters at ``positions`` now arrive as ``shape`` (the segments'
    shape of what they were): each is reshaped back for its readers, then
    ``segment_shape`` folds that reshape into the body's rows work where it can."""
    out: list[Instruction] = []
    renamed: dict[str, str] = {}
    for inst in body.instructions:
        if inst.opcode == "parameter" and inst.parameter_number in positions:
            flat = f"{inst.name}.flat"
            k = 0
            while flat in names:
                k += 1
                flat = f"{inst.name}.flat{k}"
            names.add(flat)
            renamed[inst.name] = flat
            out.append(dataclasses.replace(inst, shape=shape))
            out.append(Instruction(flat, inst.shape, "reshape", [inst.name]))
            continue
        if any(o in renamed for o in inst.operands):
            inst = dataclasses.replace(inst, operands=[renamed.get(o, o)
                                                       for o in inst.operands])
        out.append(inst)
    return shape_segments(dataclasses.replace(body, instructions=out, signature=None),
                          split, names)


def _called_once(module: HloModule) -> dict[str, int]:
    calls: dict[str, int] = {}
    for comp in module.computations:
        for inst in comp.instructions:
            for name in inst.called_computations:
                calls[name.lstrip("%")] = calls.get(name.lstrip("%"), 0) + 1
    return calls


def _fusion_body(inst: Instruction) -> str | None:
    if inst.opcode != "fusion" or not inst.called_computations:
        return None
    return inst.called_computations[0].lstrip("%")


def fusions_return_rows(module: HloModule, bodies: dict[str, Split],
                        names: set[str]) -> tuple[HloModule, list[str]]:
    """``module`` with the fusions of ``bodies`` (fused computation -> the splits its
    segments proved) returning the segments' shape where the module docstring allows;
    the fusions changed."""
    comps = {c.name: c for c in module.computations}
    calls = _called_once(module)
    changed: list[str] = []
    for comp in module.computations:
        if comp.name in bodies:
            continue                                    # a fusion body itself
        instructions = list(comps[comp.name].instructions)
        for k, inst in enumerate(instructions):
            body_name = _fusion_body(inst)
            if body_name not in bodies or (inst.is_root and not comp.is_entry):
                continue                                # a loop's state keeps its shape
            # Per returned value (tuple index or None): the fusion bodies reading it
            # (reader, operand positions), and the tuple elements that carry it.
            readers: dict[int | None, list[tuple[Instruction, set[int]]]] = {}
            carriers: dict[int, list[int]] = {}
            blocked: set[int | None] = set()
            for j, user in enumerate(instructions):
                if inst.name not in user.operands:
                    continue
                if inst.shape.is_tuple and user.opcode == "get-tuple-element":
                    index = user.int("index")
                    carriers.setdefault(index, []).append(j)
                    if user.is_root:
                        blocked.add(index)
                    for reader in instructions:
                        if user.name in reader.operands:
                            self_positions = {p for p, o in enumerate(reader.operands)
                                              if o == user.name}
                            readers.setdefault(index, []).append((reader, self_positions))
                    continue
                key = None
                readers.setdefault(key, []).append(
                    (user, {p for p, o in enumerate(user.operands) if o == inst.name}))
            if inst.shape.is_tuple:
                if None in readers:
                    continue                            # the tuple itself is read
                wanted: set[int] | None = set(carriers) - blocked
            else:
                wanted = None
            for key, users in readers.items():
                if any(calls.get(_fusion_body(u) or "") != 1 or _fusion_body(u) not in comps
                       for u, _ in users):
                    if wanted is None:
                        break
                    wanted.discard(key)
            else:
                got = _returned_as_rows(comps[body_name], bodies[body_name], wanted)
                if got is None:
                    continue
                body, shapes = got
                comps[body_name] = body
                instructions[k] = dataclasses.replace(inst, shape=body.root.shape)
                for key, shape in shapes.items():
                    for reader, positions in readers.get(key, []):
                        rb = _fusion_body(reader)
                        comps[rb] = _reads_rows(comps[rb], positions, shape,
                                                bodies[body_name], names)
                    for j in carriers.get(key, []) if key is not None else []:
                        instructions[j] = dataclasses.replace(instructions[j], shape=shape)
                changed.append(inst.name)
        if instructions != comps[comp.name].instructions:
            comps[comp.name] = dataclasses.replace(comps[comp.name],
                                                   instructions=instructions,
                                                   signature=None)
    if not changed:
        return module, []
    log.debug("%s: %d fusions return the segments' shape", module.name, len(changed))
    return dataclasses.replace(module, computations=[comps[c.name]
                                                     for c in module.computations]), changed


__all__ = ["fusions_return_rows"]
