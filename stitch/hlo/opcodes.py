"""The HLO opcodes stitch knows, and the operand counts the parser checks."""
from __future__ import annotations

UNARY_ELEMENTWISE = frozenset({
    "abs", "cbrt", "ceil", "cosine", "count-leading-zeros", "erf", "exponential",
    "exponential-minus-one", "floor", "imag", "is-finite", "log", "log-plus-one", "logistic",
    "negate", "not", "popcnt", "real", "reduce-precision", "round-nearest-afz",
    "round-nearest-even", "rsqrt", "sign", "sine", "sqrt", "tan", "tanh", "convert",
    "bitcast-convert", "stochastic-convert",
})

BINARY_ELEMENTWISE = frozenset({
    "add", "and", "atan2", "compare", "complex", "divide", "maximum", "minimum", "multiply",
    "or", "power", "remainder", "shift-left", "shift-right-arithmetic", "shift-right-logical",
    "subtract", "xor",
})

TERNARY_ELEMENTWISE = frozenset({"select", "clamp"})

OTHER_OPCODES = frozenset({
    "after-all", "add-dependency", "all-gather", "all-gather-done", "all-gather-start",
    "all-reduce", "all-reduce-done", "all-reduce-start", "all-to-all", "async-done",
    "async-start", "async-update", "batch-norm-grad", "batch-norm-inference",
    "batch-norm-training", "bitcast", "broadcast", "call", "cholesky", "collective-broadcast",
    "collective-permute", "collective-permute-done", "collective-permute-start", "concatenate",
    "conditional", "constant", "convolution", "copy", "copy-done", "copy-start", "custom-call",
    "domain", "dot", "dynamic-reshape", "dynamic-slice", "dynamic-update-slice", "fft", "fusion",
    "gather", "get-dimension-size", "get-tuple-element", "infeed", "iota", "map",
    "optimization-barrier", "outfeed", "pad", "parameter", "partition-id", "ragged-all-to-all",
    "ragged-dot", "recv", "recv-done", "reduce", "reduce-scatter", "reduce-window", "replica-id",
    "reshape", "reverse", "rng", "rng-bit-generator", "rng-get-and-update-state", "scatter",
    "select-and-scatter", "send", "send-done", "set-dimension-size", "slice", "sort",
    "topk", "transpose", "triangular-solve", "tuple", "while",
})

KNOWN_OPCODES = UNARY_ELEMENTWISE | BINARY_ELEMENTWISE | TERNARY_ELEMENTWISE | OTHER_OPCODES

# Exact operand counts the parser enforces (a missing operand is a parse error).
_FIXED = {
    "bitcast": 1, "broadcast": 1, "copy": 1, "reshape": 1, "transpose": 1, "reverse": 1,
    "slice": 1, "get-tuple-element": 1, "pad": 2, "dot": 2, "convolution": 2,
    "reduce-precision": 1, "iota": 0, "parameter": 0, "constant": 0, "while": 1,
    "select-and-scatter": 3, "gather": 2,
    "stochastic-convert": 2,  # the operand and its random bits
}


def expected_operand_count(opcode: str) -> int | None:
    """How many operands ``opcode`` must have, or None when it varies."""
    if opcode in _FIXED:
        return _FIXED[opcode]
    if opcode in UNARY_ELEMENTWISE:
        return 1
    if opcode in BINARY_ELEMENTWISE:
        return 2
    if opcode in TERNARY_ELEMENTWISE:
        return 3
    return _FIXED.get(opcode)
