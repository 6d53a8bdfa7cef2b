"""Attention's backward as FlashAttention-2-style kernels: no S x S value in memory.

Both kernels recompute the forward's scores and probabilities tile by tile from Q, K and
the forward's row statistics (the softmax's row max M and row sum L over the keys), so
neither reads nor writes a [batch, queries, keys] buffer:

    S  = scale * Q K^T  (the causal mask, key <= query, recomputed from the indices)
    P  = exp(S - M) / L              (0 where masked)
    dP = dO V^T
    dS = P * (dP - D)                D = rowsum(dO * O) per query
    dQ = scale * dS K,  dK = scale * dS^T Q,  dV = P^T dO

D is an input ([batch, queries] f32): FlashAttention's identity rowsum(dO * O) =
sum_j P_ij dP_ij (O = P V), computed before the kernels by a row reduction. It differs from
the sum over keys only by O's rounding (f32: ~1e-6 relative; a bf16 O: ~4e-3 of D).

``AttentionBackward.dq`` walks the keys for a block of query rows (one accumulator, dQ);
``AttentionBackward.dkv`` walks the queries for a block of key rows, the statistics taken
per tile column (two accumulators, dK and dV). Both are one generic kernel: rows of one
role, columns of the other, two first GEMMs (S and dP) over the head dim in shared-memory
stages, then one or two second GEMMs whose left operand (P or dS) goes through shared
memory, f32 FMA (bf16 storage widened on load). With a causal mask, column tiles wholly
above the diagonal are not visited (the walk's bounds are the block's).

With ``stats_pass`` the dQ kernel needs no statistics from the forward: a first walk over
the keys computes each query row's M, L and D online (the running sum and sum_j e_ij dP_ij
rescaled as the max grows, so D = that / L is XLA's own sum over keys, no O needed) and
writes them ``[batch, queries]`` f32 for the dK/dV kernel, which runs after it.

An operand or result is a [batch, length, head_dim] matrix over its buffer through a
``MatrixView`` (strides; row-major by default); the statistics are ``[batch, queries]``.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from . import kir
from .errors import CodegenError
from .tile_code import TileCode, block_problem, lanes_problem

log = logging.getLogger(__name__)

_c = kir.i32
_F32 = "f32"
# Shared memory one block may use without opting in to more (bytes).
SHARED_LIMIT = 48 * 1024
STORAGE = ("f32", "bf16", "f16")
# .maxnreg of the two-phase kernel: left alone, ptxas kept it at 128 registers and spilled
# 12 bytes on sm_90 (each phase alone: <= 147, no spills).
REGISTER_BUDGET = 168
# Tensor-core head blocks up to this wide (d = 128 in one block: S and dP computed once per
# tile, not once per 64-wide block). dK/dV's two accumulators then take 128 registers a
# thread, so such kernels get the whole register file (ptxas at Llama's 64 x 2048 x 2048 x
# 128, bf16: 240 registers on sm_80, 230 on sm_90, no spills; under 168 it spills ~280 B).
WIDE_HEAD_BLOCK = 128
WIDE_REGISTER_BUDGET = 255


@dataclass(frozen=True)
class MatrixView:
    """Element (b, r, c) of a [batch, length, head_dim] operand at flat offset
    b * batch_stride + r * row_stride + c * col_stride."""
    batch_stride: int
    row_stride: int
    col_stride: int

    @staticmethod
    def row_major(length: int, head_dim: int) -> "MatrixView":
        return MatrixView(length * head_dim, head_dim, 1)


MATRICES = ("q", "k", "v", "d_o", "dq", "dk", "dv")


@dataclass(frozen=True)
class AttentionBackward:
    """One attention's backward: ``batch`` (batch x heads) problems of ``queries`` x
    ``keys`` scores over ``head_dim``; operands stored as ``dtype``."""
    batch: int
    queries: int
    keys: int
    head_dim: int
    scale: float
    causal: bool
    dtype: str = _F32
    # (name in MATRICES, view) where not row-major.
    views: tuple[tuple[str, MatrixView], ...] = ()
    # What XLA's module stores S, P, dP and dS in: bf16 / f16 (its half-precision steps)
    # makes the kernels round where it does (``_BackwardKernel.rounded``).
    intermediates: str = _F32

    def length(self, name: str) -> int:
        return self.queries if name in ("q", "d_o", "dq") else self.keys

    def view(self, name: str) -> MatrixView:
        return dict(self.views).get(name) or MatrixView.row_major(self.length(name),
                                                                  self.head_dim)

    def check(self) -> None:
        if min(self.batch, self.queries, self.keys, self.head_dim) < 1:
            raise CodegenError(f"{self}: every dimension must be positive")
        if self.dtype not in STORAGE:
            raise CodegenError(f"{self}: operands of {self.dtype} are not lowered")
        if self.intermediates not in (_F32, self.dtype):
            raise CodegenError(f"{self}: {self.intermediates} scores of {self.dtype} operands")
        if self.causal and self.queries != self.keys:
            raise CodegenError(f"{self}: a causal mask is lowered for square scores only")
        for name, _ in self.views:
            if name not in MATRICES:
                raise CodegenError(f"{self}: no matrix {name!r}")


@dataclass(frozen=True)
class BackwardTiling:
    """How a backward kernel splits its work: ``block_rows`` rows per block, columns in
    steps of ``block_cols``, the head dim in stages of ``block_k`` for the first GEMMs and
    in blocks of ``block_h`` for the results; a thread holds ``thread_rows`` x
    ``thread_cols`` of each score tile (columns interleaved by the lanes of its row)."""
    block_rows: int = 64
    block_cols: int = 64
    thread_rows: int = 4
    thread_cols: int = 4
    block_k: int = 16
    block_h: int = 64
    mma: bool = False       # tensor cores: a warp per 16 rows (thread_rows / thread_cols
                            # unused), m16n8k8 TF32 for f32, m16n8k16 for bf16 / f16

    @property
    def lanes(self) -> int:
        return 4 if self.mma else self.block_cols // self.thread_cols

    @property
    def threads(self) -> int:
        if self.mma:
            return 2 * self.block_rows
        return self.lanes * (self.block_rows // self.thread_rows)

    @property
    def thread_h(self) -> int:
        return self.block_h // self.lanes

    def shared_bytes(self) -> int:
        return 4 * (self.block_rows * self.block_k + self.block_k * self.block_cols
                    + self.block_rows * self.block_cols + self.block_cols * self.block_h)

    def check(self) -> None:
        def bad(why: str) -> CodegenError:
            return CodegenError(f"backward tiling {self}: {why}")
        if min(self.block_rows, self.block_cols, self.thread_rows, self.thread_cols,
               self.block_k, self.block_h) < 1:
            raise bad("every size must be positive")
        if self.mma:
            if self.block_rows % 16 or self.block_cols % 16 or self.block_k % 16 \
                    or self.block_h % 8:
                raise bad("MMA tiles: block_rows, block_cols and block_k multiples of 16, "
                          "block_h of 8")
        else:
            if self.block_rows % self.thread_rows or self.block_cols % self.thread_cols:
                raise bad("thread tiles must divide the block tile")
            why = lanes_problem(self.lanes, self.block_h, "block_cols / thread_cols")
            if why:
                raise bad(why)
        why = block_problem(self.threads, self.shared_bytes(), SHARED_LIMIT)
        if why:
            raise bad(why)

    @staticmethod
    def default_for(problem: AttentionBackward, two_results: bool,
                    mma: bool = False) -> "BackwardTiling":
        """32 rows x 64 columns, 4 x 4 thread tiles (128 threads) and head blocks of 64 for
        attention sizes (one head block at d = 64: S is computed once per tile; ptxas:
        <= 128 registers for dQ, <= 147 for dK/dV's two accumulators, no spills on sm_80 /
        sm_90); smaller column steps and head blocks where the problem is small.
        ``two_results``: the columns are queries (dK/dV). ``mma``: tensor cores, 4 warps
        of 16 rows, 16-wide column steps, head dim in stages of 16 and blocks of up to
        ``WIDE_HEAD_BLOCK`` (ptxas: <= 162 registers for the two-phase kernel at GPT-2's
        d = 64, <= 240 at d = 128 under ``WIDE_REGISTER_BUDGET``, no spills on sm_80 /
        sm_90, f32 as TF32 and bf16)."""
        if mma:
            rows = problem.keys if two_results else problem.queries
            tiling = BackwardTiling(64 if rows >= 64 else 16 * -(-rows // 16), 16, 1, 1, 16,
                                    min(WIDE_HEAD_BLOCK, 8 * -(-problem.head_dim // 8)),
                                    mma=True)
            tiling.check()
            return tiling
        cols = 64 if (problem.queries if two_results else problem.keys) >= 64 else 16
        thread_cols = 4 if cols >= 32 else 2
        lanes = cols // thread_cols
        block_h = min(64, max(lanes, _pow2_at_least(problem.head_dim)))
        tiling = BackwardTiling(32, cols, 4, thread_cols,
                                min(16, _pow2_at_least(problem.head_dim)), block_h)
        tiling.check()
        return tiling


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


# Param names of the kernels, in order.
OPERANDS = ("q", "k", "v", "d_o")
STATS = ("row_max", "row_sum", "delta")
DQ_INPUTS = (*OPERANDS, *STATS)
DQ_OUTPUTS = ("dq",)
DKV_OUTPUTS = ("dk", "dv")


def dq_params(stats_pass: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The dQ kernel's (inputs, outputs) by name: with ``stats_pass`` it writes the
    statistics instead of reading them."""
    return (OPERANDS, ("dq", *STATS)) if stats_pass else (DQ_INPUTS, DQ_OUTPUTS)


