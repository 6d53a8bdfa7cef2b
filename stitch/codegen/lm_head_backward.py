"""The LM head's backward through its softmax cross-entropy without the [rows, vocab]
logits or their gradient in memory (Cut Cross-Entropy's backward, in FlashAttention-2's
two-phase shape).

With logits S = H E^T (H [rows, hidden] the last hidden states, E [vocab, hidden] the tied
embedding), the forward's per-row ``lse`` and the loss's per-row cotangent ``g``:

    dS = (exp(S - lse) - onehot(label)) * g       (jax's / optax's gradient of
                                                   logsumexp(S) - S[label])
    dH = dS E        dE = dS^T H

Phase dH: a block of token rows walks the vocabulary tiles, recomputing each S tile from
H and E over the hidden dim, and accumulates dH; phase dE: a block of vocabulary rows walks
the token tiles and accumulates dE (lse, g and the labels then per tile column). Both are
the attention backward's generic tile kernel (``attention_backward.backward_phase``) under
``CrossEntropyGradient``, the "gradient of S" rule: H plays Q, E plays K, no V and no dP.
A block owns ``block_h`` of the hidden dim of its result, so S is recomputed
ceil(hidden / block_h) times per phase (``recompute_factor``).

Labels as jax's ``take_along_axis`` reads them (the forward's rule): a negative label
counts from the end; one outside [0, vocab) after that has no one-hot (its gradient is the
softmax alone, as jax's dropped scatter gives). A masked row (optax's ``where``, an ignore
index turned into a weight) has g = 0. bf16 / f16 logits (``logits_dtype``): S rounded as
XLA's GEMM writes it, dS rounded as XLA's dlogits fusion stores it for the GEMMs.

XLA's training form (GPT-2) reads as inputs of these kernels: ``norm_affine`` takes H as the
final layer norm's normalized x with its scale and shift applied on load (XLA's logits and
dE GEMM fusions apply them in their prologues; H is never stored), ``stats="max_sum"`` the
row max M and sum L of exp(S - M) XLA's split reductions leave (lse = M + log L), and g the
cotangent of the row's lse (jax's log_softmax form: the mean's constant where the label is
in range, 0 where not).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from . import kir
from .attention_backward import (BackwardTiling, MatrixView, ScoreGradient, backward_phase)
from .errors import CodegenError

log = logging.getLogger(__name__)

_c = kir.i32
_F32 = "f32"
STORAGE = ("f32", "bf16", "f16")
# Param names, in order: the inputs (``LmHeadBackward.inputs``: these by default), then
# dH and dE.
INPUTS = ("h", "emb", "labels", "lse", "g")
ROW_VALUES = ("lse", "row_max", "row_sum", "labels", "g")
# The layer norm's scale and shift XLA applies in its logits GEMM's prologue (per hidden
# column): H = h * ln_scale + ln_shift.
AFFINE = ("ln_scale", "ln_shift")
DH, DEMB = "dh", "demb"
# .maxnreg of the one-launch kernel (each phase alone stays under it at the defaults).
REGISTER_BUDGET = 255
# The hidden-dim block a tensor-core block owns of its result: each phase computes the
# logits ceil(hidden / MMA_BLOCK_H) times (3 at GPT-2's 768).
MMA_BLOCK_H = 256


@dataclass(frozen=True)
class LmHeadBackward:
    """One LM head + cross-entropy backward: ``rows`` tokens, ``vocab`` logits columns,
    ``hidden`` wide; H, E (and dH, dE) row-major in ``dtype``; ``logits_dtype``: what
    XLA's module stores the logits and their gradient in (f32 or ``dtype``); ``tf32``:
    the dots allow TF32 for f32 operands."""
    rows: int
    vocab: int
    hidden: int
    dtype: str = _F32
    logits_dtype: str = _F32
    tf32: bool = False
    # H given as the normalized x with the layer norm's per-column scale and shift applied
    # on load (XLA's GEMM prologue): H = x * ln_scale + ln_shift, rounded to ``dtype``.
    norm_affine: bool = False
    # The forward's row statistics: "lse", or "max_sum" (XLA's row max M and sum L of
    # exp(S - M): lse = M + log L).
    stats: str = "lse"

    @property
    def inputs(self) -> tuple[str, ...]:
        stats = ("lse",) if self.stats == "lse" else ("row_max", "row_sum")
        return ("h", "emb", "labels", *stats, "g", *(AFFINE if self.norm_affine else ()))

    # --- the sizes the generic backward kernel reads (attention's names) ------------------
    batch = 1
    scale = 1.0
    causal = False

    @property
    def queries(self) -> int:
        return self.rows

    @property
    def keys(self) -> int:
        return self.vocab

    @property
    def head_dim(self) -> int:
        return self.hidden

    @property
    def intermediates(self) -> str:
        return self.logits_dtype

    def length(self, name: str) -> int:
        return self.rows if name in ("h", DH) else self.vocab

    def view(self, name: str) -> MatrixView:
        return MatrixView.row_major(self.length(name), self.hidden)

    def check(self) -> None:
        if min(self.rows, self.vocab, self.hidden) < 1:
            raise CodegenError(f"{self}: every dimension must be positive")
        if self.dtype not in STORAGE:
            raise CodegenError(f"{self}: operands of {self.dtype} are not lowered")
        if self.logits_dtype not in (_F32, self.dtype):
            raise CodegenError(f"{self}: {self.logits_dtype} logits of {self.dtype} operands")
        if self.stats not in ("lse", "max_sum"):
            raise CodegenError(f"{self}: row statistics {self.stats!r}")


class CrossEntropyGradient(ScoreGradient):
    """dS = (exp(S - lse) - onehot(label)) g; dH = dS E (token rows), dE = dS^T H
    (vocabulary rows)."""

    def __init__(self, problem: LmHeadBackward) -> None:
        self.problem = problem

    def params(self, key_rows: bool, stats_pass: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return self.problem.inputs, (DEMB,) if key_rows else (DH,)

    def param(self, problem: LmHeadBackward, name: str, output: bool) -> kir.Param:
        if name == "labels":
            return kir.Param(name, "i32", problem.rows, is_output=output)
        if name in ROW_VALUES:
            return kir.Param(name, _F32, problem.rows, is_output=output)
        if name in AFFINE:
            return kir.Param(name, problem.dtype, problem.hidden, is_output=output)
        return kir.Param(name, problem.dtype, problem.length(name) * problem.hidden,
                         is_output=output)

    def first_gemms(self, key_rows: bool) -> tuple[tuple[str, str, str], ...]:
        return (("s", "emb", "h"),) if key_rows else (("s", "h", "emb"),)

    def second_gemms(self, key_rows: bool) -> tuple[tuple[str, str, str], ...]:
        return (("grad", "h", DEMB),) if key_rows else (("grad", "emb", DH),)

    def row_values(self, kernel, out: list[kir.Stmt], query: kir.Expr) -> tuple[kir.Expr, ...]:
        if self.problem.stats == "lse":
            lse = kernel.let(out, "lse", kir.Load(kernel.buffers["lse"], query))
        else:
            top = kir.Load(kernel.buffers["row_max"], query)
            total = kir.Load(kernel.buffers["row_sum"], query)
            lse = kernel.let(out, "lse", kir.add(top, kir.Unary("log", total)))
        raw = kernel.let(out, "label0", kir.Load(kernel.buffers["labels"], query))
        # jax's take_along_axis: a negative label counts from the end.
        label = kernel.let(out, "label", kir.Select(
            kir.less(raw, _c(0)), kir.add(raw, _c(kernel.p.vocab)), raw))
        g = kernel.let(out, "g", kir.Load(kernel.buffers["g"], query))
        return lse, label, g

    def element(self, kernel, out: list[kir.Stmt], i: int, j: int, query: kir.Expr,
                key: kir.Expr, valid: kir.Expr,
                values: tuple[kir.Expr, ...]) -> tuple[kir.Expr, kir.Expr]:
        lse, label, g = values
        logit = kernel.rounded(kir.Ref(kernel.s[i][j], _F32))
        prob = kernel.let(out, "p", kir.Select(
            valid, kir.Unary("exp", kir.Binary("sub", logit, lse)), kir.f32(0.0)))
        # Columns past the vocabulary are not valid: a label there is no one-hot.
        hit = kir.logical_and(valid, kir.Compare("eq", key, label))
        onehot = kir.Select(hit, kir.f32(1.0), kir.f32(0.0))
        grad = kernel.let(out, "ds", kernel.rounded(
            kir.mul(kir.Binary("sub", prob, onehot), g)))
        return prob, grad


    def operand_value(self, kernel, out: list[kir.Stmt], source: str, value: kir.Expr,
                      col: kir.Expr) -> kir.Expr:
        if source != "h" or not self.problem.norm_affine:
            return value
        scale, shift = (kir.Load(kernel.params[name], col) for name in AFFINE)
        affine = kir.add(kir.mul(value, scale), shift)
        dtype = self.problem.dtype
        return affine if dtype == _F32 else kir.Unary(f"round_to_{dtype}", affine)


def uses_tensor_cores(problem: LmHeadBackward, arch: str, allow_tf32: bool) -> bool:
    """bf16 / f16 operands on sm_80+, f32 ones as TF32 where the dots allow it."""
    try:
        sm = int(arch.removeprefix("sm_").rstrip("a"))
    except ValueError:
        raise CodegenError(f"unknown arch {arch!r}") from None
    return sm >= 80 and (problem.dtype != _F32 or (allow_tf32 and problem.tf32))


def default_tiling(problem: LmHeadBackward, mma: bool) -> BackwardTiling:
    """Tensor cores: 4 warps of 16 rows, 16-wide column steps, the hidden dim in stages of
    16 and result blocks of ``MMA_BLOCK_H`` (128 accumulators a thread; ptxas at GPT-2's
    size: 254 registers TF32, 240 bf16, 250-254 in XLA's training form, no spills on
    sm_80 / sm_90; 384 spills). FMA:
    32 x 64 tiles of 4 x 4, result blocks of 128 (8 per lane; 256 would pass the shared
    limit). Smaller where the problem is."""
    h8 = 8 * -(-problem.hidden // 8)
    if mma:
        tiling = BackwardTiling(64 if min(problem.rows, problem.vocab) >= 64 else 16, 16, 1,
                                1, 16, min(MMA_BLOCK_H, h8), mma=True)
    else:
        cols = 64 if min(problem.rows, problem.vocab) >= 64 else 16
        thread_cols = 4 if cols >= 32 else 2
        lanes = cols // thread_cols
        block_h = min(128, max(lanes, lanes * -(-problem.hidden // lanes)))
        tiling = BackwardTiling(32, cols, 4, thread_cols, 16, block_h)
    tiling.check()
    return tiling


def recompute_factor(problem: LmHeadBackward, tiling: BackwardTiling) -> int:
    """How many times each phase computes every logit (once per result block of the
    hidden dim)."""
    return -(-problem.hidden // tiling.block_h)


def _prepared(problem: LmHeadBackward, tiling: BackwardTiling | None, arch: str,
              allow_tf32: bool, name: str) -> BackwardTiling:
    problem.check()
    mma = uses_tensor_cores(problem, arch, allow_tf32)
    tiling = tiling or default_tiling(problem, mma)
    if tiling.mma and not mma:
        raise CodegenError(f"{name}: tensor cores need sm_80+ (and, for f32 operands, dots "
                           f"that allow TF32)")
    return tiling


def lower_dh(problem: LmHeadBackward, tiling: BackwardTiling | None = None,
             name: str = "lm_head_dh", arch: str = "sm_70",
             allow_tf32: bool = False) -> kir.Kernel:
    """dH alone: token rows walk the vocabulary (params ``problem.inputs`` then ``dh``)."""
    tiling = _prepared(problem, tiling, arch, allow_tf32, name)
    return backward_phase(problem, tiling, name, False, CrossEntropyGradient(problem)).build()


def lower_demb(problem: LmHeadBackward, tiling: BackwardTiling | None = None,
               name: str = "lm_head_demb", arch: str = "sm_70",
               allow_tf32: bool = False) -> kir.Kernel:
    """dE alone: vocabulary rows walk the tokens (params ``problem.inputs`` then ``demb``)."""
    tiling = _prepared(problem, tiling, arch, allow_tf32, name)
    return backward_phase(problem, tiling, name, True, CrossEntropyGradient(problem)).build()


def lower_lm_head_backward(problem: LmHeadBackward, tiling: BackwardTiling | None = None,
                           name: str = "lm_head_backward", arch: str = "sm_70",
                           allow_tf32: bool = False) -> kir.Kernel:
    """dH and dE in one launch (params ``problem.inputs`` then ``dh``, ``demb``): the phases read
    only the inputs, so no barrier between them; the first blocks run the dH phase, the
    rest the dE phase."""
    tiling = _prepared(problem, tiling, arch, allow_tf32, name)
    bid = kir.BlockIdx()
    rule = CrossEntropyGradient(problem)
    dh = backward_phase(problem, tiling, name, False, rule, prefix="h")
    dh_blocks = dh.grid
    dh_body = dh.body()
    demb = backward_phase(problem, tiling, name, True, rule, prefix="e",
                          block=kir.Binary("sub", bid, _c(dh_blocks)))
    demb.names = dh.names                # Let names stay unique across the phases
    demb_body = demb.body()
    params = (*dh.params.values(), *dh.outs.values(), *demb.outs.values())
    log.debug("%s: %dx%dx%d %s, %d + %d blocks, logits computed %d times per phase", name,
              problem.rows, problem.vocab, problem.hidden, problem.dtype, dh_blocks,
              demb.grid, recompute_factor(problem, tiling))
    return kir.Kernel(name, params, dh.shared, dh_blocks + demb.grid, tiling.threads,
                      (kir.If(kir.less(bid, _c(dh_blocks)), tuple(dh_body), tuple(demb_body)),),
                      register_budget=REGISTER_BUDGET).validate()
