"""The GPU pass's PTX children start when its compile begins (PassRequest.__enter__), so
their start-up overlaps XLA's own passes; the pass takes them, and whatever is not taken is
closed when the compile ends."""
from __future__ import annotations

import pytest

from integration import xla_pass
from integration.xla_pass import PassRequest


@pytest.fixture(autouse=True)
def _one_build_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STITCH_BUILD_THREADS", "1")


def test_started_on_enter_and_closed_on_exit_when_not_taken() -> None:
    request = PassRequest("f", "h100", "gpu", compile_only=True)
    with request:
        workers = list(request._ptx_workers)
        assert len(workers) == 1 and workers[0].pid is not None
    assert workers[0].pid is None and request._ptx_workers == []


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
