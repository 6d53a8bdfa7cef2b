"""Attention's backward in XLA's optimized module: the instructions that the FlashAttention-2-style
kernels of ``stitch.codegen.attention_backward`` replace.

XLA leaves a training step's causal softmax attention (``softmax(mask(c * Q K^T)) V``) as,
per layer (all [batch, length, head_dim] operands, [batch, queries, keys] scores):

    S    GEMM fusion   c * Q K^T                       (epilogue: the scale)
    L    fusion        rowsum exp(x - rowmax x),  x = select(causal, S, -big)
    P    fusion        exp(x - rowmax x) / L
    dP   GEMM fusion   dO V^T
    dS   fusion        select(causal, (dP / L - rowsum(dP / L^2 * e)) * e, 0),  e = exp(x - rowmax x)
    dQ   GEMM fusion   (c * dS) K          dK   GEMM fusion   (c * dS)^T Q
    dV   GEMM fusion   P^T dO

``find_attention_backwards`` checks each of these structurally (commutative operands in
either order, bitcasts seen through, the mask the same iota compare col <= row or none,
the same S / L / scale everywhere) and returns an ``AttentionBackwardMatch`` naming the
instructions and the problem. Nothing is approximated: dS above is P (dP - sum_k P dP)
written out, which the kernels compute. Anything else is no match (logged at debug).

In a bf16 / f16 step XLA stores S, P, dP and dS in the operands' type: each GEMM's result
rounded, the softmax math widened to f32 and its results rounded back (``intermediates``;
the kernels round at the same places), and at full size the causal mask is a pred
fusion of its own that the L, P and dS fusions read as a parameter.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

from .combiners import combiner_kind
from .gemm_chains import allows_tf32
from .ir import Computation, HloModule, Instruction, Shape

log = logging.getLogger(__name__)

_RENAMES = frozenset({"bitcast", "copy"})
_TYPES = frozenset({"f32", "bf16", "f16"})


class _NoMatch(Exception):
    """Internal: why an instruction is not part of an attention backward."""


@dataclass(frozen=True)
class Strides:
    """A [batch, rows, cols] value's element strides in its buffer (from the layout)."""
    batch: int
    rows: int
    cols: int


@dataclass(frozen=True)
class AttentionBackwardMatch:
    """One attention's backward in computation ``computation`` (instruction names). The
    operands ``q``, ``k``, ``v``, ``d_o`` are the entry values the GEMM fusions read, with
    their strides; ``dq``, ``dk``, ``dv`` the GEMM fusions computing the gradients, each
    written with ``result_strides``. ``scores``, ``row_sums``, ``probs``, ``d_probs``,
    ``d_scores``: the fusions of S, L, P, dP, dS."""
    computation: str
    q: str
    k: str
    v: str
    d_o: str
    operand_strides: tuple[tuple[str, Strides], ...]
    scores: str
    row_sums: str
    probs: str
    d_probs: str
    d_scores: str
    dq: str
    dk: str
    dv: str
    result_strides: tuple[tuple[str, Strides], ...]
    batch: int
    queries: int
    keys: int
    head_dim: int
    scale: float
    causal: bool
    dtype: str
    tf32: bool = False      # every dot lets f32 operands run as TF32 (gemm_chains.allows_tf32)
    # The type XLA stores S, P, dP and dS in: f32, or (bf16 / f16 steps) the operands'
    # type, each GEMM result rounded to it and the softmax math widened to f32 between.
    intermediates: str = "f32"

    @property
    def replaced(self) -> tuple[str, ...]:
        """What the two backward kernels compute instead (S, L and P stay for the
        forward's own readers)."""
        return (self.d_probs, self.d_scores, self.dq, self.dk, self.dv)


