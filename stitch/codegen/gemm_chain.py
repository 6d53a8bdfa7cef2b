"""Lowering of a GEMM chain (``stitch.hlo_passes.gemm_chains.GemmChain``) to one Kernel IR kernel.

The kernel has FlashAttention's / MCFuser's shape. A block owns batch ``b``, rows
``m0 .. m0 + block_m`` and result columns ``h0 .. h0 + block_h``; it walks n in steps of
``block_n``:

1. the first GEMM's tile S[block_m, block_n]: k in steps of ``block_k``, the block loads A
   and B tiles into shared memory together (zeros past the edges), then every thread adds
   its register tile (f32 FMA, or tensor-core MMAs);
2. the chain program (scale, mask, activation...) on the thread's S elements, in registers;
3. with a softmax, the online softmax: the tile's row maximum (the ``lanes`` threads of a
   row are consecutive lanes of one warp: an xor-shuffle butterfly), a running maximum
   and sum per row, and the accumulator rescaled by exp(old max - new max);
4. P goes to shared memory, a C tile [block_n, block_h] next to it, and every thread adds
   P[its rows, :] x C[:, its columns] into its ``thread_m x thread_h`` accumulator.

At the end each thread stores its accumulator (divided by the row sum for a softmax). A
split-K reduce XLA put after the second GEMM needs nothing: the block sums all of n.

Splitting n across blocks (``ChainTiling.n_split`` = S > 1; not with a row reduction over
n other than a softmax's): S blocks share each output tile (the split index is the minor
digit of blockIdx), split i walking n steps i * c .. (i + 1) * c - 1 (c = ceil(steps / S)).
Phase 1 stores every block's f32 accumulators to a ``kir.GlobalScratch`` of partials
[S, batch, m, h] (after a softmax undivided, with the rows' running max and sum in a second
scratch [S, batch, m, 2]); a ``kir.GridBarrier``; phase 2, the combine: the grid strides
over the outputs, adding each one's S partials in split order (deterministic; no atomics)
— after a softmax weighted by exp(m_i - max m_i) and divided by the weighted sum of the
l_i, FlashDecoding's split-KV combine — applying the output scale and storing in the
output's type. The host runs the phases one after the
other; a GPU launches the kernel once per phase (``grid_sync="relaunch"``: stream order is
the barrier, so the grid need not be resident and ptxas keeps the chain's registers — the
persistent form caps them at nvptx.GRID_BARRIER_MAX_REGISTERS, where chain tiles spill).
The planner splits n only where the target runs grid-barrier kernels (STITCH_GRID_SYNC).
Rows, columns and contractions that do not fill a tile are handled by loading zeros (a
clamped index keeps every load in bounds), masking S columns past n (-inf before a softmax,
0 otherwise) and not storing rows / columns past the edges.

Two thread layouts. FMA (f32, or any type before sm_80): ``t = ty * lanes + tx``; thread
(ty, tx) owns tile rows ``ty * thread_m + i`` and tile columns ``tx + j * lanes``
(interleaved, so a warp's shared-memory reads of one row hit consecutive words); P goes
through shared memory. Tensor cores (``ChainTiling.mma``): ``kir.MmaSync`` m16n8k16 for
bf16/f16 operands, m16n8k8 TF32 for f32 operands (where the chain's dots allow TF32, as
XLA's DEFAULT precision does on sm_80+), a warp per 16 rows, S in the MMA's accumulator
layout, P handed to the second GEMM from registers (see ``_MmaChainKernel``).

Row reductions that are not a softmax's (e.g. a layer norm over n) get a pass over n each
before the main one, S recomputed per pass: the row values are then known in the main pass.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from stitch.hlo_passes.gemm_chains import (ChainOp, GemmChain, OperandView, needs_row_pass,
                                           softmax_parts)
from stitch.hlo_passes.graph import OpGraph

from . import kir
from .errors import CodegenError
from .lower import LoweredKernel
from .values import BINARY_OPS, COMPARE_OPS, UNARY_OPS, leaf, storage_dtype

log = logging.getLogger(__name__)

_c = kir.i32
_F32 = "f32"
_NEG_INF = kir.f32(float("-inf"))
# Ops whose f16/bf16 result XLA rounds to its element type (as values.py's _ROUNDS).
_ROUNDED = (frozenset(UNARY_OPS) - {"negate", "abs", "sign", "floor", "ceil"}
            | frozenset(BINARY_OPS) - {"maximum", "minimum"} | {"convert", "logistic"})
# What a column past n contributes to a row reduction.
_IDENTITY = {"add": 0.0, "multiply": 1.0, "maximum": float("-inf"), "minimum": float("inf")}
# Shared memory one block may use without opting in to more (bytes).
SHARED_LIMIT = 48 * 1024


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


@dataclass(frozen=True)
class ChainTiling:
    """How a chain kernel splits its work (see the module docstring)."""
    block_m: int = 64       # rows of M per block
    block_n: int = 64       # N columns per inner step
    threads: int = 256      # FMA: (block_m / thread_m) * (block_n / thread_n); MMA: 2 * block_m
    thread_m: int = 4       # FMA register tile per thread: rows ...
    thread_n: int = 4       # ... and S columns
    block_k: int = 16       # K per shared-memory stage of the first GEMM
    block_h: int = 64       # result columns per block (H is split over blocks beyond it)
    mma: bool = False       # tensor cores (bf16/f16 operands; f32 ones as TF32): a warp
                            # owns 16 rows
    n_split: int = 1        # blocks sharing an output tile, each on its share of n (the
                            # partials meet after a grid barrier; module docstring)

    @property
    def warp_cols(self) -> int:
        """MMA: warps sharing the same 16 rows, each on its own slice of every n step
        (threads = 2 * block_m * warp_cols); their partial results meet in shared memory
        at the end. FMA: 1."""
        return max(self.threads // (2 * self.block_m), 1) if self.mma else 1

    @property
    def lanes(self) -> int:
        """Threads sharing a tile row (consecutive lanes of one warp)."""
        return 4 if self.mma else self.block_n // self.thread_n

    @property
    def thread_h(self) -> int:
        return self.block_h // self.lanes

    def shared_bytes(self) -> int:
        """A, B, (FMA: P,) and C tiles, f32; MMA with warp columns: the partial results
        (and softmax row states) of all but the first."""
        p_tile = 0 if self.mma else self.block_m * self.block_n
        partials = (self.warp_cols - 1) * self.block_m * (self.block_h + 2)
        return 4 * (self.block_m * self.block_k + self.block_k * self.block_n + p_tile
                    + self.block_n * self.block_h + partials)

    def check(self, operand_dtype: str | None = None) -> None:
        """Refuse tilings the lowering cannot lay out; with ``operand_dtype`` also the MMA
        shape's own steps (bf16/f16 m16n8k16: n and k in 16s; f32 as TF32 m16n8k8: 8s)."""
        def bad(why: str) -> CodegenError:
            return CodegenError(f"chain tiling {self}: {why}")
        for name in ("block_m", "block_n", "threads", "thread_m", "thread_n", "block_k",
                     "block_h", "n_split"):
            if getattr(self, name) < 1:
                raise bad(f"{name} must be positive")
        if self.mma:
            step = 8 if operand_dtype in (None, _F32) else 16
            if self.block_m % 16 or self.block_n % step or self.block_k % step \
                    or self.block_h % 8:
                raise bad(f"MMA tiles ({operand_dtype or 'any'} operands): block_m a multiple "
                          f"of 16, block_n and block_k of {step}, block_h of 8")
            cols = self.warp_cols
            if self.threads != 2 * self.block_m * cols or cols & (cols - 1):
                raise bad("MMA: warp_cols (a power of two) warps per 16 rows "
                          "(threads = 2 * block_m * warp_cols)")
            if self.block_n % (cols * step):
                raise bad(f"MMA: each of the {cols} warp columns takes whole {step}-wide "
                          f"slices of block_n")
        else:
            if self.block_m % self.thread_m or self.block_n % self.thread_n:
                raise bad("thread tiles must divide the block tile")
            lanes = self.lanes
            if lanes > 32 or lanes & (lanes - 1):
                raise bad("block_n / thread_n (lanes per row) must be a power of two <= 32")
            if self.threads != lanes * (self.block_m // self.thread_m):
                raise bad("threads must be (block_m / thread_m) * (block_n / thread_n)")
            if self.block_h % lanes:
                raise bad("block_h must be a multiple of the lanes per row")
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise bad("threads must be a multiple of 32 in [32, 1024]")
        if self.shared_bytes() > SHARED_LIMIT:
            raise bad(f"{self.shared_bytes()} bytes of shared memory (limit {SHARED_LIMIT})")

    @staticmethod
    def default_for(chain: GemmChain, arch: str = "sm_80",
                    allow_tf32: bool = False) -> "ChainTiling":
        """A tiling that fits the chain's dims. f32 (or before sm_80): 64 x 64 tiles, 4 x 4
        register tiles and 256 threads for large chains (ptxas keeps these at <= 80
        registers without spills on sm_80 and sm_90 for every MCFuser shape), smaller tiles
        where m / n are small; H in blocks of up to 64 columns. bf16/f16 on sm_80+: tensor
        cores, 4 warps of 16 rows, 32-wide n steps, k in stages of 16 (<= 128 registers, no
        spills on sm_80 / sm_90 for the MCFuser shapes in bf16). f32 with ``allow_tf32`` on
        sm_80+ where the chain's dots allow it (``GemmChain.tf32``): the same on TF32 tensor
        cores (m16n8k8), n and k in multiples of 8. A chain writing P after a row pass
        holds more live values: 16-wide n steps (MMA) or 32-row blocks (FMA), which ptxas
        keeps without spills on sm_80 / sm_90 at attention sizes."""
        tf32 = (chain.operand_dtype == _F32 and allow_tf32 and chain.tf32)
        row_pass = softmax_parts(chain.program, through_convert=True) is not None \
            and needs_row_pass(chain)
        if (chain.operand_dtype in ("bf16", "f16") or tf32) and _sm(arch) >= 80:
            step = 8 if tf32 else 16
            block_m = 64 if chain.m >= 64 else 16 * -(-chain.m // 16)
            wide = 16 if row_pass else 32
            block_n = wide if chain.n >= wide else step * -(-chain.n // step)
            block_k = 16 if chain.k >= 16 else step * -(-chain.k // step)
            block_h = 64 if chain.h >= 64 else 8 * -(-chain.h // 8)
            tiling = ChainTiling(block_m, block_n, 2 * block_m, 1, 1, block_k, block_h,
                                 mma=True)
            tiling.check(chain.operand_dtype)
            return tiling
        tall = 32 if row_pass else 64
        block_m = tall if chain.m >= tall else max(16, _pow2_at_least(chain.m))
        block_n = 64 if chain.n >= 64 else max(8, _pow2_at_least(chain.n))
        thread_m, thread_n = 4, (4 if block_n >= 32 else 2)
        lanes = block_n // thread_n
        threads = lanes * (block_m // thread_m)
        while threads < 32:
            block_m *= 2
            threads *= 2
        block_k = min(16, _pow2_at_least(chain.k))
        block_h = min(64, max(lanes, _pow2_at_least(chain.h)))
        tiling = ChainTiling(block_m, block_n, threads, thread_m, thread_n, block_k, block_h)
        tiling.check()
        return tiling


def _math_note(chain: GemmChain, tiling: ChainTiling) -> str:
    if not tiling.mma:
        return ""
    return ", TF32 tensor cores" if chain.operand_dtype == _F32 else ", tensor cores"


def _sm(arch: str) -> int:
    try:
        return int(arch.removeprefix("sm_").rstrip("a"))
    except ValueError:
        raise CodegenError(f"unknown arch {arch!r}") from None


def lower_gemm_chain(graph: OpGraph, chain: GemmChain, tiling: ChainTiling | None = None,
                     name: str = "gemm_chain", arch: str = "sm_80") -> LoweredKernel:
    """One Kernel IR kernel computing ``chain`` (params: ``chain.inputs`` then the output)."""
    tiling = tiling or ChainTiling.default_for(chain, arch)
    tiling.check(chain.operand_dtype)
    if tiling.mma and _sm(arch) < 80:
        raise CodegenError(f"{name}: tensor-core MMA (mma.sync bf16/f16/tf32) needs sm_80+, "
                           f"not {arch}")
    if tiling.mma and chain.operand_dtype == _F32 and not chain.tf32:
        raise CodegenError(f"{name}: the chain's dots ask for full f32 precision (HIGHEST or "
                           f"an f32 algorithm): no TF32 tensor cores")
    if tiling.warp_cols > 1 and softmax_parts(chain.program) is None and any(
            op.kind == "reduce" for op in chain.program):
        raise CodegenError(f"{name}: warp columns split n, and a row reduction other than a "
                           f"softmax's needs all of n in one warp")
    if tiling.n_split > 1 and softmax_parts(chain.program) is None and any(
            op.kind == "reduce" for op in chain.program):
        raise CodegenError(f"{name}: n is split across blocks, and a row reduction over n "
                           f"other than a softmax's needs every block's share of the row")
    if chain.extra_outputs and (tiling.n_split > 1 or tiling.warp_cols > 1):
        raise CodegenError(f"{name}: the chain also writes values read outside, which needs "
                           f"all of n in one warp and one block (no warp columns, no n split)")
    layout = _MmaChainKernel if tiling.mma else _FmaChainKernel
    kernel = layout(graph, chain, tiling, name).build()
    softmax = ("softmax, row pass first" if needs_row_pass(chain) and softmax_parts(
        chain.program, through_convert=True) is not None else
               "online softmax" if chain.softmax else "no softmax")
    also = f", also writes {len(chain.extra_outputs)} value(s)" if chain.extra_outputs else ""
    note = (f"gemm chain {chain.batch}x{chain.m}x{chain.n}x{chain.k}x{chain.h} "
            f"({softmax}{also}), tiles "
            f"m{tiling.block_m} n{tiling.block_n} k{tiling.block_k} h{tiling.block_h}, "
            f"{tiling.threads} threads{_math_note(chain, tiling)}"
            f"{f', n split over {tiling.n_split} blocks' if tiling.n_split > 1 else ''}")
    log.debug("%s: %s", name, note)
    return LoweredKernel(kernel, list(chain.inputs),
                         [chain.output, *(out.node for out in chain.extra_outputs)],
                         ["gemm_chain"], [note])


# ----------------------------------------------------------------------------- helpers


def _offset(view: OperandView, b: kir.Expr, r: kir.Expr, c: kir.Expr) -> kir.Expr:
    pairs = [(r, view.row_stride), (c, view.col_stride)]
    if view.batch_dims:     # b's digits, minor first (OperandView.batch_offset)
        inner = 1
        for size, stride in reversed(view.batch_dims):
            digit = kir.Binary("rem", kir.Binary("div", b, _c(inner)) if inner > 1 else b,
                               _c(size))
            pairs.append((digit, stride))
            inner *= size
    else:
        pairs.append((b, view.batch_stride))
    terms = [x if s == 1 else kir.mul(x, _c(s)) for x, s in pairs if s]
    if not terms:
        return _c(0)
    out = terms[0]
    for t in terms[1:]:
        out = kir.add(out, t)
    return out


class _ChainKernel:
    """The parts every chain kernel shares; the subclasses lay the tiles on the threads.

    A layout sets ``rows`` (the global m of each of the thread's tile rows), ``cols`` (the
    tile-relative n of each of its S columns), ``s[i][j]`` (the Local holding S at row i,
    column j), ``acc[i]`` (row i's accumulators with their global h) and ``shuffle_lanes``
    (how many consecutive lanes share a row)."""

    def __init__(self, graph: OpGraph, chain: GemmChain, tiling: ChainTiling, name: str):
        self.graph = graph
        self.chain = chain
        self.t = tiling
        self.name = name
        self.params: dict[int, kir.Param] = {}
        for i, v in enumerate(chain.inputs):
            shape = leaf(graph.nodes[v].shape)
            self.params[v] = kir.Param(f"in{i}", storage_dtype(shape), shape.num_elements)
        out_shape = leaf(graph.nodes[chain.output].shape)
        self.out = kir.Param("out0", storage_dtype(out_shape), out_shape.num_elements,
                             is_output=True)
        # Values also read outside the chain (ChainOutput), written as they are computed.
        self.extra: list[kir.Param] = []
        for i, extra in enumerate(chain.extra_outputs):
            shape = leaf(graph.nodes[extra.node].shape)
            self.extra.append(kir.Param(f"out{i + 1}", storage_dtype(shape),
                                        shape.num_elements, is_output=True))
        t = tiling
        self.sa = kir.Shared("tile_a", _F32, t.block_m * t.block_k)
        self.sb = kir.Shared("tile_b", _F32, t.block_k * t.block_n)
        self.sc = kir.Shared("tile_c", _F32, t.block_n * t.block_h)
        self.shared = [self.sa, self.sb, self.sc]
        self.softmax = softmax_parts(chain.program)
        # A softmax whose P (or another value after its reductions) is written out: one pass
        # over n computes the rows' max and sum (online, their final values exact), the
        # main pass then evaluates the program with them: P exact, no rescaling.
        parts = softmax_parts(chain.program, through_convert=True)
        self.row_pass = parts if parts is not None and needs_row_pass(chain) else None
        if self.row_pass is not None:
            self.softmax = None
        # Row reductions other than a softmax's: one pass over n each (S recomputed),
        # before the pass that feeds the second GEMM.
        self.reductions = [] if self.softmax is not None else \
            [i for i, op in enumerate(chain.program) if op.kind == "reduce"]
        # Program reductions whose row value sits in a Local (name prefix; row i: _{i}).
        self.row_locals: dict[int, str] = {r: f"red{r}" for r in self.reductions}
        self.names = 0
        self.rows: list[kir.Expr] = []
        self.cols: list[kir.Expr] = []
        self.s: list[list[str]] = []
        self.acc: list[list[tuple[str, kir.Expr]]] = []
        self.shuffle_lanes = 1
        # n split across blocks: every block's f32 partial result tile, per split.
        self.partials = kir.GlobalScratch(
            "partials", _F32, tiling.n_split * chain.batch * chain.m * chain.h) \
            if tiling.n_split > 1 else None
        # ... and after a softmax, every block's row maxima and sums [split, batch, m, 2].
        self.row_stats = kir.GlobalScratch(
            "row_stats", _F32, tiling.n_split * chain.batch * chain.m * 2) \
            if self.partials is not None and self.softmax is not None else None
        self.split: kir.Expr = _c(0)

    # --- small emitters -----------------------------------------------------------------
    def let(self, out: list[kir.Stmt], hint: str, expr: kir.Expr) -> kir.Expr:
        if isinstance(expr, (kir.Const, kir.Ref)):
            return expr
        self.names += 1
        name = f"{hint}_{self.names}"
        out.append(kir.Let(name, expr))
        return kir.Ref(name, expr.dtype)

    def param(self, node: int) -> kir.Param:
        return self.params[node]

    @property
    def rows_clamped(self) -> list[kir.Expr]:
        return [kir.minimum(m, _c(self.chain.m - 1)) for m in self.rows]

    def cooperative_load(self, out: list[kir.Stmt], tile: kir.Shared, rows: int, cols: int,
                         source: OperandView, row0: kir.Expr, col0: kir.Expr,
                         row_limit: int, col_limit: int) -> None:
        """tile[r * cols + c] = source[b, row0 + r, col0 + c] (0 past the limits), the
        block's threads striding over the tile: along the source's unit-stride dim, so
        neighbouring threads read neighbouring words (K^T of attention: along rows)."""
        self.names += 1
        var = f"e{self.names}"
        body: list[kir.Stmt] = []
        e = kir.Ref(var, "i32")
        if source.row_stride == 1 and source.col_stride != 1:
            r = self.let(body, "r", kir.Binary("rem", e, _c(rows)))
            c = self.let(body, "c", kir.Binary("div", e, _c(rows)))
        else:
            r = self.let(body, "r", kir.Binary("div", e, _c(cols)))
            c = self.let(body, "c", kir.Binary("rem", e, _c(cols)))
        slot = kir.add(kir.mul(r, _c(cols)), c)
        row = self.let(body, "row", kir.add(row0, r))
        col = self.let(body, "col", kir.add(col0, c))
        valid = kir.logical_and(kir.less(row, _c(row_limit)), kir.less(col, _c(col_limit)))
        index = _offset(source, self.batch, kir.minimum(row, _c(row_limit - 1)),
                        kir.minimum(col, _c(col_limit - 1)))
        value = kir.Load(self.param(source.node), index)
        body.append(kir.Store(tile.name, slot, kir.Select(valid, value, kir.f32(0.0))))
        out.append(kir.For(var, kir.ThreadIdx(), _c(rows * cols), _c(self.t.threads),
                           tuple(body)))

    # --- the kernel ---------------------------------------------------------------------
    def build(self) -> kir.Kernel:
        ch, t = self.chain, self.t
        m_blocks = -(-ch.m // t.block_m)
        h_blocks = -(-ch.h // t.block_h)
        grid = ch.batch * m_blocks * h_blocks * t.n_split
        body: list[kir.Stmt] = []
        bid: kir.Expr = kir.BlockIdx()
        n_lo, n_hi = _c(0), _c(ch.n)
        if t.n_split > 1:
            # The block's split (minor in blockIdx: the splits of one tile read the same A
            # rows together) and its n steps.
            self.split = self.let(body, "split", kir.Binary("rem", bid, _c(t.n_split)))
            bid = self.let(body, "tile", kir.Binary("div", bid, _c(t.n_split)))
            share = -(-(-(-ch.n // t.block_n)) // t.n_split)      # n steps per split
            n_lo = self.let(body, "nlo", kir.mul(self.split, _c(share * t.block_n)))
            n_hi = self.let(body, "nhi",
                            kir.minimum(kir.add(n_lo, _c(share * t.block_n)), _c(ch.n)))
        hb = self.let(body, "hb", kir.Binary("rem", bid, _c(h_blocks)))
        mb = self.let(body, "mb", kir.Binary("rem", kir.Binary("div", bid, _c(h_blocks)),
                                             _c(m_blocks)))
        self.batch = self.let(body, "batch", kir.Binary("div", bid, _c(h_blocks * m_blocks)))
        self.m0 = self.let(body, "m0", kir.mul(mb, _c(t.block_m)))
        self.h0 = self.let(body, "h0", kir.mul(hb, _c(t.block_h)))
        self.layout(body)
        for row in self.s:
            for name in row:
                body.append(kir.Local(name, _F32, kir.f32(0.0)))
        for row in self.acc:
            for name, _ in row:
                body.append(kir.Local(name, _F32, kir.f32(0.0)))
        if self.softmax is not None:
            for i in range(len(self.rows)):
                body.append(kir.Local(f"mx_{i}", _F32, _NEG_INF))
                body.append(kir.Local(f"sum_{i}", _F32, kir.f32(0.0)))
        for r in self.reductions:
            init = kir.f32(float(ch.program[r].value))
            for i in range(len(self.rows)):
                body.append(kir.Local(f"red{r}_{i}", _F32, init))
        if self.row_pass is not None:
            body.append(kir.For("n0", _c(0), _c(ch.n), _c(t.block_n),
                                tuple(self.row_pass_step(self.row_pass))))
        else:
            for r in self.reductions:
                body.append(kir.For("n0", _c(0), _c(ch.n), _c(t.block_n),
                                    tuple(self.reduction_step(r))))
        body.append(kir.For("n0", n_lo, n_hi, _c(t.block_n), tuple(self.n_step())))
        body.extend(self.store())
        body.extend(self.store_rows())
        scratch: tuple[kir.GlobalScratch, ...] = ()
        if self.partials is not None:
            body.append(kir.GridBarrier())
            body.extend(self.combine(grid))
            scratch = (self.partials,) + ((self.row_stats,) if self.row_stats else ())
        # n split: a launch per phase (module docstring).
        return kir.Kernel(self.name, (*self.params.values(), self.out, *self.extra),
                          tuple(self.shared),
                          grid, t.threads, tuple(body), scratch,
                          "relaunch" if self.partials is not None else "barrier").validate()

    def layout(self, body: list[kir.Stmt]) -> None:
        raise NotImplementedError

    def first_gemm(self, out: list[kir.Stmt], n0: kir.Expr) -> None:
        raise NotImplementedError

    def second_gemm(self, out: list[kir.Stmt], n0: kir.Expr,
                    p: list[list[kir.Expr]]) -> None:
        raise NotImplementedError

    def s_step(self, out: list[kir.Stmt]) -> tuple[list[kir.Expr], "_Program"]:
        """S of this n step, in registers; the columns' validity and the program on them."""
        n0 = kir.Ref("n0", "i32")
        for row in self.s:
            for name in row:
                out.append(kir.Assign(name, kir.f32(0.0)))
        self.first_gemm(out, n0)
        n_cols = [self.let(out, "n", kir.add(n0, c)) for c in self.cols]
        valid_n = [self.let(out, "vn", kir.less(n, _c(self.chain.n))) for n in n_cols]
        return valid_n, _Program(self, out, n_cols)

    def reduction_step(self, r: int) -> list[kir.Stmt]:
        """One n step of the pass computing row reduction ``r`` (program index) into the
        Locals red{r}_i; columns past n add the reducer's identity."""
        op = self.chain.program[r]
        code = BINARY_OPS[op.opcode]
        identity = kir.f32(_IDENTITY[op.opcode])
        out: list[kir.Stmt] = []
        valid_n, program = self.s_step(out)
        for i in range(len(self.rows)):
            values = [self.let(out, "v", kir.Select(valid_n[j], program.value(op.args[0], i, j),
                                                    identity)) for j in range(len(self.cols))]
            total = self.row_reduce(out, code, values)
            name = f"red{r}_{i}"
            out.append(kir.Assign(name, kir.Binary(code, kir.Ref(name, _F32), total)))
        return out

    def row_pass_step(self, parts) -> list[kir.Stmt]:
        """One n step of the pass before the main one that computes a softmax's row max
        and sum (into the Locals of its reductions), online: the sum rescaled as the max
        grows, so after the last step both are the rows' exact max and sum."""
        out: list[kir.Stmt] = []
        valid_n, program = self.s_step(out)
        for i in range(len(self.rows)):
            self.online_update(out, program, valid_n, parts.x, i, f"red{parts.row_max}_{i}",
                               f"red{parts.row_sum}_{i}")
        return out

    def online_update(self, out: list[kir.Stmt], program: "_Program",
                      valid_n: list[kir.Expr], x_op: int, i: int, max_name: str,
                      sum_name: str) -> tuple[kir.Expr, list[kir.Expr]]:
        """One n step of an online softmax of program value ``x_op`` on row ``i``: the
        running max ``max_name`` and sum ``sum_name`` (Locals) take this step's values, the
        sum rescaled as the max grows. Returns the old sum's scale and exp(X - new max)."""
        x = [self.let(out, "x", kir.Select(valid_n[j], program.value(x_op, i, j),
                                           _NEG_INF)) for j in range(len(self.cols))]
        old = kir.Ref(max_name, _F32)
        new = self.let(out, "mnew", kir.Binary("max", old, self.row_reduce(out, "max", x)))
        # A row whose every value so far is -inf (masked) keeps P = 0 and scale 1.
        dead = self.let(out, "dead", kir.Compare("eq", new, _NEG_INF))
        scale = self.let(out, "scale", kir.Select(
            dead, kir.f32(1.0), kir.Unary("exp", kir.Binary("sub", old, new))))
        e = [self.let(out, "e", kir.Select(dead, kir.f32(0.0), kir.Unary(
            "exp", kir.Binary("sub", xj, new)))) for xj in x]
        total = self.row_reduce(out, "add", e)
        out.append(kir.Assign(sum_name, kir.add(kir.mul(kir.Ref(sum_name, _F32), scale), total)))
        out.append(kir.Assign(max_name, new))
        return scale, e

    def store_tiles(self, out: list[kir.Stmt], program: "_Program",
                    valid_n: list[kir.Expr]) -> None:
        """The tile values read outside the chain, at this n step's columns."""
        ch = self.chain
        for extra, param in zip(ch.extra_outputs, self.extra):
            if extra.rank != "tile":
                continue
            for i, row in enumerate(self.rows):
                for j, n in enumerate(program.n_cols):
                    value = program.value(extra.value, i, j)
                    cond = kir.logical_and(kir.less(row, _c(ch.m)), valid_n[j])
                    out.append(kir.If(cond, (kir.Store(param.name, _offset(
                        extra.view, self.batch, row, n), value),)))

    def store_rows(self) -> list[kir.Stmt]:
        """The row values read outside the chain (the softmax's row sums...), after the
        main pass, from the lane holding the row's column 0."""
        ch = self.chain
        rows = [(e, p) for e, p in zip(ch.extra_outputs, self.extra) if e.rank == "row"]
        if not rows:
            return []
        out: list[kir.Stmt] = []
        if self.softmax is not None:       # the online softmax's final row state
            self.row_locals = {**self.row_locals, self.softmax.row_max: "mx",
                               self.softmax.row_sum: "sum"}
        program = _Program(self, out, [_c(0)] * len(self.cols))
        first_lane = self.let(out, "lane0", kir.Compare("eq", self.cols[0], _c(0)))
        for extra, param in rows:
            for i, row in enumerate(self.rows):
                value = program.value(extra.value, i, 0)
                cond = kir.logical_and(kir.less(row, _c(ch.m)), first_lane)
                out.append(kir.If(cond, (kir.Store(param.name, _offset(
                    extra.view, self.batch, row, _c(0)), value),)))
        return out

    def n_step(self) -> list[kir.Stmt]:
        ch = self.chain
        out: list[kir.Stmt] = []
        n0 = kir.Ref("n0", "i32")
        # S, the program on the thread's S elements, then P (online softmax).
        valid_n, program = self.s_step(out)
        self.store_tiles(out, program, valid_n)
        if self.softmax is None:
            last = len(ch.program) - 1
            p = [[self.let(out, "p", kir.Select(valid_n[j], program.value(last, i, j),
                                                kir.f32(0.0)))
                  for j in range(len(self.cols))] for i in range(len(self.rows))]
        else:
            p = self.online_softmax(out, program, valid_n)
        self.second_gemm(out, n0, p)
        return out

    def row_reduce(self, out: list[kir.Stmt], op: str, values: list[kir.Expr]) -> kir.Expr:
        """``op`` over the thread's values and then over the lanes of its row."""
        total = values[0]
        for v in values[1:]:
            total = kir.Binary(op, total, v)
        total = self.let(out, f"r{op}", total)
        offset = 1
        while offset < self.shuffle_lanes:
            self.names += 1
            dest = f"sh_{op}_{self.names}"
            out.append(kir.WarpShuffle(dest, total, _c(offset), "xor"))
            total = self.let(out, f"r{op}", kir.Binary(op, total, kir.Ref(dest, _F32)))
            offset *= 2
        return total

    def online_softmax(self, out: list[kir.Stmt], program: "_Program",
                       valid_n: list[kir.Expr]) -> list[list[kir.Expr]]:
        """P = exp(X - running max); the running sum and the accumulator follow the max."""
        p: list[list[kir.Expr]] = []
        for i in range(len(self.rows)):
            scale, e = self.online_update(out, program, valid_n, self.softmax.x, i,
                                          f"mx_{i}", f"sum_{i}")
            for name, _ in self.acc[i]:
                out.append(kir.Assign(name, kir.mul(kir.Ref(name, _F32), scale)))
            p.append(e)
        return p

    def store(self) -> list[kir.Stmt]:
        """Each thread's accumulators: the result, or (n split) the block's f32 partial at
        partials[((split * batch + b) * m + row) * h + col], scaled by the combine."""
        ch = self.chain
        out: list[kir.Stmt] = []
        scale = kir.f32(ch.output_scale)
        for i, row in enumerate(self.rows):
            inv = None if ch.output_scale == 1.0 or self.partials is not None else scale
            if self.softmax is not None and self.partials is None:
                inv = self.let(out, "inv", kir.Binary("div", scale,
                                                      kir.Ref(f"sum_{i}", _F32)))
            elif self.softmax is not None:
                # The row's running max and sum over the block's share of n (every thread
                # of the row holds the same: the butterflies gave each lane the row's).
                split_batch = kir.add(kir.mul(self.split, _c(ch.batch)), self.batch)
                slot = kir.mul(kir.add(kir.mul(split_batch, _c(ch.m)), row), _c(2))
                out.append(kir.If(kir.less(row, _c(ch.m)), (
                    kir.Store(self.row_stats.name, slot, kir.Ref(f"mx_{i}", _F32)),
                    kir.Store(self.row_stats.name, kir.add(slot, _c(1)),
                              kir.Ref(f"sum_{i}", _F32)))))
            for name, h in self.acc[i]:
                value: kir.Expr = kir.Ref(name, _F32)
                if inv is not None:
                    value = kir.mul(value, inv)
                cond = kir.logical_and(kir.less(row, _c(ch.m)), kir.less(h, _c(ch.h)))
                if self.partials is None:
                    target, index = self.out.name, _offset(ch.out, self.batch, row, h)
                else:
                    tile = kir.add(kir.mul(self.split, _c(ch.batch)), self.batch)
                    index = kir.add(kir.mul(kir.add(kir.mul(tile, _c(ch.m)), row), _c(ch.h)), h)
                    target = self.partials.name
                out.append(kir.If(cond, (kir.Store(target, index, value),)))
        return out

    def combine(self, grid: int) -> list[kir.Stmt]:
        """After the grid barrier: the grid strides over the outputs; each is the sum of its
        ``n_split`` partials in split order (the same order every run: deterministic),
        scaled, stored in the output's type."""
        ch, t = self.chain, self.t
        outputs = ch.batch * ch.m * ch.h
        out: list[kir.Stmt] = []
        gtid = self.let(out, "gtid", kir.add(kir.mul(kir.BlockIdx(), _c(t.threads)),
                                          kir.ThreadIdx()))
        body: list[kir.Stmt] = []
        o = kir.Ref("o", "i32")
        b = self.let(body, "cb", kir.Binary("div", o, _c(ch.m * ch.h)))
        row = self.let(body, "crow", kir.Binary("rem", kir.Binary("div", o, _c(ch.h)),
                                                _c(ch.m)))
        col = self.let(body, "ccol", kir.Binary("rem", o, _c(ch.h)))
        parts = [kir.Load(self.partials, kir.add(o, _c(split * outputs))) if split else
                 kir.Load(self.partials, o) for split in range(t.n_split)]
        if self.row_stats is None:
            total: kir.Expr = parts[0]
            for part in parts[1:]:
                total = kir.add(total, part)
            total = self.let(body, "csum", total)
        else:
            total = self.softmax_combine(body, b, row, parts)
        if ch.output_scale != 1.0 and self.row_stats is None:
            total = kir.mul(total, kir.f32(ch.output_scale))
        body.append(kir.Store(self.out.name, _offset(ch.out, b, row, col), total))
        out.append(kir.For("o", gtid, _c(outputs), _c(grid * t.threads), tuple(body)))
        return out

    def softmax_combine(self, body: list[kir.Stmt], b: kir.Expr, row: kir.Expr,
                        parts: list[kir.Expr]) -> kir.Expr:
        """FlashDecoding's split-KV combine of one output: the splits' row maxima m_i and
        sums l_i give M = max m_i and weights w_i = exp(m_i - M) (0 for a split that saw
        only -inf: an empty or wholly masked share); the output is sum w_i acc_i times
        scale / sum w_i l_i, the splits in order."""
        ch, t = self.chain, self.t
        rows = ch.batch * ch.m
        base = self.let(body, "rs", kir.mul(kir.add(kir.mul(b, _c(ch.m)), row), _c(2)))
        maxima = [self.let(body, "rmx", kir.Load(self.row_stats, kir.add(base, _c(2 * i * rows))))
                  for i in range(t.n_split)]
        sums = [kir.Load(self.row_stats, kir.add(base, _c(2 * i * rows + 1)))
                for i in range(t.n_split)]
        top: kir.Expr = maxima[0]
        for m in maxima[1:]:
            top = kir.Binary("max", top, m)
        top = self.let(body, "rtop", top)
        numerator: kir.Expr = kir.f32(0.0)
        denominator: kir.Expr = kir.f32(0.0)
        for m, l, acc in zip(maxima, sums, parts):
            w = self.let(body, "w", kir.Select(kir.Compare("eq", m, _NEG_INF), kir.f32(0.0),
                                               kir.Unary("exp", kir.Binary("sub", m, top))))
            numerator = kir.add(numerator, kir.mul(w, acc))
            denominator = kir.add(denominator, kir.mul(w, l))
        numerator = self.let(body, "cnum", numerator)
        inv = self.let(body, "cinv", kir.Binary("div", kir.f32(ch.output_scale), denominator))
        return kir.mul(numerator, inv)


    def stage_first_gemm_tiles(self, k0: kir.Expr, n0: kir.Expr) -> list[kir.Stmt]:
        """The k-stage's A tile (rows m0.., k0..) and B tile (k0.., n0..) into shared
        memory, then a barrier: how both layouts start a step of the first GEMM."""
        ch, t = self.chain, self.t
        body: list[kir.Stmt] = []
        self.cooperative_load(body, self.sa, t.block_m, t.block_k, ch.a, self.m0, k0,
                              ch.m, ch.k)
        self.cooperative_load(body, self.sb, t.block_k, t.block_n, ch.b, k0, n0, ch.k, ch.n)
        body.append(kir.Barrier())
        return body


class _FmaChainKernel(_ChainKernel):
    """f32 FMA: thread (ty, tx) owns tile rows ty * thread_m + i and S columns
    tx + j * lanes; P goes through shared memory to the second GEMM."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        t = self.t
        self.sp = kir.Shared("tile_p", _F32, t.block_m * t.block_n)
        self.shared.append(self.sp)

    def layout(self, body: list[kir.Stmt]) -> None:
        t = self.t
        tid = kir.ThreadIdx()
        self.tx = self.let(body, "tx", kir.Binary("rem", tid, _c(t.lanes)))
        self.ty = self.let(body, "ty", kir.Binary("div", tid, _c(t.lanes)))
        # Per-thread indices are expressions, recomputed where used: kept in registers
        # across the n loop they cost more than the integer ops (ptxas spilled them).
        self.row_in_tile = [kir.add(kir.mul(self.ty, _c(t.thread_m)), _c(i))
                            for i in range(t.thread_m)]
        self.rows = [kir.add(self.m0, r) for r in self.row_in_tile]
        self.cols = [kir.add(self.tx, _c(j * t.lanes)) for j in range(t.thread_n)]
        self.s = [[f"s_{i}_{j}" for j in range(t.thread_n)] for i in range(t.thread_m)]
        self.acc = [[(f"o_{i}_{j}", kir.add(self.h0, kir.add(self.tx, _c(j * t.lanes))))
                     for j in range(t.thread_h)] for i in range(t.thread_m)]
        self.shuffle_lanes = t.lanes

    def first_gemm(self, out: list[kir.Stmt], n0: kir.Expr) -> None:
        """S = A[rows, :] x B[:, n0 + cols], k in shared-memory stages."""
        ch, t = self.chain, self.t
        k0 = kir.Ref("k0", "i32")
        k_body = self.stage_first_gemm_tiles(k0, n0)
        inner: list[kir.Stmt] = []
        kk = kir.Ref("kk", "i32")
        a = [self.let(inner, "a", kir.Load(self.sa, kir.add(kir.mul(r, _c(t.block_k)), kk)))
             for r in self.row_in_tile]
        b = [self.let(inner, "b", kir.Load(self.sb, kir.add(kir.mul(kk, _c(t.block_n)), c)))
             for c in self.cols]
        for i in range(t.thread_m):
            for j in range(t.thread_n):
                name = self.s[i][j]
                inner.append(kir.Assign(name, kir.add(kir.Ref(name, _F32), kir.mul(a[i], b[j]))))
        k_body.append(kir.For("kk", _c(0), _c(t.block_k), _c(1), tuple(inner)))
        k_body.append(kir.Barrier())
        out.append(kir.For("k0", _c(0), _c(ch.k), _c(t.block_k), tuple(k_body)))

    def second_gemm(self, out: list[kir.Stmt], n0: kir.Expr,
                    p: list[list[kir.Expr]]) -> None:
        """acc += P[rows, :] x C[n0 + :, h0 + cols], P through shared memory."""
        ch, t = self.chain, self.t
        for i in range(t.thread_m):
            for j in range(t.thread_n):
                index = kir.add(kir.mul(self.row_in_tile[i], _c(t.block_n)), self.cols[j])
                out.append(kir.Store(self.sp.name, index, p[i][j]))
        self.cooperative_load(out, self.sc, t.block_n, t.block_h, ch.c, n0, self.h0, ch.n, ch.h)
        out.append(kir.Barrier())
        inner: list[kir.Stmt] = []
        cc = kir.Ref("cc", "i32")
        pv = [self.let(inner, "pv", kir.Load(self.sp, kir.add(kir.mul(r, _c(t.block_n)), cc)))
              for r in self.row_in_tile]
        cv = [self.let(inner, "cv", kir.Load(self.sc, kir.add(kir.mul(cc, _c(t.block_h)),
                                                           kir.add(self.tx, _c(j * t.lanes)))))
              for j in range(t.thread_h)]
        for i in range(t.thread_m):
            for j, (name, _) in enumerate(self.acc[i]):
                inner.append(kir.Assign(name, kir.add(kir.Ref(name, _F32), kir.mul(pv[i], cv[j]))))
        out.append(kir.For("cc", _c(0), _c(t.block_n), _c(1), tuple(inner)))
        out.append(kir.Barrier())


class _MmaChainKernel(_ChainKernel):
    """Tensor cores (kir.MmaSync): warp w owns tile rows 16 w .. 16 w + 15; lane
    (g = lane >> 2, q = lane & 3) holds rows g and g + 8 of every 16x8 S tile at columns
    2q, 2q + 1 (the MMA's D layout, the same for both shapes); a row's four lanes meet by
    xor shuffles 1 and 2. P goes from registers straight into the second GEMM (as in
    FlashAttention-2): bf16/f16 (m16n8k16) take two neighbouring S tiles as exactly the A
    fragment of a 16x16 P block; TF32 (m16n8k8) wants A columns q and q + 4 where the lane
    holds 2q and 2q + 1, so one S tile feeds one MMA with its 8 columns renumbered
    (physical 2q -> MMA k q, 2q + 1 -> q + 4) and C's rows read in the same order: a
    contraction does not care how its index is numbered."""

    def layout(self, body: list[kir.Stmt]) -> None:
        t = self.t
        self.dtype = "tf32" if self.chain.operand_dtype == _F32 else self.chain.operand_dtype
        tid = kir.ThreadIdx()
        lane = self.let(body, "lane", kir.Binary("rem", tid, _c(32)))
        warp = kir.Binary("div", tid, _c(32))
        # Warp w: rows 16 (w / warp_cols), n slice w % warp_cols of every n step.
        self.slice_n = t.block_n // t.warp_cols
        self.wcol = self.let(body, "wcol", kir.Binary("rem", warp, _c(t.warp_cols)))
        self.slice0 = self.let(body, "ns0", kir.mul(self.wcol, _c(self.slice_n)))
        warp_row = self.let(body, "wrow", kir.mul(kir.Binary("div", warp, _c(t.warp_cols)),
                                               _c(16)))
        self.g = self.let(body, "g", kir.Binary("div", lane, _c(4)))
        self.q = self.let(body, "q", kir.Binary("rem", lane, _c(4)))
        self.q2 = self.let(body, "q2", kir.mul(self.q, _c(2)))
        self.warp_row = warp_row
        self.rows = [kir.add(self.m0, kir.add(warp_row, kir.add(self.g, _c(8 * i))))
                     for i in range(2)]
        n_tiles, h_tiles = self.slice_n // 8, t.block_h // 8
        # Column j = 2 nt + parity of row i: element 2 i + parity of S tile nt.
        self.cols = [kir.add(self.slice0, kir.add(self.q2, _c(8 * (j // 2) + j % 2)))
                     for j in range(2 * n_tiles)]
        self.s = [[f"s_{j // 2}_{2 * i + j % 2}" for j in range(2 * n_tiles)] for i in range(2)]
        self.acc = [[(f"o_{ht}_{2 * i + par}", kir.add(self.h0, kir.add(self.q2, _c(8 * ht + par))))
                     for ht in range(h_tiles) for par in range(2)] for i in range(2)]
        self.shuffle_lanes = 4
        if t.warp_cols > 1:
            # Partial results of warp columns 1.. (rows of the block x block_h), and their
            # softmax row states (max, sum), for the first column to fold in at the end.
            self.so = kir.Shared("tile_o", _F32, (t.warp_cols - 1) * t.block_m * t.block_h)
            self.sstat = kir.Shared("tile_stat", _F32, (t.warp_cols - 1) * t.block_m * 2)
            self.shared += [self.so, self.sstat]

    def store(self) -> list[kir.Stmt]:
        """With warp columns, the first folds the others' partial results in (a sum; with
        a softmax each partial is rescaled to the common row maximum, FlashAttention's
        split-KV combine) and stores; else every warp stores its own rows."""
        t = self.t
        if t.warp_cols == 1:
            return super().store()
        out: list[kir.Stmt] = []
        in_block = [kir.add(self.warp_row, kir.add(self.g, _c(8 * i))) for i in range(2)]
        local_h = [kir.add(self.q2, _c(8 * (k // 2) + k % 2)) for k in range(len(self.acc[0]))]

        def slot(c: kir.Expr, i: int) -> kir.Expr:
            return kir.add(kir.mul(c, _c(t.block_m)), in_block[i])

        write: list[kir.Stmt] = []
        mine = self.let(write, "wslot", kir.add(self.wcol, _c(-1)))
        for i in range(2):
            row = slot(mine, i)
            for k, (name, _) in enumerate(self.acc[i]):
                write.append(kir.Store(self.so.name,
                                       kir.add(kir.mul(row, _c(t.block_h)), local_h[k]),
                                       kir.Ref(name, _F32)))
            if self.softmax is not None:
                write.append(kir.Store(self.sstat.name, kir.mul(row, _c(2)),
                                       kir.Ref(f"mx_{i}", _F32)))
                write.append(kir.Store(self.sstat.name, kir.add(kir.mul(row, _c(2)), _c(1)),
                                       kir.Ref(f"sum_{i}", _F32)))
        out.append(kir.If(kir.Compare("ne", self.wcol, _c(0)), tuple(write)))
        out.append(kir.Barrier())
        fold: list[kir.Stmt] = []
        for c in range(t.warp_cols - 1):
            for i in range(2):
                row = slot(_c(c), i)
                if self.softmax is not None:
                    mx, total = kir.Ref(f"mx_{i}", _F32), kir.Ref(f"sum_{i}", _F32)
                    other = self.let(fold, "omx", kir.Load(self.sstat, kir.mul(row, _c(2))))
                    other_sum = self.let(fold, "osum", kir.Load(
                        self.sstat, kir.add(kir.mul(row, _c(2)), _c(1))))
                    new = self.let(fold, "cmx", kir.Binary("max", mx, other))
                    dead = self.let(fold, "dead", kir.Compare("eq", new, _NEG_INF))
                    own = self.let(fold, "sown", kir.Select(dead, kir.f32(1.0), kir.Unary(
                        "exp", kir.Binary("sub", mx, new))))
                    theirs = self.let(fold, "soth", kir.Select(dead, kir.f32(0.0), kir.Unary(
                        "exp", kir.Binary("sub", other, new))))
                    fold.append(kir.Assign(f"sum_{i}", kir.add(kir.mul(total, own),
                                                            kir.mul(other_sum, theirs))))
                    fold.append(kir.Assign(f"mx_{i}", new))
                for k, (name, _) in enumerate(self.acc[i]):
                    part = kir.Load(self.so, kir.add(kir.mul(row, _c(t.block_h)), local_h[k]))
                    acc = kir.Ref(name, _F32)
                    value = kir.add(kir.mul(acc, own), kir.mul(part, theirs)) \
                        if self.softmax is not None else kir.add(acc, part)
                    fold.append(kir.Assign(name, value))
        fold.extend(super().store())
        out.append(kir.If(kir.Compare("eq", self.wcol, _c(0)), tuple(fold)))
        return out

    def mma(self, out: list[kir.Stmt], a: list[kir.Expr], b: list[kir.Expr],
            acc: list[str]) -> None:
        self.names += 1
        dest = tuple(f"d{self.names}_{r}" for r in range(4))
        out.append(kir.MmaSync(dest, a, b, [kir.Ref(n, _F32) for n in acc], self.dtype))
        for name, d in zip(acc, dest):
            out.append(kir.Assign(name, kir.Ref(d, _F32)))

    def a_fragment(self, tile: kir.Shared, width: int, k0: int) -> list[kir.Expr]:
        """A[warp rows, k0 .. k0 + depth - 1] of a row-major [block_m, width] shared tile,
        in the PTX fragment order of the MMA shape."""
        out = []
        if self.dtype == "tf32":     # a[i] = A[g + 8 (i odd)][q + 4 (i >= 2)]
            places = [(8 * (i % 2), self.q, 4 * (i // 2)) for i in range(4)]
        else:                        # a[i] = A[g + 8 (i//2 odd)][2q + i%2 + 8 (i >= 4)]
            places = [(8 * ((i // 2) % 2), self.q2, i % 2 + 8 * (i // 4)) for i in range(8)]
        for dr, lane_col, dc in places:
            row = kir.add(self.warp_row, kir.add(self.g, _c(dr)))
            col = kir.add(lane_col, _c(k0 + dc))
            out.append(kir.Load(tile, kir.add(kir.mul(row, _c(width)), col)))
        return out

    def b_fragment(self, tile: kir.Shared, width: int, k0: int, n0: int,
                   row0: kir.Expr | None = None, col0: kir.Expr | None = None
                   ) -> list[kir.Expr]:
        """B[k0 .. k0 + depth - 1, n0 .. n0 + 7] of a row-major [k, width] shared tile
        (rows from ``row0``, columns from ``col0``: a warp column's slice)."""
        if self.dtype == "tf32":     # b[i] = B[q + 4 i][g]
            ks = [kir.add(self.q, _c(k0 + 4 * i)) for i in range(2)]
        else:                        # b[i] = B[2q + i%2 + 8 (i >= 2)][g]
            ks = [kir.add(self.q2, _c(k0 + i % 2 + 8 * (i // 2))) for i in range(4)]
        if row0 is not None:
            ks = [kir.add(row0, k) for k in ks]
        col = kir.add(self.g, _c(n0)) if col0 is None else kir.add(col0, kir.add(self.g, _c(n0)))
        return [kir.Load(tile, kir.add(kir.mul(k, _c(width)), col)) for k in ks]

    @property
    def depth(self) -> int:
        """k of one MMA."""
        return kir.MMA_SHAPES[self.dtype][2]

    def first_gemm(self, out: list[kir.Stmt], n0: kir.Expr) -> None:
        ch, t = self.chain, self.t
        k0 = kir.Ref("k0", "i32")
        k_body = self.stage_first_gemm_tiles(k0, n0)
        for kc in range(0, t.block_k, self.depth):
            a = self.a_fragment(self.sa, t.block_k, kc)
            for nt in range(self.slice_n // 8):
                self.mma(k_body, a, self.b_fragment(self.sb, t.block_n, kc, 8 * nt,
                                                    col0=self.slice0),
                         [f"s_{nt}_{r}" for r in range(4)])
        k_body.append(kir.Barrier())
        out.append(kir.For("k0", _c(0), _c(ch.k), _c(t.block_k), tuple(k_body)))

    def second_gemm(self, out: list[kir.Stmt], n0: kir.Expr,
                    p: list[list[kir.Expr]]) -> None:
        ch, t = self.chain, self.t
        self.cooperative_load(out, self.sc, t.block_n, t.block_h, ch.c, n0, self.h0, ch.n, ch.h)
        out.append(kir.Barrier())
        for chunk in range(self.slice_n // self.depth):
            if self.dtype == "tf32":
                # S tile `chunk`, renumbered: a[i] = P[g + 8 (i odd)][2q + (i >= 2)], and
                # b[i] = C[chunk rows 2q + i][g] to match.
                j0 = 2 * chunk
                a = [p[0][j0], p[1][j0], p[0][j0 + 1], p[1][j0 + 1]]
                rows = [kir.add(self.slice0, kir.add(self.q2, _c(8 * chunk + i)))
                        for i in range(2)]
            else:
                # S tiles 2 chunk and 2 chunk + 1 (columns j = 4 chunk + ...) as A's fragment.
                j0 = 4 * chunk
                a = [p[0][j0], p[0][j0 + 1], p[1][j0], p[1][j0 + 1],
                     p[0][j0 + 2], p[0][j0 + 3], p[1][j0 + 2], p[1][j0 + 3]]
                rows = None
            for ht in range(t.block_h // 8):
                names = [self.acc[r // 2][2 * ht + r % 2][0] for r in range(4)]
                if rows is None:
                    b = self.b_fragment(self.sc, t.block_h, 16 * chunk, 8 * ht,
                                        row0=self.slice0)
                else:
                    b = [kir.Load(self.sc, kir.add(kir.mul(r, _c(t.block_h)),
                                                   kir.add(self.g, _c(8 * ht))))
                         for r in rows]
                self.mma(out, a, b, names)
        out.append(kir.Barrier())


def layout_class(tiling: ChainTiling) -> type:
    """The thread layout a tiling asks for (tensor cores or FMA): its S tile on the threads,
    its first GEMM and its row reductions over lanes. Kernels that walk the first GEMM's
    columns without a second GEMM (``codegen/lm_head_loss.py``) subclass it; they set the
    attributes ``layout``/``first_gemm`` read (``chain.a/.b/.m/.n/.k/.operand_dtype``,
    ``t``, ``params``, ``sa``/``sb``, ``batch``, ``m0``, ``h0``) themselves."""
    return _MmaChainKernel if tiling.mma else _FmaChainKernel


def sm_number(arch: str) -> int:
    """80 for "sm_80" (and "sm_90a": 90)."""
    return _sm(arch)


class _Program:
    """Element values of the chain program for the thread's (row i, column j) elements."""

    def __init__(self, kernel: _ChainKernel, out: list[kir.Stmt], n_cols: list[kir.Expr]):
        self.k = kernel
        self.out = out
        self.s = kernel.s
        self.n_cols = n_cols
        self.n_clamped = [kernel.let(out, "nc", kir.minimum(n, _c(kernel.chain.n - 1)))
                          for n in n_cols]
        self.memo: dict[tuple[int, int, int], kir.Expr] = {}

    def value(self, index: int, i: int, j: int) -> kir.Expr:
        op = self.k.chain.program[index]
        key = (index, i, j if op.rank == "tile" else -1)
        got = self.memo.get(key)
        if got is None:
            if op.kind == "reduce" and index in self.k.row_locals:
                expr = self.rounded(op, kir.Ref(f"{self.k.row_locals[index]}_{i}", _F32))
            else:
                expr = self.compute(op, i, j)
            got = self.k.let(self.out, op.kind, expr)
            self.memo[key] = got
        return got

    def compute(self, op: ChainOp, i: int, j: int) -> kir.Expr:
        k = self.k
        if op.kind == "acc":
            return self.rounded(op, kir.Ref(self.s[i][j], _F32))
        if op.kind == "const":
            return kir.Const(float(op.value), _F32) if op.dtype != "pred" else \
                kir.Const(bool(op.value), "i1")
        if op.kind == "input":
            col = self.n_clamped[j] if op.rank == "tile" else _c(0)
            index = _offset(op.view, k.batch, k.rows_clamped[i], col)
            return kir.Load(k.param(op.view.node), index)
        if op.kind == "iota":
            col = self.n_clamped[j] if op.rank == "tile" else _c(0)
            index = _offset(op.view, k.batch, k.rows_clamped[i], col)
            stride, size = op.period
            return kir.Binary("rem", kir.Binary("div", index, _c(stride)), _c(size))
        if op.kind != "elementwise":
            raise CodegenError(f"{k.name}: a {op.kind} outside the softmax")
        args = [self.value(a, i, j) for a in op.args]
        code = op.opcode
        if code in UNARY_OPS:
            return self.rounded(op, kir.Unary(UNARY_OPS[code], args[0]))
        if code in BINARY_OPS:
            return self.rounded(op, kir.Binary(BINARY_OPS[code], args[0], args[1]))
        if code == "compare":
            return kir.Compare(COMPARE_OPS[op.direction or "EQ"], args[0], args[1])
        if code == "select":
            return kir.Select(args[0], args[1], args[2])
        if code == "clamp":
            return kir.Binary("min", kir.Binary("max", args[1], args[0]), args[2])
        if code == "convert":
            if op.dtype == "pred":
                return kir.Compare("ne", args[0], kir.f32(0.0))
            arg = args[0] if args[0].dtype == _F32 else kir.Select(args[0], kir.f32(1.0),
                                                                   kir.f32(0.0))
            return self.rounded(op, arg)
        raise CodegenError(f"{k.name}: {code} is not lowered in a chain kernel")

    @staticmethod
    def rounded(op: ChainOp, expr: kir.Expr) -> kir.Expr:
        """f16/bf16 results rounded as XLA rounds each op's result."""
        if op.dtype in ("f16", "bf16") and expr.dtype == _F32 and (
                op.kind in ("acc", "reduce") or op.opcode in _ROUNDED):
            return kir.Unary(f"round_to_{op.dtype}", expr)
        return expr
