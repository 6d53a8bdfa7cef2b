"""HLO text -> HloModule.

Reads what XLA, JAX and TensorFlow print today: old (``%name``, computation signatures) and
new (bare names, no signatures) styles, the FileNames/FunctionNames/FileLocations/StackFrames
tables, typed operands, ``/*index=N*/`` comments, tuple/tiled/dynamic shapes, JSON
``backend_config`` and elided ``{...}`` constants. Every error is an ``HloParseError`` naming
line, column and what was expected. Unknown opcodes become generic instructions flagged with
``known_opcode=False``.
"""
from __future__ import annotations

import bisect
import re
from typing import Callable

from .errors import HloParseError
from .ir import (ELEMENT_TYPES, Computation, HloModule, Instruction, Layout, Shape, Signature,
                 parse_computation_list, parse_dim_labels, parse_int_list, parse_padding,
                 parse_slice, parse_window)
from .literals import check_literal
from .opcodes import KNOWN_OPCODES, expected_operand_count
from .shape_inference import infer_shape

_SKIP = re.compile(r"(?:\s+|/\*.*?\*/|//[^\n]*)+", re.S)
_NAME = re.compile(r"%?([A-Za-z_][\w.\-]*)")
_ATTR_KEY = re.compile(r"([A-Za-z_][\w.\-]*)\s*=")
_OPCODE = re.compile(r"([a-z][a-z0-9\-]*)\s*\(")
_ELEMENT_TYPE = re.compile(r"([a-z][a-z0-9]*)\[")
# A dense array shape with plain dims and an untiled layout, nothing after it that would
# belong to it (a tiled layout's '{'): parsed once per distinct text (``Parser.shape``).
_PLAIN_SHAPE = re.compile(r"[a-z][a-z0-9]*\[[\d,]*\](?:\{[\d,]*\})?(?![{:\w])")
_DIM = re.compile(r"\s*(<=)?\s*(\d+|\?)\s*")
_INT = re.compile(r"-?\d+")
# Unrolled (no per-character alternation: a 10 MB string must not cost a backtracking frame
# per character); strings may span lines, as XLA's do.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_VALUE_STOP = re.compile(r'["{}\[\]()\n, \t/]')
_NESTED_STOP = re.compile(r'["{}\[\]()/]')
_TABLE_HEAD = re.compile(r"(FileNames|FunctionNames|FileLocations|StackFrames)[ \t]*\r?\n")
_TABLE_ENTRY = re.compile(r"[ \t]*(\d+[ \t]+(?:\"(?:[^\"\\\n]|\\.)*\"|\{[^\n]*\}))[ \t\r]*(?:\n|$)")
_ENTRY = re.compile(r"ENTRY(?=[\s%])")
_HEADER_COMMA = re.compile(r"[ \t]*,")
_CLOSERS = {"{": "}", "[": "]", "(": ")"}
_COMPUTATION_HEAD = re.compile(r"(?:ENTRY\s+)?%?[A-Za-z_][\w.\-]*\s*[({]")
_INLINE_BODY = re.compile(r"\{\s*(?:ROOT\s+)?%?[A-Za-z_][\w.\-]*\s*=")
_NESTED_INT_LIST = re.compile(r"\{\s*(?:\{[\s\d,\-]*\}\s*(?:,\s*\{[\s\d,\-]*\}\s*)*)?\}")

# Bounds that keep every recursive walk (here, in the IR, the evaluator and the planner)
# far from Python's recursion limit: deeper text is an HloParseError, never a RecursionError.
MAX_NESTING = 200      # tuple shapes, nested instructions, inline computations
MAX_CALL_DEPTH = 64    # computations calling computations (call, fusion, while, ...)


def _enum(*allowed: str) -> Callable[[str], object]:
    def check(text: str) -> str:
        if text not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}, got {text!r}")
        return text
    return check


def _integer(text: str) -> int:
    if not _INT.fullmatch(text):
        raise ValueError(f"expected an integer, got {text!r}")
    return int(text)


def _boolean(text: str) -> bool:
    if text not in ("true", "false"):
        raise ValueError(f"expected true or false, got {text!r}")
    return text == "true"


