"""Run fragile work (LLVM's NVPTX backend can ``abort()`` the whole process) in a child process.

``run_isolated`` runs one call in a fresh child; ``IsolatedWorker`` keeps one child alive for
many calls and replaces it after a crash, so emitting hundreds of kernels pays start-up once.

A child is a plain ``python -P -m stitch.codegen.isolation_child`` subprocess (see that module). It
imports codegen and the modules the requested function and its arguments live in, never the
caller's ``__main__``: multiprocessing's spawn and forkserver children re-import the main
script, so a script without an ``if __name__ == "__main__":`` guard (most training scripts)
ran its top level a second time and PTX emission died with "child exited with code 1".
Functions must therefore live in an importable module; one defined in ``__main__`` is refused
with a CodegenError. ``preload_modules`` names modules every new child imports at start; an
IsolatedWorker's ``warm_up`` names functions its children call once as they start, and its
``nice`` how far below the caller's priority they run (background work: it yields the CPU
to the caller's threads where cores are short).
A child costs an interpreter start: measured on the 2-core box under a load of 5, 0.33 s for a
codegen function, ~1 s when it imports llvmlite (stitch.codegen.nvptx); a warm IsolatedWorker call
is a pipe round trip (0.6 ms). Batch emission therefore goes through one IsolatedWorker.

A child's stderr (where LLVM and faulthandler write before dying) goes to a temp file whose
tail is quoted in IsolatedCrash. Each call carries the caller's current environment variables.
The child ignores SIGINT: Ctrl-C raises KeyboardInterrupt in the caller, which kills the child
and does not wait for it. ``STITCH_ISOLATE=0`` runs everything in-process (debugging).
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection
import os
import pathlib
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from stitch.hlo.errors import Cancelled

from .errors import CodegenError, IsolatedCrash
from .isolation_child import Outcome

log = logging.getLogger(__name__)

T = TypeVar("T")

START_METHOD = "subprocess"  # a fresh interpreter running stitch.codegen.isolation_child
_STDERR_TAIL_LINES = 40
_STDERR_TAIL_BYTES = 16384
_CHILD_MODULE = "stitch.codegen.isolation_child"
_PACKAGE_ROOT = str(pathlib.Path(__file__).resolve().parents[2])  # the dir holding stitch/
_preload: list[str] = []
CANCEL_POLL_S = 0.05       # how often a cancellable call looks at its flag


def isolation_enabled() -> bool:
    """False when ``STITCH_ISOLATE`` is 0/false/no/off: run in-process."""
    return os.environ.get("STITCH_ISOLATE", "1").strip().lower() not in ("0", "false", "no", "off")


def preload_modules(*names: str) -> None:
    """Import ``names`` in every child started from now on (before its first call)."""
    for name in names:
        if name not in _preload:
            _preload.append(name)


def _describe(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


# ---------------------------------------------------------------------------- parent side

def _dump_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    if getattr(fn, "__module__", None) in ("__main__", "__mp_main__"):
        raise CodegenError(f"cannot run {_describe(fn)} in a child process: the child never "
                           "imports the caller's __main__; define it in an importable module")
    try:
        return pickle.dumps((fn, args, kwargs, dict(os.environ)))
    except Exception as exc:
        raise CodegenError(f"cannot send {_describe(fn)} to a child process (it and its arguments "
                           f"must be picklable; use a top-level function): {exc}") from exc


def _stderr_tail(path: str, start: int = 0) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(start, size - _STDERR_TAIL_BYTES))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-_STDERR_TAIL_LINES:])


def _exit_description(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _crash(fn: Callable[..., Any], what: str, stderr: str) -> IsolatedCrash:
    message = f"isolated call {_describe(fn)} {what}"
    if stderr:
        message += f"\n--- child stderr (last lines) ---\n{stderr}"
    return IsolatedCrash(message)


def _unwrap(fn: Callable[..., Any], outcome: Outcome) -> Any:
    if outcome.ok:
        return outcome.value
    if outcome.exc_blob is not None:
        try:
            exc = pickle.loads(outcome.exc_blob)
        except Exception:  # noqa: BLE001
            exc = None
        if isinstance(exc, BaseException):
            exc.add_note(f"raised in an isolated child running {_describe(fn)}; child traceback:\n"
                         f"{outcome.tb.rstrip()}")
            raise exc
    raise CodegenError(f"isolated call {_describe(fn)} raised {outcome.summary}\n"
                       f"--- child traceback ---\n{outcome.tb.rstrip()}")


def _new_stderr_file() -> str:
    fd, path = tempfile.mkstemp(prefix="stitch-isolated-", suffix=".stderr")
    os.close(fd)
    return path


def _child_env() -> dict[str, str]:
    # The child must import this very codegen (-P keeps the cwd off its path).
    env = dict(os.environ)
    paths = [_PACKAGE_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _lower_priority(pid: int, nice: int) -> None:
    """Raise process ``pid``'s niceness by ``nice`` over this process's (at most 19). A
    system that refuses leaves the child at this process's priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice))
    except (AttributeError, OSError) as exc:    # no setpriority (Windows), or not allowed
        log.debug("child %d keeps its priority: %s", pid, exc)


