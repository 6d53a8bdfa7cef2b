"""What stitch.jit (jax) and the TensorFlow front end share: per input signature, a function
runs the framework's stock path until stitch's program for that signature is built, then
switches; failures fall back for good and are logged; the guard times both paths over the
first calls after the switch and keeps the faster.

``SwitchingFunction`` holds the bookkeeping (entries, stats, the switch/fallback/guard log
lines, ``wait``, ``programs``); a front end supplies how to key a call, compile and run.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from stitch.config import setting_raw

log = logging.getLogger("stitch.jit")

GUARD_CALLS = 5              # timed calls per side before the guard decides
MAX_SIGNATURES = 64          # per function; the oldest entry is dropped past it (as jax's cache)
MAX_RECORDS = 10_000         # STITCH_STATS records kept per process
# The program summary's planned-vs-delivered figures a STITCH_STATS record carries.
DELIVERY_KEYS = ("xla_mem_us", "planned_mem_us", "delivered_mem_us", "xla_mem_bytes",
                 "planned_mem_bytes", "delivered_mem_bytes", "delivered_share",
                 "dropped_kernels", "dropped_payback_us", "dropped_build_us",
                 "dropped_placement_us", "copies", "copy_bytes")


@dataclass
class SignatureCounters:
    """What one input signature did: one STITCH_STATS record (outlives its function)."""
    function: str
    calls: int = 0
    stitched_calls: int = 0
    kernels_stitched: int = 0
    kernels_xla: int | None = None
    compile_s: float = 0.0
    state: str = "compiling"
    fallback_reason: str = ""
    # What the pass delivered against what it planned (stitch.xla_pass.delivered: modeled
    # memory-intensive µs and bytes of XLA's module, the plan and the module returned, the
    # dropped kernels' lost µs by kind, the loop copies added); empty for a front end
    # whose program summary has none.
    delivered: dict = field(default_factory=dict)
    # Where the stitched and the dropped kernels come from in the user's code
    # (PassReport.sources(): {"stitched": {kernel: "layer (model.py:12)"}, "dropped": ...}).
    where: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"function": self.function, "calls": self.calls,
                "stitched_calls": self.stitched_calls,
                "kernels_stitched": self.kernels_stitched, "kernels_xla": self.kernels_xla,
                "compile_s": round(self.compile_s, 3), "state": self.state,
                "fallback_reason": self.fallback_reason, "where": self.where,
                **self.delivered}


MAX_WHERE_SHOWN = 6          # kernels per side the STITCH_LOG=info line names


def where_line(sources: dict[str, dict[str, str]]) -> str:
    """One line: each stitched kernel and each dropped one with where it comes from."""
    parts = []
    for side, label in (("stitched", "stitched kernels"), ("dropped", "left to XLA")):
        kernels = sources.get(side) or {}
        if not kernels:
            continue
        named = [f"{k} [{w}]" if w else k for k, w in list(kernels.items())[:MAX_WHERE_SHOWN]]
        more = len(kernels) - MAX_WHERE_SHOWN
        parts.append(f"{label} {len(kernels)}: " + "; ".join(named)
                     + (f"; +{more} more" if more > 0 else ""))
    return " | ".join(parts) or "no kernels"


_RECORDS: list[SignatureCounters] = []
_RECORDS_LOCK = threading.Lock()


def stats_records() -> list[dict]:
    """Every signature's record so far (what STITCH_STATS writes at exit)."""
    with _RECORDS_LOCK:
        return [r.as_dict() for r in _RECORDS]


def write_stats(path: str | None = None) -> str | None:
    """Write the records as JSON to ``path`` (default STITCH_STATS); the path written."""
    path = path or (setting_raw("STITCH_STATS") or "").strip() or None
    if path is None:
        return None
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(stats_records(), f, indent=1)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("STITCH_STATS=%s: cannot write the stats: %s", path, exc)
        with contextlib.suppress(OSError):
            os.unlink(tmp)                 # a full disk or a failed rename leaves nothing
        return None
    return path