def find_attention_backwards(module: HloModule) -> list[AttentionBackwardMatch]:
    """Every attention backward of the module's entry computation (see the module
    docstring); a dS fusion that does not fit is skipped with the reason at debug."""
    comp = module.entry
    finder = _Finder(module, comp)
    found = []
    for inst in comp.instructions:
        # dS reads S, dP and L, and the causal mask where XLA computes it apart.
        if inst.opcode != "fusion" or len(inst.operands) not in (3, 4):
            continue
        try:
            found.append(finder.match(inst))
        except _NoMatch as why:
            log.debug("%s: no attention backward: %s", inst.name, why)
    return found


def _strides(shape: Shape) -> list[int]:
    order = shape.minor_to_major()
    strides = [0] * len(shape.dims)
    step = 1
    for d in order:
        strides[d] = step
        step *= shape.dims[d]
    return strides


def _row_major(shape: Shape) -> bool:
    return shape.minor_to_major() == tuple(range(len(shape.dims) - 1, -1, -1))


def _scalar(inst: Instruction) -> float | None:
    """A constant scalar's value (a broadcast of one seen through)."""
    if inst.opcode != "constant" or inst.shape.dims or inst.literal is None:
        return None
    try:
        return float(inst.literal.strip().strip("{}").strip())
    except ValueError:
        return None


class _Computation:
    """Pattern helpers over one computation."""

    def __init__(self, comp: Computation, module: HloModule):
        self.comp = comp
        self.module = module
        self.by_name = comp.by_name()

    def get(self, name: str) -> Instruction:
        return self.by_name[name]

    def ops(self, inst: Instruction) -> list[Instruction]:
        return [self.by_name[o] for o in inst.operands]

    def strip(self, inst: Instruction) -> Instruction:
        """The value ``inst`` renames: through bitcasts between row-major shapes (the same
        elements in the same order) and copies that change nothing; a bitcast that moves
        elements (a layout change) or a transposing copy stops here."""
        while inst.opcode in _RENAMES:
            source = self.by_name[inst.operands[0]]
            if inst.opcode == "bitcast" and not (_row_major(inst.shape) and
                                                 _row_major(source.shape)):
                break
            if inst.opcode == "copy" and inst.shape != source.shape:
                break
            inst = source
        return inst

    def is_(self, inst: Instruction, opcode: str) -> Instruction:
        inst = self.strip(inst)
        if inst.opcode != opcode:
            raise _NoMatch(f"{inst.name} is a {inst.opcode}, not a {opcode}")
        return inst

    def constant(self, inst: Instruction) -> float:
        """A scalar constant, or a broadcast of one."""
        inst = self.strip(inst)
        if inst.opcode == "broadcast":
            inst = self.strip(self.get(inst.operands[0]))
        value = _scalar(inst)
        if value is None:
            raise _NoMatch(f"{inst.name} is not a constant")
        return value

    def row_broadcast(self, inst: Instruction) -> Instruction:
        """The row value a broadcast spreads along the last dim."""
        inst = self.is_(inst, "broadcast")
        rank = len(inst.shape.dims)
        if inst.ints("dimensions") != tuple(range(rank - 1)):
            raise _NoMatch(f"{inst.name} does not spread rows along the last dim")
        return self.strip(self.get(inst.operands[0]))

    def row_reduce(self, inst: Instruction, reducer: str, init: float) -> Instruction:
        """The operand of a reduce over the last dim with a one-op ``reducer``."""
        inst = self.is_(inst, "reduce")
        operand = self.get(inst.operands[0])
        if inst.ints("dimensions") != (len(operand.shape.dims) - 1,):
            raise _NoMatch(f"{inst.name} does not reduce the last dim")
        if self.constant(self.get(inst.operands[1])) != init:
            raise _NoMatch(f"{inst.name}: init is not {init}")
        if combiner_kind(self.module.computation(inst.called_computations[0])) != reducer:
            raise _NoMatch(f"{inst.name}: the reducer is not {reducer}")
        return self.strip(operand)

    def pairs(self, inst: Instruction, opcode: str) -> list[tuple[Instruction, Instruction]]:
        """A commutative binary op's operands in both orders."""
        inst = self.is_(inst, opcode)
        a, b = (self.strip(x) for x in self.ops(inst))
        return [(a, b), (b, a)]


