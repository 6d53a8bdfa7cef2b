"""TensorFlow front end: ``tf.function(jit_compile=True)`` functions and Keras' TF trainer
run the stitched program once it is built.

The stitched program is the function's whole HLO (``experimental_get_compiler_ir(...)
(stage="hlo")``, what tf2xla gives XLA) compiled by XLA on jax's client with stitch's pass
on for it (``stitch.xla_pass.entry.compile_hlo_text``): XLA fuses it, stitch replaces what its
kernels cover with FFI custom calls, and the step stays ONE XLA executable. Per input
signature:

- the first calls run the stock TF function; the HLO is taken and the stitched program built
  on stitch's compile thread (``jit.COMPILE_THREAD``);
- the mapping is read from TF, never guessed: the HLO's ENTRY parameters are the concrete
  function's ``inputs`` in order — the tensor leaves of the bound arguments, then
  ``captured_inputs`` (a resource handle → that variable's current value, an eager tensor →
  its value). The root tuple holds the function's flat outputs first, then one value per
  variable the function writes; the module header's ``input_output_alias`` names the
  parameter (hence the variable) each of those updates. Counts, shapes and dtypes are
  checked; anything that does not fit (composite tensors, a resource that is not a
  variable, updates without aliases...) keeps the function on stock TF with a logged reason;
- the first stitched call is always verified: the stitched program runs on the current
  values (it is pure), then the stock function runs the real step; every output and every
  updated variable must agree (relative L2 ≤ 1e-4) or the signature falls back for good;
  the comparison runs where the values lie (``device_compare``: one host read of a few
  figures per value, not a copy of every weight). From the next call on the stitched
  program runs the step: inputs reach jax through DLPack (``tf_bridge``), the updated
  variables are written back with ``assign`` and the outputs return as tf tensors — no
  host conversion on a stitched step;
- with the guard on (STITCH_GUARD, default) the first calls after the switch alternate both
  paths, timed, and the faster stays;
- any failure is logged ("falls back to XLA: <reason>") and never raised into the caller.

64-bit types (the optimizer's ``iterations`` is s64) are traced and run under
``jax.enable_x64``. Keras: ``patch_keras`` wraps ``TensorFlowTrainer.make_train_function``:
the train function it installs pulls each batch from the iterator in Python and calls the
model's train step (Keras' own ``one_step_on_data``) as a ``TFStitchedFunction`` whose stock
side is a plain ``tf.function`` (Keras' ``jit_compile`` setting) and whose HLO comes from the
same step under ``jit_compile=True``.

This module imports tensorflow only inside its functions.
"""
from __future__ import annotations

import functools
import inspect
import logging
import re
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from stitch.config import Settings, configure_logging, injected_failure
from stitch.errors import StitchError
from stitch.frontends.switching import SwitchEntry, SwitchingFunction
from .tf_bridge import Bridge, tf_runs_on

log = logging.getLogger("stitch.tf")

VERIFY_RTOL = 1e-4
_ALIAS = re.compile(r"\{(\d+)\}:\s*\((\d+),\s*\{\}")


class TFMappingError(StitchError):
    """The HLO's parameters or outputs cannot be tied to the TF function's values."""


# ------------------------------------------------------------------------------ mapping
@dataclass
class TFMapping:
    """How the stitched program's parameters and outputs relate to one concrete function.

    ``sources[i]`` for ENTRY parameter i: ("arg", k) the k-th tensor leaf of the bound
    arguments (a tf.Variable leaf is read), ("var", variable) a captured variable,
    ("const", tensor) a captured eager tensor. ``n_outputs`` flat function outputs come
    first in the root; ``updates`` = (root index, parameter index) of each written variable.
    """
    sources: list[tuple[str, Any]]
    n_outputs: int
    updates: list[tuple[int, int]]
    structured_outputs: Any
    output_dtypes: list[Any]


def output_aliases(hlo_text: str) -> dict[int, int]:
    """``input_output_alias={ {3}: (2, {}, may-alias), ...}`` → {root index: parameter}."""
    header = hlo_text.split("\n", 1)[0]
    start = header.find("input_output_alias=")
    if start < 0:
        return {}
    return {int(o): int(p) for o, p in _ALIAS.findall(header[start:])}


