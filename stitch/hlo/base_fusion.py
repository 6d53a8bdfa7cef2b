"""An XLA-GPU-like base fusion of pre-optimization HLO, at the level of op classes.

What XLA GPU would launch for an op graph, without running XLA: the comparison point for
plans made on the HLO jax lowers (before XLA's own fusion exists). It follows the shape of
XLA's pipeline (instruction fusion, then multi-output fusion), not its code or cost model.

1. Producer-consumer fusion, consumers first (reverse topological order). LIGHT, EXPENSIVE
   and LAYOUT ops fuse into the groups of their users; REDUCTION ops only root groups (an
   elementwise producer fuses into a reduction's input, as in XLA's kInput fusions); COMPUTE
   and OPAQUE ops are singleton groups. A producer read by several groups is duplicated
   into all of them only when every reader can take it and recomputing it is cheap: not
   EXPENSIVE, at most one full-size array read besides broadcasts (XLA's "effectively
   unary" test: duplication must not add memory traffic), and at most MAX_DUPLICATES
   copies unless it reads only scalars (a broadcast of one). Otherwise it roots a group of
   its own. An EXPENSIVE producer is not fused through an op that reads each element many
   times (a broadcast). Free ops (bitcasts, gtes) join the groups of their readers and
   never root a group.
2. Multi-output fusion. Siblings: groups reading a common array (not a scalar, constant or
   broadcast of a scalar) merge when their iteration spaces are compatible: loops over the
   same number of elements, reductions of the same input over the same dimensions, or a
   loop over exactly the elements a reduction reads. Producer-consumer: a loop group that
   phase 1 could not fuse into its readers (EXPENSIVE, or also read by a GEMM) merges into
   one compatible reader, which then also writes its value. No merge may make a group
   depend on itself through a third group, nor read a reduction's result in the
   reduction's own kernel.
3. Optionally (``row_fusion``), Ampere+-style normalization kernels: a reduction over the
   minor-most dimensions (a row of at most MAX_ROW elements) absorbs the neighbouring
   groups that work on the same rows (loops over rows x row-length or over rows, other
   reductions of such rows), reduction results included: XLA's Triton softmax/layer-norm
   fusions on A100/H100. Without it the result is XLA's classic pipeline, as on V100.

Groups come back in a launch order: each after the groups producing its inputs.

Duplicated ops make groups overlap. By default every group is also convex for
``OpGraph.is_convex``: a copy is not made where a path leaves the group through another
copy and comes back (layer norm's ``x - mean``, read by the variance and by the output);
the op then roots a group, usually merged into a reader by multi-output fusion. XLA does
make such copies; ``strict_convex=False`` allows them, and each group is then convex in the
sense that matters for launching it: no path from a value it *writes* (one read by an op
whose groups do not recompute it) comes back into it. Both give nearly the same counts.
"""
from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass, field

from .graph import OpGraph
from .ir import Shape
from .op_classes import OpClass

log = logging.getLogger(__name__)

# Kinds of group, after XLA's fusion kinds.
LOOP = "loop"          # elementwise / data movement, one thread per output element
INPUT = "input"        # rooted at reductions: the reduction's input is the iteration space
ROW = "row"            # a row-at-a-time normalization kernel (row_fusion only)
COMPUTE = "compute"    # a GEMM / convolution kernel
OPAQUE = "opaque"      # a library or unstitchable kernel; also loops/conditionals (no kernel)

FUSIBLE_KINDS = (LOOP, INPUT, ROW)

# Ops that read each operand element many times: an EXPENSIVE producer fused through them
# would be recomputed per reuse (XLA refuses such fusions, or its cost model does).
REUSING_OPCODES = frozenset({"broadcast", "reduce-window", "gather", "pad"})

# Operands that do not count as array reads when deciding whether duplicating an op adds
# memory traffic: each copy reads them from a much smaller source, or not at all.
_CHEAP_OPERAND_OPCODES = frozenset({"broadcast", "iota"})

