"""custom-call targets the evaluator understands (anything else is unsupported)."""
from __future__ import annotations

from ..errors import UnsupportedOpcodeError
from .linalg import cublas_gemm, cudnn_convolution
from .sort import topk_custom_call


def _identity(ev, inst, ops):
    return ops[0]


TARGETS = {
    "__cublas$gemm": cublas_gemm,
    "__cublas$lt$matmul": cublas_gemm,
    "__cudnn$convForward": cudnn_convolution,
    "__cudnn$convBackwardInput": cudnn_convolution,
    "__cudnn$convBackwardFilter": cudnn_convolution,
    "__cudnn$convBiasActivationForward": cudnn_convolution,
    "TopK": topk_custom_call,
    "Sharding": _identity,
    "SPMDFullToShardShape": _identity,
    "SPMDShardToFullShape": _identity,
}


def dispatch(ev, inst, ops):
    target = inst.string("custom_call_target", "")
    handler = TARGETS.get(target)
    if handler is None:
        raise UnsupportedOpcodeError(f"custom-call {target}", inst.name)
    return handler(ev, inst, ops)
