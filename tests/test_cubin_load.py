"""On a device, the GPU pass loads ptxas's cubins: each kernel is
assembled in the build threads, in parallel and through the compile cache, instead of the
driver JIT-compiling every PTX in turn on the pass's thread. The PTX is the fallback where
the driver refuses a cubin (a ptxas newer than the driver), and where no ptxas is found.

No GPU here: the driver is replaced by fakes that record what they were asked to load;
tests/gpu/test_ffi_cuda.py loads real cubins and PTX on a device."""
from __future__ import annotations

import ctypes

import pytest

from stitch.codegen import ffi_cuda, nvptx
from stitch.codegen.errors import CodegenError, ImageRefused, ToolchainError
from stitch.codegen.gpu_cache import CANONICAL_NAME, CubinBuild
from stitch.xla_pass import kernel_builds, entry as xla_pass
from tests.test_kir_host import elementwise_kernel

CUBIN = b"\x7fELF fake cubin"
PTX = "// fake PTX\n.entry k(\n"


@pytest.fixture(autouse=True)
def _fresh_refusal(monkeypatch):
    monkeypatch.setattr(ffi_cuda, "_CUBINS_REFUSED", False)


def _recording_loader(monkeypatch, refuse: type[Exception] | None):
    loads = []

    def load(image, entry, ordinals, *, co_resident=None):
        loads.append((image, entry))
        if refuse is not None and isinstance(image, bytes) and image.startswith(b"\x7fELF"):
            raise refuse("cuModuleLoadData(device 0) failed: CUDA_ERROR_UNSUPPORTED_PTX_VERSION")
        return [f"function of {entry}"]
    monkeypatch.setattr(ffi_cuda, "load_cuda_functions", load)
    return loads


def test_a_cubin_the_driver_takes_is_loaded_alone(monkeypatch):
    loads = _recording_loader(monkeypatch, None)
    got = ffi_cuda.load_image("main_k3", CUBIN, CANONICAL_NAME, [0], fallback_ptx=PTX)
    assert got == [f"function of {CANONICAL_NAME}"] and loads == [(CUBIN, CANONICAL_NAME)]
    assert not ffi_cuda.cubins_refused()


def test_a_refused_cubin_falls_back_to_the_ptx_and_is_remembered(monkeypatch, caplog):
    loads = _recording_loader(monkeypatch, ImageRefused)
    got = ffi_cuda.load_image("main_k3", CUBIN, CANONICAL_NAME, [0], fallback_ptx=PTX)
    assert loads == [(CUBIN, CANONICAL_NAME), (PTX, "main_k3")]
    assert got == ["function of main_k3"]
    assert ffi_cuda.cubins_refused()
    assert "main_k3" in caplog.text and "UNSUPPORTED_PTX_VERSION" in caplog.text
    assert not xla_pass.cubins_for_device("sm_90")      # later modules: no cubins built
    caplog.clear()
    got = ffi_cuda.load_image("main_k4", CUBIN, CANONICAL_NAME, [0], fallback_ptx=PTX)
    assert loads[2:] == [(PTX, "main_k4")] and got == ["function of main_k4"]
    assert not caplog.text                              # this module's later ones: PTX at once


def test_without_a_fallback_or_for_other_errors_the_error_stands(monkeypatch):
    _recording_loader(monkeypatch, ImageRefused)
    with pytest.raises(ImageRefused):
        ffi_cuda.load_image("main_k3", CUBIN, CANONICAL_NAME, [0])
    monkeypatch.setattr(ffi_cuda, "_CUBINS_REFUSED", False)
    loads = _recording_loader(monkeypatch, CodegenError)     # e.g. the grid is too large
    with pytest.raises(CodegenError, match="UNSUPPORTED"):
        ffi_cuda.load_image("main_k3", CUBIN, CANONICAL_NAME, [0], fallback_ptx=PTX)
    assert loads == [(CUBIN, CANONICAL_NAME)] and not ffi_cuda.cubins_refused()


class _FakeLib:
    """libcuda as far as ``_Driver.load`` calls it: cuModuleLoadData fails with ``code``."""

    def __init__(self, code: int) -> None:
        self.code = code

    def cuModuleLoadData(self, module, image):
        return self.code

    def cuGetErrorName(self, result, name):
        name._obj.value = b"CUDA_ERROR_NO_BINARY_FOR_GPU"
        return 0

    def __getattr__(self, fname):
        return lambda *args: 0


