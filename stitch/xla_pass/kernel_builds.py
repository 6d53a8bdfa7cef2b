"""Building the pass's kernels for a device: each lowered kernel made a registered XLA FFI
target (host object code on "cpu", PTX or ptxas's cubin with the CUDA handler on "gpu";
``build_target``) through the process's compile cache (``compile_cache``). On the GPU the PTX
and ptxas of a module's kernels run in the PTX children (``ptx_children``), in parallel, while
the pass lowers the next kernels (``GpuPrebuild``).
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from .pass_request import PassError, PassRequest, gpu_arch

log = logging.getLogger("stitch.xla_pass.builds")

_LOCK = threading.Lock()

# A kernel's whole build in its child: LLVM (emit_ptx_cached's 300 s) and ptxas (60 s).
BUILD_TIMEOUT_S = 360.0


@dataclass
class GpuBuild:
    """A kernel's GPU build products from ``GpuPrebuild``: its PTX and, for a compile-only
    build, ptxas's result (``stitch.codegen.gpu_cache.CubinBuild``)."""
    ptx: str
    assembled: Any = None

    @classmethod
    def renamed(cls, ptx: str, assembled: Any, name: str) -> "GpuBuild":
        """The build of a canonical kernel (``gpu_cache.canonical_kernel``) as the build of
        the kernel called ``name``."""
        from stitch.codegen.gpu_cache import renamed_cubin_build, renamed_ptx
        return cls(renamed_ptx(ptx, name),
                   renamed_cubin_build(assembled, name) if assembled is not None else None)


def assembly_mode(request: PassRequest, cubins: bool) -> str:
    """How far ptxas goes in a kernel's build (``gpu_cache.ASSEMBLY_MODES``): compile-only,
    its check is the point ("must"); on a device that loads cubins (``cubins``, and the
    driver has refused none), "try"; else "none" (the driver takes the PTX)."""
    from stitch.codegen.ffi_cuda import cubins_refused
    if request.compile_only:
        return "must"
    if cubins and not cubins_refused():
        return "try"
    return "none"


class GpuPrebuild:
    """PTX (and, compile-only, ptxas) of a module's GPU kernels, built while the caller goes
    on lowering the next ones: ``submit`` each lowered kernel, then ``each_result()``.
    Emission runs in ``workers``' children on as many threads; kernels that differ only by
    name (and their parameters') are emitted and assembled once
    (``gpu_cache.structure_key``), then renamed. A thread that frees up takes the largest
    build waiting (Kernel IR text, the structure key's length: LLVM and ptxas time grow
    with it), not the oldest: lowering's order comes from an estimate that misjudges some
    kernels (a Llama step's 94k-character kernel, estimated among the small ones, waited
    12 s behind smaller builds and then trailed the pass alone). What needs llvmlite in this process (the FFI
    handler) is left to the caller, under ``pass_planning.LLVM_LOCK``. Use as a context
    manager (the threads are joined on exit)."""

    def __init__(self, request: PassRequest, workers: list) -> None:
        import queue
        from concurrent.futures import ThreadPoolExecutor

        from stitch.codegen.nvptx import DEFAULT_PIPELINE, PIPELINE_ENV, pipeline_setting

        self.request = request
        self.arch = request.gpu_arch()
        # A bad $STITCH_LLVM_PIPELINE fails the pass once here, not every kernel's build.
        if pipeline_setting() != DEFAULT_PIPELINE:
            log.info("%s: kernels built with LLVM pipeline %s=%s", request.function,
                     PIPELINE_ENV, os.environ[PIPELINE_ENV].strip())
        # On a device, ptxas's cubin is loaded where a ptxas is found: assembled here in
        # parallel and cached, instead of the driver JIT-compiling each PTX in turn on the
        # pass's thread as its FFI target is made (PTX stays the fallback).
        self.cubins = not request.compile_only and cubins_for_device(self.arch)
        # The children use the compile cache this process would (opened here, not in a
        # thread: see gpu_cache.build_in_child); none where it is refused.
        cache = compile_cache()
        self._cache_dir = str(cache.directory) if cache.enabled else None
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        for worker in workers:
            self._idle.put(worker)
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(workers)),
                                        thread_name_prefix="stitch-build")
        self._groups: dict[str, Any] = {}                 # structure key -> Future
        self._kernels: list[tuple[Any, Any]] = []         # (kernel, its group's Future)
        # Builds not started: (-size, submission number, canonical kernel, key, Future).
        self._waiting: list[tuple[int, int, Any, str, Any]] = []
        self._waiting_lock = threading.Lock()

    def __enter__(self) -> "GpuPrebuild":
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._waiting_lock:
            for *_, future in self._waiting:
                future.cancel()
            self._waiting.clear()

    def submit(self, kernel: Any, key: str | None = None) -> None:
        """Queue ``kernel``'s build (``key``: its ``gpu_cache.structure_key`` if known)."""
        import heapq
        from concurrent.futures import Future

        from stitch.codegen.gpu_cache import canonical_kernel, structure_key
        key = structure_key(kernel) if key is None else key
        future = self._groups.get(key)
        if future is None:
            future = self._groups[key] = Future()
            with self._waiting_lock:
                heapq.heappush(self._waiting, (-len(key), len(self._groups),
                                               canonical_kernel(kernel), key, future))
            self._pool.submit(self._build_largest)
        self._kernels.append((kernel, future))

    def _build_largest(self) -> None:
        """The largest waiting build, run on this thread (one call per build queued)."""
        import heapq
        with self._waiting_lock:
            if not self._waiting:
                return
            _, _, canonical, key, future = heapq.heappop(self._waiting)
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(self._build(canonical, key))
        except BaseException as exc:  # noqa: BLE001 - handed to the kernel's waiters
            future.set_exception(exc)

    def _build(self, canonical: Any, structure: str) -> tuple[str, Any]:
        """The canonical kernel's PTX and ptxas's result for it: compile-only, and on a
        device while cubins are loaded there (``cubins_for_device``). The whole build
        (cache, LLVM, ptxas) runs in the worker's child, one round trip from this thread
        (``gpu_cache.build_in_child``)."""
        from stitch.codegen.gpu_cache import build_in_child
        assembly = assembly_mode(self.request, self.cubins)
        worker = self._idle.get()
        try:
            self.request.check_cancelled()
            built = worker.call(build_in_child, canonical, self.arch, structure=structure,
                                cache_dir=self._cache_dir, assembly=assembly,
                                timeout=BUILD_TIMEOUT_S, cancelled=self.request.cancel)
        finally:
            self._idle.put(worker)
        if built.assembly_error is not None:
            log.info("no cubin for a kernel of %s (%s): its PTX is loaded (the driver may "
                     "still take it)", self.request.function, built.assembly_error)
        return built.ptx, built.assembled

    def each_result(self) -> Iterator[Any]:
        """Per submitted kernel, in order: its ``GpuBuild`` or the exception that stopped
        its group's build, each as soon as that build is done (the caller can use a
        kernel's build while later ones still run)."""
        for kernel, future in self._kernels:
            try:
                ptx, assembled = future.result()
            except Exception as exc:  # noqa: BLE001 - handed back per kernel
                yield exc
                continue
            yield GpuBuild.renamed(ptx, assembled, kernel.name)
        log.debug("%s: %d GPU kernels, %d distinct", self.request.function,
                  len(self._kernels), len(self._groups))


