"""The latency-evaluator (FusionStitching §4.3): L = N_wave × L_warp, with occupancy.

A kernel part is described by what one warp executes (:class:`WarpWork`) and how it is
launched (:class:`LaunchShape`). Occupancy (``occupancy.py``) gives the warps resident per
SM; the grid runs in N_wave = ceil(blocks / (blocks_per_sm × SMs)) waves. A warp's time
has two bounds and the larger one wins:

- throughput: its warp instructions × CPI, where CPI is the SM-wide cost in cycles of one
  warp instruction of each class (table below); the SM's resident warps share those issue
  slots, so a wave of A warps costs A × L_warp cycles. Memory transfers and arithmetic use
  different units of the SM, and while one warp waits for its loads the others compute, so
  the two overlap: L_warp = C + M − 0.95 × min(C, M) with C the compute pipes' cycles (ALU,
  SFU, shuffles, shared memory) and M the memory cycles. The form and the 0.95 are XLA's
  (GpuPerformanceModelBase::CombineComputeAndMemoryAccessTime, kMemoryComputeParallelism
  in xla/service/gpu/model/gpu_performance_model_base.cc), the same combination the
  delta-evaluator uses for whole kernels; a kernel is then about as slow as its busier
  resource, not the sum of both;
- latency: the dependent chain of one warp — global-memory round trips (loads in a loop are
  unrolled ``UNROLL`` deep, so only one round in ``UNROLL`` waits the full DRAM latency),
  shuffles, barriers and shared-memory accesses, each at its latency.

So L = N_wave × max(A × L_warp(throughput), L_warp(latency)) cycles, plus the launch.
A global-scope kernel (``stitch.schedule.global_scope``) adds its phases' parts and
``grid_barrier_cycles`` per grid barrier.

CPI per warp instruction (cycles of one SM, full throughput), from the CUDA C++
Programming Guide's "Arithmetic Instructions" throughput table (results per clock per SM):
FP32 add/mul/fma = the SM's FP32 lanes (64 on sm_70/sm_80, 128 on sm_90), so 32/lanes;
special functions (rsqrt, ex2, lg2, sin, cos: the SFU) = 16 per SM, so 2; warp shuffle =
32 per SM, so 1; shared memory = 32 banks × 4 B per clock, so 1 per conflict-free 32-bit
warp access. Global memory: the bytes of the instruction over the SM's share of HBM
bandwidth per clock (``GpuSpec.hbm_bytes_per_cycle_per_sm``).

Latencies in cycles are approximate third-party microbenchmark figures: global memory
(DRAM) ~400 on V100 (Jia et al., "Dissecting the NVIDIA Volta GPU Architecture via
Microbenchmarking", 2018), ~470 on A100 and ~480 on H100 (Luo et al., "Benchmarking and
Dissecting the Nvidia Hopper GPU Architecture", 2024); shuffle ~30, barrier ~30 and
shared-memory load ~30 cycles (same sources, rounded); a dependent FP32 op 4 cycles.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .gpu_specs import XLA_L2_CACHE_SPEEDUP, XLA_MEMORY_COMPUTE_PARALLELISM, GpuSpec
from .occupancy import Occupancy, occupancy

UNROLL = 4                       # loads in flight per thread in a loop (codegen unrolls)
SFU_PER_SM = 16
SHUFFLES_PER_SM_PER_CLOCK = 32
SHARED_BYTES_PER_CLOCK = 128
DRAM_LATENCY_CYCLES = {7: 400, 8: 470, 9: 480}
SHUFFLE_LATENCY_CYCLES = 30
BARRIER_LATENCY_CYCLES = 30
SHARED_LATENCY_CYCLES = 30
ALU_LATENCY_CYCLES = 4
# L2 hit latency (same microbenchmark papers, rounded): a grid barrier's atomics and polls
# are served by the L2.
L2_LATENCY_CYCLES = {7: 200, 8: 200, 9: 260}
# Arrivals at one counter serialise at its L2 slice: about this many cycles apart.
SAME_ADDRESS_ATOMIC_CYCLES = 2
# L1 hit latency (same papers, rounded): what a thread's loads of data it or its block
# just touched wait, UNROLL of them in flight.
L1_LATENCY_CYCLES = {7: 28, 8: 33, 9: 33}


@dataclass(frozen=True)
class WarpWork:
    """Warp instructions one warp executes, by class, and its dependent chain."""

    alu: float = 0.0             # FP32/integer arithmetic, index math
    sfu: float = 0.0             # special-function (transcendental) instructions
    global_bytes: float = 0.0    # HBM bytes the warp loads and stores
    global_instr: float = 0.0    # global load/store warp instructions
    memory_rounds: float = 0.0   # global round trips one after another
    shared_instr: float = 0.0    # shared-memory warp accesses
    shuffles: float = 0.0
    barriers: float = 0.0
    chain_alu: float = 0.0       # arithmetic on the critical path (e.g. reduction trees)
    # Strided accesses (lanes on different 32-byte sectors): the sectors they move through
    # the L2. Their DRAM bytes are in global_bytes; the L2 merges partial sectors, so these
    # cost at the L2's speed (XLA's kL2CacheSpeedup over HBM).
    sector_bytes: float = 0.0


@dataclass(frozen=True)
class LaunchShape:
    blocks: int
    threads_per_block: int
    registers_per_thread: int
    shared_bytes_per_block: int = 0


@dataclass(frozen=True)
class Latency:
    seconds: float
    cycles: float
    waves: int
    occupancy: Occupancy
    bound: str                   # "throughput" | "latency" | "cannot launch"


# cpi per spec (by id; each entry keeps its spec alive): the tuner asks for every
# combination it tries.
_CPI: dict[int, tuple[GpuSpec, dict[str, float]]] = {}


def cpi(spec: GpuSpec) -> dict[str, float]:
    """Cycles of one SM per warp instruction of each class (see the module docstring)."""
    got = _CPI.get(id(spec))
    if got is None:
        got = _CPI[id(spec)] = (spec, {
            "alu": spec.warp_size / spec.fp32_cores_per_sm,
            "sfu": spec.warp_size / SFU_PER_SM,
            "shuffle": spec.warp_size / SHUFFLES_PER_SM_PER_CLOCK,
            "shared": spec.warp_size * 4 / SHARED_BYTES_PER_CLOCK,
            "global_byte": 1.0 / spec.hbm_bytes_per_cycle_per_sm})
    return dict(got[1])


def warp_compute_cycles(spec: GpuSpec, work: WarpWork) -> float:
    """SM cycles of one warp's arithmetic, special-function, shuffle and shared-memory
    instructions."""
    table = _CPI[id(spec)][1] if id(spec) in _CPI else cpi(spec)
    return (work.alu * table["alu"] + work.sfu * table["sfu"]
            + work.shuffles * table["shuffle"] + work.shared_instr * table["shared"])


def warp_memory_cycles(spec: GpuSpec, work: WarpWork) -> float:
    """SM cycles of one warp's HBM traffic: its bytes over the SM's share of the bandwidth
    (sectors of strided accesses at the L2's speed), at least one cycle per global
    load/store instruction."""
    table = _CPI[id(spec)][1] if id(spec) in _CPI else cpi(spec)
    moved = work.global_bytes + work.sector_bytes / XLA_L2_CACHE_SPEEDUP
    return max(moved * table["global_byte"], work.global_instr)


def warp_issue_cycles(spec: GpuSpec, work: WarpWork) -> float:
    """One warp's share of the SM's throughput: compute and memory overlapped across the
    resident warps (module docstring)."""
    compute = warp_compute_cycles(spec, work)
    memory = warp_memory_cycles(spec, work)
    return compute + memory - XLA_MEMORY_COMPUTE_PARALLELISM * min(compute, memory)


def warp_chain_cycles(spec: GpuSpec, work: WarpWork) -> float:
    dram = DRAM_LATENCY_CYCLES.get(spec.compute_capability[0], 480)
    return (work.memory_rounds * dram + work.shuffles * SHUFFLE_LATENCY_CYCLES
            + work.barriers * BARRIER_LATENCY_CYCLES
            + work.shared_instr * SHARED_LATENCY_CYCLES
            + work.chain_alu * ALU_LATENCY_CYCLES
            # every instruction issues at least one cycle after the previous one
            + work.alu + work.sfu + work.global_instr)


def thread_bound_seconds(spec: GpuSpec, loads: float, ops: float) -> float:
    """A kernel's time as bounded by what its busiest thread executes
    (``stitch.codegen.thread_work``): its loads at the L1's latency, ``UNROLL`` in flight,
    or its arithmetic at one instruction a cycle, whichever is longer, plus the launch. No
    number of threads beside it makes the kernel shorter. An estimate, not a strict floor:
    on an H200 it was 0.5-1.25× the measured time of the f32 kernels whose time it decides
    (bf16 ones ran up to 7× longer), where their schedules were priced 30-250× too low
    (GPU check, 2026-11)."""
    l1 = L1_LATENCY_CYCLES.get(spec.compute_capability[0], 33)
    cycles = max(loads * l1 / UNROLL, ops)
    return spec.kernel_launch_overhead_s + cycles / spec.clock_hz


def grid_barrier_cycles(spec: GpuSpec, blocks: int) -> float:
    """A software grid barrier (``kir.GridBarrier``): two block barriers, thread 0's
    fence and atomic arrival (an L2 round trip), the arrivals of every block serialised on
    one counter, the last one's generation bump and the others' poll seeing it (two more
    L2 round trips). An assumption built from the latencies above, not a measurement."""
    l2 = L2_LATENCY_CYCLES.get(spec.compute_capability[0], 260)
    return 2 * BARRIER_LATENCY_CYCLES + 3 * l2 + blocks * SAME_ADDRESS_ATOMIC_CYCLES


def part_cycles(spec: GpuSpec, launch: LaunchShape, work: WarpWork, occ: Occupancy
                ) -> tuple[float, float, int]:
    """(throughput cycles, latency cycles, waves) of one part run on its own."""
    warps_per_block = math.ceil(launch.threads_per_block / spec.warp_size)
    sms_used = min(spec.sm_count, launch.blocks)
    resident = max(occ.blocks_per_sm, 1) * spec.sm_count
    waves = math.ceil(launch.blocks / resident)
    total_warps = launch.blocks * warps_per_block
    throughput = total_warps * warp_issue_cycles(spec, work) / max(sms_used, 1)
    latency = waves * warp_chain_cycles(spec, work)
    return throughput, latency, waves


def evaluate(spec: GpuSpec, launch: LaunchShape, work: WarpWork) -> Latency:
    """Modeled time of one kernel (one part) with the given launch shape."""
    occ = occupancy(spec, launch.threads_per_block, launch.registers_per_thread,
                    launch.shared_bytes_per_block)
    if occ.blocks_per_sm == 0:
        return Latency(math.inf, math.inf, 0, occ, "cannot launch")
    throughput, latency, waves = part_cycles(spec, launch, work, occ)
    cycles = max(throughput, latency)
    bound = "throughput" if throughput >= latency else "latency"
    return Latency(spec.kernel_launch_overhead_s + cycles / spec.clock_hz, cycles, waves,
                   occ, bound)