def _quoted(text: str) -> str:
    if not _STRING.fullmatch(text):
        raise ValueError(f"expected a quoted string, got {text!r}")
    return text


def _float(text: str) -> float:
    return float(text)


def _int_lists(text: str) -> str:
    """``{{128,32},{128,32}}`` (collective-permute's per-pair slice sizes) or ``{1,2}``."""
    if not (_NESTED_INT_LIST.fullmatch(text.strip()) or parse_int_list(text) is not None):
        raise ValueError(f"expected a list of integer lists like {{{{1,2}}}}, got {text!r}")
    return text


_INT_LIST_ATTRS = (
    "dimensions", "lhs_contracting_dims", "rhs_contracting_dims", "lhs_batch_dims",
    "rhs_batch_dims", "offset_dims", "collapsed_slice_dims", "start_index_map",
    "operand_batching_dims", "start_indices_batching_dims", "slice_sizes",
    "dynamic_slice_sizes", "update_window_dims", "inserted_window_dims",
    "scatter_dims_to_operand_dims", "input_batching_dims", "scatter_indices_batching_dims",
)
_INT_ATTRS = ("index", "iota_dimension", "index_vector_dim", "feature_group_count",
              "batch_group_count", "exponent_bits", "mantissa_bits", "feature_index")
_CALL_ATTRS = ("to_apply", "calls", "condition", "body", "true_computation",
               "false_computation", "branch_computations", "called_computations")