# At most this many groups recompute one op: XLA's fusion budgets stop duplication long
# before, and the cap keeps chains of duplicable ops linear.
MAX_DUPLICATES = 8

# Sibling groups one group tries to merge with, per shared input (XLA compares every pair;
# the cap keeps an array read by thousands of groups from making this quadratic).
MAX_SIBLING_TRIES = 64

# Longest row a normalization kernel holds; XLA splits longer reductions in two kernels.
MAX_ROW = 16384


@dataclass(eq=False)
class _Group:
    kind: str
    root: int                      # its first root; the earliest of them after merges
    members: set[int]
    space: tuple                   # iteration space, compared by multi-output fusion
    alive: bool = True
    succs: set[int] = field(default_factory=set)   # groups reading a value of this one
    preds: set[int] = field(default_factory=set)


def _space(graph: OpGraph, root: int, kind: str) -> tuple:
    """What a group iterates over, for multi-output fusion: the element count of a loop
    fusion's output, the input shape and reduced dimensions of a reduction."""
    node = graph.nodes[root]
    if kind == INPUT and node.opcode == "reduce":
        # reduce(inputs..., inits...): the first operand is the reduced array.
        src = graph.nodes[node.operands[0]].shape
        return (INPUT, src.num_elements, src.dims, node.instruction.ints("dimensions", ()))
    if kind == LOOP:
        return (LOOP, node.shape.num_elements if node.shape.is_array else -1)
    return (kind, root)            # reduce-window, GEMMs, opaque ops: never shared


def _true_rank(shape: Shape) -> int:
    """Dimensions of size > 1."""
    return sum(1 for d in shape.dims if d != 1) if shape.is_array else 0


def _compatible(a: tuple, b: tuple) -> bool:
    """Spaces one kernel can iterate over together: equal ones, or a loop over exactly the
    elements a reduction reads (the reduction's thread mapping covers the loop too)."""
    if a[0] == LOOP and b[0] == LOOP:
        return a[1] == b[1] and a[1] >= 0
    if a[0] == INPUT and b[0] == INPUT:
        return a == b and len(a) == 4
    loop, red = (a, b) if a[0] == LOOP else (b, a)
    return loop[0] == LOOP and red[0] == INPUT and len(red) == 4 and loop[1] == red[1]


