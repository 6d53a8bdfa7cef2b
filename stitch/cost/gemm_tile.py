"""GEMM tiles under the latency-evaluator: one GEMM-chain kernel (MCFuser's fused chain,
FlashAttention's online softmax when a row softmax sits between the GEMMs) under a
:class:`GemmChainSchedule`, and XLA's own GEMM kernels (Triton tiles from the fixture's
backend config) for the same ops, on V100/A100/H100.

A kernel is described per thread block (``BlockWork``) and launched as a grid
(blocks, threads, registers, shared bytes). ``tile_kernel_time`` turns that into seconds:

- occupancy (``occupancy.py``: threads, registers, shared memory) gives the blocks resident
  per SM; the busiest SM runs ceil(blocks / SMs) blocks, ceil(blocks / (resident * SMs))
  waves;
- compute of one block = the busiest of its pipes (they are separate units of the SM and
  the resident warps keep them busy together): FP32 lanes (FMA and other arithmetic),
  tensor cores (MMA flops), shared memory (128 B/clk/SM, documented), SFU (16/clk/SM),
  and instruction issue (4 schedulers x 1 warp instruction/clk);
- memory: HBM bytes over the bandwidth the kernel can draw, which is the peak or what its
  loads in flight sustain (Little's law: resident blocks x bytes in flight per block /
  DRAM latency), whichever is lower; L2 re-reads at the L2 bandwidth (XLA's assumed 2.5x
  HBM, ``GpuSpec.l2_bandwidth``);
- compute and memory overlap as everywhere in stitch: C + M - 0.95 min(C, M);
- a latency floor: per wave, the block's pipeline steps each wait a barrier pair, and every
  ``stages``-th step a DRAM round trip (cp.async multi-stage pipelining hides the others).

HBM traffic of the chain (the assumption the brief asks to state): A (the first GEMM's
left operand) is read once; B and D (the GEMMs' right operands) are read by every M-block,
once from HBM and the other times from L2 when one batch's B and D fit in half the L2
(they do for every zoo chain), else from HBM each time; the chain's result is written once;
the N x N score matrix never leaves the chip. XLA's GEMM kernels: A is read once per N-block
and B once per M-block, once from HBM and the rest from L2 under the same rule; the result
(the score matrix for the first GEMM, split-K partials for a split second GEMM) is written.

Math throughput per SM per clock: FP32 FMA on the CUDA cores = ``fp32_cores_per_sm`` lanes;
tensor cores the published dense peaks of ``gemm_rates.TENSOR_CORE_RATES`` (the table XLA's
GEMMs are priced by) over SMs x clock: A100 ~1024 FMA/clk (2048 flops) for FP16/BF16 and
~512 FMA/clk for TF32 (whitepaper table 3); H100 2x those per SM with wgmma. The
chain kernel and XLA's Triton tiles of the fixtures (2 warps, 16-row tiles) issue
``mma.sync``, not ``wgmma``: on sm_90 we assume half the wgmma rate for it (the A100 rate
per SM; assumed, Luo et al. 2024 measured mma.sync well below wgmma on H100). V100: no
TF32/BF16 tensor cores; tensor cores are not modeled there (f32 runs on the FMA lanes).

TF32: XLA (and jax, whose default matmul precision is DEFAULT) runs f32 dots on TF32 tensor
cores on sm_80/sm_90 unless the dot asks for HIGHEST precision (``operand_precision``) or
an f32 algorithm; ``ChainDims.tf32`` says whether the chain's dots allow it. The chain's
schedule may use TF32 MMA only where XLA does (``mma`` with an f32 operand type).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .gemm_rates import FP32, GemmPrecision, gemm_time, peak_flops, precision_class
from .gpu_specs import XLA_MEMORY_COMPUTE_PARALLELISM, GpuSpec
from .latency import BARRIER_LATENCY_CYCLES, DRAM_LATENCY_CYCLES, SFU_PER_SM
from .occupancy import Occupancy, occupancy

ISSUE_PER_SM_PER_CLOCK = 4          # 4 warp schedulers, one instruction each per clock
SHARED_BYTES_PER_CLOCK = 128        # 32 banks x 4 B (documented, gpu_specs)
BASE_REGISTERS = 24                 # indices, pointers, loop counters, addresses
OPERAND_BYTES = {"f32": 4, "bf16": 2, "f16": 2}
# Thread instructions per score element of the online softmax (max compare, subtract,
# ex2 on the SFU with its scale multiply, running-sum add) and per row per N-tile
# (rescale factor: a subtract, an ex2, two multiplies).
SOFTMAX_ALU_PER_ELEMENT = 4.0
SOFTMAX_SFU_PER_ELEMENT = 1.0
SOFTMAX_ALU_PER_ROW_STEP = 4.0
# L2 may hold one batch's right-hand operands when they take at most this share of it.
L2_RESIDENT_SHARE = 0.5


def tensor_flops_per_clock_per_sm(spec: GpuSpec, operand_dtype: str) -> float | None:
    """Dense mma.sync flops per SM per clock for the operand type ("f32" means TF32), None
    where the model has no tensor cores (module docstring). The rates are the published
    dense peaks of ``gemm_rates`` (the one table every GEMM price reads) per SM and clock;
    on sm_90 mma.sync is assumed to reach ``MMA_SYNC_SHARE_SM90`` of the wgmma peak."""
    if spec.compute_capability[0] < 8:
        return None
    cls = precision_class(spec, (operand_dtype,), tf32_allowed=True)
    if cls == FP32:
        return None
    share = MMA_SYNC_SHARE_SM90 if spec.compute_capability[0] >= 9 else 1.0
    return peak_flops(spec, cls) / (spec.sm_count * spec.clock_hz) * share


# mma.sync on Hopper: about half the wgmma rate per SM (assumed; Luo et al. 2024 measured
# mma.sync well below wgmma on H100), i.e. roughly A100's per-SM rate.
MMA_SYNC_SHARE_SM90 = 0.5


@dataclass(frozen=True)
class ChainDims:
    """One GEMM chain: E[b] = between(A[b] (m x k) @ B[b] (k x n)) @ D[b] (n x h)."""

    batch: int
    m: int
    n: int
    k: int
    h: int
    operand_dtype: str = "f32"
    softmax: bool = False
    # Thread instructions per score element of the other ops between the GEMMs (scale,
    # mask, activation, gating).
    between_instructions: float = 0.0
    tf32: bool = True               # the dots allow TF32 (DEFAULT precision)
    result_bytes: int = 4           # bytes per element of the chain's result
    # HBM bytes (all batches) of other values the ops between read: a mask, a bias, a
    # gate; each distinct element read once.
    input_bytes: float = 0.0
    # A row reduction between the GEMMs other than a softmax's (a layer norm over n): it
    # needs all of n in one warp (no warp columns).
    row_reductions: bool = False
    # The target runs grid-barrier kernels (``stitch.codegen.kir.GridBarrier``: a cooperative
    # launch or a launch per phase): n may then be split across blocks (``n_split``).
    grid_sync: bool = False
    # HBM bytes (all batches) of values between the GEMMs the kernel also writes (a
    # training step's S, row sums, P: the backward reads them); each h-block writes its rows'.
    extra_output_bytes: float = 0.0
    # A pass over n before the main one computes the rows' softmax max and sum (S computed
    # twice: the first GEMM's work again), so that P is written exactly.
    row_pass: bool = False

    @property
    def itemsize(self) -> int:
        return OPERAND_BYTES.get(self.operand_dtype, 4)

    @property
    def flops(self) -> float:
        """Both GEMMs' flops (2 per multiply-add)."""
        return 2.0 * self.batch * self.m * self.n * (self.k + self.h)

    @property
    def key(self) -> tuple:
        return (self.batch, self.m, self.n, self.k, self.h, self.operand_dtype, self.softmax,
                round(self.between_instructions, 3), self.tf32, self.result_bytes,
                round(self.input_bytes), self.row_reductions, self.grid_sync,
                round(self.extra_output_bytes), self.row_pass)

    @property
    def n_splittable(self) -> bool:
        """n may be split across blocks: the target has grid barriers, and no row reduction
        over n between the GEMMs other than a softmax's (a layer norm would need every
        block's share of the row before its own P; a softmax's splits are combined by
        their row maxima and sums, FlashDecoding's split-KV)."""
        return self.grid_sync and not self.row_reductions

    def mma_allowed(self, spec: GpuSpec) -> bool:
        if tensor_flops_per_clock_per_sm(spec, self.operand_dtype) is None:
            return False
        return self.operand_dtype != "f32" or self.tf32