_FUNCTION_KEYS: dict[str, int] = {}
_FUNCTION_KEYS_LOCK = threading.Lock()


def _function_key(qualname: str) -> str:
    """A name for a function the same in every process of an SPMD job: its name and how
    many functions of that name asked before it (asked at first compile, in call order)."""
    with _FUNCTION_KEYS_LOCK:
        index = _FUNCTION_KEYS.get(qualname, 0)
        _FUNCTION_KEYS[qualname] = index + 1
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in qualname)[:80]
    return f"{safe}.{index}"


def register_record(record: SignatureCounters) -> None:
    """Add ``record`` to what STITCH_STATS writes at exit."""
    with _RECORDS_LOCK:
        if not _RECORDS and (setting_raw("STITCH_STATS") or "").strip():
            atexit.register(write_stats)
        if len(_RECORDS) < MAX_RECORDS:
            _RECORDS.append(record)


@dataclass
class SwitchStats:
    """What one stitched function did (all signatures together)."""
    calls: int = 0
    stitched_calls: int = 0
    compile_seconds: float = 0.0
    switched_at_call: int | None = None        # the first call served by stitched kernels
    kernels_before: int | None = None          # plan baseline (XLA-like) kernels
    kernels_after: int | None = None           # kernels of the stitched plan
    stitched_kernels: int | None = None        # of those, built as stitched FFI kernels
    signatures: int = 0
    fallbacks: list[str] = field(default_factory=list)
    guard: dict = field(default_factory=dict)    # the guard's timings and decision

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class SwitchEntry:
    """One input signature: compiling → ready → (failed | stock-faster); compiling →
    dropped (cancelled while waiting in the compile queue) → compiling on its next call."""
    state: str = "compiling"
    future: Future | None = None
    program: Any = None                 # stitch.xla_pass.entry.PassReport
    call: Callable | None = None        # the jitted stitched program
    verified: bool = False
    reason: str = ""
    trial_stitched: list[float] = field(default_factory=list)   # guard timings (s)
    trial_stock: list[float] = field(default_factory=list)
    guard_lock: threading.Lock = field(default_factory=threading.Lock)
    compiled_ok: bool = False           # the compile succeeded (stays so: wait() is monotonic)
    # Set once the compile was handed on (``future`` set) or failed before that: wait() must
    # not take an entry whose compile is still being submitted for one that never will be.
    submitted: threading.Event = field(default_factory=threading.Event)
    counters: SignatureCounters = field(default_factory=lambda: SignatureCounters(""))
    # In a multi-process job (job_decisions.py): the job's agreement about this signature,
    # the n-th signature of its function, the call this process promised not to pass
    # undecided, the call the job switches at.
    agreement: Any = None
    signature_index: int = 0
    proposed: bool = False
    promise_call: int = 0
    switch_at: int | None = None


