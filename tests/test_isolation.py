"""Child-process isolation: results, crashes (abort), exceptions, timeouts, worker restarts;
the child never runs the caller's __main__; Ctrl-C stops the caller."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from stitch.codegen import isolation
from stitch.codegen.errors import CodegenError, IsolatedCrash
from stitch.codegen.isolation import IsolatedWorker, run_isolated


# Top-level so they pickle by reference into the child.
def add(a: int, b: int = 0) -> int:
    return a + b


def child_pid() -> int:
    return os.getpid()


def abort_after_message(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    os.abort()


def exit_with(code: int) -> None:
    os._exit(code)


def raise_value_error(text: str) -> None:
    def inner() -> None:
        raise ValueError(text)
    inner()


class NeedsTwoArgs(Exception):
    def __init__(self, a: str, b: str) -> None:  # unpicklable: args=(message,) on reload
        super().__init__(f"{a}/{b}")


def raise_unpicklable() -> None:
    raise NeedsTwoArgs("left", "right")


def sleep_for(seconds: float) -> str:
    time.sleep(seconds)
    return "woke"


def env_value(name: str) -> str | None:
    return os.environ.get(name)


def return_unpicklable():
    return lambda: None


@pytest.fixture(autouse=True)
def _isolation_on(monkeypatch):
    monkeypatch.delenv("STITCH_ISOLATE", raising=False)


def test_result_returned_from_child():
    assert run_isolated(add, 2, b=3) == 5
    assert run_isolated(child_pid) != os.getpid()


def test_abort_raises_isolated_crash_and_parent_survives():
    with pytest.raises(IsolatedCrash) as info:
        run_isolated(abort_after_message, "LLVM ERROR: unsupported libcall")
    message = str(info.value)
    assert "abort_after_message" in message
    assert "SIGABRT" in message
    assert "LLVM ERROR: unsupported libcall" in message  # stderr tail captured
    assert run_isolated(add, 1, b=1) == 2  # parent fine, next child fine


def test_nonzero_exit_reported():
    with pytest.raises(IsolatedCrash, match="exited with code 3"):
        run_isolated(exit_with, 3)


def test_exception_keeps_type_and_child_traceback():
    with pytest.raises(ValueError, match="bad input") as info:
        run_isolated(raise_value_error, "bad input")
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "child traceback" in notes and "in inner" in notes


def test_unpicklable_exception_becomes_codegen_error():
    with pytest.raises(CodegenError) as info:
        run_isolated(raise_unpicklable)
    assert not isinstance(info.value, IsolatedCrash)
    message = str(info.value)
    assert "NeedsTwoArgs" in message and "left/right" in message
    assert "raise_unpicklable" in message and "Traceback" in message


def test_unpicklable_function_or_result():
    with pytest.raises(CodegenError, match="picklable"):
        run_isolated(lambda: 1)
    with pytest.raises(CodegenError, match="could not be sent"):
        run_isolated(return_unpicklable)


def test_timeout_kills_child():
    started = time.monotonic()
    with pytest.raises(IsolatedCrash, match="timed out"):
        run_isolated(sleep_for, 30, timeout=1.0)
    assert time.monotonic() - started < 10


def test_child_sees_callers_current_environment(monkeypatch):
    run_isolated(add, 0)  # the fork server exists by now, with the old environment
    monkeypatch.setenv("STITCH_TEST_MARKER", "set-after-start")
    assert run_isolated(env_value, "STITCH_TEST_MARKER") == "set-after-start"
    with IsolatedWorker() as worker:
        assert worker.call(env_value, "STITCH_TEST_MARKER") == "set-after-start"
        monkeypatch.delenv("STITCH_TEST_MARKER")
        assert worker.call(env_value, "STITCH_TEST_MARKER") is None


def test_in_process_switch(monkeypatch):
    monkeypatch.setenv("STITCH_ISOLATE", "0")
    assert run_isolated(child_pid) == os.getpid()
    assert run_isolated(lambda: 7) == 7  # no pickling in-process
    with IsolatedWorker() as worker:
        assert worker.call(child_pid) == os.getpid()
        assert worker.starts == 0


def test_worker_reuses_child_and_restarts_after_crash():
    with IsolatedWorker() as worker:
        first = worker.call(child_pid)
        assert first != os.getpid()
        assert [worker.call(add, i, b=1) for i in range(20)] == list(range(1, 21))
        assert worker.call(child_pid) == first and worker.starts == 1

        with pytest.raises(IsolatedCrash, match="SIGABRT") as info:
            worker.call(abort_after_message, "boom from worker")
        assert "boom from worker" in str(info.value)

        second = worker.call(child_pid)
        assert second != first and worker.starts == 2
        with pytest.raises(ValueError):
            worker.call(raise_value_error, "still alive")
        assert worker.call(child_pid) == second  # an exception does not cost the child

        with pytest.raises(IsolatedCrash, match="timed out"):
            worker.call(sleep_for, 30, timeout=0.5)
        assert worker.call(add, 40, b=2) == 42 and worker.starts == 3
        assert worker.call(child_pid) not in (first, second)
    assert worker.pid is None


def test_worker_max_calls_recycles_child():
    with IsolatedWorker(max_calls=2) as worker:
        pids = [worker.call(child_pid) for _ in range(4)]
    assert pids[0] == pids[1] and pids[2] == pids[3] and pids[0] != pids[2]
    assert worker.starts == 2


def test_worker_call_is_cheap():
    with IsolatedWorker() as worker:
        worker.call(add, 0)
        started = time.perf_counter()
        for i in range(50):
            worker.call(add, i)
        per_call = (time.perf_counter() - started) / 50
    assert per_call < 0.02, f"{per_call * 1000:.1f} ms per warm call"


REPO = pathlib.Path(__file__).resolve().parent.parent


def test_child_is_a_fresh_interpreter_not_a_fork():
    assert isolation.START_METHOD == "subprocess"
    import stitch.codegen.isolation_child as child_module
    # The child never imports the parent's __main__ (pytest's here).
    assert "pytest" not in run_isolated(main_module_file)
    assert run_isolated(main_module_file).endswith("isolation_child.py")
    assert child_module.__name__ == "stitch.codegen.isolation_child"


def main_module_file() -> str:
    return str(getattr(sys.modules["__main__"], "__file__", ""))


def _run_script(tmp_path: pathlib.Path, body: str, **kwargs) -> subprocess.Popen:
    script = tmp_path / "train.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(REPO)!r})\n" + textwrap.dedent(body))
    env = {k: v for k, v in os.environ.items() if k != "STITCH_ISOLATE"}
    return subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def test_script_without_main_guard_runs_once_and_emits_ptx(tmp_path):
    from stitch.codegen.nvptx import default_libdevice_path
    if default_libdevice_path() is None:
        pytest.skip("no libdevice.10.bc")
    # A training script's shape: no `if __name__ == "__main__":`, top level does the work.
    proc = _run_script(tmp_path, """
        print("TOP-LEVEL-MARKER", flush=True)
        from stitch.codegen.isolation import run_isolated
        from stitch.codegen.kir import Unary
        from stitch.codegen.nvptx import emit_ptx
        from tests.test_kir_host import elementwise_kernel
        kernel = elementwise_kernel("scaled_tanh", ["f32"], "f32", 1000, lambda x: Unary("tanh", x))
        ptx = run_isolated(emit_ptx, kernel, "sm_80")
        print("ENTRY" if ".entry scaled_tanh(" in ptx else "NO-ENTRY", flush=True)
    """)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    assert out.count("TOP-LEVEL-MARKER") == 1, out
    assert "ENTRY" in out.split() and "NO-ENTRY" not in out


def test_function_from_main_is_refused_with_a_clear_error(tmp_path):
    proc = _run_script(tmp_path, """
        from stitch.codegen.errors import CodegenError
        from stitch.codegen.isolation import run_isolated
        def work():
            return 1
        try:
            run_isolated(work)
        except CodegenError as exc:
            print("REFUSED", "__main__" in str(exc))
    """)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.split() == ["REFUSED", "True"]


def _alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie has stopped; only its parent's reaping is left


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_stops_the_caller_and_its_child(tmp_path):
    proc = _run_script(tmp_path, """
        from stitch.codegen.isolation import IsolatedWorker
        from tests.test_isolation import child_pid, sleep_for
        worker = IsolatedWorker()
        print(worker.call(child_pid), flush=True)
        worker.call(sleep_for, 60, timeout=120)
        print("CARRIED-ON", flush=True)
    """, start_new_session=True)
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    assert _alive(child)
    time.sleep(0.5)  # inside the long call
    started = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
    out, err = proc.communicate(timeout=30)
    assert time.monotonic() - started < 15
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert "CARRIED-ON" not in out
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the isolated child outlived its caller"


def modules_loaded(*names: str) -> list[bool]:
    return [name in sys.modules for name in names]


def test_worker_started_ahead_preloads_and_serves_calls():
    """``start`` spawns the child before the first call (its imports overlap the caller's
    work); that child, with ``preload`` imported, serves the calls."""
    with IsolatedWorker(preload=("stitch.codegen.nvptx",)) as worker:
        worker.start()
        pid = worker.pid
        assert pid is not None and pid != os.getpid()
        assert worker.call(modules_loaded, "stitch.codegen.nvptx", "llvmlite.binding") == [True, True]
        assert worker.call(child_pid) == pid and worker.starts == 1


def test_worker_children_run_at_the_niceness_asked_for():
    """``nice``: the worker's children run that much below the caller's priority (background
    work that yields the CPU where cores are short); without it, at the caller's."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    with IsolatedWorker(nice=5) as worker:
        worker.start()
        pid = worker.pid
        assert worker.call(child_pid) == pid
        assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, own + 5)
        assert worker.call(add, 2, 3) == 5
        assert worker.pid == pid                 # the niced child served, not a restart
    with IsolatedWorker() as worker:
        worker.start()
        assert os.getpriority(os.PRIO_PROCESS, worker.pid) == own


