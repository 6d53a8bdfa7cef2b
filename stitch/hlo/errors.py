"""The one error hierarchy of the project.

It lives in ``hlo`` because that package may not import ``stitch``; ``stitch.errors``
re-exports it so users see ``stitch.StitchError``.
"""
from __future__ import annotations


class StitchError(Exception):
    """Base class of every error raised on purpose by stitch."""


class Cancelled(StitchError):
    """Work stopped on request (the compile thread is shutting down), not a failure."""


class PlanCancelled(Cancelled):
    """Planning was stopped by its ``cancel`` callable (the compile thread is shutting down)."""


class StitchRuntimeError(StitchError, RuntimeError):
    """A stitched program failed in a way stock XLA cannot recover for that call (its
    donated inputs were already consumed)."""


class HloParseError(StitchError, ValueError):
    """HLO text that cannot be read: carries the 1-based line and column and what was expected."""

    def __init__(self, message: str, line: int = 0, column: int = 0, source_line: str = ""):
        self.message = message
        self.line = line
        self.column = column
        self.source_line = source_line
        where = f"line {line}, column {column}: " if line else ""
        text = f"{where}{message}"
        if source_line:
            caret = " " * (max(column, 1) - 1) + "^"
            text += f"\n  {source_line[:200]}\n  {caret[:201]}"
        super().__init__(text)


class HloEvaluationError(StitchError):
    """The reference evaluator cannot evaluate a module (bad arguments, bad attribute values)."""


class UnsupportedOpcodeError(HloEvaluationError, NotImplementedError):
    """The reference evaluator has no semantics for this opcode."""

    def __init__(self, opcode: str, instruction: str = ""):
        self.opcode = opcode
        self.instruction = instruction
        where = f" (instruction {instruction!r})" if instruction else ""
        super().__init__(f"opcode {opcode!r} is not supported by the reference evaluator{where}")
