"""Cooperative cancellation of planning.

``stitch.plan(..., cancel=callable)`` (or ``ExplorerOptions.cancel``) hands the planner a
callable that returns True once planning should stop. The planner's loops call a
``CancelPoll`` at every unit of work (a pattern scored, a vertex explored, a merge tried, a
refinement move, a schedule tuned, a BLP solve); the poll asks the callable at most every
``interval`` seconds, so polling costs nothing measurable, and raises ``PlanCancelled``.
"""
from __future__ import annotations

import time
from typing import Callable

from ..errors import PlanCancelled

# How often the cancel callable is asked, in seconds of planning work.
POLL_INTERVAL_S = 0.05


class CancelPoll:
    """Call it often; it raises PlanCancelled once ``cancel()`` has returned True."""

    def __init__(self, cancel: Callable[[], bool] | None = None,
                 interval: float = POLL_INTERVAL_S):
        self.cancel = cancel
        self.interval = interval
        self._next = 0.0

    def __call__(self) -> None:
        if self.cancel is None:
            return
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval
        if self.cancel():
            raise PlanCancelled("planning was cancelled")

    def now(self) -> None:
        """Ask the callable whatever the time since the last poll (before a long step)."""
        self._next = 0.0
        self()


NEVER = CancelPoll(None)
