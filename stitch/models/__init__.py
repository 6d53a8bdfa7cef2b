"""Model zoo: jax functions (inference and SGD training steps) with full and tiny configs.

Every model is a pure function of positional arrays (parameters included), so its lowered HLO
is a realistic input for the fusion passes. Importing this package imports jax.
"""

from .registry import build, get_model, list_models
from .spec import ModelInstance, ModelSpec

__all__ = ["ModelInstance", "ModelSpec", "build", "get_model", "list_models"]
