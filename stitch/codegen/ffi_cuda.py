"""Kernel IR kernels as XLA FFI custom calls on CUDA (platform "CUDA").

`cuda_ffi_target(kernel, image)` loads the kernel's cubin (or PTX) with the CUDA driver from
Python, once per device, and builds a host-side handler in LLVM IR (MCJIT) that, per call:
answers XLA's metadata probe; decodes the call frame exactly like the CPU handler (counts,
dtypes, element counts; errors name the kernel); fetches the CUDA stream of the call through
the FFI API's XLA_FFI_Stream_Get; picks the device's CUfunction (XLA_FFI_DeviceOrdinal_Get
when more than one device is loaded); makes the module's context current if it is not; and
calls cuLaunchKernel(grid, block, dynamic shared bytes, stream) from native code — once per
phase for a grid-barrier kernel in "relaunch" mode (kir.launches), or, for one in "barrier"
mode, cuLaunchCooperativeKernel, the driver's guarantee that all its blocks are resident at
once (checked when the module is loaded: the device supports cooperative launches and
occupancy x SMs holds the grid, else CodegenError). A failed launch comes back as
an XLA error carrying cuGetErrorName's text.

The driver entry points the handler calls are resolved with llvmlite's
`load_library_permanently("libcuda.so.1")` + `address_of_symbol` and baked into the IR as
constant addresses (`emit_cuda_handler_ir` takes them as arguments, so the IR can be built and
checked on a machine without CUDA). Module loading uses ctypes on the same libcuda: neither
cuda-bindings nor numba-cuda is a dependency of this project, and the loader needs six calls.
Importing this module needs neither CUDA nor jax.

CUDA driver API facts used (cuda.h): CUresult is an int enum, 0 = CUDA_SUCCESS; CUfunction,
CUcontext, CUstream, CUmodule are pointers; CUdevice is an int; cuCtxPushCurrent /
cuCtxPopCurrent are exported as the `_v2` symbols; cuLaunchCooperativeKernel takes
cuLaunchKernel's arguments without `extra`; CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16,
CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH = 95.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

from llvmlite import ir

from stitch.codegen import kir
from stitch.codegen.errors import CodegenError, ImageRefused
from stitch.codegen.ffi import (API, CALL_FRAME, DEVICE_ORDINAL_GET_ARGS, ERR_INTERNAL,
                                ERR_INVALID_ARGUMENT, FFI_DTYPES, PTR, STREAM_GET_ARGS,
                                TRAIT_COMMAND_BUFFER_COMPATIBLE, CStruct, FfiTarget, FunctionPointer,
                                HandlerEmitter, cached_target, compile_handler, constant_function,
                                element, new_module, target_name)
from stitch.codegen.llvm_emit import I32, I64

LOG = logging.getLogger(__name__)

LIBCUDA = "libcuda.so.1"
CUDA_SUCCESS = 0
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH = 95
# Per-block limit on dynamic shared memory without opting in (cuFuncSetAttribute).
DYNAMIC_SHARED_DEFAULT_LIMIT = 48 * 1024

# Driver function types (CUresult is i32; unsigned int launch dims are i32 too).
_LAUNCH_TYPE = ir.FunctionType(I32, [PTR, I32, I32, I32, I32, I32, I32, I32, PTR, PTR, PTR])
_COOPERATIVE_LAUNCH_TYPE = ir.FunctionType(I32, [PTR, I32, I32, I32, I32, I32, I32, I32, PTR,
                                                 PTR])
_ERROR_NAME_TYPE = ir.FunctionType(I32, [I32, PTR])
_CTX_GET_TYPE = ir.FunctionType(I32, [PTR])
_CTX_PUSH_TYPE = ir.FunctionType(I32, [PTR])
_CTX_POP_TYPE = ir.FunctionType(I32, [PTR])


@dataclass(frozen=True)
class DriverSymbols:
    """Process addresses of the driver functions the handler calls."""
    cuLaunchKernel: int
    cuGetErrorName: int
    cuCtxGetCurrent: int
    cuCtxPushCurrent_v2: int
    cuCtxPopCurrent_v2: int
    cuLaunchCooperativeKernel: int

    @classmethod
    @functools.cache
    def resolve(cls) -> "DriverSymbols":
        """From libcuda.so.1 via LLVM's process symbol table (CodegenError without CUDA),
        once per process."""
        import llvmlite.binding as llvm
        try:
            llvm.load_library_permanently(LIBCUDA)
        except RuntimeError as exc:
            raise CodegenError(f"cannot load the CUDA driver {LIBCUDA}: {exc}") from exc
        addresses = {}
        for name in cls.__dataclass_fields__:
            address = llvm.address_of_symbol(name)
            if not address:
                raise CodegenError(f"{LIBCUDA} has no symbol {name}")
            addresses[name] = address
        return cls(**addresses)


@dataclass(frozen=True)
class LoadedFunction:
    """The kernel's CUfunction in one device's primary context (never unloaded)."""
    ordinal: int
    context: int
    module: int
    function: int


# ---------------------------------------------------------------- the handler


def emit_cuda_handler_ir(kernel: kir.Kernel, name: str, functions: Sequence[LoadedFunction],
                         symbols: DriverSymbols, *, dynamic_shared_bytes: int = 0,
                         command_buffer_compatible: bool = False) -> str:
    """LLVM IR (host triple) of `ptr @name(ptr frame)` launching `functions`' kernel."""
    if not functions:
        raise CodegenError(f"kernel {kernel.name!r}: no loaded CUDA function to launch")
    kernel.validate()
    module = new_module(f"{name}_handler")
    h = HandlerEmitter(module, kernel, name)
    b = h.b
    traits = TRAIT_COMMAND_BUFFER_COMPATIBLE if command_buffer_compatible else 0
    h.answer_metadata_probe(traits)
    h.check_frame()
    values = h.buffer_table()
    ctx = h.load(h.frame, CALL_FRAME, "ctx")
    stream = _stream(h, ctx)
    function, context = _device_function(h, ctx, functions)

    def driver(sym: str, fnty: ir.FunctionType) -> FunctionPointer:
        return constant_function(getattr(symbols, sym), fnty)

    def fail_cu(what: str, result: ir.Value) -> None:
        """Return an XLA error naming the CUresult (cuGetErrorName gives null if unknown)."""
        text = h.alloca(PTR, "cu_error_name")
        b.store(h.null, text)
        b.call(driver("cuGetErrorName", _ERROR_NAME_TYPE), [result, text])
        got = b.load(text, typ=PTR)
        known = b.select(b.icmp_unsigned("!=", got, h.null), got, h.string("unknown"))
        h.fail(ERR_INTERNAL, f"{what} failed: %s (CUresult %lld)", known, b.sext(result, I64))

    # XLA's thread normally has the device's primary context current; where not, push it.
    current = h.alloca(PTR, "current_context")
    b.store(h.null, current)
    b.call(driver("cuCtxGetCurrent", _CTX_GET_TYPE), [current])
    switch = b.icmp_unsigned("!=", b.load(current, typ=PTR), context)
    with b.if_then(switch, likely=False):
        pushed = b.call(driver("cuCtxPushCurrent_v2", _CTX_PUSH_TYPE), [context])
        with b.if_then(b.icmp_signed("!=", pushed, ir.Constant(I32, CUDA_SUCCESS)),
                       likely=False):
            fail_cu("cuCtxPushCurrent", pushed)

    # kernelParams: one pointer per param, to the slot holding its device pointer.
    n = len(kernel.params)
    params = h.alloca(ir.ArrayType(PTR, max(1, n)), "kernel_params")
    for i in range(n):
        b.store(element(b, values, PTR, i), element(b, params, PTR, i))
    dims = [ir.Constant(I32, v) for v in (kernel.grid, 1, 1, kernel.block, 1, 1,
                                          dynamic_shared_bytes)]
    def pop_context() -> None:
        """Undo the push above, if it happened (before every return)."""
        with b.if_then(switch, likely=False):
            b.call(driver("cuCtxPopCurrent_v2", _CTX_POP_TYPE), [h.alloca(PTR, "popped")])

    cooperative = _cooperative(kernel)
    launch = "cuLaunchCooperativeKernel" if cooperative else "cuLaunchKernel"
    # A "relaunch" kernel runs one phase per launch, in stream order (kir.launches); its
    # phase counter lives on the device. A sequence cut short by a failed launch leaves that
    # counter at an unknown phase, so every later call fails instead of computing the
    # wrong phases (never silently wrong numbers).
    launches = kir.launches(kernel)
    broken = None
    if launches > 1:
        broken = ir.GlobalVariable(module, I32, f"{name}_sequence_broken")
        broken.linkage = "internal"
        broken.initializer = ir.Constant(I32, 0)
        with b.if_then(b.icmp_unsigned("!=", b.load(broken), ir.Constant(I32, 0)),
                       likely=False):
            pop_context()
            h.fail(ERR_INTERNAL, f"an earlier call's launch sequence ({launches} launches, one "
                   "per phase) failed part-way, so the kernel's phase counter is unknown; "
                   "this kernel cannot run again in this process")
    for n in range(launches):
        if cooperative:     # every block resident at once, or the launch fails (never hangs)
            result = b.call(driver(launch, _COOPERATIVE_LAUNCH_TYPE),
                            [function, *dims, stream, params])
        else:
            result = b.call(driver(launch, _LAUNCH_TYPE),
                            [function, *dims, stream, params, h.null])
        with b.if_then(b.icmp_signed("!=", result, ir.Constant(I32, CUDA_SUCCESS)),
                       likely=False):
            if broken is not None:
                b.store(ir.Constant(I32, 1), broken)
            pop_context()
            fail_cu(f"{launch}(grid {kernel.grid}, block {kernel.block})"
                    + (f", launch {n + 1} of {launches}" if launches > 1 else ""), result)

    pop_context()
    b.ret(h.null)
    return str(module)


