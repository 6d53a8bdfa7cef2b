"""stitch's pass inside a deviceless XLA GPU compile (tests and checks only).

On a machine without a GPU, jax's CUDA plugin still compiles for a GPU described by a
target config (``jax.experimental.topologies``): XLA GPU's whole pipeline runs, fusion,
scheduling, Triton and PTX included, and ``compiled.as_text()`` is the optimized HLO a real
H100 would run. Two things stand between that compile and stitch's pass:

1. jax's public ``register_hlo_module_transformation`` attaches to a started GPU backend
   (a backend-initialization hook), which never starts without a device, so the pass is
   never called. The CUDA plugin's PJRT *XlaTransform extension* accepts a registration
   without a client: ``register_transform`` finds it by walking the ``extension_start``
   list of the plugin's ``GetPjrtApi()`` and calls its ``register_xla_transform`` through
   ctypes. On a real GPU the public API (``xla_pass.ensure_registered("cuda")``) is the
   path; this module is for the deviceless check only.
2. Building a kernel's CUDA FFI target loads its code on the devices. Deviceless, the pass
   builds ``stitch.codegen.ffi_cuda.compile_only_cuda_target`` instead (PTX emitted and assembled
   by ptxas for the topology's arch, behind the one handler all such targets share, which
   XLA accepts for compilation and which fails with an FFI error if it is ever run):
   ``PassRequest(..., compile_only=True, arch="sm_90")``.

PJRT facts used (``xla/pjrt/c/pjrt_c_api.h``, ``pjrt_c_api_xla_transform_extension.h``,
jaxlib's ``xla.cc``; checked against jax-cuda12-plugin 0.10.2's library by walking its list
and matching the entry to its ``xla_transform_extension`` symbol; the same list on
jax-cuda13-plugin 0.11.2's):

- ``PJRT_Api`` starts ``{size_t struct_size; PJRT_Extension_Base* extension_start; ...}``;
  every extension starts ``PJRT_Extension_Base {size_t struct_size; int32 type; next}``.
- The XlaTransform extension has type id 24 and is ``{base; register_xla_transform;
  clear_xla_transform}`` (40 bytes; versions without ``clear`` are 32).
- ``register_xla_transform(PJRT_Register_Xla_Transform_Args*) -> PJRT_Error*`` with args
  ``{size_t struct_size (40); const char* name; size_t name_size; int32 stage
  (0 pre-scheduler, 1 post-scheduler); PJRT_XlaTransform_Callbacks* callbacks}``.
- Callbacks ``{int64 version (1); void (*dtor)(cb); void (*transform_hlo_module)(cb,
  PJRT_XlaTransform_Args*)}``, kept alive by the plugin (here: for the process).
- ``PJRT_XlaTransform_Args {size_t struct_size; {int64 api_version; void* data;
  void (*cleanup_fn)(void*); bool has_error; int32 code; {const char*, size_t} error_msg}
  header; {const char*, size_t} hlo_module; {const char*, size_t} transformed_hlo_module;
  bool changed}``: the module comes in serialized; an answer sets ``changed`` and the
  transformed bytes, which must live until the plugin calls ``header.cleanup_fn(data)``.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable

from stitch.errors import StitchError

log = logging.getLogger("stitch.deviceless")

XLA_TRANSFORM_EXTENSION_TYPE = 24
XLA_TRANSFORM_EXTENSION_VERSION = 1
STAGES = {"pre_scheduler": 0, "post_scheduler": 1}
PJRT_ERROR_CODE_INTERNAL = 13
# Environment a deviceless compile needs: no device may be opened, and the plugin's check
# of the installed CUDA libraries (there are none) is skipped.
DEVICELESS_ENV = {"CUDA_VISIBLE_DEVICES": "-1", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}


class DevicelessError(StitchError):
    """The deviceless GPU check cannot be set up (no CUDA plugin, no extension, ...)."""


# ---------------------------------------------------------------- PJRT structs (ctypes)


class _String(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("size", ctypes.c_size_t)]


_CLEANUP = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _Header(ctypes.Structure):
    _fields_ = [("api_version", ctypes.c_int64), ("data", ctypes.c_void_p),
                ("cleanup_fn", _CLEANUP), ("has_error", ctypes.c_bool),
                ("code", ctypes.c_int32), ("error_msg", _String)]


class _TransformArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("header", _Header),
                ("hlo_module", _String), ("transformed_hlo_module", _String),
                ("changed", ctypes.c_bool)]


class _Callbacks(ctypes.Structure):
    pass


_DTOR = ctypes.CFUNCTYPE(None, ctypes.POINTER(_Callbacks))
_TRANSFORM = ctypes.CFUNCTYPE(None, ctypes.POINTER(_Callbacks), ctypes.POINTER(_TransformArgs))
_Callbacks._fields_ = [("version", ctypes.c_int64), ("dtor", _DTOR),
                       ("transform_hlo_module", _TRANSFORM)]


class _RegisterArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("name", ctypes.c_char_p),
                ("name_size", ctypes.c_size_t), ("stage", ctypes.c_int32),
                ("callbacks", ctypes.POINTER(_Callbacks))]


class _ExtensionBase(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("type", ctypes.c_int32),
                ("next", ctypes.c_void_p)]


_REGISTER_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_RegisterArgs))


class _XlaTransformExtension(ctypes.Structure):
    _fields_ = [("base", _ExtensionBase), ("register_xla_transform", _REGISTER_FN),
                ("clear_xla_transform", ctypes.c_void_p)]


# The PJRT headers' STRUCT_SIZE: offset of the last field plus its size.
_REGISTER_ARGS_SIZE = _RegisterArgs.callbacks.offset + ctypes.sizeof(ctypes.c_void_p)
_EXTENSION_MIN_SIZE = _XlaTransformExtension.register_xla_transform.offset + \
    ctypes.sizeof(ctypes.c_void_p)


# ---------------------------------------------------------------- the plugin


# jax's CUDA plugins, newest first: (the plugin package, the jax_plugins module, CUDA major).
CUDA_PLUGINS = (("jax_cuda13_plugin", "jax_plugins.xla_cuda13", 13),
                ("jax_cuda12_plugin", "jax_plugins.xla_cuda12", 12))


def installed_plugin() -> tuple[str, str, int] | None:
    """The first of ``CUDA_PLUGINS`` that imports (None: none does)."""
    import importlib
    for package, module, major in CUDA_PLUGINS:
        try:
            importlib.import_module(package)
            importlib.import_module(module)
        except ImportError:
            continue
        return package, module, major
    return None


def plugin_available() -> str | None:
    """None when one of jax's CUDA plugins can be imported, else why not."""
    if installed_plugin() is None:
        names = " or ".join(package for package, _, _ in CUDA_PLUGINS)
        return (f"jax's CUDA plugin is not installed (neither {names} imports); see "
                "scripts/deviceless_check.sh")
    return None


