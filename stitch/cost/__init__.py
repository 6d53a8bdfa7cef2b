"""Cost models: the GPU spec table (and, later, occupancy and the delta/latency evaluators)."""
from .gpu_specs import SPECS, GpuSpec, UnknownTargetError, get_spec

__all__ = ["GpuSpec", "SPECS", "UnknownTargetError", "get_spec"]
