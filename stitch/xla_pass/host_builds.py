"""Where the XLA pass builds its CPU kernels' object code: one child process per process
(``stitch.codegen.isolation.IsolatedWorker``, started on the first CPU build and kept), so that
LLVM's optimization and code generation, which can take many seconds for a large kernel
and cannot be interrupted, never run in the process that is running XLA.

Why: the pass runs on a thread inside XLA's compile. An exit while that thread is inside
LLVM can neither wait (a large kernel's build outlasts any reasonable exit) nor leave it
running (LLVM's static destructors run at exit under the busy thread, and the thread is
torn down through XLA's C++ frames when it next takes the GIL; both abort the process). A
child is killed instead: the waiting pass sees its cancel flag within
``stitch.codegen.isolation.CANCEL_POLL_S`` and returns. This process only loads the object code
(``stitch.codegen.host.jit_module``), which takes milliseconds. ``STITCH_ISOLATE=0`` builds
in-process (debugging)."""
from __future__ import annotations

import threading
from typing import Callable

from stitch.codegen.host import ObjectBuilder, build_object
from stitch.codegen.isolation import IsolatedWorker, isolation_enabled

# A build that takes longer is given up (the kernel stays with XLA, with that reason).
HOST_BUILD_TIMEOUT_S = 600.0

_WORKER: IsolatedWorker | None = None
_WORKER_LOCK = threading.Lock()


def _worker() -> IsolatedWorker:
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None:
            _WORKER = IsolatedWorker(name="stitch-host-build", preload=("stitch.codegen.host",))
        return _WORKER


def host_object_builder(cancelled: Callable[[], bool] | None) -> ObjectBuilder | None:
    """An object builder for ``stitch.codegen.ffi.host_ffi_target`` that builds in the process's
    host-build child, giving up (child killed, ``Cancelled`` raised) once ``cancelled()``
    is true; None (build in-process) when isolation is off."""
    if not isolation_enabled():
        return None
    worker = _worker()

    def build(ir_text: str, opt: int | None, codegen_level: int) -> bytes:
        return worker.call(build_object, ir_text, opt, codegen_level,
                           timeout=HOST_BUILD_TIMEOUT_S, cancelled=cancelled)
    return build
