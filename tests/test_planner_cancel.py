"""Cancellation inside the planner: stitch.plan(..., cancel=callable) stops within ~0.5 s of
planning work after the callable turns True, with PlanCancelled (a StitchError)."""
from __future__ import annotations

import time

import pytest

import stitch
from bench.planner import elementwise_chain_hlo
from stitch.errors import PlanCancelled, StitchError
from stitch.explorer.planner import ExplorerOptions


def _after(seconds: float):
    deadline = time.monotonic() + seconds
    return lambda: time.monotonic() >= deadline


def test_plan_cancelled_is_a_stitch_error():
    assert issubclass(PlanCancelled, StitchError)
    assert stitch.errors.PlanCancelled is PlanCancelled


def test_a_2000_op_chain_cancelled_after_0_2_s_returns_within_2_s():
    text = elementwise_chain_hlo(2000)
    module = stitch.parse_hlo(text)
    start = time.monotonic()
    with pytest.raises(PlanCancelled):
        stitch.plan(module, "h100", "beam", cancel=_after(0.2))
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize("planner", ["beam", "blp"])
def test_cancel_through_options_stops_every_planner(planner):
    text = elementwise_chain_hlo(600)
    start = time.monotonic()
    with pytest.raises(PlanCancelled):
        stitch.plan(text, "a100", planner, ExplorerOptions(cancel=_after(0.3)))
    assert time.monotonic() - start < 2.5


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
