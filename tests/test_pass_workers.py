"""The GPU pass's PTX children start when its compile begins (PassRequest.__enter__), so
their start-up overlaps XLA's own passes, where the machine has cores to spare for that
(``early_ptx_children``); else the pass starts them as it begins. The pass takes them, and
whatever is not taken is closed when the compile ends."""
from __future__ import annotations

import pytest

from integration import xla_pass
from integration.xla_pass import PassRequest


@pytest.fixture(autouse=True)
def _one_build_thread_started_early(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STITCH_BUILD_THREADS", "1")
    monkeypatch.setenv("STITCH_EARLY_PTX_CHILDREN", "1")


def test_started_on_enter_and_closed_on_exit_when_not_taken() -> None:
    request = PassRequest("f", "h100", "gpu", compile_only=True)
    with request:
        workers = list(request._ptx_workers)
        assert len(workers) == 1 and workers[0].pid is not None
    assert workers[0].pid is None and request._ptx_workers == []


def test_they_run_below_the_compiling_process_priority() -> None:
    import os
    with PassRequest("f", "h100", "gpu", compile_only=True) as request:
        (worker,) = request._ptx_workers
        own = os.getpriority(os.PRIO_PROCESS, 0)
        assert xla_pass.PTX_CHILD_NICE > 0
        assert os.getpriority(os.PRIO_PROCESS, worker.pid) == \
            min(19, own + xla_pass.PTX_CHILD_NICE)


def test_host_requests_start_none() -> None:
    with PassRequest("f", "h100", "cpu") as request:
        assert request._ptx_workers == []


def test_the_pass_takes_them_and_closes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list = []

    def fake_plan_and_build(module, request, timings, ptx_workers):
        seen.extend(ptx_workers)
        assert all(w.pid is not None for w in ptx_workers)
        raise RuntimeError("stop after the hand-over")

    monkeypatch.setattr(xla_pass, "_plan_and_build", fake_plan_and_build)
    request = PassRequest("f", "h100", "gpu", compile_only=True)
    with request:
        started = list(request._ptx_workers)
        with pytest.raises(RuntimeError, match="hand-over"):
            xla_pass.stitch_module(object(), request)
        assert seen == started and request._ptx_workers == []
        assert started[0].pid is None            # closed by the pass, not left to __exit__


def test_a_pass_without_an_entered_request_starts_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list = []
    monkeypatch.setattr(xla_pass, "_plan_and_build",
                        lambda module, request, timings, ptx_workers: seen.extend(ptx_workers))
    xla_pass.stitch_module(object(), PassRequest("f", "h100", "gpu", compile_only=True))
    assert len(seen) == 1 and seen[0].pid is None


def test_started_by_the_pass_where_early_start_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STITCH_EARLY_PTX_CHILDREN", "0")
    seen: list = []

    def fake_plan_and_build(module, request, timings, ptx_workers):
        seen.extend(ptx_workers)
        assert all(w.pid is not None for w in ptx_workers)

    monkeypatch.setattr(xla_pass, "_plan_and_build", fake_plan_and_build)
    with PassRequest("f", "h100", "gpu", compile_only=True) as request:
        assert request._ptx_workers == []
        xla_pass.stitch_module(object(), request)
    assert len(seen) == 1 and seen[0].pid is None


@pytest.mark.parametrize("cores, early", [(2, False), (8, False), (10, True), (64, True)])
def test_early_by_default_only_with_cores_to_spare(monkeypatch: pytest.MonkeyPatch,
                                                   cores: int, early: bool) -> None:
    monkeypatch.delenv("STITCH_EARLY_PTX_CHILDREN")
    monkeypatch.delenv("STITCH_BUILD_THREADS")
    monkeypatch.setattr(xla_pass.os, "cpu_count", lambda: cores)
    # One child per core up to MAX_BUILD_THREADS (8): only from 10 cores are two to spare.
    assert xla_pass.early_ptx_children() is early


def test_a_bad_setting_is_named_and_the_pass_still_gets_children(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("STITCH_EARLY_PTX_CHILDREN", "sometimes")
    seen: list = []
    monkeypatch.setattr(xla_pass, "_plan_and_build",
                        lambda module, request, timings, ptx_workers: seen.extend(ptx_workers))
    with caplog.at_level("WARNING", logger=xla_pass.log.name):
        with PassRequest("f", "h100", "gpu", compile_only=True) as request:
            assert request._ptx_workers == []
            xla_pass.stitch_module(object(), request)
    assert "STITCH_EARLY_PTX_CHILDREN='sometimes'" in caplog.text
    assert len(seen) == 1