def _cooperative(kernel: kir.Kernel) -> bool:
    """A persistent grid-barrier kernel: its blocks wait for each other, so all must be
    resident at once (cuLaunchCooperativeKernel)."""
    return kir.has_grid_barrier(kernel) and kernel.grid_sync == "barrier"


def _call_api(h: HandlerEmitter, fname: str, struct: CStruct,
              fill: dict[str, ir.Value]) -> ir.Value:
    """Fill an API argument struct (struct_size, null extension, `fill`), call api->fname on
    it, return its error to XLA if any; the struct's address is returned."""
    b = h.b
    args = h.alloca(struct.type, fname.removeprefix("XLA_FFI_") + "_args")
    h.store(ir.Constant(I64, struct.struct_size()), args, struct, "struct_size")
    h.store(h.null, args, struct, "extension_start")
    for field_name, value in fill.items():
        h.store(value, args, struct, field_name)
    err = b.call(h.api_fn(fname, ir.FunctionType(PTR, [PTR])), [args])
    with b.if_then(b.icmp_unsigned("!=", err, h.null), likely=False):
        b.ret(err)
    return args


def _stream(h: HandlerEmitter, ctx: ir.Value) -> ir.Value:
    """The call's CUstream, from XLA_FFI_Stream_Get."""
    args = _call_api(h, "XLA_FFI_Stream_Get", STREAM_GET_ARGS, {"ctx": ctx, "stream": h.null})
    return h.load(args, STREAM_GET_ARGS, "stream")


