"""HloModule -> HLO text that ``parse_hlo`` reads back to an equal module."""
from __future__ import annotations

from .ir import Computation, HloModule, Instruction


def _attrs(attrs: dict[str, str]) -> str:
    return "".join(f", {k}={v}" for k, v in attrs.items())


def print_instruction(inst: Instruction, shapes: dict[str, object] | None = None) -> str:
    """``shapes`` (name -> Shape of the computation's instructions): print operands typed,
    as XLA does (``f32[8]{0} %x``); XLA's parser needs that for an operand whose name is
    also an opcode (``%get-tuple-element``), which it reads as a nested instruction."""
    if inst.opcode == "parameter":
        inside = str(inst.parameter_number)
    elif inst.opcode == "constant":
        inside = inst.literal or ""
    elif shapes is not None:
        inside = ", ".join(f"{shapes[op]} %{op}" if op in shapes else f"%{op}"
                           for op in inst.operands)
    else:
        inside = ", ".join(f"%{op}" for op in inst.operands)
    root = "ROOT " if inst.is_root else ""
    return f"{root}%{inst.name} = {inst.shape} {inst.opcode}({inside}){_attrs(inst.attrs)}"


def print_computation(comp: Computation, operand_shapes: bool = False) -> str:
    head = ("ENTRY " if comp.is_entry else "") + f"%{comp.name}"
    if comp.signature is not None:
        params = ", ".join(f"{name}: {shape}" for name, shape in comp.signature.params)
        head += f" ({params}) -> {comp.signature.result}"
    shapes = {i.name: i.shape for i in comp.instructions} if operand_shapes else None
    body = "\n".join("  " + print_instruction(i, shapes) for i in comp.instructions)
    return f"{head} {{\n{body}\n}}{_attrs(comp.attrs)}"


def print_hlo(module: HloModule, operand_shapes: bool = False) -> str:
    """The module as text; ``operand_shapes``: operands typed, as XLA prints them."""
    parts = [f"HloModule {module.name}{_attrs(module.attrs)}"]
    for section, entries in module.tables:
        parts.append("\n".join([section, *entries]))
    parts.extend(print_computation(c, operand_shapes) for c in module.computations)
    return "\n\n".join(parts) + "\n"
