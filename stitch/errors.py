"""stitch's error hierarchy (defined in hlo, which may not import stitch)."""
from stitch.hlo.errors import (Cancelled, HloEvaluationError, HloParseError, PlanCancelled,
                                      StitchError, StitchRuntimeError, UnsupportedOpcodeError)

__all__ = ["Cancelled", "HloEvaluationError", "HloParseError", "PlanCancelled", "StitchError",
           "StitchRuntimeError", "UnsupportedOpcodeError"]
