"""Data classes for HLO modules: shapes, layouts, instructions, computations.

Attribute values are kept as the exact text XLA printed (so printing is lossless); typed
accessors (``Instruction.ints``, ``Instruction.called_computations`` ...) read them on demand.
The parser validates the attributes it knows with the same readers, so a value that parsed
is a value the accessors can read.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import Iterator

# Element types XLA prints; the value is the numpy-style name the evaluator maps them to.
ELEMENT_TYPES: frozenset[str] = frozenset({
    "pred", "s2", "s4", "s8", "s16", "s32", "s64", "u2", "u4", "u8", "u16", "u32", "u64",
    "f16", "bf16", "f32", "f64", "c64", "c128",
    "f8e4m3fn", "f8e5m2", "f8e4m3fnuz", "f8e5m2fnuz", "f8e4m3b11fnuz", "f8e4m3", "f8e3m4",
    "f4e2m1fn", "f8e8m0fnu", "token", "opaque",
})

BYTES_PER_ELEMENT: dict[str, float] = {
    "pred": 1, "s2": 0.25, "s4": 0.5, "s8": 1, "s16": 2, "s32": 4, "s64": 8,
    "u2": 0.25, "u4": 0.5, "u8": 1, "u16": 2, "u32": 4, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1,
    "f8e4m3": 1, "f8e3m4": 1, "f4e2m1fn": 0.5, "f8e8m0fnu": 1, "token": 0, "opaque": 0,
}


@dataclass(frozen=True, slots=True)
class Layout:
    """A dense layout: ``minor_to_major`` plus the raw text after ':' (tiles, memory space...)."""

    minor_to_major: tuple[int, ...]
    tail: str = ""

    @property
    def tiles(self) -> tuple[tuple[int, ...], ...]:
        """The ``T(a,b)(c,d)`` tiles of a tiled layout, outermost first."""
        match = re.match(r"T((?:\([\d,*]*\))+)", self.tail)
        if not match:
            return ()
        return tuple(tuple(int(d) if d != "*" else -1 for d in grp.split(",") if d)
                     for grp in re.findall(r"\(([^)]*)\)", match.group(1)))

    def __str__(self) -> str:
        dims = ",".join(map(str, self.minor_to_major))
        return "{" + dims + (":" + self.tail if self.tail else "") + "}"


@dataclass(frozen=True, slots=True)
class Shape:
    """An array shape (``element_type`` + dims + optional layout) or a tuple of shapes.

    ``dims[i] == -1`` is an unbounded dynamic dimension (``?``); ``dynamic[i]`` marks a
    bounded one (``<=N``).
    """

    element_type: str
    dims: tuple[int, ...] = ()
    dynamic: tuple[bool, ...] = ()
    layout: Layout | None = None
    tuple_shapes: tuple["Shape", ...] = ()

    @property
    def is_tuple(self) -> bool:
        return self.element_type == "tuple"

    @property
    def is_array(self) -> bool:
        return not self.is_tuple and self.element_type not in ("token", "opaque")

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def num_elements(self) -> int:
        return math.prod(self.dims)

    @property
    def byte_size(self) -> int:
        """Bytes of the whole value (tuples: sum of the leaves)."""
        if self.is_tuple:
            return sum(s.byte_size for s in self.tuple_shapes)
        return int(math.ceil(self.num_elements * BYTES_PER_ELEMENT.get(self.element_type, 0)))

    def leaves(self) -> Iterator["Shape"]:
        """Array leaves depth-first (how tuple outputs are flattened)."""
        if self.is_tuple:
            for sub in self.tuple_shapes:
                yield from sub.leaves()
        else:
            yield self

    def minor_to_major(self) -> tuple[int, ...]:
        """The layout's order, or XLA's default (row-major) when none was printed."""
        if self.layout is not None and len(self.layout.minor_to_major) == self.rank:
            return self.layout.minor_to_major
        return tuple(range(self.rank - 1, -1, -1))

    def without_layout(self) -> "Shape":
        if self.is_tuple:
            return Shape("tuple", tuple_shapes=tuple(s.without_layout() for s in self.tuple_shapes))
        return Shape(self.element_type, self.dims, self.dynamic)

    def __str__(self) -> str:
        if self.is_tuple:
            return "(" + ", ".join(str(s) for s in self.tuple_shapes) + ")"
        dims = []
        for i, d in enumerate(self.dims):
            if d == -1:
                dims.append("?")
            elif self.dynamic and self.dynamic[i]:
                dims.append(f"<={d}")
            else:
                dims.append(str(d))
        text = f"{self.element_type}[{','.join(dims)}]"
        return text + (str(self.layout) if self.layout is not None else "")


# Attributes whose values name called computations.
_CALL_ATTRS = ("to_apply", "calls", "condition", "body", "true_computation",
               "false_computation", "branch_computations", "called_computations",
               "comparator", "select", "scatter", "async_execution_thread_computations")

_INT_LIST = re.compile(r"\{\s*(-?\d+(\s*,\s*-?\d+)*)?\s*\}")


@functools.lru_cache(maxsize=4096)
def parse_int_list(text: str) -> tuple[int, ...]:
    """``{1,0}`` -> (1, 0); raises ValueError for anything else. Memoized: a module's
    attribute lists repeat (``dimensions={1}``), and the planner reads them again and
    again (``Instruction.ints``)."""
    if not _INT_LIST.fullmatch(text.strip()):
        raise ValueError(f"expected a list of integers like {{1,0}}, got {text!r}")
    inner = text.strip()[1:-1].strip()
    return tuple(int(v) for v in inner.split(",")) if inner else ()


def parse_computation_list(text: str) -> tuple[str, ...]:
    """``%a`` or ``{%a, %b}`` -> ('a', 'b')."""
    text = text.strip()
    if text.startswith("{"):
        if not text.endswith("}"):
            raise ValueError(f"expected {{%comp, ...}}, got {text!r}")
        items = [t.strip() for t in text[1:-1].split(",") if t.strip()]
    else:
        items = [text]
    names = []
    for item in items:
        if not re.fullmatch(r"%?[\w.\-]+", item):
            raise ValueError(f"expected a computation name, got {item!r}")
        names.append(item.lstrip("%"))
    return tuple(names)


@dataclass(frozen=True, slots=True)
class SliceDim:
    start: int
    limit: int
    stride: int = 1


def parse_slice(text: str) -> tuple[SliceDim, ...]:
    """``{[0:2], [1:9:2]}`` -> SliceDims."""
    text = text.strip()
    if not (text.startswith("{") and text.endswith("}")):
        raise ValueError(f"expected {{[start:limit:stride], ...}}, got {text!r}")
    dims = []
    for item in re.findall(r"[^,\s][^,]*", text[1:-1]):
        m = re.fullmatch(r"\s*\[\s*(-?\d+)\s*:\s*(-?\d+)\s*(?::\s*(-?\d+)\s*)?\]\s*", item)
        if not m:
            raise ValueError(f"expected [start:limit(:stride)], got {item.strip()!r}")
        dims.append(SliceDim(int(m.group(1)), int(m.group(2)), int(m.group(3) or 1)))
    return tuple(dims)


@dataclass(frozen=True, slots=True)
class PadDim:
    low: int
    high: int
    interior: int = 0


def parse_padding(text: str) -> tuple[PadDim, ...]:
    """``0_0x1_2_1`` -> PadDims (low_high[_interior] per dimension, 'x' separated)."""
    text = text.strip()
    if text == "{}":
        return ()
    dims = []
    for item in text.split("x"):
        m = re.fullmatch(r"(-?\d+)_(-?\d+)(?:_(-?\d+))?", item)
        if not m:
            raise ValueError(f"expected low_high[_interior] per dimension, got {text!r}")
        dims.append(PadDim(int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)))
    return tuple(dims)


@dataclass(frozen=True, slots=True)
class WindowDim:
    size: int = 1
    stride: int = 1
    pad_low: int = 0
    pad_high: int = 0
    lhs_dilate: int = 1
    rhs_dilate: int = 1
    reversal: bool = False


_WINDOW_FIELDS = ("size", "stride", "pad", "lhs_dilate", "rhs_dilate", "rhs_reversal")


def parse_window(text: str, rank: int | None = None) -> tuple[WindowDim, ...]:
    """``{size=3x3 stride=2x2 pad=1_1x1_1 lhs_dilate=.. rhs_dilate=.. rhs_reversal=0x1}``.

    Dimensions come from ``size`` (or ``rank`` when size is absent); every field present must
    give one value per dimension.
    """
    text = text.strip()
    if not (text.startswith("{") and text.endswith("}")):
        raise ValueError(f"expected a window {{size=... stride=...}}, got {text!r}")
    fields: dict[str, list[str]] = {}
    for item in text[1:-1].split():
        key, sep, value = item.partition("=")
        if not sep or key not in _WINDOW_FIELDS:
            raise ValueError(f"unknown window field {item!r}")
        fields[key] = value.split("x")
    n = len(fields["size"]) if "size" in fields else (rank or 0)
    for key, values in fields.items():
        if len(values) != n:
            raise ValueError(f"window field {key!r} has {len(values)} dims, expected {n}")

    def ints(key: str, default: int) -> list[int]:
        return [int(v) for v in fields[key]] if key in fields else [default] * n

    pads = [p.split("_") for p in fields.get("pad", ["0_0"] * n)]
    if any(len(p) != 2 for p in pads):
        raise ValueError(f"window pad must be low_high per dimension, got {fields['pad']}")
    return tuple(WindowDim(size, stride, int(lo), int(hi), lhs, rhs, bool(rev))
                 for size, stride, (lo, hi), lhs, rhs, rev in zip(
                     ints("size", 1), ints("stride", 1), pads, ints("lhs_dilate", 1),
                     ints("rhs_dilate", 1), ints("rhs_reversal", 0)))


@dataclass(frozen=True, slots=True)
class ConvDimensionNumbers:
    """``b01f_01io->b01f``: batch/feature/spatial dims of input, kernel and output."""

    input_batch: int
    input_feature: int
    input_spatial: tuple[int, ...]
    kernel_input_feature: int
    kernel_output_feature: int
    kernel_spatial: tuple[int, ...]
    output_batch: int
    output_feature: int
    output_spatial: tuple[int, ...]


def parse_dim_labels(text: str) -> ConvDimensionNumbers:
    m = re.fullmatch(r"([a-z0-9]+)_([a-z0-9]+)->([a-z0-9]+)", text.strip())
    if not m:
        raise ValueError(f"expected dim_labels like b01f_01io->b01f, got {text!r}")
    lhs, rhs, out = m.groups()

    def spatial(labels: str) -> tuple[int, ...]:
        digits = sorted((int(c), i) for i, c in enumerate(labels) if c.isdigit())
        if [d for d, _ in digits] != list(range(len(digits))):
            raise ValueError(f"spatial labels of {labels!r} are not 0..n-1")
        return tuple(i for _, i in digits)

    for labels, need in ((lhs, "bf"), (rhs, "io"), (out, "bf")):
        if any(labels.count(c) != 1 for c in need):
            raise ValueError(f"dim_labels part {labels!r} must contain each of {need!r} once")
    n = len(spatial(lhs))
    if len(spatial(rhs)) != n or len(spatial(out)) != n:
        raise ValueError(f"dim_labels {text!r} disagree on the number of spatial dims")
    return ConvDimensionNumbers(lhs.index("b"), lhs.index("f"), spatial(lhs),
                                rhs.index("i"), rhs.index("o"), spatial(rhs),
                                out.index("b"), out.index("f"), spatial(out))


@dataclass(eq=True, slots=True)
class Instruction:
    """One HLO instruction. ``operands`` are instruction names in the same computation.

    ``attrs`` maps attribute name -> value text exactly as printed. ``literal`` is the text
    inside ``constant(...)``; ``parameter_number`` is set for parameters.
    """

    name: str
    shape: Shape
    opcode: str
    operands: list[str] = field(default_factory=list)
    attrs: dict[str, str] = field(default_factory=dict)
    literal: str | None = None
    parameter_number: int | None = None
    is_root: bool = False
    known_opcode: bool = True

    # --- typed attribute readers -------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self.attrs

    def ints(self, key: str, default: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """An integer-list attribute such as ``dimensions={0,1}``."""
        if key not in self.attrs:
            if default is None:
                raise KeyError(f"{self.name}: attribute {key!r} is missing")
            return default
        return parse_int_list(self.attrs[key])

    def int(self, key: str, default: int | None = None) -> int:
        if key not in self.attrs:
            if default is None:
                raise KeyError(f"{self.name}: attribute {key!r} is missing")
            return default
        return int(self.attrs[key])

    def string(self, key: str, default: str | None = None) -> str:
        """A quoted string attribute (unescaped) or a bare word."""
        if key not in self.attrs:
            if default is None:
                raise KeyError(f"{self.name}: attribute {key!r} is missing")
            return default
        value = self.attrs[key]
        if len(value) >= 2 and value[0] == value[-1] == '"':
            return value[1:-1].encode("utf-8").decode("unicode_escape") if "\\" in value else value[1:-1]
        return value

    @property
    def called_computations(self) -> tuple[str, ...]:
        names: list[str] = []
        for key in _CALL_ATTRS:
            if key in self.attrs:
                names.extend(parse_computation_list(self.attrs[key]))
        return tuple(names)

    @property
    def backend_config(self) -> dict:
        """``backend_config`` parsed as JSON ({} when absent or not JSON)."""
        import json
        text = self.attrs.get("backend_config")
        if not text:
            return {}
        if text.startswith('"'):
            text = self.string("backend_config")
        try:
            value = json.loads(text)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


@dataclass(frozen=True, slots=True)
class Signature:
    """``(p0: f32[2], p1: s32[]) -> f32[2]`` as printed before a computation body."""

    params: tuple[tuple[str, Shape], ...]
    result: Shape


@dataclass(eq=True, slots=True)
class Computation:
    name: str
    instructions: list[Instruction]
    is_entry: bool = False
    signature: Signature | None = None
    attrs: dict[str, str] = field(default_factory=dict)

    @property
    def root(self) -> Instruction:
        for inst in self.instructions:
            if inst.is_root:
                return inst
        return self.instructions[-1]

    @property
    def parameters(self) -> list[Instruction]:
        params = [i for i in self.instructions if i.opcode == "parameter"]
        return sorted(params, key=lambda i: i.parameter_number or 0)

    def by_name(self) -> dict[str, Instruction]:
        return {inst.name: inst for inst in self.instructions}

    def post_order(self) -> list[Instruction]:
        """Instructions with every operand before its users (printed order is not always so)."""
        table = self.by_name()
        seen: set[str] = set()
        order: list[Instruction] = []
        for start in self.instructions:
            if start.name in seen:
                continue
            stack = [(start, False)]
            while stack:
                inst, expanded = stack.pop()
                if expanded:
                    order.append(inst)
                    continue
                if inst.name in seen:
                    continue
                seen.add(inst.name)
                stack.append((inst, True))
                for op in reversed(inst.operands):
                    if op not in seen:
                        stack.append((table[op], False))
        return order

    def live_post_order(self) -> list[Instruction]:
        """``post_order`` restricted to what the root depends on (dead code left out)."""
        table = self.by_name()
        needed: set[str] = set()
        stack = [self.root.name]
        while stack:
            name = stack.pop()
            if name not in needed:
                needed.add(name)
                stack.extend(table[name].operands)
        return [inst for inst in self.post_order() if inst.name in needed]


@dataclass(eq=True, slots=True)
class HloModule:
    """A parsed HLO module. ``tables`` holds FileNames/FunctionNames/... sections verbatim."""

    name: str
    computations: list[Computation]
    attrs: dict[str, str] = field(default_factory=dict)
    tables: list[tuple[str, list[str]]] = field(default_factory=list)

    @property
    def entry(self) -> Computation:
        for comp in self.computations:
            if comp.is_entry:
                return comp
        return self.computations[-1]

    def computation(self, name: str) -> Computation:
        name = name.lstrip("%")
        for comp in self.computations:
            if comp.name == name:
                return comp
        raise KeyError(f"module {self.name!r} has no computation {name!r}")

    @property
    def unknown_opcodes(self) -> list[tuple[str, str]]:
        """(instruction name, opcode) for every opcode the parser did not recognise."""
        return [(i.name, i.opcode) for c in self.computations for i in c.instructions
                if not i.known_opcode]

    def instructions(self) -> Iterator[tuple[Computation, Instruction]]:
        for comp in self.computations:
            for inst in comp.instructions:
                yield comp, inst
