"""The LM head's logits GEMM with an online logsumexp over vocabulary tiles
(``stitch.hlo.lm_head_loss.LmHeadLoss``): one kernel writing the per-row ``lse``, the
label's logit ``picked`` and ``log_prob`` = picked - lse (labels as jax's take_along_axis
reads them), or log_prob's sum over the rows — never the [rows, vocab] logits.

A block owns ``block_m`` rows and walks the vocabulary in ``block_n`` steps, as a GEMM
chain kernel walks n (``codegen/gemm_chain.py``: its thread layouts, FMA or tensor cores,
compute each logits tile in registers). Per step and row: the tile's row max (xor shuffles
over the row's lanes), the running max and the sum of exp rescaled as the max grows, and the
logit at the row's label added into a per-thread sum where a column is the label (one
column of the row matches; lanes are summed once at the end). bf16 logits (a bf16 GEMM
result) are rounded to bf16 first, as XLA's GEMM writes them.

``ChainTiling.n_split`` = S > 1 splits the vocabulary over S blocks per row block (the
split is the minor digit of blockIdx): each writes its rows' (max, sum, picked) to a
``kir.GlobalScratch`` [S, rows, 3]; after a ``kir.GridBarrier`` (a relaunch on a GPU) the
grid strides over rows and combines them in split order (max M, sum of l_i exp(m_i - M),
lse = M + log of it; picked summed). Without splits a GPT-2-sized step (8192 rows) has only
rows / block_m blocks.

The sum of log_prob over the rows (``log_prob_sum``: the loss before its mean, what XLA's
reduce over the rows computes) goes through a ``kir.GlobalScratch`` of the rows' values and
a last grid-barrier phase in which block 0 adds them in a fixed order.
"""
from __future__ import annotations

import logging

from stitch.hlo.element_types import CODEGEN_STORAGE
from stitch.hlo.lm_head_loss import LmHeadLoss

from . import kir
from .errors import CodegenError
from .gemm_chain import ChainTiling, layout_class, sm_number
from .lower import LoweredKernel
from .tile_code import NEG_INF

log = logging.getLogger(__name__)

_c = kir.i32
_F32 = "f32"
# (max, sum, picked) per row and split in the split form's scratch.
_PARTS = 3
# The results a kernel may write (``LmHeadLoss`` names a node for each it writes): per row,
# and the sum of log_prob over the rows (one f32).
RESULTS = ("lse", "picked", "log_prob", "log_prob_sum")


def uses_tensor_cores(loss: LmHeadLoss, arch: str, allow_tf32: bool) -> bool:
    """bf16/f16 operands on sm_80+, f32 ones as TF32 where the dot allows it."""
    if sm_number(arch) < 80:
        return False
    return loss.operand_dtype != _F32 or (allow_tf32 and loss.tf32)


