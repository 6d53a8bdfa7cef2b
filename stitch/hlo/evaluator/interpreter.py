"""The interpreter: walks computations in post order and dispatches to the opcode handlers.

Values are numpy arrays (logical row-major values; layouts matter only to ``bitcast``),
Python tuples for tuple-shaped values and ``TOKEN`` for tokens.

Scalar computations (reducers, comparators, scatter combiners, ``map``) are run
*vectorised*: their parameters are whole arrays and every op combines them elementwise with
numpy broadcasting. A scalar computation that contains something non-elementwise falls back
to a per-element loop.
"""
from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from ..errors import HloEvaluationError, StitchError, UnsupportedOpcodeError
from ..ir import Computation, HloModule, Instruction, Shape
from ..combiners import combiner_kind
from ..literals import literal_to_numpy
from .dtypes import contiguous, numpy_dtype
from .registry import ELEMENTWISE, HANDLERS, TOKEN

log = logging.getLogger("stitch.evaluator")

# Opcodes that are the identity on a rank-0 value (so they may appear in scalar computations).
_SCALAR_IDENTITY = frozenset({"broadcast", "reshape", "copy", "transpose", "bitcast"})
_VECTOR_SAFE = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "call",
                          "fusion", "map", "optimization-barrier"}) | _SCALAR_IDENTITY


# What an op's handler raises when it cannot evaluate its instruction on these values:
# numpy's errors for mismatched shapes, dtypes without a loop, axes and indices out of
# range (ValueError, TypeError, IndexError; LinAlgError and AxisError derive from them),
# arithmetic errors, numpy's NotImplementedError for a dtype it has no routine for, and
# the attribute lookups of a malformed instruction (KeyError, AttributeError). Only these
# become an HloEvaluationError naming the instruction; anything else (MemoryError,
# RecursionError, KeyboardInterrupt, a signal handler's timeout) is not the evaluator's to
# judge and reaches the caller unchanged.
EVALUATION_FAILURES: tuple[type[Exception], ...] = (
    ValueError, TypeError, LookupError, ArithmeticError, AttributeError, NotImplementedError)


