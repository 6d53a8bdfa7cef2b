"""The parts every GEMM-chain kernel shares (``stitch.codegen.gemm_chain``): params and
shared tiles, the block's walk over n (row passes, the main pass), the chain program's
steps, the online softmax, the stores and the n-split combine. The thread layouts
(``gemm_chain_fma``, ``gemm_chain_mma``) place the tiles on the threads and run the GEMMs."""
from __future__ import annotations

from stitch.hlo.gemm_chains import GemmChain, OperandView, needs_row_pass, softmax_parts
from stitch.hlo.graph import OpGraph

from . import kir
from .gemm_chain_tiling import ChainTiling
from .gemm_chain_values import ChainProgramValues, view_offset
from .tile_code import NEG_INF, TileCode
from .values import BINARY_OPS, leaf, storage_dtype

_c = kir.i32
_F32 = "f32"
# What a column past n contributes to a row reduction.
_IDENTITY = {"add": 0.0, "multiply": 1.0, "maximum": float("-inf"), "minimum": float("inf")}


class ChainKernel(TileCode):
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
        param = self.param(source.node)
        self.load_tile(out, tile, rows, cols, row0, col0, row_limit, col_limit,
                       lambda r, c: view_offset(source, self.batch, r, c),
                       lambda body, at, c: kir.Load(param, at),
                       along_rows=source.row_stride == 1 and source.col_stride != 1)

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
                body.append(kir.Local(f"mx_{i}", _F32, NEG_INF))
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

    def s_step(self, out: list[kir.Stmt]) -> tuple[list[kir.Expr], "ChainProgramValues"]:
        """S of this n step, in registers; the columns' validity and the program on them."""
        n_cols, valid_n = self.first_gemm_step(out, self.chain.n)
        return valid_n, ChainProgramValues(self, out, n_cols)

    def first_gemm_step(self, out: list[kir.Stmt], n_limit: int
                        ) -> tuple[list[kir.Expr], list[kir.Expr]]:
        """S of this n step (``n0``) in the registers ``s``; the thread's columns and
        whether each lies before ``n_limit``."""
        n0 = kir.Ref("n0", "i32")
        for row in self.s:
            for name in row:
                out.append(kir.Assign(name, kir.f32(0.0)))
        self.first_gemm(out, n0)
        n_cols = [self.let(out, "n", kir.add(n0, c)) for c in self.cols]
        valid_n = [self.let(out, "vn", kir.less(n, _c(n_limit))) for n in n_cols]
        return n_cols, valid_n

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

    def online_update(self, out: list[kir.Stmt], program: "ChainProgramValues",
                      valid_n: list[kir.Expr], x_op: int, i: int, max_name: str,
                      sum_name: str) -> tuple[kir.Expr, list[kir.Expr]]:
        """One n step of an online softmax of program value ``x_op`` on row ``i``: the
        running max ``max_name`` and sum ``sum_name`` (Locals) take this step's values, the
        sum rescaled as the max grows. Returns the old sum's scale and exp(X - new max)."""
        x = [self.let(out, "x", kir.Select(valid_n[j], program.value(x_op, i, j),
                                           NEG_INF)) for j in range(len(self.cols))]
        return self.online_step(out, x, max_name, sum_name)

    def store_tiles(self, out: list[kir.Stmt], program: "ChainProgramValues",
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
                    out.append(kir.If(cond, (kir.Store(param.name, view_offset(
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
        program = ChainProgramValues(self, out, [_c(0)] * len(self.cols))
        first_lane = self.let(out, "lane0", kir.Compare("eq", self.cols[0], _c(0)))
        for extra, param in rows:
            for i, row in enumerate(self.rows):
                value = program.value(extra.value, i, 0)
                cond = kir.logical_and(kir.less(row, _c(ch.m)), first_lane)
                out.append(kir.If(cond, (kir.Store(param.name, view_offset(
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

    def online_softmax(self, out: list[kir.Stmt], program: "ChainProgramValues",
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
                    target, index = self.out.name, view_offset(ch.out, self.batch, row, h)
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
        body.append(kir.Store(self.out.name, view_offset(ch.out, b, row, col), total))
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
            w = self.let(body, "w", kir.Select(kir.Compare("eq", m, NEG_INF), kir.f32(0.0),
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
