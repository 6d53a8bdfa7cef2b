"""The pass stores its lowerings while the PTX builds run (pass_planning._in_background):
the work is done when the block is left, an error of the work reaches the pass, and an error
of the block is not hidden by it."""
from __future__ import annotations

import random
import threading

import pytest

from stitch.xla_pass import pass_planning


def test_work_is_complete_when_the_block_ends():
    done: list[int] = []
    release = threading.Event()
    values = [random.randint(0, 10**6) for _ in range(3)]

    def store(value: int) -> None:
        assert release.wait(10)
        done.append(value)

    with pass_planning._in_background([lambda v=v: store(v) for v in values], "t"):
        assert done == []                  # waiting on the event: not done before
        release.set()
    assert done == values


def test_an_error_of_the_work_reaches_the_caller():
    marker = f"store failed {random.random()}"

    def broken() -> None:
        raise OSError(marker)

    with pytest.raises(OSError, match=marker):
        with pass_planning._in_background([broken], "t"):
            pass


def test_the_blocks_own_error_wins():
    ran: list[bool] = []
    with pytest.raises(KeyError):
        with pass_planning._in_background([lambda: ran.append(True)], "t"):
            raise KeyError("the block's")
    assert ran == [True]                   # waited for, even so
