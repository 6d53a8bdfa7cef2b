"""Occupancy calculator: hand-computed cases for sm_70 (V100), sm_80 (A100), sm_90 (H100).

Every expectation below is worked out by hand in the comment beside it, from the rules in
stitch/cost/occupancy.py's docstring: W = ceil(threads / 32); warps rule 64 // W; registers
rule = (65536 // per-warp regs, rounded down to a multiple of 4) // W with per-warp regs =
ceil(regs * 32 / 256) * 256; shared rule = carve-out // per-block bytes with per-block bytes
= ceil((smem + reserved) / unit) * unit (V100: reserved 0, unit 256; A100/H100: reserved
1024, unit 128); blocks rule 32. Carve-outs: V100 0/8/16/32/64/96 KiB; A100 adds 100/132/164
KiB (no 96); H100 adds 196/228 KiB.
"""
from __future__ import annotations

import pytest

from stitch.cost.gpu_specs import get_spec
from stitch.cost.occupancy import Occupancy, best_block_size, occupancy

K = 1024

# (gpu, threads, regs, smem, carveout arg, blocks, warps, occupancy, limiter,
#  limits (warps, registers, shared_memory, blocks), carve-out used)
CASES = [
    # --- warps-limited: 1024 threads, 32 regs. W = 32 -> warps 64//32 = 2; per-warp regs
    # 32*32 = 1024 -> 64 warps -> 64//32 = 2 (tie: warps named first). 2 x 32 = 64 warps, 100%.
    # V100: no shared memory -> rule = 32, carve-out 0.
    pytest.param("v100", 1024, 32, 0, None, 2, 64, 1.0, "warps", (2, 2, 32, 32), 0,
                 id="v100-warps-1024x32"),
    # A100: 0 + 1024 reserved = 1024/block; 164 KiB / 1 KiB = 164; 2 blocks need 2 KiB -> 8 KiB.
    pytest.param("a100", 1024, 32, 0, None, 2, 64, 1.0, "warps", (2, 2, 164, 32), 8 * K,
                 id="a100-warps-1024x32"),
    # H100: 228 KiB / 1 KiB = 228; 2 blocks -> 8 KiB carve-out.
    pytest.param("h100", 1024, 32, 0, None, 2, 64, 1.0, "warps", (2, 2, 228, 32), 8 * K,
                 id="h100-warps-1024x32"),
    # --- warps-limited, no tie: 512 threads, 16 regs. W = 16 -> 64//16 = 4; per-warp 16*32 =
    # 512 -> 128 warps -> 128//16 = 8. 4 blocks x 16 = 64 warps, 100%.
    pytest.param("v100", 512, 16, 0, None, 4, 64, 1.0, "warps", (4, 8, 32, 32), 0,
                 id="v100-warps-512x16"),
    # A100: 4 blocks x 1 KiB = 4 KiB -> 8 KiB carve-out (164 KiB allows 164).
    pytest.param("a100", 512, 16, 0, None, 4, 64, 1.0, "warps", (4, 8, 164, 32), 8 * K,
                 id="a100-warps-512x16"),
    pytest.param("h100", 512, 16, 0, None, 4, 64, 1.0, "warps", (4, 8, 228, 32), 8 * K,
                 id="h100-warps-512x16"),
    # --- odd thread count: 33 threads -> W = 2; warps 64//2 = 32; 16 regs -> 512/warp -> 128
    # warps -> 64; blocks 32. Tie warps/blocks at 32 -> "warps"; 32 x 2 = 64 warps, 100%.
    pytest.param("v100", 33, 16, 0, None, 32, 64, 1.0, "warps", (32, 64, 32, 32), 0,
                 id="v100-warps-33-threads"),

    # --- register-limited: 256 threads, 128 regs. W = 8 -> warps rule 8; per-warp 128*32 =
    # 4096 -> 65536/4096 = 16 warps (multiple of 4) -> 16//8 = 2 blocks = 16 warps = 25%.
    pytest.param("v100", 256, 128, 0, None, 2, 16, 0.25, "registers", (8, 2, 32, 32), 0,
                 id="v100-regs-256x128"),
    # A100/H100: 2 blocks x 1 KiB -> 8 KiB carve-out.
    pytest.param("a100", 256, 128, 0, None, 2, 16, 0.25, "registers", (8, 2, 164, 32), 8 * K,
                 id="a100-regs-256x128"),
    pytest.param("h100", 256, 128, 0, None, 2, 16, 0.25, "registers", (8, 2, 228, 32), 8 * K,
                 id="h100-regs-256x128"),
    # --- register-limited, odd: 256 threads, 40 regs. per-warp 40*32 = 1280 (= 5 x 256);
    # 65536/1280 = 51.2 -> 51 -> 48 (multiple of 4) -> 48//8 = 6 blocks = 48 warps = 75%.
    pytest.param("v100", 256, 40, 0, None, 6, 48, 0.75, "registers", (8, 6, 32, 32), 0,
                 id="v100-regs-256x40"),
    # A100/H100: 6 blocks x 1 KiB = 6 KiB -> 8 KiB carve-out.
    pytest.param("a100", 256, 40, 0, None, 6, 48, 0.75, "registers", (8, 6, 164, 32), 8 * K,
                 id="a100-regs-256x40"),
    pytest.param("h100", 256, 40, 0, None, 6, 48, 0.75, "registers", (8, 6, 228, 32), 8 * K,
                 id="h100-regs-256x40"),
    # --- the multiple-of-4 rounding matters: 64 threads (W = 2), 40 regs: 51 warps -> 48 ->
    # 48//2 = 24 blocks (51//2 would be 25). 24 x 2 = 48 warps = 75%. warps rule 32.
    pytest.param("v100", 64, 40, 0, None, 24, 48, 0.75, "registers", (32, 24, 32, 32), 0,
                 id="v100-regs-granularity-64x40"),
    # A100: 24 blocks x 1 KiB = 24 KiB -> 32 KiB carve-out (16 KiB holds only 16).
    pytest.param("a100", 64, 40, 0, None, 24, 48, 0.75, "registers", (32, 24, 164, 32), 32 * K,
                 id="a100-regs-granularity-64x40"),
    pytest.param("h100", 64, 40, 0, None, 24, 48, 0.75, "registers", (32, 24, 228, 32), 32 * K,
                 id="h100-regs-granularity-64x40"),
    # --- per-warp rounding matters: 128 threads (W = 4), 33 regs: 33*32 = 1056 -> ceil(1056/256)
    # = 5 -> 1280/warp -> 48 warps -> 48//4 = 12 blocks = 48 warps = 75% (unrounded 1056 would
    # give 62 -> 60 warps -> 15 blocks). warps rule 16.
    pytest.param("v100", 128, 33, 0, None, 12, 48, 0.75, "registers", (16, 12, 32, 32), 0,
                 id="v100-regs-rounding-128x33"),
    # A100/H100: 12 KiB of reserved memory -> 16 KiB carve-out (8 KiB holds 8).
    pytest.param("a100", 128, 33, 0, None, 12, 48, 0.75, "registers", (16, 12, 164, 32), 16 * K,
                 id="a100-regs-rounding-128x33"),
    pytest.param("h100", 128, 33, 0, None, 12, 48, 0.75, "registers", (16, 12, 228, 32), 16 * K,
                 id="h100-regs-rounding-128x33"),
    # --- three warps per block: 96 threads, 64 regs. W = 3 -> warps 64//3 = 21; per-warp 2048
    # -> 32 warps -> 32//3 = 10 blocks = 30 warps = 30/64 = 0.46875.
    pytest.param("v100", 96, 64, 0, None, 10, 30, 0.46875, "registers", (21, 10, 32, 32), 0,
                 id="v100-regs-96x64"),
    # --- register boundary: 256 threads, 255 regs: 255*32 = 8160 -> 8192/warp; block needs
    # 8 x 8192 = 65536 (= the block limit, launches); 65536/8192 = 8 warps -> 1 block = 12.5%.
    pytest.param("h100", 256, 255, 0, None, 1, 8, 0.125, "registers", (8, 1, 228, 32), 8 * K,
                 id="h100-regs-255-boundary"),

    # --- shared-memory-limited: 48 KiB, 128 threads, 32 regs. W = 4: warps 16, registers
    # 64//4 = 16, blocks 32.
    # V100: 49152 is a multiple of 256; 96 KiB / 48 KiB = 2 blocks = 8 warps = 12.5%;
    # 64 KiB holds only 1, so the carve-out is 96 KiB.
    pytest.param("v100", 128, 32, 48 * K, None, 2, 8, 0.125, "shared_memory", (16, 16, 2, 32),
                 96 * K, id="v100-smem-48k"),
    # A100: 49152 + 1024 = 50176 (= 392 x 128); 167936 // 50176 = 3 (3.35) = 12 warps = 18.75%;
    # 132 KiB = 135168 // 50176 = 2, so 164 KiB.
    pytest.param("a100", 128, 32, 48 * K, None, 3, 12, 0.1875, "shared_memory", (16, 16, 3, 32),
                 164 * K, id="a100-smem-48k"),
    # H100: 228 KiB = 233472 // 50176 = 4 (4.65) = 16 warps = 25%; 196 KiB = 200704 =
    # exactly 4 x 50176, so the smaller 196 KiB carve-out suffices.
    pytest.param("h100", 128, 32, 48 * K, None, 4, 16, 0.25, "shared_memory", (16, 16, 4, 32),
                 196 * K, id="h100-smem-48k"),
    # --- allocation-unit rounding matters, 128 threads, 32 regs (warps 16, regs 16):
    # V100 10900 B: ceil(10900/256) = 43 -> 11008; 98304 // 11008 = 8 (unrounded: 9). 8 x 4 =
    # 32 warps = 50%. 64 KiB // 11008 = 5 < 8 -> 96 KiB.
    pytest.param("v100", 128, 32, 10900, None, 8, 32, 0.5, "shared_memory", (16, 16, 8, 32),
                 96 * K, id="v100-smem-rounding"),
    # A100 10900 B: 10900 + 1024 = 11924 -> ceil(/128) = 94 -> 12032; 167936 // 12032 = 13
    # (unrounded 11924: 14). 13 x 4 = 52 warps = 0.8125. 132 KiB // 12032 = 11 < 13 -> 164 KiB.
    pytest.param("a100", 128, 32, 10900, None, 13, 52, 0.8125, "shared_memory",
                 (16, 16, 13, 32), 164 * K, id="a100-smem-rounding"),
    # H100 16926 B: 16926 + 1024 = 17950 -> ceil(/128) = 141 -> 18048; 233472 // 18048 = 12
    # (unrounded 17950: 13). 12 x 4 = 48 warps = 75%. 196 KiB // 18048 = 11 < 12 -> 228 KiB.
    pytest.param("h100", 128, 32, 16926, None, 12, 48, 0.75, "shared_memory", (16, 16, 12, 32),
                 228 * K, id="h100-smem-rounding"),
    # --- opt-in boundary: exactly the per-block opt-in limit launches, 1 block of 4 warps.
    # V100: 98304 -> 98304 B/block; 96 KiB // 96 KiB = 1 -> 4/64 = 6.25%.
    pytest.param("v100", 128, 32, 98304, None, 1, 4, 0.0625, "shared_memory", (16, 16, 1, 32),
                 96 * K, id="v100-smem-optin-boundary"),
    # A100: 166912 + 1024 = 167936 = 164 KiB -> 1 block.
    pytest.param("a100", 128, 32, 166912, None, 1, 4, 0.0625, "shared_memory", (16, 16, 1, 32),
                 164 * K, id="a100-smem-optin-boundary"),
    # H100: 232448 + 1024 = 233472 = 228 KiB -> 1 block.
    pytest.param("h100", 128, 32, 232448, None, 1, 4, 0.0625, "shared_memory", (16, 16, 1, 32),
                 228 * K, id="h100-smem-optin-boundary"),

    # --- blocks-limited: 32 threads, 16 regs. W = 1: warps 64; per-warp 512 -> 128 warps ->
    # 128; blocks 32 -> 32 blocks = 32 warps = 50%.
    # V100: no shared memory (rule = 32, never the named limiter) -> carve-out 0.
    pytest.param("v100", 32, 16, 0, None, 32, 32, 0.5, "blocks", (64, 128, 32, 32), 0,
                 id="v100-blocks-32x16"),
    # A100: reserved 1 KiB/block: 32 blocks need 32 KiB -> 32 KiB carve-out (16 KiB holds 16);
    # the free carve-out allows 164, so "blocks" limits.
    pytest.param("a100", 32, 16, 0, None, 32, 32, 0.5, "blocks", (64, 128, 164, 32), 32 * K,
                 id="a100-blocks-32x16"),
    pytest.param("h100", 32, 16, 0, None, 32, 32, 0.5, "blocks", (64, 128, 228, 32), 32 * K,
                 id="h100-blocks-32x16"),
    # A100 100 B: 100 + 1024 = 1124 -> ceil(/128) = 9 -> 1152; 32 blocks need 36864 B:
    # 32 KiB // 1152 = 28 < 32, 64 KiB // 1152 = 56 -> 64 KiB; 164 KiB // 1152 = 145.
    pytest.param("a100", 32, 16, 100, None, 32, 32, 0.5, "blocks", (64, 128, 145, 32), 64 * K,
                 id="a100-blocks-small-smem"),
    # V100 100 B: -> 256 B/block; 32 x 256 = 8 KiB carve-out; 96 KiB // 256 = 384.
    pytest.param("v100", 32, 16, 100, None, 32, 32, 0.5, "blocks", (64, 128, 384, 32), 8 * K,
                 id="v100-blocks-small-smem"),

    # --- explicit carve-outs.
    # A100 16 KiB with 1 KiB reserved per block: 16384 // 1024 = 16 blocks = 16 warps = 25%.
    pytest.param("a100", 32, 16, 0, 16 * K, 16, 16, 0.25, "shared_memory", (64, 128, 16, 32),
                 16 * K, id="a100-explicit-16k"),
    # H100 32 KiB: 32 blocks on both the shared rule and the block cap; shared named first.
    pytest.param("h100", 32, 16, 0, 32 * K, 32, 32, 0.5, "shared_memory", (64, 128, 32, 32),
                 32 * K, id="h100-explicit-32k-tie"),
    # H100 48 KiB smem at an explicit 228 KiB (larger than the 196 KiB it needs): used as given.
    pytest.param("h100", 128, 32, 48 * K, 228 * K, 4, 16, 0.25, "shared_memory",
                 (16, 16, 4, 32), 228 * K, id="h100-explicit-228k"),
    # V100 with no shared memory at carve-out 0: nothing to hold -> 32 blocks.
    pytest.param("v100", 32, 16, 0, 0, 32, 32, 0.5, "blocks", (64, 128, 32, 32), 0,
                 id="v100-explicit-0"),
    # V100 10900 B (11008 allocated) at 64 KiB: 65536 // 11008 = 5 blocks = 20 warps = 31.25%.
    pytest.param("v100", 128, 32, 10900, 64 * K, 5, 20, 0.3125, "shared_memory",
                 (16, 16, 5, 32), 64 * K, id="v100-explicit-64k"),
]