def _first(options, what: str):
    """The first of ``options`` (callables) that matches."""
    reasons = []
    for option in options:
        try:
            return option()
        except _NoMatch as why:
            reasons.append(str(why))
    raise _NoMatch(f"{what}: " + "; ".join(reasons))


@dataclass
class _Softmax:
    """What a softmax-shaped fused computation reads (parameter numbers)."""
    scores: int
    causal: bool
    exp: Instruction


class _Fused(_Computation):
    """A fused computation of the softmax family (L, P, dS). ``operand_of`` maps a
    parameter number to the entry value the fusion reads there (the mask's own fusion)."""

    def __init__(self, comp: Computation, module: HloModule, operand_of=None):
        super().__init__(comp, module)
        self.operand_of = operand_of

    def strip(self, inst: Instruction) -> Instruction:
        """Also through widening converts (bf16 / f16 to f32: exact, a rename of the
        value); a narrowing one is a rounding and stops here (``rounded``)."""
        while True:
            inst = super().strip(inst)
            if inst.opcode != "convert":
                return inst
            source = self.by_name[inst.operands[0]]
            if inst.shape.element_type != "f32" or \
                    source.shape.element_type not in ("bf16", "f16", "f32"):
                return inst
            inst = source

    def rounded(self, inst: Instruction) -> tuple[Instruction, str]:
        """A value computed in f32 and stored as ``inst``'s type: (the f32 value, the
        stored type); an f32 value is its own."""
        inst = self.strip(inst)
        stored = inst.shape.element_type
        if stored == "f32":
            return inst, stored
        if inst.opcode != "convert":
            raise _NoMatch(f"{inst.name}: {stored} arithmetic, not f32 rounded to {stored}")
        inner = self.strip(self.get(inst.operands[0]))
        if inner.shape.element_type != "f32":
            raise _NoMatch(f"{inst.name}: not a rounding of an f32 value")
        return inner, stored

    def param(self, inst: Instruction) -> int:
        inst = self.strip(inst)
        if inst.opcode != "parameter":
            raise _NoMatch(f"{inst.name} is not a parameter")
        return inst.parameter_number

    def causal_mask(self, inst: Instruction) -> None:
        """broadcast(compare(iota dim 1, iota dim 0, LE)) onto the last two dims: key <=
        query (or the same as GE with the operands swapped)."""
        inst = self.is_(inst, "broadcast")
        rank = len(inst.shape.dims)
        if inst.ints("dimensions") != (rank - 2, rank - 1):
            raise _NoMatch(f"{inst.name}: the mask is not over the scores' last two dims")
        source = self.strip(self.get(inst.operands[0]))
        if source.opcode == "parameter" and self.operand_of is not None:
            # The [queries, keys] mask computed by a fusion of its own (XLA's bf16 steps).
            outer = self.operand_of(source.parameter_number)
            if outer.opcode != "fusion" or outer.operands:
                raise _NoMatch(f"{outer.name}: the mask is not a fusion of iotas")
            mask_comp = _Fused(self.module.computation(outer.called_computations[0]),
                               self.module)
            mask_comp.causal_compare(mask_comp.comp.root)
            return
        self.causal_compare(source)

    def causal_compare(self, inst: Instruction) -> None:
        """compare(iota dim 1, iota dim 0, LE) or the same as GE, operands swapped."""
        cmp = self.is_(inst, "compare")
        lhs, rhs = (self.is_(x, "iota") for x in self.ops(cmp))
        dims = (lhs.int("iota_dimension"), rhs.int("iota_dimension"))
        direction = cmp.attrs.get("direction", "")
        if (direction, dims) not in (("LE", (1, 0)), ("GE", (0, 1))):
            raise _NoMatch(f"{cmp.name}: not the causal compare col <= row")

    def masked_scores(self, x: Instruction) -> tuple[int, bool, Instruction | None]:
        """x = select(causal, S, big negative) or S itself: (S's parameter, causal,
        the mask instruction)."""
        x = self.strip(x)
        if x.opcode == "select":
            mask, s, fill = self.ops(x)
            if self.constant(fill) > -1e4:
                raise _NoMatch(f"{x.name}: the masked scores are not a large negative")
            self.causal_mask(mask)
            return self.param(s), True, self.strip(mask)
        return self.param(x), False, None

    def shifted_exp(self, inst: Instruction) -> tuple[int, bool, Instruction | None]:
        """exp(x - rowmax x): (S's parameter, causal, the mask)."""
        e = self.is_(inst, "exponential")
        sub = self.is_(self.get(e.operands[0]), "subtract")
        x, shift = (self.strip(o) for o in self.ops(sub))
        if self.row_reduce(self.row_broadcast(shift), "maximum", float("-inf")) is not x:
            raise _NoMatch(f"{sub.name}: not x minus its row max")
        return self.masked_scores(x)


