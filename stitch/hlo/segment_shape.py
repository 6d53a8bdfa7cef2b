"""Elementwise work between segment reductions computed in the segments' shape.

After ``stitch.hlo.segments_as_rows`` a segmented softmax reads ``x[n]``, reshapes it to
``[count, length]`` for each reduce and reshapes each broadcast ``[count, length]`` back to
``[n]`` for the elementwise ops between. A reshape that merges a row dimension with the
rest hides the rows from the planner's row analysis (each value downstream of a reduce must
keep its row in a dimension of its own), so the chain would be cut at every reduce.

This pass gives those elementwise ops the shape ``[count, length, ...]``: an op of shape
``[n, ...]`` whose operands are such ops, the broadcasts the gathers became, scalar
broadcasts or other ``[n, ...]`` values (reshaped once) is rebuilt in the segments' shape
under the name ``<name>.rows``; the original name is a reshape back to ``[n, ...]`` for the
readers outside (the root, a non-elementwise op), dropped where nobody reads it. Only
reshapes change, so values and rounding are the same.
"""
from __future__ import annotations

import dataclasses
import logging

from .ir import Computation, Instruction, Shape
from .op_classes import EXPENSIVE_OPS, LIGHT_OPS

log = logging.getLogger(__name__)

ELEMENTWISE = (LIGHT_OPS | EXPENSIVE_OPS) - {"bitcast-convert", "stochastic-convert",
                                             "complex", "real", "imag"}
# Ops nothing depends on but their result: dropped when their result is not read.
_PURE = ELEMENTWISE | {"reshape", "bitcast", "broadcast", "constant", "iota"}

Split = dict[int, tuple[int, int]]          # n -> (count, length)


def _is_row_major(shape: Shape) -> bool:
    return shape.layout is None or shape.minor_to_major() == tuple(range(shape.rank - 1, -1, -1))


class _Shaper:
    def __init__(self, comp: Computation, split: Split, names: set[str]):
        self.comp, self.split, self.names = comp, split, names
        self.by_name = {i.name: i for i in comp.instructions}
        self.rows: dict[str, str] = {}          # [n] value -> its [count, length] version
        self.rows_dims: dict[str, tuple[int, ...]] = {}     # rows version -> its dims
        self.copies: set[str] = set()           # reshapes turned into copies of rows
        self.out: list[Instruction] = []
        self.changed = 0

    def fresh(self, base: str) -> str:
        name, k = f"{base}.rows", 0
        while name in self.names:
            k += 1
            name = f"{base}.rows{k}"
        self.names.add(name)
        return name

    def target(self, shape: Shape) -> tuple[int, ...] | None:
        """[count, length, ...] for a row-major [n, ...] array shape (its other dims of
        extent 1 left out: XLA's bodies carry a gather's [n, 1, ...] and its [n, ...]
        bitcast side by side), else None."""
        if shape.is_tuple or shape.rank == 0 or not _is_row_major(shape):
            return None
        got = self.split.get(shape.dims[0])
        return None if got is None else got + tuple(d for d in shape.dims[1:] if d != 1)

    def operand_rows(self, name: str, dims: tuple[int, ...]) -> str | None:
        """The [count, length, ...] version of operand ``name``, made when needed."""
        if name in self.rows:
            return self.rows[name] if self.rows_dims[self.rows[name]] == dims else None
        inst = self.by_name.get(name)
        if inst is None or inst.shape.is_tuple:
            return None
        if inst.opcode == "broadcast" and not inst.ints("dimensions", ()) and \
                self.by_name.get(inst.operands[0]) is not None and \
                self.by_name[inst.operands[0]].shape.rank == 0:
            made = Instruction(self.fresh(name), Shape(inst.shape.element_type, dims),
                               "broadcast", [inst.operands[0]], {"dimensions": "{}"})
        elif self.target(inst.shape) == dims:
            made = Instruction(self.fresh(name), Shape(inst.shape.element_type, dims),
                               "reshape", [name])
        else:
            return None
        self.out.append(made)
        self.rows[name] = made.name
        self.rows_dims[made.name] = dims
        return made.name

    def visit(self, inst: Instruction) -> None:
        dims = self.target(inst.shape)
        src = self.by_name.get(inst.operands[0]) if len(inst.operands) == 1 else None
        # A reshape, or a bitcast between row-major shapes (the same elements in order).
        relabels = src is not None and (inst.opcode == "reshape" or (
            inst.opcode == "bitcast" and _is_row_major(inst.shape) and
            not src.shape.is_tuple and _is_row_major(src.shape)))
        if dims is not None and relabels:
            source = None
            if _is_row_major(src.shape) and _squeezed(src.shape) == dims:
                # A gather's broadcast read back as [n]: its source is the rows version
                # (less the extent-1 dims XLA's canonical gathers keep).
                source = src.name
                if tuple(src.shape.dims) != dims:
                    source = self.add_reshape(src, dims)
            elif self.rows_dims.get(self.rows.get(inst.operands[0], "")) == dims:
                source = self.rows[inst.operands[0]]    # [n, 1, ...] <-> [n, ...]
            if source is not None:
                self.rows[inst.name] = source
                self.rows_dims[source] = dims
                self.out.append(inst)
                return
        if dims is not None and inst.opcode in ELEMENTWISE and inst.operands and \
                any(o in self.rows for o in inst.operands):
            operands = []
            for o in inst.operands:
                src = self.by_name.get(o)
                got = None if src is None else self.operand_rows(o, dims)
                if got is None:
                    break
                operands.append(got)
            else:
                rows = dataclasses.replace(inst, name=self.fresh(inst.name),
                                           shape=Shape(inst.shape.element_type, dims),
                                           operands=operands, is_root=False)
                self.out.append(rows)
                self.rows[inst.name] = rows.name
                self.rows_dims[rows.name] = dims
                self.out.append(Instruction(inst.name, inst.shape, "reshape", [rows.name],
                                            is_root=inst.is_root))
                self.changed += 1
                return
        rows = self.rows.get(inst.operands[0], "") if relabels else ""
        if rows and _squeezed(inst.shape) == self.rows_dims.get(rows):
            # [n] -> [count, length] for a reduce: its readers read the rows version
            # (reshaped where XLA's canonical scatter keeps extent-1 dims).
            if tuple(inst.shape.dims) == self.rows_dims[rows]:
                self.out.append(Instruction(inst.name, inst.shape, "copy", [rows],
                                            is_root=inst.is_root))
                self.copies.add(inst.name)
            else:
                self.out.append(Instruction(inst.name, inst.shape, "reshape", [rows],
                                            is_root=inst.is_root))
            self.changed += 1
            return
        self.out.append(inst)

    def add_reshape(self, src: Instruction, dims: tuple[int, ...]) -> str:
        made = Instruction(self.fresh(src.name), Shape(src.shape.element_type, dims),
                           "reshape", [src.name])
        self.out.append(made)
        return made.name


