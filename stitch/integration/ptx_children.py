"""The GPU pass's PTX children, kept for the process: a compile takes ``build_threads()`` of
them (``acquire``) and gives them back when it is done (``release``), so only the first GPU
compile of a process pays their start-up (an interpreter, llvmlite, the NVPTX target and
libdevice's cut: ~0.2-1 s each), not every compile with up to 8 fresh interpreters. A child
that died is started again by its ``IsolatedWorker`` on its next call. At exit every child is
killed, not asked to stop: a build still running is of no use any more, and waiting for it
would hold the exit up."""
from __future__ import annotations

import atexit
import threading

from stitch.codegen.isolation import IsolatedWorker

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
