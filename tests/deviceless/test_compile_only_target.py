"""The compile-only CUDA FFI target of the deviceless check, without jax's CUDA plugin: its
handler (host code) is called on a fake XLA call frame, and its PTX goes through ptxas.
Runs in the main suite (no GPU, no plugin)."""
from __future__ import annotations

import pytest

from stitch.codegen import ffi, ffi_cuda
from stitch.codegen.errors import CodegenError, ToolchainError
from stitch.codegen.ffi_cuda import (ERR_FAILED_PRECONDITION, CompileOnlyCudaTarget,
                                     compile_only_cuda_target, emit_compile_only_handler_ir)
from stitch.codegen.nvptx import emit_ptx
from stitch.codegen.objcheck import cubin_problem
from stitch.codegen.toolchain import find_ptxas
from tests.test_ffi import ERROR_SENTINEL, FakeXla, ew_kernel, probe


def _handler(name="stitch_cudacheck_test"):
    ir_text = emit_compile_only_handler_ir(name, "sm_90")
    engine, address = ffi.compile_handler(name, None, [ir_text], build_fast=True)
    return engine, address


def test_handler_answers_xlas_metadata_probe():
    """What XLA does with a handler while compiling: it must succeed."""
    engine, address = _handler()
    xla = FakeXla()
    result, meta = probe(xla, address)
    assert result is None and not xla.errors
    assert (meta.api_version.major_version, meta.api_version.minor_version) == \
        (ffi.API_MAJOR, ffi.API_MINOR)
    assert meta.traits == 0      # not command-buffer compatible: XLA never captures it
    del engine


def test_handler_refuses_to_run_and_says_why():
    import numpy as np
    engine, address = _handler()
    xla = FakeXla()
    a = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    out = np.full(1000, np.nan, np.float32)
    assert xla.call(address, [a, a.copy()], [out]) == ERROR_SENTINEL
    (text, code, _), = xla.errors
    assert text.startswith("stitch compile-only CUDA target: built for sm_90 without a "
                           "device"), text
    assert "must never run" in text
    assert code == ERR_FAILED_PRECONDITION
    assert np.isnan(out).all()                   # nothing was written
    del engine


def test_target_assembles_the_ptx_for_the_arch():
    try:
        find_ptxas("sm_90")
    except ToolchainError as exc:
        pytest.skip(f"no ptxas for sm_90: {exc}")
    kernel = ew_kernel("assembled")
    ptx = emit_ptx(kernel, "sm_90")
    target = compile_only_cuda_target(kernel, ptx, "sm_90")
    assert isinstance(target, CompileOnlyCudaTarget) and target.platform == "CUDA"
    assert target.arch == "sm_90" and target.name.startswith("stitch_cudacheck_assembled_")
    assert cubin_problem(target.cubin) is None
    assert target.ptxas["assembled"].arch == "sm_90"
    # Same content, same target (XLA's registry is process-wide).
    assert compile_only_cuda_target(kernel, ptx, "sm_90") is target
    xla = FakeXla()
    assert xla.call(target.address, [], []) == ERROR_SENTINEL


def test_targets_share_one_handler_per_arch(monkeypatch):
    """A second kernel's target is its own (name, PTX, cubin) but builds no handler: the
    compile-only handler never runs a kernel, so every target for the arch shares it."""
    try:
        find_ptxas("sm_90")
    except ToolchainError as exc:
        pytest.skip(f"no ptxas for sm_90: {exc}")
    first_kernel, second_kernel = ew_kernel("shared_first"), ew_kernel("shared_second")
    first = compile_only_cuda_target(first_kernel, emit_ptx(first_kernel, "sm_90"), "sm_90")
    builds = []
    real = ffi_cuda.compile_handler
    monkeypatch.setattr(ffi_cuda, "compile_handler",
                        lambda *a, **k: builds.append(a[0]) or real(*a, **k))
    ptx = emit_ptx(second_kernel, "sm_90")
    second = compile_only_cuda_target(second_kernel, ptx, "sm_90")
    assert builds == []
    assert second is not first and second.name != first.name
    assert second.name.startswith("stitch_cudacheck_shared_second_")
    assert second.address == first.address and second.ptx == ptx
    assert second.ptxas["shared_second"].arch == "sm_90"
    xla = FakeXla()
    result, _ = probe(xla, second.address)
    assert result is None and not xla.errors


def test_ptx_that_ptxas_rejects_is_a_codegen_error():
    try:
        find_ptxas("sm_90")
    except ToolchainError as exc:
        pytest.skip(f"no ptxas for sm_90: {exc}")
    kernel = ew_kernel("broken")
    ptx = emit_ptx(kernel, "sm_90").replace("ret;", "ret_not_an_instruction;", 1)
    with pytest.raises(CodegenError):
        compile_only_cuda_target(kernel, ptx, "sm_90")

