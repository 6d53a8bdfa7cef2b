"""stitch as an HLO pass inside XLA's compiler: the compile entry points, and the pass's
public names.

``compile_with_pass(lowered, request)`` compiles a jax lowering with the pass on for it;
``compile_hlo_text(text, request)`` an HLO module (tf2xla's) on jax's XLA client. The pass
itself is split by job:

- ``pass_registration``: the pass registered with XLA (``ensure_registered``) and XLA's
  callback into it, which finds the module's live request, hands the module to planning and
  gives XLA the rewritten module back;
- ``pass_request``: one compile stitch asked for (``PassRequest``), what the pass did
  (``PassReport``) and its errors;
- ``pass_planning``: planning, lowering and placing the stitched kernels of one module
  (``stitch_module``);
- ``kernel_builds``: the placed kernels built for the device as registered XLA FFI targets
  (host object code on "cpu", PTX or cubins with the CUDA handler on "gpu"; the GPU build
  pool, ``GpuPrebuild``);
- ``ptx_children``: the process's PTX children the GPU builds run in.

Without a GPU (the deviceless check, tests only): ``stitch/xla_pass/deviceless.py`` registers the
same callback with the CUDA plugin's XlaTransform extension and compiles with
``PassRequest(compile_only=True)``: kernels are built for the target spec's arch as
compile-only CUDA FFI targets (``kernel_builds.build_target``). CPU kernels' object code is
built in a child process (``host_builds``), so a cancelled pass never leaves LLVM running in
this process.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from stitch.hlo import parse_hlo, print_hlo
from stitch.hlo.literals import ELIDED
from stitch.errors import Cancelled

from .kernel_builds import GpuBuild, GpuPrebuild, build_target, compile_cache, cubins_for_device
from .pass_planning import GPU_CHAIN_TF32, LLVM_LOCK, stitch_module
from .pass_registration import (DUMP_ENV, ensure_registered, registered_platforms,
                                stitch_module_text, to_proto)


from .pass_request import (REQUEST_ATTR, BuiltKernel, PassCancelled, PassError, PassReport,
                           PassRequest, gpu_arch, target_arch)


from .ptx_children import build_threads, early_ptx_children

log = logging.getLogger("stitch.xla_pass")


def compile_with_pass(lowered: Any, request: PassRequest) -> tuple[Any, PassReport]:
    """``lowered`` compiled by XLA with the pass on for it: (executable, report).

    XLA CPU has failed to link an FFI call placed in a loop body (jax's threefry loop:
    "Symbols not found: __xla_cpu_runtime_HandleFfiCall"); when XLA rejects a module with
    kernels in loop bodies, the compile is retried once with ENTRY kernels only."""
    if request.device == "gpu" and not request.compile_only:
        from stitch.xla_pass.device_target import pass_target
        request.target = pass_target(request.target)     # the device's, unless named
    private = request.prepare(lowered)
    try:
        with request:
            compiled = private.compile()
        if request.report is None and request.error is None and request.calls == 0:
            log.warning("%s: XLA compiled for %s without calling stitch's pass (registered "
                        "for %s); the program runs as stock XLA", request.function,
                        request.device, ", ".join(registered_platforms()) or "nothing")
        return _holding_kernels(compiled, request.result())
    except Exception as exc:  # noqa: BLE001 - XLA's own error on the rewritten module
        if isinstance(request.error, Cancelled):
            raise request.error from None       # the pass stopped XLA's compile
        report = request.report
        if report is None or not report.in_loop_bodies:
            raise
        log.info("%s: XLA rejected stitched kernels in loop bodies (%s: %s); retrying with "
                 "ENTRY kernels only", request.function, type(exc).__name__,
                 str(exc).splitlines()[0][:200])
    retry = PassRequest(request.function, request.target, request.device, request.cancel,
                        request.options, loop_bodies=False,
                        compile_only=request.compile_only, arch=request.arch)
    private = retry.prepare(lowered)
    with retry:
        compiled = private.compile()
    return _holding_kernels(compiled, retry.result())


def _holding_kernels(executable: Any, report: PassReport) -> tuple[Any, PassReport]:
    """The executable made to hold its kernels' FFI targets: the targets' code lives as long
    as something holds them (stitch.codegen.ffi.cached_target), and XLA calls it by address."""
    executable._stitch_ffi_targets = tuple(k.target for k in report.kernels)
    return executable, report


def compile_hlo_text(text: str, request: PassRequest | None, platform: str = "cpu"
                     ) -> tuple[Callable[..., list], PassReport | None]:
    """An HLO module (text, e.g. tf2xla's) compiled on jax's XLA client with the pass on:
    (call, report). ``call(*arrays)`` runs it on the first device and returns the root's
    leaves. The module is tagged with the request's token (a module-level frontend
    attribute, which survives the conversion to StableHLO). With ``request=None`` it is
    XLA's own compile of the module (no pass, report None): the reference a stitched
    program is checked against where the module came from another XLA (TF's)."""
    import jax
    import jax.extend.backend as jax_backend
    from jax._src.lib import _jax

    module = parse_hlo(text)
    elided = [inst.name for _, inst in module.instructions()
              if inst.opcode == "constant" and inst.literal == ELIDED]
    if elided:
        # XLA's parser reads an elided constant as zeros: the program would run wrong.
        raise PassError(f"module {module.name!r}: {len(elided)} constant(s) printed without "
                        f"their values ({ELIDED}), e.g. {elided[0]!r}; print the HLO with "
                        f"print_large_constants=True")
    if request is not None:
        attrs = module.attrs.get("frontend_attributes", "{}").strip()
        inner = attrs[1:-1].strip()
        module.attrs["frontend_attributes"] = \
            "{" + (inner + "," if inner else "") + f'{REQUEST_ATTR}="{request.token}"' + "}"
    proto = to_proto(print_hlo(module, operand_shapes=True))
    stablehlo = _jax.mlir.hlo_to_stablehlo(proto)
    backend = jax_backend.get_backend(platform)
    device = backend.local_devices()[0]
    options = jax_backend.get_compile_options(num_replicas=1, num_partitions=1)
    if request is None:
        executable = backend.compile_and_load(stablehlo, _jax.DeviceList((device,)), options)
    else:
        ensure_registered("cpu" if platform == "cpu" else "cuda")
        with request:
            executable = backend.compile_and_load(stablehlo, _jax.DeviceList((device,)),
                                                  options)

    def call(*arrays: Any) -> list:
        return executable.execute([jax.device_put(a, device) for a in arrays])
    if request is None:
        return call, None
    report = request.result()
    return _holding_kernels(call, report)


__all__ = ["BuiltKernel", "DUMP_ENV", "GPU_CHAIN_TF32", "GpuBuild", "GpuPrebuild", "LLVM_LOCK",
           "PassCancelled", "PassError", "PassReport", "PassRequest", "REQUEST_ATTR",
           "build_target", "build_threads", "compile_cache", "compile_hlo_text",
           "compile_with_pass", "cubins_for_device", "early_ptx_children", "ensure_registered",
           "gpu_arch", "stitch_module", "stitch_module_text", "target_arch"]