class _Finder:
    def __init__(self, module: HloModule, comp: Computation):
        self.module = module
        self.entry = _Computation(comp, module)
        self.readers: dict[str, list[Instruction]] = {}
        for inst in comp.instructions:
            for o in inst.operands:
                self.readers.setdefault(o, []).append(inst)

    def fused(self, inst: Instruction) -> _Fused:
        if inst.opcode != "fusion":
            raise _NoMatch(f"{inst.name} is not a fusion")
        return _Fused(self.module.computation(inst.called_computations[0]), self.module,
                      lambda param: self.operand(inst, param))

    def operand(self, fusion: Instruction, param: int) -> Instruction:
        """The entry value a fusion parameter reads (bitcasts seen through)."""
        return self.entry.strip(self.entry.get(fusion.operands[param]))

    def direct(self, fusion: Instruction, param: int) -> Instruction:
        """The entry instruction a fusion parameter reads (its buffer, its layout)."""
        return self.entry.get(fusion.operands[param])

    def value_readers(self, inst: Instruction) -> list[Instruction]:
        """Who reads the value, through entry bitcasts."""
        out = []
        for r in self.readers.get(inst.name, []):
            out.extend(self.value_readers(r) if r.opcode in _RENAMES else [r])
        return out

    # --- the softmax gradient (dS) ----------------------------------------------------------
    def d_scores(self, fusion: Instruction) -> tuple[int, int, int, bool]:
        """dS's fused computation: (S, dP, L parameters, causal). In a bf16 / f16 step
        dS is computed in f32 and rounded before the mask's zeros are selected."""
        f = self.fused(fusion)
        root = f.strip(f.comp.root)
        mask = None
        body = root
        if root.opcode == "select":
            mask_inst, body, zero = f.ops(root)
            if f.constant(zero) != 0.0:
                raise _NoMatch(f"{root.name}: masked gradients are not 0")
            f.causal_mask(mask_inst)
            mask = f.strip(mask_inst)
        body, _ = f.rounded(body)

        def with_exp(diff: Instruction, e: Instruction):
            s, causal, x_mask = f.shifted_exp(e)
            if causal != (mask is not None) or (mask is not None and not _same_mask(
                    f, mask, x_mask)):
                raise _NoMatch(f"{root.name}: the gradient's mask is not the scores' mask")
            return _first([lambda a=a, b=b: self.dp_term(f, a, b, e) for a, b in
                           f.pairs(diff, "add")], f"{diff.name}: dP / L - rowsum") + (s, causal)

        dp, l_param, s, causal = _first(
            [lambda a=a, b=b: with_exp(a, b) for a, b in f.pairs(body, "multiply")],
            f"{body.name}: (dP / L - D / L) * e")
        return s, dp, l_param, causal

    def dp_term(self, f: _Fused, div_part: Instruction, neg_part: Instruction,
                e: Instruction) -> tuple[int, int]:
        """div_part = dP / bcast(L); neg_part = bcast(-rowsum(dP * bcast(1 / (L * L)) * e)):
        (dP's parameter, L's parameter)."""
        div = f.is_(div_part, "divide")
        dp_inst, l_b = f.ops(div)
        dp, l_param = f.param(dp_inst), f.param(f.row_broadcast(l_b))
        neg = f.is_(f.row_broadcast(neg_part), "negate")
        summed = f.row_reduce(f.get(neg.operands[0]), "add", 0.0)

        def weighted(a: Instruction, b: Instruction) -> None:
            if f.strip(b) is not f.strip(e):
                raise _NoMatch(f"{b.name} is not the scores' exp")
            for x, y in f.pairs(a, "multiply"):
                try:
                    if f.param(x) != dp:
                        continue
                    inv = f.is_(f.row_broadcast(y), "divide")
                    one, sq = f.ops(inv)
                    if f.constant(one) != 1.0:
                        continue
                    l1, l2 = (f.param(z) for z in f.ops(f.is_(sq, "multiply")))
                    if l1 == l2 == l_param:
                        return
                except _NoMatch:
                    continue
            raise _NoMatch(f"{a.name} is not dP / L^2")

        _first([lambda a=a, b=b: weighted(a, b) for a, b in f.pairs(summed, "multiply")],
               f"{summed.name}: rowsum(dP / L^2 * e)")
        return dp, l_param

    # --- L and P ------------------------------------------------------------------------------
    def row_sums(self, fusion: Instruction) -> tuple[int, bool]:
        """L = rowsum exp(x - rowmax x): (S's parameter, causal)."""
        f = self.fused(fusion)
        e = f.row_reduce(f.comp.root, "add", 0.0)
        s, causal, _ = f.shifted_exp(e)
        return s, causal

    def probs(self, fusion: Instruction) -> tuple[int, int, bool]:
        """P = exp(x - rowmax x) / bcast(L): (S's parameter, L's parameter, causal)."""
        f = self.fused(fusion)
        div = f.is_(f.rounded(f.comp.root)[0], "divide")
        e, l_b = f.ops(div)
        s, causal, _ = f.shifted_exp(e)
        return s, f.param(f.row_broadcast(l_b)), causal

    # --- GEMM fusions -------------------------------------------------------------------------
    def gemm(self, fusion: Instruction) -> "_Gemm":
        """A GEMM fusion: dot(scale * param, param) (* scale) over rank-3 operands with
        batch dim 0, seen through a bitcast root."""
        if fusion.opcode != "fusion":
            raise _NoMatch(f"{fusion.name} is not a GEMM fusion")
        f = _Fused(self.module.computation(fusion.called_computations[0]), self.module)
        # The root's bitcast renames the dot's buffer whatever its layout: the result's
        # strides are read off the dot's own shape.
        root = f.comp.root
        while root.opcode == "bitcast":
            root = f.get(root.operands[0])
        root = f.strip(root)
        out_scale = 1.0
        if root.opcode == "multiply":
            dot, scale = _first([lambda a=a, b=b: (f.is_(a, "dot"), f.constant(b))
                                 for a, b in f.pairs(root, "multiply")], "epilogue")
            out_scale = scale
        else:
            dot = f.is_(root, "dot")
        if dot.ints("lhs_batch_dims") != (0,) or dot.ints("rhs_batch_dims") != (0,):
            raise _NoMatch(f"{dot.name}: batch dims are not 0")
        sides: list[tuple[int | tuple[int, ...], float]] = []
        for read in f.ops(dot):
            operand = f.strip(read)
            scale = 1.0
            if operand.opcode == "multiply":
                operand, scale = _first([lambda a=a, b=b: (f.is_(a, "parameter"), f.constant(b))
                                         for a, b in f.pairs(operand, "multiply")], "prologue")
            if len(read.shape.dims) != 3:
                raise _NoMatch(f"{dot.name}: operands are not rank 3")
            if operand.opcode == "concatenate" and scale == 1.0:
                sides.append((_concatenated_params(f, operand), scale))
                continue
            if operand.opcode != "parameter" or len(operand.shape.dims) != 3:
                raise _NoMatch(f"{dot.name}: operands are not rank-3 parameters")
            sides.append((operand.parameter_number, scale))
        contracting = (dot.ints("lhs_contracting_dims"), dot.ints("rhs_contracting_dims"))
        return _Gemm(fusion, sides[0][0], sides[1][0], sides[0][1] * sides[1][1] * out_scale,
                     contracting, dot.shape, allows_tf32(dot), out_scale)

    def gemm_of(self, fusion: Instruction, contracting: tuple, what: str) -> "_Gemm":
        g = self.gemm(fusion)
        if not (isinstance(g.lhs, int) and isinstance(g.rhs, int)):
            raise _NoMatch(f"{fusion.name}: {what} reads a concatenation")
        if g.contracting != contracting:
            raise _NoMatch(f"{fusion.name}: {what} contracts {g.contracting}")
        return g

    # --- the whole ----------------------------------------------------------------------------
    def match(self, ds_fusion: Instruction) -> AttentionBackwardMatch:
        s_p, dp_p, l_p, causal = self.d_scores(ds_fusion)
        s_inst = self.operand(ds_fusion, s_p)
        l_inst = self.operand(ds_fusion, l_p)
        dp_inst = self.operand(ds_fusion, dp_p)
        score = self.gemm_of(s_inst, ((2,), (2,)), "S = Q K^T")
        d_prob = self.gemm_of(dp_inst, ((2,), (2,)), "dP = dO V^T")
        if d_prob.scale != 1.0:
            raise _NoMatch(f"{dp_inst.name}: dP is scaled")
        q, k = self.operand(s_inst, score.lhs), self.operand(s_inst, score.rhs)
        d_o, v = self.operand(dp_inst, d_prob.lhs), self.operand(dp_inst, d_prob.rhs)
        # L: the row sums of the same masked scores.
        ls, l_causal = self.row_sums(l_inst)
        if self.operand(l_inst, ls) is not s_inst or l_causal != causal:
            raise _NoMatch(f"{l_inst.name}: not the row sums of {s_inst.name}")
        # dS's readers: dQ = (c dS) K and dK = (c dS)^T Q; P's reader dV = P^T dO.
        found: dict[str, tuple[Instruction, Strides, float, Instruction]] = {}
        for reader in self.value_readers(ds_fusion):
            got = None
            for name, contract, small in (("dq", 2, k), ("dk", 1, q)):
                try:
                    got = name, self.gradient(reader, ds_fusion, contract, small)
                    break
                except _NoMatch:
                    continue
            if got is None or got[0] in found:
                raise _NoMatch(f"{reader.name} reads dS but is neither dQ nor dK")
            found[got[0]] = got[1]
        if set(found) != {"dq", "dk"}:
            raise _NoMatch(f"{ds_fusion.name}: dQ or dK not found among its readers")
        for name in ("dq", "dk"):
            if not _close(found[name][2], score.scale):
                raise _NoMatch(f"{found[name][0].name}: not the scores' scale times dS")
        p_inst = None
        for reader in self.value_readers(s_inst):
            if reader is ds_fusion or reader is l_inst or reader.opcode != "fusion":
                continue
            try:
                ps, pl, p_causal = self.probs(reader)
            except _NoMatch:
                continue
            if self.operand(reader, ps) is not s_inst or \
                    self.operand(reader, pl) is not l_inst or p_causal != causal:
                continue
            for user in self.value_readers(reader):
                try:
                    grad = self.gradient(user, reader, 1, d_o)
                except _NoMatch:
                    continue
                if grad[2] == 1.0 and "dv" not in found:
                    found["dv"], p_inst = grad, reader
        if p_inst is None:
            raise _NoMatch(f"{ds_fusion.name}: no dV = P^T dO of the same P")
        intermediates = self.intermediates(s_inst, l_inst, p_inst, dp_inst, ds_fusion,
                                           score, [found[n][0] for n in ("dq", "dk")])
        # The operands as the GEMMs read them: one buffer layout each.
        q, k = self.direct(s_inst, score.lhs), self.direct(s_inst, score.rhs)
        d_o, v = self.direct(dp_inst, d_prob.lhs), self.direct(dp_inst, d_prob.rhs)
        for name, want in (("dq", k), ("dk", q), ("dv", d_o)):
            if found[name][3] is not None and found[name][3].shape != want.shape:
                raise _NoMatch(f"{found[name][0].name} reads {want.name} in another layout")
        tf32 = all(self.gemm(f).tf32 for f in (s_inst, dp_inst, *(
            found[n][0] for n in ("dq", "dk", "dv"))))
        match = self.describe(ds_fusion, s_inst, l_inst, dp_inst, p_inst, q, k, v, d_o, found,
                              score.scale, causal)
        if intermediates not in ("f32", match.dtype):
            raise _NoMatch(f"{ds_fusion.name}: {intermediates} scores of {match.dtype} operands")
        return dataclasses.replace(match, tf32=tf32, intermediates=intermediates)

    def intermediates(self, s_inst: Instruction, l_inst: Instruction, p_inst: Instruction,
                      dp_inst: Instruction, ds_fusion: Instruction, score: "_Gemm",
                      grads: list[Instruction]) -> str:
        """The one type S, P, dP and dS are stored in (L stays f32). Rounded to bf16 / f16,
        the scale's place matters unless it is a power of two (then scaling is exact):
        the kernels round S = c * (Q K^T) after the scale (XLA's epilogue) and scale dS
        before dQ's and dK's GEMMs (XLA's prologue)."""
        stored = s_inst.shape.element_type
        for inst in (p_inst, dp_inst, ds_fusion):
            if inst.shape.element_type != stored:
                raise _NoMatch(f"{inst.name} is {inst.shape.element_type}, S is {stored}")
        if l_inst.shape.element_type != "f32":
            raise _NoMatch(f"{l_inst.name}: the row sums are not f32")
        if stored == "f32" or _power_of_two(score.scale):
            return stored
        if not _close(score.epilogue, score.scale):
            raise _NoMatch(f"{s_inst.name}: {stored} S scaled before its GEMM's rounding")
        for grad in grads:
            if self.gemm(grad).epilogue != 1.0:
                raise _NoMatch(f"{grad.name}: {stored} dS scaled after its GEMM")
        return stored

    def gradient(self, fusion: Instruction, big: Instruction, contract: int,
                 small: Instruction) -> tuple[Instruction, Strides, float, Instruction]:
        """A GEMM fusion contracting the scores-sized value ``big`` over its dim
        ``contract`` with ``small`` ([batch, length, head_dim]) over its length, either
        operand order: (the fusion, where result (b, row, d) lands, its scale, the
        operand instruction read as ``small``)."""
        g = self.gemm(fusion)
        sides = ((g.lhs, g.rhs, 0), (g.rhs, g.lhs, 1))
        for big_side, small_side, which in sides:
            if not isinstance(big_side, int) or self.operand(fusion, big_side) is not big \
                    or not self.reads_value(fusion, small_side, small):
                continue
            want = ((contract,), (1,)) if which == 0 else ((1,), (contract,))
            if g.contracting != want:
                raise _NoMatch(f"{fusion.name} contracts {g.contracting}, not {want}")
            st = _strides(g.out_shape)
            strides = Strides(st[0], st[1], st[2]) if which == 0 else \
                Strides(st[0], st[2], st[1])
            # A concatenation read in pieces: the kernels read ``small``'s own buffer.
            read = self.direct(fusion, small_side) if isinstance(small_side, int) else None
            return fusion, strides, g.scale, read
        raise _NoMatch(f"{fusion.name} does not read {big.name} and {small.name}")

    def reads_value(self, fusion: Instruction, side: int | tuple[int, ...],
                    value: Instruction) -> bool:
        """The fusion's operand ``side`` is ``value``: the same entry value, or (Llama's
        rotary Q and K) a concatenation along the head dim of the very pieces ``value``'s
        own concatenation fusion joins, in the same order."""
        value = self.entry.strip(value)
        if isinstance(side, int):
            return self.operand(fusion, side) is value
        if value.opcode != "fusion" or len(value.operands) != len(side):
            return False
        joined = _Fused(self.module.computation(value.called_computations[0]), self.module)
        try:
            pieces = _concatenated_params(joined, joined.strip(joined.comp.root))
        except _NoMatch:
            return False
        return pieces == tuple(range(len(side))) and all(
            self.operand(value, i) is self.operand(fusion, p) for i, p in enumerate(side))

    def describe(self, ds, s, l_inst, dp, p, q, k, v, d_o, found, scale: float,
                 causal: bool) -> AttentionBackwardMatch:
        dims = {}
        for name, inst in (("q", q), ("k", k), ("v", v), ("d_o", d_o)):
            if len(inst.shape.dims) != 3 or inst.shape.element_type not in _TYPES:
                raise _NoMatch(f"{inst.name}: operand {name} is not a rank-3 float array")
            dims[name] = inst.shape.dims
        batch, queries, head_dim = dims["q"]
        keys = dims["k"][1]
        if dims["d_o"] != dims["q"] or dims["v"] != dims["k"] or dims["k"][0] != batch \
                or dims["k"][2] != head_dim:
            raise _NoMatch(f"{ds.name}: operand shapes {dims} do not agree")
        dtype = q.shape.element_type
        if any(i.shape.element_type != dtype for i in (k, v, d_o)):
            raise _NoMatch(f"{ds.name}: operands of different types")
        for name in ("dq", "dk", "dv"):
            if found[name][0].shape.element_type != dtype:
                raise _NoMatch(f"{found[name][0].name}: {name} is not {dtype}")
        operands = tuple((name, Strides(*_strides(inst.shape)))
                         for name, inst in (("q", q), ("k", k), ("v", v), ("d_o", d_o)))
        return AttentionBackwardMatch(
            self.entry.comp.name, q.name, k.name, v.name, d_o.name, operands, s.name,
            l_inst.name, p.name, dp.name, ds.name, found["dq"][0].name,
            found["dk"][0].name, found["dv"][0].name,
            tuple((name, found[name][1]) for name in ("dq", "dk", "dv")),
            batch, queries, keys, head_dim, scale, causal, dtype)