class _Child:
    """One child process and its two pipe ends."""

    def __init__(self, stderr_path: str, preload: tuple[str, ...] = (),
                 warm_up: tuple[str, ...] = (), nice: int = 0) -> None:
        with open(stderr_path, "ab") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-P", "-m", _CHILD_MODULE], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=stderr, env=_child_env(), close_fds=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if nice > 0:
            _lower_priority(self.proc.pid, nice)
        # Connection owns (and closes) its descriptor; the Popen file objects close theirs.
        self.outbox = Connection(os.dup(self.proc.stdin.fileno()), readable=False)
        self.inbox = Connection(os.dup(self.proc.stdout.fileno()), writable=False)
        self.proc.stdin.close()
        self.proc.stdout.close()
        setup = {"sys_path": [os.path.abspath(p) if p else os.getcwd() for p in sys.path
                              if isinstance(p, str)],
                 "preload": list(_preload) + [m for m in preload if m not in _preload],
                 "warm_up": list(warm_up)}
        self.outbox.send_bytes(pickle.dumps(setup))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, blob: bytes) -> None:
        self.outbox.send_bytes(blob)

    def wait_reply(self, fn: Callable[..., Any], timeout: float, stderr_path: str,
                   stderr_start: int, cancelled: Callable[[], bool] | None = None) -> Outcome:
        """The child's outcome; IsolatedCrash (child killed where needed) on death or timeout;
        Cancelled (child killed) as soon as ``cancelled()`` turns true."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            step = left if cancelled is None else min(left, CANCEL_POLL_S)
            ready = multiprocessing.connection.wait([self.inbox], max(0.0, step))
            if ready or left <= step:
                break
            if cancelled is not None and cancelled():
                self.kill()
                raise Cancelled(f"{_describe(fn)}: cancelled while its child was working "
                                "(child killed)")
        if ready:
            try:
                return pickle.loads(self.inbox.recv_bytes())
            except (EOFError, OSError):
                pass  # died mid-send or before sending: treated as a crash below
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
            raise _crash(fn, f"crashed: child {_exit_description(self.proc.poll())}",
                         _stderr_tail(stderr_path, stderr_start))
        self.kill()
        raise _crash(fn, f"timed out after {timeout:g}s (child killed)",
                     _stderr_tail(stderr_path, stderr_start))

    def stop(self) -> None:
        """Ask the child to exit, then make sure it has."""
        if self.alive():
            with contextlib.suppress(OSError):
                self.outbox.send_bytes(b"")
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
        self.kill()

    def kill(self) -> None:
        if self.alive():
            with contextlib.suppress(OSError):
                self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        for conn in (self.inbox, self.outbox):
            with contextlib.suppress(OSError):
                conn.close()


def run_isolated(fn: Callable[..., T], *args: Any, timeout: float = 120.0, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in a fresh child process; its return value.

    ``fn`` must be a picklable top-level function of an importable module (not ``__main__``);
    so must args and result be picklable. A child that dies (signal, non-zero exit) or
    outlives ``timeout`` seconds -> IsolatedCrash with the tail of its stderr. An exception
    raised by ``fn`` is re-raised with its own type (the child's traceback added as a note),
    or as CodegenError carrying the traceback when it cannot be pickled. ``timeout`` is
    consumed here, never passed to ``fn``.
    """
    if not isolation_enabled():
        return fn(*args, **kwargs)
    with IsolatedWorker(name=f"stitch-isolated:{getattr(fn, '__name__', 'fn')}") as worker:
        return worker.call(fn, *args, timeout=timeout, **kwargs)


