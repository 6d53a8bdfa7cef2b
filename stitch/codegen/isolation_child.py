"""The isolated child: ``python -P -m stitch.codegen.isolation_child``, started by stitch.codegen.isolation.

It imports codegen and whatever module a requested function lives in, and never the caller's
``__main__``: a training script without an ``if __name__ == "__main__":`` guard must not run a
second time here (multiprocessing's spawn/forkserver children re-import it). A function or
argument pickled from ``__main__`` is refused with a clear error instead.

Protocol: the parent's pipe on fd 0 carries requests and fd 1 carries replies (both moved to
private descriptors at start, so output the work prints cannot corrupt them: fd 1 then goes
to stderr, fd 0 to /dev/null). Each message is a length-prefixed pickle
(multiprocessing.connection framing). The first request is the setup (the parent's sys.path,
modules to preload, "module:function"s to call once to warm up); then one call per request,
an empty request to stop. SIGINT is ignored: Ctrl-C is the parent's to handle (it kills
this child).
"""
from __future__ import annotations

import contextlib
import faulthandler
import importlib
import io
import os
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any


@dataclass
class Outcome:
    """What the child sends back: a result, or an exception with its traceback text."""
    ok: bool
    value: Any = None
    exc_blob: bytes | None = None  # pickled exception, when it survives a round trip
    summary: str = ""
    tb: str = ""


class _NoMainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "__main__" or module.startswith("__main__.") or module == "__mp_main__":
            raise pickle.UnpicklingError(
                f"{name} is defined in the caller's __main__; the isolated child never runs "
                "the caller's script, so isolated work must live in an importable module")
        return super().find_class(module, name)


def _sync_environ(env: dict[str, str]) -> None:
    # A long-lived child must see the caller's current environment (STITCH_*, CUDA_HOME set
    # after it started), not the one it was started with.
    for name in [k for k in os.environ if k not in env]:
        del os.environ[name]
    for name, value in env.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


def run_call(blob: bytes) -> Outcome:
    try:
        fn, args, kwargs, env = _NoMainUnpickler(io.BytesIO(blob)).load()
        _sync_environ(env)
        return Outcome(ok=True, value=fn(*args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - everything must travel back to the parent
        tb = traceback.format_exc()
        exc_blob: bytes | None
        try:
            exc_blob = pickle.dumps(exc)
            pickle.loads(exc_blob)  # custom __init__ signatures often fail only here
        except Exception:  # noqa: BLE001
            exc_blob = None
        return Outcome(ok=False, exc_blob=exc_blob, summary=f"{type(exc).__name__}: {exc}", tb=tb)


def _reply(outbox: Connection, outcome: Outcome) -> None:
    try:
        blob = pickle.dumps(outcome)
    except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable result
        blob = pickle.dumps(Outcome(ok=False, summary=f"result could not be sent to the parent: "
                                                       f"{exc!r}", tb=traceback.format_exc()))
    outbox.send_bytes(blob)


def _setup(setup: dict[str, Any]) -> None:
    # The parent's import path (minus nothing: the script's directory is only a place to
    # import named modules from; __main__ itself is never imported).
    own = list(sys.path)
    sys.path[:] = [p for p in setup.get("sys_path", []) if isinstance(p, str)]
    sys.path += [p for p in own if p not in sys.path]
    for name in setup.get("preload", []):
        importlib.import_module(name)
    for target in setup.get("warm_up", []):
        module, _, function = str(target).partition(":")
        try:
            getattr(importlib.import_module(module), function)()
        except Exception as exc:  # noqa: BLE001 - the first call meets it and says why
            print(f"warm-up {target} failed: {exc!r}", file=sys.stderr, flush=True)


def _exit_now() -> None:
    # Nothing here needs the interpreter's teardown (replies are sent, the work's files
    # closed), and with llvmlite loaded it takes ~60 ms, which the parent waits for as it
    # closes each child at the end of a compile.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    inbox = Connection(os.dup(0), writable=False)
    outbox = Connection(os.dup(1), readable=False)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)  # prints from the work land in the captured stderr
    faulthandler.enable()  # a SIGSEGV/SIGABRT leaves a Python traceback in the stderr tail
    try:
        _setup(pickle.loads(inbox.recv_bytes()))
        while True:
            blob = inbox.recv_bytes()
            if not blob:  # empty message: orderly shutdown
                _exit_now()
            _reply(outbox, run_call(blob))
    except (EOFError, BrokenPipeError):  # the parent went away
        return 0


if __name__ == "__main__":
    # Run under the module's real name, so Outcome pickles as stitch.codegen.isolation_child.Outcome.
    from stitch.codegen.isolation_child import main as _main
    sys.exit(_main())
