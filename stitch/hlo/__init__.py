"""The HLO layer of stitch: parse, print and evaluate XLA HLO text.

No dependency on ``stitch`` or ``codegen``.
"""
from typing import TYPE_CHECKING

from .errors import HloEvaluationError, HloParseError, StitchError, UnsupportedOpcodeError

if TYPE_CHECKING:      # what __getattr__ below loads on first use, for type checkers
    from .ir import Computation, HloModule, Instruction, Layout, Shape, Signature
    from .parser import parse_hlo
    from .printer import print_hlo

# The IR, parser and printer (numpy among their imports) load on first use: a process that
# needs only the error types (a PTX build child: stitch.codegen.errors) does not pay for them.
_LAZY = {"Computation": ".ir", "HloModule": ".ir", "Instruction": ".ir", "Layout": ".ir",
         "Shape": ".ir", "Signature": ".ir", "parse_hlo": ".parser", "print_hlo": ".printer"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def evaluate(module, args):
    """Evaluate ``module`` (an HloModule or HLO text) on numpy ``args``; see evaluator."""
    from .evaluator import evaluate as _evaluate  # numpy-heavy; imported on first use
    return _evaluate(module, args)


__all__ = [
    "Computation", "HloEvaluationError", "HloModule", "HloParseError", "Instruction", "Layout",
    "Shape", "Signature", "StitchError", "UnsupportedOpcodeError", "evaluate", "parse_hlo",
    "print_hlo",
]