@dataclass
class _Gemm:
    fusion: Instruction
    lhs: int | tuple[int, ...]    # parameter numbers (several: joined along the last dim)
    rhs: int | tuple[int, ...]
    scale: float              # product of the prologue / epilogue scales
    contracting: tuple
    out_shape: Shape          # the dot's (its layout: where the result lands)
    tf32: bool = False
    epilogue: float = 1.0     # the part of ``scale`` applied to the dot's result


def _concatenated_params(f: _Computation, inst: Instruction) -> tuple[int, ...]:
    """A concatenation of parameters along the last dim: their numbers, in order."""
    inst = f.is_(inst, "concatenate")
    if inst.ints("dimensions") != (len(inst.shape.dims) - 1,):
        raise _NoMatch(f"{inst.name} does not join along the last dim")
    pieces = [f.strip(o) for o in f.ops(inst)]
    if any(p.opcode != "parameter" for p in pieces):
        raise _NoMatch(f"{inst.name} joins more than parameters")
    return tuple(p.parameter_number for p in pieces)


def _power_of_two(x: float) -> bool:
    mantissa, _ = math.frexp(abs(x))
    return x != 0.0 and mantissa == 0.5


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(abs(a), abs(b))


def _same_mask(f: _Fused, a: Instruction, b: Instruction | None) -> bool:
    """Both are the causal mask (each already checked by ``causal_mask``)."""
    return b is not None and a.shape.dims == b.shape.dims
