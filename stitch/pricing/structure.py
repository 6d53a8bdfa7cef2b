"""Structure keys: one key for op sets that are the same up to renaming.

Transformer layers (forward and backward) repeat the same op sets layer after layer, and
XLA's post-scheduler modules repeat cheap producers once more in every consumer fusion, so
the explorer, merging, packing and refinement score the same shapes of kernels many times
over. ``StructureKeys.key(members)`` names what the delta-evaluator and the feasibility
analysis read about a member set, without node ids or names:

- per member, in increasing id order: opcode, shape, class, attributes (called
  computations by content, not by name), its operands (members by position, outside nodes
  by first appearance; users inside the set follow from them), how many users it has,
  whether its value lives in its operand's buffer (a bitcast), and how often it is a graph
  output;
- per outside node it touches: opcode, class, shape, tuple index, whether it is free, and
  its buffer, and for a constant its literal.

Equal keys map the i-th smallest member to the i-th smallest member, so results that break
ties by member ids agree too. Only sets of plannable ops get a key (GEMMs and custom calls
read called computations and backend configs the key does not describe): others get None
and are scored as before. Convexity depends on paths outside the set and is not in the
key; callers check it first.
"""
from __future__ import annotations

import bisect
import hashlib
import re
from collections import Counter
from typing import Hashable, Iterable

from stitch.hlo.graph import OpGraph
from stitch.hlo.ir import Computation, Instruction
from stitch.hlo.op_classes import OpClass

from ..cost.hbm_traffic import graph_facts

# Attributes no cost or feasibility rule reads and that differ between identical layers.
_IGNORED_ATTRS = frozenset({"metadata", "frontend_attributes", "statistics"})
_CALL_ATTRS = frozenset({"to_apply", "calls", "condition", "body", "true_computation",
                         "false_computation", "branch_computations", "called_computations",
                         "comparator", "select", "scatter"})
_PLANNABLE = (OpClass.LIGHT, OpClass.EXPENSIVE, OpClass.REDUCTION, OpClass.LAYOUT)
_CONTROL = frozenset({"while", "conditional"})
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_SALT = "structure-part"            # part ids hashed apart: the fingerprint sums the hashes
_MASK = (1 << 64) - 1


