"""The few CUDA driver calls the GPU kit's timing and sanitizer steps need, through ctypes on
libcuda (no cupy, no cuda-bindings, none of stitch's modules): device facts, memory, module
loading, launches (plain and cooperative), events and stream-captured graphs.

Only plain Python and numpy: ``bench.opt_levels time`` runs this on the GPU machine.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

LIBCUDA = "libcuda.so.1"
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE = 36        # kHz
CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH = 37  # bits
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_STREAM_NON_BLOCKING = 1
CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1


class CudaError(RuntimeError):
    """A driver call that did not return CUDA_SUCCESS (its name and the driver's message)."""


@dataclass(frozen=True)
class DeviceFacts:
    name: str
    compute_capability: tuple[int, int]
    sms: int
    memory_bytes: int
    driver_version: int          # e.g. 13000 for CUDA 13.0
    peak_hbm_gbs: float          # 2 × memory clock × bus width (DDR), GB/s
    smem_optin_bytes: int


def available() -> bool:
    """libcuda loads and reports at least one device."""
    try:
        return Driver().device_count() > 0
    except (OSError, CudaError):
        return False


class Driver:
    """libcuda through ctypes; one primary context on ``ordinal``."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(LIBCUDA)
        self._check("cuInit", self.lib.cuInit(0))
        self.context = None

    # --- plumbing --------------------------------------------------------------------
    def _check(self, name: str, status: int) -> None:
        if status != 0:
            message = ctypes.c_char_p()
            self.lib.cuGetErrorString(status, ctypes.byref(message))
            text = message.value.decode() if message.value else "unknown error"
            raise CudaError(f"{name} failed ({status}): {text}")

    def call(self, name: str, *args) -> None:
        self._check(name, getattr(self.lib, name)(*args))

    # --- device ----------------------------------------------------------------------
    def device_count(self) -> int:
        count = ctypes.c_int()
        self.call("cuDeviceGetCount", ctypes.byref(count))
        return count.value

    def attribute(self, attribute: int, ordinal: int = 0) -> int:
        value = ctypes.c_int()
        self.call("cuDeviceGetAttribute", ctypes.byref(value), attribute, self._device(ordinal))
        return value.value

    def _device(self, ordinal: int) -> ctypes.c_int:
        device = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(device), ordinal)
        return device

    def facts(self, ordinal: int = 0) -> DeviceFacts:
        device = self._device(ordinal)
        name = ctypes.create_string_buffer(256)
        self.call("cuDeviceGetName", name, 256, device)
        memory = ctypes.c_size_t()
        self.call("cuDeviceTotalMem_v2", ctypes.byref(memory), device)
        version = ctypes.c_int()
        self.call("cuDriverGetVersion", ctypes.byref(version))
        clock_khz = self.attribute(CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE, ordinal)
        bus_bits = self.attribute(CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH, ordinal)
        return DeviceFacts(
            name=name.value.decode(),
            compute_capability=(self.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                                               ordinal),
                                self.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                                               ordinal)),
            sms=self.attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, ordinal),
            memory_bytes=memory.value, driver_version=version.value,
            peak_hbm_gbs=2.0 * clock_khz * 1e3 * bus_bits / 8 / 1e9,
            smem_optin_bytes=self.attribute(
                CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, ordinal))

    def use(self, ordinal: int = 0) -> None:
        """Make the device's primary context current (what jax and the FFI handler use)."""
        context = ctypes.c_void_p()
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(context), self._device(ordinal))
        self.call("cuCtxSetCurrent", context)
        self.context = context

    # --- memory ----------------------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        pointer = ctypes.c_uint64()
        self.call("cuMemAlloc_v2", ctypes.byref(pointer), ctypes.c_size_t(max(nbytes, 1)))
        return pointer.value

    def free(self, pointer: int) -> None:
        self.call("cuMemFree_v2", ctypes.c_uint64(pointer))

    def to_device(self, pointer: int, host) -> None:
        self.call("cuMemcpyHtoD_v2", ctypes.c_uint64(pointer),
                  host.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(host.nbytes))

    def to_host(self, pointer: int, host) -> None:
        self.call("cuMemcpyDtoH_v2", host.ctypes.data_as(ctypes.c_void_p),
                  ctypes.c_uint64(pointer), ctypes.c_size_t(host.nbytes))

    def fill(self, pointer: int, byte: int, nbytes: int) -> None:
        self.call("cuMemsetD8_v2", ctypes.c_uint64(pointer), ctypes.c_ubyte(byte),
                  ctypes.c_size_t(nbytes))

    def synchronize(self) -> None:
        self.call("cuCtxSynchronize")

    # --- modules and launches ----------------------------------------------------------
    def load(self, image: bytes, entry: str, dynamic_shared_bytes: int = 0) -> ctypes.c_void_p:
        """The CUfunction ``entry`` of a cubin or PTX image (opted in to its dynamic shared
        memory where that is over the default 48 KB)."""
        module = ctypes.c_void_p()
        # A bytes object is NUL-terminated in memory: PTX text loads as it is.
        self.call("cuModuleLoadData", ctypes.byref(module), ctypes.c_char_p(image))
        function = ctypes.c_void_p()
        self.call("cuModuleGetFunction", ctypes.byref(function), module, entry.encode())
        if dynamic_shared_bytes > 48 * 1024:
            self.call("cuFuncSetAttribute", function,
                      CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dynamic_shared_bytes)
        return function

    def launch(self, function: ctypes.c_void_p, grid: int, block: int, pointers: list[int],
               stream: ctypes.c_void_p | None = None, *, cooperative: bool = False,
               dynamic_shared_bytes: int = 0) -> None:
        values = [ctypes.c_uint64(p) for p in pointers]
        params = (ctypes.c_void_p * len(values))(
            *[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
        if cooperative:
            self.call("cuLaunchCooperativeKernel", function, grid, 1, 1, block, 1, 1,
                      dynamic_shared_bytes, stream, params)
        else:
            self.call("cuLaunchKernel", function, grid, 1, 1, block, 1, 1,
                      dynamic_shared_bytes, stream, params, None)

    # --- streams, events, graphs ---------------------------------------------------------
    def stream(self) -> ctypes.c_void_p:
        stream = ctypes.c_void_p()
        self.call("cuStreamCreate", ctypes.byref(stream), CU_STREAM_NON_BLOCKING)
        return stream

    def event(self) -> ctypes.c_void_p:
        event = ctypes.c_void_p()
        self.call("cuEventCreate", ctypes.byref(event), 0)
        return event

    def record(self, event: ctypes.c_void_p, stream: ctypes.c_void_p | None) -> None:
        self.call("cuEventRecord", event, stream)

    def elapsed_ms(self, start: ctypes.c_void_p, end: ctypes.c_void_p) -> float:
        self.call("cuEventSynchronize", end)
        ms = ctypes.c_float()
        self.call("cuEventElapsedTime", ctypes.byref(ms), start, end)
        return ms.value

    def capture(self, stream: ctypes.c_void_p, body) -> ctypes.c_void_p:
        """An instantiated graph of what ``body()`` launches on ``stream``."""
        self.call("cuStreamBeginCapture_v2", stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        try:
            body()
        finally:
            graph = ctypes.c_void_p()
            self.call("cuStreamEndCapture", stream, ctypes.byref(graph))
        executable = ctypes.c_void_p()
        self.call("cuGraphInstantiateWithFlags", ctypes.byref(executable), graph,
                  ctypes.c_ulonglong(0))
        return executable

    def graph_launch(self, executable: ctypes.c_void_p, stream: ctypes.c_void_p) -> None:
        self.call("cuGraphLaunch", executable, stream)
