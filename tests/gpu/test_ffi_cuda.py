"""The CUDA FFI handler (stitch.codegen.ffi_cuda) on a real GPU through jax.jit.

Skipped unless jax sees a CUDA device. Kernels are emitted by stitch.codegen.nvptx and loaded as a
cubin when a ptxas for the device's arch is found, else as PTX (the driver JIT-compiles it).
Results are compared with the host program (compile_host) and numpy.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from stitch.codegen import ffi_cuda
from stitch.codegen.errors import CodegenError, ToolchainError
from stitch.codegen.host import NUMPY_DTYPES
from stitch.codegen.kir import Kernel, f32
from stitch.codegen.nvptx import ARCHS, default_libdevice_path, emit_ptx
from tests.test_ffi import empty_kernel, half_kernel, host_reference, warp_row_sum_kernel
from tests.test_kir_host import (add, elementwise_kernel, mul, softmax_ref, tiled_sum_kernel,
                                 warp_softmax_kernel)

LOG = logging.getLogger(__name__)
RNG = np.random.default_rng

jax = pytest.importorskip("jax")


def _arch(device) -> str:
    """The newest NVPTX arch we emit that the device runs (PTX is forward-compatible)."""
    major, minor = (int(v) for v in str(getattr(device, "compute_capability", "8.0")).split("."))
    fits = [a for a in ARCHS if int(a[3:]) <= major * 10 + minor]
    return fits[-1] if fits else ARCHS[0]


def _image(kernel: Kernel, device, *, cubin: bool = True) -> bytes:
    arch = _arch(device)
    try:
        ptx = emit_ptx(kernel, arch)
    except ToolchainError as exc:
        pytest.skip(f"cannot emit PTX: {exc}")
    if cubin:
        from stitch.codegen.toolchain import assemble_cubin
        try:
            return assemble_cubin(ptx, arch, kernel_name=kernel.name)[0]
        except ToolchainError as exc:
            LOG.info("no cubin for %s (%s); loading PTX", arch, exc)
    return ptx.encode()


def _target(kernel: Kernel, device, **kw):
    return ffi_cuda.cuda_ffi_target(kernel, _image(kernel, device, **kw))


def test_elementwise(gpu) -> None:
    k = elementwise_kernel("gpu_ew", ["f32", "f32"], "f32", 100_000,
                           lambda x, y: add(mul(x, y), f32(0.5)), grid_stride=True)
    for cubin in (True, False):
        t = _target(k, gpu, cubin=cubin)
        fn = jax.jit(lambda a, b: t.call(a, b)[0])
        a, b = RNG(1).standard_normal((2, 100_000)).astype(np.float32)
        out = np.asarray(fn(a, b))
        np.testing.assert_array_equal(out, host_reference(k, a, b)[0])


def test_shared_memory_barriers_and_two_outputs(gpu) -> None:
    rows, length = 6, 5000
    k = tiled_sum_kernel(rows, length)
    t = _target(k, gpu)
    x = RNG(2).standard_normal((rows, length)).astype(np.float32)
    partials, sums = jax.jit(lambda v: t.call(v))(x)
    ref_partials, ref_sums = host_reference(k, x)
    np.testing.assert_allclose(np.asarray(partials), ref_partials, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(sums), ref_sums, rtol=1e-5, atol=1e-4)


def test_warp_reduce_and_half_dtypes(gpu) -> None:
    k = warp_row_sum_kernel(37, 300)
    x = RNG(3).standard_normal((37, 300)).astype(np.float32)
    (sums,) = jax.jit(lambda v: _target(k, gpu).call(v))(x)
    np.testing.assert_array_equal(np.asarray(sums), host_reference(k, x)[0])
    k = half_kernel()
    a = RNG(4).standard_normal(777).astype(NUMPY_DTYPES["bf16"])
    b = RNG(5).standard_normal(777).astype(np.float32)
    o16, obf = jax.jit(lambda p, q: _target(k, gpu).call(p, q))(a, b)
    r16, rbf = host_reference(k, a, b)
    np.testing.assert_array_equal(np.asarray(o16), r16)
    np.testing.assert_array_equal(np.asarray(obf).astype(np.float32), rbf.astype(np.float32))


@pytest.mark.skipif(default_libdevice_path() is None, reason="no libdevice.10.bc")
def test_softmax_with_libdevice(gpu) -> None:
    rows, length = 50, 333
    k = warp_softmax_kernel(rows, length, "reduce")
    x = (RNG(6).standard_normal((rows, length)) * 3).astype(np.float32)
    (out,) = jax.jit(lambda v: _target(k, gpu).call(v, out_shapes=[(rows, length)]))(x)
    np.testing.assert_allclose(np.asarray(out), softmax_ref(x), rtol=1e-5, atol=1e-7)


def test_the_pass_cubin_of_a_canonical_copy_runs_under_the_kernels_name(gpu) -> None:
    """The GPU pass's load (stitch.xla_pass.entry.build_target): ptxas's cubin of the
    kernel's canonical copy (entry CANONICAL_NAME), the kernel's own PTX behind it."""
    from stitch.codegen.gpu_cache import CANONICAL_NAME, canonical_kernel
    from stitch.codegen.toolchain import assemble_cubin
    k = elementwise_kernel("gpu_canonical", ["f32", "f32"], "f32", 30_000,
                           lambda x, y: add(mul(x, y), f32(0.25)), grid_stride=True)
    arch = _arch(gpu)
    try:
        ptx = emit_ptx(k, arch)
        cubin = assemble_cubin(emit_ptx(canonical_kernel(k), arch), arch,
                               kernel_name=CANONICAL_NAME)[0]
    except ToolchainError as exc:
        pytest.skip(f"no cubin for {arch}: {exc}")
    t = ffi_cuda.cuda_ffi_target(k, cubin, entry=CANONICAL_NAME, fallback_ptx=ptx)
    assert not ffi_cuda.cubins_refused(), "the driver refused ptxas's cubin: PTX was loaded"
    a, b = RNG(9).standard_normal((2, 30_000)).astype(np.float32)
    out = np.asarray(jax.jit(lambda x, y: t.call(x, y)[0])(a, b))
    np.testing.assert_array_equal(out, host_reference(k, a, b)[0])


def test_errors_name_the_kernel(gpu) -> None:
    k = elementwise_kernel("gpu_err", ["f32", "f32"], "f32", 1000, lambda x, y: add(x, y))
    t = _target(k, gpu)
    t.register()
    raw = jax.ffi.ffi_call(t.name, jax.ShapeDtypeStruct((1000,), np.float32))
    with pytest.raises(Exception, match="kernel 'gpu_err': custom call has 1 operands"):
        jax.block_until_ready(jax.jit(raw)(np.ones(1000, np.float32)))
    with pytest.raises(CodegenError, match="1 arguments for 2 inputs"):
        t.call(np.ones(1000, np.float32))


def test_per_call_overhead(gpu) -> None:
    """Reported, not asserted: time per custom call (one-warp kernel) in a jitted chain."""
    t = _target(empty_kernel(), gpu)
    chain = 200

    @jax.jit
    def many(x):
        for _ in range(chain):
            (x,) = t.call(x)
        return x
    x = jax.device_put(np.arange(32, dtype=np.float32), gpu)
    jax.block_until_ready(many(x))
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(20):
            y = many(x)
        jax.block_until_ready(y)
        best = min(best, (time.perf_counter() - start) / 20)
    np.testing.assert_array_equal(np.asarray(y), np.arange(32, dtype=np.float32))
    LOG.warning("CUDA FFI: %.2f us per custom call in a chain of %d inside one jit",
                best / chain * 1e6, chain)


@pytest.mark.skipif(default_libdevice_path() is None, reason="no libdevice.10.bc")
@pytest.mark.parametrize("grid_sync", ["barrier", "relaunch"])
def test_grid_barrier_kernel_runs(gpu, grid_sync) -> None:
    """x / sum(x) in one kernel with a grid barrier between its phases — one cooperative
    launch, or a launch per phase — twice in a row (the phase/barrier counters must come
    back to their start state), against the host program."""
    import dataclasses

    from tests.test_global_scope import normalize_kernel
    sms = int(getattr(gpu, "core_count", 0) or 0) or 8
    k = dataclasses.replace(normalize_kernel(50_000, sms, 128), grid_sync=grid_sync)
    t = _target(k, gpu)
    fn = jax.jit(lambda v: t.call(v)[0])
    for seed in (7, 8):
        x = (RNG(seed).random(50_000) + 0.5).astype(np.float32)
        out = np.asarray(fn(x))
        np.testing.assert_allclose(out, host_reference(k, x)[0], rtol=1e-5)
        np.testing.assert_allclose(out, x / x.astype(np.float64).sum(), rtol=1e-4)


def test_grid_barrier_kernel_with_a_grid_too_large_is_refused_at_load(gpu) -> None:
    from tests.test_global_scope import normalize_kernel
    k = normalize_kernel(1 << 20, 1 << 16, 1024)   # far more blocks than can be resident
    with pytest.raises(CodegenError, match="can be resident"):
        _target(k, gpu)