class Evaluator:
    """Evaluates one module; caches constants and per-computation analyses."""

    def __init__(self, module: HloModule):
        self.module = module
        self._computations = {c.name: c for c in module.computations}
        self._orders: dict[str, list[Instruction]] = {}
        self._tables: dict[str, dict[str, Instruction]] = {}
        self._constants: dict[int, np.ndarray] = {}
        self._vectorizable: dict[str, bool] = {}
        self._binary_kinds: dict[str, str | None] = {}
        self._frames: list[dict[str, Instruction]] = []
        self.vectorized = False

    # --- computations -------------------------------------------------------------------
    def computation(self, name: str | Computation) -> Computation:
        if isinstance(name, Computation):
            return name
        comp = self._computations.get(name.lstrip("%"))
        if comp is None:
            raise HloEvaluationError(f"module {self.module.name!r} has no computation {name!r}")
        return comp

    def _order(self, comp: Computation) -> list[Instruction]:
        """Post order of the instructions the root depends on (dead code is skipped)."""
        order = self._orders.get(comp.name)
        if order is None:
            order = self._orders[comp.name] = comp.live_post_order()
        return order

    def _table(self, comp: Computation) -> dict[str, Instruction]:
        table = self._tables.get(comp.name)
        if table is None:
            table = self._tables[comp.name] = comp.by_name()
        return table

    def shape_of(self, operand: str) -> Shape:
        """The shape (with layout) of an instruction of the computation being evaluated."""
        return self._frames[-1][operand].shape

    def apply_instruction(self, comp: Computation | str, inst: Instruction,
                          operands: Sequence[object]) -> object:
        """Evaluate one instruction of ``comp`` on given operand values (one per operand;
        code generators use it as the oracle for a single op)."""
        comp = self.computation(comp)
        handler = HANDLERS.get(inst.opcode)
        if handler is None:
            raise UnsupportedOpcodeError(inst.opcode, inst.name)
        self._frames.append(self._table(comp))
        try:
            return self._conform(inst, inst.shape, handler(self, inst, list(operands)))
        finally:
            self._frames.pop()

    def run(self, comp: Computation | str, args: Sequence[object]) -> object:
        """Evaluate ``comp`` on ``args`` (one value per parameter number)."""
        comp = self.computation(comp)
        values: dict[str, object] = {}
        self._frames.append(self._table(comp))
        try:
            for inst in self._order(comp):
                values[inst.name] = self._evaluate(comp, inst, values, args)
        finally:
            self._frames.pop()
        return values[comp.root.name]

    def call(self, comp: Computation | str, args: Sequence[object]) -> object:
        """Run a computation on full (non-vectorised) values."""
        saved, self.vectorized = self.vectorized, False
        try:
            return self.run(comp, args)
        finally:
            self.vectorized = saved

    def _evaluate(self, comp: Computation, inst: Instruction, values: dict[str, object],
                  args: Sequence[object]) -> object:
        opcode = inst.opcode
        if opcode == "parameter":
            number = inst.parameter_number or 0
            if number >= len(args):
                raise HloEvaluationError(
                    f"computation {comp.name!r} needs parameter {number} but got {len(args)} values")
            return args[number]
        if opcode == "constant":
            return self._constant(inst)
        ops = [values[name] for name in inst.operands]
        if self.vectorized and opcode in _SCALAR_IDENTITY and inst.shape.rank == 0:
            return self._scalar_identity(inst, ops[0])
        handler = HANDLERS.get(opcode)
        if handler is None:
            raise UnsupportedOpcodeError(opcode, inst.name)
        try:
            return self._conform(inst, inst.shape, handler(self, inst, ops))
        except StitchError:
            raise
        except EVALUATION_FAILURES as exc:  # the op failed on these values: name it
            raise HloEvaluationError(
                f"{comp.name}/{inst.name} ({opcode}): {type(exc).__name__}: {exc}") from exc

    def _conform(self, inst: Instruction, shape: Shape, value: object) -> object:
        """Cast the handler's result to the instruction's element type; check its shape."""
        if shape.is_tuple:
            if not isinstance(value, tuple) or len(value) != len(shape.tuple_shapes):
                raise HloEvaluationError(
                    f"internal: {inst.name} ({inst.opcode}) should produce a {len(shape.tuple_shapes)}"
                    f"-tuple, got {type(value).__name__}")
            return tuple(self._conform(inst, s, v) for s, v in zip(shape.tuple_shapes, value))
        if not shape.is_array:
            return TOKEN
        value = np.asarray(value)
        dtype = numpy_dtype(shape.element_type)
        if value.dtype != dtype:
            value = value.astype(dtype)
        if not self.vectorized and value.shape != shape.dims and -1 not in shape.dims:
            raise HloEvaluationError(
                f"internal: {inst.name} ({inst.opcode}) produced shape {value.shape}, "
                f"expected {shape.dims}")
        return value

    def _constant(self, inst: Instruction) -> np.ndarray:
        cached = self._constants.get(id(inst))
        if cached is None:
            if inst.literal is None:
                raise HloEvaluationError(f"constant {inst.name!r} has no literal")
            if not inst.shape.is_array:
                raise UnsupportedOpcodeError("constant (tuple literal)", inst.name)
            try:
                cached = literal_to_numpy(inst.literal, inst.shape, numpy_dtype(inst.shape.element_type))
            except ValueError as exc:
                raise HloEvaluationError(f"constant {inst.name!r}: {exc}") from exc
            cached.flags.writeable = False
            self._constants[id(inst)] = cached
        return cached

    def _scalar_identity(self, inst: Instruction, value: object) -> np.ndarray:
        value = np.asarray(value)
        dtype = numpy_dtype(inst.shape.element_type)
        if value.dtype != dtype:
            if inst.opcode != "bitcast" or value.dtype.itemsize != dtype.itemsize:
                raise HloEvaluationError(f"{inst.name}: cannot reinterpret {value.dtype} as {dtype}")
            value = contiguous(value).view(dtype)
        return value

    # --- scalar computations applied to arrays ------------------------------------------
    def is_vectorizable(self, comp: Computation | str) -> bool:
        """True when every instruction of ``comp`` is scalar and elementwise."""
        comp = self.computation(comp)
        known = self._vectorizable.get(comp.name)
        if known is not None:
            return known
        self._vectorizable[comp.name] = False  # recursion guard
        ok = True
        for inst in self._order(comp):
            leaves = list(inst.shape.leaves())
            if any(s.is_array and s.rank != 0 for s in leaves):
                ok = False
            elif inst.opcode in ("call", "fusion", "map"):
                ok = all(self.is_vectorizable(c) for c in inst.called_computations)
            elif inst.opcode not in _VECTOR_SAFE and inst.opcode not in ELEMENTWISE:
                ok = False
            if not ok:
                break
        self._vectorizable[comp.name] = ok
        return ok

    def apply(self, comp: Computation | str, args: Sequence[object]) -> object:
        """Apply a scalar computation elementwise to array arguments (numpy broadcasting).

        Arguments may be arrays or tuples of arrays (for tuple-typed parameters); the result
        has the broadcast shape of all argument leaves.
        """
        comp = self.computation(comp)
        leaves = [np.asarray(a) for a in _leaves(args)]
        shape = np.broadcast_shapes(*(a.shape for a in leaves)) if leaves else ()
        if self.is_vectorizable(comp):
            saved, self.vectorized = self.vectorized, True
            try:
                result = self.run(comp, args)
            finally:
                self.vectorized = saved
            return _map_leaves(result, lambda v: np.broadcast_to(v, shape))
        return self._apply_by_element(comp, args, shape)

    def _apply_by_element(self, comp: Computation, args: Sequence[object], shape: tuple) -> object:
        log.debug("computation %s is not elementwise; applying it per element (%d)",
                  comp.name, int(np.prod(shape)))
        bcast = [_map_leaves(a, lambda v: np.broadcast_to(np.asarray(v), shape)) for a in args]
        results = []
        for index in np.ndindex(*shape):
            scalar_args = [_map_leaves(a, lambda v: np.asarray(v[index])) for a in bcast]
            results.append(self.call(comp, scalar_args))
        if not results:
            out_shape = self.computation(comp).root.shape
            return _empty_like_shape(out_shape, shape)
        return _stack_leaves(results, shape)

    def binary_kind(self, comp: Computation | str) -> str | None:
        """``stitch.hlo.combiners.combiner_kind`` of the computation, memoized."""
        comp = self.computation(comp)
        if comp.name not in self._binary_kinds:
            self._binary_kinds[comp.name] = combiner_kind(comp)
        return self._binary_kinds[comp.name]


