"""XLA's C++ log lines around stitch's own compile: caught, not printed.

XLA writes its glog lines (``E1128 12:00:00.123456  4242 execution_engine.cc:54] LLVM
compilation error: Symbols not found``) straight to file descriptor 2. During stitch's own
compile of a stitched program such a line is about stitch's attempt — one it recovers from
(a retry, or the stock path) — so it must not reach the user as a foreign line.
``xla_stderr_captured()`` points fd 2 at a pipe for the duration of that compile only: a
reader thread keeps XLA's lines (glog's form) and forwards every other line to the real stderr
at once, so the program's own output from other threads is not held back or lost. The caller
says the gist in one stitch line (``Captured.gist``). Where fd 2 cannot be redirected, or
another capture is running, nothing is captured and XLA's lines print as before.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from typing import Iterator

log = logging.getLogger("stitch.jit")

# glog's prefix: severity, MMDD, time, thread id, file:line]
GLOG_LINE = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+\s+[\w./-]+:\d+\] ?(.*)$")
MAX_KEPT = 50                    # XLA lines kept per compile (the gist needs the first few)
_ACTIVE = threading.Lock()       # fd 2 is the process's: one capture at a time


@dataclass
class Captured:
    """XLA's lines caught during one compile (their messages, glog's prefix dropped)."""
    lines: list[str] = field(default_factory=list)
    dropped: int = 0             # lines past MAX_KEPT
    active: bool = False         # False: fd 2 was left as it was

    def gist(self, width: int = 200) -> str:
        """The first error line (else the first line), cut to ``width``, with the count."""
        if not self.lines:
            return ""
        errors = [line for line in self.lines if line.startswith(("E", "F"))]
        first = (errors or self.lines)[0]
        message = first.split("] ", 1)[-1].strip()
        total = len(self.lines) + self.dropped
        more = f" (+{total - 1} more XLA lines)" if total > 1 else ""
        return (message[:width] + ("..." if len(message) > width else "")) + more


class _Pump(threading.Thread):
    """Reads the pipe: XLA's lines into ``captured``, the rest to the real stderr."""

    def __init__(self, read_fd: int, real_fd: int, captured: Captured) -> None:
        super().__init__(name="stitch-stderr", daemon=True)
        self.read_fd, self.real_fd, self.captured = read_fd, real_fd, captured

    def run(self) -> None:
        pending = b""
        try:
            while chunk := os.read(self.read_fd, 65536):
                pending += chunk
                *complete, pending = pending.split(b"\n")
                for line in complete:
                    self._route(line)
            if pending:
                self._route(pending)
        finally:
            os.close(self.read_fd)
            os.close(self.real_fd)

    def _route(self, line: bytes) -> None:
        if GLOG_LINE.match(line):
            if len(self.captured.lines) < MAX_KEPT:
                self.captured.lines.append(line.decode(errors="replace"))
            else:
                self.captured.dropped += 1
            return
        with contextlib.suppress(OSError):
            os.write(self.real_fd, line + b"\n")


@contextlib.contextmanager
def xla_stderr_captured() -> Iterator[Captured]:
    """fd 2 into a pipe while the block runs (restored in ``finally``); yields what XLA
    wrote there. A no-op (``active`` False) where fd 2 cannot be redirected or another
    capture holds it."""
    captured = Captured()
    if not _ACTIVE.acquire(blocking=False):
        yield captured
        return
    try:
        try:
            _flush_streams()
            saved = os.dup(2)
            pump_real = os.dup(2)
            read_fd, write_fd = os.pipe()
        except OSError as exc:
            log.debug("XLA's stderr not captured: %s", exc)
            yield captured
            return
        pump = _Pump(read_fd, pump_real, captured)
        pump.start()
        try:
            os.dup2(write_fd, 2)
            captured.active = True
        except OSError as exc:
            log.debug("XLA's stderr not captured: %s", exc)
        finally:
            os.close(write_fd)
        if not captured.active:
            os.close(saved)
            yield captured
            return
        try:
            yield captured
        finally:
            _flush_streams()
            os.dup2(saved, 2)          # the pipe's last write end closes: the pump ends
            os.close(saved)
            # A child started meanwhile may hold the pipe: the pump then keeps forwarding.
            pump.join(timeout=2.0)
    finally:
        _ACTIVE.release()


def _flush_streams() -> None:
    for stream in (sys.stderr, sys.__stderr__):
        with contextlib.suppress(Exception):
            stream.flush()