@dataclass(frozen=True)
class GemmChainSchedule:
    """How one chain kernel is tiled (the codegen helper's ``ChainTiling`` carries the same
    fields; the lead maps one to the other).

    ``expression``: MCFuser's tiling expression of the block's loops once the loops bound
    to blockIdx (batch, m, and h when ``block_h`` < h) are removed: "n(k,h)" (flat: per
    N-tile, the first GEMM's k loop, then the second GEMM over the block's h columns; the
    FlashAttention order) or "nk" (deep, h bound to blocks: each block recomputes the
    first GEMM for its h columns). ``hoist_a``: the DAG hoisting of A's load out of the n
    loop to the m loop (legal when ``block_k`` == k: the k loop has one trip, so A's tile
    is loaded once per block and stays in shared memory).

    ``n_split``: blocks sharing one output tile, each summing the second GEMM over its
    share of n (whole ``block_n`` steps); each writes its f32 partial tile to global scratch,
    and a second launch of the kernel (its phase after the grid barrier) adds the
    ``n_split`` partials of every output element in split order (deterministic) and stores
    the result: XLA's split-K for the chain, in one kernel of two phases."""

    expression: str = "n(k,h)"
    block_m: int = 64
    block_n: int = 64
    block_k: int = 32
    block_h: int = 64
    threads: int = 128
    thread_m: int = 4               # rows of the register tile of one thread
    thread_n: int = 4               # columns of it (of the N-tile in the first GEMM)
    mma: bool = False               # tensor-core MMA (TF32 for f32 operands) vs FMA
    stages: int = 2                 # shared-memory buffers per operand tile (cp.async)
    hoist_a: bool = False
    n_split: int = 1

    def text(self) -> str:
        math_kind = "mma" if self.mma else "fma"
        return (f"{self.expression} m{self.block_m} n{self.block_n} k{self.block_k} "
                f"h{self.block_h} t{self.threads} {self.thread_m}x{self.thread_n} {math_kind} "
                f"s{self.stages}{' hoistA' if self.hoist_a else ''}"
                f"{f' nsplit{self.n_split}' if self.n_split > 1 else ''}")