def test_the_driver_reports_a_refused_image_as_image_refused():
    driver = ffi_cuda._Driver.__new__(ffi_cuda._Driver)
    driver.lib = _FakeLib(209)
    with pytest.raises(ImageRefused, match="NO_BINARY_FOR_GPU"):
        driver.load(CUBIN, "k", 0)
    assert issubclass(ImageRefused, CodegenError)


def _kernel():
    return elementwise_kernel("main_k7", ["f32", "f32"], "f32", 1000,
                              lambda x, y: ffi_cuda.kir.Binary("add", x, y))


def _device_request() -> xla_pass.PassRequest:
    return xla_pass.PassRequest("f", "h100", "gpu", arch="sm_90")        # not compile-only


def _ptxas_or_skip() -> None:
    from stitch.codegen.toolchain import find_ptxas
    if nvptx.default_libdevice_path() is None:
        pytest.skip("no libdevice")
    try:
        find_ptxas("sm_90")
    except ToolchainError as exc:
        pytest.skip(f"no ptxas for sm_90: {exc}")


def _prebuilt(request, monkeypatch, tmp_path):
    monkeypatch.setenv("STITCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernel_builds, "_CACHE", None)
    from stitch.codegen.isolation import IsolatedWorker
    kernel = _kernel()
    worker = IsolatedWorker(name="cubin-test")
    try:
        with xla_pass.GpuPrebuild(request, [worker]) as prebuild:
            prebuild.submit(kernel)
            (built,) = list(prebuild.each_result())
    finally:
        worker.close()
    assert not isinstance(built, Exception), built
    return kernel, built


def test_on_a_device_the_build_threads_assemble_the_cubin(monkeypatch, tmp_path):
    _ptxas_or_skip()
    kernel, built = _prebuilt(_device_request(), monkeypatch, tmp_path)
    assert f".entry {kernel.name}(" in built.ptx
    assert built.assembled is not None and built.assembled.cubin[:4] == b"\x7fELF"
    assert built.assembled.entry == CANONICAL_NAME           # the canonical build's entry
    assert list(built.assembled.reports) == [kernel.name]


def test_without_ptxas_or_after_a_refusal_only_ptx_is_built(monkeypatch, tmp_path):
    _ptxas_or_skip()

    def no_ptxas(arch=None, **kw):
        raise ToolchainError("ptxas not found (test)")
    monkeypatch.setattr("stitch.codegen.toolchain.find_ptxas", no_ptxas)
    _, built = _prebuilt(_device_request(), monkeypatch, tmp_path / "a")
    assert built.assembled is None and built.ptx
    monkeypatch.undo()
    monkeypatch.setattr(ffi_cuda, "_CUBINS_REFUSED", True)
    _, built = _prebuilt(_device_request(), monkeypatch, tmp_path / "b")
    assert built.assembled is None and built.ptx


def test_the_device_target_loads_the_cubin_with_the_ptx_behind_it(monkeypatch):
    asked = []

    class Target:
        def register(self):
            asked.append("registered")

    def cuda_target(kernel, image, **kw):
        asked.append((kernel.name, image, kw))
        return Target()
    monkeypatch.setattr(ffi_cuda, "cuda_ffi_target", cuda_target)
    kernel = _kernel()
    assembled = CubinBuild(CUBIN, {}, False, entry=CANONICAL_NAME)
    xla_pass.build_target(kernel, "gpu", arch="sm_90", ptx=PTX, assembled=assembled)
    # A kernel without a grid barrier joins XLA's command buffers (STITCH_COMMAND_BUFFERS).
    assert asked == [(kernel.name, CUBIN, {"entry": CANONICAL_NAME, "fallback_ptx": PTX,
                                           "command_buffer_compatible": True}),
                     "registered"]
    asked.clear()
    xla_pass.build_target(kernel, "gpu", arch="sm_90", ptx=PTX)
    assert asked == [(kernel.name, PTX, {"command_buffer_compatible": True}), "registered"]
    asked.clear()
    monkeypatch.setenv("STITCH_COMMAND_BUFFERS", "0")
    xla_pass.build_target(kernel, "gpu", arch="sm_90", ptx=PTX)
    assert asked == [(kernel.name, PTX, {"command_buffer_compatible": False}), "registered"]