class _BaseFusion:
    def __init__(self, graph: OpGraph, strict_convex: bool, row_fusion: bool):
        self.graph = graph
        self.nodes = graph.nodes
        self.strict = strict_convex
        self.row_fusion = row_fusion
        n = len(self.nodes)
        self.outputs = set(graph.outputs)
        self.groups: list[_Group] = []
        # Phase 1 membership (merges later only update the groups themselves).
        self.groups_of: list[list[int]] = [[] for _ in range(n)]
        # demand[v]: v's value must be written by the group computing it (a graph output,
        # or read by an op that cannot fuse it). Set when v is visited.
        self.demand = [False] * n
        self.free = [graph.is_free(i) for i in range(n)]
        # Free ops that pass data through and may join any group; the other free ops
        # (sources, while/conditional, barriers) are boundaries no group takes in.
        self.transparent = [self.free[i] and self.nodes[i].op_class not in
                            (OpClass.SOURCE, OpClass.OPAQUE) for i in range(n)]
        self.reach: list[int] = []        # per group: bitset of the groups it reaches
        self.alias: dict[int, int] = {}   # merged group -> the group it went into

    # --- phase 1: producer-consumer fusion ---------------------------------------------
    def new_group(self, root: int, kind: str) -> None:
        gid = len(self.groups)
        self.groups.append(_Group(kind, root, {root}, _space(self.graph, root, kind)))
        self.groups_of[root].append(gid)

    def join(self, v: int, gid: int) -> None:
        self.groups[gid].members.add(v)
        self.groups_of[v].append(gid)

    def consumer_groups(self, v: int) -> tuple[list[int], bool]:
        """The fusible groups v's readers belong to, and whether some reader cannot fuse v."""
        found: dict[int, None] = {}
        blocked = v in self.outputs
        for u in self.nodes[v].users:
            fusible = [g for g in self.groups_of[u] if self.groups[g].kind in FUSIBLE_KINDS]
            if self.transparent[u]:
                blocked |= self.demand[u]
            elif not fusible:
                blocked = True          # a GEMM, an opaque op, a loop, a reduce-window...
            found.update(dict.fromkeys(fusible))
        return list(found), blocked

    def joins_convexly(self, v: int, gid: int) -> bool:
        """Adding v keeps the group convex in the strict sense (no path v -> outside ->
        member). Every member was visited before v, so it comes after v in topological
        order: no path can lead from a member back to v. Without ``strict_convex``, v's
        readers outside the group read another copy, and v always fits."""
        members = self.groups[gid].members
        outside = [u for u in self.nodes[v].users if u not in members]
        if not outside or not self.strict:
            return True
        bound = self.groups[gid].root       # the group's largest id during phase 1
        stack = [u for u in outside if u < bound]
        seen = set(stack)
        while stack:
            for w in self.nodes[stack.pop()].users:
                if w in members:
                    return False
                if w < bound and w not in seen:
                    seen.add(w)
                    stack.append(w)
        return True

    def duplicable(self, v: int) -> bool:
        """Recomputing v in several kernels adds no memory traffic: it reads at most one
        full array besides broadcasts, iotas and scalars, or reads no more bytes than it
        writes (XLA's test before duplicating a producer)."""
        node = self.nodes[v]
        rank = _true_rank(node.shape)
        arrays, read = 0, 0
        for o in dict.fromkeys(node.operands):
            src = self.nodes[o]
            read += src.shape.byte_size
            if (src.opcode in _CHEAP_OPERAND_OPCODES or _true_rank(src.shape) < rank
                    or (src.opcode == "constant" and src.shape.num_elements <= 1)):
                continue
            arrays += 1
        return arrays <= 1 or read <= node.shape.byte_size

    def scalar_inputs(self, v: int) -> bool:
        """v reads only scalars (a broadcast of one, an iota): any number of copies are
        free, and duplicating it cannot cascade into real work."""
        return all(self.nodes[o].shape.num_elements <= 1 for o in self.nodes[v].operands)

    def reused_expensively(self, v: int, gid: int) -> bool:
        """v is read in the group by an op that reuses each element (looking through
        bitcasts): an EXPENSIVE v fused there would be recomputed per reuse."""
        members = self.groups[gid].members
        stack = [u for u in self.nodes[v].users if u in members]
        seen = set(stack)
        while stack:
            u = stack.pop()
            if self.nodes[u].opcode in REUSING_OPCODES:
                return True
            if self.transparent[u]:
                for w in self.nodes[u].users:
                    if w in members and w not in seen:
                        seen.add(w)
                        stack.append(w)
        return False

    def fuse_producers(self) -> None:
        for v in range(len(self.nodes) - 1, -1, -1):
            if self.free[v]:
                if self.nodes[v].op_class is OpClass.OPAQUE:
                    # A loop or conditional runs kernels of its own between its producers
                    # and its readers: a group without a kernel, that no op joins.
                    self.new_group(v, OPAQUE)
                elif self.transparent[v]:
                    groups, blocked = self.consumer_groups(v)
                    for g in groups:
                        if self.joins_convexly(v, g):
                            self.join(v, g)
                        else:
                            blocked = True
                    self.demand[v] = blocked
                continue
            cls = self.nodes[v].op_class
            # A scatter stays a kernel of its own here (XLA's baseline keeps it whole); the
            # planner decides whether it is stitched.
            if cls is OpClass.COMPUTE or cls is OpClass.OPAQUE or \
                    self.nodes[v].opcode == "scatter":
                self.new_group(v, COMPUTE if cls is OpClass.COMPUTE else OPAQUE)
                continue
            if cls is OpClass.REDUCTION:
                self.new_group(v, INPUT)
                continue
            groups, blocked = self.consumer_groups(v)
            if (blocked or not groups
                    or (len(groups) > 1 and (cls is OpClass.EXPENSIVE
                                             or (len(groups) > MAX_DUPLICATES
                                                 and not self.scalar_inputs(v))
                                             or not self.duplicable(v)))
                    or (cls is OpClass.EXPENSIVE and self.reused_expensively(v, groups[0]))
                    or not all(self.joins_convexly(v, g) for g in groups)):
                self.new_group(v, LOOP)
                continue
            for g in groups:
                self.join(v, g)

    # --- the group DAG ------------------------------------------------------------------
    def producers(self, v: int, memo: dict[int, tuple[int, ...]]) -> tuple[int, ...]:
        """Groups computing v, looking through bitcasts and gtes."""
        if v in memo:
            return memo[v]
        found: dict[int, None] = {}
        stack, seen = [v], {v}
        while stack:
            x = stack.pop()
            if not self.transparent[x]:
                found.update(dict.fromkeys(self.groups_of[x]))   # none for sources
            elif x in memo:
                found.update(dict.fromkeys(memo[x]))
            else:
                for o in self.nodes[x].operands:
                    if o not in seen:
                        seen.add(o)
                        stack.append(o)
        memo[v] = tuple(found)
        return memo[v]

    def link_groups(self) -> None:
        """Edges between groups (one reads a value the other computes), and for each group
        the set of groups it reaches, as a bitset, for the cycle checks of merges."""
        memo: dict[int, tuple[int, ...]] = {}
        for gid, group in enumerate(self.groups):
            for m in group.members:
                for o in self.nodes[m].operands:
                    if o in group.members:
                        continue
                    for p in self.producers(o, memo):
                        if p != gid:
                            group.preds.add(p)
                            self.groups[p].succs.add(gid)
        self.reach = [0] * len(self.groups)
        for g in reversed(self.launch_order()):
            bits = 0
            for s in self.groups[g].succs:
                bits |= self.reach[s] | (1 << s)
            self.reach[g] = bits

    def launch_order(self) -> list[int]:
        """Live groups, each after its producers; among ready groups, earliest root first."""
        live = [g for g, group in enumerate(self.groups) if group.alive]
        waiting = {g: len(self.groups[g].preds) for g in live}
        ready = [(self.groups[g].root, g) for g in live if not waiting[g]]
        heapq.heapify(ready)
        order: list[int] = []
        while ready:
            _, g = heapq.heappop(ready)
            order.append(g)
            for s in self.groups[g].succs:
                waiting[s] -= 1
                if not waiting[s]:
                    heapq.heappush(ready, (self.groups[s].root, s))
        if len(order) != len(live):
            raise AssertionError(f"{self.graph.name}: base fusion groups form a cycle")
        return order

    # --- phase 2: multi-output fusion ---------------------------------------------------
    def find(self, g: int) -> int:
        while g in self.alias:
            g = self.alias[g]
        return g

    def origin(self, v: int) -> int:
        """The value a chain of bitcasts and gtes names."""
        while self.transparent[v] and len(self.nodes[v].operands) == 1:
            v = self.nodes[v].operands[0]
        return v

    def shared_inputs(self) -> list[list[int]]:
        """For each array read by several fusible groups (not a scalar, a constant or a
        broadcast of a scalar: XLA rematerializes those anyway), the groups reading it;
        the latest values first, as XLA's multi-output fusion walks the graph."""
        readers: dict[int, dict[int, None]] = {}
        for gid, group in enumerate(self.groups):
            if group.kind not in FUSIBLE_KINDS:
                continue
            for m in group.members:
                for o in self.nodes[m].operands:
                    if o in group.members:
                        continue
                    src = self.origin(o)
                    node = self.nodes[src]
                    if (node.opcode != "constant" and node.shape.is_array
                            and node.shape.num_elements > 1
                            and not (node.op_class is OpClass.LAYOUT
                                     and self.scalar_inputs(src))):
                        readers.setdefault(src, {})[gid] = None
        return [sorted(gs, key=lambda g: self.groups[g].root)
                for _, gs in sorted(readers.items(), reverse=True) if len(gs) > 1]

    def try_merge(self, a: int, b: int, rows: bool = False) -> bool:
        """Merge groups a and b when their spaces are compatible and neither reaches the
        other through a third group (the merged group would read its own output). Only a
        row kernel (``rows``) may consume a reduction's result itself."""
        ga, gb = self.groups[a], self.groups[b]
        if not rows and not _compatible(ga.space, gb.space):
            return False
        x, y = (b, a) if self.reach[b] >> a & 1 else (a, b)     # x never after y
        gx, gy = self.groups[x], self.groups[y]
        if self.reach[x] >> y & 1:
            if y not in gx.succs or (gx.kind != LOOP and not rows):
                return False
            if any(self.reach[s] >> y & 1 for s in gx.succs if s != y):
                return False
        if self.strict and not self.graph.is_convex(gx.members | gy.members):
            return False
        self.merge(x, y)
        return True

    def merge(self, a: int, b: int) -> None:
        """Fold the smaller of two groups into the larger (a member moves O(log n) times),
        and update edges and reachability."""
        keep, drop = ((a, b) if len(self.groups[a].members) >= len(self.groups[b].members)
                      else (b, a))
        gk, gd = self.groups[keep], self.groups[drop]
        gk.members |= gd.members
        if gd.kind == INPUT:
            gk.kind, gk.space = INPUT, gd.space
        gk.root = min(gk.root, gd.root)
        for p in gd.preds:
            self.groups[p].succs.discard(drop)
            if p != keep:
                self.groups[p].succs.add(keep)
                gk.preds.add(p)
        for s in gd.succs:
            self.groups[s].preds.discard(drop)
            if s != keep:
                self.groups[s].preds.add(keep)
                gk.succs.add(s)
        gk.preds.discard(drop)
        gk.succs.discard(drop)
        gd.alive, gd.members, gd.preds, gd.succs = False, set(), set(), set()
        self.alias[drop] = keep
        # Whatever reaches the merged group now reaches what either part reached; a group
        # that already did shields its ancestors. (The dead group's bit may stay set: only
        # live groups are looked up.)
        bits = (self.reach[keep] | self.reach[drop]) & ~(1 << keep)
        self.reach[drop], self.reach[keep] = 0, bits
        bits |= 1 << keep
        stack, seen = list(gk.preds), set(gk.preds)
        while stack:
            z = stack.pop()
            if self.reach[z] | bits == self.reach[z]:
                continue
            self.reach[z] |= bits
            for p in self.groups[z].preds:
                if p not in seen:
                    seen.add(p)
                    stack.append(p)

    def fuse_siblings(self) -> int:
        merged = 0
        for readers in self.shared_inputs():
            # Unmerged readers so far, by element count (only equal counts are compatible);
            # a new reader tries the latest MAX_SIBLING_TRIES of them, oldest first.
            live: dict[int, list[int]] = {}
            for g in readers:
                g = self.find(g)
                bucket = live.setdefault(self.groups[g].space[1], [])
                if g in bucket:
                    continue
                for k in range(max(len(bucket) - MAX_SIBLING_TRIES, 0), len(bucket)):
                    if self.try_merge(g, bucket[k]):
                        merged += 1
                        bucket.pop(k)
                        g = self.find(g)
                        break
                bucket.append(g)
        return merged

    def fuse_into_consumers(self) -> int:
        """Producer-consumer multi-output fusion of the loop groups phase 1 left unfused."""
        merged = 0
        for p in reversed(self.launch_order()):
            group = self.groups[p]
            if not group.alive or group.kind != LOOP:
                continue
            for c in sorted(group.succs, key=lambda g: self.groups[g].root):
                if self.groups[c].kind in FUSIBLE_KINDS and self.try_merge(p, c):
                    merged += 1
                    break
        return merged

    # --- phase 3 (optional): row kernels ------------------------------------------------
    def row_of(self, g: int) -> tuple[int, int] | None:
        """(rows, row length) of a row-kernel group, or of a reduction group that can seed
        one: it reduces the minor-most dimensions of its input (rows of at most MAX_ROW
        elements, and more than one row)."""
        group = self.groups[g]
        if group.kind == ROW:
            return group.space[1], group.space[2]
        if group.kind != INPUT or len(group.space) != 4:
            return None
        _, count, dims, reduced = group.space
        shape = self.nodes[self.nodes[group.root].operands[0]].shape
        if not reduced or set(shape.minor_to_major()[:len(reduced)]) != set(reduced):
            return None
        length = 1
        for d in reduced:
            length *= dims[d]
        # A reduction to one value is no row kernel: a single block would do all the work.
        return (count // length, length) if length <= MAX_ROW and count > length else None

    def fits_row(self, h: int, row: tuple[int, int]) -> bool:
        """Group h works on the same rows: a loop over all their elements or one per row,
        or a reduction of the same rows."""
        group = self.groups[h]
        if group.kind == LOOP:
            return group.space[1] in (row[0] * row[1], row[0])
        return group.kind in (INPUT, ROW) and self.row_of(h) == row

    def fuse_rows(self) -> int:
        merged = 0
        for g in self.launch_order():
            if not self.groups[g].alive:
                continue
            row = self.row_of(g)
            if row is None:
                continue
            frontier = sorted(self.groups[g].preds | self.groups[g].succs)
            while frontier:
                h = self.find(frontier.pop())
                if h == g or not self.fits_row(h, row) or not self.try_merge(g, h, rows=True):
                    continue
                merged += 1
                g = self.find(g)
                self.groups[g].kind, self.groups[g].space = ROW, (ROW,) + row
                frontier = sorted(self.groups[g].preds | self.groups[g].succs)
        return merged

    # --- result -------------------------------------------------------------------------
    def write_what_is_read(self, result: list[list[int]], unfixable: set[int] | None = None
                           ) -> list[list[int]]:
        """Every value a group reads from outside must be written by a group holding it.
        Duplication can break that: a reader copied into a second group takes its producer
        along only where the producer itself was fused, so the second copy reads a value
        that its first group uses only inside (a scalar convert feeding two compares was
        seen in a Keras train step). The producer is then duplicated into the reader too,
        when that keeps the group convex; repeated until nothing is missing."""
        unfixable = set() if unfixable is None else unfixable
        for _ in range(len(self.nodes)):
            written = self._written_values(result)
            changed = False
            for gi, group in enumerate(result):
                members = set(group)
                missing = self._unwritten_reads(members, written)
                for o in sorted(missing - unfixable):
                    if self.graph.is_convex(members | {o}):
                        members.add(o)
                        changed = True
                        continue
                    # Not convex here: o becomes a kernel of its own that writes it for
                    # every reader, unless that closes a cycle (o's producer inside a
                    # holder); then the plan is left as it is and its validation says why.
                    # A free alias cannot be a kernel: what it aliases gets one instead.
                    own = self._resolve({o}, set()) if self.free[o] else {o}
                    try:
                        result = self.relaunch([[m for m in g if m not in own] for g in result]
                                               + [[v] for v in sorted(own)])
                    except AssertionError:
                        unfixable.add(o)
                        continue
                    return self.write_what_is_read(result, unfixable)
                result[gi] = sorted(members)
            if not changed:
                return result
        return result

    def _resolve(self, starts: set[int], within: set[int]) -> set[int]:
        """The computed values ``starts`` stand for: each one that is not free, or, for a
        free alias (bitcast, reshape, gte), what it aliases, walking back through operands
        (those in ``within`` only, when given non-empty). Sources resolve to nothing."""
        found: set[int] = set()
        stack, seen = list(starts), set()
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            if not self.free[v]:
                found.add(v)
            elif self.transparent[v]:
                stack.extend(o for o in self.nodes[v].operands if not within or o in within)
        return found

    def _written_values(self, result: list[list[int]]) -> set[int]:
        """Values some group writes: members used outside it (or graph outputs), a free
        alias member standing for the member it aliases."""
        written: set[int] = set()
        for group in result:
            members = set(group)
            leaving = {m for m in group if m in self.outputs
                       or any(u not in members for u in self.nodes[m].users)}
            written |= self._resolve(leaving, members)
        return written

    def _unwritten_reads(self, members: set[int], written: set[int]) -> set[int]:
        """Operands the group reads from outside whose value no group writes. A free
        operand (a reshape of a value another group uses only inside) is returned itself
        when what it aliases is unwritten: taking the alias in brings its producer along
        on the next round (kernel 7 reads mul.24, which no kernel writes: a dense +
        layer-norm + MSE + SGD step)."""
        missing: set[int] = set()
        for m in members:
            for o in self.nodes[m].operands:
                if o in members or not (self.transparent[o] or not self.free[o]):
                    continue
                values = self._resolve({o}, set())
                if any(v not in written and self.groups_of[v] for v in values):
                    missing.add(o)
        return missing

    def relaunch(self, result: list[list[int]]) -> list[list[int]]:
        """Groups in a valid launch order again (each after the groups writing what it
        reads; among ready groups, the earliest first op first)."""
        result = [g for g in result if g]
        holder: dict[int, list[int]] = {}
        for gi, group in enumerate(result):
            for m in group:
                holder.setdefault(m, []).append(gi)
        sets = [set(g) for g in result]
        outputs = set(self.graph.outputs)

        def writers(o: int) -> list[int]:
            # A recomputed value comes from the holders that write it (use it outside).
            held = holder.get(o, [])
            writing = [h for h in held if o in outputs
                       or any(u not in sets[h] for u in self.nodes[o].users)]
            return writing or held
        preds = [set() for _ in result]
        for gi, group in enumerate(result):
            for m in group:
                for o in self.nodes[m].operands:
                    if o not in sets[gi]:
                        preds[gi].update(h for h in writers(o) if h != gi)
        order: list[int] = []
        done: set[int] = set()
        ready = [(result[g][0], g) for g in range(len(result)) if not preds[g]]
        heapq.heapify(ready)
        succs = [[] for _ in result]
        for gi, p in enumerate(preds):
            for q in p:
                succs[q].append(gi)
        waiting = [len(p) for p in preds]
        while ready:
            _, g = heapq.heappop(ready)
            order.append(g)
            done.add(g)
            for s in succs[g]:
                waiting[s] -= 1
                if not waiting[s]:
                    heapq.heappush(ready, (result[s][0], s))
        if len(order) != len(result):
            raise AssertionError(f"{self.graph.name}: base fusion groups form a cycle")
        return [result[g] for g in order]

    def run(self) -> list[list[int]]:
        self.fuse_producers()
        self.link_groups()
        siblings = self.fuse_siblings()
        chained = self.fuse_into_consumers()
        rows = self.fuse_rows() if self.row_fusion else 0
        result = [sorted(self.groups[g].members) for g in self.launch_order()
                  if not all(self.free[m] for m in self.groups[g].members)]
        result = self.write_what_is_read(result)
        log.debug("base fusion of %s: %d groups (merges: %d sibling, %d producer-consumer, "
                  "%d row)", self.graph.name, len(result), siblings, chained, rows)
        return result


def base_fusion(graph: OpGraph, *, strict_convex: bool = True,
                row_fusion: bool = False) -> list[list[int]]:
    """Groups of node ids (each group = one kernel XLA GPU would launch), in a valid launch order.

    Groups may overlap: an op in several groups is recomputed by each. With
    ``strict_convex`` (the default) each group is convex for ``OpGraph.is_convex``; without
    it XLA's recomputation across paths is allowed too. ``row_fusion`` adds the
    normalization kernels XLA forms with Triton on A100/H100 (without it: XLA's classic
    pipeline, as V100 gets it).
    """
    return _BaseFusion(graph, strict_convex, row_fusion).run()
