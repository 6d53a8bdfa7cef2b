"""Re-emit HLO instructions as jax.lax ops.

``stitch.jit`` replaces each stitched pattern of a jax function's pre-optimization HLO by one
custom call and hands everything else back to XLA as jax ops; this module is that
"everything else". ``JaxOpEmitter.apply`` computes one instruction with jax.lax on jax values
(it only builds lax ops, so it works under ``jax.jit`` tracing); ``run_computation`` and
``run_module`` run whole computations (reducers, loop bodies, the ENTRY computation).

The numpy reference evaluator (``hlo_passes.evaluator``) is the semantic oracle: every handler
reads the attributes the way the evaluator's handler does. Most handlers lower to the very HLO
op they came from, so XLA's own semantics apply; where jax adds conventions of its own, the
handlers undo them:

* ``lax.dynamic_slice``/``dynamic_update_slice`` wrap negative starts numpy-style, HLO clamps:
  starts are clamped to ``[0, dim - size]`` first (the wrap is then a no-op).
* gather/scatter use ``GatherScatterMode.PROMISE_IN_BOUNDS``, which lowers to the plain XLA op
  (gather clamps start indices, scatter skips out-of-bounds windows: XLA's rules), after moving
  ``index_vector_dim`` last (the only place jax accepts it).
* jax has no integer ``pow``, no TOTALORDER/UNSIGNED/SIGNED compare types, no arithmetic on
  pred, no custom sort comparator, no public select-and-scatter and no public scatter with an
  arbitrary combiner: those are built from other lax ops (square-and-multiply,
  order-preserving integer keys, uint8 routes, a stable bitonic network over the emitted
  comparator, a select over window offsets, a loop over scatter windows). A comparator that
  is just ``p[2k] < p[2k+1]`` (or >, or jax's own canonicalized TOTALORDER form) becomes one
  ``lax.sort``; a reducer/combiner that is one add/mul/max/min/and/or/xor becomes the lax op.

Not emitted (JaxEmitError naming the instruction): rng/rng-bit-generator, tokens and
send/recv/infeed/outfeed, collectives and async wrappers, batch-norm ops, fft, custom calls
other than the sharding annotations, sub-byte bitcast-converts, dynamic shapes.

64-bit types need ``jax_enable_x64`` (the zoo's pre-optimization HLO has none: f32/s32/pred);
without it they raise JaxEmitError rather than silently computing in 32 bits.
"""
from __future__ import annotations

import logging
import math
from functools import partial
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from hlo_passes.evaluator.dtypes import BIT_WIDTH, numpy_dtype
from hlo_passes.ir import (Computation, HloModule, Instruction, Shape, WindowDim,
                           parse_computation_list, parse_dim_labels, parse_padding, parse_slice,
                           parse_window)
from hlo_passes.literals import literal_to_numpy
from stitch.errors import StitchError

log = logging.getLogger("stitch.frontends.jax_ops")

Value = Any  # a jax array, or a Python tuple of values for tuple-shaped HLO values
Handler = Callable[["JaxOpEmitter", Instruction, list], Value]


class JaxEmitError(StitchError):
    """An instruction cannot be re-emitted as jax ops (unsupported opcode or attribute)."""

    def __init__(self, instruction: str, opcode: str, reason: str):
        self.instruction = instruction
        self.opcode = opcode
        self.reason = reason
        super().__init__(f"cannot emit {instruction!r} ({opcode}) as jax ops: {reason}")


_HANDLERS: dict[str, Handler] = {}


def _handles(*opcodes: str) -> Callable[[Handler], Handler]:
    """Register the decorated function as the jax emitter of ``opcodes``."""
    def register(fn: Handler) -> Handler:
        for opcode in opcodes:
            if opcode in _HANDLERS:
                raise RuntimeError(f"opcode {opcode!r} registered twice")
            _HANDLERS[opcode] = fn
        return fn
    return register


def supported_opcodes() -> frozenset[str]:
    """Every opcode ``JaxOpEmitter.apply`` has a handler for (parameter/constant included)."""
    return frozenset(_HANDLERS) | {"parameter", "constant"}


# --- element types -------------------------------------------------------------------------
def jax_dtype(element_type: str) -> np.dtype:
    """The dtype jax computes ``element_type`` in; 64-bit types need jax_enable_x64."""
    dtype = numpy_dtype(element_type)
    wide = dtype.itemsize == 8 and dtype.kind != "c" or dtype.itemsize == 16
    if wide and not jax.config.jax_enable_x64:
        raise ValueError(f"element type {element_type} needs jax_enable_x64")
    return dtype


def _out_dtype(inst: Instruction) -> np.dtype:
    return jax_dtype(inst.shape.element_type)


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _is_int(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.integer)


def _is_complex(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.complexfloating)


def _is_signed(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.signedinteger)


def _int_type(bits: int, signed: bool) -> np.dtype:
    return np.dtype(f"{'i' if signed else 'u'}{bits // 8}")


def _scalar(value: int | float, dtype) -> jax.Array:
    """A strongly typed scalar constant (weak types would change while-loop carries)."""
    return jnp.asarray(np.asarray(value, dtype=dtype))


def _storage_bits(dtype) -> int:
    return np.dtype(dtype).itemsize * 8


