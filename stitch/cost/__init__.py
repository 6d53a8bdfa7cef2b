"""Cost models: GPU specs, occupancy, HBM traffic, the latency and delta evaluators, GEMM
tile and tensor-core rates, and the pricing of GEMM chains and fused LM-head losses."""
from .gpu_specs import SPECS, GpuSpec, UnknownTargetError, get_spec

__all__ = ["GpuSpec", "SPECS", "UnknownTargetError", "get_spec"]
