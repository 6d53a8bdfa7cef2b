"""The tensor-core thread layout of a GEMM-chain kernel (``stitch.codegen.gemm_chain``):
mma.sync fragments, P from registers into the second GEMM, warp columns folded at the end."""
from __future__ import annotations

from . import kir
from .gemm_chain_kernel import ChainKernel
from .tile_code import NEG_INF

_c = kir.i32
_F32 = "f32"


class MmaChainKernel(ChainKernel):
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
                    dead = self.let(fold, "dead", kir.Compare("eq", new, NEG_INF))
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
