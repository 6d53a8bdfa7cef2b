"""The GPU pass's PTX children, kept for the process: a compile takes ``build_threads()`` of
them (``acquire``) and gives them back when it is done (``release``), so only the first GPU
compile of a process pays their start-up (an interpreter, llvmlite, the NVPTX target and
libdevice's cut: ~0.2-1 s each), not every compile with up to 8 fresh interpreters. A child
that died is started again by its ``IsolatedWorker`` on its next call. At exit every child is
killed, not asked to stop: a build still running is of no use any more, and waiting for it
would hold the exit up.

How many a compile takes (``build_threads``) and whether a request starts them as its compile
begins (``early_ptx_children``) are decided here too."""
from __future__ import annotations

import atexit
import os
import threading

from stitch.codegen.isolation import IsolatedWorker

from stitch.config import ConfigError, env_flag

# What a PTX child imports as it starts (stitch.codegen.gpu_cache.build_in_child's work).
PTX_CHILD_PRELOAD = ("stitch.codegen.nvptx", "stitch.codegen.gpu_cache")
# What a PTX child does as it starts, while the pass still plans: the NVPTX target and the
# libdevice cut every kernel's math links from (stitch.codegen.nvptx.warm_up), the facts of every
# cache key and the compile cache opened (stitch.codegen.gpu_cache.warm_child).
PTX_CHILD_WARM_UP = ("stitch.codegen.nvptx:warm_up", "stitch.codegen.gpu_cache:warm_child")
# The PTX children run below the compiling process's priority: where cores are short they
# yield to the pass's own thread (planning, lowering: what hands them work) and to whatever
# else the machine runs (a training step on stock XLA while stitch compiles). Measured on 2
# cores, transformer_train tiny: planning lost 0.09-0.18 s to the children's start-up at
# equal priority, 0.01-0.02 s at niceness 10; lowering ran 0.9 s instead of 1.2-1.5 s.
PTX_CHILD_NICE = 10
# Calls after which a child is replaced by a fresh one (bounds what LLVM contexts keep).
PTX_CHILD_MAX_CALLS = 2000

_ALL: list[IsolatedWorker] = []
_FREE: list[IsolatedWorker] = []
_LOCK = threading.Lock()


def acquire(count: int) -> list[IsolatedWorker]:
    """``count`` children for one compile: idle ones first, new ones for the rest; each is
    started (not waited for) where its child is not running."""
    with _LOCK:
        taken = [_FREE.pop(0) for _ in range(min(count, len(_FREE)))]
        for _ in range(count - len(taken)):
            worker = IsolatedWorker(name=f"stitch-ptx-{len(_ALL)}", preload=PTX_CHILD_PRELOAD,
                                    warm_up=PTX_CHILD_WARM_UP, nice=PTX_CHILD_NICE,
                                    max_calls=PTX_CHILD_MAX_CALLS)
            if not _ALL:
                atexit.register(kill_all)
            _ALL.append(worker)
            taken.append(worker)
    try:
        for worker in taken:
            worker.start()
    except BaseException:
        release(taken)
        raise
    return taken


def release(workers: list[IsolatedWorker]) -> None:
    """Children a compile is done with, idle for the next one."""
    with _LOCK:
        _FREE.extend(w for w in workers if w not in _FREE)


def idle() -> list[IsolatedWorker]:
    """The children no compile holds now."""
    with _LOCK:
        return list(_FREE)


def kill_all() -> None:
    """Kill every child at once (exit): builds in flight are lost."""
    with _LOCK:
        workers = list(_ALL)
    for worker in workers:
        worker.kill(final=True)


def start_ptx_workers() -> list:
    """``build_threads()`` of the process's PTX children, started where they are not running
    yet (not waited for); ``release_ptx_workers`` gives them back."""
    return acquire(build_threads())


def release_ptx_workers(workers: list) -> None:
    """PTX children a request or pass is done with, back to the process's for the next."""
    release(workers)


def build_threads() -> int:
    """Threads (each with its own PTX child) that emit and assemble a module's GPU kernels:
    ``STITCH_BUILD_THREADS``, else one per core up to MAX_BUILD_THREADS."""
    configured = os.environ.get("STITCH_BUILD_THREADS", "").strip()
    if not configured:
        return max(1, min(os.cpu_count() or 1, MAX_BUILD_THREADS))
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    raise ConfigError(f"STITCH_BUILD_THREADS={configured!r}: expected a number of threads "
                      ">= 1")


MAX_BUILD_THREADS = 8      # each PTX child holds an interpreter with llvmlite (~150 MB)


def early_ptx_children() -> bool:
    """Whether a GPU request starts its PTX children as its compile begins, so that their
    start-up (~0.2 s each: an interpreter, llvmlite, the NVPTX target, libdevice's cut, the
    cache keys' facts) runs during XLA's passes before stitch's, rather than as the pass
    begins, during planning (which keeps one core busy and leaves the others idle).
    ``STITCH_EARLY_PTX_CHILDREN`` (1/0) decides; by default, early only where the cores
    outnumber the children by EARLY_START_SPARE_CORES. Measured on 2 cores (transformer_train
    tiny, deviceless H100): started early, the children slowed XLA's passes before stitch's
    by 0.3-0.5 s and saved the pass 0.1 s; the whole compile was 0.2-0.5 s slower."""
    default = (os.cpu_count() or 1) >= build_threads() + EARLY_START_SPARE_CORES
    return env_flag("STITCH_EARLY_PTX_CHILDREN", default)


# Cores XLA's own passes keep busy beside the children's start-up.
EARLY_START_SPARE_CORES = 2
