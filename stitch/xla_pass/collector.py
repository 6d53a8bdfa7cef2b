"""Python's cyclic garbage collector during stitch's pass: collected less often.

Why: planning and Kernel IR lowering allocate millions of small objects (most freed by
reference counting), so with the default thresholds (700 allocations per young
collection) the collector ran ~600 young and ~5 full collections during transformer_train
tiny's pass, each full one walking every object of the process (~300,000 with jax and the
traced model loaded): 0.8 s of a 6 s pass, measured with ``gc.callbacks``
(docs/benchmarks.md, bench-pass-compile-gpu's reading). With a young threshold of
``PASS_GEN0_THRESHOLD`` it runs ~3 young collections and no full one: 0.1 s. Python
compilers written in Python do the same (mypy raises the threshold for a build).

The thresholds are the process's: they are raised while at least one pass runs (passes
may run in several threads) and put back when the last one ends. Garbage in reference
cycles is still collected, only in larger batches.
"""
from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

PASS_GEN0_THRESHOLD = 100_000

_lock = threading.Lock()
_active = 0
_saved: tuple[int, ...] | None = None     # the thresholds to put back, when raised


@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """The collector's young-generation threshold at least PASS_GEN0_THRESHOLD for the
    duration (a threshold of 0, collection off, is left alone); nested and concurrent uses
    share one raise. Thresholds someone else set meanwhile are not overwritten."""
    global _active, _saved
    with _lock:
        if _active == 0:
            current = gc.get_threshold()
            _saved = current if 0 < current[0] < PASS_GEN0_THRESHOLD else None
            if _saved is not None:
                gc.set_threshold(PASS_GEN0_THRESHOLD, *current[1:])
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if (_active == 0 and _saved is not None
                    and gc.get_threshold() == (PASS_GEN0_THRESHOLD, *_saved[1:])):
                gc.set_threshold(*_saved)
