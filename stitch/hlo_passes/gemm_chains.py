"""GEMM chains: two GEMMs whose second contracts over the first one's result columns, with
only memory-intensive work between them (MCFuser's memory-bound chains, attention).

A chain computes, per batch b (heads x batch)::

    S[b, m, n] = sum_k A[b, m, k] * B[b, k, n]          (the first GEMM)
    P[b, m, n] = program(S)[b, m, n]                     (scale, mask, softmax, ...)
    O[b, m, h] = sum_n P[b, m, n] * C[b, n, h]           (the second GEMM)

The score matrix S/P never needs to reach memory: a chain kernel (stitch.codegen.gemm_chain)
streams over n. Recognition works on ``OpGraph``s as XLA leaves them: GEMMs are plain
``dot``s, GEMM fusions kept as one COMPUTE node (their computation may hold a scale
epilogue after the dot, or an elementwise prologue in front of the second GEMM's lhs) or
cuBLAS custom calls (alpha scales, beta must be 0). XLA splits a long contraction into a
batch dim of the GEMM and a reduce over it afterwards (split-K, ``[512,4,64] x [4,64,64]``
then a reduce over dim 0): that reduce is part of the GEMM it finishes.

Everything between the GEMMs becomes ``GemmChain.program``: a hash-consed list of element
ops over three ranks of value, "tile" (one per (b, m, n)), "row" (one per (b, m)) and
"scalar". A value's rank is read off its element count, so every value must be row-major
(bitcast-compatible with the canonical [B, M, N] / [B, M] layouts): bitcasts, row-major
reshapes and copies only rename, broadcasts must spread rows along n (or scalars), and
reductions must reduce over exactly n. Anything else is not a chain (logged at debug).
"""
from __future__ import annotations

import bisect
import dataclasses
import heapq
import logging
import math
import weakref
from dataclasses import dataclass, field

from .graph import OpGraph
from .ir import Computation, Instruction, Shape
from .op_classes import OpClass

log = logging.getLogger(__name__)

GEMM_DTYPES = frozenset({"f32", "bf16", "f16"})
# Element ops a chain program may hold (HLO opcodes; the lowering maps each).
ELEMENTWISE_OPS = frozenset({
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "power", "negate", "abs",
    "exponential", "exponential-minus-one", "log", "log-plus-one", "sqrt", "rsqrt", "tanh",
    "logistic", "erf", "sign", "floor", "ceil", "compare", "select", "clamp", "convert",
})
REDUCERS = frozenset({"add", "maximum", "minimum", "multiply"})
# Integer values an index computation may read from a buffer (labels spread over the tile).
_INDEX_INPUT_TYPES = frozenset({"s32"})
# Element ops of an index computation a chain kernel recomputes (a causal mask of iotas).
_INDEX_OPS = frozenset({"compare", "add", "subtract", "and", "or", "not", "select"})
_RENAMES = frozenset({"bitcast", "reshape", "copy"})
# What may sit between a chain's GEMMs (``_Recognizer.translate``).
_HELD_OPCODES = ELEMENTWISE_OPS | _RENAMES | {"constant", "broadcast", "reduce"}
_HELD_TYPES = frozenset({"f32", "bf16", "f16", "pred"})


class _NotAChain(Exception):
    """Internal: why a candidate pair is not a chain (logged at debug)."""


@dataclass(frozen=True)
class OperandView:
    """A GEMM operand as a [batch, rows, cols] matrix over the row-major buffer of graph
    node ``node``: element (b, r, c) lies at flat offset
    ``b * batch_stride + r * row_stride + c * col_stride``."""
    node: int
    batch_stride: int
    row_stride: int
    col_stride: int
    # When b is not one strided run (heads x batch through a transpose, a mask broadcast
    # over heads): b's digits as (size, stride), major first; batch_stride is then 0.
    batch_dims: tuple[tuple[int, int], ...] = ()

    def batch_offset(self, b: int) -> int:
        """The offset of batch ``b`` (what lowerings compute with index arithmetic)."""
        if not self.batch_dims:
            return b * self.batch_stride
        offset = 0
        for size, stride in reversed(self.batch_dims):
            offset += (b % size) * stride
            b //= size
        return offset


@dataclass(frozen=True)
class ChainOp:
    """One element op of a chain program (see the module docstring).

    kind "acc": the first GEMM's sum at (b, m, n); "const": ``value``; "input": an outside
    value read through ``view`` (rows m, cols n; a row value has col_stride 0); "iota": an
    index XLA computes with iota (a causal mask's row / column), at (b, m, n)
    ``(view offset // period[0]) % period[1]`` (no buffer: the view's node is -1);
    "elementwise": HLO ``opcode`` over ``args`` (lower ranks broadcast: a row value is the
    same for every n); "reduce": ``opcode`` (the reducer) over n of ``args[0]`` starting
    from ``value``. ``dtype`` is the HLO element type of the result."""
    kind: str
    rank: str                       # "tile" | "row" | "scalar"
    dtype: str
    opcode: str = ""
    args: tuple[int, ...] = ()
    value: float = 0.0
    view: OperandView | None = None
    direction: str = ""             # compare's comparison_direction
    period: tuple[int, int] = ()    # iota: (stride, size) of its dim in the view's buffer


@dataclass(frozen=True)
class ChainOutput:
    """A value between the GEMMs that is also read outside the chain (a training step's
    backward reads the scores S, the softmax's row sums or P): the chain kernel writes it
    too. ``value``: its program index; ``view``: where element (b, m, n) (a row value: n = 0,
    col_stride 0) goes in the row-major buffer of graph node ``node``."""
    node: int
    value: int
    rank: str                       # "tile" | "row"
    dtype: str
    view: OperandView


@dataclass(frozen=True)
class GemmChain:
    members: tuple[int, ...]   # sorted op-graph node ids one chain kernel covers: both GEMM
                               # nodes, the memory-intensive ops between them, bitcasts, a
                               # split-K reduce of the second GEMM
    first: int                 # node id of the first GEMM (dot, GEMM fusion or cuBLAS call)
    second: int                # node id of the second GEMM
    batch: int                 # product of batch dims (heads x batch)
    m: int                     # rows of the first GEMM's result
    n: int                     # columns of the first GEMM = contraction of the second
    k: int                     # contraction of the first GEMM
    h: int                     # columns of the second GEMM's result
    operand_dtype: str         # HLO element type of the GEMM operands: "f32" | "bf16" | "f16"
    softmax: bool              # a row softmax (max, exp, sum, divide) over n sits between
    between: tuple[int, ...]   # ids of the memory-intensive ops between the two GEMMs
    inputs: tuple[int, ...]    # node ids (outside members) the kernel reads
    output: int                # the member node whose value leaves the kernel (chain result)
    # --- added by chaincg (defaults only): what the lowering needs ---------------------
    a: OperandView | None = None        # first GEMM lhs  [b, m, k]
    b: OperandView | None = None        # first GEMM rhs  [b, k, n]
    c: OperandView | None = None        # second GEMM rhs [b, n, h]
    out: OperandView | None = None      # the result      [b, m, h] over ``output``
    program: tuple[ChainOp, ...] = ()   # element ops from S to P (P is the last one)
    output_dtype: str = "f32"           # HLO element type of ``output``
    output_scale: float = 1.0           # the second GEMM's cuBLAS alpha
    # --- added by tf32 (default only) ----------------------------------------------------
    tf32: bool = False                  # both dots let f32 operands run as TF32 (no HIGHEST
                                        # operand precision, no algorithm but TF32's)
    # --- values also read outside (default only) -----------------------------------------
    extra_outputs: tuple[ChainOutput, ...] = ()