WARMED: list[str] = []


def note_warm_up() -> None:
    WARMED.append("warm")


def fail_warm_up() -> None:
    raise RuntimeError("no toolchain here")


def warmed() -> list[str]:
    return list(WARMED)


def test_worker_warms_its_child_once_before_the_first_call():
    """``warm_up`` functions run in each new child as it starts (not in the caller), once;
    one that fails leaves the child serving calls, its error in the child's stderr."""
    with IsolatedWorker(warm_up=("tests.test_isolation:note_warm_up",)) as worker:
        worker.start()
        assert worker.call(warmed) == ["warm"]
        assert worker.call(warmed) == ["warm"]
    assert WARMED == []
    with IsolatedWorker(warm_up=("tests.test_isolation:fail_warm_up",)) as worker:
        assert worker.call(add, 2, 3) == 5
        assert "warm-up tests.test_isolation:fail_warm_up failed" in \
            isolation._stderr_tail(worker._stderr_path)


def test_worker_started_but_unused_closes_without_waiting():
    worker = IsolatedWorker(preload=("stitch.codegen.nvptx", "numpy"))
    worker.start()
    child = worker._child
    start = time.perf_counter()
    worker.close()
    assert time.perf_counter() - start < 2.0
    assert child is not None and not child.alive()


def print_unflushed(text: str) -> None:
    print(text)         # the child's stdout goes to its stderr file, block-buffered