@dataclass(frozen=True)
class BlockWork:
    """What one thread block of a tiled kernel does (counts per block)."""

    fma_instr: float = 0.0          # warp FMA instructions on the FP32 lanes
    alu_instr: float = 0.0          # other warp arithmetic on the FP32/INT lanes
    mma_flops: float = 0.0          # tensor-core flops
    mma_dtype: str = "bf16"         # their operand type ("f32": TF32)
    sfu_instr: float = 0.0          # warp special-function instructions
    shared_bytes: float = 0.0       # shared-memory bytes read and written
    other_instr: float = 0.0        # loads, stores, address math, shuffles: issue slots
    hbm_bytes: float = 0.0          # DRAM bytes
    l2_bytes: float = 0.0           # bytes served by L2 (re-reads)
    steps: int = 1                  # pipeline steps (tile loads followed by a barrier)
    stages: int = 1                 # shared-memory buffers: loads issued ahead
    inflight_bytes: float = 0.0     # global bytes one block has in flight


@dataclass(frozen=True)
class TileCost:
    seconds: float
    cycles: float
    blocks: int
    threads: int
    registers: int
    smem_bytes: int
    hbm_bytes: float
    l2_bytes: float
    flops: float
    waves: int
    occupancy: Occupancy | None
    bound: str                      # the busiest pipe, "memory", "latency", "cannot launch"
    pipes: dict = field(default_factory=dict, compare=False)

    @property
    def us(self) -> float:
        return self.seconds * 1e6


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# mma.sync.m16n8k8 (TF32) / m16n8k16 (FP16/BF16): flops one warp instruction performs.
MMA_INSTRUCTION_FLOPS = {"f32": 2 * 16 * 8 * 8, "bf16": 2 * 16 * 8 * 16, "f16": 2 * 16 * 8 * 16}


