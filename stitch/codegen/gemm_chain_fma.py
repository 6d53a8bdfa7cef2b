"""The FMA thread layout of a GEMM-chain kernel (``stitch.codegen.gemm_chain``): f32 register
tiles, P through shared memory."""
from __future__ import annotations

from . import kir
from .gemm_chain_kernel import ChainKernel

_c = kir.i32
_F32 = "f32"


class FmaChainKernel(ChainKernel):
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
