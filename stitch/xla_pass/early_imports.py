"""The modules the pass imports as it starts, imported early in a thread of their own.

In a fresh process the pass's first module imports the planner, the HLO evaluator and the
lowering (about half a second on a 2-core machine) before it can plan. ``start()`` (called as
a compile that stitch asked for begins, ``PassRequest.__enter__``) imports them in a daemon
thread while XLA runs its own passes; ``wait()`` (the pass's first step) joins that thread,
so no module is ever imported by the pass and the thread at once. A failed import is left for
the pass's own import to raise where it always did.
"""
from __future__ import annotations

import importlib
import logging
import threading

log = logging.getLogger(__name__)

PASS_MODULES = (
    "stitch.explorer.planner",
    "stitch.hlo.evaluator.interpreter",
    "stitch.hlo.gemm_chains",
    "stitch.pricing.chain_pricing",
    "stitch.codegen.lower",
    "stitch.codegen.lowering_reuse",
    "stitch.codegen.kir_data",
    "stitch.codegen.gpu_cache",
    "stitch.codegen.thread_work",
    "stitch.codegen.ffi_cuda",
    "stitch.codegen.gemm_chain",
    "stitch.xla_pass.attention_backward_jobs",
    "stitch.xla_pass.lm_head_placement",
    "stitch.xla_pass.code_budget",
    "stitch.xla_pass.payback",
)

_LOCK = threading.Lock()
_THREAD: threading.Thread | None = None


def _import_all() -> None:
    for name in PASS_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - the pass's own import reports it
            log.debug("early import of %s failed: %s", name, exc)
            return


def start() -> None:
    """Import ``PASS_MODULES`` in a daemon thread, once per process."""
    global _THREAD
    with _LOCK:
        if _THREAD is None:
            _THREAD = threading.Thread(target=_import_all, name="stitch-early-imports",
                                       daemon=True)
            _THREAD.start()


def wait() -> None:
    """Return once the early imports (if started) are done."""
    with _LOCK:
        thread = _THREAD
    if thread is not None:
        thread.join()