def _leaves(value: object) -> list:
    if isinstance(value, (tuple, list)):
        out = []
        for v in value:
            out.extend(_leaves(v))
        return out
    if value is TOKEN:
        return []
    return [value]


def _map_leaves(value: object, fn) -> object:
    if isinstance(value, tuple):
        return tuple(_map_leaves(v, fn) for v in value)
    if value is TOKEN:
        return value
    return fn(value)


def _stack_leaves(results: list, shape: tuple) -> object:
    first = results[0]
    if isinstance(first, tuple):
        return tuple(_stack_leaves([r[i] for r in results], shape) for i in range(len(first)))
    if first is TOKEN:
        return TOKEN
    return np.stack([np.asarray(r) for r in results]).reshape(shape)


def _empty_like_shape(out: Shape, shape: tuple) -> object:
    if out.is_tuple:
        return tuple(_empty_like_shape(s, shape) for s in out.tuple_shapes)
    if not out.is_array:
        return TOKEN
    return np.zeros(shape, numpy_dtype(out.element_type))


def flatten(value: object) -> list[np.ndarray]:
    """A value's array leaves depth-first, as fresh writable arrays (never views of the
    arguments); tokens become empty bool arrays."""
    if isinstance(value, tuple):
        out: list[np.ndarray] = []
        for v in value:
            out.extend(flatten(v))
        return out
    if value is TOKEN:
        return [np.zeros((0,), np.bool_)]
    return [np.array(value, copy=True)]