def tf2xla_hlo_text(compiler_ir: Callable[..., Any]) -> str:
    """tf2xla's HLO with every constant's values. TF's ``stage="hlo"`` text elides large
    constants as ``{...}`` (Llama's rotary tables and causal mask), which XLA's parser reads
    back as zeros: the serialized module is printed here with its constants instead."""
    from jaxlib import _hlo

    return _hlo.XlaComputation(compiler_ir(stage="hlo_serialized")).as_hlo_text(
        print_large_constants=True)


def _is_tensor_leaf(x: Any) -> bool:
    import tensorflow as tf
    return isinstance(x, (tf.Tensor, tf.Variable, np.ndarray, np.generic))


def bound_leaves(python_fn: Callable, args: tuple, kwargs: dict) -> tuple[list, list]:
    """(the bound arguments in parameter order with defaults applied, their tensor leaves
    in the order tf.function flattens them)."""
    import tensorflow as tf

    try:
        bound = inspect.signature(python_fn).bind(*args, **kwargs)
        bound.apply_defaults()
        values = list(bound.arguments.values())
    except (TypeError, ValueError):
        values = list(args) + [kwargs[k] for k in sorted(kwargs)]
    leaves = [x for x in tf.nest.flatten(values, expand_composites=True) if _is_tensor_leaf(x)]
    return values, leaves


def build_mapping(concrete: Any, module: Any, hlo_text: str, arg_leaves: list) -> TFMapping:
    """Tie ENTRY parameters and root leaves to the concrete function (module docstring)."""
    import tensorflow as tf

    inputs = list(concrete.inputs)
    captured = list(concrete.captured_inputs)
    n_args = len(inputs) - len(captured)
    if n_args != len(arg_leaves):
        raise TFMappingError(f"the concrete function has {n_args} argument inputs for "
                             f"{len(arg_leaves)} tensor arguments")
    variables = list(concrete.variables) + list(getattr(concrete.graph, "variables", []))
    sources: list[tuple[str, Any]] = [("arg", k) for k in range(n_args)]
    for t in captured:
        if t.dtype == tf.resource:
            var = next((v for v in variables if getattr(v, "handle", None) is t), None)
            if var is None:
                raise TFMappingError("a captured resource is not a variable of the function")
            sources.append(("var", var))
        else:
            sources.append(("const", t))
    params = module.entry.parameters
    if len(params) != len(sources):
        raise TFMappingError(f"the HLO has {len(params)} parameters for {len(sources)} "
                             "function inputs")
    for i, (param, (kind, value)) in enumerate(zip(params, sources)):
        if kind == "arg":
            x = arg_leaves[value]
            shape, dtype = _shape_dtype(x.read_value() if isinstance(x, tf.Variable) else x)
        elif kind == "var":
            shape, dtype = tuple(value.shape), np.dtype(value.dtype.as_numpy_dtype)
        else:
            shape, dtype = _shape_dtype(value)
        _check_shape(f"parameter {i}", param.shape, shape, dtype)
    root = module.entry.root
    leaves = root.shape.tuple_shapes if root.shape.is_tuple else [root.shape]
    outputs = list(concrete.outputs)
    aliases = output_aliases(hlo_text)
    n_out = len(outputs)
    if len(leaves) != n_out + len(aliases):
        raise TFMappingError(f"the HLO root has {len(leaves)} values for {n_out} outputs and "
                             f"{len(aliases)} aliased variable updates")
    if any(o < n_out for o in aliases):
        raise TFMappingError("an aliased update sits among the function's outputs")
    updates = []
    for o, p in sorted(aliases.items()):
        kind, value = sources[p]
        if kind == "const":
            raise TFMappingError(f"root value {o} updates parameter {p}, not a variable")
        updates.append((o, p))
    for i, t in enumerate(outputs):
        _check_shape(f"output {i}", leaves[i], tuple(t.shape), np.dtype(t.dtype.as_numpy_dtype))
    structured = concrete.structured_outputs
    flat = tf.nest.flatten(structured, expand_composites=True)
    if sum(isinstance(x, tf.Tensor) for x in flat) != n_out:
        raise TFMappingError("the function's structured outputs are not its flat tensors")
    return TFMapping(sources, n_out, updates, structured, [t.dtype for t in outputs])


