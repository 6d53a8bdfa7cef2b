"""Where an instruction came from in the user's code, from XLA's metadata.

XLA keeps ``metadata={op_name="jit(step)/jvp(layer)/sub" ...}`` on instructions, with either
``source_file="..." source_line=N`` (older jax) or ``stack_frame_id=N`` into the module's
FileNames / FunctionNames / FileLocations / StackFrames tables (newer jax; the parser keeps
them verbatim in ``HloModule.tables``). ``SourceLines(module).where(instructions)`` says it
in a few words — the user's functions with ``file:line`` — for reasons and reports that would
otherwise name HLO ops only (``multiply.11.1 -> sub.39.15``). Empty where XLA kept nothing.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Iterable

from .ir import HloModule, Instruction

_FIELD = re.compile(r'([A-Za-z_]\w*)=("(?:[^"\\]|\\.)*"|[^\s}]+)')
_ENTRY = re.compile(r'\s*(\d+)\s+(.*)$', re.S)
# op_name's transformation wrappers: jit(f), pjit(f), jvp(f), transpose(jvp(f))...
_WRAPPED = re.compile(r"^(?:\w+\()+([^()/]*?)\)+$")
MAX_PLACES = 3                 # places named per kernel; the rest counted


@dataclass(frozen=True)
class SourceLine:
    """One instruction's origin: the user's function and its ``file:line`` (0: unknown)."""
    function: str
    file: str
    line: int


def metadata_fields(text: str) -> dict[str, str]:
    """``{op_name="..." source_line=3}`` → its fields (strings unquoted)."""
    out = {}
    for key, value in _FIELD.findall(text or ""):
        out[key] = value[1:-1].replace('\\"', '"') if value.startswith('"') else value
    return out


_TABLE_TITLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_TABLE_ROW = re.compile(r"\s*(\d+)\s+(.*\S)\s*$")
_METADATA_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?([A-Za-z_][\w.\-]*)\s*=.*?\bmetadata=\{([^}]*)\}",
                            re.M)


def metadata_of_text(text: str) -> tuple[list[tuple[str, list[str]]], dict[str, str]]:
    """(source tables, instruction name → metadata) read from HLO text printed with its
    metadata (XLA's instruction names are unique in a module): the pass's own input is
    printed without, and reading a second full module costs far more than this scan."""
    tables: list[tuple[str, list[str]]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        title = lines[i].strip()
        if title in _TABLE_TITLES:
            rows = []
            i += 1
            while i < len(lines) and _TABLE_ROW.match(lines[i]):
                rows.append(lines[i].strip())
                i += 1
            tables.append((title, rows))
            continue
        if "{" in lines[i] and "=" not in lines[i]:
            break                               # the first computation: tables are done
        i += 1
    return tables, {m.group(1): m.group(2) for m in _METADATA_LINE.finditer(text)}


class SourceLines:
    """The module's source tables, asked per instruction. ``metadata`` (instruction name
    → its metadata text) stands in for instructions parsed without theirs, and ``tables``
    for the module's (both from ``metadata_of_text``)."""

    def __init__(self, module: HloModule | None = None, *,
                 tables: list[tuple[str, list[str]]] | None = None,
                 metadata: dict[str, str] | None = None) -> None:
        self._metadata = metadata or {}
        parsed: dict[str, dict[int, str]] = {}
        for title, entries in (module.tables if tables is None and module else tables or []):
            rows = parsed.setdefault(title, {})
            for entry in entries:
                m = _ENTRY.match(entry)
                if m:
                    rows[int(m.group(1))] = m.group(2).strip()
        tables = parsed
        self._files = {i: _unquote(v) for i, v in tables.get("FileNames", {}).items()}
        self._functions = {i: _unquote(v) for i, v in tables.get("FunctionNames", {}).items()}
        self._locations = {i: metadata_fields(v) for i, v in
                           tables.get("FileLocations", {}).items()}
        self._frames = {i: metadata_fields(v) for i, v in tables.get("StackFrames", {}).items()}

    def of(self, inst: Instruction) -> SourceLine | None:
        """Where ``inst`` came from, or None where XLA kept no source for it."""
        fields = metadata_fields(inst.attrs.get("metadata") or self._metadata.get(inst.name, ""))
        if not fields:
            return None
        function = op_name_function(fields.get("op_name", ""))
        if "source_file" in fields:
            return SourceLine(function, fields["source_file"],
                              _int(fields.get("source_line")))
        frame = self._frames.get(_int(fields.get("stack_frame_id")))
        if frame is not None:
            location = self._locations.get(_int(frame.get("file_location_id")), {})
            return SourceLine(
                self._functions.get(_int(location.get("function_name_id")), function),
                self._files.get(_int(location.get("file_name_id")), ""),
                _int(location.get("line")))
        return SourceLine(function, "", 0) if function else None

    def where(self, instructions: Iterable[Instruction]) -> str:
        """The places ``instructions`` came from, first seen first:
        ``layer (model.py:12,14), loss (train.py:40)``; "" where none is known."""
        places: dict[tuple[str, str], list[int]] = {}
        for inst in instructions:
            src = self.of(inst)
            if src is None:
                continue
            lines = places.setdefault((src.function, src.file), [])
            if src.line and src.line not in lines:
                lines.append(src.line)
        parts = []
        for (function, file), lines in list(places.items())[:MAX_PLACES]:
            at = os.path.basename(file)
            if at and lines:
                at += ":" + ",".join(str(n) for n in sorted(lines)[:4])
            parts.append(f"{function or '?'} ({at})" if at else function)
        if len(places) > MAX_PLACES:
            parts.append(f"+{len(places) - MAX_PLACES} more")
        return ", ".join(p for p in parts if p)


def op_name_function(op_name: str) -> str:
    """The innermost user function an ``op_name`` path names: ``jit(step)/jit(layer)/sub``
    → ``layer``; ``jit(f)/tanh`` → ``f``."""
    name = ""
    for part in op_name.split("/"):
        m = _WRAPPED.match(part)
        if m and m.group(1) and not m.group(1).startswith(("main", "...")):
            name = m.group(1)
    return name


def plan_sources(module: HloModule, fusion_plan: object,
                 metadata_text: str = "") -> dict[str, str]:
    """Each planned stitched kernel's ``where`` (kernel name → places; "" where unknown):
    ``fusion_plan`` is a FusionPlan (its graphs' stitched kernels and their members);
    ``metadata_text``: the module printed with its metadata, where ``module`` was read
    without."""
    if metadata_text:
        tables, metadata = metadata_of_text(metadata_text)
        lines = SourceLines(tables=tables, metadata=metadata)
    else:
        lines = SourceLines(module)
    # By name from ``module`` itself: a plan the plan cache handed back was made from
    # another module of the same structure, whose metadata may point elsewhere.
    own = {(c.name, i.name): i for c in module.computations for i in c.instructions}
    out: dict[str, str] = {}
    for result in getattr(fusion_plan, "graphs", ()):
        graph = result.graph
        for kernel in result.stitched.kernels:
            members = sorted(kernel.members, key=lambda v: (graph.is_free(v), v))
            out[kernel.name] = lines.where(
                own.get((graph.nodes[v].computation, graph.nodes[v].instruction.name),
                        graph.nodes[v].instruction) for v in members)
    return out


def _unquote(text: str) -> str:
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] == '"' else text


def _int(text: str | None) -> int:
    try:
        return int(text or 0)
    except ValueError:
        return 0