def _device_function(h: HandlerEmitter, ctx: ir.Value,
                     functions: Sequence[LoadedFunction]) -> tuple[ir.Value, ir.Value]:
    """(CUfunction, CUcontext) of the call's device: a constant for one device, else chosen
    by XLA_FFI_DeviceOrdinal_Get (an API field newer than the rest: checked by size)."""
    def const(address: int) -> ir.Value:
        return ir.Constant(I64, address).inttoptr(PTR)
    if len(functions) == 1:
        return const(functions[0].function), const(functions[0].context)
    b = h.b
    need = API.offset("XLA_FFI_DeviceOrdinal_Get") + 8
    size = h.load(h.api, API, "struct_size")
    with b.if_then(b.icmp_unsigned("<", size, ir.Constant(I64, need)), likely=False):
        h.fail(ERR_INTERNAL, "the XLA FFI API (%lld bytes) has no DeviceOrdinal_Get; "
               "load the kernel for one device only", size)
    args = _call_api(h, "XLA_FFI_DeviceOrdinal_Get", DEVICE_ORDINAL_GET_ARGS,
                     {"ctx": ctx, "device_ordinal": ir.Constant(I32, -1)})
    ordinal = h.load(args, DEVICE_ORDINAL_GET_ARGS, "device_ordinal")
    function, context = h.null, h.null
    for f in functions:
        hit = b.icmp_signed("==", ordinal, ir.Constant(I32, f.ordinal))
        function = b.select(hit, const(f.function), function)
        context = b.select(hit, const(f.context), context)
    with b.if_then(b.icmp_unsigned("==", function, h.null), likely=False):
        loaded = ", ".join(str(f.ordinal) for f in functions)
        h.fail(ERR_INVALID_ARGUMENT, f"no CUDA module loaded for device %lld (loaded: {loaded})",
               b.sext(ordinal, I64))
    return function, context