def _shape_dtype(x: Any) -> tuple[tuple, np.dtype]:
    if hasattr(x, "dtype") and hasattr(x.dtype, "as_numpy_dtype"):
        return tuple(x.shape), np.dtype(x.dtype.as_numpy_dtype)
    a = np.asarray(x)
    return a.shape, a.dtype


def _check_shape(what: str, hlo_shape: Any, shape: tuple, dtype: np.dtype) -> None:
    from stitch.hlo.evaluator.dtypes import numpy_dtype
    if hlo_shape.is_tuple:
        raise TFMappingError(f"{what} is a tuple in the HLO")
    dims = tuple(hlo_shape.dims)
    want = numpy_dtype(hlo_shape.element_type)
    if dims != tuple(int(d) if d is not None else -1 for d in shape) or want != dtype:
        raise TFMappingError(f"{what}: HLO {hlo_shape.element_type}{list(dims)} vs TF "
                             f"{dtype}{list(shape)}")


# ------------------------------------------------------------------------- the function
@dataclass
class _Entry(SwitchEntry):
    mapping: TFMapping | None = None
    # XLA's own compile of the same module on jax's client, kept until the first stitched
    # call is verified: the reference that tells stitch's kernels from XLA-version effects.
    plain_call: Callable | None = None
    bridge: Bridge | None = None        # DLPack exchange with TF (stitch/frontends/tf/tf_bridge.py)
    device: str = "cpu"                 # where the stitched program runs


