"""stitch: FusionStitching for XLA.

The public surface grows with the issues; today it re-exports the HLO front end and the
reference evaluator. Nothing here imports jax or tensorflow.
"""
from hlo_passes import HloModule, evaluate, parse_hlo, print_hlo

from .errors import HloEvaluationError, HloParseError, StitchError, UnsupportedOpcodeError

__version__ = "0.1.0"

__all__ = ["HloEvaluationError", "HloModule", "HloParseError", "StitchError",
           "UnsupportedOpcodeError", "__version__", "evaluate", "parse_hlo", "print_hlo"]