def tile_kernel_time(spec: GpuSpec, work: BlockWork, blocks: int, threads: int,
                     registers: float, smem_bytes: float, flops: float = 0.0) -> TileCost:
    """Modeled time of a tiled kernel launch (module docstring)."""
    registers = max(1, int(math.ceil(registers)))
    blocks = max(int(blocks), 1)
    if registers > spec.max_registers_per_thread or threads > spec.max_threads_per_block:
        return _cannot(blocks, threads, registers, smem_bytes, work, flops, None)
    occ = occupancy(spec, int(threads), registers, int(math.ceil(smem_bytes)))
    if occ.blocks_per_sm == 0:
        return _cannot(blocks, threads, registers, smem_bytes, work, flops, occ)
    tensor = 0.0
    if work.mma_flops:
        rate = tensor_flops_per_clock_per_sm(spec, work.mma_dtype)
        if rate is None:
            return _cannot(blocks, threads, registers, smem_bytes, work, flops, occ)
        tensor = work.mma_flops / rate
    mma_instr = work.mma_flops / MMA_INSTRUCTION_FLOPS.get(work.mma_dtype, 4096)
    pipes = {
        "fma": (work.fma_instr + work.alu_instr) * spec.warp_size / spec.fp32_cores_per_sm,
        "tensor": tensor,
        "shared": work.shared_bytes / SHARED_BYTES_PER_CLOCK,
        "sfu": work.sfu_instr * spec.warp_size / SFU_PER_SM,
        "issue": (work.fma_instr + work.alu_instr + work.sfu_instr + work.other_instr
                  + mma_instr) / ISSUE_PER_SM_PER_CLOCK,
    }
    resident = occ.blocks_per_sm
    per_sm = _ceil_div(blocks, spec.sm_count)
    active_sms = min(blocks, spec.sm_count)
    waves = _ceil_div(blocks, resident * spec.sm_count)
    compute = per_sm * max(pipes.values())
    dram = DRAM_LATENCY_CYCLES.get(spec.compute_capability[0], 480)
    # Bandwidth the kernel can draw: its loads in flight over the DRAM latency (Little).
    in_flight = active_sms * min(resident, per_sm) * max(work.inflight_bytes, 1.0) / dram
    hbm_rate = min(spec.hbm_bytes_per_cycle, in_flight)
    l2_rate = min(spec.hbm_bytes_per_cycle, in_flight) * spec.l2_speedup_over_hbm
    total_hbm = work.hbm_bytes * blocks
    total_l2 = work.l2_bytes * blocks
    memory = total_hbm / hbm_rate + total_l2 / l2_rate
    throughput = compute + memory - XLA_MEMORY_COMPUTE_PARALLELISM * min(compute, memory)
    # One block's dependent chain: a barrier pair per step, a DRAM round trip per
    # ``stages`` steps (the loads issued ahead hide the others).
    chain = work.steps * 2 * BARRIER_LATENCY_CYCLES + dram * _ceil_div(work.steps,
                                                                       max(work.stages, 1))
    latency = waves * chain
    # The rule every GEMM is priced by (gemm_rates): no tiling runs its tensor-core work
    # faster than the achievable rate's roofline with the kernel's HBM bytes.
    roofline = 0.0
    if work.mma_flops:
        unit = precision_class(spec, (work.mma_dtype,), tf32_allowed=True)
        roofline = (gemm_time(spec, work.mma_flops * blocks, total_hbm,
                              GemmPrecision(unit), launches=0).total_s * spec.clock_hz)
    cycles = max(throughput, latency, roofline)
    if roofline >= max(throughput, latency):
        bound = "roofline"
    elif latency >= throughput:
        bound = "latency"
    elif memory >= compute:
        bound = "memory"
    else:
        bound = max(pipes, key=pipes.get)
    seconds = spec.kernel_launch_overhead_s + cycles / spec.clock_hz
    return TileCost(seconds, cycles, blocks, int(threads), registers, int(math.ceil(smem_bytes)),
                    total_hbm, total_l2, flops, waves, occ, bound,
                    {**{k: v * per_sm for k, v in pipes.items()}, "memory": memory,
                     "latency": latency})


def _cannot(blocks, threads, registers, smem_bytes, work, flops, occ) -> TileCost:
    return TileCost(math.inf, math.inf, blocks, int(threads), registers,
                    int(math.ceil(smem_bytes)), work.hbm_bytes * blocks,
                    work.l2_bytes * blocks, flops, 0, occ, "cannot launch")


# --- the chain kernel ---------------------------------------------------------------------

def _warp_tile(rows: int, cols: int, warps: int) -> tuple[float, float]:
    """A warp's share of a rows x cols block tile, as square as the block allows."""
    area = rows * cols / max(warps, 1)
    wm = min(float(rows), max(16.0, 2.0 ** round(math.log2(max(math.sqrt(area), 1.0)))))
    return wm, area / wm