# --- the emitter ---------------------------------------------------------------------------
class JaxOpEmitter:
    """Emits the instructions of one HLO module as jax.lax ops (see the module docstring)."""

    def __init__(self, module: HloModule):
        self.module = module
        self._computations = {c.name: c for c in module.computations}
        self._tables: dict[str, dict[str, Instruction]] = {}
        self._orders: dict[str, list[Instruction]] = {}
        self._constants: dict[int, np.ndarray] = {}
        self._frames: list[dict[str, Instruction]] = []

    # computations --------------------------------------------------------------------
    def computation(self, comp: Computation | str) -> Computation:
        if isinstance(comp, Computation):
            return comp
        found = self._computations.get(comp.lstrip("%"))
        if found is None:
            raise JaxEmitError(comp, "computation", f"module {self.module.name!r} has no such "
                               "computation")
        return found

    def _table(self, comp: Computation) -> dict[str, Instruction]:
        table = self._tables.get(comp.name)
        if table is None:
            table = self._tables[comp.name] = comp.by_name()
        return table

    def _order(self, comp: Computation) -> list[Instruction]:
        """Post order of what the root depends on (dead code is not emitted)."""
        order = self._orders.get(comp.name)
        if order is None:
            order = self._orders[comp.name] = comp.live_post_order()
        return order

    def shape_of(self, operand: str) -> Shape:
        """The shape (with layout) of an instruction of the computation being emitted."""
        return self._frames[-1][operand].shape

    # emission ------------------------------------------------------------------------
    def apply(self, comp: Computation | str, inst: Instruction, operands: Sequence[Value]) -> Value:
        """The jax value of ``inst`` (an instruction of ``comp``) given one jax value per
        operand (tuple-shaped operands as Python tuples)."""
        comp = self.computation(comp)
        if inst.opcode == "constant":
            return self.constant(inst)
        if inst.opcode == "parameter":
            raise JaxEmitError(inst.name, inst.opcode, "a parameter's value comes from "
                               "run_computation's arguments")
        handler = _HANDLERS.get(inst.opcode)
        if handler is None:
            raise JaxEmitError(inst.name, inst.opcode, "unsupported opcode")
        self._frames.append(self._table(comp))
        try:
            value = handler(self, inst, list(operands))
        except StitchError:
            raise
        except Exception as exc:  # jax/attribute errors: name the instruction
            raise JaxEmitError(inst.name, inst.opcode, f"{type(exc).__name__}: {exc}") from exc
        finally:
            self._frames.pop()
        _check_value(inst, inst.shape, value)
        return value

    def constant(self, inst: Instruction) -> jax.Array:
        cached = self._constants.get(id(inst))
        if cached is None:
            if inst.literal is None or not inst.shape.is_array:
                raise JaxEmitError(inst.name, inst.opcode, "needs an array literal")
            try:
                dtype = jax_dtype(inst.shape.element_type)
                cached = literal_to_numpy(inst.literal, inst.shape, dtype)
            except ValueError as exc:
                raise JaxEmitError(inst.name, inst.opcode, str(exc)) from exc
            self._constants[id(inst)] = cached
        return jnp.asarray(cached)

    def run_computation(self, comp: Computation | str, args: Sequence[Value]) -> Value:
        """The root value of ``comp`` on ``args`` (one value per parameter number)."""
        comp = self.computation(comp)
        values: dict[str, Value] = {}
        for inst in self._order(comp):
            if inst.opcode == "parameter":
                number = inst.parameter_number or 0
                if number >= len(args):
                    raise JaxEmitError(inst.name, "parameter", f"{comp.name} got {len(args)} "
                                       f"arguments, needs parameter {number}")
                values[inst.name] = args[number]
            else:
                values[inst.name] = self.apply(comp, inst, [values[o] for o in inst.operands])
        return values[comp.root.name]

    def run_module(self, args: Sequence[Value]) -> list[jax.Array]:
        """Run the ENTRY computation on ``args`` (in parameter order); the root's array leaves
        depth-first, like ``hlo_passes.evaluate``."""
        entry = self.module.entry
        if len(args) != len(entry.parameters):
            raise JaxEmitError(entry.name, "ENTRY", f"takes {len(entry.parameters)} arguments, "
                               f"got {len(args)}")
        log.debug("emitting %s (%d computations)", self.module.name, len(self.module.computations))
        return _leaves(self.run_computation(entry, list(args)))

    # scalar computations on arrays ---------------------------------------------------
    def binary_kind(self, comp: Computation | str) -> str | None:
        """``add``/``multiply``/... when the two-parameter computation is exactly that op on its
        parameters (same element type), ``assign``/``keep`` when it returns parameter 1/0."""
        comp = self.computation(comp)
        params = comp.parameters
        root = comp.root
        if len(params) != 2 or any(not p.shape.is_array or p.shape.rank for p in params):
            return None
        if root.opcode == "parameter":
            return "assign" if root.name == params[1].name else "keep"
        types = {p.shape.element_type for p in params} | {root.shape.element_type}
        on_params = sorted(root.operands) == sorted(p.name for p in params)
        if len(types) == 1 and root.opcode in _MONOIDS and on_params:
            return root.opcode
        return None

    def scalar_fn(self, comp: Computation | str) -> Callable[..., Value]:
        """``comp`` as a Python function of its parameters (for lax.reduce, vmap...)."""
        comp = self.computation(comp)
        return lambda *args: self.run_computation(comp, list(args))

    def apply_elementwise(self, comp: Computation | str, args: Sequence[Value]) -> Value:
        """Apply a scalar computation to every element of broadcast-compatible arrays (one
        vmap over the flattened elements)."""
        leaves = jax.tree_util.tree_leaves(list(args))
        shape = jnp.broadcast_shapes(*(jnp.shape(v) for v in leaves)) if leaves else ()
        flat = jax.tree_util.tree_map(lambda v: jnp.broadcast_to(v, shape).reshape(-1), list(args))
        out = jax.vmap(self.scalar_fn(comp))(*flat)
        return jax.tree_util.tree_map(lambda v: v.reshape(shape), out)


def _check_value(inst: Instruction, shape: Shape, value: Value) -> None:
    """A handler's result must have the instruction's shape and element type exactly."""
    if shape.is_tuple:
        if not isinstance(value, tuple) or len(value) != len(shape.tuple_shapes):
            raise JaxEmitError(inst.name, inst.opcode, f"internal: expected a "
                               f"{len(shape.tuple_shapes)}-tuple, got {type(value).__name__}")
        for sub, v in zip(shape.tuple_shapes, value):
            _check_value(inst, sub, v)
        return
    if not shape.is_array:
        raise JaxEmitError(inst.name, inst.opcode, f"{shape.element_type} values are not supported")
    got_shape, got_dtype = tuple(jnp.shape(value)), np.dtype(jnp.result_type(value))
    if -1 not in shape.dims and got_shape != shape.dims:
        raise JaxEmitError(inst.name, inst.opcode, f"internal: produced shape {got_shape}, "
                           f"expected {shape.dims}")
    try:
        want = jax_dtype(shape.element_type)
    except ValueError as exc:
        raise JaxEmitError(inst.name, inst.opcode, str(exc)) from exc
    if got_dtype != want:
        raise JaxEmitError(inst.name, inst.opcode, f"internal: produced {got_dtype}, expected "
                           f"{shape.element_type}")


