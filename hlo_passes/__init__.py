"""The HLO layer of stitch: parse, print and evaluate XLA HLO text.

No dependency on ``stitch`` or ``codegen``.
"""
from .errors import HloEvaluationError, HloParseError, StitchError, UnsupportedOpcodeError
from .ir import Computation, HloModule, Instruction, Layout, Shape, Signature
from .parser import parse_hlo
from .printer import print_hlo


def evaluate(module, args):
    """Evaluate ``module`` (an HloModule or HLO text) on numpy ``args``; see evaluator."""
    from .evaluator import evaluate as _evaluate  # numpy-heavy; imported on first use
    return _evaluate(module, args)


__all__ = [
    "Computation", "HloEvaluationError", "HloModule", "HloParseError", "Instruction", "Layout",
    "Shape", "Signature", "StitchError", "UnsupportedOpcodeError", "evaluate", "parse_hlo",
    "print_hlo",
]