def test_worker_stop_is_an_orderly_exit_that_keeps_the_childs_stderr(monkeypatch):
    """Asked to stop, a child that served calls exits at once with status 0 (it skips the
    interpreter's teardown) and what its work printed is flushed first."""
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)     # buffered, as for most users
    worker = IsolatedWorker()
    try:
        worker.call(print_unflushed, "last words of the child")
        child = worker._child
        assert child is not None
        child.stop()
        assert child.proc.returncode == 0
        assert "last words of the child" in isolation._stderr_tail(worker._stderr_path)
    finally:
        worker.close()


def test_a_worker_killed_for_good_starts_no_child_again():
    """At exit the pass's children are killed for good: a build thread's next call must not
    start a fresh interpreter behind the exiting process's back."""
    from stitch.hlo.errors import Cancelled
    worker = IsolatedWorker(name="final-test")
    try:
        assert worker.call(sum, [1, 2]) == 3
        pid = worker.pid
        worker.kill(final=True)
        with pytest.raises(Cancelled, match="shut down"):
            worker.call(sum, [1, 2])
        worker.start()
        assert worker.pid is None
        with pytest.raises(ProcessLookupError):
            for _ in range(50):
                os.kill(pid, 0)
                time.sleep(0.1)
    finally:
        worker.close()