def _leaves(value: Value) -> list:
    if isinstance(value, tuple):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


def _called(inst: Instruction, key: str) -> str:
    return parse_computation_list(inst.attrs[key])[0]


# --- elementwise -----------------------------------------------------------------------
_UNARY: dict[str, Callable] = {
    "exponential": lax.exp, "exponential-minus-one": lax.expm1, "log": lax.log,
    "log-plus-one": lax.log1p, "logistic": lax.logistic, "tanh": lax.tanh, "erf": lax.erf,
    "sqrt": lax.sqrt, "rsqrt": lax.rsqrt, "cbrt": lax.cbrt, "sine": lax.sin, "cosine": lax.cos,
    "tan": lax.tan, "floor": lax.floor, "ceil": lax.ceil,
    "round-nearest-afz": partial(lax.round, rounding_method=lax.RoundingMethod.AWAY_FROM_ZERO),
    "round-nearest-even": partial(lax.round, rounding_method=lax.RoundingMethod.TO_NEAREST_EVEN),
    "abs": lax.abs, "negate": lax.neg, "sign": lax.sign, "is-finite": lax.is_finite,
    "real": lax.real, "imag": lax.imag, "not": lax.bitwise_not, "popcnt": lax.population_count,
    "count-leading-zeros": lax.clz,
}