class StructureKeys:
    """Structure keys of member sets of one graph (per-node parts computed once)."""

    def __init__(self, graph: OpGraph):
        self.graph = graph
        self._comps: dict[str, Hashable] = {}
        self._interned: dict[Hashable, int] = {}
        self.plannable = [n.op_class in _PLANNABLE and n.opcode not in _CONTROL
                          for n in graph.nodes]
        self.output_uses = Counter(graph.outputs)
        self.buffer = _buffers(graph)
        self.operands = [n.operands for n in graph.nodes]
        self._hashes: list[int | None] = [None] * len(graph.nodes)
        self._parts: list[int | None] = [None] * len(graph.nodes)
        self._outside_parts: list[int | None] = [None] * len(graph.nodes)
        # Per keyed set: its members in order and the outside nodes its key numbers, in
        # that numbering (what ``union_key`` reads of a part).
        self.layouts: dict[frozenset[int], tuple[tuple[int, ...], tuple[int, ...]]] = {}
        # What decides a union's key (``union_key``) -> the key.
        self._unions: dict[Hashable, Hashable] = {}

    # --- per node ----------------------------------------------------------------------
    def _intern(self, value: Hashable) -> int:
        return self._interned.setdefault(value, len(self._interned))

    def _computation(self, name: str) -> Hashable:
        got = self._comps.get(name)
        if got is None:
            comp: Computation | None = self.graph.computations.get(name)
            if comp is None:
                got = ("missing", name)
            else:
                self._comps[name] = ("recursive", name)     # a cycle stays name-keyed
                position = {inst.name: i for i, inst in enumerate(comp.instructions)}
                got = tuple((self._instruction(inst),
                             tuple(position.get(o, o) for o in inst.operands), inst.is_root)
                            for inst in comp.instructions)
            self._comps[name] = got
        return got

    def _instruction(self, inst: Instruction) -> Hashable:
        attrs = []
        for key in sorted(inst.attrs):
            if key in _IGNORED_ATTRS:
                continue
            value: Hashable = inst.attrs[key]
            if key in _CALL_ATTRS:
                value = tuple(self._computation(n) for n in inst.called_computations)
            attrs.append((key, value))
        literal = inst.literal
        if literal is not None and len(literal) > 64:
            literal = hashlib.sha1(literal.encode()).hexdigest()
        return (inst.opcode, inst.shape, tuple(attrs), literal, inst.parameter_number)

    def _member(self, v: int) -> int:
        got = self._parts[v]
        if got is None:
            node = self.graph.nodes[v]
            got = self._parts[v] = self._intern(
                ("m", node.op_class, node.shape, self._instruction(node.instruction),
                 node.index, self.graph.is_free(v), self.output_uses.get(v, 0),
                 len(node.users), self.buffer[v] != v))
        return got

    def _outside(self, v: int) -> int:
        got = self._outside_parts[v]
        if got is None:
            node = self.graph.nodes[v]
            literal = self._instruction(node.instruction) if node.opcode == "constant" \
                else None
            got = self._outside_parts[v] = self._intern(
                ("o", node.opcode, node.op_class, node.shape, node.index,
                 self.graph.is_free(v), self.output_uses.get(v, 0), literal))
        return got

    # --- per member set ----------------------------------------------------------------
    def fingerprint(self, members: Iterable[int]) -> tuple[int, int] | None:
        """A cheap digest equal for sets of equal keys (size and the sum of the members'
        part hashes), None when a member is not a plannable op."""
        plannable, hashes = self.plannable, self._hashes
        if not all(map(plannable.__getitem__, members)):
            return None
        try:
            # Whole-set steps while every member's hash is known (the common case once a
            # layer was seen); a missing one (None) stops the sum.
            total = sum(map(hashes.__getitem__, members))
        except TypeError:
            total = 0
            for v in members:
                h = hashes[v]
                if h is None:
                    h = hashes[v] = hash((_SALT, self._member(v))) & _MASK
                total += h
        return len(members), total & _MASK

    def key(self, members: Iterable[int]) -> Hashable | None:
        """The set's structure key, or None when a member is not a plannable op."""
        order = sorted(members)
        if not all(map(self.plannable.__getitem__, order)):
            return None
        operands, parts, buffer = self.operands, self._parts, self.buffer
        outside = self._outside_parts
        # Members by position (>= 0), outside nodes by first appearance (~k < 0).
        index = dict(zip(order, range(len(order))))
        touched: list[int] = []
        # Inside users follow from the operands, outside users from each member's user
        # count (in its part); a bitcast member's buffer from its operand's. One flat
        # tuple of ints (each row prefixed by its operand count): the cyclic garbage
        # collector untracks it at once, where nested tuples kept it busy.
        flat = [len(order)]
        append = flat.append
        for v in order:
            ops = operands[v]
            part = parts[v]
            append(self._member(v) if part is None else part)
            append(len(ops))
            for o in ops:
                j = index.get(o)
                if j is None:
                    j = index[o] = ~len(touched)
                    touched.append(o)
                append(j)
        # Outside nodes' buffers may touch further nodes: number them as they come.
        i = 0
        while i < len(touched):
            w = touched[i]
            part = outside[w]
            append(self._outside(w) if part is None else part)
            b = buffer[w]
            if b != w:
                j = index.get(b)
                if j is None:
                    j = index[b] = ~len(touched)
                    touched.append(b)
                append(1)
                append(j)
            else:
                append(0)
            i += 1
        if isinstance(members, frozenset):
            self.layouts[members] = (tuple(order), tuple(touched))
        return tuple(flat)

    def union_key(self, union: frozenset[int], a: frozenset[int], b: frozenset[int],
                  key_a: Hashable, key_b: Hashable) -> Hashable | None:
        """``key(union)`` for the union of keyed sets ``a`` and ``b``, all of one before
        all of the other. Operands and buffers have smaller ids than their users, so
        nothing the earlier part touches is in the later one (checked), and the union's
        key follows from the parts' keys and how the later part's outside nodes meet the
        earlier part (a member, by position; an outside node of its key, by number;
        neither): found by those, computed once per new combination. Any other union:
        ``key``."""
        layout_a, layout_b = self._layout(a), self._layout(b)
        if layout_a[0][-1] > layout_b[0][0]:
            if layout_b[0][-1] > layout_a[0][0]:
                return self.key(union)                  # interleaved ids
            layout_a, layout_b, key_a, key_b = layout_b, layout_a, key_b, key_a
        order_a, touched_a = layout_a
        if touched_a and max(touched_a) >= layout_b[0][0]:
            return self.key(union)          # the earlier part reads from the later
        numbered = dict(zip(touched_a, range(-1, -len(touched_a) - 1, -1)))
        size, find = len(order_a), bisect.bisect_left
        meets = []
        for w in layout_b[1]:
            i = find(order_a, w)
            meets.append(i if i < size and order_a[i] == w else numbered.get(w))
        decided = (key_a, key_b, tuple(meets))
        got = self._unions.get(decided)
        if got is None:
            got = self._unions[decided] = self.key(union)
        return got

    def _layout(self, members: frozenset[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        got = self.layouts.get(members)
        if got is None:
            self.key(members)
            got = self.layouts[members]
        return got

    def names(self, members: Iterable[int]) -> tuple[str, ...]:
        """Member names in increasing id order (to carry a reason to another set)."""
        return tuple([self.graph.nodes[v].name for v in sorted(members)])


def rename(text: str, before: tuple[str, ...], after: tuple[str, ...]) -> str:
    """``text`` with every name of ``before`` replaced by the name at its position in
    ``after`` (a reason worded for one member set, carried to one with the same key)."""
    if before == after:
        return text
    mapping = dict(zip(before, after))

    def swap(match: re.Match) -> str:
        token = match.group(0)
        got = mapping.get(token)
        if got is None and token.endswith("."):      # a name ending a sentence
            stem = token.rstrip(".")
            got = mapping.get(stem)
            return token if got is None else got + token[len(stem):]
        return token if got is None else got
    return _NAME.sub(swap, text)


def _buffers(graph: OpGraph) -> list[int]:
    """The buffer each value lives in, as the delta-evaluator counts it (a bitcast, or a
    free reshape of the same size, is its operand's buffer)."""
    return graph_facts(graph).buffer
