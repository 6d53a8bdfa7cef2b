"""stitch: FusionStitching for XLA.

The public surface grows with the issues: the HLO front end, the reference evaluator and
the fusion planner (``stitch.plan``). Nothing here imports jax or tensorflow.
"""
from hlo_passes import HloModule, evaluate, parse_hlo, print_hlo

from .errors import HloEvaluationError, HloParseError, StitchError, UnsupportedOpcodeError
from .explorer.planner import ExplorerOptions, FusionPlan, plan

__version__ = "0.1.0"

__all__ = ["ExplorerOptions", "FusionPlan", "HloEvaluationError", "HloModule", "HloParseError",
           "StitchError", "UnsupportedOpcodeError", "__version__", "evaluate", "parse_hlo",
           "plan", "print_hlo"]