@_handles(*_UNARY)
def _unary(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    x = ops[0]
    if x.dtype == jnp.bool_ and inst.opcode in ("abs", "sign"):
        return x  # |p| and sign(p) of a pred are p
    if x.dtype == jnp.bool_ and inst.opcode in ("negate", "popcnt", "count-leading-zeros"):
        return _via_uint8(_UNARY[inst.opcode], [x], _out_dtype(inst))
    if inst.opcode in ("real", "imag") and not _is_complex(x.dtype):
        return x if inst.opcode == "real" else jnp.zeros_like(x)  # lax wants complex input
    return _UNARY[inst.opcode](x)


def _int_power(a: jax.Array, b: jax.Array) -> jax.Array:
    """Integer power by square-and-multiply over every exponent bit (jax has no integer
    lax.pow); negative exponents give 1 for base 1, +-1 for base -1 and 0 otherwise."""
    one = _scalar(1, a.dtype)
    signed = _is_signed(a.dtype)
    exp = lax.select(b < 0, jnp.zeros_like(b), b) if signed else b
    result, base = jnp.ones_like(a), a
    for _ in range(_storage_bits(a.dtype)):
        result = lax.select(lax.bitwise_and(exp, one) != 0, result * base, result)
        base = base * base
        exp = lax.shift_right_logical(exp, one)
    if signed:
        odd = lax.bitwise_and(b, one) != 0
        minus_one = lax.select(odd, jnp.full_like(a, -1), jnp.ones_like(a))
        negative = lax.select(a == one, jnp.ones_like(a),
                              lax.select(a == -one, minus_one, jnp.zeros_like(a)))
        result = lax.select(b < 0, negative, result)
    return result


def _power(a: jax.Array, b: jax.Array) -> jax.Array:
    return _int_power(a, b) if _is_int(a.dtype) else lax.pow(a, b)


_MONOIDS: dict[str, Callable] = {
    "add": lax.add, "multiply": lax.mul, "maximum": lax.max, "minimum": lax.min,
    "and": lax.bitwise_and, "or": lax.bitwise_or, "xor": lax.bitwise_xor,
}
# On pred, add/max saturate to or, multiply/min are and (what uint8 arithmetic != 0 gives).
_PRED_MONOIDS: dict[str, Callable] = {
    "add": lax.bitwise_or, "multiply": lax.bitwise_and, "maximum": lax.bitwise_or,
    "minimum": lax.bitwise_and, "and": lax.bitwise_and, "or": lax.bitwise_or,
    "xor": lax.bitwise_xor,
}

_BINARY: dict[str, Callable] = {
    **_MONOIDS, "subtract": lax.sub, "divide": lax.div, "remainder": lax.rem, "power": _power,
    "atan2": lax.atan2, "shift-left": lax.shift_left,
    "shift-right-logical": lax.shift_right_logical,
    "shift-right-arithmetic": lax.shift_right_arithmetic, "complex": lax.complex,
}
# pred arithmetic is computed in uint8 (as the evaluator does), jax has none on bool.
_PRED_VIA_UINT8 = frozenset({"add", "subtract", "multiply", "divide", "remainder", "power",
                             "maximum", "minimum", "shift-left", "shift-right-logical",
                             "shift-right-arithmetic"})


def _via_uint8(fn: Callable, args: list, out: np.dtype) -> jax.Array:
    result = fn(*(lax.convert_element_type(a, jnp.uint8) for a in args))
    return result != 0 if out == np.bool_ else lax.convert_element_type(result, out)


@_handles(*_BINARY)
def _binary(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    a, b = ops
    fn = _BINARY[inst.opcode]
    if a.dtype == jnp.bool_ and inst.opcode in _PRED_VIA_UINT8:
        return _via_uint8(fn, [a, b], _out_dtype(inst))
    return fn(a, b)


_COMPARE: dict[str, Callable] = {"EQ": lax.eq, "NE": lax.ne, "LT": lax.lt, "LE": lax.le,
                                 "GT": lax.gt, "GE": lax.ge}


def _total_order_key(x: jax.Array) -> jax.Array:
    """Signed integers ordered like x in the IEEE total order (-NaN < -inf < -0 < +0 < NaN):
    negative floats have their magnitude bits flipped."""
    bits = lax.bitcast_convert_type(x, _int_type(_storage_bits(x.dtype), True))
    magnitude = _scalar(np.iinfo(bits.dtype).max, bits.dtype)
    flipped = lax.bitwise_xor(bits, jnp.broadcast_to(magnitude, bits.shape))
    return lax.select(bits < 0, flipped, bits)


def _reinterpret_int(x: jax.Array, signed: bool) -> jax.Array:
    return lax.bitcast_convert_type(x, _int_type(_storage_bits(x.dtype), signed))


@_handles("compare")
def _compare(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    a, b = ops
    direction = inst.string("direction")
    fn = _COMPARE.get(direction)
    if fn is None:
        raise JaxEmitError(inst.name, inst.opcode, f"unknown direction {direction!r}")
    kind = inst.string("type", "")
    if kind == "TOTALORDER" and _is_float(a.dtype):
        a, b = _total_order_key(a), _total_order_key(b)
    elif kind == "UNSIGNED" and _is_signed(a.dtype):
        a, b = _reinterpret_int(a, False), _reinterpret_int(b, False)
    elif kind == "SIGNED" and _is_int(a.dtype) and not _is_signed(a.dtype):
        a, b = _reinterpret_int(a, True), _reinterpret_int(b, True)
    return fn(a, b)


@_handles("select")
def _select(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    return lax.select(*ops)


@_handles("clamp")
def _clamp(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    lo, x, hi = ops
    if x.dtype == jnp.bool_:
        return _via_uint8(lax.clamp, [lo, x, hi], np.dtype(np.bool_))
    return lax.clamp(lo, x, hi)


@_handles("convert")
def _convert(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    x, out = ops[0], _out_dtype(inst)
    if _is_complex(x.dtype) and not _is_complex(out):
        x = lax.real(x)  # HLO keeps the real part (jax would warn)
    return lax.convert_element_type(x, out)


@_handles("bitcast-convert")
def _bitcast_convert(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    out = _out_dtype(inst)
    if min(BIT_WIDTH[inst.shape.element_type], _storage_bits(ops[0].dtype)) < 8:
        raise JaxEmitError(inst.name, inst.opcode, "sub-byte types are not supported")
    return lax.bitcast_convert_type(ops[0], out)


@_handles("reduce-precision")
def _reduce_precision(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    return lax.reduce_precision(ops[0], inst.int("exponent_bits"), inst.int("mantissa_bits"))


@_handles("map")
def _map(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    return em.apply_elementwise(inst.called_computations[0], ops)


# --- data movement -----------------------------------------------------------------------
@_handles("broadcast")
def _broadcast(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    x = ops[0]
    dims = inst.ints("dimensions", ())
    order = sorted(range(len(dims)), key=lambda i: dims[i])
    if order != list(range(len(dims))):  # lax wants increasing dims: transpose first
        x = lax.transpose(x, order)
    return lax.broadcast_in_dim(x, inst.shape.dims, tuple(sorted(dims)))


@_handles("reshape")
def _reshape(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    return lax.reshape(ops[0], inst.shape.dims)


@_handles("transpose")
def _transpose(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    return lax.transpose(ops[0], inst.ints("dimensions"))


@_handles("copy", "domain")
def _identity(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    return ops[0]


@_handles("optimization-barrier")
def _optimization_barrier(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    return lax.optimization_barrier(ops[0])


def _physical(x: jax.Array, shape: Shape) -> jax.Array:
    """The buffer of logical value ``x`` laid out by ``shape``'s layout, flat."""
    major_to_minor = tuple(reversed(shape.minor_to_major()))
    if len(major_to_minor) != x.ndim:
        major_to_minor = tuple(range(x.ndim))
    return lax.reshape(lax.transpose(x, major_to_minor), (math.prod(x.shape),))


def _logical(flat: jax.Array, shape: Shape) -> jax.Array:
    major_to_minor = tuple(reversed(shape.minor_to_major()))
    physical = lax.reshape(flat, tuple(shape.dims[d] for d in major_to_minor))
    return lax.transpose(physical, tuple(int(i) for i in np.argsort(major_to_minor)))


@_handles("bitcast")
def _bitcast(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    # A bitcast reinterprets the physical buffer, so layouts matter (unlike everywhere else).
    flat = _physical(ops[0], em.shape_of(inst.operands[0]))
    out = _out_dtype(inst)
    if flat.dtype != out:
        if np.dtype(flat.dtype).itemsize != out.itemsize:
            raise JaxEmitError(inst.name, inst.opcode, "element size changes")
        flat = lax.bitcast_convert_type(flat, out)
    if flat.shape[0] != inst.shape.num_elements:
        raise JaxEmitError(inst.name, inst.opcode, "the number of elements changes")
    return _logical(flat, inst.shape)


@_handles("slice")
def _slice(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    dims = parse_slice(inst.attrs["slice"])
    return lax.slice(ops[0], [d.start for d in dims], [d.limit for d in dims],
                     [d.stride for d in dims])


@_handles("concatenate")
def _concatenate(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    return lax.concatenate(ops, inst.ints("dimensions")[0])


@_handles("pad")
def _pad(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    pads = parse_padding(inst.attrs["padding"])
    return lax.pad(ops[0], ops[1], [(p.low, p.high, p.interior) for p in pads])


@_handles("iota")
def _iota(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    return lax.broadcasted_iota(_out_dtype(inst), inst.shape.dims, inst.int("iota_dimension"))


@_handles("reverse")
def _reverse(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    return lax.rev(ops[0], inst.ints("dimensions", ()))


@_handles("get-dimension-size")
def _get_dimension_size(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    dim = inst.ints("dimensions")[0]
    return _scalar(jnp.shape(ops[0])[dim], _out_dtype(inst))


# --- dynamic slicing, gather, scatter ----------------------------------------------------
def _clamped_starts(inst: Instruction, operand: jax.Array, index_ops: list,
                    sizes: Sequence[int]) -> list[jax.Array]:
    """Scalar starts (or one legacy index vector) clamped to [0, dim - size] as HLO does
    (lax would otherwise wrap negative starts)."""
    if len(index_ops) == 1 and jnp.ndim(index_ops[0]) == 1:
        index_ops = [index_ops[0][i] for i in range(operand.ndim)]
    if len(index_ops) != operand.ndim:
        raise JaxEmitError(inst.name, inst.opcode, f"{len(index_ops)} start indices for rank "
                           f"{operand.ndim}")
    starts = []
    for start, dim, size in zip(index_ops, operand.shape, sizes):
        start = jnp.reshape(start, ())
        hi = _scalar(max(dim - size, 0), start.dtype)
        starts.append(lax.clamp(_scalar(0, start.dtype), start, hi))
    return starts


@_handles("dynamic-slice")
def _dynamic_slice(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    sizes = inst.ints("dynamic_slice_sizes")
    return lax.dynamic_slice(ops[0], _clamped_starts(inst, ops[0], ops[1:], sizes), sizes)


@_handles("dynamic-update-slice")
def _dynamic_update_slice(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    operand, update = ops[0], ops[1]
    starts = _clamped_starts(inst, operand, ops[2:], update.shape)
    return lax.dynamic_update_slice(operand, update, starts)


def _indices_last(indices: jax.Array, index_vector_dim: int,
                  batching: Sequence[int]) -> tuple[jax.Array, tuple[int, ...]]:
    """Indices with the index vector as the last dimension (the only place lax accepts it),
    and the indices batching dims renumbered accordingly."""
    if index_vector_dim == indices.ndim:
        return lax.expand_dims(indices, (indices.ndim,)), tuple(batching)
    moved = jnp.moveaxis(indices, index_vector_dim, -1)
    return moved, tuple(d - 1 if d > index_vector_dim else d for d in batching)


def _bool_attr(inst: Instruction, key: str) -> bool:
    return inst.attrs.get(key, "false") == "true"


@_handles("gather")
def _gather(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    operand, indices = ops
    indices, batching = _indices_last(indices, inst.int("index_vector_dim"),
                                      inst.ints("start_indices_batching_dims", ()))
    dnums = lax.GatherDimensionNumbers(
        offset_dims=inst.ints("offset_dims", ()),
        collapsed_slice_dims=inst.ints("collapsed_slice_dims", ()),
        start_index_map=inst.ints("start_index_map"),
        operand_batching_dims=inst.ints("operand_batching_dims", ()),
        start_indices_batching_dims=batching)
    return lax.gather(operand, indices, dnums, inst.ints("slice_sizes"),
                      indices_are_sorted=_bool_attr(inst, "indices_are_sorted"),
                      mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)


_SCATTERS: dict[str, Callable] = {"add": lax.scatter_add, "multiply": lax.scatter_mul,
                                  "maximum": lax.scatter_max, "minimum": lax.scatter_min,
                                  "assign": lax.scatter}


@_handles("scatter")
def _scatter(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    n = (len(ops) - 1) // 2
    comp = inst.called_computations[0]
    kind = em.binary_kind(comp) if n == 1 else None
    if kind == "keep":
        return ops[0]
    scatter = _SCATTERS.get(kind) if kind is not None and ops[0].dtype != jnp.bool_ else None
    if scatter is None:  # any other combiner: one window at a time, in index order
        result = _scatter_by_window(em, inst, ops[:n], ops[n], ops[n + 1:], comp)
        return tuple(result) if inst.shape.is_tuple else result[0]
    indices, batching = _indices_last(ops[1], inst.int("index_vector_dim"),
                                      inst.ints("scatter_indices_batching_dims", ()))
    dnums = lax.ScatterDimensionNumbers(
        update_window_dims=inst.ints("update_window_dims", ()),
        inserted_window_dims=inst.ints("inserted_window_dims", ()),
        scatter_dims_to_operand_dims=inst.ints("scatter_dims_to_operand_dims"),
        operand_batching_dims=inst.ints("input_batching_dims", ()),
        scatter_indices_batching_dims=batching)
    result = scatter(ops[0], indices, ops[2], dnums,
                     indices_are_sorted=_bool_attr(inst, "indices_are_sorted"),
                     unique_indices=_bool_attr(inst, "unique_indices"),
                     mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)
    return (result,) if inst.shape.is_tuple else result


def _scatter_starts(inst: Instruction, rank: int, indices: jax.Array) -> jax.Array:
    """(count, rank) operand start of every scatter window: mapped index components, the
    batch coordinate for batching dims, 0 elsewhere."""
    vectors, batching = _indices_last(indices, inst.int("index_vector_dim"),
                                      inst.ints("scatter_indices_batching_dims", ()))
    batch_shape = vectors.shape[:-1]
    count = math.prod(batch_shape)
    flat = lax.reshape(vectors, (count, vectors.shape[-1]))
    columns = [jnp.zeros((count,), flat.dtype) for _ in range(rank)]
    for k, d in enumerate(inst.ints("scatter_dims_to_operand_dims")):
        columns[d] = flat[:, k]
    coords = np.indices(batch_shape).reshape(len(batch_shape), count)  # static batch positions
    for od, idim in zip(inst.ints("input_batching_dims", ()), batching):
        columns[od] = jnp.asarray(coords[idim].astype(np.dtype(flat.dtype)))
    return jnp.stack(columns, axis=1)


def _scatter_by_window(em: JaxOpEmitter, inst: Instruction, operands: list, indices: jax.Array,
                       updates: list, comp: str) -> list:
    """Scatter with an arbitrary (or variadic) combiner: a loop over the update windows in
    index order, skipping windows not wholly inside the operand (XLA's rule)."""
    rank = operands[0].ndim
    window_dims = inst.ints("update_window_dims", ())
    excluded = {*inst.ints("inserted_window_dims", ()), *inst.ints("input_batching_dims", ())}
    window_operand_dims = [d for d in range(rank) if d not in excluded]
    full_window = [1] * rank
    for d, wd in zip(window_operand_dims, window_dims):
        full_window[d] = updates[0].shape[wd]
    starts = _scatter_starts(inst, rank, indices)
    count = starts.shape[0]
    scatter_dims = [d for d in range(updates[0].ndim) if d not in window_dims]
    perm = scatter_dims + list(window_dims)
    windows = [lax.reshape(lax.transpose(u, perm), (count, *full_window)) for u in updates]
    limits = jnp.asarray(np.array(operands[0].shape) - np.array(full_window), starts.dtype)

    def body(i, outs):
        start = starts[i]
        inside = jnp.all((start >= 0) & (start <= limits))

        def update(outs):
            begin = [start[d] for d in range(rank)]
            current = [lax.dynamic_slice(o, begin, full_window) for o in outs]
            new = [lax.dynamic_index_in_dim(w, i, keepdims=False) for w in windows]
            combined = em.apply_elementwise(comp, current + new)
            combined = list(combined) if isinstance(combined, tuple) else [combined]
            return tuple(lax.dynamic_update_slice(o, c, begin) for o, c in zip(outs, combined))
        return lax.cond(inside, update, lambda outs: outs, outs)
    return list(lax.fori_loop(0, count, body, tuple(operands)))


# --- reductions --------------------------------------------------------------------------
def _reducer(em: JaxOpEmitter, comp: str, n: int, dtype) -> Callable:
    """The reducer as lax.reduce wants it: the lax op itself for a single add/mul/max/min/
    and/or/xor, otherwise the emitted computation taking (accumulators, values)."""
    kind = em.binary_kind(comp) if n == 1 else None
    if kind == "assign":
        return lambda acc, x: x
    if kind == "keep":
        return lambda acc, x: acc
    if kind is not None:
        return (_PRED_MONOIDS if dtype == jnp.bool_ else _MONOIDS)[kind]
    fn = em.scalar_fn(comp)
    if n == 1:
        return fn
    return lambda accs, xs: tuple(fn(*accs, *xs))


@_handles("reduce")
def _reduce(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    n = len(ops) // 2
    dims = inst.ints("dimensions", ())
    reducer = _reducer(em, inst.called_computations[0], n, ops[0].dtype)
    if n == 1:
        result = lax.reduce(ops[0], jnp.reshape(ops[1], ()), reducer, dims)
        return (result,) if inst.shape.is_tuple else result
    inits = tuple(jnp.reshape(v, ()) for v in ops[n:])
    return tuple(lax.reduce(tuple(ops[:n]), inits, reducer, dims))


def _window(inst: Instruction, rank: int) -> tuple[WindowDim, ...]:
    if "window" not in inst.attrs:
        return tuple(WindowDim() for _ in range(rank))
    return parse_window(inst.attrs["window"], rank)


@_handles("reduce-window")
def _reduce_window(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    n = len(ops) // 2
    window = _window(inst, ops[0].ndim)
    if any(w.reversal for w in window):
        raise JaxEmitError(inst.name, inst.opcode, "window reversal is not supported")
    reducer = _reducer(em, inst.called_computations[0], n, ops[0].dtype)
    operands = ops[0] if n == 1 else tuple(ops[:n])
    inits = jnp.reshape(ops[1], ()) if n == 1 else tuple(jnp.reshape(v, ()) for v in ops[n:])
    result = lax.reduce_window(operands, inits, reducer,
                               window_dimensions=[w.size for w in window],
                               window_strides=[w.stride for w in window],
                               padding=[(w.pad_low, w.pad_high) for w in window],
                               base_dilation=[w.lhs_dilate for w in window],
                               window_dilation=[w.rhs_dilate for w in window])
    if n > 1:
        return tuple(result)
    return (result,) if inst.shape.is_tuple else result


def _combine_at(em: JaxOpEmitter, comp: str, out: jax.Array, index: jax.Array,
                values: jax.Array) -> jax.Array:
    """``out[index[i]] = comp(out[index[i]], values[i])`` on a flat ``out``, in order; an
    index of ``out.size`` drops its value."""
    kind = em.binary_kind(comp)
    if kind == "keep":
        return out
    scatter = _SCATTERS.get(kind) if kind is not None and out.dtype != jnp.bool_ else None
    if scatter is not None:
        dnums = lax.ScatterDimensionNumbers(update_window_dims=(), inserted_window_dims=(0,),
                                            scatter_dims_to_operand_dims=(0,))
        return scatter(out, index[:, None], values, dnums,
                       mode=lax.GatherScatterMode.FILL_OR_DROP)

    def body(i, out):
        j = index[i]

        def update(out):
            new = em.apply_elementwise(comp, [lax.dynamic_index_in_dim(out, j, keepdims=False),
                                              values[i]])
            return lax.dynamic_update_index_in_dim(out, new, j, 0)
        return lax.cond(j < out.shape[0], update, lambda out: out, out)
    return lax.fori_loop(0, index.shape[0], body, out)


@_handles("select-and-scatter")
def _select_and_scatter(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    """Every window picks one operand element (kept while ``select(kept, candidate)`` holds,
    padding never picked) and the window's source value is scattered onto it."""
    operand, source, init = ops
    if source.size == 0:
        return jnp.full(operand.shape, jnp.reshape(init, ()), operand.dtype)
    window = _window(inst, operand.ndim)
    if any(w.pad_low < 0 or w.pad_high < 0 or w.lhs_dilate != 1 or w.rhs_dilate != 1
           for w in window):
        raise JaxEmitError(inst.name, inst.opcode, "needs non-negative padding, no dilation")
    pads = [(w.pad_low, w.pad_high, 0) for w in window]
    padded = lax.pad(operand, jnp.zeros((), operand.dtype), pads)
    valid = np.pad(np.ones(operand.shape, bool), [(lo, hi) for lo, hi, _ in pads])
    flat_index = np.arange(valid.size, dtype=np.int32).reshape(valid.shape)
    select_comp = _called(inst, "select")
    selected = chosen = have = None
    for offset in np.ndindex(*(w.size for w in window)):
        begin = [k * w.rhs_dilate for k, w in zip(offset, window)]
        end = [b + (n - 1) * w.stride + 1 for b, n, w in zip(begin, source.shape, window)]
        strides = [w.stride for w in window]
        cand = lax.slice(padded, begin, end, strides)
        where = tuple(slice(b, e, st) for b, e, st in zip(begin, end, strides))
        cand_valid, cand_index = jnp.asarray(valid[where]), jnp.asarray(flat_index[where])
        if selected is None:
            selected, chosen, have = cand, cand_index, cand_valid
            continue
        keep = em.apply_elementwise(select_comp, [selected, cand])
        take = cand_valid & (~have | ~keep)
        selected = lax.select(take, cand, selected)
        chosen = lax.select(take, cand_index, chosen)
        have = have | cand_valid
    index = lax.select(have, chosen, jnp.full_like(chosen, valid.size)).reshape(-1)
    out = jnp.full((valid.size,), jnp.reshape(init, ()), operand.dtype)
    out = _combine_at(em, _called(inst, "scatter"), out, index, source.reshape(-1))
    out = out.reshape(valid.shape)
    return lax.slice(out, [lo for lo, _, _ in pads],
                     [lo + n for (lo, _, _), n in zip(pads, operand.shape)])


# --- dot, convolution --------------------------------------------------------------------
def _precision(inst: Instruction) -> Any:
    """HIGHEST (exact f32 products), or the dot ``algorithm`` the HLO names."""
    if "algorithm" not in inst.attrs:
        return lax.Precision.HIGHEST
    name = inst.string("algorithm").lower().removeprefix("alg_").removeprefix("dot_").upper()
    preset = lax.DotAlgorithmPreset.__members__.get(name)
    if preset is None:
        raise JaxEmitError(inst.name, inst.opcode, f"unknown dot algorithm {name!r}")
    return preset


@_handles("dot")
def _dot(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    if "sparsity" in inst.attrs:
        raise JaxEmitError(inst.name, inst.opcode, "sparse dots are not supported")
    dnums = ((inst.ints("lhs_contracting_dims", ()), inst.ints("rhs_contracting_dims", ())),
             (inst.ints("lhs_batch_dims", ()), inst.ints("rhs_batch_dims", ())))
    return lax.dot_general(ops[0], ops[1], dnums, precision=_precision(inst),
                           preferred_element_type=_out_dtype(inst))


@_handles("convolution")
def _convolution(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    lhs, rhs = ops
    dn = parse_dim_labels(inst.attrs["dim_labels"])
    if "window" in inst.attrs:
        window = parse_window(inst.attrs["window"], len(dn.input_spatial))
    else:  # no window: a 1x1..-style window as large as the kernel
        window = tuple(WindowDim(size=rhs.shape[d]) for d in dn.kernel_spatial)
    flips = tuple(d for d, w in zip(dn.kernel_spatial, window) if w.reversal)
    if flips:
        rhs = lax.rev(rhs, flips)
    numbers = lax.ConvDimensionNumbers(
        lhs_spec=(dn.input_batch, dn.input_feature, *dn.input_spatial),
        rhs_spec=(dn.kernel_output_feature, dn.kernel_input_feature, *dn.kernel_spatial),
        out_spec=(dn.output_batch, dn.output_feature, *dn.output_spatial))
    return lax.conv_general_dilated(
        lhs, rhs, window_strides=[w.stride for w in window],
        padding=[(w.pad_low, w.pad_high) for w in window],
        lhs_dilation=[w.lhs_dilate for w in window], rhs_dilation=[w.rhs_dilate for w in window],
        dimension_numbers=numbers, feature_group_count=inst.int("feature_group_count", 1),
        batch_group_count=inst.int("batch_group_count", 1), precision=_precision(inst),
        preferred_element_type=_out_dtype(inst))


# --- sort, topk --------------------------------------------------------------------------
def _literal_is(inst: Instruction, *texts: str) -> bool:
    return inst.opcode == "constant" and (inst.literal or "").strip() in texts


def _sort_operand(table: dict[str, Instruction], inst: Instruction) -> tuple[int, bool] | None:
    """(parameter number, canonicalized) for a comparator operand that is a parameter, or
    jax's canonicalization of one: ``select(x != x, nan, select(x == 0, 0, x))``, which makes
    -0 == +0 and every NaN the same (lax.sort's own order)."""
    if inst.opcode == "parameter":
        return inst.parameter_number or 0, False
    if inst.opcode != "select":
        return None
    is_nan, nan, inner = (table[o] for o in inst.operands)
    if inner.opcode != "select" or not _literal_is(nan, "nan", "-nan"):
        return None
    is_zero, zero, x = (table[o] for o in inner.operands)
    same = (x.opcode == "parameter" and _literal_is(zero, "0", "-0", "0.0")
            and is_nan.opcode == "compare" and is_nan.string("direction") == "NE"
            and is_nan.operands == [x.name, x.name]
            and is_zero.opcode == "compare" and is_zero.string("direction") == "EQ"
            and sorted(is_zero.operands) == sorted([x.name, zero.name]))
    return (x.parameter_number or 0, True) if same else None


def _simple_sort_key(em: JaxOpEmitter, comp: str) -> tuple[int, bool, bool] | None:
    """(operand k, descending, total order) when the comparator is just ``p[2k] < p[2k+1]``
    (or >, or jax's canonicalized TOTALORDER form): then lax.sort on one key sorts the same."""
    comp = em.computation(comp)
    root = comp.root
    if root.opcode != "compare" or root.string("direction") not in ("LT", "GT"):
        return None
    table = em._table(comp)
    a, b = (_sort_operand(table, table[o]) for o in root.operands)
    if a is None or b is None or a[1] != b[1] or a[0] % 2 or b[0] != a[0] + 1:
        return None
    element = table[root.operands[0]].shape.element_type
    kind = root.string("type", "")
    if (kind, element[0]) in (("UNSIGNED", "s"), ("SIGNED", "u")):
        return None  # a reinterpreted integer order: leave it to the general network
    canonical = a[1]
    return a[0] // 2, root.string("direction") == "GT", kind == "TOTALORDER" and not canonical


def _sort_key(x: jax.Array, descending: bool, total_order: bool) -> jax.Array:
    """A key lax.sort orders like the comparator. lax.sort treats -0 == +0 and puts every NaN
    last (like a FLOAT compare on non-NaNs); TOTALORDER needs the integer total-order key."""
    if total_order and _is_float(x.dtype):
        x = _total_order_key(x)
    if not descending:
        return x
    if _is_float(x.dtype):
        return lax.neg(x)  # reverses the order; -0 and +0 stay equal
    return lax.bitwise_not(x)  # ~x = -x-1 for signed, max-x for unsigned, !x for pred


@_handles("sort")
def _sort(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    dim = inst.ints("dimensions")[0]
    comp = inst.called_computations[0]
    simple = _simple_sort_key(em, comp)
    if simple is not None:
        k, descending, total_order = simple
        key = _sort_key(ops[k], descending, total_order)
        result = list(lax.sort([key, *ops], dimension=dim, is_stable=True, num_keys=1))[1:]
    else:
        result = _network_sort(em, comp, ops, dim)
    return tuple(result) if inst.shape.is_tuple else result[0]


def _network_sort(em: JaxOpEmitter, comp: str, ops: list, dim: int) -> list:
    """Stable sort along ``dim`` by an arbitrary comparator: a bitonic network over padded
    positions, the comparator applied to whole arrays, ties broken by original position."""
    moved = [jnp.moveaxis(o, dim, -1) for o in ops]
    n = moved[0].shape[-1]
    if n <= 1:
        return list(ops)
    lead = moved[0].shape[:-1]
    rows = math.prod(lead)
    keys = [lax.reshape(m, (rows, n)) for m in moved]
    size = 1 << (n - 1).bit_length()
    perm = jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32), (rows, size))

    def less(pa: jax.Array, pb: jax.Array) -> jax.Array:
        """Strict total order: comparator, then position; positions >= n sort last."""
        ca, cb = jnp.minimum(pa, n - 1), jnp.minimum(pb, n - 1)
        pairs_ab, pairs_ba = [], []
        for key in keys:
            ka, kb = jnp.take_along_axis(key, ca, axis=1), jnp.take_along_axis(key, cb, axis=1)
            pairs_ab += [ka, kb]
            pairs_ba += [kb, ka]
        ab = em.apply_elementwise(comp, pairs_ab)
        ba = em.apply_elementwise(comp, pairs_ba)
        real = ab | (~ba & (pa < pb))
        return jnp.where(pa >= n, False, jnp.where(pb >= n, True, real))

    position = np.arange(size)
    k = 2
    while k <= size:
        j = k // 2
        while j >= 1:
            partner = position ^ j
            low, high = np.minimum(position, partner), np.maximum(position, partner)
            ascending = jnp.asarray((low & k) == 0)
            p_low, p_high = perm[:, low], perm[:, high]
            swap = jnp.where(ascending, less(p_high, p_low), less(p_low, p_high))
            perm = jnp.where(swap, perm[:, partner], perm)
            j //= 2
        k *= 2
    order = perm[:, :n]
    return [jnp.moveaxis(lax.reshape(jnp.take_along_axis(key, order, axis=1), (*lead, n)), -1, dim)
            for key in keys]


@_handles("topk")
def _topk(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    if inst.attrs.get("largest", "true") == "false":
        raise JaxEmitError(inst.name, inst.opcode, "largest=false is not supported")
    values, indices = lax.top_k(ops[0], inst.int("k"))
    return values, indices


# custom-call targets with a jax meaning: sharding annotations are the identity on values.
_CUSTOM_CALL_IDENTITY = frozenset({"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"})


@_handles("custom-call")
def _custom_call(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    target = inst.string("custom_call_target", "")
    if target not in _CUSTOM_CALL_IDENTITY or len(ops) != 1:
        raise JaxEmitError(inst.name, inst.opcode, f"unsupported custom-call target {target!r}")
    return ops[0]


# --- structure and control flow ----------------------------------------------------------
@_handles("tuple")
def _tuple(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    return tuple(ops)


@_handles("get-tuple-element")
def _get_tuple_element(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    if not isinstance(ops[0], tuple):
        raise JaxEmitError(inst.name, inst.opcode, "operand is not a tuple")
    return ops[0][inst.int("index")]


@_handles("call", "fusion")
def _call(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    key = "calls" if inst.opcode == "fusion" else "to_apply"
    return em.run_computation(_called(inst, key), ops)


@_handles("while")
def _while(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    condition = em.scalar_fn(_called(inst, "condition"))
    body = em.scalar_fn(_called(inst, "body"))
    return lax.while_loop(lambda state: jnp.reshape(condition(state), ()), body, ops[0])


@_handles("conditional")
def _conditional(em: JaxOpEmitter, inst: Instruction, ops: list) -> Value:
    selector = jnp.reshape(ops[0], ())
    if "branch_computations" in inst.attrs:
        branches = parse_computation_list(inst.attrs["branch_computations"])
    else:
        branches = (_called(inst, "true_computation"), _called(inst, "false_computation"))
    if len(ops) - 1 != len(branches):
        raise JaxEmitError(inst.name, inst.opcode, f"{len(branches)} branches but "
                           f"{len(ops) - 1} branch operands")
    if selector.dtype == jnp.bool_:  # true selects branch 0
        index = lax.select(selector, _scalar(0, np.int32), _scalar(1, np.int32))
    else:  # out of range (negative included) selects the last branch; lax.switch clamps
        last = _scalar(len(branches) - 1, selector.dtype)
        bad = (selector < 0) | (selector > last)
        index = lax.convert_element_type(lax.select(bad, last, selector), np.int32)
    fns = [partial(_run_branch, em, name, i) for i, name in enumerate(branches)]
    return lax.switch(index, fns, *ops[1:])


def _run_branch(em: JaxOpEmitter, name: str, i: int, *operands: Value) -> Value:
    return em.run_computation(name, [operands[i]])
