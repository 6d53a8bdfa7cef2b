"""Cancellation inside the planner: stitch.plan(..., cancel=callable) stops within ~0.5 s of
planning work after the callable turns True, with PlanCancelled (a StitchError)."""
from __future__ import annotations

import time

import pytest

import stitch
from bench.planner.scale import elementwise_chain_hlo
from stitch.errors import PlanCancelled, StitchError
from stitch.explorer.planner import ExplorerOptions


class _FiresOnPoll:
    """Turns True from its n-th poll on and remembers when: the test then times the planner
    from the moment cancellation was asked for, not from a wall-clock guess at how long
    planning takes (a fast machine finished a 600-op plan before a 0.3 s timer fired)."""

    def __init__(self, poll: int):
        self.poll = poll
        self.polls = 0
        self.fired_at: float | None = None

    def __call__(self) -> bool:
        self.polls += 1
        if self.polls >= self.poll and self.fired_at is None:
            self.fired_at = time.monotonic()
        return self.fired_at is not None


def test_plan_cancelled_is_a_stitch_error():
    assert issubclass(PlanCancelled, StitchError)
    assert stitch.errors.PlanCancelled is PlanCancelled


def test_a_2000_op_chain_cancelled_mid_plan_returns_within_2_s():
    text = elementwise_chain_hlo(2000)
    module = stitch.parse_hlo(text)
    cancel = _FiresOnPoll(2)
    with pytest.raises(PlanCancelled):
        stitch.plan(module, "h100", "beam", cancel=cancel)
    assert cancel.fired_at is not None
    assert time.monotonic() - cancel.fired_at < 2.0


@pytest.mark.parametrize("planner", ["beam", "blp"])
def test_cancel_through_options_stops_every_planner(planner):
    text = elementwise_chain_hlo(600)
    cancel = _FiresOnPoll(2)
    with pytest.raises(PlanCancelled):
        stitch.plan(text, "a100", planner, ExplorerOptions(cancel=cancel))
    assert cancel.fired_at is not None
    assert time.monotonic() - cancel.fired_at < 2.0


def test_a_cancel_that_never_fires_changes_nothing():
    text = elementwise_chain_hlo(40)
    calls = []

    def never() -> bool:
        calls.append(1)
        return False
    plain = stitch.plan(text, "h100", "beam")
    polled = stitch.plan(text, "h100", "beam", cancel=never)
    assert [k.members for k in polled.kernels] == [k.members for k in plain.kernels]
    assert calls, "the planner never polled its cancel callable"