def _squeezed(shape: Shape) -> tuple[int, ...] | None:
    """[count, length, ...] dims less the extent-1 dims after the first two."""
    if shape.is_tuple or shape.rank < 2:
        return None
    return tuple(shape.dims[:2]) + tuple(d for d in shape.dims[2:] if d != 1)


def _drop_unread(instructions: list[Instruction]) -> list[Instruction]:
    users: dict[str, int] = {}
    for inst in instructions:
        for o in inst.operands:
            users[o] = users.get(o, 0) + 1
    keep = [True] * len(instructions)
    for k in range(len(instructions) - 1, -1, -1):
        inst = instructions[k]
        if users.get(inst.name, 0) or inst.is_root or inst.opcode not in _PURE:
            continue
        keep[k] = False
        for o in inst.operands:
            users[o] -= 1
    return [i for i, k in zip(instructions, keep) if k]


def _forward_copies(instructions: list[Instruction], copies: set[str]) -> list[Instruction]:
    """Readers of a non-root ``copy`` made here read its source (shapes are equal)."""
    alias = {i.name: i.operands[0] for i in instructions
             if i.name in copies and not i.is_root}
    if not alias:
        return instructions
    out = []
    for inst in instructions:
        if inst.name in alias:
            continue
        if any(o in alias for o in inst.operands):
            inst = dataclasses.replace(inst, operands=[alias.get(o, o) for o in inst.operands])
        out.append(inst)
    return out


def shape_segments(comp: Computation, split: Split, names: set[str]) -> Computation:
    """``comp`` with its elementwise ops on ``[n, ...]`` values computed as
    ``[count, length, ...]`` where they read a segment broadcast (module docstring)."""
    shaper = _Shaper(comp, split, names)
    for inst in comp.instructions:
        shaper.visit(inst)
    if not shaper.changed:
        return comp
    log.debug("%s: %d elementwise ops in the segments' shape", comp.name, shaper.changed)
    kept = _drop_unread(_forward_copies(shaper.out, shaper.copies))
    return dataclasses.replace(comp, instructions=kept)


__all__ = ["shape_segments", "ELEMENTWISE"]