# Attribute readers used to validate values at parse time (same readers the IR uses).
_ATTR_CHECKS: dict[str, Callable[[str], object]] = {
    **{k: parse_int_list for k in _INT_LIST_ATTRS},
    **{k: _integer for k in _INT_ATTRS},
    **{k: parse_computation_list for k in _CALL_ATTRS},
    "direction": _enum("EQ", "NE", "LT", "LE", "GT", "GE"),
    "slice": parse_slice,
    "window": parse_window,
    "dim_labels": parse_dim_labels,
    "is_stable": _boolean,
    "indices_are_sorted": _boolean,
    "unique_indices": _boolean,
    "custom_call_target": _quoted,
    "epsilon": _float,
}
# Checks that only apply to one opcode (the same key means other things elsewhere).
_OPCODE_ATTR_CHECKS: dict[tuple[str, str], Callable[[str], object]] = {
    ("fusion", "kind"): _enum("kLoop", "kInput", "kOutput", "kCustom"),
    ("compare", "type"): _enum("FLOAT", "TOTALORDER", "SIGNED", "UNSIGNED", "PARTIALORDER"),
    ("pad", "padding"): parse_padding,
    **{(op, "slice_sizes"): _int_lists for op in ("collective-permute",
                                                  "collective-permute-start")},
}


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.pos = 0
        self.n = len(text)
        self._line_starts: list[int] | None = None
        self.called: list[tuple[str, int]] = []
        self.calls: dict[tuple[str, str], int] = {}     # (caller, callee) -> position
        self.depth = 0                                   # current nesting, see MAX_NESTING
        self.current = ""                                # the computation being read
        self.inline: list[Computation] = []              # inline computations read so far
        self.unshaped: dict[int, int] = {}               # id(inst) -> opcode position
        self.topo: dict[str, list[str]] = {}             # computation -> operand-first order
        self.fresh = 0
        self._shapes: dict[str, Shape] = {}              # plain shape text -> its Shape

    def enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise self.error(f"nesting deeper than {MAX_NESTING} levels")

    def fresh_name(self, base: str) -> str:
        self.fresh += 1
        return f"{base}.nested{self.fresh}"

    # --- error reporting ---------------------------------------------------------------
    def error(self, message: str, pos: int | None = None) -> HloParseError:
        pos = self.pos if pos is None else pos
        if self._line_starts is None:
            self._line_starts = [0] + [m.end() for m in re.finditer("\n", self.text)]
        line = bisect.bisect_right(self._line_starts, pos) - 1
        start = self._line_starts[line]
        end = self.text.find("\n", start)
        source = self.text[start:end if end >= 0 else self.n]
        return HloParseError(message, line + 1, pos - start + 1, source)

    def found(self) -> str:
        if self.pos >= self.n:
            return "end of input"
        return repr(self.text[self.pos:self.pos + 20].split("\n")[0] or "\\n")

    # --- low-level scanning ------------------------------------------------------------
    def skip(self) -> None:
        m = _SKIP.match(self.text, self.pos)
        if m:
            self.pos = m.end()

    def peek(self, s: str) -> bool:
        self.skip()
        return self.text.startswith(s, self.pos)

    def accept(self, s: str) -> bool:
        if self.peek(s):
            self.pos += len(s)
            return True
        return False

    def expect(self, s: str, what: str | None = None) -> None:
        if not self.accept(s):
            raise self.error(f"expected {what or repr(s)}, found {self.found()}")

    def name(self, what: str) -> str:
        self.skip()
        m = _NAME.match(self.text, self.pos)
        if not m:
            raise self.error(f"expected {what}, found {self.found()}")
        self.pos = m.end()
        return m.group(1)

    def balanced(self, stop_at_space: bool) -> str:
        """Raw text up to a top-level ',' / ')' / '}' / newline (and space if asked)."""
        self.skip()
        start = self.pos
        stack: list[str] = []
        text = self.text
        while True:
            # Inside brackets only brackets and strings matter: one regex step per bracket,
            # not per comma (a 10M-element literal is one step).
            m = (_NESTED_STOP if stack else _VALUE_STOP).search(text, self.pos)
            if m is None:
                if stack:
                    raise self.error(f"expected {stack[-1]!r}, found end of input")
                self.pos = self.n
                break
            self.pos = m.start()
            c = m.group()
            if c == '"':
                s = _STRING.match(text, self.pos)
                if not s:
                    raise self.error("unterminated string")
                self.pos = s.end()
            elif c == "/":
                if text.startswith("//", self.pos) and not stack:
                    break  # a comment after the value
                if text.startswith("//", self.pos) or text.startswith("/*", self.pos):
                    end = text.find("\n" if text[self.pos + 1] == "/" else "*/", self.pos + 2)
                    self.pos = self.n if end < 0 else end + (0 if text[self.pos + 1] == "/" else 2)
                else:
                    self.pos += 1
            elif c in "{[(":
                stack.append(_CLOSERS[c])
                self.pos += 1
            elif c in "}])":
                if not stack:
                    break
                want = stack.pop()
                if c != want:
                    raise self.error(f"expected {want!r}, found {c!r}")
                self.pos += 1
            elif stack:
                self.pos += 1
            elif c == "," or c == "\n" or stop_at_space:
                break
            else:
                self.pos += 1
        value = text[start:self.pos].strip()
        if not value:
            raise self.error(f"expected a value, found {self.found()}", start)
        return value

    # --- shapes ------------------------------------------------------------------------
    def shape(self) -> Shape:
        self.skip()
        # Most shapes are dense arrays printed alike many times over (f32[4,32]{1,0}):
        # each distinct text is parsed once per module. Shapes are immutable, so the
        # instructions can share them.
        plain = _PLAIN_SHAPE.match(self.text, self.pos)
        if plain is not None:
            text = plain.group()
            got = self._shapes.get(text)
            if got is None:
                got = self._shapes[text] = self._shape()
            self.pos = plain.end()
            return got
        return self._shape()

    def _shape(self) -> Shape:
        if self.text.startswith("(", self.pos):
            self.enter()
            self.pos += 1
            shapes: list[Shape] = []
            if not self.accept(")"):
                while True:
                    shapes.append(self.shape())
                    if self.accept(","):
                        continue
                    self.expect(")", "',' or ')' in a tuple shape")
                    break
            self.depth -= 1
            return Shape("tuple", tuple_shapes=tuple(shapes))
        m = _ELEMENT_TYPE.match(self.text, self.pos)
        if not m:
            raise self.error(f"expected a shape such as f32[2,3], found {self.found()}")
        element_type = m.group(1)
        if element_type not in ELEMENT_TYPES:
            raise self.error(f"unknown element type {element_type!r}")
        self.pos = m.end()
        dims: list[int] = []
        dynamic: list[bool] = []
        if not self.accept("]"):
            while True:
                d = _DIM.match(self.text, self.pos)
                if not d:
                    raise self.error(f"expected a dimension size, found {self.found()}")
                self.pos = d.end()
                dims.append(-1 if d.group(2) == "?" else int(d.group(2)))
                dynamic.append(bool(d.group(1)))
                if self.accept(","):
                    continue
                self.expect("]", "',' or ']' in the shape's dimensions")
                break
        layout = None
        if self.text.startswith("{", self.pos):  # a layout is printed right after ']'
            layout = self.layout(len(dims))
        return Shape(element_type, tuple(dims), tuple(dynamic) if any(dynamic) else (), layout)

    def layout(self, rank: int) -> Layout:
        start = self.pos
        self.pos += 1
        order: list[int] = []
        tail = ""
        if not self.accept("}"):
            while not self.peek(":") and not self.peek("}"):
                self.skip()
                m = _INT.match(self.text, self.pos)
                if not m:
                    raise self.error(f"expected a layout dimension, found {self.found()}")
                order.append(int(m.group()))
                self.pos = m.end()
                if not self.accept(","):
                    break
            if self.accept(":"):
                close = self.text.find("}", self.pos)
                if close < 0:
                    raise self.error("expected '}' closing the layout")
                tail = self.text[self.pos:close].strip()
                self.pos = close
            self.expect("}", "'}' closing the layout")
        if order and sorted(order) != list(range(rank)):
            raise self.error(f"layout {{{','.join(map(str, order))}}} is not a permutation of "
                             f"the {rank} dimensions", start)
        return Layout(tuple(order), tail)

    # --- module structure --------------------------------------------------------------
    def module(self) -> HloModule:
        self.skip()
        if self.text.startswith("HloModule", self.pos):
            self.pos += len("HloModule")
            name = self.name("a module name")
            if self.text.startswith(":", self.pos):  # ``HloModule name:``, which XLA reads
                self.pos += 1
            attrs = self.attributes(newline_ends=True)
        elif _COMPUTATION_HEAD.match(self.text, self.pos):
            name, attrs = "module", {}  # bare computations: XLA reads them too (test shorthand)
        else:
            raise self.error(f"expected 'HloModule' or a computation, found {self.found()}")
        tables: list[tuple[str, list[str]]] = []
        computations: list[Computation] = []
        self.skip()
        while self.pos < self.n:
            head = _TABLE_HEAD.match(self.text, self.pos)
            if head:
                self.pos = head.end()
                tables.append((head.group(1), self.table_entries()))
            else:
                comp = self.computation()
                computations.extend(self.inline)  # callees first, as XLA prints them
                self.inline.clear()
                computations.append(comp)
            self.skip()
        if not computations:
            raise self.error("expected at least one computation")
        entries = [c for c in computations if c.is_entry]
        if len(entries) > 1:
            raise self.error(f"more than one ENTRY computation: {[c.name for c in entries]}")
        module = HloModule(name, computations, attrs, tables)
        names = {c.name for c in computations}
        if len(names) != len(computations):
            raise self.error("two computations share a name", 0)
        for callee, pos in self.called:
            if callee not in names:
                raise self.error(f"unknown computation {callee!r}", pos)
        order = self.check_calls(computations)
        self.infer_shapes(computations, order)
        return module

    def check_calls(self, computations: list[Computation]) -> list[str]:
        """Reject call cycles and call chains deeper than MAX_CALL_DEPTH (iteratively: the
        text may be anything). Returns the computation names callees-first."""
        graph: dict[str, list[tuple[str, int]]] = {c.name: [] for c in computations}
        for (caller, callee), pos in self.calls.items():
            if caller in graph and callee in graph:
                graph[caller].append((callee, pos))
        done: set[str] = set()
        depth: dict[str, int] = {}
        order: list[str] = []
        for start in graph:
            if start in done:
                continue
            active = {start}
            stack = [(start, iter(graph[start]))]
            while stack:
                node, callees = stack[-1]
                for callee, pos in callees:
                    if callee in active:
                        raise self.error(f"call cycle: computation {node!r} calls {callee!r}, "
                                         f"which is already on the call chain", pos)
                    if callee not in done:
                        active.add(callee)
                        stack.append((callee, iter(graph[callee])))
                        break
                else:
                    stack.pop()
                    active.discard(node)
                    done.add(node)
                    order.append(node)
                    depth[node] = 1 + max((depth[c] for c, _ in graph[node]), default=0)
                    if depth[node] > MAX_CALL_DEPTH:
                        raise self.error(f"computation {node!r} starts a call chain "
                                         f"{depth[node]} computations deep (the limit is "
                                         f"{MAX_CALL_DEPTH})", graph[node][0][1])
        return order

    def infer_shapes(self, computations: list[Computation], order: list[str]) -> None:
        """Give every instruction written without a result shape the one XLA infers."""
        if not self.unshaped:
            return
        by_name = {c.name: c for c in computations}

        def callee_root(name: str) -> Shape:
            root = by_name[name.lstrip("%")].root.shape
            if root is None:
                raise KeyError(f"the root of {name!r} has no shape")
            return root
        for comp_name in order:
            comp = by_name[comp_name]
            table = comp.by_name()
            for name in self.topo.get(comp_name, ()):
                inst = table[name]
                if inst.shape is not None:
                    continue
                pos = self.unshaped[id(inst)]
                try:
                    inst.shape = infer_shape(inst, [table[o].shape for o in inst.operands],
                                             callee_root)
                except ValueError as exc:
                    raise self.error(str(exc), pos) from None

    def table_entries(self) -> list[str]:
        entries = []
        while True:
            m = _TABLE_ENTRY.match(self.text, self.pos)
            if not m:
                break
            entries.append(m.group(1))
            self.pos = m.end()
        return entries

    def attributes(self, newline_ends: bool = False, nested: bool = False) -> dict[str, str]:
        """``, key=value`` pairs (raw values), validated against the known readers.

        ``nested``: the attributes of an instruction written as an operand, where a ','
        followed by anything but ``key=`` is the next operand of the outer instruction."""
        attrs: dict[str, str] = {}
        while True:
            before = self.pos
            if newline_ends:  # module/computation attributes end with their line
                m = _HEADER_COMMA.match(self.text, self.pos)
                if not m:
                    break
                self.pos = m.end()
            elif not self.accept(","):
                break
            self.skip()
            key = _ATTR_KEY.match(self.text, self.pos)
            if nested and not key:
                self.pos = before
                break
            if not key:
                raise self.error(f"expected an attribute 'name=value', found {self.found()}")
            self.pos = key.end()
            if key.group(1) in attrs:
                raise self.error(f"attribute {key.group(1)!r} given twice", key.start())
            self.skip()
            if key.group(1) in _CALL_ATTRS and _INLINE_BODY.match(self.text, self.pos):
                # An inline computation (``to_apply={ x = ... }``): read it as one of its own.
                self.enter()
                comp = self.body(self.fresh_name(key.group(1)), False, None)
                self.depth -= 1
                self.inline.append(comp)
                attrs[key.group(1)] = comp.name
                continue
            attrs[key.group(1)] = self.balanced(stop_at_space=False)
        return attrs

    def computation(self) -> Computation:
        self.skip()
        entry = _ENTRY.match(self.text, self.pos)
        is_entry = entry is not None
        if entry:
            self.pos = entry.end()
        name = self.name("a computation name")
        signature = None
        if self.peek("("):
            signature = self.signature()
        comp = self.body(name, is_entry, signature)
        comp.attrs = self.attributes(newline_ends=True)
        return comp

    def body(self, name: str, is_entry: bool, signature: Signature | None) -> Computation:
        """``{ instructions }`` of computation ``name`` (a top-level or an inline one)."""
        self.expect("{", "'{' opening the computation body")
        outer, self.current = self.current, name
        instructions: list[Instruction] = []
        positions: dict[str, int] = {}
        operand_pos: list[tuple[Instruction, list[int]]] = []
        while not self.accept("}"):
            if self.pos >= self.n:
                raise self.error(f"expected '}}' closing computation {name!r}, found end of input")
            for inst, op_positions, start in self.instruction():
                if inst.name in positions:
                    raise self.error(f"instruction {inst.name!r} defined twice", start)
                positions[inst.name] = start
                instructions.append(inst)
                operand_pos.append((inst, op_positions))
        if not instructions:
            raise self.error(f"computation {name!r} has no instructions")
        self.check_computation(name, instructions, positions, operand_pos)
        self.current = outer
        return Computation(name, instructions, is_entry, signature, {})

    def signature(self) -> Signature:
        self.expect("(")
        params: list[tuple[str, Shape]] = []
        if not self.accept(")"):
            while True:
                pname = self.name("a parameter name")
                self.expect(":", "':' after the parameter name")
                params.append((pname, self.shape()))
                if self.accept(","):
                    continue
                self.expect(")", "',' or ')' in the computation's parameters")
                break
        self.expect("->", "'->' and the result shape")
        return Signature(tuple(params), self.shape())

    def check_computation(self, name: str, instructions: list[Instruction],
                          positions: dict[str, int],
                          operand_pos: list[tuple[Instruction, list[int]]]) -> None:
        roots = [i for i in instructions if i.is_root]
        if len(roots) > 1:
            raise self.error(f"computation {name!r} has more than one ROOT", positions[roots[1].name])
        if not roots:
            instructions[-1].is_root = True  # XLA's rule: the last instruction is the root
        numbers: dict[int, str] = {}
        for inst, op_positions in operand_pos:
            for op, pos in zip(inst.operands, op_positions):
                if op not in positions:
                    raise self.error(f"operand {op!r} of {inst.name!r} is not defined in "
                                     f"computation {name!r}", pos)
            if inst.parameter_number is not None:
                if inst.parameter_number in numbers:
                    raise self.error(f"parameter number {inst.parameter_number} used twice",
                                     positions[inst.name])
                numbers[inst.parameter_number] = inst.name
        if sorted(numbers) != list(range(len(numbers))):
            raise self.error(f"parameters of {name!r} are not numbered 0..{len(numbers) - 1}",
                             positions[instructions[0].name])
        self.check_acyclic(name, instructions, positions)

    def check_acyclic(self, name: str, instructions: list[Instruction],
                      positions: dict[str, int]) -> None:
        indegree = {i.name: len(i.operands) for i in instructions}
        users: dict[str, list[str]] = {}
        for inst in instructions:
            for op in inst.operands:
                users.setdefault(op, []).append(inst.name)
        ready = [n for n, d in indegree.items() if d == 0]
        done = 0
        order: list[str] = []
        while ready:
            node = ready.pop()
            order.append(node)
            done += 1
            for user in users.get(node, ()):
                indegree[user] -= 1
                if indegree[user] == 0:
                    ready.append(user)
        if done != len(instructions):
            stuck = next(n for n, d in indegree.items() if d > 0)
            raise self.error(f"computation {name!r} has a cycle through {stuck!r}", positions[stuck])
        self.topo[name] = order

    # --- instructions ------------------------------------------------------------------
    def instruction(self) -> list[tuple[Instruction, list[int], int]]:
        """One instruction line: (instruction, operand positions, start) for it and, before
        it, for each instruction written inline as one of its operands."""
        self.skip()
        start = self.pos
        is_root = False
        if self.text.startswith("ROOT", self.pos) and self.text[self.pos + 4:self.pos + 5] in (" ", "\t", "%"):
            is_root = True
            self.pos += 4
        name = self.name("an instruction name")
        self.expect("=", f"'=' after instruction name {name!r}")
        self.skip()
        shape = None if _OPCODE.match(self.text, self.pos) else self.shape()
        done: list[tuple[Instruction, list[int], int]] = []
        inst, positions = self.instruction_rhs(name, shape, is_root, done, nested=False)
        done.append((inst, positions, start))
        return done

    def instruction_rhs(self, name: str, shape: Shape | None, is_root: bool,
                        done: list[tuple[Instruction, list[int], int]],
                        nested: bool) -> tuple[Instruction, list[int]]:
        """``opcode(operands), attributes`` of instruction ``name``; ``shape`` None: XLA
        infers it (after the module is read). Operands written as instructions go to
        ``done``, innermost first."""
        self.skip()
        m = _OPCODE.match(self.text, self.pos)
        if not m:
            raise self.error(f"expected an opcode followed by '(', found {self.found()}")
        opcode = m.group(1)
        opcode_pos = self.pos
        self.pos = m.end()
        inst = Instruction(name, shape, opcode, is_root=is_root, known_opcode=opcode in KNOWN_OPCODES)
        if shape is None:
            self.unshaped[id(inst)] = opcode_pos
        positions: list[int] = []
        if opcode == "parameter":
            self.skip()
            num = _INT.match(self.text, self.pos)
            if not num or num.group().startswith("-"):
                raise self.error(f"expected a parameter number, found {self.found()}")
            inst.parameter_number = int(num.group())
            self.pos = num.end()
            self.expect(")", "')' after the parameter number")
            if shape is None:
                raise self.error(f"parameter {name!r} needs its shape", opcode_pos)
        elif opcode == "constant":
            lit_pos = self.pos
            inst.literal = self.balanced(stop_at_space=False)
            self.expect(")", "')' closing the constant literal")
            if shape is None:
                raise self.error(f"constant {name!r} needs its shape", opcode_pos)
            try:
                check_literal(inst.literal, shape)
            except ValueError as exc:
                raise self.error(f"bad constant literal: {exc}", lit_pos) from None
        else:
            if not self.accept(")"):
                while True:
                    self.skip()
                    typed = None
                    if _ELEMENT_TYPE.match(self.text, self.pos) or self.text.startswith("(", self.pos):
                        typed = self.shape()  # a typed operand: redundant with its definition
                    self.skip()
                    positions.append(self.pos)
                    sub = _OPCODE.match(self.text, self.pos)
                    if sub:  # an instruction written in place of an operand
                        self.enter()
                        sub_name = self.fresh_name(sub.group(1))
                        sub_inst, sub_positions = self.instruction_rhs(sub_name, typed, False,
                                                                       done, nested=True)
                        self.depth -= 1
                        done.append((sub_inst, sub_positions, positions[-1]))
                        inst.operands.append(sub_name)
                    else:
                        inst.operands.append(self.name("an operand name"))
                    if self.accept(","):
                        continue
                    self.expect(")", "',' or ')' in the operand list")
                    break
        inst.attrs = self.attributes(nested=nested)
        self.check_instruction(inst, opcode_pos)
        return inst, positions

    def check_instruction(self, inst: Instruction, opcode_pos: int) -> None:
        want = expected_operand_count(inst.opcode)
        if want is not None and len(inst.operands) != want:
            raise self.error(f"{inst.opcode} {inst.name!r} takes {want} operand(s), "
                             f"got {len(inst.operands)}", opcode_pos)
        if inst.opcode == "fusion" and "calls" not in inst.attrs:
            raise self.error(f"fusion {inst.name!r} needs a 'calls' attribute", opcode_pos)
        for key, value in inst.attrs.items():
            check = _OPCODE_ATTR_CHECKS.get((inst.opcode, key)) or _ATTR_CHECKS.get(key)
            if check is None:
                continue
            try:
                check(value)
            except ValueError as exc:
                raise self.error(f"bad value for attribute {key!r} of {inst.name!r}: {exc}",
                                 self.value_position(value, opcode_pos)) from None
            if key in _CALL_ATTRS:
                pos = self.value_position(value, opcode_pos)
                self.called.extend((c, pos) for c in parse_computation_list(value))
        try:
            callees = inst.called_computations
        except ValueError:
            callees = ()
        for callee in callees:
            self.calls.setdefault((self.current, callee), opcode_pos)

    def value_position(self, value: str, fallback: int) -> int:
        found = self.text.rfind(value, fallback, self.pos)
        return found if found >= 0 else fallback


def parse_hlo(text: str) -> HloModule:
    """Parse HLO text (any of the dialects XLA/JAX/TF print) into an ``HloModule``."""
    if not isinstance(text, str):
        raise TypeError(f"parse_hlo expects HLO text (str), got {type(text).__name__}")
    return _Parser(text).module()
