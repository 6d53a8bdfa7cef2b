"""stitch.xla_pass.collector: the pass runs with fewer garbage collections, and puts the
process's thresholds back."""
from __future__ import annotations

import gc
import threading

import pytest

from stitch.xla_pass import collector
from stitch.xla_pass.collector import PASS_GEN0_THRESHOLD, fewer_collections


@pytest.fixture(autouse=True)
def _thresholds():
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)


def test_raised_inside_and_restored_after() -> None:
    with fewer_collections():
        assert gc.get_threshold() == (PASS_GEN0_THRESHOLD, 10, 10)
        with fewer_collections():                       # nested: one raise
            assert gc.get_threshold()[0] == PASS_GEN0_THRESHOLD
        assert gc.get_threshold()[0] == PASS_GEN0_THRESHOLD
    assert gc.get_threshold() == (700, 10, 10)


def test_restored_after_an_exception() -> None:
    with pytest.raises(RuntimeError):
        with fewer_collections():
            raise RuntimeError("pass failed")
    assert gc.get_threshold() == (700, 10, 10)


def test_concurrent_passes_restore_once_the_last_ends() -> None:
    entered, release = threading.Barrier(2), threading.Event()

    def other_pass() -> None:
        with fewer_collections():
            entered.wait()
            release.wait(10)

    thread = threading.Thread(target=other_pass)
    thread.start()
    with fewer_collections():
        entered.wait()
    assert gc.get_threshold()[0] == PASS_GEN0_THRESHOLD     # the other pass still runs
    release.set()
    thread.join()
    assert gc.get_threshold() == (700, 10, 10) and collector._active == 0


def test_leaves_off_and_higher_and_foreign_thresholds_alone() -> None:
    gc.set_threshold(0, 10, 10)                          # automatic collection off
    with fewer_collections():
        assert gc.get_threshold()[0] == 0
    gc.set_threshold(500_000, 10, 10)                    # already higher
    with fewer_collections():
        assert gc.get_threshold()[0] == 500_000
    assert gc.get_threshold()[0] == 500_000
    gc.set_threshold(700, 10, 10)
    with fewer_collections():
        gc.set_threshold(2_000, 5, 5)                    # the program changed them meanwhile
    assert gc.get_threshold() == (2_000, 5, 5)


def test_the_pass_runs_under_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """stitch_module_text's work (parse, plan, build) sees the raised threshold."""
    from stitch.xla_pass import pass_registration, entry as xla_pass

    seen: list[int] = []

    def fake_stitch_module(module, request):
        seen.append(gc.get_threshold()[0])
        raise RuntimeError("stop here")

    monkeypatch.setattr(pass_registration, "stitch_module", fake_stitch_module)
    text = "HloModule m\n\nENTRY e {\n  ROOT p = f32[4] parameter(0)\n}\n"
    with pytest.raises(RuntimeError, match="stop here"):
        xla_pass.stitch_module_text(text, xla_pass.PassRequest("f", "h100", "cpu"))
    assert seen == [PASS_GEN0_THRESHOLD] and gc.get_threshold() == (700, 10, 10)
