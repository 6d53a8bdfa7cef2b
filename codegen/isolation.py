"""Run fragile work (LLVM's NVPTX backend can ``abort()`` the whole process) in a child process.

``run_isolated`` runs one call in a fresh child; ``IsolatedWorker`` keeps one child alive for
many calls and replaces it after a crash, so emitting hundreds of kernels pays start-up once.

Children come from the ``forkserver`` start method where available (else ``spawn``): forking
the caller itself is unsafe once it has threads or an initialised LLVM, while the fork server
is a clean single-threaded process. Measured on a 2-core box with a target module importing
llvmlite: spawn ~150 ms per child, forkserver ~110 ms, forkserver with that module preloaded
(``preload_modules``) ~7 ms; a warm IsolatedWorker call is a pipe round trip.

A child's stderr (where LLVM and faulthandler write before dying) goes to a temp file whose
tail is quoted in IsolatedCrash. Each call carries the caller's current environment variables
(fork-server children would otherwise see the server's). ``STITCH_ISOLATE=0`` runs everything in-process (debugging).
"""
from __future__ import annotations

import contextlib
import faulthandler
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .errors import CodegenError, IsolatedCrash

log = logging.getLogger(__name__)

T = TypeVar("T")

START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
_STDERR_TAIL_LINES = 40
_STDERR_TAIL_BYTES = 16384
_preload: list[str] = ["__main__", __name__]  # '__main__' is multiprocessing's own default


def isolation_enabled() -> bool:
    """False when ``STITCH_ISOLATE`` is 0/false/no/off: run in-process."""
    return os.environ.get("STITCH_ISOLATE", "1").strip().lower() not in ("0", "false", "no", "off")


def preload_modules(*names: str) -> None:
    """Import ``names`` once in the fork server so each child starts warm (~7 ms instead of the
    module's import time). Effective only before the first isolated call starts the server."""
    for name in names:
        if name not in _preload:
            _preload.append(name)
    if START_METHOD == "forkserver":
        multiprocessing.get_context("forkserver").set_forkserver_preload(list(_preload))


def _context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(list(_preload))
    return ctx


