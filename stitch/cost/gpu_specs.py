"""The GPU spec table the cost models read (V100, A100, H100 SXM, H200).

Where a figure comes from:
- V100/A100/H100 device figures (SM count, clock, HBM bandwidth, L2, shared memory, registers,
  threads) are copied from the XLA GPU target descriptions this project compiles its baseline
  with (../shared/xla_gpu_specs/*.txtpb: OpenXLA's public target_config specs); tests check
  them against those files.
- Per-architecture limits (carve-outs, blocks/warps per SM, registers per thread, register
  allocation unit) are from NVIDIA's CUDA C++ Programming Guide, "Compute Capabilities"
  (technical specifications table and the per-architecture shared memory sections), and the
  Volta/Ampere/Hopper tuning guides; the allocation unit from the CUDA Occupancy Calculator.
- H200: NVIDIA's H200 datasheet (141 GB HBM3e, 4.8 TB/s, FP32 67 TFLOPS). It is the H100
  SM (sm_90, 132 SMs in the SXM part); figures the datasheet does not give are marked
  "assumed" below.
Every figure is "documented" (from one of those sources) unless marked "assumed".
"""
from __future__ import annotations

from dataclasses import dataclass

from stitch.hlo.errors import StitchError

KIB = 1024

# XLA's analytical model (xla/service/gpu/model/gpu_performance_model_base.h,
# GpuPerformanceModelBase and GpuPerformanceModelOptions): constants XLA itself labels
# "estimated values in the absence of easy ways to query them". We use the same numbers so
# our latency figures are comparable with XLA's fusion decisions.
XLA_KERNEL_LAUNCH_OVERHEAD_S = 1e-6      # kKernelLaunchOverhead = 1 us (older XLA: 5 us)
XLA_NCCL_KERNEL_LAUNCH_OVERHEAD_S = 5e-6 # kNcclKernelLaunchOverhead
XLA_L2_CACHE_SPEEDUP = 2.5               # kL2CacheSpeedup: L2 reads vs HBM (assumed by XLA)
XLA_L1_CACHE_SPEEDUP = 8.0               # kL1CacheSpeedup: L1 reads vs HBM (assumed by XLA)
XLA_MEMORY_COMPUTE_PARALLELISM = 0.95    # T = C + M - 0.95 * min(C, M)

# Shared memory: 32 banks, each 32 bits wide, each serving one 32-bit word per clock
# (CUDA Programming Guide, "Shared Memory" of compute capabilities 5.x-9.x): 128 B/clk/SM
# without bank conflicts. Documented.
SHARED_MEMORY_BANKS = 32
SHARED_MEMORY_BANK_BYTES = 4


@dataclass(frozen=True)
class _Arch:
    """What the compute capability fixes (CUDA Programming Guide tables)."""

    carveouts_kib: tuple[int, ...]       # shared memory capacities an SM can be set to
    reserved_shared_per_block: int       # driver-reserved shared memory per block
    max_blocks_per_sm: int = 32
    max_warps_per_sm: int = 64
    max_threads_per_sm: int = 2048
    # Shared memory is allocated to a block in units of this many bytes (CUDA Occupancy
    # Calculator, "shared memory allocation unit size").
    shared_memory_allocation_unit: int = 256


_ARCHS: dict[tuple[int, int], _Arch] = {
    # Volta: unified L1/shared of 128 KB, "shared memory capacity can be set to 0, 8, 16,
    # 32, 64 or 96 KB"; no reserved shared memory (opt-in limit = 96 KB = the SM's).
    (7, 0): _Arch((0, 8, 16, 32, 64, 96), 0),
    # A100 (8.0): 192 KB unified, "0, 8, 16, 32, 64, 100, 132 or 164 KB"; 1 KB per block is
    # reserved for system use (per-block opt-in 163 KB).
    (8, 0): _Arch((0, 8, 16, 32, 64, 100, 132, 164), KIB, shared_memory_allocation_unit=128),
    # Hopper (9.0): 256 KB unified, "0, 8, 16, 32, 64, 100, 132, 164, 196 or 228 KB";
    # 1 KB reserved per block (opt-in 227 KB).
    (9, 0): _Arch((0, 8, 16, 32, 64, 100, 132, 164, 196, 228), KIB,
                  shared_memory_allocation_unit=128),
}