@pytest.mark.parametrize(
    "gpu, threads, regs, smem, carveout, blocks, warps, occ, limiter, limits, used", CASES)
def test_hand_computed_cases(gpu, threads, regs, smem, carveout, blocks, warps, occ, limiter,
                             limits, used):
    got = occupancy(get_spec(gpu), threads, regs, smem, carveout)
    assert got == Occupancy(
        threads_per_block=threads, registers_per_thread=regs, shared_bytes_per_block=smem,
        blocks_per_sm=blocks, warps_per_sm=warps, occupancy=occ, limiter=limiter,
        limits=dict(zip(("warps", "registers", "shared_memory", "blocks"), limits)),
        carveout_bytes=used, reason="")


# (gpu, threads, regs, smem, carveout arg, the rule forced to 0, text the reason must contain)
CANNOT_LAUNCH = [
    # 255 regs -> 8192/warp; 1024 threads = 32 warps -> 262144 > 65536 registers per block.
    pytest.param("v100", 1024, 255, 0, None, "registers", "262144", id="v100-regs-per-block"),
    pytest.param("a100", 1024, 255, 0, None, "registers", "262144", id="a100-regs-per-block"),
    pytest.param("h100", 1024, 255, 0, None, "registers", "262144", id="h100-regs-per-block"),
    # 256 registers per thread is over the 255 limit even for one warp.
    pytest.param("a100", 32, 256, 0, None, "registers", "registers_per_thread 256",
                 id="a100-regs-over-255"),
    # 192 regs -> 6144/warp; 320 threads = 10 warps = 61440 <= 65536 per block, but 65536 //
    # 6144 = 10 warps -> 8 (multiple of 4) < 10 -> no block fits.
    pytest.param("h100", 320, 192, 0, None, "registers", "8 warps", id="h100-regs-granularity"),
    # Shared memory one byte over the opt-in limit (V100 96 KiB, A100 163 KiB, H100 227 KiB).
    pytest.param("v100", 128, 32, 98305, None, "shared_memory", "98305", id="v100-smem-optin"),
    pytest.param("a100", 128, 32, 166913, None, "shared_memory", "166913", id="a100-smem-optin"),
    pytest.param("h100", 128, 32, 232449, None, "shared_memory", "232449", id="h100-smem-optin"),
    # Explicit 0 carve-out on A100: even 0 bytes takes the 1 KiB reserved -> 0 // 1024 = 0.
    pytest.param("a100", 32, 16, 0, 0, "shared_memory", "carve-out 0", id="a100-carveout-0"),
    # Explicit 32 KiB on V100 for 48 KiB of shared memory: 32768 // 49152 = 0.
    pytest.param("v100", 128, 32, 48 * K, 32 * K, "shared_memory", "49152",
                 id="v100-carveout-too-small"),
    # 1025 threads is over the 1024-thread block limit.
    pytest.param("h100", 1025, 16, 0, None, "warps", "threads_per_block 1025",
                 id="h100-threads-over-1024"),
]


