"""stitch: FusionStitching for XLA.

The public surface: the HLO front end, the reference evaluator, the fusion planner
(``stitch.plan``), the compiler (``stitch.compile``: an executable on the CPU, PTX per
kernel) and ``stitch.jit`` for jax. Importing stitch imports neither jax nor tensorflow
(``stitch.jit`` imports jax on first use).
"""
from hlo_passes import HloModule, evaluate, parse_hlo, print_hlo

from .errors import HloEvaluationError, HloParseError, StitchError, UnsupportedOpcodeError
from .compiler import Executable, compile
from .explorer.planner import ExplorerOptions, FusionPlan, plan
from .jit import StitchedFunction, jit

__version__ = "0.1.0"

__all__ = ["Executable", "ExplorerOptions", "FusionPlan", "StitchedFunction", "HloEvaluationError", "HloModule", "HloParseError",
           "StitchError", "UnsupportedOpcodeError", "__version__", "compile", "evaluate",
           "jit", "parse_hlo", "plan", "print_hlo"]
