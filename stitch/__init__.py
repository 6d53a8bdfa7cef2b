"""stitch: FusionStitching for XLA.

The public surface: the HLO front end, the reference evaluator, the fusion planner
(``stitch.plan``), the compiler (``stitch.compile``: an executable on the CPU, PTX per
kernel) and ``stitch.jit`` for jax. Importing stitch imports neither jax nor tensorflow
(``stitch.jit`` imports jax on first use).

``stitch.jit`` lives in the framework layer above the optimizer (``integration.jax_jit``,
on the XLA pass in ``integration.xla_pass``); it is re-exported here, on first access, as
the public name.
"""
from hlo_passes import HloModule, evaluate, parse_hlo, print_hlo

from .errors import HloEvaluationError, HloParseError, StitchError, UnsupportedOpcodeError
from .compiler import Executable, compile
from .explorer.planner import ExplorerOptions, FusionPlan, plan
from .version import __version__

_FRAMEWORK_NAMES = ("jit", "StitchedFunction")


def __getattr__(name: str):
    # Lazy: the framework layer imports this package, not the other way round at import.
    if name in _FRAMEWORK_NAMES:
        from integration import jax_jit
        return getattr(jax_jit, name)
    raise AttributeError(f"module 'stitch' has no attribute {name!r}")

__all__ = ["Executable", "ExplorerOptions", "FusionPlan", "StitchedFunction", "HloEvaluationError", "HloModule", "HloParseError",
           "StitchError", "UnsupportedOpcodeError", "__version__", "compile", "evaluate",
           "jit", "parse_hlo", "plan", "print_hlo"]
