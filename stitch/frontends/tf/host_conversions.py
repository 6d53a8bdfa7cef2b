"""Counting host conversions: TF tensors and variables and jax arrays read into numpy.

``HostConversions`` is a context manager. While it is entered, every ``np.asarray`` /
``np.array`` of a TF tensor, TF variable, Keras variable or jax array, every ``.numpy()`` of a
TF tensor or variable, every ``__array__`` of those, and every ``float()`` / ``int()`` /
``bool()`` / ``operator.index`` of a TF tensor or jax array is counted — one per host read:
a conversion made inside another one (``np.asarray(t)`` calling ``t.__array__``, a variable's
``numpy()`` calling its value's) is not counted again. With ``where=True`` each count also
records the call site (the innermost frame outside numpy, TF, Keras and jax). The
frameworks watched are those imported when the counter is entered.

The TF front end's tests and ``bench/tf.py`` count with it: stock Keras steps against
stitched ones (``bench/tf_conversions.py``).
"""
from __future__ import annotations

import collections
import contextlib
import inspect
import logging
import sys
import threading
from typing import Any, Callable, Iterator

import numpy as np

log = logging.getLogger("stitch.tf")

# Frames inside these packages are not a conversion's call site.
_LIBRARY_PARTS = ("/numpy/", "/tensorflow/", "/keras/", "/jax/", "/jaxlib/", "/optree/",
                  "/tf_keras/", "/keras_hub/", "host_conversions.py")
_SCALAR_READS = ("__float__", "__int__", "__bool__", "__index__")


def _defining_class(cls: type, name: str) -> type | None:
    """The class of ``cls``'s MRO that defines ``name`` (patched there, its subclasses too)."""
    for base in cls.__mro__:
        if name in base.__dict__:
            return base
    return None


def _watched() -> tuple[tuple[type, ...], list[tuple[type, str]]]:
    """(the types whose numpy conversion counts, the (class, method) pairs to wrap), for
    the frameworks imported so far: a framework not imported yet has no values to read."""
    types: list[type] = []
    methods: list[tuple[type, str]] = []
    if "tensorflow" in sys.modules:
        import tensorflow as tf
        tensor, variable = type(tf.constant(0.0)), type(tf.Variable(0.0))
        types += [tf.Tensor, tf.Variable]
        methods += [(tensor, n) for n in ("numpy", "__array__", *_SCALAR_READS)]
        methods += [(variable, n) for n in ("numpy", "__array__")]
    keras = sys.modules.get("keras")
    if keras is not None and isinstance(getattr(keras, "Variable", None), type):
        types.append(keras.Variable)
    if "jax" in sys.modules:
        import jax
        array = type(jax.numpy.zeros(1))
        types.append(jax.Array)
        methods += [(array, n) for n in ("__array__", *_SCALAR_READS)]
    return tuple(types), methods


class HostConversions:
    """Counts host conversions while entered (module docstring): ``total``, ``kinds``
    (e.g. ``"EagerTensor.numpy"``, ``"np.array(ArrayImpl)"``) and, with ``where=True``,
    ``sites`` ("file:line function" of the call outside the libraries → count).
    ``paused()`` stops counting for a block (a measurement's own reads)."""

    def __init__(self, where: bool = False):
        self.where = where
        self.kinds: collections.Counter[str] = collections.Counter()
        self.sites: collections.Counter[str] = collections.Counter()
        self._restore: list[tuple[Any, str, Any]] = []
        self._local = threading.local()
        self._paused = False
        self._types: tuple[type, ...] = ()

    @property
    def total(self) -> int:
        return sum(self.kinds.values())

    def reset(self) -> None:
        self.kinds.clear()
        self.sites.clear()

    # --- patching -----------------------------------------------------------------------
    def __enter__(self) -> "HostConversions":
        self._types, methods = _watched()
        for name in ("asarray", "array"):
            self._patch(np, name, self._numpy_wrapper(name, getattr(np, name)))
        for cls, name in methods:
            owner = _defining_class(cls, name)
            if owner is None:
                continue
            self._patch(owner, name, self._method_wrapper(name, owner.__dict__[name]))
        return self

    def __exit__(self, *exc: Any) -> None:
        while self._restore:
            owner, name, original = self._restore.pop()
            setattr(owner, name, original)

    def _patch(self, owner: Any, name: str, wrapper: Callable) -> None:
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        if any(o is owner and n == name for o, n, _ in self._restore):
            return                       # two watched classes share the defining class
        try:
            setattr(owner, name, wrapper)
        except TypeError:                # a type that takes no new attributes: not watched
            log.debug("%s.%s cannot be watched", owner, name)
            return
        self._restore.append((owner, name, original))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No counting inside this block (a measurement's own reads)."""
        before, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = before

    # --- counting -----------------------------------------------------------------------
    def _enter_read(self, kind: str) -> None:
        """Count ``kind`` unless this read happens inside a counted one (or paused)."""
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        if depth == 0 and not self._paused:
            self.kinds[kind] += 1
            if self.where:
                self.sites[_call_site()] += 1

    def _leave_read(self) -> None:
        self._local.depth -= 1

    def _numpy_wrapper(self, name: str, real: Callable) -> Callable:
        """``np.<name>``: counted when handed one of the watched frameworks' values."""
        return self._counting(real, lambda obj: f"np.{name}({type(obj).__name__})",
                              watched_only=True)

    def _method_wrapper(self, name: str, real: Callable) -> Callable:
        """A watched type's ``name`` method (``.numpy()``, ``__array__``, ``__float__``...)."""
        return self._counting(real, lambda obj: f"{type(obj).__name__}.{name}")

    def _counting(self, real: Callable, kind: Callable[[Any], str],
                  watched_only: bool = False) -> Callable:
        counter = self

        def converted(obj: Any, *args: Any, **kwargs: Any) -> Any:
            if watched_only and not isinstance(obj, counter._types):
                return real(obj, *args, **kwargs)
            counter._enter_read(kind(obj))
            try:
                return real(obj, *args, **kwargs)
            finally:
                counter._leave_read()
        converted.__wrapped__ = real
        return converted


def _call_site() -> str:
    """The innermost caller outside numpy, the frameworks and this module."""
    frame = inspect.currentframe()
    while frame is not None and any(part in frame.f_code.co_filename
                                    for part in _LIBRARY_PARTS):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}"
