"""The opcode -> handler table the interpreter dispatches on.

A handler is ``fn(ev, inst, ops) -> value``: ``ev`` is the running ``Evaluator``, ``inst``
the instruction, ``ops`` its operand values (numpy arrays, or Python tuples for tuple-shaped
values). It returns a numpy array (or a tuple of values) and never mutates ``ops``.
"""
from __future__ import annotations

from typing import Callable

HANDLERS: dict[str, Callable] = {}

# Opcodes whose handlers only combine their operands elementwise (numpy broadcasting), so a
# computation made of them can run on whole arrays at once (reducers, comparators, map).
ELEMENTWISE: set[str] = set()


def handles(*opcodes: str, elementwise: bool = False) -> Callable[[Callable], Callable]:
    """Register the decorated function as the handler of ``opcodes``."""
    def register(fn: Callable) -> Callable:
        for opcode in opcodes:
            if opcode in HANDLERS:
                raise RuntimeError(f"opcode {opcode!r} registered twice")
            HANDLERS[opcode] = fn
            if elementwise:
                ELEMENTWISE.add(opcode)
        return fn
    return register


class Token:
    """The value of a token (``after-all``): carries nothing."""

    _instance: "Token | None" = None

    def __new__(cls) -> "Token":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "Token()"


TOKEN = Token()
