"""One decision per job: in a multi-process jax job (``jax.distributed``), every process
switches a signature to its stitched executable at the same call and keeps or drops it
together.

Each process compiles alone (``stitch.jit``'s compile thread); what the processes agree on
goes through jax.distributed's key-value store, never through a collective:

- **Proposal** (any thread, once per signature): when a process's compile ends it writes
  ``<prefix>/proposal/<rank>``: built or not (with the reason), a digest of the program it
  built (its kernels' Kernel IR) and the call number ``p`` it promises not to pass without
  the job's decision.
- **Decision** (the calling thread, at call ``p``): wait (bounded) for every rank's proposal;
  all built the same program → switch at ``max(p)``; else stock, saying which process and
  why. Written with first-writer-wins (``key_value_set`` without overwrite): a process that
  timed out writes "stock" and whoever comes later reads that instead of deciding again, so
  no two processes can leave with different decisions.
- **Guard verdict**: process 0's timings decide keep or drop; the others wait for it
  (bounded; a timeout writes "stock" the same first-writer-wins way).

Every wait is bounded by ``DECISION_TIMEOUT_S``; a timeout or a store that cannot be reached
means stock on every process, logged with the reason. Key names are made of the function's
name, its creation index among functions of that name, and the signature's index: the same
in every process of an SPMD program.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("stitch.jit")

# Bounded wait for another process's proposal or verdict; past it the job runs stock.
DECISION_TIMEOUT_S = 300.0
_PREFIX = "stitch/v1"


@dataclass(frozen=True)
class JobDecision:
    """What the job decided for one signature: switch at ``at_call``, or stay on stock."""
    switch: bool
    at_call: int = 0
    reason: str = ""

    def encode(self) -> str:
        return json.dumps({"switch": self.switch, "at_call": self.at_call,
                           "reason": self.reason}, sort_keys=True)

    @classmethod
    def decode(cls, text: str) -> "JobDecision":
        try:
            data = json.loads(text)
            return cls(bool(data["switch"]), int(data["at_call"]), str(data["reason"]))
        except (ValueError, KeyError, TypeError):
            return cls(False, 0, f"unreadable job decision {text[:80]!r}")


class JobStore:
    """The job's key-value store (jax.distributed's coordination service), as four calls
    that never raise: ``put`` (once), ``claim`` (first writer wins), ``wait``, ``peek``."""

    def __init__(self, client: Any, rank: int, size: int):
        self.client = client
        self.rank = rank
        self.size = size

    def put(self, key: str, value: str) -> bool:
        try:
            self.client.key_value_set(key, value, allow_overwrite=True)
            return True
        except Exception as exc:  # noqa: BLE001 - the job then decides stock on a timeout
            log.warning("job store: cannot write %s: %s", key, exc)
            return False

    def claim(self, key: str, value: str, timeout_s: float = 10.0) -> str | None:
        """Write ``value`` unless the key exists; the value the key holds after (ours or the
        first writer's). None when the store cannot be reached."""
        try:
            self.client.key_value_set(key, value, allow_overwrite=False)
            return value
        except Exception:  # noqa: BLE001 - ALREADY_EXISTS, or the store is gone
            return self.wait(key, timeout_s)

    def wait(self, key: str, timeout_s: float) -> str | None:
        try:
            return self.client.blocking_key_value_get(key, max(1, int(timeout_s * 1e3)))
        except Exception:  # noqa: BLE001 - DEADLINE_EXCEEDED or unreachable
            return None

    def peek(self, key: str) -> str | None:
        try:
            return self.client.key_value_try_get(key)
        except Exception:  # noqa: BLE001 - NOT_FOUND
            return None


def current_store() -> JobStore | None:
    """The job's store when this process is one of several (jax.distributed initialized,
    more than one process), else None: a single process decides alone."""
    import jax
    try:
        if not jax.distributed.is_initialized() or jax.process_count() <= 1:
            return None
        # jax exposes the coordination client only here (no public accessor in 0.10/0.11).
        from jax._src import distributed
        client = distributed.global_state.client
    except Exception as exc:  # noqa: BLE001 - no job: decide alone
        log.debug("no jax.distributed job store: %s", exc)
        return None
    if client is None:
        return None
    return JobStore(client, jax.process_index(), jax.process_count())


def program_digest(report: Any) -> str:
    """What must be equal on every process for them to run the same executable: the placed
    kernels' Kernel IR (names included), in name order."""
    from stitch.codegen.gpu_cache import kernel_ir_text
    h = hashlib.sha256()
    for built in sorted(report.kernels, key=lambda k: k.name):
        h.update(built.name.encode())
        h.update(kernel_ir_text(built.lowered.kernel).encode())
    return h.hexdigest()[:32]


class SignatureAgreement:
    """The job's agreement about one signature of one function (module docstring)."""

    def __init__(self, store: JobStore, function_key: str, signature: int):
        self.store = store
        self.prefix = f"{_PREFIX}/{function_key}/sig{signature}"
        self.function_key = function_key

    # --- the switch ---------------------------------------------------------------------
    def propose(self, promise_call: int, digest: str | None, problem: str = "") -> None:
        """This process's compile ended: built (``digest`` of its program) or not
        (``problem``); it will not pass call ``promise_call`` without the job's decision.
        A failure decides the job at once (nothing to wait for)."""
        value = json.dumps({"call": promise_call, "digest": digest, "problem": problem})
        self.store.put(f"{self.prefix}/proposal/{self.store.rank}", value)
        if digest is None:
            self.store.claim(f"{self.prefix}/decision", JobDecision(
                False, 0, f"process {self.store.rank} could not build it: {problem}").encode())

    def decide(self, timeout_s: float | None = None) -> JobDecision:
        """The job's decision, waiting (bounded) for every process's proposal. Called on
        the calling thread at the promised call; the same answer on every process."""
        timeout_s = DECISION_TIMEOUT_S if timeout_s is None else timeout_s
        key = f"{self.prefix}/decision"
        known = self.store.peek(key)
        if known is not None:
            return JobDecision.decode(known)
        deadline = time.monotonic() + timeout_s
        proposals = []
        for rank in range(self.store.size):
            text = self.store.wait(f"{self.prefix}/proposal/{rank}",
                                   max(0.0, deadline - time.monotonic()))
            if text is None:
                return self._claim(JobDecision(False, 0, f"no word from process {rank} "
                                               f"within {timeout_s:.0f}s"))
            try:
                proposals.append(json.loads(text))
            except ValueError:
                return self._claim(JobDecision(False, 0, f"process {rank}'s proposal is "
                                               "unreadable"))
        return self._claim(_agree(proposals))

    def _claim(self, decision: JobDecision) -> JobDecision:
        final = self.store.claim(f"{self.prefix}/decision", decision.encode())
        if final is None:
            return JobDecision(False, 0, "the job's key-value store cannot be reached")
        return JobDecision.decode(final)

    # --- the guard ----------------------------------------------------------------------
    def verdict(self, local: dict, timeout_s: float | None = None) -> dict:
        """The guard's job-wide verdict: process 0's (``local`` there), waited for
        elsewhere. ``{"kept": "stitched"|"xla", "stitched_ms", "stock_ms", "reason"}``."""
        timeout_s = DECISION_TIMEOUT_S if timeout_s is None else timeout_s
        key = f"{self.prefix}/verdict"
        if self.store.rank == 0:
            final = self.store.claim(key, json.dumps(local, sort_keys=True))
        else:
            final = self.store.wait(key, timeout_s)
            if final is None:
                final = self.store.claim(key, json.dumps(
                    {"kept": "xla", "reason": f"no guard verdict from process 0 within "
                                              f"{timeout_s:.0f}s"}))
        if final is None:
            return {"kept": "xla", "reason": "the job's key-value store cannot be reached"}
        try:
            return dict(json.loads(final))
        except (ValueError, TypeError):
            return {"kept": "xla", "reason": f"unreadable guard verdict {final[:80]!r}"}


    def refuse(self, reason: str) -> None:
        """This process's stitched program failed during the guard's trial: the verdict is
        "xla" for every process (unless one was given already)."""
        self.store.claim(f"{self.prefix}/verdict", json.dumps(
            {"kept": "xla", "reason": f"process {self.store.rank}: {reason}"}))


def _agree(proposals: list[dict]) -> JobDecision:
    """Every process's proposal → the decision (a pure function: each process that computes
    it computes the same one)."""
    for rank, p in enumerate(proposals):
        if not p.get("digest"):
            return JobDecision(False, 0, f"process {rank} could not build it: "
                                         f"{p.get('problem') or 'no reason given'}")
    digests = {p["digest"] for p in proposals}
    if len(digests) > 1:
        return JobDecision(False, 0, f"the processes built {len(digests)} different programs "
                                     "(plans differ); every process stays on stock")
    return JobDecision(True, max(int(p["call"]) for p in proposals))
