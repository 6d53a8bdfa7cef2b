"""Theoretical occupancy: how many blocks of a kernel fit on one SM (sm_70, sm_80, sm_90).

Sources: NVIDIA CUDA C++ Programming Guide, "Compute Capabilities" (the technical
specifications table and the per-architecture shared memory sections), and the CUDA
Occupancy Calculator (register and shared memory allocation units, sub-partition warp
granularity). The per-architecture figures live in :mod:`stitch.cost.gpu_specs`.

Rules, for a block of T threads using R registers per thread and S bytes of shared memory:

- warps per block W = ceil(T / 32).
- "warps":  floor(max_warps_per_sm / W)                         (64 warps per SM).
- "blocks": max_blocks_per_sm                                   (32 per SM).
- "registers": registers are allocated per warp in units of 256, so a warp takes
  ceil(R * 32 / 256) * 256 registers; the register file (65536) is split among 4
  sub-partitions, so the warps it holds, floor(65536 / per-warp), are rounded down to a
  multiple of 4; the rule is floor(those warps / W).
- "shared_memory": a block takes ceil((S + reserved) / unit) * unit bytes, where reserved
  is the 1 KB per resident block that sm_80/sm_90 keep for the system even when S = 0
  (0 on sm_70) and unit is 256 bytes (sm_70) or 128 (sm_80/sm_90); the rule is
  floor(carve-out / per-block bytes), or max_blocks_per_sm when a block takes none.
- blocks per SM = the minimum of the four rules; occupancy = resident warps / 64. The
  limiter is the rule giving that minimum; on ties the first in RULE_ORDER (warps,
  registers, shared_memory, blocks) is named, and shared_memory is never named for a block
  that takes no shared memory.

Carve-out: given explicitly, it must be one of ``spec.shared_memory_carveouts`` and the
shared memory rule uses it. Left to the driver (None), the carve-out is free, so the shared
memory rule is evaluated at the largest carve-out and the kernel is reported to run with the
smallest carve-out that still reaches the resulting blocks per SM (a model of the driver).

A kernel cannot launch (blocks_per_sm = 0, limiter "launch") when T > 1024, R > 255,
W * per-warp registers > registers_per_block (65536), S > the opt-in per-block shared
memory limit, or when a rule leaves no room for a single block (e.g. the register
sub-partition rounding, or an explicitly chosen carve-out smaller than one block).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .gpu_specs import GpuSpec

# Tie-break order for naming the limiter when several rules give the same minimum: the
# per-thread resources first (they are what a kernel author changes), the fixed block cap last.
RULE_ORDER: tuple[str, ...] = ("warps", "registers", "shared_memory", "blocks")

DEFAULT_BLOCK_SIZES: tuple[int, ...] = tuple(range(32, 1025, 32))


@dataclass(frozen=True)
class Occupancy:
    threads_per_block: int
    registers_per_thread: int      # as requested (before allocation rounding)
    shared_bytes_per_block: int    # as requested
    blocks_per_sm: int             # resident blocks per SM (0 = cannot launch)
    warps_per_sm: int              # blocks_per_sm * warps per block
    occupancy: float               # warps_per_sm / max_warps_per_sm
    limiter: str                   # a RULE_ORDER name, or "launch" when it cannot launch
    limits: dict[str, int]         # blocks per SM allowed by each rule
    carveout_bytes: int            # the shared-memory carve-out the kernel runs with
    reason: str = ""               # why it cannot launch, when blocks_per_sm == 0


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_int(name: str, value: object, minimum: int) -> None:
    # bool is an int subclass; True threads per block is a caller bug, not 1 thread.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def shared_allocation_per_block(spec: GpuSpec, shared_bytes_per_block: int) -> int:
    """Bytes of the carve-out one resident block takes (reserved bytes and rounding included)."""
    total = shared_bytes_per_block + spec.reserved_shared_memory_per_block
    unit = spec.shared_memory_allocation_unit
    return _ceil_div(total, unit) * unit


def registers_per_warp(spec: GpuSpec, registers_per_thread: int) -> int:
    """Registers one warp is allocated (rounded up to the allocation unit)."""
    unit = spec.register_allocation_unit
    return _ceil_div(registers_per_thread * spec.warp_size, unit) * unit


def _blocks_by_shared(spec: GpuSpec, allocation: int, carveout: int) -> int:
    return spec.max_blocks_per_sm if allocation == 0 else carveout // allocation


# Results by (spec, block, registers, shared bytes, carve-out): the schedule tuner asks about
# the same few launch shapes for every combination it tries. Keyed by the spec's id (hashing
# a GpuSpec hashes all its fields); each entry keeps its spec alive, so the id stays its own.
# Bounded: cleared when full.
_MEMO: dict[tuple, tuple[GpuSpec, Occupancy]] = {}
_MEMO_LIMIT = 65536


def occupancy(spec: GpuSpec, threads_per_block: int, registers_per_thread: int,
              shared_bytes_per_block: int = 0, carveout_bytes: int | None = None) -> Occupancy:
    """Resident blocks and warps per SM for one kernel configuration (see the module rules).

    ``carveout_bytes`` None lets the carve-out be chosen (see below); otherwise it must be one
    of ``spec.shared_memory_carveouts`` and is used as given.
    """
    key = (id(spec), type(threads_per_block), threads_per_block, type(registers_per_thread),
           registers_per_thread, type(shared_bytes_per_block), shared_bytes_per_block,
           carveout_bytes)
    got = _MEMO.get(key)
    if got is None:
        result = _occupancy(spec, threads_per_block, registers_per_thread,
                            shared_bytes_per_block, carveout_bytes)
        if len(_MEMO) >= _MEMO_LIMIT:
            _MEMO.clear()
        _MEMO[key] = (spec, result)
        return result
    return got[1]


def _occupancy(spec: GpuSpec, threads_per_block: int, registers_per_thread: int,
               shared_bytes_per_block: int, carveout_bytes: int | None) -> Occupancy:
    _check_int("threads_per_block", threads_per_block, 1)
    _check_int("registers_per_thread", registers_per_thread, 1)
    _check_int("shared_bytes_per_block", shared_bytes_per_block, 0)
    if carveout_bytes is not None:
        _check_int("carveout_bytes", carveout_bytes, 0)
        if carveout_bytes not in spec.shared_memory_carveouts:
            raise ValueError(
                f"carveout_bytes {carveout_bytes} is not a {spec.name} carve-out; choose one of "
                f"{', '.join(map(str, spec.shared_memory_carveouts))}")

    warps_per_block = _ceil_div(threads_per_block, spec.warp_size)
    reasons: list[str] = []

    warps_limit = spec.max_warps_per_sm // warps_per_block
    if threads_per_block > spec.max_threads_per_block:
        reasons.append(f"threads_per_block {threads_per_block} exceeds the "
                       f"{spec.max_threads_per_block}-thread block limit")
        warps_limit = 0

    per_warp = registers_per_warp(spec, registers_per_thread)
    if registers_per_thread > spec.max_registers_per_thread:
        reasons.append(f"registers_per_thread {registers_per_thread} exceeds the "
                       f"{spec.max_registers_per_thread}-register limit")
        registers_limit = 0
    elif per_warp * warps_per_block > spec.registers_per_block:
        reasons.append(f"a block needs {per_warp * warps_per_block} registers "
                       f"({warps_per_block} warps x {per_warp}), over the "
                       f"{spec.registers_per_block}-register block limit")
        registers_limit = 0
    else:
        warps_by_registers = spec.registers_per_sm // per_warp
        warps_by_registers -= warps_by_registers % spec.warp_allocation_granularity
        registers_limit = warps_by_registers // warps_per_block
        if registers_limit == 0:
            reasons.append(f"registers_per_thread {registers_per_thread} leaves room for "
                           f"{warps_by_registers} warps per SM (register file split over "
                           f"{spec.warp_allocation_granularity} sub-partitions), fewer than "
                           f"the block's {warps_per_block}")

    allocation = shared_allocation_per_block(spec, shared_bytes_per_block)
    largest = max(spec.shared_memory_carveouts)
    # When the carve-out is free, shared memory limits only what the largest one allows.
    limit_carveout = largest if carveout_bytes is None else carveout_bytes
    shared_limit = _blocks_by_shared(spec, allocation, limit_carveout)
    if shared_bytes_per_block > spec.shared_memory_per_block_optin:
        reasons.append(f"shared_bytes_per_block {shared_bytes_per_block} exceeds the "
                       f"{spec.shared_memory_per_block_optin}-byte opt-in block limit")
        shared_limit = 0
    elif shared_limit == 0:
        reasons.append(f"carve-out {limit_carveout} bytes cannot hold one block's "
                       f"{allocation}-byte shared memory allocation")

    limits = {"warps": warps_limit, "registers": registers_limit,
              "shared_memory": shared_limit, "blocks": spec.max_blocks_per_sm}
    blocks = min(limits.values())

    if carveout_bytes is None:
        # No preference set: modelled as the driver picking the smallest carve-out that still
        # reaches the best blocks per SM, leaving the rest of the unified memory to L1. This is
        # a model of the driver's heuristic, which NVIDIA does not specify exactly.
        carveout = largest if blocks == 0 else next(
            c for c in spec.shared_memory_carveouts
            if _blocks_by_shared(spec, allocation, c) >= blocks)
    else:
        carveout = carveout_bytes

    # A block taking no shared memory is never limited by it (its rule is just the block cap).
    rules = [rule for rule in RULE_ORDER if allocation or rule != "shared_memory"]
    limiter = ("launch" if blocks == 0
               else next(rule for rule in rules if limits[rule] == blocks))
    warps = blocks * warps_per_block
    return Occupancy(
        threads_per_block=threads_per_block, registers_per_thread=registers_per_thread,
        shared_bytes_per_block=shared_bytes_per_block, blocks_per_sm=blocks,
        warps_per_sm=warps, occupancy=warps / spec.max_warps_per_sm, limiter=limiter,
        limits=limits, carveout_bytes=carveout, reason="; ".join(reasons))


def best_block_size(spec: GpuSpec, registers_per_thread: int,
                    shared_bytes_per_thread_block: Callable[[int], int] | int = 0,
                    candidates: Iterable[int] = DEFAULT_BLOCK_SIZES) -> Occupancy:
    """The candidate block size with the highest occupancy; the smaller block wins ties.

    ``shared_bytes_per_thread_block`` is a block's shared memory, fixed or as a function of the
    block size. If no candidate can launch, the smallest candidate's (failed) result is returned.
    """
    sizes = sorted(set(candidates))
    if not sizes:
        raise ValueError("candidates is empty")
    best: Occupancy | None = None
    for threads in sizes:   # ascending, so keeping only strict improvements favours smaller
        shared = (shared_bytes_per_thread_block(threads) if callable(shared_bytes_per_thread_block)
                  else shared_bytes_per_thread_block)
        result = occupancy(spec, threads, registers_per_thread, shared)
        if best is None or result.warps_per_sm > best.warps_per_sm:
            best = result
    assert best is not None
    return best
