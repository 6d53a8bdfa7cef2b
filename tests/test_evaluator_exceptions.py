"""Which exceptions the reference evaluator turns into HloEvaluationError: the evaluation
failures of its own ops (numpy's ValueError/TypeError/IndexError, arithmetic errors, bad
attributes), named by instruction; anything else (a signal handler's exception, as XLA
corpus module 07671 showed under the corpus runner's alarm, MemoryError, KeyboardInterrupt)
reaches the caller unchanged."""
from __future__ import annotations

import signal

import numpy as np
import pytest

from stitch.hlo.errors import HloEvaluationError
from stitch.hlo.evaluator import evaluate
from stitch.hlo.evaluator.registry import HANDLERS
from stitch.hlo.parser import parse_hlo

BUSY = parse_hlo("""HloModule busy
ENTRY e {
  x = f32[512,512] parameter(0)
  a = f32[512,512] exponential(x)
  b = f32[512,512] tanh(a)
  c = f32[512,512] multiply(a, b)
  s = f32[512,512] sine(c)
  ROOT d = f32[512,512] add(s, x)
}""")
X = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)


class Alarm(Exception):
    """What a user's SIGALRM handler raises (a timeout of their own)."""


def _on_alarm(signum: int, frame: object) -> None:
    raise Alarm("time is up")


@pytest.fixture
def alarm_handler():
    old = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _wrapping(opcode: str, before) -> object:
    """HANDLERS[opcode] that runs ``before()`` first, inside the op."""
    original = HANDLERS[opcode]

    def handler(ev, inst, ops):
        before()
        return original(ev, inst, ops)
    return handler


def test_a_signal_handlers_exception_inside_an_op_arrives_unchanged(alarm_handler,
                                                                    monkeypatch):
    """The signal arrives while an op runs (raised from inside the handler, so the Python
    handler runs there): its exception is the caller's, not an HloEvaluationError."""
    monkeypatch.setitem(HANDLERS, "tanh",
                        _wrapping("tanh", lambda: signal.raise_signal(signal.SIGALRM)))
    with pytest.raises(Alarm, match="time is up") as caught:
        evaluate(BUSY, [X])
    assert not isinstance(caught.value, HloEvaluationError)
    assert caught.value.__cause__ is None


def test_an_alarm_during_a_long_evaluation_arrives_unchanged(alarm_handler):
    """A timer firing while a module is evaluated over and over (its ops are nearly all of
    the time): the handler's exception type reaches the loop."""
    signal.setitimer(signal.ITIMER_REAL, 0.05)
    with pytest.raises(Alarm):
        while True:
            evaluate(BUSY, [X])


@pytest.mark.parametrize("error", [MemoryError, KeyboardInterrupt, RecursionError])
def test_memory_errors_and_interrupts_from_an_op_pass_through(monkeypatch, error):
    def fail():
        raise error("from the op")
    monkeypatch.setitem(HANDLERS, "multiply", _wrapping("multiply", fail))
    with pytest.raises(error, match="from the op"):
        evaluate(BUSY, [X])


@pytest.mark.parametrize("error", [ValueError, TypeError, IndexError, KeyError,
                                   ZeroDivisionError, FloatingPointError, AttributeError])
def test_an_ops_own_failures_are_evaluation_errors_naming_the_instruction(monkeypatch,
                                                                          error):
    def fail():
        raise error("bad operands")
    monkeypatch.setitem(HANDLERS, "multiply", _wrapping("multiply", fail))
    with pytest.raises(HloEvaluationError, match=r"e/c \(multiply\): " + error.__name__) \
            as caught:
        evaluate(BUSY, [X])
    assert isinstance(caught.value.__cause__, error)