def lower_dq(problem: AttentionBackward, tiling: BackwardTiling | None = None,
             name: str = "attention_dq", stats_pass: bool = False) -> kir.Kernel:
    """dQ: a block of query rows walks the keys (params ``dq_params(stats_pass)``)."""
    problem.check()
    tiling = tiling or BackwardTiling.default_for(problem, two_results=False)
    return _kernel_class(tiling)(problem, tiling, name, key_rows=False,
                                 stats_pass=stats_pass).build()


def lower_dkv(problem: AttentionBackward, tiling: BackwardTiling | None = None,
              name: str = "attention_dkv") -> kir.Kernel:
    """dK and dV: a block of key rows walks the queries (params ``DQ_INPUTS`` then ``dk``,
    ``dv``)."""
    problem.check()
    tiling = tiling or BackwardTiling.default_for(problem, two_results=True)
    return _kernel_class(tiling)(problem, tiling, name, key_rows=True).build()


def uses_tensor_cores(problem: AttentionBackward, arch: str, allow_tf32: bool) -> bool:
    """bf16 / f16 operands on sm_80+, f32 ones as TF32 where the dots allow it."""
    try:
        sm = int(arch.removeprefix("sm_").rstrip("a"))
    except ValueError:
        raise CodegenError(f"unknown arch {arch!r}") from None
    return sm >= 80 and (problem.dtype != _F32 or allow_tf32)