class TFStitchedFunction(SwitchingFunction):
    """A TF function that switches to the stitched program (module docstring).

    ``xla_fn``: a ``tf.function(jit_compile=True)`` whose HLO is stitched; ``stock_fn``: what
    runs until then (and wherever stitch steps aside); the same object for plain
    ``tf.function(jit_compile=True)`` users. Attributes it lacks come from ``stock_fn``."""

    stock_name = "TF"
    entry_type = _Entry

    def __init__(self, xla_fn: Any, stock_fn: Any = None, *, name: str | None = None,
                 target: str | None = None, device: str | None = None,
                 async_compile: bool | None = None, guard: bool | None = None):
        configure_logging()
        settings = Settings.read()
        # Settings stitch cannot read (reported once by Settings.read) keep TF's own path.
        self.disabled_reason = "; ".join(settings.problems)
        self.xla_fn = xla_fn
        self.stock = stock_fn if stock_fn is not None else xla_fn
        self.python_fn = getattr(xla_fn, "python_function", None) or xla_fn
        self.target = target or settings.target
        # None: the device TF runs the step on (its variables'), found per signature
        self.device = device or settings.device
        self.async_compile = settings.async_compile if async_compile is None else async_compile
        self._init_switching(settings.guard if guard is None else guard)
        if self.disabled_reason:
            self.stats.fallbacks.append(f"unreadable settings: {self.disabled_reason}")
        self.__name__ = name or getattr(self.python_fn, "__name__", "fn")
        self.__qualname__ = name or getattr(self.python_fn, "__qualname__", self.__name__)
        self.__wrapped__ = self.python_fn
        self._bound: "weakref.WeakKeyDictionary[Any, TFStitchedFunction]" = \
            weakref.WeakKeyDictionary()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["stock"], name)

    def __repr__(self) -> str:
        return f"stitch.tf({self.__qualname__}, target={self.target!r})"

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        """A tf.function method: one stitched function per instance."""
        if obj is None:
            return self
        try:
            bound = self._bound.get(obj)
            if bound is None:
                bound = TFStitchedFunction(
                    self.xla_fn.__get__(obj, objtype),
                    None if self.stock is self.xla_fn else self.stock.__get__(obj, objtype),
                    name=self.__qualname__, target=self.target, device=self.device,
                    async_compile=self.async_compile, guard=self.guard)
                self._bound[obj] = bound
            return bound
        except TypeError:                        # not weak-referenceable: stock TF
            return self.stock.__get__(obj, objtype)

    # --- signatures ---------------------------------------------------------------------
    def _key(self, args: tuple, kwargs: dict) -> Any:
        import tensorflow as tf

        parts = []
        for x in tf.nest.flatten((args, kwargs), expand_composites=True):
            if isinstance(x, tf.Variable):
                parts.append(("var", tuple(x.shape), x.dtype))
            elif isinstance(x, (tf.Tensor, np.ndarray, np.generic)):
                parts.append((tuple(x.shape), str(x.dtype)))
            else:
                parts.append(("py", type(x), x))
        key = (tf.nest.map_structure(lambda _: 0, (args, kwargs), expand_composites=True)
               .__repr__(), tuple(parts))
        hash(key)
        return key

    # --- calling ------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import tensorflow as tf

        if self.disabled_reason or not tf.executing_eagerly():
            # unreadable settings, or inside another trace: TF's own function
            return self.stock(*args, **kwargs)
        try:
            key = self._key(args, kwargs)
        except Exception:  # noqa: BLE001 - unhashable arguments: stock TF
            key = None
        entry, call_number = self._count_call(key, args, kwargs)
        if entry is None or entry.state != "ready":
            return self.stock(*args, **kwargs)
        if not entry.verified:
            return self._verify_call(entry, args, kwargs, call_number)
        if self._in_guard_trial(entry):
            return self._guarded_call(entry, args, kwargs, call_number)
        return self._call_stitched(entry, args, kwargs, call_number)

    def _run_program(self, entry: _Entry, args: tuple, kwargs: dict,
                     call: Callable | None = None) -> list[Any]:
        """The stitched program (or ``call``) on the current values (pure: assigns nothing):
        jax arrays on the program's device. Inputs reach it through DLPack where they lie
        (``tf_bridge.Bridge``); an argument that is not a TF value (a numpy batch) is
        handed to jax as it is."""
        import jax

        injected_failure("run")
        _, leaves = bound_leaves(self.python_fn, args, kwargs)
        values, keep = [], []
        for i, (kind, value) in enumerate(entry.mapping.sources):
            if kind == "arg":
                x = leaves[value]
                values.append(x.value() if _is_variable(x) else x)
            elif kind == "var":
                values.append(value.value())
            else:
                values.append(value)
                keep.append(i)
        with jax.enable_x64(True):             # the optimizer's s64 counter stays s64
            inputs = entry.bridge.to_jax(values, frozenset(keep))
            return list((call or entry.call)(*inputs))

    def _finish(self, entry: _Entry, outs: list[Any], args: tuple, kwargs: dict) -> Any:
        """Write the updated variables, return the outputs as TF would: the program's
        results become TF tensors through DLPack on their device; a variable's update is a
        device-to-device ``assign``."""
        import tensorflow as tf

        mapping = entry.mapping
        _, leaves = bound_leaves(self.python_fn, args, kwargs)
        wanted = list(range(mapping.n_outputs)) + [o for o, _ in mapping.updates]
        tensors = dict(zip(wanted, entry.bridge.to_tf([outs[i] for i in wanted])))
        for o, p in mapping.updates:
            self._variable(mapping, p, leaves).assign(tensors[o])
        results = iter([tensors[i] for i in range(mapping.n_outputs)])
        flat = [next(results) if isinstance(x, tf.Tensor) else x
                for x in tf.nest.flatten(mapping.structured_outputs, expand_composites=True)]
        return tf.nest.pack_sequence_as(mapping.structured_outputs, flat,
                                        expand_composites=True)

    @staticmethod
    def _variable(mapping: TFMapping, p: int, leaves: list) -> Any:
        kind, value = mapping.sources[p]
        return leaves[value] if kind == "arg" else value

    def _call_stitched(self, entry: _Entry, args: tuple, kwargs: dict, call_number: int) -> Any:
        try:
            outs = self._run_program(entry, args, kwargs)
            result = self._finish(entry, outs, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - never into the training loop
            self._fail(entry, f"stitched call failed: {type(exc).__name__}: {exc}")
            return self.stock(*args, **kwargs)
        self._count_stitched(entry, call_number)
        return result

    def _verify_call(self, entry: _Entry, args: tuple, kwargs: dict, call_number: int) -> Any:
        """The first stitched call: the program on the current values, then the stock step
        (which updates the variables); outputs and new variable values must agree. Where TF's
        result and the stitched one differ, XLA's own compile of the same module on jax's
        client (run on the same values) decides: the stitched result must be as close to it
        as TF's result is (``verify.spread_check``): TF's own kernels (Keras on a CPU-only
        machine runs without XLA) draw other dropout masks than XLA, and compilers round
        differently; stitch's kernels must not add to that. The comparison runs on the
        values' device (``device_compare``): no host copy of the outputs and variables."""
        import jax
        import tensorflow as tf

        try:
            outs = self._run_program(entry, args, kwargs)
            plain = (self._run_program(entry, args, kwargs, entry.plain_call)
                     if entry.plain_call is not None else None)
            entry.plain_call = None
        except Exception as exc:  # noqa: BLE001
            self._fail(entry, f"stitched call failed: {type(exc).__name__}: {exc}")
            return self.stock(*args, **kwargs)
        entry.bridge.block(outs + (plain or []))   # computed from the values before the step
        result = self.stock(*args, **kwargs)
        try:
            from stitch.frontends.device_compare import first_mismatch
            mapping = entry.mapping
            _, leaves = bound_leaves(self.python_fn, args, kwargs)
            expected = [t for t in tf.nest.flatten(result, expand_composites=True)
                        if isinstance(t, tf.Tensor)]
            named = [(f"output {i}", i, expected[i]) for i in range(mapping.n_outputs)]
            for o, p in mapping.updates:
                var = self._variable(mapping, p, leaves)
                named.append((f"variable {var.name}", o, var.value()))
            # TF's results go to jax through DLPack: compared where they lie, one host read
            with jax.enable_x64(True):
                wants = entry.bridge.to_jax([t for _, _, t in named])
            checks = [(what, outs[o], want, None if plain is None else plain[o])
                      for (what, o, _), want in zip(named, wants)]
            why = first_mismatch(checks, VERIFY_RTOL)
            if why is not None:
                self._fail(entry, f"verify: stitched result differs from TF ({why})")
                return result
        except Exception as exc:  # noqa: BLE001
            self._fail(entry, f"verify failed: {type(exc).__name__}: {exc}")
            return result
        entry.verified = True
        log.debug("%s: first stitched call verified against TF", self.__qualname__)
        return result

    def _guarded_call(self, entry: _Entry, args: tuple, kwargs: dict, call_number: int) -> Any:
        """A guard trial call (switching.py), timed to the end of its device work."""
        stitched_turn = self._stitched_turn(entry)
        start = time.perf_counter()
        if stitched_turn:
            result = self._call_stitched(entry, args, kwargs, call_number)
        else:
            result = self.stock(*args, **kwargs)
        # Both sides to the end of their device work, variable updates included: TF queues
        # its ops (the stock step's updates, the stitched side's assigns) on its stream.
        entry.bridge.wait_tf()
        self._guard_record(entry, stitched_turn, time.perf_counter() - start)
        return result

    # --- compiling ----------------------------------------------------------------------
    def _start_compile(self, entry: _Entry, args: tuple, kwargs: dict, call_number: int) -> None:
        """The TF side (trace, tf2xla's HLO, the mapping) runs here on the calling thread:
        TF compiling on the compile thread while the caller's stock step compiles too
        deadlocks (both hold a TF lock and want the GIL). Planning and building go to the
        compile thread."""
        from stitch.frontends.jax.jax_jit import COMPILE_THREAD

        log.info("%s: compiling stitched kernels for %s (call %d, %s)", self.__qualname__,
                 self.target, call_number, "in the background" if self.async_compile
                 else "before running")
        start = time.perf_counter()
        try:
            injected_failure("compile")
            module, mapping = self._hlo_and_mapping(args, kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure means stock TF
            self._compile_failed(entry, time.perf_counter() - start, exc)
            return
        tf_device = tf_runs_on(self._read_values(mapping, args, kwargs))
        entry.device = self.device or tf_device
        entry.bridge = Bridge(gpu=tf_device == "gpu")
        entry.future = COMPILE_THREAD.submit(functools.partial(
            self._compile, entry, module, mapping, time.perf_counter() - start))
        if not self.async_compile:
            try:
                entry.future.result()
            except BaseException:  # noqa: BLE001 - recorded by _compile
                pass

    def mapping_for(self, *args: Any, **kwargs: Any) -> TFMapping:
        """How a call with these arguments maps onto its stitched program (traces the
        function and reads tf2xla's HLO; compiles nothing). For tools and benchmarks."""
        return self._hlo_and_mapping(args, kwargs)[1]

    def read_values(self, mapping: TFMapping, *args: Any, **kwargs: Any) -> list[Any]:
        """The TF values (tensors, variables' current values, constants) a call hands the
        stitched program, in parameter order."""
        _, leaves = bound_leaves(self.python_fn, args, kwargs)
        values = []
        for kind, value in mapping.sources:
            x = leaves[value] if kind == "arg" else value
            values.append(x.value() if _is_variable(x) else x)
        return values

    def _read_values(self, mapping: TFMapping, args: tuple, kwargs: dict) -> list[Any]:
        """The TF values a step reads (arguments, variables, constants), for their device."""
        _, leaves = bound_leaves(self.python_fn, args, kwargs)
        return [leaves[v] if kind == "arg" else v for kind, v in mapping.sources]

    def _hlo_and_mapping(self, args: tuple, kwargs: dict) -> tuple[Any, TFMapping]:
        from stitch.hlo import parse_hlo

        values, leaves = bound_leaves(self.python_fn, args, kwargs)
        concrete = self.xla_fn.get_concrete_function(*args, **kwargs)
        # experimental_get_compiler_ir does not apply defaults: pass every bound value.
        hlo = tf2xla_hlo_text(self.xla_fn.experimental_get_compiler_ir(*values))
        module = parse_hlo(hlo)
        return module, build_mapping(concrete, module, hlo, leaves)

    def _compile(self, entry: _Entry, module: Any, mapping: TFMapping, earlier: float) -> None:
        """tf2xla's HLO compiled by XLA on jax's client with stitch's pass on for it."""
        import jax

        from stitch.hlo import print_hlo
        from stitch.xla_pass.entry import PassRequest, compile_hlo_text

        from .gpu_sharing import check_gpu_allowed
        from stitch.frontends.jax.jax_jit import COMPILE_THREAD

        start = time.perf_counter()
        try:
            device = entry.device
            if device == "gpu":
                check_gpu_allowed()        # TF and jax could not be set to share the GPU
            request = PassRequest(self.__qualname__, self.target, device,
                                  cancel=COMPILE_THREAD.stopping.is_set)
            with jax.enable_x64(True):
                text, platform = print_hlo(module), "cpu" if device == "cpu" else "cuda"
                call, report = compile_hlo_text(text, request, platform)
                if not report.kernels_stitched:
                    raise StitchError(report.reason_nothing_stitched())
                plain_call, _ = compile_hlo_text(text, None, platform)
        except Exception as exc:  # noqa: BLE001 - any failure means stock TF
            self._compile_failed(entry, time.perf_counter() - start + earlier, exc)
            return
        elapsed = time.perf_counter() - start + earlier
        entry.mapping, entry.call, entry.plain_call = mapping, call, plain_call
        self._program_ready(entry, report, elapsed)
        log.debug("%s: stitched executable ready in %.1fs (TF side %.1fs): %d stitched kernels, "
                  "%d inputs, %d outputs, %d variable updates", self.__qualname__, elapsed,
                  earlier, report.kernels_stitched, len(mapping.sources), mapping.n_outputs,
                  len(mapping.updates))


def _is_variable(x: Any) -> bool:
    import tensorflow as tf
    return isinstance(x, tf.Variable)


# ---------------------------------------------------------------------- tf.function patch
def stitch_function(fn: Any, **options: Any) -> TFStitchedFunction:
    """Wrap a ``tf.function(jit_compile=True)`` (or a Python function: it is made one)."""
    import tensorflow as tf
    if not hasattr(fn, "experimental_get_compiler_ir"):
        original = getattr(tf.function, "__stitch_original__", tf.function)
        fn = original(fn, jit_compile=True)
    return TFStitchedFunction(fn, **options)


def patch_tensorflow(tf_module: Any) -> None:
    """``tf.function(..., jit_compile=True)`` returns a ``TFStitchedFunction``; every other
    use of tf.function is untouched (the original stays as ``__stitch_original__``)."""
    original = tf_module.function
    if getattr(original, "__stitch_original__", None) is not None:
        return
    try:
        signature = inspect.signature(original)
    except (TypeError, ValueError):
        signature = None

    def jit_requested(args: tuple, kwargs: dict) -> bool:
        if "jit_compile" in kwargs or "experimental_compile" in kwargs:
            return bool(kwargs.get("jit_compile") or kwargs.get("experimental_compile"))
        if signature is None or not args:
            return False
        try:
            bound = signature.bind_partial(None, *args)
        except TypeError:
            return False
        return bool(bound.arguments.get("jit_compile"))

    def wrap(func: Any, args: tuple, kwargs: dict) -> Any:
        stock = original(func, *args, **kwargs)
        try:
            return TFStitchedFunction(stock)
        except Exception as exc:  # noqa: BLE001 - never break the user's tf.function
            log.warning("%s stays on stock TF: %s: %s", getattr(func, "__qualname__", func),
                        type(exc).__name__, exc)
            return stock

    @functools.wraps(original)
    def function(func: Any = None, *args: Any, **kwargs: Any) -> Any:
        if not jit_requested(args, kwargs):
            return original(func, *args, **kwargs)
        if func is None:
            return lambda f: wrap(f, args, kwargs)
        return wrap(func, args, kwargs)

    function.__stitch_original__ = original
    tf_module.function = function
    log.info("STITCH_ENABLE: tf.function(jit_compile=True) now compiles stitched kernels "
             "in the background")


# ------------------------------------------------------------------------------- Keras
class KerasTrainFunction:
    """``model.train_function`` under stitch: pulls one batch from the iterator, runs the
    model's train step as a ``TFStitchedFunction`` (stock side: Keras' own step function
    settings), raises StopIteration at the end of the data like Keras does. ``options``
    (``async_compile``, ``guard``, ``target``, ``device``) go to the ``TFStitchedFunction``;
    unset, they come from the STITCH_* settings."""

    def __init__(self, model: Any, stock_train_function: Callable, **options: Any):
        import tensorflow as tf
        from keras.src.backend.tensorflow.trainer import reduce_per_replica

        self.model = model
        self.stock_train_function = stock_train_function
        original = getattr(tf.function, "__stitch_original__", tf.function)

        @tf.autograph.experimental.do_not_convert
        def one_step_on_data(data):
            outputs = model.distribute_strategy.run(model.train_step, args=(data,))
            return reduce_per_replica(outputs, model.distribute_strategy, reduction="auto")

        stock = original(one_step_on_data, reduce_retracing=True,
                         jit_compile=bool(model.jit_compile))
        xla = original(one_step_on_data, jit_compile=True)
        self.step = TFStitchedFunction(xla, stock, name=f"{model.name}.train_step", **options)
        if not model.jit_compile:
            # Keras' "auto" leaves XLA off on CPU-only machines; the stitched program is XLA's.
            log.info("%s.train_step: Keras runs it without XLA (jit_compile=False); once "
                     "switched, the step runs as XLA compiles it, whose random ops (dropout) "
                     "draw other numbers than TF's own kernels", model.name)

    def __call__(self, iterator: Any) -> Any:
        import tensorflow as tf

        if not isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            return self.stock_train_function(iterator)
        optional = iterator.get_next_as_optional()
        if not optional.has_value():
            raise StopIteration
        return self.step(optional.get_value())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["stock_train_function"], name)


def _keras_unsupported(model: Any) -> str | None:
    import tensorflow as tf
    if model.run_eagerly:
        return "run_eagerly=True"
    if getattr(model, "steps_per_execution", 1) != 1:
        return f"steps_per_execution={model.steps_per_execution}"
    if model.distribute_strategy is not tf.distribute.get_strategy() or \
            model.distribute_strategy.num_replicas_in_sync != 1:
        return "a distribution strategy"
    return None


def patch_keras() -> bool:
    """Wrap ``TensorFlowTrainer.make_train_function`` (Keras on the TF backend); False when
    Keras runs on another backend."""
    import keras
    if keras.backend.backend() != "tensorflow":
        return False
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    original = TensorFlowTrainer.make_train_function
    if getattr(original, "__stitch_original__", None) is not None:
        return True

    @functools.wraps(original)
    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        original(self, force)
        try:
            why = _keras_unsupported(self)
            if why is not None:
                log.warning("%s.train_step: falls back to XLA: %s is not supported",
                            self.name, why)
            elif not isinstance(self.train_function, KerasTrainFunction):
                self.train_function = KerasTrainFunction(self, self.train_function)
        except Exception as exc:  # noqa: BLE001 - never break model.fit
            log.warning("%s.train_step: falls back to XLA: %s: %s", self.name,
                        type(exc).__name__, exc)
        return self.train_function

    make_train_function.__stitch_original__ = original
    TensorFlowTrainer.make_train_function = make_train_function
    log.info("STITCH_ENABLE: Keras' TensorFlow trainer now compiles stitched kernels in the "
             "background")
    return True
