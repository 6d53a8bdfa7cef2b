"""Lowering of a GEMM chain (``hlo_passes.gemm_chains.GemmChain``) to one Kernel IR kernel.

The kernel has FlashAttention's / MCFuser's shape. A block owns batch ``b``, rows
``m0 .. m0 + block_m`` and result columns ``h0 .. h0 + block_h``; it walks n in steps of
``block_n``:

1. the first GEMM's tile S[block_m, block_n]: k in steps of ``block_k``, the block loads A
   and B tiles into shared memory together (zeros past the edges), then every thread adds
   its ``thread_m x thread_n`` register tile (f32 FMA);
2. the chain program (scale, mask, activation...) on the thread's S elements, in registers;
3. with a softmax, the online softmax: the tile's row maximum (the ``lanes`` threads of a
   row are consecutive lanes of one warp: an xor-shuffle butterfly), a running maximum
   and sum per row, and the accumulator rescaled by exp(old max - new max);
4. P goes to shared memory, a C tile [block_n, block_h] next to it, and every thread adds
   P[its rows, :] x C[:, its columns] into its ``thread_m x thread_h`` accumulator.

At the end each thread stores its accumulator (divided by the row sum for a softmax). A
split-K reduce XLA put after the second GEMM needs nothing: the block sums all of n.
Rows, columns and contractions that do not fill a tile are handled by loading zeros (a
clamped index keeps every load in bounds), masking S columns past n (-inf before a softmax,
0 otherwise) and not storing rows / columns past the edges.

Threads: ``t = ty * lanes + tx``; thread (ty, tx) owns tile rows ``ty * thread_m + i`` and
tile columns ``tx + j * lanes`` (interleaved, so a warp's shared-memory reads of one row
hit consecutive words).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from hlo_passes.gemm_chains import ChainOp, GemmChain, OperandView, softmax_parts
from hlo_passes.graph import OpGraph

from . import kir
from .errors import CodegenError
from .lower import LoweredKernel
from .values import _BINARY, _COMPARE, _UNARY, leaf, storage_dtype

log = logging.getLogger(__name__)

_c = kir.i32
_F32 = "f32"
_NEG_INF = kir.f32(float("-inf"))
# Ops whose f16/bf16 result XLA rounds to its element type (as values.py's _ROUNDS).
_ROUNDED = (frozenset(_UNARY) - {"negate", "abs", "sign", "floor", "ceil"}
            | frozenset(_BINARY) - {"maximum", "minimum"} | {"convert", "logistic"})
# Shared memory one block may use without opting in to more (bytes).
SHARED_LIMIT = 48 * 1024


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


@dataclass(frozen=True)
class ChainTiling:
    """How a chain kernel splits its work (see the module docstring)."""
    block_m: int = 64       # rows of M per block
    block_n: int = 64       # N columns per inner step
    threads: int = 256      # threads per block = (block_m / thread_m) * (block_n / thread_n)
    thread_m: int = 4       # register tile per thread: rows ...
    thread_n: int = 4       # ... and S columns
    block_k: int = 16       # K per shared-memory stage of the first GEMM
    block_h: int = 64       # result columns per block (H is split over blocks beyond it)
    mma: bool = False       # tensor cores for bf16/f16 (not lowered yet: must be False)

    @property
    def lanes(self) -> int:
        """Threads sharing a tile row (consecutive lanes of one warp)."""
        return self.block_n // self.thread_n

    @property
    def thread_h(self) -> int:
        return self.block_h // self.lanes

    def shared_bytes(self) -> int:
        """A, B, P and C tiles, f32."""
        return 4 * (self.block_m * self.block_k + self.block_k * self.block_n
                    + self.block_m * self.block_n + self.block_n * self.block_h)

    def accumulators(self) -> int:
        """f32 values a thread keeps live across the n loop and inside one step."""
        return self.thread_m * (self.thread_n + self.thread_h + 2)

    def check(self) -> None:
        def bad(why: str) -> CodegenError:
            return CodegenError(f"chain tiling {self}: {why}")
        for name in ("block_m", "block_n", "threads", "thread_m", "thread_n", "block_k",
                     "block_h"):
            if getattr(self, name) < 1:
                raise bad(f"{name} must be positive")
        if self.block_m % self.thread_m or self.block_n % self.thread_n:
            raise bad("thread tiles must divide the block tile")
        lanes = self.lanes
        if lanes > 32 or lanes & (lanes - 1):
            raise bad("block_n / thread_n (lanes per row) must be a power of two <= 32")
        if self.threads != lanes * (self.block_m // self.thread_m):
            raise bad("threads must be (block_m / thread_m) * (block_n / thread_n)")
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise bad("threads must be a multiple of 32 in [32, 1024]")
        if self.block_h % lanes:
            raise bad("block_h must be a multiple of the lanes per row")
        if self.shared_bytes() > SHARED_LIMIT:
            raise bad(f"{self.shared_bytes()} bytes of shared memory (limit {SHARED_LIMIT})")
        if self.mma:
            raise bad("tensor-core MMA is not lowered yet")

    @staticmethod
    def default_for(chain: GemmChain, arch: str = "sm_80") -> "ChainTiling":
        """A tiling that fits the chain's dims: 64 x 64 tiles, 4 x 4 register tiles and
        256 threads for large chains (ptxas keeps these at <= 80 registers without spills
        on sm_80 and sm_90 for every MCFuser shape), smaller tiles where m / n are small;
        H in blocks of up to 64 columns."""
        block_m = 64 if chain.m >= 64 else max(16, _pow2_at_least(chain.m))
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


def lower_gemm_chain(graph: OpGraph, chain: GemmChain, tiling: ChainTiling | None = None,
                     name: str = "gemm_chain", arch: str = "sm_80") -> LoweredKernel:
    """One Kernel IR kernel computing ``chain`` (params: ``chain.inputs`` then the output)."""
    tiling = tiling or ChainTiling.default_for(chain, arch)
    tiling.check()
    kernel = _ChainKernel(graph, chain, tiling, name).build()
    note = (f"gemm chain {chain.batch}x{chain.m}x{chain.n}x{chain.k}x{chain.h} "
            f"({'online softmax' if chain.softmax else 'no softmax'}), tiles "
            f"m{tiling.block_m} n{tiling.block_n} k{tiling.block_k} h{tiling.block_h}, "
            f"{tiling.threads} threads")
    return LoweredKernel(kernel, list(chain.inputs), [chain.output], ["gemm_chain"], [note])


# ----------------------------------------------------------------------------- helpers


def _add(a: kir.Expr, b: kir.Expr) -> kir.Expr:
    return kir.Binary("add", a, b)


def _mul(a: kir.Expr, b: kir.Expr) -> kir.Expr:
    return kir.Binary("mul", a, b)


def _min(a: kir.Expr, b: kir.Expr) -> kir.Expr:
    return kir.Binary("min", a, b)


def _lt(a: kir.Expr, b: kir.Expr) -> kir.Expr:
    return kir.Compare("lt", a, b)


def _and(a: kir.Expr, b: kir.Expr) -> kir.Expr:
    return kir.Binary("and", a, b)


def _offset(view: OperandView, b: kir.Expr, r: kir.Expr, c: kir.Expr) -> kir.Expr:
    terms = [x if s == 1 else _mul(x, _c(s))
             for x, s in ((b, view.batch_stride), (r, view.row_stride), (c, view.col_stride))
             if s]
    if not terms:
        return _c(0)
    out = terms[0]
    for t in terms[1:]:
        out = _add(out, t)
    return out


class _ChainKernel:
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
        t = tiling
        self.sa = kir.Shared("tile_a", _F32, t.block_m * t.block_k)
        self.sb = kir.Shared("tile_b", _F32, t.block_k * t.block_n)
        self.sp = kir.Shared("tile_p", _F32, t.block_m * t.block_n)
        self.sc = kir.Shared("tile_c", _F32, t.block_n * t.block_h)
        self.softmax = softmax_parts(chain.program)
        if any(op.kind == "reduce" for op in chain.program) and self.softmax is None:
            raise CodegenError(f"{name}: row reductions other than one softmax are not "
                               "lowered in a chain kernel")
        self.names = 0

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

    def cooperative_load(self, out: list[kir.Stmt], tile: kir.Shared, rows: int, cols: int,
                         source: OperandView, row0: kir.Expr, col0: kir.Expr,
                         row_limit: int, col_limit: int) -> None:
        """tile[r * cols + c] = source[b, row0 + r, col0 + c] (0 past the limits), the
        block's threads striding over the tile."""
        var = f"e{self.names + 1}"
        self.names += 1
        body: list[kir.Stmt] = []
        e = kir.Ref(var, "i32")
        r = self.let(body, "r", kir.Binary("div", e, _c(cols)))
        c = self.let(body, "c", kir.Binary("rem", e, _c(cols)))
        row = self.let(body, "row", _add(row0, r))
        col = self.let(body, "col", _add(col0, c))
        valid = _and(_lt(row, _c(row_limit)), _lt(col, _c(col_limit)))
        index = _offset(source, self.batch, _min(row, _c(row_limit - 1)),
                        _min(col, _c(col_limit - 1)))
        value = kir.Load(self.param(source.node), index)
        body.append(kir.Store(tile.name, e, kir.Select(valid, value, kir.f32(0.0))))
        out.append(kir.For(var, kir.ThreadIdx(), _c(rows * cols), _c(self.t.threads),
                           tuple(body)))

    # --- the kernel ---------------------------------------------------------------------
    def build(self) -> kir.Kernel:
        ch, t = self.chain, self.t
        m_blocks = -(-ch.m // t.block_m)
        h_blocks = -(-ch.h // t.block_h)
        grid = ch.batch * m_blocks * h_blocks
        body: list[kir.Stmt] = []
        bid, tid = kir.BlockIdx(), kir.ThreadIdx()
        hb = self.let(body, "hb", kir.Binary("rem", bid, _c(h_blocks)))
        mb = self.let(body, "mb", kir.Binary("rem", kir.Binary("div", bid, _c(h_blocks)),
                                             _c(m_blocks)))
        self.batch = self.let(body, "batch", kir.Binary("div", bid, _c(h_blocks * m_blocks)))
        self.m0 = self.let(body, "m0", _mul(mb, _c(t.block_m)))
        self.h0 = self.let(body, "h0", _mul(hb, _c(t.block_h)))
        self.tx = self.let(body, "tx", kir.Binary("rem", tid, _c(t.lanes)))
        self.ty = self.let(body, "ty", kir.Binary("div", tid, _c(t.lanes)))
        self.row_in_tile = [_add(_mul(self.ty, _c(t.thread_m)), _c(i))
                            for i in range(t.thread_m)]
        # Per-thread indices are expressions, recomputed where used: kept in registers
        # across the n loop they cost more than the integer ops (ptxas spilled them).
        self.rows = [_add(self.m0, r) for r in self.row_in_tile]
        self.rows_clamped = [_min(m, _c(ch.m - 1)) for m in self.rows]
        self.col_in_tile = [_add(self.tx, _c(j * t.lanes)) for j in range(t.thread_n)]
        self.h_cols = [_add(self.h0, _add(self.tx, _c(j * t.lanes)))
                       for j in range(t.thread_h)]
        acc = [[f"o_{i}_{j}" for j in range(t.thread_h)] for i in range(t.thread_m)]
        s = [[f"s_{i}_{j}" for j in range(t.thread_n)] for i in range(t.thread_m)]
        for row in acc + s:
            for name in row:
                body.append(kir.Local(name, _F32, kir.f32(0.0)))
        if self.softmax is not None:
            for i in range(t.thread_m):
                body.append(kir.Local(f"mx_{i}", _F32, _NEG_INF))
                body.append(kir.Local(f"sum_{i}", _F32, kir.f32(0.0)))
        body.append(kir.For("n0", _c(0), _c(ch.n), _c(t.block_n),
                            tuple(self.n_step(acc, s))))
        body.extend(self.store(acc))
        return kir.Kernel(self.name, (*self.params.values(), self.out),
                          (self.sa, self.sb, self.sp, self.sc), grid, t.threads,
                          tuple(body)).validate()

    def n_step(self, acc: list[list[str]], s: list[list[str]]) -> list[kir.Stmt]:
        ch, t = self.chain, self.t
        out: list[kir.Stmt] = []
        n0 = kir.Ref("n0", "i32")
        for row in s:
            for name in row:
                out.append(kir.Assign(name, kir.f32(0.0)))
        # 1. S = A[rows, :] x B[:, n0 + cols], k in shared-memory stages.
        k_body: list[kir.Stmt] = []
        k0 = kir.Ref("k0", "i32")
        self.cooperative_load(k_body, self.sa, t.block_m, t.block_k, ch.a, self.m0, k0,
                              ch.m, ch.k)
        self.cooperative_load(k_body, self.sb, t.block_k, t.block_n, ch.b, k0, n0, ch.k, ch.n)
        k_body.append(kir.Barrier())
        inner: list[kir.Stmt] = []
        kk = kir.Ref("kk", "i32")
        a = [self.let(inner, "a", kir.Load(self.sa, _add(_mul(r, _c(t.block_k)), kk)))
             for r in self.row_in_tile]
        b = [self.let(inner, "b", kir.Load(self.sb, _add(_mul(kk, _c(t.block_n)), c)))
             for c in self.col_in_tile]
        for i in range(t.thread_m):
            for j in range(t.thread_n):
                inner.append(kir.Assign(s[i][j], _add(kir.Ref(s[i][j], _F32), _mul(a[i], b[j]))))
        k_body.append(kir.For("kk", _c(0), _c(t.block_k), _c(1), tuple(inner)))
        k_body.append(kir.Barrier())
        out.append(kir.For("k0", _c(0), _c(ch.k), _c(t.block_k), tuple(k_body)))

        # 2./3. The program on the thread's S elements, then P (online softmax).
        n_cols = [self.let(out, "n", _add(n0, c)) for c in self.col_in_tile]
        valid_n = [self.let(out, "vn", _lt(n, _c(ch.n))) for n in n_cols]
        program = _Program(self, out, s, n_cols)
        p: list[list[kir.Expr]] = []
        if self.softmax is None:
            last = len(ch.program) - 1
            for i in range(t.thread_m):
                p.append([self.let(out, "p", kir.Select(valid_n[j], program.value(last, i, j),
                                                        kir.f32(0.0)))
                          for j in range(t.thread_n)])
        else:
            p = self.online_softmax(out, program, valid_n, acc)

        # 4. acc += P[rows, :] x C[n0 + :, h0 + cols].
        for i in range(t.thread_m):
            for j in range(t.thread_n):
                index = _add(_mul(self.row_in_tile[i], _c(t.block_n)), self.col_in_tile[j])
                out.append(kir.Store(self.sp.name, index, p[i][j]))
        self.cooperative_load(out, self.sc, t.block_n, t.block_h, ch.c, n0, self.h0, ch.n, ch.h)
        out.append(kir.Barrier())
        inner = []
        cc = kir.Ref("cc", "i32")
        pv = [self.let(inner, "pv", kir.Load(self.sp, _add(_mul(r, _c(t.block_n)), cc)))
              for r in self.row_in_tile]
        cv = [self.let(inner, "cv", kir.Load(self.sc, _add(_mul(cc, _c(t.block_h)),
                                                           _add(self.tx, _c(j * t.lanes)))))
              for j in range(t.thread_h)]
        for i in range(t.thread_m):
            for j in range(t.thread_h):
                inner.append(kir.Assign(acc[i][j], _add(kir.Ref(acc[i][j], _F32),
                                                        _mul(pv[i], cv[j]))))
        out.append(kir.For("cc", _c(0), _c(t.block_n), _c(1), tuple(inner)))
        out.append(kir.Barrier())
        return out

    def row_reduce(self, out: list[kir.Stmt], op: str, values: list[kir.Expr]) -> kir.Expr:
        """``op`` over the thread's values and then over the lanes of its row."""
        total = values[0]
        for v in values[1:]:
            total = kir.Binary(op, total, v)
        total = self.let(out, f"r{op}", total)
        offset = 1
        while offset < self.t.lanes:
            self.names += 1
            dest = f"sh_{op}_{self.names}"
            out.append(kir.WarpShuffle(dest, total, _c(offset), "xor"))
            total = self.let(out, f"r{op}", kir.Binary(op, total, kir.Ref(dest, _F32)))
            offset *= 2
        return total

    def online_softmax(self, out: list[kir.Stmt], program: "_Program",
                       valid_n: list[kir.Expr], acc: list[list[str]]) -> list[list[kir.Expr]]:
        """P = exp(X - running max); the running sum and the accumulator follow the max."""
        parts = self.softmax
        t = self.t
        p: list[list[kir.Expr]] = []
        for i in range(t.thread_m):
            x = [self.let(out, "x", kir.Select(valid_n[j], program.value(parts.x, i, j),
                                               _NEG_INF)) for j in range(t.thread_n)]
            old = kir.Ref(f"mx_{i}", _F32)
            new = self.let(out, "mnew", kir.Binary("max", old, self.row_reduce(out, "max", x)))
            # A row whose every value so far is -inf (masked) keeps P = 0 and scale 1.
            dead = self.let(out, "dead", kir.Compare("eq", new, _NEG_INF))
            scale = self.let(out, "scale", kir.Select(
                dead, kir.f32(1.0), kir.Unary("exp", kir.Binary("sub", old, new))))
            e = [self.let(out, "e", kir.Select(dead, kir.f32(0.0), kir.Unary(
                "exp", kir.Binary("sub", xj, new)))) for xj in x]
            total = self.row_reduce(out, "add", e)
            out.append(kir.Assign(f"sum_{i}", _add(_mul(kir.Ref(f"sum_{i}", _F32), scale),
                                                   total)))
            out.append(kir.Assign(f"mx_{i}", new))
            for name in acc[i]:
                out.append(kir.Assign(name, _mul(kir.Ref(name, _F32), scale)))
            p.append(e)
        return p

    def store(self, acc: list[list[str]]) -> list[kir.Stmt]:
        ch, t = self.chain, self.t
        out: list[kir.Stmt] = []
        for i in range(t.thread_m):
            inv = None
            if self.softmax is not None:
                inv = self.let(out, "inv", kir.Binary("div", kir.f32(1.0),
                                                      kir.Ref(f"sum_{i}", _F32)))
            for j in range(t.thread_h):
                value: kir.Expr = kir.Ref(acc[i][j], _F32)
                if inv is not None:
                    value = _mul(value, inv)
                cond = _and(_lt(self.rows[i], _c(ch.m)), _lt(self.h_cols[j], _c(ch.h)))
                index = _offset(ch.out, self.batch, self.rows[i], self.h_cols[j])
                out.append(kir.If(cond, (kir.Store(self.out.name, index, value),)))
        return out


class _Program:
    """Element values of the chain program for the thread's (row i, column j) elements."""

    def __init__(self, kernel: _ChainKernel, out: list[kir.Stmt], s: list[list[str]],
                 n_cols: list[kir.Expr]):
        self.k = kernel
        self.out = out
        self.s = s
        self.n_cols = n_cols
        self.n_clamped = [kernel.let(out, "nc", _min(n, _c(kernel.chain.n - 1)))
                          for n in n_cols]
        self.memo: dict[tuple[int, int, int], kir.Expr] = {}

    def value(self, index: int, i: int, j: int) -> kir.Expr:
        op = self.k.chain.program[index]
        key = (index, i, j if op.rank == "tile" else -1)
        got = self.memo.get(key)
        if got is None:
            got = self.k.let(self.out, op.kind, self.compute(op, i, j))
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
        if op.kind != "elementwise":
            raise CodegenError(f"{k.name}: a {op.kind} outside the softmax")
        args = [self.value(a, i, j) for a in op.args]
        code = op.opcode
        if code in _UNARY:
            return self.rounded(op, kir.Unary(_UNARY[code], args[0]))
        if code in _BINARY:
            return self.rounded(op, kir.Binary(_BINARY[code], args[0], args[1]))
        if code == "compare":
            return kir.Compare(_COMPARE[op.direction or "EQ"], args[0], args[1])
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
                op.kind == "acc" or op.opcode in _ROUNDED):
            return kir.Unary(f"round_to_{op.dtype}", expr)
        return expr
