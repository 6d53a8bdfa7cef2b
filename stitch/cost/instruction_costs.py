"""Thread instructions an op costs per element it computes, by op class and, for expensive
ops, by opcode: the compute term of every kernel time model (the delta-evaluator, the schedule
spaces, GEMM chain pricing)."""
from __future__ import annotations

from stitch.hlo.op_classes import OpClass

# Thread instructions per element (FP32 pipeline issue slots). Light ops are one
# instruction; layout ops cost their index arithmetic. Expensive ops: libdevice expansions
# (expf ~ 8 instructions incl. range reduction, logf ~ 14, tanhf/erff ~ 20, IEEE divide ~ 10
# with its Newton step; rsqrt/sqrt issue on the quarter-rate SFU, 4 slots).
INSTRUCTIONS_PER_ELEMENT = {
    OpClass.LIGHT: 1.0, OpClass.LAYOUT: 2.0, OpClass.REDUCTION: 2.0, OpClass.EXPENSIVE: 10.0,
}
EXPENSIVE_INSTRUCTIONS = {
    "rsqrt": 4.0, "sqrt": 4.0, "exponential": 8.0, "exponential-minus-one": 10.0,
    "logistic": 12.0, "log": 14.0, "log-plus-one": 16.0, "tanh": 20.0, "erf": 20.0,
    "divide": 10.0, "power": 30.0, "sine": 16.0, "cosine": 16.0, "tan": 24.0,
    "atan2": 30.0, "remainder": 20.0, "cbrt": 20.0,
}