def plugin_library() -> str:
    """Path of the CUDA plugin's PJRT library (the one jax loads)."""
    found = installed_plugin()
    if found is None:
        raise DevicelessError(plugin_available() or "no CUDA plugin")
    import importlib
    cuda_plugin = importlib.import_module(found[1])
    path = cuda_plugin._get_library_path()
    if path is None or not os.path.exists(str(path)):
        raise DevicelessError(f"the CUDA plugin's PJRT library is missing ({path})")
    return str(path)


def _extensions(api: int) -> list[tuple[int, int, int]]:
    """(address, type, struct_size) of every extension on the PJRT_Api at ``api``."""
    found = []
    node = ctypes.c_void_p.from_address(api + ctypes.sizeof(ctypes.c_size_t)).value
    while node and len(found) < 256:          # a corrupt list must not loop forever
        base = _ExtensionBase.from_address(node)
        found.append((node, base.type, base.struct_size))
        node = base.next
    return found


def find_xla_transform_extension(library: str | None = None) -> _XlaTransformExtension:
    """The plugin's XlaTransform extension (DevicelessError if it has none)."""
    lib = ctypes.CDLL(library or plugin_library())   # the handle jax's dlopen also gets
    get_api = lib.GetPjrtApi
    get_api.restype = ctypes.c_void_p
    api = get_api()
    if not api:
        raise DevicelessError("the CUDA plugin's GetPjrtApi() returned null")
    extensions = _extensions(api)
    for address, kind, size in extensions:
        if kind == XLA_TRANSFORM_EXTENSION_TYPE:
            if size < _EXTENSION_MIN_SIZE:
                raise DevicelessError(f"the XlaTransform extension is {size} bytes "
                                      f"(need {_EXTENSION_MIN_SIZE})")
            return _XlaTransformExtension.from_address(address)
    raise DevicelessError("the CUDA plugin has no XlaTransform extension (type "
                          f"{XLA_TRANSFORM_EXTENSION_TYPE}); extensions: "
                          f"{sorted(k for _, k, _ in extensions)}")