def lower_attention_backward(problem: AttentionBackward, tiling: BackwardTiling | None = None,
                             name: str = "attention_backward", arch: str = "sm_70",
                             allow_tf32: bool = False) -> kir.Kernel:
    """dQ, dK and dV in one kernel of two phases (params ``OPERANDS`` then ``dq``,
    ``dk``, ``dv``): the dQ kernel with its statistics pass, the statistics in global
    scratch, a grid barrier (on a GPU: a second launch), the dK/dV kernel. Nothing but the
    operands is read; square scores only (both phases then have the same grid)."""
    problem.check()
    if problem.queries != problem.keys:
        raise CodegenError(f"{name}: one kernel for both phases needs square scores")
    tiling = tiling or BackwardTiling.default_for(
        problem, two_results=True, mma=uses_tensor_cores(problem, arch, allow_tf32))
    if tiling.mma and not uses_tensor_cores(problem, arch, allow_tf32):
        raise CodegenError(f"{name}: tensor cores need sm_80+ (and, for f32 operands, dots "
                           f"that allow TF32)")
    scratch = {k: kir.GlobalScratch(k, _F32, problem.batch * problem.queries) for k in STATS}
    layout = _kernel_class(tiling)
    dq = layout(problem, tiling, name, key_rows=False, stats_pass=True,
                         stats_scratch=scratch, prefix="q")
    first = dq.body()
    dkv = layout(problem, tiling, name, key_rows=True, stats_scratch=scratch,
                          prefix="kv")
    dkv.names = dq.names                 # Let names stay unique across the phases
    second = dkv.body()
    params = (*dq.params.values(), *dq.outs.values(), *dkv.outs.values())
    return kir.Kernel(name, params, dq.shared, dq.grid, tiling.threads,
                      (*first, kir.GridBarrier(), *second), tuple(scratch.values()),
                      "relaunch", register_budget=register_budget(tiling)).validate()


def register_budget(tiling: BackwardTiling) -> int:
    """The two-phase kernel's .maxnreg: the whole register file for head blocks wider
    than 64 (two accumulators of block_h / 4 x 2 values a thread under tensor cores)."""
    return REGISTER_BUDGET if tiling.block_h <= 64 else WIDE_REGISTER_BUDGET