def compile_cache() -> Any:
    """The process's on-disk compile cache (stitch.codegen.cache: per-user, authenticated; a
    refused or unwritable directory turns caching off, logged, and compiles go on)."""
    global _CACHE
    with _LOCK:
        if _CACHE is None:
            from stitch.codegen.cache import CompileCache
            _CACHE = CompileCache()
        return _CACHE


_CACHE: Any = None


def in_command_buffers(kernel: Any) -> bool:
    """Whether the kernel's handler declares itself command-buffer compatible: its launches
    are stream-ordered work XLA can record in a CUDA graph. Not a kernel with a grid barrier
    (a cooperative launch, or one launch per phase reading the phase from module state),
    and not when ``STITCH_COMMAND_BUFFERS`` is off."""
    from stitch.codegen import kir

    from stitch.config import command_buffers_setting
    return command_buffers_setting() and not kir.has_grid_barrier(kernel)


def build_target(kernel: Any, device: str, *, arch: str | None = None,
                 compile_only: bool = False, worker: Any = None, ptx: str | None = None,
                 assembled: Any = None, cancelled: Callable[[], bool] | None = None) -> Any:
    """The kernel as a registered XLA FFI target for ``device`` ("cpu" | "gpu"), its object
    code or PTX through the compile cache. GPU: PTX for ``arch`` (default: the device's);
    ``compile_only`` builds a target XLA compiles against without a device (ptxas checks
    the PTX; the handler never runs, see stitch.codegen.ffi_cuda.compile_only_cuda_target).
    ``worker``: a stitch.codegen.isolation.IsolatedWorker to emit PTX in (one child for all the
    kernels of a module, instead of a fresh interpreter per kernel). ``ptx``: the kernel's
    PTX for ``arch`` when already emitted (``GpuPrebuild``), ``assembled`` ptxas's result
    for it: compile-only, checked; on a device, its cubin is what the driver loads (the
    PTX where the driver refuses it). ``cancelled``: polled while a CPU kernel's object
    code is built in the host-build child (``host_builds``); once true the build is given
    up with ``Cancelled``."""
    if device == "cpu":
        from stitch.codegen.ffi import host_ffi_target

        from .host_builds import host_object_builder
        target = host_ffi_target(kernel, cache=compile_cache(),
                                 object_builder=host_object_builder(cancelled))
    elif device == "gpu":
        from stitch.codegen.ffi_cuda import compile_only_cuda_target, cuda_ffi_target
        from stitch.codegen.gpu_cache import emit_ptx_cached
        arch = arch or gpu_arch()
        if ptx is None:
            ptx = emit_ptx_cached(kernel, arch, cache=compile_cache(), worker=worker).ptx
        if compile_only:
            target = compile_only_cuda_target(kernel, ptx, arch, cache=compile_cache(),
                                              assembled=assembled)
        elif assembled is not None:
            target = cuda_ffi_target(kernel, assembled.cubin,
                                     entry=assembled.entry or kernel.name, fallback_ptx=ptx,
                                     command_buffer_compatible=in_command_buffers(kernel))
        else:
            target = cuda_ffi_target(kernel, ptx,
                                     command_buffer_compatible=in_command_buffers(kernel))
    else:
        raise PassError(f"device {device!r} is not supported (cpu, gpu)")
    target.register()
    return target


def cubins_for_device(arch: str) -> bool:
    """Whether the pass loads ptxas's cubins for ``arch`` on a device: a ptxas for it is
    found and the driver has not refused one in this process (stitch.codegen.ffi_cuda)."""
    from stitch.codegen.errors import ToolchainError
    from stitch.codegen.ffi_cuda import cubins_refused
    from stitch.codegen.toolchain import find_ptxas
    if cubins_refused():
        return False
    try:
        find_ptxas(arch)
    except ToolchainError as exc:
        log.info("no ptxas for %s (%s): the driver JIT-compiles the kernels' PTX", arch, exc)
        return False
    return True
