"""How a GEMM-chain kernel (``stitch.codegen.gemm_chain``) splits its work: ``ChainTiling``,
its checks and its defaults per chain and target."""
from __future__ import annotations

import math
from dataclasses import dataclass

from stitch.hlo.gemm_chains import GemmChain, needs_row_pass, softmax_parts

from .errors import CodegenError
from .tile_code import block_problem, lanes_problem

_F32 = "f32"
# Shared memory one block may use without opting in to more (bytes).
SHARED_LIMIT = 48 * 1024


def pow2_at_least(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def sm_number(arch: str) -> int:
    """80 for "sm_80" (and "sm_90a": 90)."""
    try:
        return int(arch.removeprefix("sm_").rstrip("a"))
    except ValueError:
        raise CodegenError(f"unknown arch {arch!r}") from None


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
            why = lanes_problem(self.lanes, self.block_h, "block_n / thread_n")
            if why:
                raise bad(why)
            if self.threads != self.lanes * (self.block_m // self.thread_m):
                raise bad("threads must be (block_m / thread_m) * (block_n / thread_n)")
        why = block_problem(self.threads, self.shared_bytes(), SHARED_LIMIT)
        if why:
            raise bad(why)

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
        if (chain.operand_dtype in ("bf16", "f16") or tf32) and sm_number(arch) >= 80:
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
        block_m = tall if chain.m >= tall else max(16, pow2_at_least(chain.m))
        block_n = 64 if chain.n >= 64 else max(8, pow2_at_least(chain.n))
        thread_m, thread_n = 4, (4 if block_n >= 32 else 2)
        lanes = block_n // thread_n
        threads = lanes * (block_m // thread_m)
        while threads < 32:
            block_m *= 2
            threads *= 2
        block_k = min(16, pow2_at_least(chain.k))
        block_h = min(64, max(lanes, pow2_at_least(chain.h)))
        tiling = ChainTiling(block_m, block_n, threads, thread_m, thread_n, block_k, block_h)
        tiling.check()
        return tiling