class IsolatedWorker:
    """One long-lived child that runs calls in turn; a crash or timeout raises IsolatedCrash and
    the next call starts a fresh child. ``max_calls`` recycles the child after that many calls
    (bounds memory an LLVM context may accumulate). Thread-safe (calls are serialised). Any
    interruption of a call (KeyboardInterrupt included) kills the child: its reply would be
    out of step with the next call."""

    def __init__(self, *, max_calls: int | None = None, name: str = "stitch-isolated-worker",
                 preload: tuple[str, ...] = (), warm_up: tuple[str, ...] = (),
                 nice: int = 0) -> None:
        self.max_calls = max_calls
        self.name = name
        self.preload = preload    # modules this worker's children import at start
        # Niceness its children get over the caller's: background work that yields the CPU
        # to the caller's own threads (and to anything else the machine runs) when contended.
        self.nice = nice
        # "module:function"s each child calls once at start, before any request: work its
        # calls share, done while the caller is busy elsewhere (a failure is left for the
        # first call to meet and report).
        self.warm_up = warm_up
        self.starts = 0  # children started so far (restarts = starts - 1)
        self._child: _Child | None = None
        self._stderr_path: str | None = None
        self._calls_in_child = 0
        self._lock = threading.Lock()
        self._final = False       # killed for good (exit): no call starts a child again

    def __enter__(self) -> IsolatedWorker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def pid(self) -> int | None:
        return self._child.pid if self._child is not None and self._child.alive() else None

    def _start(self) -> _Child:
        self._stderr_path = self._stderr_path or _new_stderr_file()
        child = _Child(self._stderr_path, self.preload, self.warm_up, self.nice)
        self._child, self._calls_in_child = child, 0
        self.starts += 1
        log.debug("%s: started child pid %s (start #%d)", self.name, child.pid, self.starts)
        return child

    def start(self) -> None:
        """Start the child now, without waiting for it: its interpreter start and imports
        (``preload``) then overlap the caller's own work instead of delaying the first call."""
        if not isolation_enabled() or self._final:
            return
        with self._lock:
            if self._child is None or not self._child.alive():
                self._discard_child()
                self._start()

    def _discard_child(self) -> None:
        if self._child is not None:
            self._child.kill()
        self._child = None

    def call(self, fn: Callable[..., T], *args: Any, timeout: float = 120.0,
             cancelled: Callable[[], bool] | None = None, **kwargs: Any) -> T:
        """Like run_isolated, in this worker's child. ``cancelled``: polled while the child
        works; once true the child is killed and Cancelled raised (an exit need not wait for
        a long LLVM build)."""
        if not isolation_enabled():
            return fn(*args, **kwargs)
        if self._final:
            raise Cancelled(f"{_describe(fn)}: {self.name} was shut down (the process is "
                            "exiting)")
        blob = _dump_call(fn, args, kwargs)
        started = time.perf_counter()
        with self._lock:
            child = self._child
            if child is None or not child.alive():
                self._discard_child()
                child = self._start()
            stderr_path = self._stderr_path
            assert stderr_path is not None
            stderr_start = os.path.getsize(stderr_path)
            try:
                child.send(blob)
                outcome = child.wait_reply(fn, timeout, stderr_path, stderr_start, cancelled)
            except OSError as exc:  # the pipe broke: the child died before reading
                self._discard_child()
                raise _crash(fn, f"lost its worker: {exc!r}",
                             _stderr_tail(stderr_path, stderr_start)) from exc
            except BaseException:  # crash, timeout, KeyboardInterrupt: never reuse the child
                self._discard_child()
                raise
            self._calls_in_child += 1
            if self.max_calls is not None and self._calls_in_child >= self.max_calls:
                self._stop_child()
        if tail := _stderr_tail(stderr_path, stderr_start):
            log.debug("isolated %s stderr:\n%s", _describe(fn), tail)
        log.debug("isolated %s took %.3fs", _describe(fn), time.perf_counter() - started)
        return _unwrap(fn, outcome)

    def _stop_child(self) -> None:
        if self._child is not None:
            if self._calls_in_child == 0:
                # Started ahead (``start``) and never used: it holds nothing, and asking it
                # to exit would wait for its imports to finish.
                self._child.kill()
            else:
                self._child.stop()
        self._child = None

    def kill(self, *, final: bool = False) -> None:
        """Kill the child now, without asking it to stop or waiting for a call in flight
        (that call then fails as a crash); the next call starts a fresh child. ``final``
        (the process is exiting): the stderr file goes too."""
        child = self._child
        if child is not None and child.alive():
            with contextlib.suppress(OSError):
                child.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(1)             # reaped: SIGKILL takes effect at once
        if final:
            self._final = True
            if self._stderr_path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(self._stderr_path)

    def close(self) -> None:
        """Stop the child (politely, then by force) and remove the stderr file."""
        with self._lock:
            self._stop_child()
            if self._stderr_path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(self._stderr_path)
                self._stderr_path = None
