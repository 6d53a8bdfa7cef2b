"""stitch's error hierarchy (defined in hlo_passes, which may not import stitch)."""
from stitch.hlo_passes.errors import (Cancelled, HloEvaluationError, HloParseError, PlanCancelled,
                                      StitchError, StitchRuntimeError, UnsupportedOpcodeError)

__all__ = ["Cancelled", "HloEvaluationError", "HloParseError", "PlanCancelled", "StitchError",
           "StitchRuntimeError", "UnsupportedOpcodeError"]