@pytest.mark.parametrize("gpu, threads, regs, smem, carveout, rule, text", CANNOT_LAUNCH)
def test_cannot_launch(gpu, threads, regs, smem, carveout, rule, text):
    got = occupancy(get_spec(gpu), threads, regs, smem, carveout)
    assert (got.blocks_per_sm, got.warps_per_sm, got.occupancy, got.limiter) == (0, 0, 0.0,
                                                                                 "launch")
    assert got.limits[rule] == 0
    assert text in got.reason


def test_every_failure_is_reported():
    # 2048 threads (over 1024) with 255 regs (64 warps x 8192 > 65536) on V100.
    got = occupancy(get_spec("v100"), 2048, 255, 100_000)
    assert got.limits == {"warps": 0, "registers": 0, "shared_memory": 0, "blocks": 32}
    assert "threads_per_block 2048" in got.reason
    assert "524288" in got.reason              # 64 warps x 8192 registers
    assert "100000" in got.reason              # over the 98304 opt-in limit


@pytest.mark.parametrize("kwargs, text", [
    (dict(threads_per_block=0, registers_per_thread=32), "threads_per_block"),
    (dict(threads_per_block=-32, registers_per_thread=32), "threads_per_block"),
    (dict(threads_per_block=128, registers_per_thread=0), "registers_per_thread"),
    (dict(threads_per_block=128, registers_per_thread=32, shared_bytes_per_block=-1),
     "shared_bytes_per_block"),
    # 12345 bytes is no carve-out; 96 KiB is a V100 carve-out but not an A100 one.
    (dict(threads_per_block=128, registers_per_thread=32, carveout_bytes=12345), "12345"),
    (dict(threads_per_block=128, registers_per_thread=32, carveout_bytes=96 * K), "98304"),
])
def test_invalid_arguments_raise(kwargs, text):
    with pytest.raises(ValueError, match=text):
        occupancy(get_spec("a100"), **kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(threads_per_block=128.0, registers_per_thread=32),
    dict(threads_per_block=True, registers_per_thread=32),
    dict(threads_per_block=128, registers_per_thread="32"),
])
def test_non_integer_arguments_raise(kwargs):
    with pytest.raises(TypeError):
        occupancy(get_spec("a100"), **kwargs)


