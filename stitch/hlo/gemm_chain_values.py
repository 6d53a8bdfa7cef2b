"""The chain program's values (``stitch.hlo.gemm_chains``): graph ops and GEMM-fusion
ops between two GEMMs translated into hash-consed ``ChainOp``s over tile / row / scalar
values, outside values read as strided views, index computations (iota masks, one-hot labels)
recomputed in the kernel.
"""
from __future__ import annotations

import dataclasses

from .gemm_chain_operands import (HELD_TYPES, RENAMES, Digits, GemmDot, constant_value,
                                   literal_scalar, live_dims, prefix_points, reducer_of,
                                   row_major, row_major_strides, strided_source, strided_view)
from .gemm_chain_program import ELEMENTWISE_OPS, ChainOp, NotAChain, OperandView
from .gemm_chain_search import ChainSearch
from .graph import OpGraph
from .ir import Instruction, Shape

# Integer values an index computation may read from a buffer (labels spread over the tile).
_INDEX_INPUT_TYPES = frozenset({"s32"})
# Element ops of an index computation a chain kernel recomputes (a causal mask of iotas).
_INDEX_OPS = frozenset({"compare", "add", "subtract", "and", "or", "not", "select"})


class ChainProgramBuilder:
    """The program of one (first, second) GEMM pair as it is built (``Recognizer`` runs it)."""
    def __init__(self, graph: OpGraph, first: int, second: int,
                 reach: ChainSearch | None = None):
        self.g = graph
        self.first = first
        self.second = second
        self.reach = reach if reach is not None else ChainSearch.of(graph)
        self.ops: list[ChainOp] = []
        self.memo: dict[ChainOp, int] = {}
        self.value_of: dict[int, int] = {}      # graph node -> program index
        self.members: set[int] = set()
        self.inputs: list[int] = []
        self.dims: tuple[int, int, int] = (0, 0, 0)   # batch, m, n

    # --- program building -------------------------------------------------------------
    def add(self, op: ChainOp) -> int:
        got = self.memo.get(op)
        if got is None:
            got = len(self.ops)
            self.ops.append(op)
            self.memo[op] = got
        return got

    def rank_of(self, shape: Shape) -> str:
        b, m, n = self.dims
        count = shape.num_elements
        if count == b * m * n:
            return "tile"
        if count == b * m:
            return "row"
        if count == 1:
            return "scalar"
        raise NotAChain(f"a value of {count} elements is neither a tile, a row nor a scalar")

    def outside(self, nid: int) -> int:
        """An outside value read by the program: a scalar constant, or a buffer."""
        node = self.g.nodes[nid]
        shape = node.shape
        if shape.is_tuple or not shape.is_array:
            raise NotAChain(f"{node.name}: tuple read by the chain")
        spread = self.spread_constant(nid)
        if spread is not None:
            value, nodes = spread
            # A scalar constant (or its broadcast) only the chain reads joins the chain.
            for v in nodes:
                if all(u in self.members for u in self.g.nodes[v].users):
                    self.members.add(v)
            return self.add(ChainOp("const", "scalar", shape.element_type, value=value))
        rank = self.rank_of(shape)
        root, digits, moved = strided_source(self.g, nid, self.members)
        if not self.g.nodes[root].shape.is_array or not row_major(self.g.nodes[root].shape):
            raise NotAChain(f"{node.name}: outside operand layout is not row-major")
        view = self.value_view(root, shape.dims, digits, rank)
        self.index_inputs: list[int] = []
        index = self.index_value(root, dataclasses.replace(view, node=-1), rank, set())
        if index is not None:
            for v in self.index_inputs:
                if v not in self.inputs:
                    self.inputs.append(v)
            # Computed from iotas only (a causal mask): the kernel computes it. Its ops join
            # the chain where only the chain reads them; one XLA also reads elsewhere (bf16:
            # the mask is a kernel of its own, the backward reads it too) stays outside,
            # neither read nor written by the chain.
            value, nodes = index
            self.members.update(moved)
            inside = set(nodes)
            changed = True
            while changed:
                changed = False
                for v in list(inside):
                    if any(u not in self.members and u not in inside
                           for u in self.g.nodes[v].users):
                        inside.discard(v)
                        changed = True
            self.members.update(inside)
            return value
        self.members.update(moved)
        if root not in self.inputs:
            self.inputs.append(root)
        return self.add(ChainOp("input", rank, shape.element_type, view=view))

    def value_view(self, root: int, dims: tuple[int, ...], digits: list[Digits],
                   rank: str) -> OperandView:
        """A tile / row / scalar value as [b, m, n] (rows: n = 0) over ``root``."""
        b, m, _ = self.dims
        if rank == "scalar":
            return OperandView(root, 0, 0, 0)
        everything = list(range(len(dims)))
        for j1 in prefix_points(dims, b):
            ends = prefix_points(dims, b * m) if rank == "tile" else [len(dims)]
            for j2 in (j for j in ends if j >= j1):
                try:
                    view, _ = strided_view(root, dims, digits, everything[:j1],
                                            everything[j1:j2], everything[j2:])
                    return view
                except NotAChain:
                    continue
        raise NotAChain(f"a {rank} value over {list(dims)} is not [batch, m, n] strided")

    def index_value(self, nid: int, view: OperandView, rank: str, nodes: set[int]
                    ) -> tuple[int, set[int]] | None:
        """(program value, nodes) when ``nid`` is computed from iotas and scalar constants
        by element ops on its own shape (XLA's causal mask: compare(iota, iota)), each
        element at ``view``'s offset into ``nid``'s row-major buffer; else None."""
        if self.fails_clean(nid):
            return None
        node = self.g.nodes[nid]
        shape = node.shape
        if not shape.is_array or not row_major(shape):
            return None
        if node.opcode == "iota":
            d = node.instruction.int("iota_dimension", 0)
            nodes.add(nid)
            return self.add(ChainOp("iota", rank, shape.element_type, view=view,
                                    period=(row_major_strides(shape.dims)[d], shape.dims[d]))), nodes
        spread = self.spread_constant(nid)
        if spread is not None:
            nodes.update(spread[1])
            return self.add(ChainOp("const", "scalar", shape.element_type,
                                    value=spread[0])), nodes
        if node.opcode == "broadcast" and shape.element_type in _INDEX_INPUT_TYPES:
            # Integer row (or column) values spread over the tile, compared with an iota: a
            # cross-entropy gradient's one-hot of the labels. Read from their own buffer.
            root, digits, moved = strided_source(self.g, nid, self.members | set(node.users))
            if self.g.nodes[root].shape.num_elements >= shape.num_elements or \
                    not row_major(self.g.nodes[root].shape):
                return None
            try:
                spread = self.value_view(root, shape.dims, digits, rank)
            except NotAChain:
                return None
            nodes.update(moved)
            self.index_inputs.append(root)
            return self.add(ChainOp("input", rank, shape.element_type, view=spread)), nodes
        if node.opcode not in _INDEX_OPS or not node.operands or any(
                self.g.nodes[o].shape.dims != shape.dims for o in node.operands):
            return None
        args = []
        for o in node.operands:
            got = self.index_value(o, view, rank, nodes)
            if got is None:
                return None
            args.append(got[0])
        nodes.add(nid)
        direction = node.instruction.attrs.get("direction", "") if node.opcode == "compare" \
            else ""
        return self.add(ChainOp("elementwise", rank, shape.element_type, node.opcode,
                                tuple(args), direction=direction)), nodes

    def fails_clean(self, nid: int) -> bool:
        """True when ``index_value(nid, ...)`` returns None whatever the pair, before it
        adds an op or a node: ``nid`` is no index op on its own shape, or is one whose first
        operand fails so. Kept per graph (``ChainSearch.index_failures``): a residual
        stream's adds chain back through every layer, and the walk down their first
        operands, once per outside value of every pair, grew with the square of the layers.
        The first operand only: the walk reads the operands in order, and one that succeeds
        adds its ops before a later one fails (those ops stay in the program's list)."""
        memo = self.reach.index_failures
        path: list[int] = []
        v = nid
        while True:
            known = memo.get(v)
            if known is not None:
                break
            known = self._fails_here(v)
            if known is not None:
                memo[v] = known
                break
            path.append(v)
            v = self.g.nodes[v].operands[0]
        for w in path:
            memo[w] = known
        return known

    def _fails_here(self, nid: int) -> bool | None:
        """``fails_clean`` of ``nid`` by itself: True (fails), False (may build), None (as
        its first operand)."""
        node = self.g.nodes[nid]
        shape = node.shape
        if not shape.is_array or not row_major(shape):
            return True
        if node.opcode == "iota" or self.spread_constant(nid) is not None or (
                node.opcode == "broadcast" and shape.element_type in _INDEX_INPUT_TYPES):
            return False
        if node.opcode not in _INDEX_OPS or not node.operands or any(
                self.g.nodes[o].shape.dims != shape.dims for o in node.operands):
            return True
        return None

    def spread_constant(self, nid: int) -> tuple[float, list[int]] | None:
        """(value, nodes) when ``nid`` is a scalar constant or broadcasts / renames of one
        (``nodes``: those ops, outermost first)."""
        nodes: list[int] = []
        while True:
            node = self.g.nodes[nid]
            nodes.append(nid)
            value = constant_value(self.g, nid)
            if value is not None:
                return value, nodes
            if node.opcode not in ("broadcast", *RENAMES) or len(node.operands) != 1:
                return None
            nid = node.operands[0]
            if self.g.nodes[nid].shape.num_elements != 1 and node.opcode == "broadcast":
                return None

    def translate(self, inst: Instruction, shape: Shape, args: list[int],
                  arg_shapes: list[Shape]) -> int:
        """The program index of ``inst`` (a graph op or an op inside a GEMM fusion) whose
        operands are already program values ``args``."""
        op = inst.opcode
        name = inst.name
        if not shape.is_array or shape.element_type not in HELD_TYPES:
            raise NotAChain(f"{name}: element type {shape.element_type}")
        if not row_major(shape):
            raise NotAChain(f"{name}: layout is not row-major")
        rank = self.rank_of(shape)
        if op in RENAMES:
            if not row_major(arg_shapes[0]) or arg_shapes[0].element_type != shape.element_type:
                raise NotAChain(f"{name}: {op} moves data")
            return args[0]
        if op == "constant":
            value = literal_scalar(inst, shape)
            if value is None:
                raise NotAChain(f"{name}: a non-scalar constant inside a GEMM fusion")
            return self.add(ChainOp("const", "scalar", shape.element_type, value=value))
        if op == "broadcast":
            self.check_broadcast(inst, shape, arg_shapes[0])
            return args[0]
        if op == "reduce":
            return self.translate_reduce(inst, shape, args, arg_shapes)
        if op not in ELEMENTWISE_OPS:
            raise NotAChain(f"{name}: {op} is not an element op a chain holds")
        order = {"scalar": 0, "row": 1, "tile": 2}
        arg_rank = max((self.ops[a].rank for a in args), key=order.__getitem__)
        if order[arg_rank] > order[rank]:
            raise NotAChain(f"{name}: {op} of {arg_rank} values gives a {rank}")
        # An element op on broadcast values (a row sum converted after its broadcast, as
        # bf16 softmax does) is the op on the narrower value, broadcast: keep its rank.
        rank = arg_rank
        direction = inst.attrs.get("direction", "") if op == "compare" else ""
        return self.add(ChainOp("elementwise", rank, shape.element_type, op, tuple(args),
                                direction=direction))

    def check_broadcast(self, inst: Instruction, shape: Shape, src: Shape) -> None:
        if src.num_elements == 1:
            return
        table = list(inst.ints("dimensions", ()))
        out = shape.dims
        mapped = [table[i] for i in range(src.rank) if src.dims[i] != 1]
        if mapped != sorted(mapped) or not row_major(src):
            raise NotAChain(f"{inst.name}: broadcast reorders dims")
        if src.num_elements == shape.num_elements:
            return                      # adds unit dims only: a rename
        b, m, _ = self.dims
        if self.rank_of(src) == "row" and self.rank_of(shape) == "tile":
            for j in prefix_points(out, b * m):
                if mapped == live_dims(out, range(j)):
                    return
        raise NotAChain(f"{inst.name}: broadcast does not spread rows along n")

    def translate_reduce(self, inst: Instruction, shape: Shape, args: list[int],
                         arg_shapes: list[Shape]) -> int:
        if len(args) != 2 or self.ops[args[1]].kind != "const":
            raise NotAChain(f"{inst.name}: a variadic reduce or one without a constant init")
        reducer = reducer_of(self.g, inst)
        if reducer is None:
            raise NotAChain(f"{inst.name}: reducer is not add/max/min/multiply")
        src = arg_shapes[0]
        if self.rank_of(src) != "tile" or self.rank_of(shape) != "row":
            raise NotAChain(f"{inst.name}: reduce is not over the rows' n")
        dims = set(inst.ints("dimensions", ()))
        b, m, _ = self.dims
        for j in prefix_points(src.dims, b * m):
            if set(live_dims(src.dims, range(j, src.rank))) <= dims <= set(range(j, src.rank)):
                return self.add(ChainOp("reduce", "row", shape.element_type, reducer,
                                        (args[0],), value=self.ops[args[1]].value))
        raise NotAChain(f"{inst.name}: reduce dims {sorted(dims)} are not n")

    def fusion_values(self, d: GemmDot, graph_args: list[int | None], upto: str | None,
                      skip: set[str]) -> dict[str, int]:
        """Translate the ops of GEMM fusion ``d``'s computation (not the dot): parameters
        read the fusion's operands (``graph_args``: a program value, or None for an outside
        node to read through ``outside``), others become program ops. ``upto``: stop at
        this instruction (the dot's lhs)."""
        comp = d.comp
        node = self.g.nodes[d.node]
        vals: dict[str, int] = {}
        shapes: dict[str, Shape] = {}
        for inst in comp.post_order():
            if inst.name in skip:
                continue
            shapes[inst.name] = inst.shape
            if inst.opcode == "parameter":
                k = inst.parameter_number
                v = graph_args[k]
                vals[inst.name] = v if v is not None else self.outside(node.operands[k])
            elif all(o in vals for o in inst.operands):
                vals[inst.name] = self.translate(inst, inst.shape,
                                                 [vals[o] for o in inst.operands],
                                                 [shapes[o] for o in inst.operands])
            if inst.name == upto:
                break
        return vals

