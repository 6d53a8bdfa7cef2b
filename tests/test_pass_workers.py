"""The GPU pass's PTX children start when its compile begins (PassRequest.__enter__), so
their start-up overlaps XLA's own passes, where the machine has cores to spare for that
(``early_ptx_children``); else the pass starts them as it begins. The pass takes them, and
gives them back to the process's children when it ends (``ptx_children``), as the request
does with any it did not hand over: the next compile gets the same, running, children."""
from __future__ import annotations

import pytest

from stitch.xla_pass import pass_planning, ptx_children, entry as xla_pass
from stitch.xla_pass.entry import PassRequest


def _idle(worker) -> bool:
    return worker in ptx_children.idle() and worker.pid is not None


@pytest.fixture(autouse=True)
def _one_build_thread_started_early(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STITCH_BUILD_THREADS", "1")
    monkeypatch.setenv("STITCH_EARLY_PTX_CHILDREN", "1")


def test_started_on_enter_and_given_back_on_exit_when_not_taken() -> None:
    request = PassRequest("f", "h100", "gpu", compile_only=True)
    with request:
        workers = list(request._ptx_workers)
        assert len(workers) == 1 and workers[0].pid is not None
        assert workers[0] not in ptx_children.idle()
    assert _idle(workers[0]) and request._ptx_workers == []


def test_the_next_compile_gets_the_same_running_child() -> None:
    """Every GPU compile used to start build_threads() fresh interpreters (~0.2-1 s each)."""
    with PassRequest("f", "h100", "gpu", compile_only=True) as first:
        (worker,) = first._ptx_workers
        pid = worker.pid
        assert worker.call(sum, [1, 2]) == 3         # it works (and is warm) ...
    with PassRequest("g", "h100", "gpu", compile_only=True) as second:
        assert second._ptx_workers == [worker] and worker.pid == pid   # ... and is reused


def test_they_run_below_the_compiling_process_priority() -> None:
    import os
    with PassRequest("f", "h100", "gpu", compile_only=True) as request:
        (worker,) = request._ptx_workers
        own = os.getpriority(os.PRIO_PROCESS, 0)
        assert ptx_children.PTX_CHILD_NICE > 0
        assert os.getpriority(os.PRIO_PROCESS, worker.pid) == \
            min(19, own + ptx_children.PTX_CHILD_NICE)


def test_host_requests_start_none() -> None:
    with PassRequest("f", "h100", "cpu") as request:
        assert request._ptx_workers == []


def test_the_pass_takes_them_and_closes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list = []

    def fake_plan_and_build(module, request, timings, ptx_workers):
        seen.extend(ptx_workers)
        assert all(w.pid is not None for w in ptx_workers)
        raise RuntimeError("stop after the hand-over")

    monkeypatch.setattr(pass_planning, "_plan_and_build", fake_plan_and_build)
    request = PassRequest("f", "h100", "gpu", compile_only=True)
    with request:
        started = list(request._ptx_workers)
        with pytest.raises(RuntimeError, match="hand-over"):
            xla_pass.stitch_module(object(), request)
        assert seen == started and request._ptx_workers == []
        assert _idle(started[0])                 # given back by the pass, not by __exit__


def test_a_pass_without_an_entered_request_starts_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list = []
    monkeypatch.setattr(pass_planning, "_plan_and_build",
                        lambda module, request, timings, ptx_workers: seen.extend(ptx_workers))
    xla_pass.stitch_module(object(), PassRequest("f", "h100", "gpu", compile_only=True))
    assert len(seen) == 1 and _idle(seen[0])


def test_started_by_the_pass_where_early_start_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STITCH_EARLY_PTX_CHILDREN", "0")
    seen: list = []

    def fake_plan_and_build(module, request, timings, ptx_workers):
        seen.extend(ptx_workers)
        assert all(w.pid is not None for w in ptx_workers)

    monkeypatch.setattr(pass_planning, "_plan_and_build", fake_plan_and_build)
    with PassRequest("f", "h100", "gpu", compile_only=True) as request:
        assert request._ptx_workers == []
        xla_pass.stitch_module(object(), request)
    assert len(seen) == 1 and _idle(seen[0])


@pytest.mark.parametrize("cores, early", [(2, False), (8, False), (10, True), (64, True)])
def test_early_by_default_only_with_cores_to_spare(monkeypatch: pytest.MonkeyPatch,
                                                   cores: int, early: bool) -> None:
    monkeypatch.delenv("STITCH_EARLY_PTX_CHILDREN")
    monkeypatch.delenv("STITCH_BUILD_THREADS")
    monkeypatch.setattr(ptx_children.os, "cpu_count", lambda: cores)
    # One child per core up to MAX_BUILD_THREADS (8): only from 10 cores are two to spare.
    assert ptx_children.early_ptx_children() is early


def test_a_bad_setting_is_named_and_the_pass_still_gets_children(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("STITCH_EARLY_PTX_CHILDREN", "sometimes")
    seen: list = []
    monkeypatch.setattr(pass_planning, "_plan_and_build",
                        lambda module, request, timings, ptx_workers: seen.extend(ptx_workers))
    with caplog.at_level("WARNING", logger=xla_pass.log.name):
        with PassRequest("f", "h100", "gpu", compile_only=True) as request:
            assert request._ptx_workers == []
            xla_pass.stitch_module(object(), request)
    assert "STITCH_EARLY_PTX_CHILDREN='sometimes'" in caplog.text
    assert len(seen) == 1


def test_exit_kills_the_children_and_their_files(tmp_path) -> None:
    """At exit the kept children are killed, not waited for, and leave no stderr file."""
    import os
    import subprocess
    import sys
    import time
    script = (
        "import os, time\n"
        "from stitch.codegen.isolation import IsolatedWorker\n"
        "from stitch.xla_pass import ptx_children\n"
        "(w,) = ptx_children.acquire(1)\n"
        "w.call(time.sleep, 0)\n"
        "print(w.pid, w._stderr_path, flush=True)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    pid, stderr_path = run.stdout.split()
    assert not os.path.exists(stderr_path)
    with pytest.raises(ProcessLookupError):
        for _ in range(50):
            os.kill(int(pid), 0)
            time.sleep(0.1)
    assert time.monotonic() - start < 60