def head_blocks(problem: AttentionBackward, tiling: BackwardTiling) -> int:
    """How many head blocks each row block is split into: S and dP are computed once per
    block (each block recomputes them for its own slice of dQ, dK and dV)."""
    return -(-problem.head_dim // tiling.block_h)


class ScoreGradient:
    """The "gradient of S" rule of a backward kernel (``backward_phase``): what the kernel
    computes from its score tiles. The tile loops (first GEMMs over the contraction dim,
    the walk over column tiles, second GEMMs through shared memory or MMA fragments, the
    stores) are the kernel's; the rule names the params, the first GEMMs after S, the
    values loaded per score row (of the problem's query role), each element's (P, dS),
    and the second GEMMs. Attention's softmax (``SoftmaxAttentionGradient``) and the LM
    head's cross-entropy (``codegen.lm_head_backward``) are the two."""

    # A statistics walk before the main one (the dQ kernel's ``stats_pass``).
    has_stats_pass = False

    def params(self, key_rows: bool, stats_pass: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(inputs, outputs) of one phase, by name."""
        raise NotImplementedError

    def param(self, problem, name: str, output: bool) -> kir.Param:
        raise NotImplementedError

    def first_gemms(self, key_rows: bool) -> tuple[tuple[str, str, str], ...]:
        """(tile, rows' operand, columns' operand) per first GEMM; tile "s" first."""
        raise NotImplementedError

    def second_gemms(self, key_rows: bool) -> tuple[tuple[str, str, str], ...]:
        """(left: "grad" or "prob", the right operand, the result) per second GEMM."""
        raise NotImplementedError

    def row_values(self, kernel: "_BackwardKernel", out: list[kir.Stmt],
                   query: kir.Expr) -> tuple[kir.Expr, ...]:
        """The values of query-role row ``query`` the gradient needs."""
        raise NotImplementedError

    def after_first_gemms(self, kernel: "_BackwardKernel", out: list[kir.Stmt]) -> None:
        """Anything done to the first GEMMs' tiles before they are used."""

    def element(self, kernel: "_BackwardKernel", out: list[kir.Stmt], i: int, j: int,
                query: kir.Expr, key: kir.Expr, valid: kir.Expr,
                values: tuple[kir.Expr, ...]) -> tuple[kir.Expr, kir.Expr]:
        """(P, dS) of the thread's tile element (i, j) as the second GEMMs take them."""
        raise NotImplementedError

    def result_scale(self, problem, result: str) -> float:
        """A constant the result is multiplied by when stored."""
        return 1.0

    def operand_value(self, kernel: "_BackwardKernel", out: list[kir.Stmt], source: str,
                      value: kir.Expr, col: kir.Expr) -> kir.Expr:
        """Operand ``source``'s element as the GEMMs take it, from its loaded ``value``
        at contraction column ``col`` (a prologue XLA fused into its GEMM)."""
        return value


class SoftmaxAttentionGradient(ScoreGradient):
    """Softmax attention: P = exp(c S - M) / L, dS = P (dP - D) with dP = dO V^T a second
    first GEMM; dQ = c dS K for query rows, dK = c dS^T Q and dV = P^T dO for key rows."""

    has_stats_pass = True

    def params(self, key_rows: bool, stats_pass: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return (DQ_INPUTS, DKV_OUTPUTS) if key_rows else dq_params(stats_pass)

    def param(self, problem, name: str, output: bool) -> kir.Param:
        b = problem.batch
        if name in STATS:
            return kir.Param(name, _F32, b * problem.queries, is_output=output)
        return kir.Param(name, problem.dtype, b * problem.length(name) * problem.head_dim,
                         is_output=output)

    def first_gemms(self, key_rows: bool) -> tuple[tuple[str, str, str], ...]:
        # Rows' operands of S and dP: (Q, dO) for query rows, (K, V) for key rows.
        if key_rows:
            return (("s", "k", "q"), ("dp", "v", "d_o"))
        return (("s", "q", "k"), ("dp", "d_o", "v"))

    def second_gemms(self, key_rows: bool) -> tuple[tuple[str, str, str], ...]:
        # dQ += dS K;  dK += dS^T Q (dS^T is this tile), dV += P^T dO.
        if key_rows:
            return (("grad", "q", "dk"), ("prob", "d_o", "dv"))
        return (("grad", "k", "dq"),)

    def row_values(self, kernel: "_BackwardKernel", out: list[kir.Stmt],
                   query: kir.Expr) -> tuple[kir.Expr, ...]:
        at = kernel.let(out, "qs", kir.add(kir.mul(kernel.batch, _c(kernel.p.queries)), query))
        return tuple(kernel.let(out, name, kir.Load(kernel.buffers[name], at))
                     for name in STATS)

    def after_first_gemms(self, kernel: "_BackwardKernel", out: list[kir.Stmt]) -> None:
        if kernel.p.intermediates != _F32:         # dP as XLA's GEMM stores it
            for row in kernel.tiles["dp"]:
                for name in row:
                    out.append(kir.Assign(name, kernel.rounded(kir.Ref(name, _F32))))

    def element(self, kernel: "_BackwardKernel", out: list[kir.Stmt], i: int, j: int,
                query: kir.Expr, key: kir.Expr, valid: kir.Expr,
                values: tuple[kir.Expr, ...]) -> tuple[kir.Expr, kir.Expr]:
        p = kernel.p
        mx, total, delta = values
        e = kir.Unary("exp", kir.Binary("sub", kernel.scaled_score(i, j), mx))
        prob = kernel.let(out, "p", kir.Select(valid, kir.Binary("div", e, total),
                                               kir.f32(0.0)))
        grad = kernel.let(out, "ds", kir.mul(prob, kir.Binary(
            "sub", kir.Ref(kernel.tiles["dp"][i][j], _F32), delta)))
        if p.intermediates != _F32:
            # XLA's stored P for dV, and its stored dS scaled in dQ's / dK's
            # GEMM prologue (the store then leaves the scale out).
            prob = kernel.let(out, "pr", kernel.rounded(prob))
            grad = kernel.let(out, "dsr", kernel.rounded(
                kir.mul(kernel.rounded(grad), kir.f32(p.scale))))
        return prob, grad

    def result_scale(self, problem, result: str) -> float:
        return 1.0 if result == "dv" or problem.intermediates != _F32 else problem.scale


ATTENTION = SoftmaxAttentionGradient()


def backward_phase(problem, tiling: BackwardTiling, name: str, key_rows: bool,
                   rule: ScoreGradient, prefix: str = "",
                   block: kir.Expr | None = None) -> "_BackwardKernel":
    """One phase of a backward kernel under ``rule`` (rows of the problem's query role
    when not ``key_rows``): ``.body()`` its statements, ``.params`` / ``.outs`` its
    params, ``.shared``, ``.grid`` its blocks, ``.names`` its Let counter (share it
    across phases of one kernel); ``block`` (default blockIdx): the phase's block index
    where several phases share a launch. ``problem`` has an ``AttentionBackward``'s
    sizes (``batch``, ``queries``, ``keys``, ``head_dim``, ``scale``, ``causal``,
    ``dtype``, ``intermediates``, ``view``)."""
    return _kernel_class(tiling)(problem, tiling, name, key_rows=key_rows, prefix=prefix,
                                 rule=rule, block=block)


class _BackwardKernel(TileCode):
    """Rows of one role (queries for dQ, keys for dK/dV), columns of the other. Thread
    (ty, tx) owns tile rows ty * thread_rows + i and columns tx + j * lanes."""

    def __init__(self, problem: AttentionBackward, tiling: BackwardTiling, name: str,
                 key_rows: bool, stats_pass: bool = False,
                 stats_scratch: dict[str, kir.GlobalScratch] | None = None,
                 prefix: str = "", rule: ScoreGradient = ATTENTION,
                 block: kir.Expr | None = None) -> None:
        tiling.check()
        if stats_pass and (key_rows or not rule.has_stats_pass):
            raise CodegenError(f"{name}: the statistics pass walks keys for query rows")
        self.p, self.t, self.name, self.key_rows = problem, tiling, name, key_rows
        self.stats_pass = stats_pass
        self.rule = rule
        self.block_index = block if block is not None else kir.BlockIdx()

        inputs, outputs = rule.params(key_rows, stats_pass)
        if stats_scratch is not None:       # the statistics cross a grid barrier instead
            inputs = tuple(k for k in inputs if k not in STATS)
            outputs = tuple(k for k in outputs if k not in STATS)
        self.params = {k: rule.param(problem, k, False) for k in inputs}
        self.outs = {k: rule.param(problem, k, True) for k in outputs}
        self.buffers: dict[str, kir.Param | kir.GlobalScratch] = {
            **self.params, **(stats_scratch or {})}
        self.prefix = prefix
        # Row length / column length (rows: keys for dK/dV).
        m, n = problem.queries, problem.keys
        self.row_len, self.col_len = (n, m) if key_rows else (m, n)
        t = tiling
        self.sa = kir.Shared("tile_a", _F32, t.block_rows * t.block_k)
        self.sb = kir.Shared("tile_b", _F32, t.block_k * t.block_cols)
        self.sp = kir.Shared("tile_p", _F32, t.block_rows * t.block_cols)
        self.sc = kir.Shared("tile_c", _F32, t.block_cols * t.block_h)
        self.names = 0

    def rounded(self, expr: kir.Expr) -> kir.Expr:
        """``expr`` rounded to the type XLA stores the scores-sized values in (itself for
        f32): S after its scale, dP, P as dV's operand, dS and c * dS as dQ's / dK's."""
        if self.p.intermediates == _F32:
            return expr
        return kir.Unary(f"round_to_{self.p.intermediates}", expr)

    def scaled_score(self, i: int, j: int) -> kir.Expr:
        """c * S of the thread's element (i, j), stored as XLA stores S."""
        raw = kir.Ref(self.s[i][j], _F32)
        return self.rounded(kir.mul(self.rounded(raw), kir.f32(self.p.scale)))

    def offset(self, name: str, row: kir.Expr, col: kir.Expr) -> kir.Expr:
        view = self.p.view(name)
        terms = [kir.mul(x, _c(stride)) if stride != 1 else x
                 for x, stride in ((self.batch, view.batch_stride), (row, view.row_stride),
                                   (col, view.col_stride)) if stride]
        out = terms[0] if terms else _c(0)
        for term in terms[1:]:
            out = kir.add(out, term)
        return out

    # --- loads ----------------------------------------------------------------------------
    def operand_load(self, out: list[kir.Stmt], tile: kir.Shared, source: str, length: int,
                     start: kir.Expr, r0: kir.Expr, rows: int, k0: kir.Expr, cols: int,
                     transposed: bool) -> None:
        """tile = source[b, start + i, k0 + c] for i < rows, c < cols (zeros past the
        edges); ``transposed`` stores it as [c, i] (a first GEMM's B tile). The threads
        stride along the head dim, the operand's unit stride."""
        param = self.params[source]
        self.load_tile(out, tile, rows, cols, kir.add(start, r0), k0, length, self.p.head_dim,
                       lambda r, c: self.offset(source, r, c),
                       lambda body, at, c: self.rule.operand_value(self, body, source,
                                                                   kir.Load(param, at), c),
                       transposed=transposed)

    def stage_operands(self, out: list[kir.Stmt], acc: list[list[str]], a: str, b: str,
                       c0: kir.Expr) -> list[kir.Stmt]:
        """How a first GEMM starts (both layouts): ``acc`` zeroed, then the body of its k0
        loop begun: A's rows and B's columns (c0..) of the k0 stage into shared memory
        (B transposed), a barrier."""
        t = self.t
        for row in acc:
            for name in row:
                out.append(kir.Assign(name, kir.f32(0.0)))
        k0 = kir.Ref("k0", "i32")
        k_body: list[kir.Stmt] = []
        self.operand_load(k_body, self.sa, a, self.row_len, self.r0, _c(0), t.block_rows,
                          k0, t.block_k, transposed=False)
        self.operand_load(k_body, self.sb, b, self.col_len, c0, _c(0), t.block_cols, k0,
                          t.block_k, transposed=True)
        k_body.append(kir.Barrier())
        return k_body

    # --- the kernel -----------------------------------------------------------------------
    @property
    def grid(self) -> int:
        t = self.t
        return self.p.batch * -(-self.row_len // t.block_rows) * -(-self.p.head_dim // t.block_h)

    @property
    def shared(self) -> tuple[kir.Shared, ...]:
        return (self.sa, self.sb, self.sp, self.sc)

    def build(self) -> kir.Kernel:
        params = (*self.params.values(), *self.outs.values())
        return kir.Kernel(self.name, params, self.shared, self.grid, self.t.threads,
                          tuple(self.body())).validate()

    def layout(self, body: list[kir.Stmt]) -> None:
        """FMA: ``rows`` (global), ``row_in_tile``, ``cols`` (tile-relative), ``acc_h``
        (each accumulator column's head-dim offset from h0), ``shuffle_lanes`` and
        ``first_lane`` (the lane of a row that writes its statistics)."""
        t = self.t
        tid = kir.ThreadIdx()
        self.tx = self.let(body, "tx", kir.Binary("rem", tid, _c(t.lanes)))
        self.ty = self.let(body, "ty", kir.Binary("div", tid, _c(t.lanes)))
        self.row_in_tile = [kir.add(kir.mul(self.ty, _c(t.thread_rows)), _c(i))
                            for i in range(t.thread_rows)]
        self.rows = [kir.add(self.r0, r) for r in self.row_in_tile]
        self.cols = [kir.add(self.tx, _c(j * t.lanes)) for j in range(t.thread_cols)]
        self.acc_h = [kir.add(self.tx, _c(j * t.lanes)) for j in range(t.thread_h)]
        self.shuffle_lanes = t.lanes
        self.first_lane = kir.Compare("eq", self.tx, _c(0))

    def body(self) -> list[kir.Stmt]:
        p, t = self.p, self.t
        row_blocks = -(-self.row_len // t.block_rows)
        h_blocks = -(-p.head_dim // t.block_h)
        body: list[kir.Stmt] = []
        bid = self.block_index
        hb = self.let(body, "hb", kir.Binary("rem", bid, _c(h_blocks)))
        rb = self.let(body, "rb", kir.Binary("rem", kir.Binary("div", bid, _c(h_blocks)),
                                             _c(row_blocks)))
        self.batch = self.let(body, "batch", kir.Binary("div", bid, _c(h_blocks * row_blocks)))
        self.r0 = self.let(body, "r0", kir.mul(rb, _c(t.block_rows)))
        self.h0 = self.let(body, "h0", kir.mul(hb, _c(t.block_h)))
        self.layout(body)
        n_rows, n_cols = len(self.rows), len(self.cols)
        self.tiles = {tile: [[f"{self.prefix}{tile}_{i}_{j}" for j in range(n_cols)]
                             for i in range(n_rows)]
                      for tile, _, _ in self.rule.first_gemms(self.key_rows)}
        self.s, self.dp = self.tiles["s"], self.tiles.get("dp")
        results = [res for _, _, res in self.rule.second_gemms(self.key_rows)]
        self.acc = {res: [[f"{res}_{i}_{j}" for j in range(len(self.acc_h))]
                          for i in range(n_rows)] for res in results}
        for grid in (*self.tiles.values(), *self.acc.values()):
            for row in grid:
                for name in row:
                    body.append(kir.Local(name, _F32, kir.f32(0.0)))
        lo, hi = self.walk_bounds(body)
        # The rows' statistics (dQ: the rows are queries): computed by a first walk, or
        # loaded once.
        if self.stats_pass:
            for i in range(len(self.rows)):
                body.append(kir.Local(f"mx_{i}", _F32, kir.f32(float("-inf"))))
                body.append(kir.Local(f"sum_{i}", _F32, kir.f32(0.0)))
                body.append(kir.Local(f"wdp_{i}", _F32, kir.f32(0.0)))
            body.append(kir.For("c0", lo, hi, _c(t.block_cols), tuple(self.stats_step())))
            self.row_stats = self.finish_stats(body)
        else:
            self.row_stats = None if self.key_rows else [
                self.stats(body, kir.minimum(row, _c(p.queries - 1))) for row in self.rows]
        body.append(kir.For("c0", lo, hi, _c(t.block_cols), tuple(self.step())))
        body.extend(self.store())
        return body

    def walk_bounds(self, body: list[kir.Stmt]) -> tuple[kir.Expr, kir.Expr]:
        """The column steps a block visits: with a causal mask (key <= query) dQ's query
        rows stop at the block's last row, dK/dV's key rows start at the step holding
        the block's first key."""
        t = self.t
        if not self.p.causal:
            return _c(0), _c(self.col_len)
        if self.key_rows:
            first = kir.mul(kir.Binary("div", self.r0, _c(t.block_cols)), _c(t.block_cols))
            return self.let(body, "lo", first), _c(self.col_len)
        last = kir.minimum(kir.add(self.r0, _c(t.block_rows)), _c(self.col_len))
        return _c(0), self.let(body, "hi", last)

    def stats(self, out: list[kir.Stmt], query: kir.Expr) -> tuple[kir.Expr, ...]:
        return self.rule.row_values(self, out, query)

    def first_gemm(self, out: list[kir.Stmt], acc: list[list[str]], a: str, b: str,
                   c0: kir.Expr) -> None:
        """acc = A[rows, :] x B[c0 + cols, :]^T over the head dim in shared stages."""
        p, t = self.p, self.t
        k_body = self.stage_operands(out, acc, a, b, c0)
        inner: list[kir.Stmt] = []
        kk = kir.Ref("kk", "i32")
        av = [self.let(inner, "a", kir.Load(self.sa, kir.add(kir.mul(r, _c(t.block_k)), kk)))
              for r in self.row_in_tile]
        bv = [self.let(inner, "b", kir.Load(self.sb, kir.add(kir.mul(kk, _c(t.block_cols)), c)))
              for c in self.cols]
        for i, row in enumerate(acc):
            for j, name in enumerate(row):
                inner.append(kir.Assign(name, kir.add(kir.Ref(name, _F32), kir.mul(av[i], bv[j]))))
        k_body.append(kir.For("kk", _c(0), _c(t.block_k), _c(1), tuple(inner)))
        k_body.append(kir.Barrier())
        out.append(kir.For("k0", _c(0), _c(p.head_dim), _c(t.block_k), tuple(k_body)))

    def scores(self, out: list[kir.Stmt], c0: kir.Expr
               ) -> tuple[list[kir.Expr], list[list[kir.Expr]]]:
        """S and dP of this column step in registers; the columns and each element's
        validity (inside the problem, not masked)."""
        p = self.p
        for tile, a, b in self.rule.first_gemms(self.key_rows):
            self.first_gemm(out, self.tiles[tile], a, b, c0)
        self.rule.after_first_gemms(self, out)
        cols = [self.let(out, "col", kir.add(c0, c)) for c in self.cols]
        valid: list[list[kir.Expr]] = []
        for row in self.rows:
            row_valid = []
            for col in cols:
                query, key = (col, row) if self.key_rows else (row, col)
                ok = kir.logical_and(kir.less(row, _c(self.row_len)),
                                     kir.less(col, _c(self.col_len)))
                if p.causal:
                    ok = kir.logical_and(ok, kir.Compare("le", key, query))
                row_valid.append(self.let(out, "ok", ok))
            valid.append(row_valid)
        return cols, valid

    def stats_step(self) -> list[kir.Stmt]:
        """One column step of the statistics walk: the rows' running max, sum of
        exp(S - max) and sum of exp(S - max) dP, both sums rescaled as the max grows."""
        out: list[kir.Stmt] = []
        _, valid = self.scores(out, kir.Ref("c0", "i32"))
        ninf = kir.f32(float("-inf"))
        for i in range(len(self.rows)):
            x = [self.let(out, "x", kir.Select(ok, self.scaled_score(i, j), ninf))
                 for j, ok in enumerate(valid[i])]
            old = kir.Ref(f"mx_{i}", _F32)
            new = self.let(out, "mnew", kir.Binary("max", old, self.row_reduce(out, "max", x)))
            dead = self.let(out, "dead", kir.Compare("eq", new, ninf))
            rescale = self.let(out, "f", kir.Select(dead, kir.f32(1.0), kir.Unary(
                "exp", kir.Binary("sub", old, new))))
            e = [self.let(out, "e", kir.Select(dead, kir.f32(0.0), kir.Unary(
                "exp", kir.Binary("sub", xj, new)))) for xj in x]
            total = self.row_reduce(out, "add", e)
            weighted = self.row_reduce(out, "add", [
                kir.mul(ej, kir.Ref(self.dp[i][j], _F32)) for j, ej in enumerate(e)])
            for name, step in ((f"sum_{i}", total), (f"wdp_{i}", weighted)):
                out.append(kir.Assign(name, kir.add(kir.mul(kir.Ref(name, _F32), rescale), step)))
            out.append(kir.Assign(f"mx_{i}", new))
        return out

    def finish_stats(self, body: list[kir.Stmt]) -> list[tuple[kir.Expr, ...]]:
        """After the statistics walk: each row's (M, L, D = sum e dP / L; 0 for a row
        with nothing valid), written out by the row's first lane."""
        p = self.p
        stats = []
        for i, row in enumerate(self.rows):
            mx, total = kir.Ref(f"mx_{i}", _F32), kir.Ref(f"sum_{i}", _F32)
            delta = self.let(body, "delta", kir.Select(
                kir.Compare("eq", total, kir.f32(0.0)), kir.f32(0.0),
                kir.Binary("div", kir.Ref(f"wdp_{i}", _F32), total)))
            stats.append((mx, total, delta))
            at = kir.add(kir.mul(self.batch, _c(p.queries)), row)
            cond = kir.logical_and(kir.less(row, _c(p.queries)), self.first_lane)
            body.append(kir.If(cond, tuple(kir.Store(name, at, value) for name, value in
                                           zip(STATS, (mx, total, delta)))))
        return stats

    def step(self) -> list[kir.Stmt]:
        p = self.p
        out: list[kir.Stmt] = []
        c0 = kir.Ref("c0", "i32")
        cols, valid_tile = self.scores(out, c0)
        col_stats = [self.stats(out, kir.minimum(col, _c(p.queries - 1))) for col in cols] \
            if self.key_rows else None
        probs: list[list[kir.Expr]] = []
        grads: list[list[kir.Expr]] = []
        for i, row in enumerate(self.rows):
            prow, grow = [], []
            for j, col in enumerate(cols):
                values = col_stats[j] if self.key_rows else self.row_stats[i]
                query, key = (col, row) if self.key_rows else (row, col)
                prob, grad = self.rule.element(self, out, i, j, query, key,
                                               valid_tile[i][j], values)
                prow.append(prob)
                grow.append(grad)
            probs.append(prow)
            grads.append(grow)
        lefts = {"grad": grads, "prob": probs}
        for left, source, result in self.rule.second_gemms(self.key_rows):
            self.second_gemm(out, lefts[left], source, result, c0)
        return out

    def second_gemm(self, out: list[kir.Stmt], left: list[list[kir.Expr]], source: str,
                    result: str, c0: kir.Expr) -> None:
        """acc[result] += left[rows, :] x source[c0 + :, h0 + :], left through shared."""
        t = self.t
        for i in range(t.thread_rows):
            for j in range(t.thread_cols):
                index = kir.add(kir.mul(self.row_in_tile[i], _c(t.block_cols)), self.cols[j])
                out.append(kir.Store(self.sp.name, index, left[i][j]))
        self.operand_load(out, self.sc, source, self.col_len, c0, _c(0), t.block_cols,
                          self.h0, t.block_h, transposed=False)
        out.append(kir.Barrier())
        inner: list[kir.Stmt] = []
        cc = kir.Ref("cc", "i32")
        pv = [self.let(inner, "pv", kir.Load(self.sp, kir.add(kir.mul(r, _c(t.block_cols)), cc)))
              for r in self.row_in_tile]
        cv = [self.let(inner, "cv", kir.Load(self.sc, kir.add(kir.mul(cc, _c(t.block_h)), h)))
              for h in self.acc_h]
        for i, row in enumerate(self.acc[result]):
            for j, name in enumerate(row):
                inner.append(kir.Assign(name, kir.add(kir.Ref(name, _F32), kir.mul(pv[i], cv[j]))))
        out.append(kir.For("cc", _c(0), _c(t.block_cols), _c(1), tuple(inner)))
        out.append(kir.Barrier())

    def store(self) -> list[kir.Stmt]:
        """Each thread's accumulators; dQ and dK carry the score scale."""
        p = self.p
        out: list[kir.Stmt] = []
        for result, grid in self.acc.items():
            scale = self.rule.result_scale(p, result)
            for i, row in enumerate(self.rows):
                for j, name in enumerate(grid[i]):
                    h = kir.add(self.h0, self.acc_h[j])
                    value: kir.Expr = kir.Ref(name, _F32)
                    if scale != 1.0:
                        value = kir.mul(value, kir.f32(scale))
                    index = self.offset(result, row, h)
                    cond = kir.logical_and(kir.less(row, _c(self.row_len)),
                                           kir.less(h, _c(p.head_dim)))
                    out.append(kir.If(cond, (kir.Store(result, index, value),)))
        return out


class _MmaBackwardKernel(_BackwardKernel):
    """Tensor cores (kir.MmaSync), as the GEMM-chain kernel lays them out: warp w owns
    tile rows 16 w .. 16 w + 15; lane (g = lane >> 2, q = lane & 3) holds rows g and g + 8
    of every 16 x 8 score tile at columns 2q, 2q + 1 (the MMA's D layout); a row's four
    lanes meet by xor shuffles 1 and 2. P / dS go from registers into the second GEMMs as
    their A fragments (FlashAttention-2): TF32 (m16n8k8) renumbers one tile's 8 columns
    (2q -> q, 2q + 1 -> q + 4) and reads the B rows in the same order; bf16 / f16
    (m16n8k16) take two neighbouring tiles."""

    def layout(self, body: list[kir.Stmt]) -> None:
        t = self.t
        self.dtype = "tf32" if self.p.dtype == _F32 else self.p.dtype
        tid = kir.ThreadIdx()
        lane = self.let(body, "lane", kir.Binary("rem", tid, _c(32)))
        self.warp_row = self.let(body, "wrow", kir.mul(kir.Binary("div", tid, _c(32)), _c(16)))
        self.g = self.let(body, "g", kir.Binary("div", lane, _c(4)))
        self.q = self.let(body, "q", kir.Binary("rem", lane, _c(4)))
        self.q2 = self.let(body, "q2", kir.mul(self.q, _c(2)))
        self.row_in_tile = [kir.add(self.warp_row, kir.add(self.g, _c(8 * i))) for i in range(2)]
        self.rows = [kir.add(self.r0, r) for r in self.row_in_tile]
        self.cols = [kir.add(self.q2, _c(8 * (j // 2) + j % 2)) for j in range(t.block_cols // 4)]
        self.acc_h = [kir.add(self.q2, _c(8 * (j // 2) + j % 2)) for j in range(t.block_h // 4)]
        self.shuffle_lanes = 4
        self.first_lane = kir.Compare("eq", self.q, _c(0))
        self.tx = self.q

    @property
    def depth(self) -> int:
        return kir.MMA_SHAPES[self.dtype][2]

    def a_fragment(self, width: int, k0: int) -> list[kir.Expr]:
        """A[warp rows, k0 ..] of the row-major [block_rows, width] tile_a."""
        if self.dtype == "tf32":     # a[i] = A[g + 8 (i odd)][q + 4 (i >= 2)]
            places = [(8 * (i % 2), self.q, 4 * (i // 2)) for i in range(4)]
        else:                        # a[i] = A[g + 8 (i//2 odd)][2q + i%2 + 8 (i >= 4)]
            places = [(8 * ((i // 2) % 2), self.q2, i % 2 + 8 * (i // 4)) for i in range(8)]
        return [kir.Load(self.sa, kir.add(kir.mul(kir.add(self.warp_row, kir.add(self.g, _c(dr))),
                                            _c(width)), kir.add(col, _c(k0 + dc))))
                for dr, col, dc in places]

    def b_rows(self, k0: int) -> list[kir.Expr]:
        """The k rows of this lane's B fragment (b[i] = B[row_i][g])."""
        if self.dtype == "tf32":     # b[i] = B[q + 4 i][g]
            return [kir.add(self.q, _c(k0 + 4 * i)) for i in range(2)]
        return [kir.add(self.q2, _c(k0 + i % 2 + 8 * (i // 2))) for i in range(4)]

    def tile_acc(self, grid: list[list[str]], tile: int) -> list[str]:
        """The four accumulators of 16 x 8 tile ``tile`` (D layout order)."""
        return [grid[0][2 * tile], grid[0][2 * tile + 1], grid[1][2 * tile],
                grid[1][2 * tile + 1]]

    def first_gemm(self, out: list[kir.Stmt], acc: list[list[str]], a: str, b: str,
                   c0: kir.Expr) -> None:
        p, t = self.p, self.t
        k_body = self.stage_operands(out, acc, a, b, c0)
        for kc in range(0, t.block_k, self.depth):
            frag = self.a_fragment(t.block_k, kc)
            for nt in range(t.block_cols // 8):
                col = kir.add(self.g, _c(8 * nt))
                bv = [kir.Load(self.sb, kir.add(kir.mul(r, _c(t.block_cols)), col))
                      for r in self.b_rows(kc)]
                self.mma(k_body, frag, bv, self.tile_acc(acc, nt))
        k_body.append(kir.Barrier())
        out.append(kir.For("k0", _c(0), _c(p.head_dim), _c(t.block_k), tuple(k_body)))

    def second_gemm(self, out: list[kir.Stmt], left: list[list[kir.Expr]], source: str,
                    result: str, c0: kir.Expr) -> None:
        t = self.t
        self.operand_load(out, self.sc, source, self.col_len, c0, _c(0), t.block_cols,
                          self.h0, t.block_h, transposed=False)
        out.append(kir.Barrier())
        for chunk in range(t.block_cols // self.depth):
            if self.dtype == "tf32":
                j0 = 2 * chunk
                a = [left[0][j0], left[1][j0], left[0][j0 + 1], left[1][j0 + 1]]
                rows = [kir.add(self.q2, _c(8 * chunk + i)) for i in range(2)]
            else:
                j0 = 4 * chunk
                a = [left[0][j0], left[0][j0 + 1], left[1][j0], left[1][j0 + 1],
                     left[0][j0 + 2], left[0][j0 + 3], left[1][j0 + 2], left[1][j0 + 3]]
                rows = self.b_rows(16 * chunk)
            for ht in range(t.block_h // 8):
                col = kir.add(self.g, _c(8 * ht))
                bv = [kir.Load(self.sc, kir.add(kir.mul(r, _c(t.block_h)), col)) for r in rows]
                self.mma(out, a, bv, self.tile_acc(self.acc[result], ht))
        out.append(kir.Barrier())


def _kernel_class(tiling: BackwardTiling) -> type:
    return _MmaBackwardKernel if tiling.mma else _BackwardKernel


def problem_for(match) -> AttentionBackward:
    """The kernels' problem for a recognized backward
    (``stitch.hlo.attention_backward.AttentionBackwardMatch``): its sizes, scale,
    mask, type and every operand's and result's strides."""
    strides = dict(match.operand_strides) | dict(match.result_strides)
    views = tuple((name, MatrixView(st.batch, st.rows, st.cols))
                  for name, st in strides.items())
    return AttentionBackward(match.batch, match.queries, match.keys, match.head_dim,
                             match.scale, match.causal, match.dtype, views,
                             match.intermediates)
