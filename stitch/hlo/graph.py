"""Canonicalization: an HloModule becomes op graphs the planner works on.

One graph per launching computation: ENTRY first, then every while body / while condition
/ conditional branch reached from it (recursively, breadth first). In each graph:

- ``call`` is inlined: the callee's parameters become the call's operands, its root
  replaces the call;
- XLA fusions are flattened into their ops, each remembering ``xla_group`` (the fusion's
  name: XLA's own partition, the baseline). Nested fusions flatten into the same group.
  GEMM fusions (class COMPUTE: Triton/cuBLAS GEMMs, kLoop-wrapped dots) stay one node;
- ``tuple`` and ``get-tuple-element`` that only forward values disappear: users read the
  producing op of each element directly (multi-output fusions included). A gte of a value
  we cannot see into (a while's result) stays a node reading it;
- parameters and constants are SOURCE nodes; a tuple-shaped graph parameter (a while
  body's state) is split into one SOURCE node per leaf, so the body's gtes resolve away;
- ``while``/``conditional`` stay single OPAQUE nodes whose ``subgraphs`` hold the indices of
  their body and condition / branch graphs. Ops taking a tuple read each of its leaves:
  a while's operands are the leaves of its initial state, in order.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Union

from .errors import StitchError
from .ir import Computation, HloModule, Instruction, Shape, parse_computation_list
from .op_classes import OpClass, classify_with

log = logging.getLogger(__name__)

# Ops that launch no kernel: they name, alias or sequence buffers, or (while/conditional)
# hand over to graphs of their own. A reshape is one of them when it is a bitcast.
FREE_OPCODES = frozenset({"bitcast", "get-tuple-element", "tuple", "add-dependency", "domain",
                          "optimization-barrier", "after-all", "while", "conditional"})

# Graphs up to this many nodes keep reachability bitmasks for ``OpGraph.is_convex``
# (2 * n^2 bits: 32 MiB at 16,384 nodes); larger ones keep them between their units (XLA
# fusions, each other op alone) where there are at most this many, else search.
REACHABILITY_MAX_NODES = 16384

# A value during construction: a node id, or a tuple of values (a tuple not materialized).
Val = Union[int, tuple]


@dataclass(eq=False)
class OpNode:
    id: int
    name: str                 # unique in its graph (inner names prefixed on collision)
    opcode: str
    shape: Shape
    op_class: OpClass
    operands: list[int]       # node ids, one per operand leaf (repeats kept: add(x, x))
    users: list[int]          # distinct consumer ids, in increasing order
    xla_group: str | None     # name of the XLA fusion this op came from
    instruction: Instruction
    computation: str          # the computation the instruction lives in
    subgraphs: list[int] = field(default_factory=list)  # while: [body, cond]; conditional: branches
    index: tuple[int, ...] = ()   # leaf of a tuple-shaped parameter this SOURCE stands for

    def __repr__(self) -> str:
        group = f" [{self.xla_group}]" if self.xla_group else ""
        return f"OpNode({self.id} {self.name} = {self.opcode} {self.op_class.value}{group})"


@dataclass(eq=False)
class OpGraph:
    name: str                 # the computation it was built from
    kind: str                 # "entry" | "while-body" | "while-cond" | "branch"
    nodes: list[OpNode]       # topological order; nodes[i].id == i
    inputs: list[int]         # SOURCE nodes of the parameters (leaves, parameter order)
    outputs: list[int]        # leaves of the root, in order (repeats kept)
    trip_count: int | None = None   # known_trip_count of the while (the condition runs n+1 times)
    _names: dict[str, int] = field(default_factory=dict, repr=False)
    # (node count, descendants, ancestors): per node, a bitmask of the nodes it reaches
    # and of the nodes reaching it (``is_convex``); built on first use.
    _reach: tuple[int, list[int], list[int]] | None = field(default=None, repr=False)
    # Above REACHABILITY_MAX_NODES: the same bitmasks between units (``UnitReach``).
    _unit_reach: tuple[tuple[int, int], "UnitReach | None"] | None = field(default=None,
                                                                           repr=False)
    # The module's computations by name (shared by all graphs of a module): what a GEMM
    # fusion kept as one node computes, and reducers' to_apply (stitch.hlo.gemm_chains).
    computations: dict[str, Computation] = field(default_factory=dict, repr=False)
    # (len(outputs), the outputs as a set): ``output_set``, built on first use.
    _output_set: tuple[int, frozenset[int]] | None = field(default=None, repr=False)

    def output_set(self) -> frozenset[int]:
        """``outputs`` as a set, built once (kernels ask "is this member an output?" per
        member; a set of a deep training step's outputs per kernel grew with depth twice)."""
        got = self._output_set
        if got is None or got[0] != len(self.outputs):
            got = self._output_set = (len(self.outputs), frozenset(self.outputs))
        return got[1]

    def node(self, name: str) -> OpNode:
        if not self._names:
            self._names = {n.name: n.id for n in self.nodes}
        try:
            return self.nodes[self._names[name]]
        except KeyError:
            raise KeyError(f"graph {self.name!r} has no node {name!r}") from None

    def is_free(self, nid: int) -> bool:
        """True when the op launches no kernel and moves no bytes by itself (sources,
        bitcasts, tuple plumbing, control flow, reshapes that are bitcasts)."""
        node = self.nodes[nid]
        if node.op_class is OpClass.SOURCE or node.opcode in FREE_OPCODES:
            return True
        if node.opcode == "reshape" and node.operands:
            return _is_bitcast_reshape(self.nodes[node.operands[0]].shape, node.shape)
        return False

    def topological_order(self) -> list[int]:
        return [n.id for n in self.nodes]

    def baseline_groups(self) -> dict[str, list[int]]:
        """XLA's partition: fusion name -> its op ids; every unfused op is its own group
        (keyed by its name). SOURCE nodes belong to no group."""
        groups: dict[str, list[int]] = {}
        for n in self.nodes:
            if n.op_class is not OpClass.SOURCE:
                groups.setdefault(n.xla_group or n.name, []).append(n.id)
        return groups

    def is_convex(self, ids: Iterable[int]) -> bool:
        """True when no path leaves the set and comes back (fusing it creates no cycle).

        Search forward from the set's outside users; ids are topological indices, so a
        node past the set's last member can never lead back into it.
        """
        members = set(ids)
        if not members:
            return True
        reach = self._reachability()
        if reach is not None:
            # Not convex exactly when an outside node is both reached from a member and
            # reaches one: 2 * |members| bitmask ORs instead of a walk over the nodes
            # between the first and last member (the explorer asks thousands of times).
            desc, anc = reach
            below = above = inside = 0
            for m in members:
                below |= desc[m]
                above |= anc[m]
                inside |= 1 << m
            return not (below & above & ~inside)
        units = self.unit_reachability()
        if units is not None and units.surely_convex(members):
            return True
        return self._searched_convex(members)

    def _searched_convex(self, members: set[int]) -> bool:
        """``is_convex`` by search: no outside node is both reached from the set and
        reaching it (by outside paths). Forward from the outside users (below the last
        member) and backward from the outside operands (above the first) at once, growing
        the smaller side: either side running out without meeting the other proves it.
        (Patterns spanning a training step's forward and backward made a one-sided search
        cover most of the graph.)"""
        first, last = min(members), max(members)
        ahead = {u for m in members for u in self.nodes[m].users
                 if u not in members and u < last}
        behind = {o for m in members for o in self.nodes[m].operands
                  if o not in members and o > first}
        if ahead & behind:
            return False
        front_ahead, front_behind = list(ahead), list(behind)
        while front_ahead and front_behind:
            if len(front_ahead) <= len(front_behind):
                grown = []
                for v in front_ahead:
                    for u in self.nodes[v].users:
                        if u in members:
                            return False
                        if u < last and u not in ahead:
                            if u in behind:
                                return False
                            ahead.add(u)
                            grown.append(u)
                front_ahead = grown
            else:
                grown = []
                for v in front_behind:
                    for o in self.nodes[v].operands:
                        if o in members:
                            return False
                        if o > first and o not in behind:
                            if o in ahead:
                                return False
                            behind.add(o)
                            grown.append(o)
                front_behind = grown
        return True

    def reachability(self) -> tuple[list[int], list[int]] | None:
        """(descendants, ancestors): per node, a bitmask of the nodes it reaches and of the
        nodes reaching it; None above REACHABILITY_MAX_NODES (see ``unit_reachability``)."""
        return self._reachability()

    def _reachability(self) -> tuple[list[int], list[int]] | None:
        """Descendant and ancestor bitmasks of every node (None above
        REACHABILITY_MAX_NODES: two n-bit masks per node is n^2 / 4 bytes)."""
        n = len(self.nodes)
        if n > REACHABILITY_MAX_NODES:
            return None
        if self._reach is None or self._reach[0] != n:
            desc = [0] * n
            for node in reversed(self.nodes):
                d = 0
                for u in node.users:
                    d |= desc[u] | (1 << u)
                desc[node.id] = d
            anc = [0] * n
            for node in self.nodes:
                a = 0
                for o in node.operands:
                    a |= anc[o] | (1 << o)
                anc[node.id] = a
            self._reach = (n, desc, anc)
        return self._reach[1], self._reach[2]

    def unit_reachability(self) -> "UnitReach | None":
        """The unit-level bitmasks of a graph above REACHABILITY_MAX_NODES (None: at most
        that many nodes, too many units, or a cycle between them)."""
        key = (len(self.nodes), REACHABILITY_MAX_NODES)
        if self._unit_reach is None or self._unit_reach[0] != key:
            built = UnitReach.build(self) if key[0] > key[1] else None
            self._unit_reach = (key, built)
        return self._unit_reach[1]

    def hbm_bytes(self, ids: Iterable[int]) -> int:
        """Bytes a kernel made of ``ids`` moves through HBM: each outside value it reads,
        once, plus each value it produces that is used outside or leaves the graph, once.
        SOURCE members are memory, not compute: they count as reads, never as writes. A gte
        reading an outside tuple reads only its element."""
        members = set(ids)
        outputs = self.output_set()
        reads: dict[tuple[int, int], int] = {}
        written = 0
        for m in members:
            node = self.nodes[m]
            if node.op_class is OpClass.SOURCE:
                if any(u in members for u in node.users):
                    reads[(m, -1)] = node.shape.byte_size
                continue
            for o in node.operands:
                src = self.nodes[o]
                if o in members and src.op_class is not OpClass.SOURCE:
                    continue
                if node.opcode == "get-tuple-element" and src.shape.is_tuple:
                    reads[(o, node.instruction.int("index"))] = node.shape.byte_size
                else:
                    reads[(o, -1)] = src.shape.byte_size
            if m in outputs or any(u not in members for u in node.users):
                written += node.shape.byte_size
        return sum(reads.values()) + written


@dataclass
class UnitReach:
    """Reachability between a large graph's units: an XLA fusion's ops are one unit, every
    other op (sources too) one of its own. A path between ops maps to a path between their
    units, so a union of whole units no outside unit both leaves and re-enters is convex;
    the converse need not hold (a path may enter a multi-output fusion by one part and leave
    by another), so the units only ever prove convexity and ``is_convex`` searches
    otherwise. XLA's fusions being convex, the units form a DAG."""

    unit_of: list[int]        # node id -> unit (topological position among the units)
    sizes: list[int]          # unit -> its op count
    desc: list[int]           # unit -> bitmask of the units it reaches
    anc: list[int]            # unit -> bitmask of the units reaching it

    @staticmethod
    def build(graph: OpGraph) -> "UnitReach | None":
        first: dict[object, int] = {}
        unit_of: list[int] = []
        for node in graph.nodes:
            if node.xla_group is not None and node.op_class is not OpClass.SOURCE:
                unit_of.append(first.setdefault(node.xla_group, len(first)))
            else:
                unit_of.append(len(first))
                first[(node.id,)] = len(first)
        count = len(first)
        if count > REACHABILITY_MAX_NODES:
            return None
        succ: list[set[int]] = [set() for _ in range(count)]
        for node in graph.nodes:
            a = unit_of[node.id]
            succ[a].update(unit_of[u] for u in node.users if unit_of[u] != a)
        order = _topological_units(succ)
        if order is None:
            log.warning("graph %s: its XLA fusions are not convex: convexity is searched",
                        graph.name)
            return None
        position = [0] * count
        for i, u in enumerate(order):
            position[u] = i
        unit_of = [position[u] for u in unit_of]
        sizes = [0] * count
        for u in unit_of:
            sizes[u] += 1
        succ = [{position[v] for v in succ[u]} for u in order]
        desc = [0] * count
        for u in range(count - 1, -1, -1):
            d = 0
            for v in succ[u]:
                d |= desc[v] | (1 << v)
            desc[u] = d
        anc = [0] * count
        for u in range(count):
            for v in succ[u]:
                anc[v] |= anc[u] | (1 << u)
        return UnitReach(unit_of, sizes, desc, anc)

    def surely_convex(self, members: set[int]) -> bool:
        """True when ``members`` are whole units and no outside unit lies on a path
        between two of them (then the op set is convex); False: undecided."""
        units = {self.unit_of[m] for m in members}
        if sum(self.sizes[u] for u in units) != len(members):
            return False
        below = above = inside = 0
        for u in units:
            below |= self.desc[u]
            above |= self.anc[u]
            inside |= 1 << u
        return not (below & above & ~inside)


def _topological_units(succ: list[set[int]]) -> list[int] | None:
    """Kahn's order of the unit graph (None: it has a cycle)."""
    indegree = [0] * len(succ)
    for targets in succ:
        for v in targets:
            indegree[v] += 1
    ready = deque(u for u, d in enumerate(indegree) if d == 0)
    order: list[int] = []
    while ready:
        u = ready.popleft()
        order.append(u)
        for v in sorted(succ[u]):
            indegree[v] -= 1
            if indegree[v] == 0:
                ready.append(v)
    return order if len(order) == len(succ) else None


def _is_bitcast_reshape(src: Shape, dst: Shape) -> bool:
    """A reshape between row-major layouts only relabels the bytes (XLA makes it a
    bitcast); with other layouts we assume data moves."""
    def row_major(shape: Shape) -> bool:
        return shape.minor_to_major() == tuple(range(shape.rank - 1, -1, -1))
    return (src.is_array and dst.is_array and row_major(src) and row_major(dst)
            and src.element_type == dst.element_type)


class GraphBuildError(StitchError):
    """The module cannot be canonicalized (a malformed call/while/fusion)."""


def build_op_graphs(module: HloModule) -> list[OpGraph]:
    """The op graphs of ``module``: ENTRY first, then loop bodies/conditions and branches."""
    return _ModuleBuilder(module).run()


class _ModuleBuilder:
    def __init__(self, module: HloModule):
        self.module = module
        self.comps = {c.name: c for c in module.computations}
        self.class_cache: dict = {}
        self.orders: dict[str, list[Instruction]] = {}
        self.graphs: list[OpGraph | None] = []
        self.slots: dict[tuple[str, str], int] = {}
        self.queue: deque[tuple[int, str, str, int | None]] = deque()

    def lookup(self, name: str) -> Computation:
        try:
            return self.comps[name.lstrip("%")]
        except KeyError:
            raise GraphBuildError(
                f"module {self.module.name!r} has no computation {name!r}") from None

    def order(self, comp: Computation) -> list[Instruction]:
        if comp.name not in self.orders:
            self.orders[comp.name] = comp.post_order()
        return self.orders[comp.name]

    def slot(self, comp: str, kind: str, trip_count: int | None) -> int:
        """The index of the graph for (comp, kind), queued for building on first sight.
        A computation shared by two loops is planned once (first loop's trip count)."""
        key = (comp, kind)
        if key not in self.slots:
            self.slots[key] = len(self.graphs)
            self.graphs.append(None)
            self.queue.append((self.slots[key], comp, kind, trip_count))
        return self.slots[key]

    def run(self) -> list[OpGraph]:
        self.slot(self.module.entry.name, "entry", None)
        while self.queue:
            index, comp, kind, trips = self.queue.popleft()
            self.graphs[index] = _GraphBuilder(self, self.lookup(comp), kind, trips).build()
        graphs = [g for g in self.graphs if g is not None]
        log.debug("module %s: %d graphs, %d nodes", self.module.name, len(graphs),
                  sum(len(g.nodes) for g in graphs))
        return graphs


def _leaves(val: Val) -> list[int]:
    if isinstance(val, int):
        return [val]
    out: list[int] = []
    for v in val:
        out.extend(_leaves(v))
    return out


def _trip_count(inst: Instruction) -> int | None:
    known = inst.backend_config.get("known_trip_count")
    if not isinstance(known, dict):
        return None
    try:
        return int(known.get("n"))
    except (TypeError, ValueError):
        return None


class _GraphBuilder:
    def __init__(self, owner: _ModuleBuilder, comp: Computation, kind: str,
                 trip_count: int | None):
        self.owner = owner
        self.comp = comp
        self.kind = kind
        self.trip_count = trip_count
        self.nodes: list[OpNode] = []
        self.inputs: list[int] = []
        # Names of the graph's own instructions are reserved: inlined ops yield to them.
        self.used: set[str] = {i.name for i in comp.instructions}

    def build(self) -> OpGraph:
        root = self.expand(self.comp, None, "", None)
        for node in self.nodes:
            for o in node.operands:
                users = self.nodes[o].users
                if not users or users[-1] != node.id:
                    users.append(node.id)
        return OpGraph(self.comp.name, self.kind, self.nodes, self.inputs, _leaves(root),
                       self.trip_count, computations=self.owner.comps)

    # --- naming and node creation ------------------------------------------------------
    def unique(self, name: str, scope: str) -> str:
        if scope and name in self.used:
            name = scope + name
        base, k = name, 1
        while scope and name in self.used:
            k += 1
            name = f"{base}#{k}"
        self.used.add(name)
        return name

    def add(self, inst: Instruction, comp: Computation, scope: str, operands: list[int],
            op_class: OpClass, group: str | None, shape: Shape | None = None,
            name: str | None = None, index: tuple[int, ...] = ()) -> int:
        node = OpNode(len(self.nodes), self.unique(name or inst.name, scope), inst.opcode,
                      shape or inst.shape, op_class, operands, [], group, inst, comp.name,
                      index=index)
        self.nodes.append(node)
        return node.id

    def graph_parameter(self, inst: Instruction, comp: Computation) -> Val:
        """A parameter of the graph's own computation: one SOURCE node per array leaf."""
        def split(shape: Shape, index: tuple[int, ...]) -> Val:
            if shape.is_tuple:
                return tuple(split(s, index + (i,)) for i, s in enumerate(shape.tuple_shapes))
            label = inst.name + ("{" + ",".join(map(str, index)) + "}" if index else "")
            return self.add(inst, comp, "", [], OpClass.SOURCE, None, shape, label, index)
        val = split(inst.shape, ())
        self.inputs.extend(_leaves(val))
        return val

    # --- expansion ---------------------------------------------------------------------
    def expand(self, comp: Computation, params: list[Val] | None, scope: str,
               group: str | None) -> Val:
        """Emit the nodes of ``comp``; ``params`` are the values bound to its parameters
        (None for the graph's own computation). Returns the value of its root."""
        owner = self.owner
        vals: dict[str, Val] = {}
        for inst in owner.order(comp):
            op = inst.opcode
            if op == "parameter":
                if params is None:
                    vals[inst.name] = self.graph_parameter(inst, comp)
                elif inst.parameter_number is None or inst.parameter_number >= len(params):
                    raise GraphBuildError(f"{comp.name}/{inst.name}: parameter "
                                          f"{inst.parameter_number} has no operand")
                else:
                    vals[inst.name] = params[inst.parameter_number]
                continue
            if op == "tuple":
                vals[inst.name] = tuple(vals[o] for o in inst.operands)
                continue
            if op == "get-tuple-element":
                src = vals[inst.operands[0]]
                if isinstance(src, tuple):
                    vals[inst.name] = src[inst.int("index")]
                    continue
            op_class = classify_with(inst, owner.lookup, owner.class_cache)
            args = [vals[o] for o in inst.operands]
            if op == "call" or (op == "fusion" and op_class is not OpClass.COMPUTE):
                callee = owner.lookup(inst.called_computations[0])
                inner_group = group or (inst.name if op == "fusion" else None)
                vals[inst.name] = self.expand(callee, args, f"{scope}{inst.name}/", inner_group)
                continue
            operands = [leaf for a in args for leaf in _leaves(a)]
            node_group = group or (inst.name if op == "fusion" else None)
            nid = self.add(inst, comp, scope, operands, op_class, node_group)
            if op == "while":
                trips = _trip_count(inst)
                self.nodes[nid].subgraphs = [
                    owner.slot(self.callee(inst, "body"), "while-body", trips),
                    owner.slot(self.callee(inst, "condition"), "while-cond", trips)]
            elif op == "conditional":
                self.nodes[nid].subgraphs = [owner.slot(c, "branch", None)
                                             for c in inst.called_computations]
            vals[inst.name] = nid
        return vals[comp.root.name]

    @staticmethod
    def callee(inst: Instruction, attr: str) -> str:
        names = parse_computation_list(inst.attrs.get(attr, "{}"))
        if len(names) != 1:
            raise GraphBuildError(f"{inst.name}: expected one {attr}= computation, got {names}")
        return names[0]