def _describe(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


# ----------------------------------------------------------------------------- child side

@dataclass
class _Outcome:
    """What the child sends back: a result, or an exception with its traceback text."""
    ok: bool
    value: Any = None
    exc_blob: bytes | None = None  # pickled exception, when it survives a round trip
    summary: str = ""
    tb: str = ""


def _redirect_stderr(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.enable()  # a SIGSEGV/SIGABRT leaves a Python traceback in the captured tail


def _sync_environ(env: dict[str, str]) -> None:
    # Fork-server children inherit the server's environment, frozen when it started; the caller's
    # current one (STITCH_*, CUDA_HOME set later) is what the work must see.
    for name in [k for k in os.environ if k not in env]:
        del os.environ[name]
    for name, value in env.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


def _run_call(blob: bytes) -> _Outcome:
    try:
        fn, args, kwargs, env = pickle.loads(blob)
        _sync_environ(env)
        return _Outcome(ok=True, value=fn(*args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - everything must travel back to the parent
        tb = traceback.format_exc()
        exc_blob: bytes | None
        try:
            exc_blob = pickle.dumps(exc)
            pickle.loads(exc_blob)  # custom __init__ signatures often fail only here
        except Exception:  # noqa: BLE001
            exc_blob = None
        return _Outcome(ok=False, exc_blob=exc_blob, summary=f"{type(exc).__name__}: {exc}", tb=tb)


def _send(conn: multiprocessing.connection.Connection, outcome: _Outcome) -> None:
    try:
        conn.send(outcome)
    except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable result
        conn.send(_Outcome(ok=False, summary=f"result could not be sent to the parent: {exc!r}",
                           tb=traceback.format_exc()))


def _child_once(conn: multiprocessing.connection.Connection, stderr_path: str, blob: bytes) -> None:
    _redirect_stderr(stderr_path)
    _send(conn, _run_call(blob))
    conn.close()


def _child_loop(conn: multiprocessing.connection.Connection, stderr_path: str) -> None:
    _redirect_stderr(stderr_path)
    while True:
        try:
            blob = conn.recv_bytes()
        except (EOFError, OSError):
            return
        if not blob:  # empty message: orderly shutdown
            return
        _send(conn, _run_call(blob))


# ---------------------------------------------------------------------------- parent side

def _dump_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
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


def _unwrap(fn: Callable[..., Any], outcome: _Outcome) -> Any:
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


def _await(fn: Callable[..., Any], proc: multiprocessing.process.BaseProcess,
           conn: multiprocessing.connection.Connection, timeout: float,
           stderr_path: str, stderr_start: int) -> _Outcome:
    """The child's outcome; IsolatedCrash (child killed where needed) on death or timeout."""
    ready = multiprocessing.connection.wait([conn, proc.sentinel], timeout)
    if conn in ready or conn.poll(0):
        try:
            return conn.recv()
        except (EOFError, OSError):
            pass  # died mid-send or before sending: treated as a crash below
    if not ready:
        proc.kill()
        proc.join(5)
        raise _crash(fn, f"timed out after {timeout:g}s (child killed)",
                     _stderr_tail(stderr_path, stderr_start))
    proc.join(5)
    raise _crash(fn, f"crashed: child {_exit_description(proc.exitcode)}",
                 _stderr_tail(stderr_path, stderr_start))


def _new_stderr_file() -> str:
    fd, path = tempfile.mkstemp(prefix="stitch-isolated-", suffix=".stderr")
    os.close(fd)
    return path


def run_isolated(fn: Callable[..., T], *args: Any, timeout: float = 120.0, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in a fresh child process; its return value.

    ``fn`` must be a picklable top-level function (so must args and result). A child that dies
    (signal, non-zero exit) or outlives ``timeout`` seconds -> IsolatedCrash with the tail of
    its stderr. An exception raised by ``fn`` is re-raised with its own type (the child's
    traceback added as a note), or as CodegenError carrying the traceback when it cannot be
    pickled. ``timeout`` is consumed here, never passed to ``fn``.
    """
    if not isolation_enabled():
        return fn(*args, **kwargs)
    blob = _dump_call(fn, args, kwargs)
    stderr_path = _new_stderr_file()
    ctx = _context()
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_once, args=(child_conn, stderr_path, blob),
                       name=f"stitch-isolated:{getattr(fn, '__name__', 'fn')}", daemon=True)
    started = time.perf_counter()
    try:
        proc.start()
        child_conn.close()  # so EOF is seen when the child dies
        outcome = _await(fn, proc, parent_conn, timeout, stderr_path, 0)
        proc.join(5)
        if tail := _stderr_tail(stderr_path):
            log.debug("isolated %s stderr:\n%s", _describe(fn), tail)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        parent_conn.close()
        with contextlib.suppress(OSError):
            os.unlink(stderr_path)
        log.debug("isolated %s took %.3fs", _describe(fn), time.perf_counter() - started)
    return _unwrap(fn, outcome)


class IsolatedWorker:
    """One long-lived child that runs calls in turn; a crash or timeout raises IsolatedCrash and
    the next call starts a fresh child. ``max_calls`` recycles the child after that many calls
    (bounds memory an LLVM context may accumulate). Thread-safe (calls are serialised)."""

    def __init__(self, *, max_calls: int | None = None, name: str = "stitch-isolated-worker") -> None:
        self.max_calls = max_calls
        self.name = name
        self.starts = 0  # children started so far (restarts = starts - 1)
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._conn: multiprocessing.connection.Connection | None = None
        self._stderr_path: str | None = None
        self._calls_in_child = 0
        self._lock = threading.Lock()

    def __enter__(self) -> IsolatedWorker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.is_alive() else None

    def _start(self) -> None:
        ctx = _context()
        self._stderr_path = self._stderr_path or _new_stderr_file()
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=_child_loop, args=(child_conn, self._stderr_path),
                           name=self.name, daemon=True)
        proc.start()
        child_conn.close()
        self._proc, self._conn, self._calls_in_child = proc, parent_conn, 0
        self.starts += 1
        log.debug("%s: started child pid %s (start #%d)", self.name, proc.pid, self.starts)

    def _discard_child(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    def call(self, fn: Callable[..., T], *args: Any, timeout: float = 120.0, **kwargs: Any) -> T:
        """Like run_isolated, in this worker's child."""
        if not isolation_enabled():
            return fn(*args, **kwargs)
        blob = _dump_call(fn, args, kwargs)
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self._discard_child()
                self._start()
            assert self._proc is not None and self._conn is not None and self._stderr_path
            stderr_start = os.path.getsize(self._stderr_path)
            try:
                self._conn.send_bytes(blob)
                outcome = _await(fn, self._proc, self._conn, timeout, self._stderr_path, stderr_start)
            except (IsolatedCrash, OSError) as exc:
                self._discard_child()
                if isinstance(exc, IsolatedCrash):
                    raise
                raise _crash(fn, f"lost its worker: {exc!r}",
                             _stderr_tail(self._stderr_path, stderr_start)) from exc
            self._calls_in_child += 1
            if self.max_calls is not None and self._calls_in_child >= self.max_calls:
                self._stop_child()
        return _unwrap(fn, outcome)

    def _stop_child(self) -> None:
        if self._proc is not None and self._proc.is_alive() and self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.send_bytes(b"")
            self._proc.join(5)
        self._discard_child()

    def close(self) -> None:
        """Stop the child (politely, then by force) and remove the stderr file."""
        with self._lock:
            self._stop_child()
            if self._stderr_path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(self._stderr_path)
                self._stderr_path = None
