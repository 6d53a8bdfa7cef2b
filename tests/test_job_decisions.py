"""The job's agreement (stitch.frontends.job_decisions) on an in-memory store that behaves
as jax.distributed's: switch at the largest promised call when every process built the same
program; stock, the same for everyone, when one did not build, built another program or
did not answer in time; the guard's verdict is process 0's."""
from __future__ import annotations

import random
import threading

import pytest

from stitch.frontends.job_decisions import JobDecision, JobStore, SignatureAgreement


class FakeClient:
    """jax's DistributedRuntimeClient's key-value calls, in memory."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.changed = threading.Condition()

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        with self.changed:
            if key in self.values and not allow_overwrite:
                raise RuntimeError(f"ALREADY_EXISTS: {key}")
            self.values[key] = value
            self.changed.notify_all()

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.values, timeout_in_ms / 1e3):
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            return self.values[key]

    def key_value_try_get(self, key: str) -> str:
        with self.changed:
            if key not in self.values:
                raise RuntimeError(f"NOT_FOUND: {key}")
            return self.values[key]


def _agreements(size: int) -> list[SignatureAgreement]:
    client = FakeClient()
    return [SignatureAgreement(JobStore(client, rank, size), "step.0", 1)
            for rank in range(size)]


def test_every_process_switches_at_the_largest_promised_call():
    processes = _agreements(4)
    calls = [random.randint(3, 40) for _ in processes]
    for p, call in zip(processes, calls):
        p.propose(call, "same-program")
    decisions = {p.decide(1.0) for p in random.sample(processes, len(processes))}
    assert decisions == {JobDecision(True, max(calls))}


def test_one_process_that_cannot_build_takes_every_process_to_stock():
    processes = _agreements(3)
    processes[0].propose(5, "program")
    processes[2].propose(6, None, "LLVM refused a kernel")
    processes[1].propose(7, "program")
    decisions = {p.decide(1.0) for p in processes}
    assert len(decisions) == 1
    decision = decisions.pop()
    assert not decision.switch and "process 2" in decision.reason
    assert "LLVM refused" in decision.reason


def test_different_programs_are_not_run_together():
    processes = _agreements(2)
    processes[0].propose(5, "program-a")
    processes[1].propose(5, "program-b")
    assert {p.decide(1.0).switch for p in processes} == {False}


def test_a_process_that_times_out_decides_stock_for_everyone_after_it():
    processes = _agreements(2)
    processes[0].propose(5, "program")
    early = processes[0].decide(0.2)           # process 1 has not proposed in time
    assert not early.switch and "process 1" in early.reason
    processes[1].propose(9, "program")        # late: the decision stands
    assert processes[1].decide(1.0) == early


@pytest.mark.parametrize("kept", ["stitched", "xla"])
def test_the_guard_verdict_is_process_zeros(kept):
    processes = _agreements(3)
    other = "xla" if kept == "stitched" else "stitched"
    answers: dict[int, dict] = {}
    threads = [threading.Thread(target=lambda p=p: answers.__setitem__(
        p.store.rank, p.verdict({"kept": other, "stitched_ms": 9.0, "stock_ms": 1.0}, 5.0)))
        for p in processes[1:]]
    for t in threads:
        t.start()
    answers[0] = processes[0].verdict({"kept": kept, "stitched_ms": 1.0, "stock_ms": 2.0})
    for t in threads:
        t.join()
    assert {a["kept"] for a in answers.values()} == {kept}
    assert {a["stitched_ms"] for a in answers.values()} == {1.0}


def test_no_verdict_in_time_drops_the_stitched_program_everywhere():
    processes = _agreements(2)
    late = processes[1].verdict({"kept": "stitched"}, 0.2)
    assert late["kept"] == "xla" and "process 0" in late["reason"]
    assert processes[0].verdict({"kept": "stitched"})["kept"] == "xla"


def test_a_stitched_call_failing_in_the_trial_drops_the_program_everywhere():
    processes = _agreements(2)
    processes[1].refuse("stitched call failed: boom")
    verdicts = [p.verdict({"kept": "stitched", "stitched_ms": 1.0, "stock_ms": 2.0}, 1.0)
                for p in processes]
    assert [v["kept"] for v in verdicts] == ["xla", "xla"]
    assert all("process 1" in v["reason"] for v in verdicts)