def default_tiling(loss: LmHeadLoss, arch: str = "sm_80", allow_tf32: bool = False,
                   n_split: int = 1) -> ChainTiling:
    """Tensor cores (``uses_tensor_cores``): 4 warps of 16 rows, 64-wide vocabulary steps,
    k in stages of 16. FMA: 64 x 64 tiles of 4 x 4 register tiles, 256 threads (smaller
    where rows / vocab are small). No second GEMM: ``block_h`` is the least the layout takes."""
    if uses_tensor_cores(loss, arch, allow_tf32):
        step = 8 if loss.operand_dtype == _F32 else 16
        block_m = 64 if loss.rows >= 64 else 16 * -(-loss.rows // 16)
        block_n = 64 if loss.vocab >= 64 else step * -(-loss.vocab // step)
        block_k = 16 if loss.hidden >= 16 else step * -(-loss.hidden // step)
        tiling = ChainTiling(block_m, block_n, 2 * block_m, 1, 1, block_k, 8, mma=True,
                             n_split=n_split)
    else:
        block_m = 64 if loss.rows >= 64 else max(16, 1 << (loss.rows - 1).bit_length())
        block_n = 64 if loss.vocab >= 64 else max(8, 1 << (loss.vocab - 1).bit_length())
        thread_n = 4 if block_n >= 32 else 2
        lanes = block_n // thread_n
        threads = lanes * (block_m // 4)
        while threads < 32:
            block_m *= 2
            threads *= 2
        block_k = min(16, 1 << (loss.hidden - 1).bit_length())
        tiling = ChainTiling(block_m, block_n, threads, 4, thread_n, block_k, lanes,
                             n_split=n_split)
    tiling.check(loss.operand_dtype)
    return tiling


def tiling_from_schedule(schedule) -> ChainTiling:
    """The loss kernel's tiling of a chain schedule (``cost.lm_head_pricing.loss_price``'s
    ``GemmChainSchedule``): its tiles and threads; block_h the least the layout takes."""
    lanes = 4 if schedule.mma else schedule.block_n // schedule.thread_n
    return ChainTiling(block_m=schedule.block_m, block_n=schedule.block_n,
                       threads=schedule.threads, thread_m=schedule.thread_m,
                       thread_n=schedule.thread_n, block_k=schedule.block_k,
                       block_h=8 if schedule.mma else lanes, mma=schedule.mma,
                       n_split=schedule.n_split)


def lower_lm_head_loss(loss: LmHeadLoss, tiling: ChainTiling | None = None,
                       name: str = "lm_head_loss", arch: str = "sm_80") -> LoweredKernel:
    """One Kernel IR kernel computing ``loss``'s results (params: H, E, labels, then those of
    ``RESULTS`` the description names a node for, in that order)."""
    tiling = tiling or default_tiling(loss, arch)
    tiling.check(loss.operand_dtype)
    if tiling.mma and sm_number(arch) < 80:
        raise CodegenError(f"{name}: tensor-core MMA needs sm_80+, not {arch}")
    if tiling.mma and loss.operand_dtype == _F32 and not loss.tf32:
        raise CodegenError(f"{name}: the logits dot asks for full f32 precision: no TF32")
    if tiling.warp_cols > 1:
        raise CodegenError(f"{name}: warp columns are not lowered here (threads must be "
                           f"2 * block_m on tensor cores)")
    kernel = _kernel_class(tiling)(loss, tiling, name).build()
    note = (f"lm head loss {loss.rows}x{loss.vocab}x{loss.hidden} {loss.operand_dtype}, "
            f"tiles m{tiling.block_m} n{tiling.block_n} k{tiling.block_k}, "
            f"{tiling.threads} threads{', tensor cores' if tiling.mma else ''}"
            f"{f', vocabulary split over {tiling.n_split} blocks' if tiling.n_split > 1 else ''}")
    log.debug("%s: %s", name, note)
    return LoweredKernel(kernel, list(loss.inputs),
                         [getattr(loss, w) for w in RESULTS if getattr(loss, w) >= 0],
                         ["lm_head_loss"], [note])


class _LossSteps:
    """The loss kernel's own parts, put in front of a chain layout (``_kernel_class``): the
    layout places the logits tile on the threads and computes it (``first_gemm``), this
    class walks the vocabulary and reduces the rows."""

    def __init__(self, loss: LmHeadLoss, tiling: ChainTiling, name: str) -> None:
        self.chain = loss           # what the layout's first GEMM reads
        self.t = tiling
        self.name = name
        self.names = 0
        h, e = loss.hidden_view.node, loss.embedding_view.node
        if len({h, e, loss.labels}) != 3:
            raise CodegenError(f"{name}: H, E and the labels must be three buffers")
        storage = CODEGEN_STORAGE[loss.operand_dtype]
        self.params: dict[int, kir.Param] = {
            h: kir.Param("in0", storage, loss.rows * loss.hidden),
            e: kir.Param("in1", storage, loss.vocab * loss.hidden),
            loss.labels: kir.Param("in2", "i32", loss.rows),
        }
        # The per-row results the description names a node for, in ``RESULTS`` order.
        self.results = [(what, kir.Param(f"out{i}", _F32,
                                         1 if what == "log_prob_sum" else loss.rows,
                                         is_output=True))
                        for i, what in enumerate(w for w in RESULTS if getattr(loss, w) >= 0)]
        if not self.results:
            raise CodegenError(f"{name}: the site names none of {RESULTS} to write")
        # The sum over rows: every row's log_prob through global scratch, summed by block 0
        # after a grid barrier (in a fixed order: deterministic).
        self.row_values = kir.GlobalScratch("row_values", _F32, loss.rows) \
            if loss.log_prob_sum >= 0 else None
        self.sa = kir.Shared("tile_a", _F32, tiling.block_m * tiling.block_k)
        self.sb = kir.Shared("tile_b", _F32, tiling.block_k * tiling.block_n)
        self.shared = [self.sa, self.sb]
        self.parts = kir.GlobalScratch("row_parts", _F32, tiling.n_split * loss.rows * _PARTS) \
            if tiling.n_split > 1 else None
        self.rows: list[kir.Expr] = []
        self.cols: list[kir.Expr] = []
        self.s: list[list[str]] = []
        self.shuffle_lanes = 1

    def build(self) -> kir.Kernel:
        loss, t = self.chain, self.t
        grid = -(-loss.rows // t.block_m) * t.n_split
        body: list[kir.Stmt] = []
        block: kir.Expr = kir.BlockIdx()
        n_lo, n_hi = _c(0), _c(loss.vocab)
        split: kir.Expr = _c(0)
        if t.n_split > 1:
            split = self.let(body, "split", kir.Binary("rem", block, _c(t.n_split)))
            block = self.let(body, "rblock", kir.Binary("div", block, _c(t.n_split)))
            share = -(-(-(-loss.vocab // t.block_n)) // t.n_split) * t.block_n
            n_lo = self.let(body, "nlo", kir.mul(split, _c(share)))
            n_hi = self.let(body, "nhi", kir.Binary("min", kir.add(n_lo, _c(share)),
                                                     _c(loss.vocab)))
        self.batch = _c(0)
        self.m0 = self.let(body, "m0", kir.mul(block, _c(t.block_m)))
        self.h0 = _c(0)
        self.layout(body)
        for row in self.s:
            for name in row:
                body.append(kir.Local(name, _F32, kir.f32(0.0)))
        labels = self.params[loss.labels]
        self.labels = []
        for i, row in enumerate(self.rows_clamped):
            body.append(kir.Local(f"mx_{i}", _F32, NEG_INF))
            body.append(kir.Local(f"sum_{i}", _F32, kir.f32(0.0)))
            body.append(kir.Local(f"pick_{i}", _F32, kir.f32(0.0)))
            # jax's take_along_axis: a negative label counts from the end.
            label = self.let(body, "label0", kir.Load(labels, row))
            self.labels.append(self.let(body, "label", kir.Select(
                kir.less(label, _c(0)), kir.add(label, _c(loss.vocab)), label)))
        body.append(kir.For("n0", n_lo, n_hi, _c(t.block_n), tuple(self.n_step())))
        body.extend(self.finish(split))
        scratch: list[kir.GlobalScratch] = []
        if self.parts is not None:
            body.append(kir.GridBarrier())
            body.extend(self.combine(grid))
            scratch.append(self.parts)
        if self.row_values is not None:
            body.append(kir.GridBarrier())
            body.extend(self.row_total())
            scratch.append(self.row_values)
            self.shared.append(self.warp_sums)
        phases = self.parts is not None or self.row_values is not None
        return kir.Kernel(self.name, (*self.params.values(), *(p for _, p in self.results)),
                          tuple(self.shared), grid, t.threads, tuple(body), tuple(scratch),
                          "relaunch" if phases else "barrier").validate()

    def row_total(self) -> list[kir.Stmt]:
        """Block 0 sums the rows' log_prob: each thread its rows strided by the block (in
        order), a warp butterfly, the warps' sums through shared memory, thread 0 adds them
        in warp order and stores."""
        t, rows = self.t, self.chain.rows
        warps = t.threads // 32
        self.warp_sums = kir.Shared("warp_sums", _F32, warps)
        body: list[kir.Stmt] = [kir.Local("part", _F32, kir.f32(0.0))]
        r = kir.Ref("tr", "i32")
        body.append(kir.For("tr", kir.ThreadIdx(), _c(rows), _c(t.threads), (
            kir.Assign("part", kir.add(kir.Ref("part", _F32), kir.Load(self.row_values, r))),)))
        body.append(kir.WarpReduce("warp_part", kir.Ref("part", _F32), "add"))
        lane, warp = kir.Binary("rem", kir.ThreadIdx(), _c(32)), \
            kir.Binary("div", kir.ThreadIdx(), _c(32))
        body.append(kir.If(kir.Compare("eq", lane, _c(0)), (
            kir.Store(self.warp_sums.name, warp, kir.Ref("warp_part", _F32)),)))
        body.append(kir.Barrier())
        total: kir.Expr = kir.Load(self.warp_sums, _c(0))
        for w in range(1, warps):
            total = kir.add(total, kir.Load(self.warp_sums, _c(w)))
        param = dict(self.results)["log_prob_sum"]
        body.append(kir.If(kir.Compare("eq", kir.ThreadIdx(), _c(0)), (
            kir.Store(param.name, _c(0), total),)))
        return [kir.If(kir.Compare("eq", kir.BlockIdx(), _c(0)), tuple(body))]

    def logit(self, i: int, j: int) -> kir.Expr:
        value: kir.Expr = kir.Ref(self.s[i][j], _F32)
        if self.chain.logits_dtype in ("bf16", "f16"):
            value = kir.Unary(f"round_to_{self.chain.logits_dtype}", value)
        return value

    def n_step(self) -> list[kir.Stmt]:
        """One vocabulary step: the logits tile, then per row the online logsumexp and the
        label's logit where this step holds it."""
        out: list[kir.Stmt] = []
        n_cols, valid = self.first_gemm_step(out, self.chain.vocab)
        for i in range(len(self.rows)):
            x = [self.let(out, "x", kir.Select(valid[j], self.logit(i, j), NEG_INF))
                 for j in range(len(self.cols))]
            self.online_step(out, x, f"mx_{i}", f"sum_{i}")
            hit: kir.Expr = kir.Ref(f"pick_{i}", _F32)
            for j, n in enumerate(n_cols):
                at_label = kir.logical_and(valid[j], kir.Compare("eq", n, self.labels[i]))
                hit = kir.add(hit, kir.Select(at_label, x[j], kir.f32(0.0)))
            out.append(kir.Assign(f"pick_{i}", hit))
        return out

    def finish(self, split: kir.Expr) -> list[kir.Stmt]:
        """The picked logit summed over the row's lanes; then the lane holding column 0
        stores the row's results (or, split, its (max, sum, picked) partial)."""
        loss = self.chain
        out: list[kir.Stmt] = []
        first_lane = self.let(out, "lane0", kir.Compare("eq", self.cols[0], _c(0)))
        stores: tuple[kir.Stmt, ...]
        for i, row in enumerate(self.rows):
            picked = self.row_reduce(out, "add", [kir.Ref(f"pick_{i}", _F32)])
            mx, total = kir.Ref(f"mx_{i}", _F32), kir.Ref(f"sum_{i}", _F32)
            cond = kir.logical_and(kir.less(row, _c(loss.rows)), first_lane)
            if self.parts is None:
                lse = kir.add(mx, kir.Unary("log", total))
                stores = self.store_results(out, row, self.labels[i], lse, picked)
            else:
                slot = self.let(out, "slot", kir.mul(kir.add(kir.mul(split, _c(loss.rows)), row),
                                                  _c(_PARTS)))
                stores = tuple(kir.Store(self.parts.name, kir.add(slot, _c(p)), value)
                               for p, value in enumerate((mx, total, picked)))
            out.append(kir.If(cond, stores))
        return out

    def combine(self, grid: int) -> list[kir.Stmt]:
        """After the grid barrier: the grid strides over rows; each row's splits combined
        in split order (deterministic): M = max m_i, weights exp(m_i - M) (0 for a split
        that saw only -inf), lse = M + log(sum w_i l_i), picked = sum of the splits'."""
        loss, t = self.chain, self.t
        out: list[kir.Stmt] = []
        gtid = self.let(out, "gtid", kir.add(kir.mul(kir.BlockIdx(), _c(t.threads)),
                                          kir.ThreadIdx()))
        body: list[kir.Stmt] = []
        r = kir.Ref("r", "i32")
        base = [self.let(body, "at", kir.mul(kir.add(r, _c(s * loss.rows)), _c(_PARTS)))
                for s in range(t.n_split)]
        maxima = [self.let(body, "pmx", kir.Load(self.parts, b)) for b in base]
        top: kir.Expr = maxima[0]
        for m in maxima[1:]:
            top = kir.Binary("max", top, m)
        top = self.let(body, "top", top)
        total: kir.Expr = kir.f32(0.0)
        picked: kir.Expr = kir.f32(0.0)
        for m, b in zip(maxima, base):
            w = self.let(body, "w", kir.Select(kir.Compare("eq", m, NEG_INF), kir.f32(0.0),
                                               kir.Unary("exp", kir.Binary("sub", m, top))))
            total = kir.add(total, kir.mul(w, kir.Load(self.parts, kir.add(b, _c(1)))))
            picked = kir.add(picked, kir.Load(self.parts, kir.add(b, _c(2))))
        lse = self.let(body, "lse", kir.add(top, kir.Unary("log", total)))
        label0 = self.let(body, "clabel0", kir.Load(self.params[loss.labels], r))
        label = self.let(body, "clabel", kir.Select(kir.less(label0, _c(0)),
                                                    kir.add(label0, _c(loss.vocab)), label0))
        body.extend(self.store_results(body, r, label, lse, self.let(body, "cpick", picked)))
        out.append(kir.For("r", gtid, _c(loss.rows), _c(grid * t.threads), tuple(body)))
        return out


    def store_results(self, out: list[kir.Stmt], row: kir.Expr, label: kir.Expr,
                      lse: kir.Expr, picked: kir.Expr) -> tuple[kir.Stmt, ...]:
        """The row's results: a label outside [0, vocab) (after the wrap) picks NaN, as
        jax's take_along_axis fills; log_prob = picked - lse."""
        inside = kir.logical_and(kir.Compare("ge", label, _c(0)),
                                 kir.less(label, _c(self.chain.vocab)))
        picked = self.let(out, "picked", kir.Select(inside, picked, kir.f32(float("nan"))))
        values = {"lse": lse, "picked": picked, "log_prob": kir.Binary("sub", picked, lse)}
        stores = [kir.Store(param.name, row, values[what]) for what, param in self.results
                  if what in values]
        if self.row_values is not None:
            stores.append(kir.Store(self.row_values.name, row, values["log_prob"]))
        return tuple(stores)


def _kernel_class(tiling: ChainTiling) -> type:
    base = layout_class(tiling)
    return type(f"LmHeadLoss{base.__name__.lstrip('_')}", (_LossSteps, base), {})
