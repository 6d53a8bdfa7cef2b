"""stitch's error hierarchy (defined in hlo_passes, which may not import stitch)."""
from hlo_passes.errors import (HloEvaluationError, HloParseError, PlanCancelled, StitchError,
                               UnsupportedOpcodeError)

__all__ = ["HloEvaluationError", "HloParseError", "PlanCancelled", "StitchError",
           "UnsupportedOpcodeError"]
