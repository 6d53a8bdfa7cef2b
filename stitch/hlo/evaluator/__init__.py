"""numpy reference evaluator for XLA HLO: the oracle the rest of stitch is tested against.

``evaluate(module, args)`` runs the ENTRY computation of an ``HloModule`` (or HLO text) on
numpy arrays and returns the root value's array leaves, depth-first.

Semantics are XLA's, computed in each instruction's own element type (f32 in float32; bf16,
f16 and f8 computed in float32 and rounded after every op). Layouts only matter to
``bitcast``. Modules:

* ``interpreter`` - the walk over computations, constants, vectorised scalar computations
* ``dtypes`` - element types <-> numpy dtypes
* ``elementwise`` - arithmetic, math, bit ops, compare/select/clamp, convert...
* ``shape_ops`` - broadcast/reshape/transpose/bitcast/slice/concatenate/pad/iota/reverse
* ``reductions`` - reduce, reduce-window, select-and-scatter
* ``indexing`` - dynamic-slice/-update-slice, gather, scatter
* ``linalg`` - dot, convolution, fft, cuBLAS and cuDNN custom calls
* ``control`` - tuple, call, fusion, while, conditional, tokens, async wrappers
* ``sort`` - sort, topk
* ``batch_norm`` - batch-norm-training/-inference/-grad
* ``custom_calls`` - the custom-call target table

Checked against XLA's CPU backend (tests/test_evaluator_xla_semantics.py): a
single-participant collective-permute returns its operand only with a (0, 0) pair, zeros
otherwise; complex division recovers C99's infinities and zeros where numpy's quotient is
NaN (finite/inf = 0); reduce-window skips padding and base-dilation holes (the init is the
start of every window, not one more element per padding position).

Deliberate choices where HLO leaves room: reductions whose reducer is a single add/mul/
max/min on bf16/f16 accumulate in f32 and round once (what XLA's backends do after float
normalisation); sort is always stable; token values come back as empty bool arrays.
XLA backends may run with excess precision (converts to bf16 removed by the compiler), so
compare low-precision results against XLA with bf16-level tolerance. Not supported (raise
UnsupportedOpcodeError): rng ops, infeed/outfeed/send/recv, cholesky, triangular-solve,
multi-participant collectives, stochastic-convert, ragged ops, other custom-call targets.
"""
from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from ..errors import HloEvaluationError
from ..ir import HloModule, Shape
# Importing the handler modules registers their opcodes.
from . import (batch_norm, control, elementwise, indexing, linalg, reductions,  # noqa: F401
               shape_ops, sort)
from .dtypes import numpy_dtype
from .interpreter import Evaluator, flatten
from .registry import HANDLERS, TOKEN

log = logging.getLogger("stitch.evaluator")


def _check_argument(value: object, shape: Shape, where: str) -> object:
    if shape.is_tuple:
        if not isinstance(value, (tuple, list)) or len(value) != len(shape.tuple_shapes):
            raise HloEvaluationError(f"{where}: expected a {len(shape.tuple_shapes)}-tuple {shape}")
        return tuple(_check_argument(v, s, f"{where}[{i}]")
                     for i, (v, s) in enumerate(zip(value, shape.tuple_shapes)))
    if not shape.is_array:
        return TOKEN
    array = np.asarray(value)
    dtype = numpy_dtype(shape.element_type)
    if array.dtype != dtype:
        raise HloEvaluationError(
            f"{where}: expected {shape.without_layout()} ({dtype}), got dtype {array.dtype}")
    dims = shape.dims
    if len(array.shape) != len(dims) or any(d != -1 and d != a for d, a in zip(dims, array.shape)):
        raise HloEvaluationError(
            f"{where}: expected {shape.without_layout()}, got shape {tuple(array.shape)}")
    return array


def evaluate(module: HloModule | str, args: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Evaluate the ENTRY computation of ``module`` on ``args`` (in parameter order).

    Each argument must match its parameter's shape and dtype exactly (HloEvaluationError
    naming the parameter otherwise). Returns the root value's array leaves depth-first
    (tokens become empty bool arrays). Unsupported opcodes raise UnsupportedOpcodeError.
    """
    if isinstance(module, str):
        from ..parser import parse_hlo
        module = parse_hlo(module)
    entry = module.entry
    params = entry.parameters
    if len(args) != len(params):
        raise HloEvaluationError(
            f"{entry.name} takes {len(params)} arguments, got {len(args)}")
    checked = []
    for number, (param, value) in enumerate(zip(params, args)):
        if param.parameter_number != number:
            raise HloEvaluationError(f"{entry.name}: parameter numbers are not 0..{len(params) - 1}")
        checked.append(_check_argument(value, param.shape, f"parameter {number} ({param.name})"))
    log.debug("evaluating %s (%d computations)", module.name, len(module.computations))
    with np.errstate(all="ignore"):
        value = Evaluator(module).run(entry, checked)
    try:
        return flatten(value)        # a broadcast result is a view until it is copied out
    except MemoryError as exc:
        raise HloEvaluationError(f"{entry.name}: the result {entry.root.shape} does not fit "
                                 f"in this host's memory ({exc})") from exc


__all__ = ["evaluate", "Evaluator", "HANDLERS"]