@dataclass
class _Registration:
    """What must outlive a registration: the plugin keeps pointers to all of it."""
    name: bytes
    callbacks: _Callbacks
    transform: Any
    dtor: Any


_LOCK = threading.Lock()
_REGISTRATIONS: dict[tuple[str, str], _Registration] = {}
_PENDING: dict[int, ctypes.Array] = {}          # answers until the plugin's cleanup
_NEXT_KEY = [1]


@_CLEANUP
def _cleanup(data: int | None) -> None:
    with _LOCK:
        _PENDING.pop(data or 0, None)


def _keep(payload: bytes) -> tuple[int, ctypes.Array]:
    """A buffer holding ``payload`` and the key ``_cleanup`` frees it by."""
    buffer = ctypes.create_string_buffer(payload, len(payload))
    with _LOCK:
        key = _NEXT_KEY[0]
        _NEXT_KEY[0] += 1
        _PENDING[key] = buffer
    return key, buffer


def _fail(args: _TransformArgs, message: str) -> None:
    key, buffer = _keep(message.encode())
    args.header.has_error = True
    args.header.code = PJRT_ERROR_CODE_INTERNAL
    args.header.error_msg = _String(ctypes.addressof(buffer), len(buffer.raw))
    args.header.data = key
    args.header.cleanup_fn = _cleanup


def _adapter(callback: Callable[[bytes], bytes | None]) -> Any:
    """``callback(bytes) -> bytes | None`` as the plugin's ``transform_hlo_module``."""
    def transform(_callbacks: Any, args_ptr: Any) -> None:
        args = args_ptr.contents
        try:
            module = ctypes.string_at(args.hlo_module.data, args.hlo_module.size)
            answer = callback(module)
            if answer is None:
                args.changed = False
                return
            key, buffer = _keep(bytes(answer))
            args.transformed_hlo_module = _String(ctypes.addressof(buffer), len(answer))
            args.header.data = key
            args.header.cleanup_fn = _cleanup
            args.changed = True
        except BaseException as exc:  # noqa: BLE001 - never unwind into the plugin
            log.debug("deviceless transform failed", exc_info=True)
            _fail(args, f"{type(exc).__name__}: {exc}")
    return _TRANSFORM(transform)


def register_transform(callback: Callable[[bytes], bytes | None], name: str,
                       stage: str = "post_scheduler") -> bool:
    """Register ``callback`` with the CUDA plugin's XLA GPU compiler, no client needed.
    Once per (name, stage) per process; True when this call registered it."""
    if stage not in STAGES:
        raise DevicelessError(f"stage {stage!r}: one of {sorted(STAGES)}")
    with _LOCK:
        if (name, stage) in _REGISTRATIONS:
            return False
    extension = find_xla_transform_extension()
    transform = _adapter(callback)
    dtor = _DTOR(lambda _cb: None)               # ours live for the process
    callbacks = _Callbacks(XLA_TRANSFORM_EXTENSION_VERSION, dtor, transform)
    encoded = name.encode()
    args = _RegisterArgs(_REGISTER_ARGS_SIZE, encoded, len(encoded), STAGES[stage],
                         ctypes.pointer(callbacks))
    with _LOCK:
        if (name, stage) in _REGISTRATIONS:
            return False
        error = extension.register_xla_transform(ctypes.byref(args))
        if error:
            raise DevicelessError(f"the plugin refused the XlaTransform registration of "
                                  f"{name!r} (PJRT_Error at {error:#x})")
        _REGISTRATIONS[(name, stage)] = _Registration(encoded, callbacks, transform, dtor)
    log.debug("registered %s with the CUDA plugin's XlaTransform extension at %s", name, stage)
    return True


def ensure_pass_registered() -> None:
    """stitch's pass in deviceless GPU compiles (POST_SCHEDULER: the fused module, as
    ``pass_registration.ensure_registered("cuda")`` registers it on a real GPU)."""
    from .pass_registration import xla_callback
    register_transform(xla_callback, "stitch", "post_scheduler")


# ---------------------------------------------------------------- the compile's target

