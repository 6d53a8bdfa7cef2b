"""The chain program's element values in a chain kernel (``stitch.codegen.gemm_chain``):
each op on the thread's (row, column) elements, rounded as XLA rounds f16/bf16 results, and
an ``OperandView``'s element offset as index arithmetic."""
from __future__ import annotations

from stitch.hlo.gemm_chains import ChainOp, OperandView

from . import kir
from .errors import CodegenError
from .tile_code import TileCode
from .values import BINARY_OPS, COMPARE_OPS, UNARY_OPS

_c = kir.i32
_F32 = "f32"
# Ops whose f16/bf16 result XLA rounds to its element type (as values.py's _ROUNDS).
_ROUNDED = (frozenset(UNARY_OPS) - {"negate", "abs", "sign", "floor", "ceil"}
            | frozenset(BINARY_OPS) - {"maximum", "minimum"} | {"convert", "logistic"})


def view_offset(view: OperandView, b: kir.Expr, r: kir.Expr, c: kir.Expr) -> kir.Expr:
    """Element (b, r, c) of ``view`` as an offset into its buffer."""
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


class ChainProgramValues:
    """Element values of the chain program for the thread's (row i, column j) elements.
    ``kernel``: a ``gemm_chain_kernel.ChainKernel`` (its S registers, rows, params)."""

    def __init__(self, kernel: TileCode, out: list[kir.Stmt], n_cols: list[kir.Expr]):
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
            index = view_offset(op.view, k.batch, k.rows_clamped[i], col)
            return kir.Load(k.param(op.view.node), index)
        if op.kind == "iota":
            col = self.n_clamped[j] if op.rank == "tile" else _c(0)
            index = view_offset(op.view, k.batch, k.rows_clamped[i], col)
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