# ---------------------------------------------------------------- module loading (Python)


class _Driver:
    """The few libcuda calls that load a module, through ctypes."""

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL(LIBCUDA)
        except OSError as exc:
            raise CodegenError(f"cannot load the CUDA driver {LIBCUDA}: {exc}") from exc
        vp, pvp = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
        signatures = {
            "cuInit": [ctypes.c_uint],
            "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
            "cuDevicePrimaryCtxRetain": [pvp, ctypes.c_int],
            "cuCtxPushCurrent_v2": [vp],
            "cuCtxPopCurrent_v2": [pvp],
            "cuModuleLoadData": [pvp, ctypes.c_char_p],
            "cuModuleGetFunction": [pvp, vp, ctypes.c_char_p],
            "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
            "cuDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
            "cuOccupancyMaxActiveBlocksPerMultiprocessor": [ctypes.POINTER(ctypes.c_int), vp,
                                                            ctypes.c_int, ctypes.c_size_t],
        }
        for fname, argtypes in signatures.items():
            fn = getattr(self.lib, fname)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int

    def check(self, result: int, what: str,
              error: type[CodegenError] = CodegenError) -> None:
        if result != CUDA_SUCCESS:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(result, ctypes.byref(name))
            text = name.value.decode() if name.value else "unknown"
            raise error(f"{what} failed: {text} (CUresult {result})")

    def attribute(self, attribute: int, device: int) -> int:
        value = ctypes.c_int()
        self.check(self.lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, device),
                   f"cuDeviceGetAttribute({attribute}, device {device})")
        return value.value

    def check_co_resident(self, function: ctypes.c_void_p, entry: str, device: int,
                          grid: int, block: int, dynamic_shared_bytes: int) -> None:
        """CodegenError unless a cooperative launch of `grid` blocks can run on `device`:
        a grid barrier waits for every block, so all must be resident at once."""
        if not self.attribute(CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH, device):
            raise CodegenError(f"kernel {entry!r} has grid barriers but device {device} does "
                               "not support cooperative launches")
        per_sm = ctypes.c_int()
        self.check(self.lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(per_sm), function, block, dynamic_shared_bytes),
            f"cuOccupancyMaxActiveBlocksPerMultiprocessor({entry!r})")
        resident = per_sm.value * self.attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                                                 device)
        if grid > resident:
            raise CodegenError(f"kernel {entry!r} has grid barriers and a grid of {grid} "
                               f"blocks, but only {resident} blocks of {block} threads can be "
                               f"resident on device {device} ({per_sm.value} per SM)")

    def load(self, image: bytes, entry: str, ordinal: int,
             co_resident: tuple[int, int, int] | None = None) -> LoadedFunction:
        lib = self.lib
        self.check(lib.cuInit(0), "cuInit")
        device = ctypes.c_int()
        self.check(lib.cuDeviceGet(ctypes.byref(device), ordinal), f"cuDeviceGet({ordinal})")
        context = ctypes.c_void_p()
        # XLA runs on each device's primary context; retained for good (the module lives in it).
        self.check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device),
                   "cuDevicePrimaryCtxRetain")
        self.check(lib.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")
        try:
            module, function = ctypes.c_void_p(), ctypes.c_void_p()
            self.check(lib.cuModuleLoadData(ctypes.byref(module), image),
                       f"cuModuleLoadData(device {ordinal})", ImageRefused)
            self.check(lib.cuModuleGetFunction(ctypes.byref(function), module, entry.encode()),
                       f"cuModuleGetFunction({entry!r})")
            if co_resident is not None:
                self.check_co_resident(function, entry, device.value, *co_resident)
        finally:
            lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        return LoadedFunction(ordinal, context.value or 0, module.value or 0,
                              function.value or 0)


def load_cuda_functions(image: bytes | str, entry: str, ordinals: Sequence[int], *,
                        co_resident: tuple[int, int, int] | None = None
                        ) -> list[LoadedFunction]:
    """Load a cubin (ELF) or PTX image into each device's primary context; `entry`'s
    CUfunction per device. ``co_resident`` = (grid, block, dynamic shared bytes) of a kernel
    launched cooperatively: each device must hold the whole grid at once (CodegenError)."""
    data = image.encode() if isinstance(image, str) else bytes(image)
    if not data.startswith(b"\x7fELF") and not data.endswith(b"\0"):
        data += b"\0"  # PTX text must be NUL-terminated for cuModuleLoadData
    driver = _Driver()
    return [driver.load(data, entry, o, co_resident) for o in ordinals]


def load_image(kernel_name: str, image: bytes, entry: str, ordinals: Sequence[int], *,
               co_resident: tuple[int, int, int] | None = None,
               fallback_ptx: str | None = None) -> list[LoadedFunction]:
    """``load_cuda_functions`` of `image`; where the driver refuses it (ImageRefused: a
    cubin from a ptxas newer than the driver) and ``fallback_ptx`` is given, of the PTX
    instead (entry `kernel_name`), which the driver JIT-compiles. A refusal is remembered
    (``cubins_refused``): the pass stops assembling cubins for this process's devices."""
    global _CUBINS_REFUSED
    if fallback_ptx is None or not _CUBINS_REFUSED:
        try:
            return load_cuda_functions(image, entry, ordinals, co_resident=co_resident)
        except ImageRefused as exc:
            if fallback_ptx is None:
                raise
            _CUBINS_REFUSED = True
            LOG.warning("kernel %s: the CUDA driver refused ptxas's cubin (%s); loading the "
                        "PTX (driver JIT) for it and for every later kernel", kernel_name, exc)
    return load_cuda_functions(fallback_ptx, kernel_name, ordinals, co_resident=co_resident)


_CUBINS_REFUSED = False


def cubins_refused() -> bool:
    """Whether the driver refused a cubin in this process (then PTX is loaded instead)."""
    return _CUBINS_REFUSED


def gpu_ordinals() -> list[int]:
    """The CUDA device ordinals of jax's local GPU devices (CodegenError if none)."""
    import jax
    try:
        devices = jax.local_devices(backend="gpu")
    except RuntimeError as exc:
        raise CodegenError(f"no jax GPU backend: {exc}") from exc
    return [d.local_hardware_id if d.local_hardware_id is not None else d.id for d in devices]


def cuda_ffi_target(kernel: kir.Kernel, image: bytes | str, *,
                    ordinals: Sequence[int] | None = None, dynamic_shared_bytes: int = 0,
                    command_buffer_compatible: bool = False, entry: str | None = None,
                    fallback_ptx: str | None = None) -> FfiTarget:
    """The kernel's cubin / PTX `image` (entry `entry`, default `kernel.name`; params in
    kernel.params order as global pointers, as stitch.codegen.nvptx emits them) behind an XLA FFI
    handler for "CUDA". ``fallback_ptx``: the kernel's PTX (entry `kernel.name`), loaded
    instead when the driver refuses a cubin `image` (``load_image``)."""
    kernel.validate()
    for p in kernel.params:
        if p.dtype not in FFI_DTYPES:
            raise CodegenError(f"kernel {kernel.name!r}: param {p.name!r} dtype {p.dtype} "
                               "has no XLA FFI dtype")
    if not 0 <= dynamic_shared_bytes <= DYNAMIC_SHARED_DEFAULT_LIMIT:
        raise CodegenError(f"kernel {kernel.name!r}: {dynamic_shared_bytes} bytes of dynamic "
                           f"shared memory (at most {DYNAMIC_SHARED_DEFAULT_LIMIT})")
    ordinals = list(gpu_ordinals() if ordinals is None else ordinals)
    data = image.encode() if isinstance(image, str) else bytes(image)
    name = target_name("cuda", kernel, data, repr(ordinals), str(dynamic_shared_bytes),
                       str(command_buffer_compatible))

    co_resident = ((kernel.grid, kernel.block, dynamic_shared_bytes)
                   if _cooperative(kernel) else None)

    def build(name: str) -> FfiTarget:
        functions = load_image(kernel.name, data, entry or kernel.name, ordinals,
                               co_resident=co_resident, fallback_ptx=fallback_ptx)
        handler_ir, engine, address = build_cuda_handler(
            kernel, name, functions, DriverSymbols.resolve(),
            dynamic_shared_bytes=dynamic_shared_bytes,
            command_buffer_compatible=command_buffer_compatible)
        LOG.debug("kernel %s: CUDA FFI target %s on devices %s", kernel.name, name, ordinals)
        return FfiTarget(name, kernel, "CUDA", address, handler_ir, engine,
                         _keepalive=tuple(functions))
    return cached_target(name, build)


def build_cuda_handler(kernel: kir.Kernel, name: str, functions: Sequence[LoadedFunction],
                       symbols: DriverSymbols, **options: Any) -> tuple[str, object, int]:
    """(IR, engine, address) of the CUDA handler ``name`` launching ``functions`` (options:
    ``emit_cuda_handler_ir``'s), built fast: it only decodes the frame and calls the driver."""
    handler_ir = emit_cuda_handler_ir(kernel, name, functions, symbols, **options)
    engine, address = compile_handler(name, kernel, [handler_ir], build_fast=True)
    return handler_ir, engine, address


# ---------------------------------------------------------------- compile-only (deviceless)

# XLA_FFI_Error_Code_FAILED_PRECONDITION (the absl code): the target exists but cannot run.
ERR_FAILED_PRECONDITION = 9


def emit_compile_only_handler_ir(name: str, arch: str) -> str:
    """LLVM IR (host triple) of the handler every compile-only target for ``arch`` shares:
    it answers XLA's metadata probe, so a compile accepts the custom call, and fails any
    real call with an error saying no code was loaded (kernels share it because it never
    runs any of them: one MCJIT build per process instead of one per kernel)."""
    module = new_module(f"{name}_handler")
    h = HandlerEmitter(module, None, name, subject="stitch compile-only CUDA target")
    h.answer_metadata_probe(0)
    h.fail(ERR_FAILED_PRECONDITION, f"built for {arch} without a device (deviceless check): "
           "no code is loaded on any device, so it must never run")
    return str(module)


_SHARED_HANDLERS: dict[str, tuple[str, object, int]] = {}
_SHARED_LOCK = threading.Lock()


def compile_only_handler(arch: str) -> tuple[str, object, int]:
    """(IR, engine, address) of the compile-only handler for ``arch``, built once per process
    (kept for its life: XLA's registry keeps the address of every name registered)."""
    with _SHARED_LOCK:
        shared = _SHARED_HANDLERS.get(arch)
        if shared is None:
            name = f"stitch_cudacheck_handler_{arch}"
            handler_ir = emit_compile_only_handler_ir(name, arch)
            engine, address = compile_handler(name, None, [handler_ir], build_fast=True)
            shared = _SHARED_HANDLERS[arch] = (handler_ir, engine, address)
        return shared


@dataclass
class CompileOnlyCudaTarget(FfiTarget):
    """A kernel's CUDA FFI target for compiling without a device: XLA accepts the custom call
    (the handler, shared by every target for ``arch``, answers the metadata probe) but it can
    never run. ``cubin`` is ptxas's output for ``arch`` and ``ptxas`` its per-entry resource
    reports, so a deviceless check still covers PTX emission and assembly."""
    arch: str = ""
    ptx: str = field(default="", repr=False)
    cubin: bytes = field(default=b"", repr=False)
    ptxas: dict = field(default_factory=dict, repr=False)

    def register(self) -> None:
        """Registered for "CUDA" without touching a device (FfiTarget.register asks jax for
        the GPU devices first, which a deviceless process has none of)."""
        import jax
        from stitch.codegen import ffi
        with ffi._LOCK:                 # the one record of names XLA holds (cached_target)
            if self.name in ffi._REGISTERED:
                return
            jax.ffi.register_ffi_target(self.name, self.capsule(), platform="CUDA")
            ffi._REGISTERED.add(self.name)
        LOG.debug("registered compile-only CUDA FFI target %s (%s)", self.name, self.arch)


def compile_only_cuda_target(kernel: kir.Kernel, ptx: str, arch: str, *,
                             cache: Any = None, assembled: Any = None) -> CompileOnlyCudaTarget:
    """The kernel's PTX assembled by ptxas for ``arch`` (CodegenError if ptxas rejects it)
    behind the compile-only FFI handler for "CUDA" (``compile_only_handler``), registered
    under the kernel's own target name (see CompileOnlyCudaTarget). ``cache`` is a
    stitch.codegen.cache.CompileCache for ptxas's result. ``assembled``: ptxas's result when the
    caller has it already (``gpu_cache.renamed_cubin_build`` of a kernel that differs only
    by name)."""
    from stitch.codegen.gpu_cache import assemble_cached

    kernel.validate()
    for p in kernel.params:
        if p.dtype not in FFI_DTYPES:
            raise CodegenError(f"kernel {kernel.name!r}: param {p.name!r} dtype {p.dtype} "
                               "has no XLA FFI dtype")
    name = target_name("cudacheck", kernel, ptx, arch)

    def build(name: str) -> FfiTarget:
        nonlocal assembled
        if assembled is None:
            assembled = assemble_cached(ptx, arch, cache=cache, kernel_name=kernel.name)
        handler_ir, engine, address = compile_only_handler(arch)
        LOG.debug("kernel %s: compile-only CUDA target %s (%s, %d cubin bytes)", kernel.name,
                  name, arch, len(assembled.cubin))
        return CompileOnlyCudaTarget(name, kernel, "CUDA", address, handler_ir, engine,
                                     arch=arch, ptx=ptx, cubin=assembled.cubin,
                                     ptxas=dict(assembled.reports))
    target = cached_target(name, build)
    if not isinstance(target, CompileOnlyCudaTarget):     # names are per kind: cannot happen
        raise CodegenError(f"FFI target {name} is registered as a {type(target).__name__}")
    return target