# ---------------------------------------------------------------------------- public


def find_gemm_chains(graph: OpGraph) -> list[GemmChain]:
    """Every chain of ``graph``, in topological order of their first GEMM; a GEMM belongs
    to at most one chain (the earlier one wins). Cached per graph (graphs are not changed
    after they are built; the planner and the lowering ask many times)."""
    key = len(graph.nodes)
    cached = _FOUND.get(graph)
    if cached is None or cached[0] != key:
        cached = (key, tuple(_find(graph)))
        _FOUND[graph] = cached
    return list(cached[1])


_FOUND: "weakref.WeakKeyDictionary[OpGraph, tuple[int, tuple[GemmChain, ...]]]" = \
    weakref.WeakKeyDictionary()


_BARRIERS = (OpClass.COMPUTE, OpClass.OPAQUE)


@dataclass(frozen=True)
class _ChainSearch:
    """What the recognizer asks of one graph for many (first, second) GEMM pairs, computed
    once: which GEMMs / opaque ops ("barriers") each node reaches (``bits[v]`` has bit
    ``position[x]`` set when there is a path v -> ... -> x; one pass over the edges in
    reverse topological order), the walk from each first GEMM's result, each GEMM's
    description. A residual stream links every layer's GEMMs to all later ones, so pairs
    grow with the square of the layers; their work no longer does."""
    position: dict[int, int]
    bits: list[int]
    # The other way: ``above[v]`` has bit ``position[x]`` set when barrier x reaches v.
    above: list[int] = field(default_factory=list)
    holdable: dict[int, bool] = field(default_factory=dict)   # node -> ``_holdable``
    # A first GEMM's result node -> its last candidate second GEMM (bounds ``walk``).
    limits: dict[int, int] = field(default_factory=dict)
    # start -> (descendants reached without walking through a barrier, barriers among them)
    walks: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)
    dots: dict[int, object] = field(default_factory=dict)    # node -> _Dot or its refusal

    @staticmethod
    def of(graph: OpGraph) -> "_ChainSearch":
        position = {n.id: i for i, n in enumerate(
            n for n in graph.nodes if n.op_class in _BARRIERS)}
        bits = [0] * len(graph.nodes)
        for node in reversed(graph.nodes):
            reach = 0
            for u in node.users:
                reach |= bits[u]
                at = position.get(u)
                if at is not None:
                    reach |= 1 << at
            bits[node.id] = reach
        above = [0] * len(graph.nodes)
        for node in graph.nodes:
            reached = 0
            for o in node.operands:
                reached |= above[o]
                at = position.get(o)
                if at is not None:
                    reached |= 1 << at
            above[node.id] = reached
        return _ChainSearch(position, bits, above)

    def reaches(self, v: int, barrier: int) -> bool:
        return bool(self.bits[v] >> self.position[barrier] & 1)

    def gemm(self, graph: OpGraph, nid: int) -> "_Dot":
        """``_describe_gemm`` + ``_finish_result`` of ``nid`` (its refusal re-raised), once
        per node: a GEMM is a candidate of many pairs. A copy: the recognizer's own."""
        got = self.dots.get(nid)
        if got is None:
            try:
                got = _describe_gemm(graph, nid)
                _finish_result(graph, got)
            except _NotAChain as why:
                got = why
            self.dots[nid] = got
        if isinstance(got, _NotAChain):
            raise _NotAChain(str(got))
        return dataclasses.replace(got, lb=list(got.lb), lc=list(got.lc), rb=list(got.rb),
                                   rc=list(got.rc),
                                   split=None if got.split is None else list(got.split))

    def second_candidates(self, graph: OpGraph, first: int) -> list[int]:
        """The GEMMs a chain from ``first`` may end at, nearest first: those reached from it
        through values a chain can hold between its GEMMs (``_holdable`` ops of tile, row
        or scalar size, and the first GEMM's own result ops) that no GEMM or opaque op met
        on the way reaches (the walk stops at both). Every other pair is refused by
        ``_Recognizer.run``; walking through every op instead made the pairs grow with the
        square of the layers."""
        try:
            d1 = self.gemm(graph, first)
            # A value between is a tile (the first result's count), a row or a scalar.
            tile = graph.nodes[d1.result].shape.num_elements
            n = math.prod(d1.rhs_shape.dims[d] for d in _free(d1.rhs_shape, d1.rb, d1.rc))
        except (_NotAChain, KeyError, ValueError, IndexError, TypeError, ZeroDivisionError):
            # No description: every pair is refused the same way; keep the plain walk.
            return _second_candidates(graph, first)
        passable = set(d1.extra)
        counts = {tile, 1} | ({tile // n} if n and tile % n == 0 else set())
        found: list[int] = []
        # Barriers the walk meets (bits by ``position``). One that reaches a node sits
        # between the first GEMM and every GEMM past that node (``nodes_between`` refuses
        # the pair): in a residual stream the next layer's GEMM, which reaches all later
        # ones, so the walk stops there. In id order, so such a barrier is met first.
        met = 0
        heap = list(graph.nodes[first].users)
        heapq.heapify(heap)
        seen = set(heap)
        while heap:
            v = heapq.heappop(heap)
            if self.above[v] & met:
                continue
            node = graph.nodes[v]
            if node.op_class in _BARRIERS:
                met |= 1 << self.position[v]
                if node.op_class is OpClass.COMPUTE:
                    found.append(v)
                continue
            if v not in passable and not (self.is_holdable(node)
                                          and node.shape.num_elements in counts):
                continue
            for u in node.users:
                if u not in seen:
                    seen.add(u)
                    heapq.heappush(heap, u)
        if found:
            self.limits[d1.result] = max(self.limits.get(d1.result, -1), found[-1])
        return found

    def is_holdable(self, node) -> bool:
        got = self.holdable.get(node.id)
        if got is None:
            got = self.holdable[node.id] = _holdable(node)
        return got

    def walk(self, graph: OpGraph, start: int) -> tuple[list[int], list[int]]:
        """Descendants of ``start`` reached without going through a barrier (barriers
        included, not walked through), and the barriers among them; once per start. Up to
        the last second GEMM ``second_candidates`` found for the first GEMM (``limits``):
        nothing past it is between that GEMM and any of its candidates."""
        got = self.walks.get(start)
        if got is None:
            limit = self.limits.get(start, len(graph.nodes))
            seen: set[int] = set()
            barriers: list[int] = []
            stack = [start]
            while stack:
                v = stack.pop()
                for u in graph.nodes[v].users:
                    if u not in seen and u <= limit:
                        seen.add(u)
                        if graph.nodes[u].op_class in _BARRIERS:
                            barriers.append(u)
                        else:
                            stack.append(u)
            got = self.walks[start] = (sorted(seen), barriers)
        return got


def _find(graph: OpGraph) -> list[GemmChain]:
    chains: list[GemmChain] = []
    taken: set[int] = set()
    reach = _ChainSearch.of(graph)
    for node in graph.nodes:
        if node.op_class is not OpClass.COMPUTE or node.id in taken:
            continue
        for second in reach.second_candidates(graph, node.id):
            if second in taken:
                continue
            try:
                chain = _Recognizer(graph, node.id, second, reach).run()
            except _NotAChain as why:
                log.debug("%s: %s -> %s is not a GEMM chain: %s", graph.name, node.name,
                          graph.nodes[second].name, why)
                continue
            except (KeyError, ValueError, IndexError, TypeError, ZeroDivisionError) as exc:
                # An HLO form the recognizer does not expect (odd attributes or configs):
                # no chain, never a failed plan.
                log.warning("%s: %s -> %s: GEMM chain recognition failed (%s: %s); "
                            "treated as no chain", graph.name, node.name,
                            graph.nodes[second].name, type(exc).__name__, exc)
                continue
            if taken & set(chain.members):
                log.debug("%s: chain %s -> %s overlaps an earlier chain", graph.name,
                          node.name, graph.nodes[second].name)
                continue
            chains.append(chain)
            taken.update(chain.members)
            break
    return chains


def chain_of(graph: OpGraph, members: tuple[int, ...]) -> GemmChain | None:
    """The chain if exactly these members form one (what the planner and lowering ask).
    Free nodes (bitcasts) and constants may be left out of ``members`` or added."""
    wanted = set(members)
    for chain in find_gemm_chains(graph):
        if set(chain.members) == wanted:
            return chain
        if _core(graph, chain.members) == _core(graph, wanted):
            return chain
    return None


def _core(graph: OpGraph, ids) -> set[int]:
    return {i for i in ids if not graph.is_free(i)}


def _second_candidates(graph: OpGraph, first: int) -> list[int]:
    """COMPUTE nodes reachable from ``first`` through non-COMPUTE nodes, nearest first."""
    found: list[int] = []
    stack = list(graph.nodes[first].users)
    seen = set(stack)
    while stack:
        v = stack.pop()
        node = graph.nodes[v]
        if node.op_class is OpClass.COMPUTE:
            found.append(v)
            continue
        if node.op_class is OpClass.OPAQUE:
            continue
        for u in node.users:
            if u not in seen:
                seen.add(u)
                stack.append(u)
    return sorted(found)


def _holdable(node) -> bool:
    """Can ``node`` sit between a chain's GEMMs? What ``_Recognizer.translate`` refuses
    whatever the dims: another opcode, element type or a non-row-major layout."""
    shape = node.shape
    return (node.opcode in _HELD_OPCODES and shape.is_array
            and shape.element_type in _HELD_TYPES and _row_major(shape))


# ---------------------------------------------------------------------------- shapes


def _row_major(shape: Shape) -> bool:
    return shape.minor_to_major() == tuple(range(shape.rank - 1, -1, -1))


def _strides(dims: tuple[int, ...]) -> list[int]:
    out = [1] * len(dims)
    for i in range(len(dims) - 2, -1, -1):
        out[i] = out[i + 1] * dims[i + 1]
    return out


def _prefix_points(dims: tuple[int, ...], rows: int) -> list[int]:
    """Every j with prod(dims[:j]) == rows."""
    return [j for j in range(len(dims) + 1) if math.prod(dims[:j]) == rows]


def _live(dims: tuple[int, ...], among) -> list[int]:
    return [d for d in among if dims[d] != 1]


# ---------------------------------------------------------------------------- GEMMs


@dataclass
class _Dot:
    """A GEMM as a dot: operand shapes and dimension numbers, where its operands and its
    epilogue live, and the node holding its (split-K reduced) result."""
    node: int
    inst: Instruction                   # the dot (or the custom call)
    comp: Computation | None            # the GEMM fusion's computation
    lhs_shape: Shape
    rhs_shape: Shape
    lb: list[int]
    lc: list[int]
    rb: list[int]
    rc: list[int]
    alpha: float = 1.0
    split: list[int] | None = None      # positions of the batch dims a split-K reduce sums
    result: int = -1                    # node of the array result (after gte / reduce)
    extra: tuple[int, ...] = ()         # gte / split reduce / bitcasts up to the reduce

    def out_dims(self) -> list[int]:
        batch = [self.lhs_shape.dims[d] for d in self.lb]
        lf = [self.lhs_shape.dims[d] for d in _free(self.lhs_shape, self.lb, self.lc)]
        rf = [self.rhs_shape.dims[d] for d in _free(self.rhs_shape, self.rb, self.rc)]
        return batch + lf + rf


def _free(shape: Shape, batch: list[int], contract: list[int]) -> list[int]:
    return [d for d in range(shape.rank) if d not in batch and d not in contract]


def _dims_from(numbers: dict, key: str) -> list[int]:
    return [int(x) for x in numbers.get(key, [])]


def _describe_gemm(graph: OpGraph, nid: int) -> _Dot:
    node = graph.nodes[nid]
    inst = node.instruction
    if node.opcode == "dot":
        dot, comp = inst, None
        lhs, rhs = graph.nodes[node.operands[0]].shape, graph.nodes[node.operands[1]].shape
    elif node.opcode == "fusion":
        comp = graph.computations.get(inst.called_computations[0]) if \
            inst.called_computations else None
        if comp is None:
            raise _NotAChain(f"{node.name}: its computation is unknown to the graph")
        dots = [i for i in comp.instructions if i.opcode == "dot"]
        if len(dots) != 1:
            raise _NotAChain(f"{node.name}: {len(dots)} dots in the GEMM fusion")
        dot = dots[0]
        names = comp.by_name()
        lhs, rhs = names[dot.operands[0]].shape, names[dot.operands[1]].shape
    elif node.opcode == "custom-call":
        cfg = inst.backend_config.get("gemm_backend_config")
        if not isinstance(cfg, dict) or len(node.operands) != 2:
            raise _NotAChain(f"{node.name}: not a plain two-operand cuBLAS GEMM")
        if float(cfg.get("beta", 0) or 0) != 0 or cfg.get("epilogue", "DEFAULT") != "DEFAULT":
            raise _NotAChain(f"{node.name}: cuBLAS beta/epilogue")
        if float(cfg.get("alpha_imag", 0) or 0) != 0:
            raise _NotAChain(f"{node.name}: complex alpha")
        numbers = cfg.get("dot_dimension_numbers", {})
        d = _Dot(nid, inst, None, graph.nodes[node.operands[0]].shape,
                 graph.nodes[node.operands[1]].shape,
                 _dims_from(numbers, "lhs_batch_dimensions"),
                 _dims_from(numbers, "lhs_contracting_dimensions"),
                 _dims_from(numbers, "rhs_batch_dimensions"),
                 _dims_from(numbers, "rhs_contracting_dimensions"),
                 alpha=float(cfg.get("alpha_real", 1.0)))
        return d
    else:
        raise _NotAChain(f"{node.name}: {node.opcode} is not a GEMM")
    return _Dot(nid, dot, comp, lhs, rhs, list(dot.ints("lhs_batch_dims", ())),
                list(dot.ints("lhs_contracting_dims", ())),
                list(dot.ints("rhs_batch_dims", ())), list(dot.ints("rhs_contracting_dims", ())))


def _allows_tf32(d: _Dot) -> bool:
    return allows_tf32(d.inst)


def allows_tf32(inst: Instruction) -> bool:
    """XLA may run this GEMM's (a ``dot`` or a cuBLAS custom call) f32 operands on TF32
    tensor cores (sm_80+): no operand asks for HIGHEST precision (DEFAULT and HIGH allow
    TF32, as jax's default precision does) and it names no algorithm other than TF32's."""
    if inst.opcode == "custom-call":
        cfg = inst.backend_config.get("gemm_backend_config", {})
        config = cfg.get("precision_config", {}) if isinstance(cfg, dict) else {}
        config = config if isinstance(config, dict) else {}
        precisions = [str(p) for p in config.get("operand_precision", [])]
        algorithm = str(config.get("algorithm", ""))
    else:
        precisions = str(inst.attrs.get("operand_precision", "")).strip("{}").split(",")
        algorithm = str(inst.attrs.get("algorithm", ""))
    if any(p.strip().lower() == "highest" for p in precisions):
        return False
    return algorithm.lower().removeprefix("alg_").removeprefix("dot_") in (
        "", "unset", "tf32_tf32_f32")


def _through_renames(graph: OpGraph, nid: int) -> tuple[int, list[int]]:
    """The node a chain of free row-major bitcasts/reshapes starts from, and those nodes."""
    chain: list[int] = []
    while True:
        node = graph.nodes[nid]
        if node.opcode in ("bitcast", "reshape") and graph.is_free(nid) and node.operands:
            src = graph.nodes[node.operands[0]].shape
            if not (_row_major(src) and _row_major(node.shape)):
                break
            chain.append(nid)
            nid = node.operands[0]
            continue
        break
    return nid, chain


def _finish_result(graph: OpGraph, d: _Dot) -> None:
    """Find the array result of GEMM ``d``: through a gte of a custom call's tuple, then a
    split-K reduce (an add-reduce over batch dims of the dot only) if one follows."""
    node = graph.nodes[d.node]
    result, extra = d.node, []
    if node.shape.is_tuple:
        gtes = [u for u in node.users if graph.nodes[u].opcode == "get-tuple-element"
                and graph.nodes[u].instruction.int("index", 0) == 0]
        if len(gtes) != 1:
            raise _NotAChain(f"{node.name}: its result is not read through one gte")
        result = gtes[0]
        extra.append(result)
    shape = graph.nodes[result].shape
    if not _row_major(shape):
        raise _NotAChain(f"{node.name}: result layout is not row-major")
    users = graph.nodes[result].users
    if len(users) == 1 and graph.nodes[users[0]].opcode == "reduce" and d.lb:
        red = graph.nodes[users[0]]
        dims = set(red.instruction.ints("dimensions", ()))
        if dims and dims <= set(range(len(d.lb))) and _reducer(graph, red.instruction) == "add" \
                and _constant_value(graph, red.operands[1]) == 0.0 and len(red.operands) == 2:
            d.split = sorted(dims)
            result = red.id
            extra.append(red.id)
    d.result, d.extra = result, tuple(extra)


def _reducer(graph: OpGraph, inst: Instruction) -> str | None:
    """The reducer of a reduce: add / maximum / minimum / multiply of its two parameters."""
    names = inst.called_computations
    comp = graph.computations.get(names[0]) if names else None
    if comp is None:
        return None
    root = comp.root
    params = {p.name for p in comp.parameters}
    if root.opcode in REDUCERS and len(root.operands) == 2 and set(root.operands) == params:
        return root.opcode
    return None


def _constant_value(graph: OpGraph, nid: int) -> float | None:
    node = graph.nodes[nid]
    if node.opcode != "constant":
        return None
    return _literal_scalar(node.instruction, node.shape)


def _literal_scalar(inst: Instruction, shape: Shape) -> float | None:
    if shape.is_tuple or shape.num_elements != 1 or inst.literal is None:
        return None
    text = inst.literal.strip().strip("{}").strip()
    try:
        if text in ("true", "false"):
            return 1.0 if text == "true" else 0.0
        return float(text)
    except ValueError:
        return None


def _groups(d: _Dot, side: str) -> tuple[list[int], list[int], list[int]]:
    """(batch, free, contract) dims of one operand, split-K dims moved into contract."""
    shape, batch, contract = ((d.lhs_shape, d.lb, d.lc) if side == "lhs"
                              else (d.rhs_shape, d.rb, d.rc))
    split = d.split or []
    kept = [x for i, x in enumerate(batch) if i not in split]
    moved = [x for i, x in enumerate(batch) if i in split]
    return kept, _free(shape, batch, contract), moved + list(contract)


# A value's element index along one dim as mixed-radix digits (size, stride), major first:
# index i of a dim with digits ((s1, t1), (s2, t2)) lies at (i // s2) * t1 + (i % s2) * t2.
Digits = tuple[tuple[int, int], ...]


def _row_major_digits(dims: tuple[int, ...]) -> list[Digits]:
    return [((d, st),) for d, st in zip(dims, _strides(dims))]


def _view(node: int, shape: Shape, batch: list[int], rows: list[int], cols: list[int]
          ) -> tuple[OperandView, tuple[int, int, int]]:
    """The view of a row-major value read directly (the second GEMM's lhs)."""
    if not _row_major(shape):
        raise _NotAChain("operand layout is not row-major")
    return _strided_view(node, shape.dims, _row_major_digits(shape.dims), batch, rows, cols)


_MOVES = frozenset({"bitcast", "reshape", "copy", "transpose", "broadcast"})


def _regroup(src: list[Digits], dims: tuple[int, ...]) -> list[Digits] | None:
    """The digits of a reshape to ``dims`` of a value with digits ``src`` (row-major
    element order), splitting a digit where a new dim takes its major part; None when a
    dim would need part of a digit that does not divide."""
    atoms = [a for d in src for a in d if a[0] != 1]
    out: list[Digits] = []
    for size in dims:
        need, digits = size, []
        while need > 1:
            if not atoms:
                return None
            s, t = atoms[0]
            if need % s == 0:
                digits.append((s, t))
                atoms.pop(0)
                need //= s
            elif s % need == 0:
                digits.append((need, t * (s // need)))
                atoms[0] = (s // need, t)
                need = 1
            else:
                return None
        out.append(tuple(digits) or ((1, 0),))
    return None if atoms else out


def _strided(graph: OpGraph, nid: int, allowed: set[int]) -> tuple[int, list[Digits], list[int]]:
    """(root, digits, moved): the value of node ``nid`` read straight from the row-major
    buffer of ``root`` (per dim, ``Digits`` into it), looking through bitcasts, reshapes,
    copies, transposes and broadcasts whose users are all ``allowed`` (``moved``: those
    ops; a chain kernel absorbs them instead of reading their result)."""
    node = graph.nodes[nid]
    dims = node.shape.dims
    here = (nid, _row_major_digits(dims), [])
    if node.opcode not in _MOVES or len(node.operands) != 1 or not node.shape.is_array \
            or any(u not in allowed for u in node.users):
        return here
    src = node.operands[0]
    src_shape = graph.nodes[src].shape
    if not src_shape.is_array:
        return here
    root, digits, moved = _strided(graph, src, allowed | {nid})
    moved = moved + [nid]
    if node.opcode in ("bitcast", "reshape"):
        if node.opcode == "bitcast" and not (_row_major(src_shape) and _row_major(node.shape)):
            return here
        regrouped = _regroup(digits, dims)
        return here if regrouped is None else (root, regrouped, moved)
    if node.opcode == "copy":
        return root, digits, moved
    if node.opcode == "transpose":
        return root, [digits[p] for p in node.instruction.ints("dimensions")], moved
    table = list(node.instruction.ints("dimensions", ()))
    return root, [digits[table.index(d)] if d in table else ((dims[d], 0),)
                  for d in range(len(dims))], moved


def _runs(digits: list[Digits], group: list[int]) -> list[tuple[int, int]]:
    """The digits of the dims ``group`` (major first) read as one index, neighbours that
    form one strided run merged."""
    out: list[tuple[int, int]] = []
    for d in group:
        for size, stride in digits[d]:
            if size == 1:
                continue
            if out and out[-1][1] == stride * size:
                out[-1] = (out[-1][0] * size, stride)
            else:
                out.append((size, stride))
    return out


def _strided_view(node: int, dims: tuple[int, ...], digits: list[Digits], batch: list[int],
                  rows: list[int], cols: list[int]) -> tuple[OperandView, tuple[int, int, int]]:
    sizes = tuple(math.prod(dims[d] for d in g) for g in (batch, rows, cols))
    row_cols = []
    for g in (rows, cols):
        runs = _runs(digits, g)
        if len(runs) > 1:
            raise _NotAChain(f"dims {g} of {list(dims)} are not one strided run")
        row_cols.append(runs[0][1] if runs else 0)
    runs = _runs(digits, batch)
    if len(runs) > 1:
        return OperandView(node, 0, row_cols[0], row_cols[1], tuple(runs)), sizes
    return OperandView(node, runs[0][1] if runs else 0, *row_cols), sizes


# ---------------------------------------------------------------------------- recognizer


class _Recognizer:
    def __init__(self, graph: OpGraph, first: int, second: int,
                 reach: _ChainSearch | None = None):
        self.g = graph
        self.first = first
        self.second = second
        self.reach = reach if reach is not None else _ChainSearch.of(graph)
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
        raise _NotAChain(f"a value of {count} elements is neither a tile, a row nor a scalar")

    def outside(self, nid: int) -> int:
        """An outside value read by the program: a scalar constant, or a buffer."""
        node = self.g.nodes[nid]
        shape = node.shape
        if shape.is_tuple or not shape.is_array:
            raise _NotAChain(f"{node.name}: tuple read by the chain")
        spread = self.spread_constant(nid)
        if spread is not None:
            value, nodes = spread
            # A scalar constant (or its broadcast) only the chain reads joins the chain.
            for v in nodes:
                if all(u in self.members for u in self.g.nodes[v].users):
                    self.members.add(v)
            return self.add(ChainOp("const", "scalar", shape.element_type, value=value))
        rank = self.rank_of(shape)
        root, digits, moved = _strided(self.g, nid, self.members)
        if not self.g.nodes[root].shape.is_array or not _row_major(self.g.nodes[root].shape):
            raise _NotAChain(f"{node.name}: outside operand layout is not row-major")
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
        for j1 in _prefix_points(dims, b):
            ends = _prefix_points(dims, b * m) if rank == "tile" else [len(dims)]
            for j2 in (j for j in ends if j >= j1):
                try:
                    view, _ = _strided_view(root, dims, digits, everything[:j1],
                                            everything[j1:j2], everything[j2:])
                    return view
                except _NotAChain:
                    continue
        raise _NotAChain(f"a {rank} value over {list(dims)} is not [batch, m, n] strided")

    def index_value(self, nid: int, view: OperandView, rank: str, nodes: set[int]
                    ) -> tuple[int, set[int]] | None:
        """(program value, nodes) when ``nid`` is computed from iotas and scalar constants
        by element ops on its own shape (XLA's causal mask: compare(iota, iota)), each
        element at ``view``'s offset into ``nid``'s row-major buffer; else None."""
        node = self.g.nodes[nid]
        shape = node.shape
        if not shape.is_array or not _row_major(shape):
            return None
        if node.opcode == "iota":
            d = node.instruction.int("iota_dimension", 0)
            nodes.add(nid)
            return self.add(ChainOp("iota", rank, shape.element_type, view=view,
                                    period=(_strides(shape.dims)[d], shape.dims[d]))), nodes
        spread = self.spread_constant(nid)
        if spread is not None:
            nodes.update(spread[1])
            return self.add(ChainOp("const", "scalar", shape.element_type,
                                    value=spread[0])), nodes
        if node.opcode == "broadcast" and shape.element_type in _INDEX_INPUT_TYPES:
            # Integer row (or column) values spread over the tile, compared with an iota: a
            # cross-entropy gradient's one-hot of the labels. Read from their own buffer.
            root, digits, moved = _strided(self.g, nid, self.members | set(node.users))
            if self.g.nodes[root].shape.num_elements >= shape.num_elements or \
                    not _row_major(self.g.nodes[root].shape):
                return None
            try:
                spread = self.value_view(root, shape.dims, digits, rank)
            except _NotAChain:
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

    def spread_constant(self, nid: int) -> tuple[float, list[int]] | None:
        """(value, nodes) when ``nid`` is a scalar constant or broadcasts / renames of one
        (``nodes``: those ops, outermost first)."""
        nodes: list[int] = []
        while True:
            node = self.g.nodes[nid]
            nodes.append(nid)
            value = _constant_value(self.g, nid)
            if value is not None:
                return value, nodes
            if node.opcode not in ("broadcast", *_RENAMES) or len(node.operands) != 1:
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
        if not shape.is_array or shape.element_type not in _HELD_TYPES:
            raise _NotAChain(f"{name}: element type {shape.element_type}")
        if not _row_major(shape):
            raise _NotAChain(f"{name}: layout is not row-major")
        rank = self.rank_of(shape)
        if op in _RENAMES:
            if not _row_major(arg_shapes[0]) or arg_shapes[0].element_type != shape.element_type:
                raise _NotAChain(f"{name}: {op} moves data")
            return args[0]
        if op == "constant":
            value = _literal_scalar(inst, shape)
            if value is None:
                raise _NotAChain(f"{name}: a non-scalar constant inside a GEMM fusion")
            return self.add(ChainOp("const", "scalar", shape.element_type, value=value))
        if op == "broadcast":
            self.check_broadcast(inst, shape, arg_shapes[0])
            return args[0]
        if op == "reduce":
            return self.translate_reduce(inst, shape, args, arg_shapes)
        if op not in ELEMENTWISE_OPS:
            raise _NotAChain(f"{name}: {op} is not an element op a chain holds")
        order = {"scalar": 0, "row": 1, "tile": 2}
        arg_rank = max((self.ops[a].rank for a in args), key=order.__getitem__)
        if order[arg_rank] > order[rank]:
            raise _NotAChain(f"{name}: {op} of {arg_rank} values gives a {rank}")
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
        if mapped != sorted(mapped) or not _row_major(src):
            raise _NotAChain(f"{inst.name}: broadcast reorders dims")
        if src.num_elements == shape.num_elements:
            return                      # adds unit dims only: a rename
        b, m, _ = self.dims
        if self.rank_of(src) == "row" and self.rank_of(shape) == "tile":
            for j in _prefix_points(out, b * m):
                if mapped == _live(out, range(j)):
                    return
        raise _NotAChain(f"{inst.name}: broadcast does not spread rows along n")

    def translate_reduce(self, inst: Instruction, shape: Shape, args: list[int],
                         arg_shapes: list[Shape]) -> int:
        if len(args) != 2 or self.ops[args[1]].kind != "const":
            raise _NotAChain(f"{inst.name}: a variadic reduce or one without a constant init")
        reducer = _reducer(self.g, inst)
        if reducer is None:
            raise _NotAChain(f"{inst.name}: reducer is not add/max/min/multiply")
        src = arg_shapes[0]
        if self.rank_of(src) != "tile" or self.rank_of(shape) != "row":
            raise _NotAChain(f"{inst.name}: reduce is not over the rows' n")
        dims = set(inst.ints("dimensions", ()))
        b, m, _ = self.dims
        for j in _prefix_points(src.dims, b * m):
            if set(_live(src.dims, range(j, src.rank))) <= dims <= set(range(j, src.rank)):
                return self.add(ChainOp("reduce", "row", shape.element_type, reducer,
                                        (args[0],), value=self.ops[args[1]].value))
        raise _NotAChain(f"{inst.name}: reduce dims {sorted(dims)} are not n")

    def fusion_values(self, d: _Dot, graph_args: list[int | None], upto: str | None,
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

    # --- the chain ----------------------------------------------------------------------
    def run(self) -> GemmChain:
        g = self.g
        d1 = self.reach.gemm(g, self.first)
        d2 = self.reach.gemm(g, self.second)
        if d1.alpha != 1.0 and d1.split:
            raise _NotAChain("a scaled split-K first GEMM")
        dtype = d1.lhs_shape.element_type
        if dtype not in GEMM_DTYPES or {d1.rhs_shape.element_type, d2.rhs_shape.element_type,
                                       d2.lhs_shape.element_type} - {dtype, "f32"}:
            raise _NotAChain(f"GEMM operand types {dtype}/{d1.rhs_shape.element_type}/"
                             f"{d2.rhs_shape.element_type}")

        # First GEMM: A [b, m, k], B [b, k, n] over the nodes its operands rename.
        lb, lf, lk = _groups(d1, "lhs")
        rb, rf, rk = _groups(d1, "rhs")
        a_node, a_digits, a_renames = self.gemm_operand(d1, 0)
        b_node, b_digits, b_renames = self.gemm_operand(d1, 1)
        a, (batch, m, k) = _strided_view(a_node, d1.lhs_shape.dims, a_digits, lb, lf, lk)
        b, (batch_b, k_b, n) = _strided_view(b_node, d1.rhs_shape.dims, b_digits, rb, rk, rf)
        if (batch, k) != (batch_b, k_b):
            raise _NotAChain("first GEMM operands disagree on batch / contraction")
        self.dims = (batch, m, n)
        result = g.nodes[d1.result]
        if self.rank_of(result.shape) != "tile":
            raise _NotAChain("first GEMM result is not [batch, m, n]")

        # Nodes strictly between the two GEMMs (on paths from the first one's result).
        between = self.nodes_between(d1.result, d2)
        self.members = {self.first, *d1.extra, *between, self.second, *d2.extra,
                        *a_renames, *b_renames}
        if d2.comp is None:
            self.members.update(self.rename_members(d2, 0))

        # The program: the first GEMM's sum, its fusion epilogue / cuBLAS alpha...
        dot_type = next(iter(d1.inst.shape.leaves())).element_type
        acc = self.add(ChainOp("acc", "tile", dot_type))
        if d1.comp is not None and not d1.split:
            vals = self.fusion_values(d1, [None] * len(g.nodes[self.first].operands), None,
                                      {d1.inst.name, *self.dot_operands(d1)})
            vals[d1.inst.name] = acc
            self.epilogue(d1, vals)
            s_value = vals[d1.comp.root.name]
        elif d1.comp is not None and d1.comp.root is not d1.inst:
            raise _NotAChain("a split-K first GEMM with an epilogue")
        else:
            s_value = acc
            if d1.alpha != 1.0:
                scale = self.add(ChainOp("const", "scalar", "f32", value=d1.alpha))
                s_value = self.add(ChainOp("elementwise", "tile", "f32", "multiply",
                                           (acc, scale)))
        self.value_of[d1.result] = s_value
        # ... the graph ops between ...
        for v in sorted(between):
            node = g.nodes[v]
            args = [self.value_of[o] if o in self.value_of else self.outside(o)
                    for o in node.operands]
            self.value_of[v] = self.translate(node.instruction, node.shape, args,
                                              [g.nodes[o].shape for o in node.operands])
        # ... and the second GEMM's lhs (a prologue inside its fusion included).
        p_value, p_shape = self.second_lhs(d2)

        # Second GEMM: P [b, m, n] must be the tile itself, C [b, n, h].
        lb2, lf2, lk2 = _groups(d2, "lhs")
        rb2, rf2, rk2 = _groups(d2, "rhs")
        pview, (batch2, m2, n2) = _view(-1, p_shape, lb2, lf2, lk2)
        if (batch2, m2, n2) != (batch, m, n) or (pview.batch_stride, pview.row_stride,
                                                   pview.col_stride) not in (
                (m * n, n, 1), (0, n, 1)) or (batch > 1 and pview.batch_stride == 0):
            raise _NotAChain("the second GEMM does not contract over the first one's n")
        c_node, c_digits, c_renames = self.gemm_operand(d2, 1)
        c, (batch_c, n_c, h) = _strided_view(c_node, d2.rhs_shape.dims, c_digits, rb2, rk2,
                                             rf2)
        if (batch_c, n_c) != (batch, n):
            raise _NotAChain("second GEMM rhs disagrees on batch / contraction")
        if c_node in self.members or self.depends_on_first(c_node):
            raise _NotAChain("the second GEMM's rhs depends on the first GEMM")
        self.members.update(c_renames)
        out_dims = [x for i, x in enumerate(d2.out_dims()) if i not in (d2.split or [])]
        output = g.nodes[d2.result]
        if math.prod(out_dims) != batch * m * h or output.shape.num_elements != batch * m * h:
            raise _NotAChain("the second GEMM's result is not [batch, m, h]")
        out = OperandView(d2.result, m * h, h, 1)
        if d2.comp is not None and d2.comp.root is not d2.inst:
            raise _NotAChain("an epilogue after the second GEMM")
        if d2.alpha != 1.0 and d2.split:
            raise _NotAChain("a scaled split-K second GEMM")

        # An intermediate value read outside (a training step's backward reads S, the row
        # sums, P) is written by the chain kernel too; constants only the chain reads join it.
        escaping = [v for v in sorted(self.members - {d2.result})
                    if v in g.outputs or any(u not in self.members for u in g.nodes[v].users)]
        inputs = list(dict.fromkeys([a_node, b_node, c_node, *self.inputs]))
        if set(inputs) & self.members:
            raise _NotAChain("a chain input is computed inside the chain")
        if not g.is_convex(self.members):
            raise _NotAChain("the chain is not convex")
        extra_values = [self.escaping_value(v) for v in escaping]
        program, where = self.reordered(p_value, [value for value, _ in extra_values])
        extra_outputs = tuple(
            ChainOutput(v, where[value], program[where[value]].rank,
                        g.nodes[v].shape.element_type, view)
            for v, (value, view) in zip(escaping, extra_values))
        if extra_outputs and softmax_parts(program, through_convert=True) is None:
            # (Written out only around a softmax, the form checked end to end.)
            raise _NotAChain(f"{g.nodes[escaping[0]].name} is also read outside a chain "
                             f"without a softmax")
        return GemmChain(
            members=tuple(sorted(self.members)), first=self.first, second=self.second,
            batch=batch, m=m, n=n, k=k, h=h, operand_dtype=dtype,
            softmax=softmax_parts(program) is not None,
            between=tuple(sorted(v for v in between
                                 if g.nodes[v].op_class is not OpClass.SOURCE)),
            inputs=tuple(inputs), output=d2.result, a=a, b=b, c=c, out=out,
            program=program, output_dtype=output.shape.element_type, output_scale=d2.alpha,
            tf32=_allows_tf32(d1) and _allows_tf32(d2), extra_outputs=extra_outputs)

    def escaping_value(self, v: int) -> tuple[int, OperandView]:
        """(program value, view) of member ``v`` read outside the chain: a tile or row
        value the program computes, in its own row-major buffer (the kernel writes it)."""
        node = self.g.nodes[v]
        value = self.value_of.get(v)
        shape = node.shape
        if value is None or not shape.is_array:
            raise _NotAChain(f"{node.name} is also read outside the chain")
        rank = self.rank_of(shape)
        op = self.ops[value]
        if rank == "scalar" or op.rank != rank or op.dtype != shape.element_type \
                or shape.element_type == "pred" or not _row_major(shape):
            raise _NotAChain(f"{node.name} is also read outside the chain, as a "
                             f"{rank} value the kernel cannot write")
        return value, self.value_view(v, shape.dims, _row_major_digits(shape.dims), rank)

    def reordered(self, last: int, keep: list[int] | tuple[int, ...] = ()
                  ) -> tuple[tuple[ChainOp, ...], dict[int, int]]:
        """The program with ``last`` moved to the end, the values ``keep`` kept (ops
        neither needs dropped); and old -> new program indices."""
        need: set[int] = set()
        stack = [*keep, last]
        while stack:
            i = stack.pop()
            if i not in need:
                need.add(i)
                stack.extend(self.ops[i].args)
        need.discard(last)
        order = sorted(need, key=lambda i: (i > last, i))
        if any(last in _ancestors(tuple(self.ops), i) for i in order if i > last):
            raise _NotAChain("a value read outside the chain is computed from P")
        order.append(last)
        where = {old: new for new, old in enumerate(order)}
        return tuple(ChainOp(op.kind, op.rank, op.dtype, op.opcode,
                             tuple(where[a] for a in op.args), op.value, op.view, op.direction,
                             op.period)
                     for op in (self.ops[i] for i in order)), where

    def dot_operands(self, d: _Dot) -> set[str]:
        return set(d.inst.operands)

    def epilogue(self, d: _Dot, vals: dict[str, int]) -> None:
        """Translate the fusion ops after the dot (vals already maps the dot to acc)."""
        comp = d.comp
        shapes = {i.name: i.shape for i in comp.instructions}
        for inst in comp.post_order():
            if inst.name in vals or inst.opcode == "parameter":
                continue
            if all(o in vals for o in inst.operands):
                vals[inst.name] = self.translate(inst, inst.shape,
                                                 [vals[o] for o in inst.operands],
                                                 [shapes[o] for o in inst.operands])
        if comp.root.name not in vals:
            raise _NotAChain(f"{comp.name}: the GEMM fusion's root does not follow the dot")

    def gemm_operand(self, d: _Dot, which: int) -> tuple[int, list[Digits], list[int]]:
        """(root, digits, moved ops) of operand ``which`` of GEMM ``d`` (see _strided)."""
        node = self.g.nodes[d.node]
        if d.comp is None:
            nid = node.operands[which]
        else:
            names = d.comp.by_name()
            inst = names[d.inst.operands[which]]
            if inst.opcode != "parameter":
                raise _NotAChain(f"{node.name}: operand {which} is computed in the fusion")
            nid = node.operands[inst.parameter_number]
        root, digits, moved = _strided(self.g, nid, {d.node})
        if not self.g.nodes[root].shape.is_array or not _row_major(self.g.nodes[root].shape):
            raise _NotAChain(f"{node.name}: operand {which} layout is not row-major")
        return root, digits, moved

    def rename_members(self, d: _Dot, which: int) -> list[int]:
        node = self.g.nodes[d.node]
        _, renames = _through_renames(self.g, node.operands[which])
        return renames

    def nodes_between(self, start: int, d2: _Dot) -> set[int]:
        """Nodes strictly between ``start`` and the second GEMM: descendants of ``start``
        that reach it. A GEMM or an opaque op among them refuses the chain.

        The walk from ``start`` takes a GEMM or opaque op but does not go through it; which
        nodes reach the second GEMM comes from ``_ChainSearch``. The same set and verdict
        as walking every path both ways: a path through such an op to the second GEMM has a
        first such op, which is taken and reaches it (refused); without one every path
        between avoids them. Walking every path cost the forward pass's GEMMs a walk over
        much of the backward pass for each far candidate (quadratic in layers)."""
        g = self.g
        second = self.second
        below, barriers = self.reach.walk(g, start)
        if any(x < second and self.reach.reaches(x, second) for x in barriers):
            raise _NotAChain("a GEMM or an opaque op sits between")
        # (A node is smaller than every node it reaches: those past the second GEMM cannot.)
        between = {v for v in below[:bisect.bisect_left(below, second)]
                   if self.reach.reaches(v, second)}
        if not any(o in between or o == start for o in g.nodes[self.second].operands):
            raise _NotAChain("the second GEMM does not read the first one's result")
        return between

    def depends_on_first(self, nid: int) -> bool:
        stack = [nid]
        seen: set[int] = set()
        while stack:
            v = stack.pop()
            if v == self.first:
                return True
            if v in seen or v < self.first:
                continue
            seen.add(v)
            stack.extend(self.g.nodes[v].operands)
        return False

    def second_lhs(self, d2: _Dot) -> tuple[int, Shape]:
        """The program value the second GEMM's lhs reads, and the shape the dot sees."""
        g = self.g
        node = g.nodes[self.second]
        if d2.comp is None:
            lhs = node.operands[0]
            if lhs not in self.value_of:
                raise _NotAChain("the second GEMM's lhs is not computed from the first GEMM")
            return self.value_of[lhs], d2.lhs_shape
        names = d2.comp.by_name()
        rhs_param = names[d2.inst.operands[1]]
        if rhs_param.opcode != "parameter":
            raise _NotAChain("the second GEMM's rhs is computed in its fusion")
        args: list[int | None] = []
        for k, o in enumerate(node.operands):
            if k == rhs_param.parameter_number:
                args.append(self.add(ChainOp("const", "scalar", "f32", value=0.0)))
            elif o in self.value_of:
                args.append(self.value_of[o])
            else:
                args.append(None)
        vals = self.fusion_values(d2, args, d2.inst.operands[0], {d2.inst.name})
        lhs = d2.inst.operands[0]
        if lhs not in vals:
            raise _NotAChain("the second GEMM's lhs prologue could not be followed")
        return vals[lhs], names[lhs].shape


# ---------------------------------------------------------------------------- softmax


@dataclass(frozen=True)
class SoftmaxParts:
    """P = divide(E, sum_n E) with E = exp(X - max_n X): program indices of each part."""
    x: int
    row_max: int
    e: int
    row_sum: int
    p: int


def softmax_parts(program: tuple[ChainOp, ...], through_convert: bool = False
                  ) -> SoftmaxParts | None:
    """The row softmax the program ends in, or None (see ``SoftmaxParts``).
    ``through_convert``: also one whose P is converted last (bf16 attention's
    ``convert(divide(E, sum))``; ``p`` is then the divide)."""
    if not program:
        return None
    p = len(program) - 1
    last = program[p]
    if through_convert and last.kind == "elementwise" and last.opcode == "convert":
        p = last.args[0]
        last = program[p]
    if last.kind != "elementwise" or last.opcode != "divide":
        return None
    e, row_sum = last.args
    s = program[row_sum]
    if s.kind != "reduce" or s.opcode != "add" or s.args != (e,) or s.value != 0.0:
        return None
    ex = program[e]
    if ex.kind != "elementwise" or ex.opcode != "exponential":
        return None
    sub = program[ex.args[0]]
    if sub.kind != "elementwise" or sub.opcode != "subtract":
        return None
    x, row_max = sub.args
    mx = program[row_max]
    if mx.kind != "reduce" or mx.opcode != "maximum" or mx.args != (x,) \
            or mx.value != float("-inf"):
        return None
    if any(program[i].kind == "reduce" for i in _ancestors(program, x)):
        return None
    return SoftmaxParts(x, row_max, e, row_sum, p)


def needs_row_pass(chain: GemmChain) -> bool:
    """Whether a tile value the kernel writes out needs a row reduction's final value (P of
    a training step's softmax): the kernel then computes the rows' statistics in a pass
    over n first and writes exact values in the second, instead of online-softmax running
    ones. Row values (the row sums) and tiles before the reductions (S) are exact in one
    pass: the online softmax's final max and sum are the rows' max and sum."""
    return any(out.rank == "tile" and any(
        chain.program[i].kind == "reduce" for i in _ancestors(chain.program, out.value))
        for out in chain.extra_outputs)


def _ancestors(program: tuple[ChainOp, ...], i: int) -> set[int]:
    seen: set[int] = set()
    stack = [i]
    while stack:
        j = stack.pop()
        if j not in seen:
            seen.add(j)
            stack.extend(program[j].args)
    return seen
