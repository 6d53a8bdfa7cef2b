"""The HBM bytes a kernel made of a set of ops moves (``kernel_hbm_bytes``), counting only what
its outputs depend on, and the per-graph facts the cost formulas read for every pattern
(``graph_facts``, computed once per graph)."""
from __future__ import annotations

import weakref
from typing import Iterable

from stitch.hlo.graph import OpGraph, OpNode
from stitch.hlo.op_classes import OpClass

from .instruction_costs import EXPENSIVE_INSTRUCTIONS, INSTRUCTIONS_PER_ELEMENT


def inside_users(graph: OpGraph, members: Iterable[int]) -> dict[int, list[int]]:
    """For every value a member reads (members and outside values alike): the distinct
    members reading it, in increasing order (as ``OpNode.users`` lists them). Work
    proportional to the members' operands, whatever the fan-out of what they read."""
    nodes = graph.nodes
    found: dict[int, list[int]] = {}
    for w in sorted(members):
        operands = nodes[w].operands
        for o in (operands if len(operands) < 2 else dict.fromkeys(operands)):
            got = found.get(o)
            if got is None:
                found[o] = [w]
            else:
                got.append(w)
    return found


def in_place_updates(graph: OpGraph, members: Iterable[int]) -> set[int]:
    """Dynamic-update-slices of ``members`` that run in place: the updated buffer is a value
    from outside the kernel (seen through free aliases) that nothing else in the kernel
    reads, the kernel writes the result out and nothing inside reads it, and the two
    buffers have the same size. XLA then assigns both the same buffer and its emitter
    writes only the update (IrEmitterUnnested's in-place dynamic-update-slice fusion);
    the rest of the buffer is neither read nor written."""
    members = members if isinstance(members, (set, frozenset)) else set(members)
    facts = graph_facts(graph)
    outputs = facts.outputs
    found: set[int] = set()
    for d in members & facts.updates:
        node = graph.nodes[d]
        if any(u in members for u in node.users):
            continue
        if not (d in outputs or not members.issuperset(node.users)):
            continue
        base = node.operands[0]
        chain = []
        while base in members and graph.nodes[base].opcode in ("bitcast", "reshape") and \
                graph.is_free(base):
            chain.append(base)
            base = graph.nodes[base].operands[0]
        src = graph.nodes[base]
        read_in_full = src.op_class is OpClass.SOURCE or (
            src.opcode == "get-tuple-element" and graph.is_free(base)
            and all(o not in members for o in src.operands))
        if base in members and not read_in_full:
            continue                    # the buffer is computed here: nothing to alias
        if graph.nodes[base].shape.byte_size != node.shape.byte_size:
            continue
        readers = {u for v in [base, *chain] for u in graph.nodes[v].users if u in members}
        if readers - set(chain) - {d}:
            continue
        found.add(d)
    return found


class GraphFacts:
    """Per-node facts the cost formulas read for every pattern, computed once per graph
    (the explorer scores thousands of patterns of one graph)."""

    def __init__(self, graph: OpGraph):
        self.elements = [element_count(n) for n in graph.nodes]
        self.outputs = frozenset(graph.outputs)
        self.byte_size = [n.shape.byte_size for n in graph.nodes]
        # The buffer each value lives in: a bitcast (or bitcast reshape) is its operand's
        # buffer, so a kernel reading a value and a bitcast of it reads the bytes once.
        self.buffer = list(range(len(graph.nodes)))
        for n in graph.nodes:
            if n.operands and (n.opcode == "bitcast" or (n.opcode == "reshape"
                                                         and graph.is_free(n.id))) \
                    and self.byte_size[n.operands[0]] == self.byte_size[n.id]:
                self.buffer[n.id] = self.buffer[n.operands[0]]
        # Per-op terms of ``CostModel._instructions``: elements computed per pass (a
        # reduction reads its input's) and instructions per element.
        self.is_reduction = [n.op_class is OpClass.REDUCTION for n in graph.nodes]
        self.is_expensive = [n.op_class is OpClass.EXPENSIVE for n in graph.nodes]
        self.n_users = [len(n.users) for n in graph.nodes]
        self.is_source = [n.op_class is OpClass.SOURCE for n in graph.nodes]
        # A get-tuple-element reading an element of a tuple-shaped value.
        self.tuple_gte = [n.opcode == "get-tuple-element" and bool(n.operands)
                          and graph.nodes[n.operands[0]].shape.is_tuple for n in graph.nodes]
        self.count = [self.elements[n.operands[0]]
                      if n.op_class is OpClass.REDUCTION and n.operands else self.elements[n.id]
                      for n in graph.nodes]
        self.per_element = [EXPENSIVE_INSTRUCTIONS.get(n.opcode, 10.0)
                            if n.op_class is OpClass.EXPENSIVE
                            else INSTRUCTIONS_PER_ELEMENT.get(n.op_class, 2.0)
                            for n in graph.nodes]
        # The dynamic-update-slices that may run in place (``in_place_updates``).
        self.updates = frozenset(n.id for n in graph.nodes
                                 if n.opcode == "dynamic-update-slice" and len(n.operands) >= 2)
        # Consumers whose share of an operand is not the plain elementwise one.
        self.plain = [n.op_class not in (OpClass.COMPUTE, OpClass.OPAQUE)
                      and n.opcode not in ("reduce", "reduce-window", "gather", "scatter",
                                           "dynamic-update-slice")
                      for n in graph.nodes]


