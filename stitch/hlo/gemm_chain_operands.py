"""GEMMs as the chain recognizer reads them (``stitch.hlo.gemm_chains``): a GEMM node
(dot, GEMM fusion, cuBLAS call) described as a dot with its split-K reduce, its TF32
permission, and values read as strided [batch, rows, cols] views of a row-major buffer through
bitcasts, reshapes, copies, transposes and broadcasts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .gemm_chain_program import REDUCERS, ELEMENTWISE_OPS, NotAChain, OperandView
from .graph import OpGraph
from .ir import Computation, Instruction, Shape

RENAMES = frozenset({"bitcast", "reshape", "copy"})
# What may sit between a chain's GEMMs (``ChainProgramBuilder.translate``).
HELD_OPCODES = ELEMENTWISE_OPS | RENAMES | {"constant", "broadcast", "reduce"}
HELD_TYPES = frozenset({"f32", "bf16", "f16", "pred"})


def holdable(node) -> bool:
    """Can ``node`` sit between a chain's GEMMs? What ``ChainProgramBuilder.translate`` refuses
    whatever the dims: another opcode, element type or a non-row-major layout."""
    shape = node.shape
    return (node.opcode in HELD_OPCODES and shape.is_array
            and shape.element_type in HELD_TYPES and row_major(shape))


# ---------------------------------------------------------------------------- shapes


def row_major(shape: Shape) -> bool:
    return shape.minor_to_major() == tuple(range(shape.rank - 1, -1, -1))


def row_major_strides(dims: tuple[int, ...]) -> list[int]:
    out = [1] * len(dims)
    for i in range(len(dims) - 2, -1, -1):
        out[i] = out[i + 1] * dims[i + 1]
    return out


def prefix_points(dims: tuple[int, ...], rows: int) -> list[int]:
    """Every j with prod(dims[:j]) == rows."""
    return [j for j in range(len(dims) + 1) if math.prod(dims[:j]) == rows]


def live_dims(dims: tuple[int, ...], among) -> list[int]:
    return [d for d in among if dims[d] != 1]


# ---------------------------------------------------------------------------- GEMMs


@dataclass
class GemmDot:
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
        lf = [self.lhs_shape.dims[d] for d in free_dims(self.lhs_shape, self.lb, self.lc)]
        rf = [self.rhs_shape.dims[d] for d in free_dims(self.rhs_shape, self.rb, self.rc)]
        return batch + lf + rf


def free_dims(shape: Shape, batch: list[int], contract: list[int]) -> list[int]:
    return [d for d in range(shape.rank) if d not in batch and d not in contract]


def _dims_from(numbers: dict, key: str) -> list[int]:
    return [int(x) for x in numbers.get(key, [])]


def describe_gemm(graph: OpGraph, nid: int) -> GemmDot:
    node = graph.nodes[nid]
    inst = node.instruction
    if node.opcode == "dot":
        dot, comp = inst, None
        lhs, rhs = graph.nodes[node.operands[0]].shape, graph.nodes[node.operands[1]].shape
    elif node.opcode == "fusion":
        comp = graph.computations.get(inst.called_computations[0]) if \
            inst.called_computations else None
        if comp is None:
            raise NotAChain(f"{node.name}: its computation is unknown to the graph")
        dots = [i for i in comp.instructions if i.opcode == "dot"]
        if len(dots) != 1:
            raise NotAChain(f"{node.name}: {len(dots)} dots in the GEMM fusion")
        dot = dots[0]
        names = comp.by_name()
        lhs, rhs = names[dot.operands[0]].shape, names[dot.operands[1]].shape
    elif node.opcode == "custom-call":
        cfg = inst.backend_config.get("gemm_backend_config")
        if not isinstance(cfg, dict) or len(node.operands) != 2:
            raise NotAChain(f"{node.name}: not a plain two-operand cuBLAS GEMM")
        if float(cfg.get("beta", 0) or 0) != 0 or cfg.get("epilogue", "DEFAULT") != "DEFAULT":
            raise NotAChain(f"{node.name}: cuBLAS beta/epilogue")
        if float(cfg.get("alpha_imag", 0) or 0) != 0:
            raise NotAChain(f"{node.name}: complex alpha")
        numbers = cfg.get("dot_dimension_numbers", {})
        d = GemmDot(nid, inst, None, graph.nodes[node.operands[0]].shape,
                 graph.nodes[node.operands[1]].shape,
                 _dims_from(numbers, "lhs_batch_dimensions"),
                 _dims_from(numbers, "lhs_contracting_dimensions"),
                 _dims_from(numbers, "rhs_batch_dimensions"),
                 _dims_from(numbers, "rhs_contracting_dimensions"),
                 alpha=float(cfg.get("alpha_real", 1.0)))
        return d
    else:
        raise NotAChain(f"{node.name}: {node.opcode} is not a GEMM")
    return GemmDot(nid, dot, comp, lhs, rhs, list(dot.ints("lhs_batch_dims", ())),
                list(dot.ints("lhs_contracting_dims", ())),
                list(dot.ints("rhs_batch_dims", ())), list(dot.ints("rhs_contracting_dims", ())))


def _allows_tf32(d: GemmDot) -> bool:
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


def through_renames(graph: OpGraph, nid: int) -> tuple[int, list[int]]:
    """The node a chain of free row-major bitcasts/reshapes starts from, and those nodes."""
    chain: list[int] = []
    while True:
        node = graph.nodes[nid]
        if node.opcode in ("bitcast", "reshape") and graph.is_free(nid) and node.operands:
            src = graph.nodes[node.operands[0]].shape
            if not (row_major(src) and row_major(node.shape)):
                break
            chain.append(nid)
            nid = node.operands[0]
            continue
        break
    return nid, chain


def finish_result(graph: OpGraph, d: GemmDot) -> None:
    """Find the array result of GEMM ``d``: through a gte of a custom call's tuple, then a
    split-K reduce (an add-reduce over batch dims of the dot only) if one follows."""
    node = graph.nodes[d.node]
    result, extra = d.node, []
    if node.shape.is_tuple:
        gtes = [u for u in node.users if graph.nodes[u].opcode == "get-tuple-element"
                and graph.nodes[u].instruction.int("index", 0) == 0]
        if len(gtes) != 1:
            raise NotAChain(f"{node.name}: its result is not read through one gte")
        result = gtes[0]
        extra.append(result)
    shape = graph.nodes[result].shape
    if not row_major(shape):
        raise NotAChain(f"{node.name}: result layout is not row-major")
    users = graph.nodes[result].users
    if len(users) == 1 and graph.nodes[users[0]].opcode == "reduce" and d.lb:
        red = graph.nodes[users[0]]
        dims = set(red.instruction.ints("dimensions", ()))
        if dims and dims <= set(range(len(d.lb))) and reducer_of(graph, red.instruction) == "add" \
                and constant_value(graph, red.operands[1]) == 0.0 and len(red.operands) == 2:
            d.split = sorted(dims)
            result = red.id
            extra.append(red.id)
    d.result, d.extra = result, tuple(extra)


def reducer_of(graph: OpGraph, inst: Instruction) -> str | None:
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


def constant_value(graph: OpGraph, nid: int) -> float | None:
    node = graph.nodes[nid]
    if node.opcode != "constant":
        return None
    return literal_scalar(node.instruction, node.shape)


def literal_scalar(inst: Instruction, shape: Shape) -> float | None:
    if shape.is_tuple or shape.num_elements != 1 or inst.literal is None:
        return None
    text = inst.literal.strip().strip("{}").strip()
    try:
        if text in ("true", "false"):
            return 1.0 if text == "true" else 0.0
        return float(text)
    except ValueError:
        return None


def operand_groups(d: GemmDot, side: str) -> tuple[list[int], list[int], list[int]]:
    """(batch, free, contract) dims of one operand, split-K dims moved into contract."""
    shape, batch, contract = ((d.lhs_shape, d.lb, d.lc) if side == "lhs"
                              else (d.rhs_shape, d.rb, d.rc))
    split = d.split or []
    kept = [x for i, x in enumerate(batch) if i not in split]
    moved = [x for i, x in enumerate(batch) if i in split]
    return kept, free_dims(shape, batch, contract), moved + list(contract)


# A value's element index along one dim as mixed-radix digits (size, stride), major first:
# index i of a dim with digits ((s1, t1), (s2, t2)) lies at (i // s2) * t1 + (i % s2) * t2.
Digits = tuple[tuple[int, int], ...]


def row_major_digits(dims: tuple[int, ...]) -> list[Digits]:
    return [((d, st),) for d, st in zip(dims, row_major_strides(dims))]


def direct_view(node: int, shape: Shape, batch: list[int], rows: list[int], cols: list[int]
          ) -> tuple[OperandView, tuple[int, int, int]]:
    """The view of a row-major value read directly (the second GEMM's lhs)."""
    if not row_major(shape):
        raise NotAChain("operand layout is not row-major")
    return strided_view(node, shape.dims, row_major_digits(shape.dims), batch, rows, cols)


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


def strided_source(graph: OpGraph, nid: int, allowed: set[int]) -> tuple[int, list[Digits], list[int]]:
    """(root, digits, moved): the value of node ``nid`` read straight from the row-major
    buffer of ``root`` (per dim, ``Digits`` into it), looking through bitcasts, reshapes,
    copies, transposes and broadcasts whose users are all ``allowed`` (``moved``: those
    ops; a chain kernel absorbs them instead of reading their result)."""
    node = graph.nodes[nid]
    dims = node.shape.dims
    here = (nid, row_major_digits(dims), [])
    if node.opcode not in _MOVES or len(node.operands) != 1 or not node.shape.is_array \
            or any(u not in allowed for u in node.users):
        return here
    src = node.operands[0]
    src_shape = graph.nodes[src].shape
    if not src_shape.is_array:
        return here
    root, digits, moved = strided_source(graph, src, allowed | {nid})
    moved = moved + [nid]
    if node.opcode in ("bitcast", "reshape"):
        if node.opcode == "bitcast" and not (row_major(src_shape) and row_major(node.shape)):
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


def strided_view(node: int, dims: tuple[int, ...], digits: list[Digits], batch: list[int],
                  rows: list[int], cols: list[int]) -> tuple[OperandView, tuple[int, int, int]]:
    sizes = tuple(math.prod(dims[d] for d in g) for g in (batch, rows, cols))
    row_cols = []
    for g in (rows, cols):
        runs = _runs(digits, g)
        if len(runs) > 1:
            raise NotAChain(f"dims {g} of {list(dims)} are not one strided run")
        row_cols.append(runs[0][1] if runs else 0)
    runs = _runs(digits, batch)
    if len(runs) > 1:
        return OperandView(node, 0, row_cols[0], row_cols[1], tuple(runs)), sizes
    return OperandView(node, runs[0][1] if runs else 0, *row_cols), sizes


