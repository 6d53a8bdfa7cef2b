"""Kernel IR emitters the tiled GEMM kernels share: the GEMM chain (``gemm_chain``), the
attention backward (``attention_backward``, and the LM-head backward through its rule) and
the LM-head loss (``lm_head_loss``, a chain layout with the loss's steps in front).

``TileCode`` is a base class: a kernel class holds ``names`` (a counter keeping Let and
loop names unique), ``shuffle_lanes`` (consecutive lanes of one warp sharing a tile row) and
``t.threads`` (the block's threads). Each emitter appends statements to the list it is
given, so what it emits sits where the caller's code sits.
"""
from __future__ import annotations

from typing import Callable

from . import kir

_c = kir.i32
_F32 = "f32"
NEG_INF = kir.f32(float("-inf"))

# (clamped row, clamped col) -> the element's offset in the source buffer.
TileIndex = Callable[[kir.Expr, kir.Expr], kir.Expr]
# (loop body, offset, clamped col) -> the element's f32 value (a Load, maybe converted).
TileValue = Callable[[list[kir.Stmt], kir.Expr, kir.Expr], kir.Expr]


def lanes_problem(lanes: int, block_h: int, ratio: str) -> str | None:
    """Why an FMA layout's ``lanes`` per tile row (``ratio``, e.g. "block_n / thread_n")
    do not fit a warp's xor butterfly or the block's ``block_h`` result columns; None when
    they do."""
    if lanes > 32 or lanes & (lanes - 1):
        return f"{ratio} (lanes per row) must be a power of two <= 32"
    if block_h % lanes:
        return "block_h must be a multiple of the lanes per row"
    return None


def block_problem(threads: int, shared_bytes: int, shared_limit: int) -> str | None:
    """Why a block of ``threads`` using ``shared_bytes`` cannot launch; None when it can."""
    if threads % 32 or not 32 <= threads <= 1024:
        return "threads must be a multiple of 32 in [32, 1024]"
    if shared_bytes > shared_limit:
        return f"{shared_bytes} bytes of shared memory (limit {shared_limit})"
    return None


class TileCode:
    """Let names, tile loads into shared memory, row reductions over a row's lanes and the
    online softmax step, one tensor-core MMA (see the module docstring for what a subclass holds)."""

    names: int
    shuffle_lanes: int
    dtype: str              # tensor-core layouts: the MMA's operand type (kir.MMA_SHAPES)

    def let(self, out: list[kir.Stmt], hint: str, expr: kir.Expr) -> kir.Expr:
        """``expr`` bound to a fresh name (constants and names stay as they are)."""
        if isinstance(expr, (kir.Const, kir.Ref)):
            return expr
        self.names += 1
        name = f"{hint}_{self.names}"
        out.append(kir.Let(name, expr))
        return kir.Ref(name, expr.dtype)

    def load_tile(self, out: list[kir.Stmt], tile: kir.Shared, rows: int, cols: int,
                  row0: kir.Expr, col0: kir.Expr, row_limit: int, col_limit: int,
                  index: TileIndex, value: TileValue, along_rows: bool = False,
                  transposed: bool = False) -> None:
        """tile[r * cols + c] (``transposed``: [c * rows + r]) = the source element at
        (row0 + r, col0 + c), 0 past ``row_limit`` / ``col_limit`` (the index is clamped,
        so every load stays in bounds). The block's threads stride over the tile, along
        columns, or along rows where the source's unit stride runs down them
        (``along_rows``): neighbouring threads read neighbouring words."""
        self.names += 1
        var = f"e{self.names}"
        body: list[kir.Stmt] = []
        e = kir.Ref(var, "i32")
        if along_rows:
            r = self.let(body, "r", kir.Binary("rem", e, _c(rows)))
            c = self.let(body, "c", kir.Binary("div", e, _c(rows)))
        else:
            r = self.let(body, "r", kir.Binary("div", e, _c(cols)))
            c = self.let(body, "c", kir.Binary("rem", e, _c(cols)))
        slot = kir.add(kir.mul(c, _c(rows)), r) if transposed else kir.add(kir.mul(r, _c(cols)), c)
        row = self.let(body, "row", kir.add(row0, r))
        col = self.let(body, "col", kir.add(col0, c))
        valid = kir.logical_and(kir.less(row, _c(row_limit)), kir.less(col, _c(col_limit)))
        col_clamped = kir.minimum(col, _c(col_limit - 1))
        at = index(kir.minimum(row, _c(row_limit - 1)), col_clamped)
        loaded = value(body, at, col_clamped)
        body.append(kir.Store(tile.name, slot, kir.Select(valid, loaded, kir.f32(0.0))))
        out.append(kir.For(var, kir.ThreadIdx(), _c(rows * cols), _c(self.t.threads),
                           tuple(body)))

    def row_reduce(self, out: list[kir.Stmt], op: str, values: list[kir.Expr]) -> kir.Expr:
        """``op`` over the thread's values, then over the lanes of its row (consecutive
        lanes of one warp: an xor butterfly)."""
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

    def online_step(self, out: list[kir.Stmt], x: list[kir.Expr], max_name: str,
                    sum_name: str) -> tuple[kir.Expr, list[kir.Expr]]:
        """One step of an online softmax (logsumexp) of a row's values ``x`` (the thread's,
        -inf where invalid): the running max ``max_name`` and sum ``sum_name`` (Locals)
        take this step's values, the sum rescaled as the max grows. Returns the old sum's
        scale and exp(x - new max)."""
        old = kir.Ref(max_name, _F32)
        new = self.let(out, "mnew", kir.Binary("max", old, self.row_reduce(out, "max", x)))
        # A row whose every value so far is -inf (masked) keeps P = 0, sum 0 and scale 1.
        dead = self.let(out, "dead", kir.Compare("eq", new, NEG_INF))
        scale = self.let(out, "scale", kir.Select(
            dead, kir.f32(1.0), kir.Unary("exp", kir.Binary("sub", old, new))))
        e = [self.let(out, "e", kir.Select(dead, kir.f32(0.0), kir.Unary(
            "exp", kir.Binary("sub", xj, new)))) for xj in x]
        total = self.row_reduce(out, "add", e)
        out.append(kir.Assign(sum_name, kir.add(kir.mul(kir.Ref(sum_name, _F32), scale), total)))
        out.append(kir.Assign(max_name, new))
        return scale, e

    def mma(self, out: list[kir.Stmt], a: list[kir.Expr], b: list[kir.Expr],
            acc: list[str]) -> None:
        """acc (four f32 Locals, the D layout) += a x b: one ``kir.MmaSync`` of ``dtype``."""
        self.names += 1
        dest = tuple(f"d{self.names}_{r}" for r in range(4))
        out.append(kir.MmaSync(dest, a, b, [kir.Ref(n, _F32) for n in acc], self.dtype))
        for name, d in zip(acc, dest):
            out.append(kir.Assign(name, kir.Ref(d, _F32)))