_FACTS: "weakref.WeakKeyDictionary[OpGraph, GraphFacts]" = weakref.WeakKeyDictionary()


def graph_facts(graph: OpGraph) -> GraphFacts:
    facts = _FACTS.get(graph)
    if facts is None:
        facts = _FACTS[graph] = GraphFacts(graph)
    return facts


def utilization(graph: OpGraph, members: Iterable[int], whole: Iterable[int] = (),
                inside: dict[int, list[int]] | None = None,
                in_place: set[int] | None = None
                ) -> tuple[dict[int, float], dict[int, float]]:
    """(fraction of each member's elements the kernel computes, fraction of each outside
    value's elements it reads): see ``kernel_hbm_bytes``. ``inside`` and ``in_place``:
    ``inside_users`` and ``in_place_updates`` of ``members`` when the caller has them."""
    members = members if isinstance(members, (set, frozenset)) else set(members)
    facts = graph_facts(graph)
    outputs = facts.outputs
    elems = facts.elements
    plain = facts.plain
    nodes = graph.nodes
    forced = set(whole)
    if inside is None:
        inside = inside_users(graph, members)
    if in_place is None:
        in_place = in_place_updates(graph, members)
    used: dict[int, float] = {}
    no_users: list[int] = []

    def share(w: int, v: int) -> float:
        """Fraction of v's elements consumer w reads."""
        uw = used.get(w, 0.0)
        if uw <= 0.0:
            return 0.0
        if plain[w]:
            # Elementwise / layout consumers read one operand element per output element.
            return min(1.0, uw * elems[w] / max(elems[v], 1))
        node = nodes[w]
        if node.op_class in (OpClass.COMPUTE, OpClass.OPAQUE):
            return 1.0
        best = 0.0
        data = len(node.operands) // 2 if node.opcode in ("reduce", "reduce-window") else 0
        for position, o in enumerate(node.operands):
            if o != v:
                continue
            if w in in_place and position == 0:
                continue
            if node.opcode == "gather" and position == 1:
                # One index vector per gathered slice: the needed outputs' vectors.
                best = max(best, uw)
                continue
            if node.opcode == "scatter" and position >= len(node.operands) // 2:
                # Indices and updates: any update may land on a needed output element,
                # so every one is read (however few elements the scatter writes).
                return 1.0
            per_output = elems[v] / max(elems[w], 1) if position < data else 1.0
            best = max(best, min(1.0, uw * elems[w] * per_output / max(elems[v], 1)))
        return best

    source, n_users = facts.is_source, facts.n_users
    # ``share`` inlined for the common plain consumer (the same arithmetic).
    def demand(v: int, readers) -> float:
        """The fraction of ``v`` its member readers need (already-known readers' ``used``)."""
        total = 0.0
        ev = max(elems[v], 1)
        for u in readers:
            if u in members:
                if plain[u]:
                    uw = used.get(u, 0.0)
                    if uw > 0.0:
                        total += min(1.0, uw * elems[u] / ev)
                else:
                    total += share(u, v)
        return min(1.0, total)

    for m in sorted(members, reverse=True):
        readers = inside.get(m, no_users)
        if (not source[m] and (m in outputs or len(readers) < n_users[m])) or m in forced:
            used[m] = 1.0
        else:
            used[m] = demand(m, readers)
    read = {o: demand(o, readers) for o, readers in inside.items() if o not in members}
    return used, read