# Fields of XLA's GpuTargetConfigProto that stitch's GpuSpec does not hold: CUDA's launch
# limits, and the cuDNN / CUDA runtime versions each CUDA plugin accepts (by CUDA major).
_BLOCK_DIM_LIMITS = (2147483647, 65535, 65535)
_DNN_VERSION = (9, 7)
_RUNTIME_VERSIONS = {12: (12, 8, 0), 13: (13, 0, 0)}
_DEVICE_NAMES = {"v100": "Tesla V100-SXM2-16GB", "a100": "NVIDIA A100-SXM4-40GB",
                 "h100": "NVIDIA H100 80GB HBM3"}


def target_config(target: str) -> str:
    """XLA's GPU target config (text proto) for stitch's GPU spec ``target``: what a
    deviceless compile is told about the GPU (the same numbers stitch's cost model uses)."""
    from stitch.cost.gpu_specs import get_spec
    spec = get_spec(target)
    major, minor = spec.compute_capability
    fields = {
        "threads_per_block_limit": spec.max_threads_per_block,
        "threads_per_warp": spec.warp_size,
        "shared_memory_per_block": spec.shared_memory_per_block,
        "shared_memory_per_core": spec.shared_memory_per_sm,
        "threads_per_core_limit": spec.max_threads_per_sm,
        "core_count": spec.sm_count,
        "fpus_per_core": spec.fp32_cores_per_sm,
        "block_dim_limit_x": _BLOCK_DIM_LIMITS[0],
        "block_dim_limit_y": _BLOCK_DIM_LIMITS[1],
        "block_dim_limit_z": _BLOCK_DIM_LIMITS[2],
        "memory_bandwidth": spec.hbm_bandwidth,
        "l2_cache_size": spec.l2_bytes,
        "clock_rate_ghz": spec.clock_ghz,
        "device_memory_size": spec.memory_bytes,
        "shared_memory_per_block_optin": spec.shared_memory_per_block_optin,
        "registers_per_core_limit": spec.registers_per_sm,
        "registers_per_block_limit": spec.registers_per_block,
    }
    lines = ["gpu_device_info {"]
    lines += [f"  {k}: {v}" for k, v in fields.items()]
    lines += [f"  cuda_compute_capability {{ major: {major} minor: {minor} }}", "}",
              'platform_name: "CUDA"',
              f"dnn_version_info {{ major: {_DNN_VERSION[0]} minor: {_DNN_VERSION[1]} }}",
              "runtime_version {{ major: {} minor: {} patch: {} }}".format(*_runtime_version()),
              f'device_description_str: "{_DEVICE_NAMES.get(spec.name, spec.name)}"']
    return "\n".join(lines) + "\n"


def _runtime_version() -> tuple[int, int, int]:
    found = installed_plugin()
    return _RUNTIME_VERSIONS[found[2] if found else 12]


def check_environment() -> None:
    """DevicelessError unless this process may compile for a GPU without one."""
    why = plugin_available()
    if why:
        raise DevicelessError(why)
    wrong = {k: os.environ.get(k) for k, v in DEVICELESS_ENV.items() if os.environ.get(k) != v}
    if wrong:
        raise DevicelessError("a deviceless compile needs " + " ".join(
            f"{k}={v}" for k, v in DEVICELESS_ENV.items()) + f" (got {wrong})")


def topology(target: str = "h100", shape: str = "1x1x1") -> Any:
    """jax's description of ``shape`` GPUs of stitch's spec ``target``, no device opened."""
    from jax.experimental import topologies
    check_environment()
    return topologies.get_topology_desc(platform="cuda", topology=shape,
                                        target_config=target_config(target))


@dataclass
class DevicelessCompile:
    """One deviceless compile with stitch's pass on: the executable and the pass's report."""
    compiled: Any                    # jax.stages.Compiled (cannot run: no device)
    report: Any                      # xla_pass.PassReport
    request: Any                     # xla_pass.PassRequest

    @property
    def text(self) -> str:
        """XLA GPU's final HLO (after the pass and the rest of XLA's pipeline)."""
        return self.compiled.as_text()


def compile_with_pass(lowered: Any, function: str, target: str = "h100",
                      arch: str | None = None, options: Any = None) -> DevicelessCompile:
    """``lowered`` (a ``jax.stages.Lowered`` for a topology's devices) compiled by XLA GPU
    with stitch's pass on for it, kernels built as compile-only CUDA targets."""
    from .entry import PassRequest
    ensure_pass_registered()
    request = PassRequest(function, target, "gpu", options=options, compile_only=True,
                          arch=arch)
    private = request.prepare(lowered)
    with request:
        compiled = private.compile()
    return DevicelessCompile(compiled, request.result(), request)