class SwitchingFunction:
    """Bookkeeping base; subclasses set ``stock`` and implement ``_start_compile``."""

    stock_name = "XLA"                 # the stock path, as log lines name it
    entry_type: type = SwitchEntry
    job_decisions = False              # decide with the other processes of a jax job

    def _init_switching(self, guard: bool) -> None:
        self.guard = guard
        self.stats = SwitchStats()
        self._entries: dict[Any, SwitchEntry] = {}
        self._lock = threading.Lock()
        self._job_key: str | None = None
        self._undecided = 0            # entries waiting for the job's decision

    def _start_compile(self, entry: SwitchEntry, args: tuple, kwargs: dict,
                       call_number: int) -> None:
        raise NotImplementedError

    # --- calls --------------------------------------------------------------------------
    def _count_call(self, key: Any, args: tuple, kwargs: dict
                    ) -> tuple[SwitchEntry | None, int]:
        """Count the call; a signature seen for the first time starts its compile."""
        with self._lock:
            self.stats.calls += 1
            call_number = self.stats.calls
            entry = self._entries.get(key) if key is not None else None
            start = key is not None and entry is None
            if entry is not None and entry.state == "dropped":   # back in the compile queue
                entry.submitted.clear()
                entry.state = entry.counters.state = "compiling"
                entry.counters.fallback_reason = ""
                start = True
            elif start:
                entry = self._entries[key] = self.entry_type()
                entry.counters = SignatureCounters(self.__qualname__)
                register_record(entry.counters)
                self.stats.signatures += 1
                entry.signature_index = self.stats.signatures
                while len(self._entries) > MAX_SIGNATURES:     # oldest first, as jax's cache
                    evicted = self._entries.pop(next(iter(self._entries)))
                    evicted.call = evicted.program = None
                    if evicted.state == "deciding":   # evicted alike in every process
                        evicted.state = "failed"
                        self._undecided -= 1
                    if evicted.future is not None:
                        evicted.future.cancel()                  # if it is still waiting
            if entry is not None:
                entry.counters.calls += 1
        if start:
            try:
                if self.job_decisions and entry.agreement is None:
                    entry.agreement = self._job_agreement(entry)
                self._start_compile(entry, args, kwargs, call_number)
            finally:
                entry.submitted.set()
        return entry, call_number

    def _count_stitched(self, entry: SwitchEntry, call_number: int) -> None:
        with self._lock:
            self.stats.stitched_calls += 1
            entry.counters.stitched_calls += 1
            if self.stats.switched_at_call is None:
                self.stats.switched_at_call = call_number
                log.info("%s: switched to stitched kernels at call %d (%s kernels -> %s, "
                         "%s stitched)", self.__qualname__, call_number,
                         self.stats.kernels_before, self.stats.kernels_after,
                         self.stats.stitched_kernels)

    def _program_ready(self, entry: SwitchEntry, program: Any, elapsed: float) -> None:
        """Record a built program (stats from its summary()); the entry switches on its next
        call."""
        summary = program.summary()
        with self._lock:
            self.stats.compile_seconds += elapsed
            self.stats.kernels_before = summary["kernels_before"]
            self.stats.kernels_after = summary["kernels_after"]
            self.stats.stitched_kernels = summary["stitched_kernels"]
            entry.counters.compile_s = elapsed
            entry.counters.kernels_xla = summary["kernels_before"]
            entry.counters.kernels_stitched = summary["stitched_kernels"]
            entry.counters.delivered = {k: summary[k] for k in DELIVERY_KEYS if k in summary}
            entry.counters.state = "ready"
            sources = program.sources() if hasattr(program, "sources") else {}
            entry.counters.where = sources
        if sources:
            log.info("%s: %s", self.__qualname__, where_line(sources))
        entry.program = program
        entry.compiled_ok = True
        if entry.agreement is None:
            entry.state = "ready"
            return
        from .job_decisions import program_digest
        try:
            digest, problem = program_digest(program), ""
        except Exception as exc:  # noqa: BLE001 - the job then stays on stock
            digest, problem = None, f"no digest of its program: {exc}"
        self._propose(entry, digest, problem)

    def _compile_failed(self, entry: SwitchEntry, elapsed: float, exc: BaseException,
                        xla_said: str = "") -> None:
        """``xla_said``: the gist of XLA's own log lines during the attempt (one line)."""
        with self._lock:
            self.stats.compile_seconds += elapsed
            entry.counters.compile_s = elapsed
        from stitch.errors import Cancelled
        if isinstance(exc, Cancelled):
            # The program is ending (compiles are cancelled only at exit): not a failure of
            # stitch's, and nothing falls back — the calls made all ran on stock XLA.
            reason = f"compile stopped after {elapsed:.1f}s: the program ended first ({exc})"
            entry.state, entry.reason, entry.call = "cancelled", reason, None
            entry.counters.state, entry.counters.fallback_reason = "cancelled", reason
            log.info("%s: %s", self.__qualname__, reason)
            if entry.agreement is not None:
                self._job_fail(entry, reason)
        elif isinstance(exc, KeyboardInterrupt):
            self._fail(entry, f"compile interrupted after {elapsed:.1f}s (KeyboardInterrupt)")
        else:
            said = f" (XLA's log: {xla_said})" if xla_said else ""
            self._fail(entry, f"compile failed after {elapsed:.1f}s: {type(exc).__name__}: "
                              f"{exc}{said}")

    def _dropped_from_queue(self, entry: SwitchEntry) -> None:
        """Its compile was cancelled before it started (newer signatures filled the compile
        queue, or the signature was evicted): stock until its next call queues it again."""
        reason = "dropped from the compile queue before it started (newer compiles waiting)"
        if entry.agreement is not None:
            # The job agrees once per signature: a compile some process dropped is one the
            # job does without (whether a queue overflows is each process's own timing).
            if entry.state == "compiling":
                self._fail(entry, reason)
            return
        with self._lock:
            if entry.state != "compiling":
                return
            entry.state = entry.counters.state = "dropped"
            entry.counters.fallback_reason = reason
        log.info("%s: one signature's compile was %s; it is queued again on its next call",
                 self.__qualname__, reason)

    def _fail(self, entry: SwitchEntry, reason: str, quiet: bool = False) -> None:
        """The signature stays on stock for good; said as a warning unless ``quiet`` (the
        caller already gets the same error from the stock call)."""
        was_deciding = entry.state == "deciding"
        entry.state, entry.reason, entry.call = "failed", reason, None
        entry.counters.state, entry.counters.fallback_reason = "failed", reason
        with self._lock:
            self.stats.fallbacks.append(reason)
            if was_deciding:
                self._undecided -= 1
        if entry.agreement is not None:
            self._job_fail(entry, reason)
        (log.debug if quiet else log.warning)("%s: falls back to %s: %s", self.__qualname__,
                                              self.stock_name, reason)

    # --- the guard ----------------------------------------------------------------------
    def _in_guard_trial(self, entry: SwitchEntry) -> bool:
        return self.guard and entry.state == "ready" and len(entry.trial_stock) < GUARD_CALLS

    @staticmethod
    def _stitched_turn(entry: SwitchEntry) -> bool:
        with entry.guard_lock:
            return len(entry.trial_stitched) <= len(entry.trial_stock)

    def _guard_record(self, entry: SwitchEntry, stitched_turn: bool, elapsed: float) -> None:
        """One timed trial call; after GUARD_CALLS stock ones the faster path stays. The
        first stitched call also compiled: the median leaves it out."""
        if entry.state != "ready":
            return
        with entry.guard_lock:
            (entry.trial_stitched if stitched_turn else entry.trial_stock).append(elapsed)
            if stitched_turn or len(entry.trial_stock) != GUARD_CALLS:
                return
            stitched_ms = 1e3 * float(np.median(entry.trial_stitched[1:]
                                                or entry.trial_stitched))
            stock_ms = 1e3 * float(np.median(entry.trial_stock))
        kept = "xla" if stitched_ms > stock_ms else "stitched"
        job_reason = ""
        if entry.agreement is not None:
            # One verdict for the job: process 0's timings (waited for, bounded, elsewhere).
            verdict = entry.agreement.verdict({"kept": kept, "stitched_ms": stitched_ms,
                                               "stock_ms": stock_ms})
            kept = "stitched" if verdict.get("kept") == "stitched" else "xla"
            stitched_ms = float(verdict.get("stitched_ms", stitched_ms))
            stock_ms = float(verdict.get("stock_ms", stock_ms))
            job_reason = str(verdict.get("reason", ""))
        with self._lock:
            self.stats.guard = {"stitched_ms": stitched_ms, "stock_ms": stock_ms, "kept": kept}
        if job_reason:
            entry.state = entry.counters.state = "stock-faster"
            entry.counters.fallback_reason = job_reason
            log.warning("%s: the job stays on %s: %s", self.__qualname__, self.stock_name,
                        job_reason)
        elif kept == "xla":
            entry.state = "stock-faster"
            entry.counters.state = "stock-faster"
            log.info("%s: stays on %s on this device: stitched %.3f ms vs %s %.3f ms per "
                     "call (STITCH_GUARD=0 keeps the stitched kernels)", self.__qualname__,
                     self.stock_name, stitched_ms, self.stock_name, stock_ms)
        else:
            log.info("%s: keeps the stitched kernels: %.3f ms vs %s %.3f ms per call",
                     self.__qualname__, stitched_ms, self.stock_name, stock_ms)

    # --- one decision per job (job_decisions.py) -----------------------------------------
    def _job_agreement(self, entry: SwitchEntry) -> Any:
        """The job's agreement about ``entry`` when this process is one of several in a
        jax.distributed job, else None (the process decides alone)."""
        from .job_decisions import SignatureAgreement, current_store
        store = current_store()
        if store is None:
            return None
        if self._job_key is None:
            self._job_key = _function_key(self.__qualname__)
        return SignatureAgreement(store, self._job_key, entry.signature_index)

    def _propose(self, entry: SwitchEntry, digest: str | None, problem: str) -> None:
        """Tell the job this process's compile ended; it will not pass the promised call
        (two calls on: a call already counted but not yet gated may be under way) without
        the job's decision. Any thread."""
        with self._lock:
            if entry.proposed:
                return
            entry.proposed = True
            entry.promise_call = self.stats.calls + 2
            if digest is not None:
                entry.state = entry.counters.state = "deciding"
                self._undecided += 1
        entry.agreement.propose(entry.promise_call, digest, problem)

    def _job_fail(self, entry: SwitchEntry, reason: str) -> None:
        """This process cannot go on with what the job chose: before the decision, its
        proposal says so (the job stays stock); during the guard's trial, the verdict
        becomes "xla" for every process."""
        if not entry.proposed:
            self._propose(entry, None, reason)
        elif entry.switch_at is not None:
            entry.agreement.refuse(reason)

    def _job_gate(self, call_number: int) -> None:
        """On the calling thread, before a call runs: each signature waiting for the job
        gets its decision at the call this process promised (a bounded wait), and switches
        at the call the job chose."""
        if not self._undecided:
            return
        with self._lock:
            waiting = [e for e in self._entries.values() if e.state == "deciding"]
        for entry in waiting:
            if entry.switch_at is None:
                if call_number < entry.promise_call:
                    continue
                decision = entry.agreement.decide()
                if not decision.switch:
                    self._fail(entry, f"the job stays on {self.stock_name}: {decision.reason}")
                    continue
                entry.switch_at = decision.at_call
                log.info("%s: the job (%d processes) switches at call %d",
                         self.__qualname__, entry.agreement.store.size, decision.at_call)
            if call_number >= entry.switch_at:
                with self._lock:
                    entry.state = entry.counters.state = "ready"
                    self._undecided -= 1

    # --- waiting ------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> bool:
        """Block until every signature seen so far has finished compiling; True when every
        compile succeeded (False: one failed or the timeout passed). A later guard decision
        or run failure does not turn a True into a False: see ``stats`` for those."""
        with self._lock:
            entries = list(self._entries.values())
        deadline = None if timeout is None else time.monotonic() + timeout
        for e in entries:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not e.submitted.wait(left):
                return False
            if e.future is None:
                continue
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                e.future.result(left)
            except Exception:  # noqa: BLE001 - timeouts and failures both mean "not ready"
                return False
            except BaseException:  # noqa: BLE001 - a compile interrupted by Ctrl-C
                if e.state != "compiling":
                    return False
                raise
        return all(e.compiled_ok for e in entries)

    def programs(self) -> list[Any]:
        """What the pass did for each compiled signature so far (``PassReport``: plan,
        placed kernels with their Kernel IR, skipped kernels with reasons, timings)."""
        with self._lock:
            return [e.program for e in self._entries.values() if e.program is not None]