def warp_columns(s: GemmChainSchedule) -> int:
    """MMA: warps sharing the same 16 rows, each on a slice of every n step (codegen's
    ``ChainTiling.warp_cols``); FMA: 1."""
    return max(s.threads // (2 * s.block_m), 1) if s.mma else 1


def chain_grid(dims: ChainDims, s: GemmChainSchedule) -> int:
    """Blocks of the kernel: batch x m-tiles (x h-tiles in a deep tiling) x n-splits."""
    blocks = dims.batch * _ceil_div(dims.m, s.block_m) * max(s.n_split, 1)
    if s.expression == "nk":
        blocks *= _ceil_div(dims.h, s.block_h)
    return blocks


def split_n_tiles(dims: ChainDims, s: GemmChainSchedule) -> int:
    """n steps (of ``block_n``) of one block: all of n's, or its split's share (codegen
    gives split ``i`` the steps i * this .. (i + 1) * this - 1)."""
    return _ceil_div(_ceil_div(dims.n, s.block_n), max(s.n_split, 1))


def partial_bytes(dims: ChainDims, s: GemmChainSchedule) -> int:
    """Bytes of the f32 partial results an n-split kernel writes to global scratch (and the
    combine phase reads back): n_split x batch x m x h, and after a softmax each split's
    row maxima and sums (n_split x batch x m x 2); 0 when n is not split."""
    if s.n_split <= 1:
        return 0
    return s.n_split * dims.batch * dims.m * (dims.h + (2 if dims.softmax else 0)) * 4


def _block_h(dims: ChainDims, s: GemmChainSchedule) -> int:
    """Output columns one block computes: all of h (flat), or its h tile (deep)."""
    return dims.h if s.expression != "nk" else min(s.block_h, dims.h)


def chain_smem_bytes(dims: ChainDims, s: GemmChainSchedule) -> int:
    """Shared memory of one block (MCFuser's equation (1) for this kernel): A's tile (the
    whole k extent once when hoisted, else ``stages`` k-slices), ``stages`` B k-slices and
    D n-slices, and the score tile P handed from the first GEMM to the second (f32)."""
    isz = dims.itemsize
    hb = _block_h(dims, s)
    a = s.block_m * dims.k * isz if s.hoist_a else s.stages * s.block_m * s.block_k * isz
    b = s.stages * s.block_k * s.block_n * isz
    d = s.stages * s.block_n * min(s.block_h, hb) * isz
    p = s.block_m * s.block_n * 4
    partials = (warp_columns(s) - 1) * s.block_m * (hb + 2) * 4    # the warp columns' fold
    return a + b + d + p + partials


def _thread_cols_second(dims: ChainDims, s: GemmChainSchedule) -> float:
    """Columns of the second GEMM's register tile of one thread (its rows: thread_m)."""
    hb = _block_h(dims, s)
    return s.block_m * hb / (s.threads * s.thread_m)


# Registers per thread of codegen's chain kernels, calibrated against ptxas -v (sm_80 and
# sm_90; ``python -m bench.codegen.gemm_chain_registers``: the zoo's planned schedules plus random
# legal ones per chain and target; FMA on 236 schedules, MMA on 123 distinct ones, 54 of
# them with warp columns). MMA: ptxas keeps the S and E accumulators (a warp's n slice / 2
# + block_h / 2 per thread) and hoists the unrolled MMA steps' fragment loads as far as the
# registers allow, the more the fewer threads share an SM's register file. FMA: the register
# tiles of both GEMMs, scaled (ptxas unrolls the kk loop).
MMA_REGISTERS_BASE = 47.3
MMA_REGISTERS_PER_ACCUMULATOR = 1.0
MMA_REGISTERS_SOFTMAX = 2.3
MMA_REGISTERS_PER_FRAGMENT = 0.28     # per fragment register of one stage, x 64 / threads
MMA_REGISTERS_THREADS = 13.8          # x 128 / threads
FMA_REGISTERS_BASE = 30.0
FMA_REGISTERS_PER_ACCUMULATOR = 1.38
FMA_REGISTERS_SOFTMAX = 4.4
FMA_REGISTERS_THREADS = 17.0          # x 128 / threads


def chain_registers(dims: ChainDims, s: GemmChainSchedule) -> int:
    """Registers per thread of the chain kernel codegen builds for ``s`` (calibrated above;
    against ptxas: MMA mean error 13%, 82% of schedules within 20%; FMA mean 17%)."""
    hb = _block_h(dims, s)
    softmax = 1.0 if dims.softmax else 0.0
    if s.mma:
        depth = 8 if dims.itemsize == 4 else 16          # k of one mma.sync
        slice_n = s.block_n / warp_columns(s)             # a warp's share of an n step
        accumulators = slice_n / 2 + hb / 2               # a warp's 16 rows over 32 lanes
        first = (s.block_k / depth) * (4 + slice_n / 8 * 2)       # A and B fragments
        second = (slice_n / depth) * (hb / 8) * 2                 # C fragments
        estimate = (MMA_REGISTERS_BASE + MMA_REGISTERS_PER_ACCUMULATOR * accumulators
                    + MMA_REGISTERS_SOFTMAX * softmax
                    + MMA_REGISTERS_PER_FRAGMENT * (first + second) * 64 / s.threads
                    + MMA_REGISTERS_THREADS * 128 / s.threads)
    else:
        accumulators = s.thread_m * s.thread_n + s.thread_m * _thread_cols_second(dims, s)
        estimate = (FMA_REGISTERS_BASE + FMA_REGISTERS_PER_ACCUMULATOR * accumulators
                    + FMA_REGISTERS_SOFTMAX * softmax + FMA_REGISTERS_THREADS * 128 / s.threads)
    return int(math.ceil(estimate))


def chain_cost(spec: GpuSpec, dims: ChainDims, s: GemmChainSchedule) -> TileCost:
    """Modeled time of one chain kernel under schedule ``s`` (module docstring)."""
    isz = dims.itemsize
    bm, bn, bk, threads = s.block_m, s.block_n, s.block_k, s.threads
    hb = _block_h(dims, s)
    splits = max(s.n_split, 1)
    n_tiles = split_n_tiles(dims, s)                   # the block's n steps
    n_local = min(dims.n, n_tiles * bn)                # the n columns it reads of B and D
    k_tiles = 1 if s.hoist_a else _ceil_div(dims.k, bk)
    n_pad, k_pad = n_tiles * bn, k_tiles * (dims.k if s.hoist_a else bk)
    warps = max(threads // spec.warp_size, 1)
    m_blocks = _ceil_div(dims.m, bm)
    h_blocks = _ceil_div(dims.h, s.block_h) if s.expression == "nk" else 1
    flops1 = 2.0 * bm * n_pad * k_pad
    flops2 = 2.0 * bm * n_pad * hb
    # Shared memory: tiles stored once, read by the threads that need them.
    stored = ((bm * dims.k if s.hoist_a else bm * k_pad * n_tiles) * isz
              + n_tiles * (k_pad * bn + bn * hb) * isz + n_tiles * bm * bn * 4)
    if s.mma:
        wm1, wn1 = _warp_tile(bm, bn, warps)
        wm2, wn2 = _warp_tile(bm, hb, warps)
        read = n_tiles * warps * ((wm1 + wn1) * k_pad * isz + (wm2 + wn2) * bn * isz)
    else:
        th = _thread_cols_second(dims, s)
        read = n_tiles * threads * ((s.thread_m + s.thread_n) * k_pad * isz
                                    + (s.thread_m + th) * bn * 4)
    # Warp columns: all but the first write their partial results (and softmax row
    # states) to shared memory once, after a barrier the first reads and folds them in.
    folded = (warp_columns(s) - 1) * bm * hb
    stored += folded * 4
    read += folded * 4
    flops_row = 0.0
    if dims.row_pass:
        # The row pass: the first GEMM's tiles through shared memory and its flops again.
        flops_row = flops1
        stored += ((bm * dims.k if s.hoist_a else bm * k_pad * n_tiles)
                   + n_tiles * k_pad * bn) * isz
        if s.mma:
            read += n_tiles * warps * (wm1 + wn1) * k_pad * isz
        else:
            read += n_tiles * threads * (s.thread_m + s.thread_n) * k_pad * isz
    vector = 16 if min(s.thread_m, s.thread_n) >= 4 or s.mma else 4
    shared_instr = (stored + read) / (spec.warp_size * vector)
    # Ops between the GEMMs, per score element, and the online softmax's row state.
    scores = bm * n_pad
    alu = scores * dims.between_instructions + folded * (2.0 if dims.softmax else 1.0)
    sfu = 0.0
    shuffles = 0.0
    if dims.softmax:
        alu += scores * SOFTMAX_ALU_PER_ELEMENT + bm * n_tiles * SOFTMAX_ALU_PER_ROW_STEP
        alu += bm * hb * n_tiles + bm * hb          # rescale the accumulators, normalize
        sfu += scores * SOFTMAX_SFU_PER_ELEMENT + bm * n_tiles
        threads_per_row = max(threads / bm, 1.0)
        shuffles = 2 * bm * n_tiles * math.log2(threads_per_row) if threads_per_row > 1 else 0
        if dims.row_pass:
            shuffles *= 2
    if dims.row_pass:
        # The row pass's max, exps and sum (a softmax P converted last is not
        # ``dims.softmax``: its main-pass ops are among ``between_instructions``).
        alu += scores * SOFTMAX_ALU_PER_ELEMENT + bm * n_tiles * SOFTMAX_ALU_PER_ROW_STEP
        sfu += scores * SOFTMAX_SFU_PER_ELEMENT + bm * n_tiles
    # Global traffic per block.
    a_bytes = bm * dims.k * isz
    rhs = (dims.k + hb) * n_local * isz                # B and D: this block's n and h share
    rhs_batch = (dims.k * dims.n + dims.n * dims.h) * isz
    readers = m_blocks * h_blocks                      # blocks reading one n share of them
    if rhs_batch <= L2_RESIDENT_SHARE * spec.l2_bytes:
        hbm_rhs, l2_rhs = rhs / readers, rhs * (1 - 1 / readers)
    else:
        hbm_rhs, l2_rhs = rhs, 0.0
    a_rereads = 0.0 if s.hoist_a else a_bytes * (n_tiles - 1)
    if dims.row_pass:
        # The row pass reads A and B again (B's n share: from L2 where it stays resident).
        a_rereads += a_bytes
        b_again = dims.k * n_local * isz
        hbm_rhs += b_again / readers if rhs_batch <= L2_RESIDENT_SHARE * spec.l2_bytes \
            else b_again
        l2_rhs += b_again * (1 - 1 / readers) if rhs_batch <= L2_RESIDENT_SHARE * \
            spec.l2_bytes else 0.0
        rhs += b_again
    # Other inputs of the ops between: each block's share (its n share) once from HBM,
    # again from L2 by the other h-blocks of its rows (deep tiling).
    extra = dims.input_bytes / (dims.batch * m_blocks * splits)
    # A's rows are read by every h-block and n-split of them: once from HBM.
    a_share = h_blocks * splits
    # An n-split block writes its f32 partial tile (to scratch) instead of the result.
    out_bytes = 4 if splits > 1 else dims.result_bytes
    # Values also read outside: every h-block writes its rows' share (n all in the block).
    written = dims.extra_output_bytes / (dims.batch * m_blocks)
    hbm = a_bytes / a_share + hbm_rhs + bm * hb * out_bytes + extra / h_blocks + written
    l2 = a_bytes * (1 - 1 / a_share) + l2_rhs + a_rereads + extra * (1 - 1 / h_blocks)
    loads = a_bytes + a_rereads + rhs + extra
    steps = n_tiles * (k_tiles + 1) + (1 if folded else 0) + (
        n_tiles * k_tiles if dims.row_pass else 0)
    # (A scalar store per written element: a warp instruction per 32.)
    global_instr = (loads + bm * hb * out_bytes) / (spec.warp_size * 16) + written / (
        spec.warp_size * 4)
    if s.mma:
        work = BlockWork(alu_instr=alu / 32, mma_flops=flops1 + flops2 + flops_row,
                         mma_dtype=dims.operand_dtype, sfu_instr=sfu / 32,
                         shared_bytes=stored + read,
                         other_instr=shared_instr + global_instr + shuffles,
                         hbm_bytes=hbm, l2_bytes=l2, steps=steps, stages=s.stages,
                         inflight_bytes=loads / steps * s.stages)
    else:
        work = BlockWork(fma_instr=(flops1 + flops2 + flops_row) / 2 / 32, alu_instr=alu / 32,
                         sfu_instr=sfu / 32, shared_bytes=stored + read,
                         other_instr=shared_instr + global_instr + shuffles,
                         hbm_bytes=hbm, l2_bytes=l2, steps=steps, stages=s.stages,
                         inflight_bytes=loads / steps * s.stages)
    blocks = chain_grid(dims, s)
    # Flops executed: padding and the deep tiling's recomputed first GEMM included.
    cost = tile_kernel_time(spec, work, blocks, threads, chain_registers(dims, s),
                            chain_smem_bytes(dims, s),
                            flops=(flops1 + flops2 + flops_row) * blocks)
    if splits == 1 or not math.isfinite(cost.seconds):
        return cost
    return _with_combine(spec, dims, s, cost)


def _with_combine(spec: GpuSpec, dims: ChainDims, s: GemmChainSchedule,
                  phase1: TileCost) -> TileCost:
    """An n-split kernel (codegen launches it once per phase): the partials launch
    (``phase1``), then the combine launch on the same grid — every thread grid-stride over
    the outputs, each output's ``n_split`` f32 partials (and after a softmax the row
    maxima and sums) loaded together (from L2 when they fit in its resident share, else
    HBM), combined in order and stored."""
    dram = DRAM_LATENCY_CYCLES.get(spec.compute_capability[0], 480)
    outputs = dims.batch * dims.m * dims.h
    partials = partial_bytes(dims, s)
    result = outputs * dims.result_bytes
    lanes = min(phase1.blocks, (phase1.occupancy.blocks_per_sm if phase1.occupancy else 1)
                * spec.sm_count) * phase1.threads          # threads resident at once
    rate = min(spec.hbm_bytes_per_cycle, lanes * s.n_split * 4 / dram)
    l2 = partials <= L2_RESIDENT_SHARE * spec.l2_bytes
    read_rate = rate * spec.l2_speedup_over_hbm if l2 else rate
    memory = partials / read_rate + result / rate
    latency = _ceil_div(outputs, lanes) * dram          # a round trip per grid-stride step
    # After a softmax: an exp per split and output (the splits' weights).
    sfu = outputs * s.n_split / (SFU_PER_SM * spec.sm_count) if dims.softmax else 0.0
    combine = max(memory, latency, sfu)
    l2_read = partials if l2 else 0.0
    return replace(phase1,
                   seconds=phase1.seconds + spec.kernel_launch_overhead_s
                   + combine / spec.clock_hz,
                   cycles=phase1.cycles + combine,
                   hbm_bytes=phase1.hbm_bytes + result + partials - l2_read,
                   l2_bytes=phase1.l2_bytes + l2_read,
                   pipes={**phase1.pipes, "combine": combine})


# --- XLA's GEMM kernels ----------------------------------------------------------------

@dataclass(frozen=True)
class GemmTile:
    """A Triton GEMM tile as XLA's backend config gives it (block_level_fusion_config's
    output tile and warps, or triton_gemm_config), or an assumed library tile."""

    block_m: int = 16
    block_n: int = 8
    block_k: int = 16
    warps: int = 2
    stages: int = 1
    split_k: int = 1
    source: str = "default"       # "xla" (read from the config) | "assumed"


# cuBLAS and dots without a tile config (pre-optimization HLO): an assumed library tile
# (128 x 128 x 32, 8 warps, 3 stages: a common CUTLASS/cuBLAS SIMT/MMA configuration).
LIBRARY_TILE = GemmTile(128, 128, 32, 8, 3, 1, "assumed")
# XLA's Triton nested GEMM fusion with no k block in the outer config: 16 (the fixtures'
# inner dot configs say 16, 64 or 128; the nested computation is not on the op graph).
TRITON_DEFAULT_BLOCK_K = 16


def xla_gemm_tile(backend_config: dict) -> GemmTile:
    """The tile of an XLA GEMM fusion from its backend config (LIBRARY_TILE otherwise)."""
    fusion = backend_config.get("fusion_backend_config", {}) if isinstance(
        backend_config, dict) else {}
    gemm = fusion.get("triton_gemm_config") if isinstance(fusion, dict) else None
    if isinstance(gemm, dict) and gemm.get("block_m"):
        return GemmTile(int(gemm.get("block_m", 16)), int(gemm.get("block_n", 16)),
                        int(gemm.get("block_k", 16)), int(gemm.get("num_warps", 4)),
                        int(gemm.get("num_stages", 1)), int(gemm.get("split_k", 1)), "xla")
    block = fusion.get("block_level_fusion_config") if isinstance(fusion, dict) else None
    if isinstance(block, dict):
        tiles = block.get("output_tiles") or [{}]
        sizes = [int(x) for x in (tiles[0].get("sizes") or [16, 8])]
        bm, bn = (sizes[-2], sizes[-1]) if len(sizes) >= 2 else (16, sizes[-1] if sizes else 8)
        return GemmTile(bm, bn, TRITON_DEFAULT_BLOCK_K, int(block.get("num_warps", 4)),
                        int(block.get("num_stages", 1)), 1, "xla")
    return LIBRARY_TILE


def gemm_cost(spec: GpuSpec, batch: int, m: int, n: int, k: int, tile: GemmTile,
              operand_dtype: str = "f32", tf32: bool = True, out_bytes: int = 4,
              epilogue_instructions: float = 0.0) -> TileCost:
    """One XLA GEMM kernel: ``batch`` independent (m x k) @ (k x n) products (a split-K
    GEMM counts its splits as batch with k already split), tiled by ``tile``."""
    isz = OPERAND_BYTES.get(operand_dtype, 4)
    bm, bn = min(tile.block_m, max(m, 1)), min(tile.block_n, max(n, 1))
    bk = min(tile.block_k, max(k, 1))
    threads = tile.warps * spec.warp_size
    k_tiles = _ceil_div(k, bk)
    k_pad = k_tiles * bk
    m_blocks, n_blocks = _ceil_div(m, bm), _ceil_div(n, bn)
    blocks = batch * m_blocks * n_blocks
    use_mma = tensor_flops_per_clock_per_sm(spec, operand_dtype) is not None and (
        operand_dtype != "f32" or tf32)
    flops = 2.0 * bm * bn * k_pad
    stored = (bm + bn) * k_pad * isz
    per_thread = max(bm * bn / threads, 1.0)
    if use_mma:
        wm, wn = _warp_tile(bm, bn, tile.warps)
        read = tile.warps * (wm + wn) * k_pad * isz
    else:
        tm = min(float(bm), max(1.0, 2.0 ** math.floor(math.log2(math.sqrt(per_thread)))))
        tn = per_thread / tm
        read = threads * (tm + tn) * k_pad * isz
    a_bytes, b_bytes = bm * k * isz, bn * k * isz
    operands = (m * k + k * n) * isz
    if operands <= L2_RESIDENT_SHARE * spec.l2_bytes:
        hbm = a_bytes / n_blocks + b_bytes / m_blocks
        l2 = a_bytes * (1 - 1 / n_blocks) + b_bytes * (1 - 1 / m_blocks)
    else:
        hbm, l2 = a_bytes + b_bytes, 0.0
    hbm += bm * bn * out_bytes
    loads = a_bytes + b_bytes
    global_instr = (loads + bm * bn * out_bytes) / (spec.warp_size * 16)
    shared_instr = (stored + read) / (spec.warp_size * (16 if use_mma or per_thread >= 16
                                                        else 4))
    alu = bm * bn * epilogue_instructions / 32
    registers = BASE_REGISTERS + per_thread + (8 if use_mma else 2 * math.sqrt(per_thread))
    smem = max(tile.stages, 1) * (bm + bn) * bk * isz
    common = dict(alu_instr=alu, shared_bytes=stored + read,
                  other_instr=shared_instr + global_instr, hbm_bytes=hbm, l2_bytes=l2,
                  steps=k_tiles, stages=max(tile.stages, 1),
                  inflight_bytes=loads / k_tiles * max(tile.stages, 1))
    if use_mma:
        work = BlockWork(mma_flops=flops, mma_dtype=operand_dtype, **common)
    else:
        work = BlockWork(fma_instr=flops / 2 / 32, **common)
    return tile_kernel_time(spec, work, blocks, threads, registers, smem,
                            flops=2.0 * batch * m * n * k)