def kernel_hbm_bytes(graph: OpGraph, members: Iterable[int], whole: Iterable[int] = (),
                     used: tuple[dict[int, float], dict[int, float]] | None = None,
                     inside: dict[int, list[int]] | None = None,
                     in_place: set[int] | None = None) -> int:
    """Bytes a kernel made of ``members`` moves through HBM, counting only what it reads:
    each outside value once, scaled by the fraction of its elements the kernel's outputs
    depend on, plus each value used outside or leaving the graph, once (the rules of
    ``OpGraph.hbm_bytes`` otherwise: SOURCE members are reads, a gte of an outside tuple
    reads its element).

    The fraction (utilization) of a value is propagated back from the written values
    (1): a consumer w used at fraction u reads at most min(1, u * |w| * k / |v|) of
    operand v, where k is the operand elements one output element reads (1 for elementwise,
    layout, slice, dynamic-slice, gather, broadcast; the reduced length for a reduce), and
    the fractions of several consumers add up, capped at 1 (an upper bound: XLA's operand
    utilization in GpuHloCostAnalysis follows the same idea). So a gather reads the gathered
    rows and the index vectors of the needed outputs, a slice the slice, a reduce whose
    result is sliced the inputs of the kept outputs. An in-place dynamic-update-slice
    (``in_place_updates``) reads none of the buffer and writes only the update. ``whole``
    are ops computed in full whatever their consumers need (reductions a warp or block
    reduces row by row). ``used`` is ``utilization``'s result when the caller has it;
    ``inside`` and ``in_place`` are ``inside_users`` and ``in_place_updates`` of a kernel
    holding ``members`` (a packed kernel's parts share its maps: no edge joins two parts)."""
    members = members if isinstance(members, (set, frozenset)) else set(members)
    facts = graph_facts(graph)
    outputs = facts.outputs
    size = facts.byte_size
    buffer = facts.buffer
    nodes = graph.nodes
    if inside is None:
        inside = inside_users(graph, members)
    if in_place is None:
        in_place = in_place_updates(graph, members)
    if used is None:
        used = utilization(graph, members, whole, inside, in_place)
    used, read = used
    written = 0
    reads: dict[tuple[int, int], float] = {}
    no_users: list[int] = []
    source, n_users, tuple_gte = facts.is_source, facts.n_users, facts.tuple_gte
    # ``inside`` lists only readers inside ``members``: a member's readers inside the
    # kernel are in its own connected part.
    for m in members:
        readers = inside.get(m, no_users)
        if source[m]:
            if readers:
                reads[(m, -1)] = size[m] * used[m]
            continue
        node = nodes[m]
        if m in outputs or len(readers) < n_users[m]:
            update = node.operands[1] if m in in_place else m
            written += size[update]
        for o in node.operands:
            if o in members and not source[o]:
                continue
            if tuple_gte[m]:
                reads[(o, node.instruction.int("index"))] = size[m] * used[m]
            elif o in members:
                reads[(o, -1)] = size[o] * used[o]
            else:
                # Outside values are read once per buffer (a value and its bitcasts).
                root = buffer[o] if buffer[o] not in members else o
                got = size[o] * read[o]
                if got > reads.get((root, -1), 0.0):
                    reads[(root, -1)] = got
    return int(round(sum(reads.values()))) + written


def element_count(node: OpNode) -> int:
    """Elements of a value (of its largest leaf, for a tuple)."""
    shape = node.shape
    if shape.is_tuple:
        leaves = list(shape.leaves())
        return max((s.num_elements for s in leaves), default=1)
    return max(shape.num_elements, 1) if shape.is_array else 1