@pytest.mark.parametrize("gpu, unit", [("v100", 256), ("a100", 128), ("h100", 128),
                                       ("h200", 128)])
def test_allocation_units(gpu, unit):
    spec = get_spec(gpu)
    assert spec.shared_memory_allocation_unit == unit
    assert spec.warp_allocation_granularity == 4


def test_best_block_size_prefers_the_smaller_block_on_ties():
    # V100, 32 regs, no smem: blocks = min(64 // W, 32). W = 1 -> 32 warps; W = 2 -> 32 blocks
    # x 2 = 64 warps (100%), which 128, 256, ... also reach: 64 threads wins.
    got = best_block_size(get_spec("v100"), 32)
    assert (got.threads_per_block, got.blocks_per_sm, got.warps_per_sm) == (64, 32, 64)
    # 128 regs: 4096/warp -> 16 warps -> blocks = 16 // W, warps = (16 // W) x W <= 16; W = 1
    # already gives 16 blocks x 1 = 16 warps, so 32 threads wins.
    got = best_block_size(get_spec("v100"), 128)
    assert (got.threads_per_block, got.blocks_per_sm, got.warps_per_sm) == (32, 16, 16)


def test_best_block_size_with_shared_memory_per_block_size():
    # A100, 32 regs, 256 B per thread: a block of t threads takes 256 t + 1024 bytes (already a
    # multiple of 128), 167936 // that blocks. t = 32: 9216 -> 18 x 1 = 18 warps; 64: 17408 ->
    # 9 x 2 = 18; 96: 25600 -> 6 x 3 = 18; 128: 33792 -> 4 x 4 = 16; 160: 41984 -> exactly 4 x 5
    # = 20; 192: 50176 -> 3 x 6 = 18; 320: 82944 -> 2 x 10 = 20; 640: 164864 -> 1 x 20 = 20;
    # 672: 172032 B > 166912 opt-in. Nothing beats 20 warps; 160 is the smallest reaching it.
    got = best_block_size(get_spec("a100"), 32, lambda t: 256 * t)
    assert (got.threads_per_block, got.blocks_per_sm, got.warps_per_sm) == (160, 4, 20)
    assert got.shared_bytes_per_block == 160 * 256
    assert got.limiter == "shared_memory"
    # A fixed 48 KiB per block allows 3 blocks (see a100-smem-48k); warps and registers allow
    # 64 // W. W <= 21: 3 blocks, at most 3 x 21 = 63 warps; W = 22..31: 2 blocks, at most 62;
    # W = 32 (1024 threads): 2 blocks x 32 = 64 warps, the only way to 100%.
    got = best_block_size(get_spec("a100"), 32, 48 * K)
    assert (got.threads_per_block, got.blocks_per_sm, got.warps_per_sm) == (1024, 2, 64)


def test_best_block_size_edge_cases():
    # Nothing launches with 256 registers per thread: the smallest candidate's failure comes back.
    got = best_block_size(get_spec("v100"), 256, candidates=(256, 128))
    assert (got.threads_per_block, got.blocks_per_sm, got.limiter) == (128, 0, "launch")
    with pytest.raises(ValueError, match="empty"):
        best_block_size(get_spec("v100"), 32, candidates=())