@dataclass(frozen=True)
class GpuSpec:
    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    clock_ghz: float                     # boost clock, as XLA's target description uses
    hbm_bandwidth: float                 # bytes/s, peak
    memory_bytes: int                    # device memory
    l2_bytes: int
    fp32_cores_per_sm: int
    shared_memory_per_sm: int            # largest carve-out, bytes
    shared_memory_per_block_optin: int   # per-block limit after cudaFuncSetAttribute opt-in
    shared_memory_carveouts: tuple[int, ...]   # bytes, ascending
    reserved_shared_memory_per_block: int
    shared_memory_per_block: int = 48 * KIB    # without opt-in
    shared_memory_allocation_unit: int = 256   # bytes; 256 on sm_70, 128 on sm_80/sm_90
    registers_per_sm: int = 65536
    registers_per_block: int = 65536
    max_registers_per_thread: int = 255
    register_allocation_unit: int = 256        # registers, allocated per warp
    # The register file is split among 4 SM sub-partitions (one warp scheduler each), so
    # the warps registers allow are rounded down to a multiple of 4.
    warp_allocation_granularity: int = 4
    max_threads_per_sm: int = 2048
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    max_threads_per_block: int = 1024
    warp_size: int = 32
    kernel_launch_overhead_s: float = XLA_KERNEL_LAUNCH_OVERHEAD_S
    # L2 bandwidth: NVIDIA publishes none for these parts; XLA assumes 2.5x HBM
    # (kL2CacheSpeedup). Assumed. For scale, Jia et al., "Dissecting the NVIDIA Volta GPU
    # Architecture via Microbenchmarking" (2018) measured about 2.1 TB/s of L2 load
    # throughput on V100, i.e. ~2.4x its HBM2.
    l2_speedup_over_hbm: float = XLA_L2_CACHE_SPEEDUP
    notes: str = ""

    # --- derived quantities ----------------------------------------------------------
    @property
    def clock_hz(self) -> float:
        return self.clock_ghz * 1e9

    @property
    def fp32_flops(self) -> float:
        """Peak FP32 FLOP/s: one FMA (2 FLOPs) per core per clock."""
        return self.sm_count * self.fp32_cores_per_sm * 2 * self.clock_hz

    @property
    def hbm_bytes_per_cycle(self) -> float:
        """Device-wide HBM bytes per SM clock."""
        return self.hbm_bandwidth / self.clock_hz

    @property
    def hbm_bytes_per_cycle_per_sm(self) -> float:
        return self.hbm_bytes_per_cycle / self.sm_count

    @property
    def l2_bandwidth(self) -> float:
        """Assumed (see ``l2_speedup_over_hbm``)."""
        return self.hbm_bandwidth * self.l2_speedup_over_hbm

    @property
    def shared_memory_bytes_per_cycle_per_sm(self) -> int:
        return SHARED_MEMORY_BANKS * SHARED_MEMORY_BANK_BYTES

    @property
    def shared_memory_bandwidth(self) -> float:
        """Device-wide conflict-free shared memory bandwidth, bytes/s (documented per clock)."""
        return self.shared_memory_bytes_per_cycle_per_sm * self.sm_count * self.clock_hz

    @property
    def max_warps_per_block(self) -> int:
        return self.max_threads_per_block // self.warp_size

    @property
    def ridge_flops_per_byte(self) -> float:
        """FP32 roofline ridge point: below it a kernel is memory-bound."""
        return self.fp32_flops / self.hbm_bandwidth

    def carveout_for(self, shared_bytes_per_sm: int) -> int | None:
        """The smallest carve-out (bytes) holding ``shared_bytes_per_sm``, None if none does."""
        return next((c for c in self.shared_memory_carveouts if c >= shared_bytes_per_sm), None)


def _spec(name: str, cc: tuple[int, int], **fields) -> GpuSpec:
    arch = _ARCHS[cc]
    return GpuSpec(
        name=name, compute_capability=cc,
        shared_memory_carveouts=tuple(k * KIB for k in arch.carveouts_kib),
        reserved_shared_memory_per_block=arch.reserved_shared_per_block,
        max_blocks_per_sm=arch.max_blocks_per_sm, max_warps_per_sm=arch.max_warps_per_sm,
        max_threads_per_sm=arch.max_threads_per_sm,
        shared_memory_allocation_unit=arch.shared_memory_allocation_unit, **fields)


SPECS: dict[str, GpuSpec] = {
    # Tesla V100-SXM2-16GB (v100.txtpb). Datasheet: 900 GB/s, 15.7 FP32 TFLOPS.
    "v100": _spec("v100", (7, 0), sm_count=80, clock_ghz=1.53, hbm_bandwidth=898_048_000_000,
                  memory_bytes=16_935_682_048, l2_bytes=6_291_456, fp32_cores_per_sm=64,
                  shared_memory_per_sm=98_304, shared_memory_per_block_optin=98_304),
    # A100-SXM4-80GB (a100.txtpb). Datasheet: 2,039 GB/s, 19.5 FP32 TFLOPS.
    "a100": _spec("a100", (8, 0), sm_count=108, clock_ghz=1.41, hbm_bandwidth=2_039_040_000_000,
                  memory_bytes=85_100_068_864, l2_bytes=41_943_040, fp32_cores_per_sm=64,
                  shared_memory_per_sm=167_936, shared_memory_per_block_optin=166_912),
    # H100 80GB HBM3, SXM (h100.txtpb). Datasheet: 3.35 TB/s, 67 FP32 TFLOPS.
    "h100": _spec("h100", (9, 0), sm_count=132, clock_ghz=1.98, hbm_bandwidth=3_352_320_000_000,
                  memory_bytes=84_942_979_072, l2_bytes=52_428_800, fp32_cores_per_sm=128,
                  shared_memory_per_sm=233_472, shared_memory_per_block_optin=232_448),
    # H200 SXM. Documented (datasheet): 4.8 TB/s HBM3e, 141 GB, FP32 67 TFLOPS; sm_90 limits
    # from the programming guide. Assumed: 132 SMs at 1.98 GHz with 128 FP32 cores each (the
    # H100 SXM SM/board; consistent with the datasheet's 67 TFLOPS), 50 MiB L2 as on H100,
    # 141e9 bytes of memory (the datasheet's decimal GB).
    "h200": _spec("h200", (9, 0), sm_count=132, clock_ghz=1.98, hbm_bandwidth=4_800_000_000_000,
                  memory_bytes=141_000_000_000, l2_bytes=52_428_800, fp32_cores_per_sm=128,
                  shared_memory_per_sm=233_472, shared_memory_per_block_optin=232_448,
                  notes="SM count, clock, L2 size assumed equal to H100 SXM"),
}


class UnknownTargetError(StitchError, ValueError):
    """A GPU name not in the spec table."""


def get_spec(name: str) -> GpuSpec:
    """The spec of ``name`` ("v100", "a100", "h100", "h200"; case-insensitive)."""
    key = name.strip().lower() if isinstance(name, str) else ""
    if key not in SPECS:
        raise UnknownTargetError(
            f"unknown GPU target {name!r}: choose one of {', '.join(sorted(SPECS))}")
    return SPECS[key]
