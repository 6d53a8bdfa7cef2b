"""Under ``STITCH_ENABLE=1`` every ``jax.jit`` in a program becomes stitch's, and each new
signature would get a background compile with the pass. Tiny jits (an optimizer's scalar
update, a metric, a PRNG split) cannot repay that: ``SizeGated`` runs calls whose array
arguments total under ``STITCH_MIN_BYTES`` (default ``MIN_BYTES`` = 1 MiB; ``0``/``off``:
every call stitched) on stock ``jax.jit`` and makes the ``stitch.jit`` function only at the
first call at or above it. The first call below the gate is said once at ``STITCH_LOG=info``
(the function's name, its argument bytes, the gate) and the calls below it are counted in a
STITCH_STATS record of state ``below-size-gate``.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from stitch.config import ConfigError, env_count
from .switching import SignatureCounters, register_record

log = logging.getLogger("stitch.autoload")
MIN_BYTES = 1 << 20


class SizeSettingError(ConfigError, ValueError):
    """STITCH_MIN_BYTES is not a byte count or off."""


def min_bytes_setting() -> int:
    """STITCH_MIN_BYTES (``config.env_count``'s spelling: a count, ``off``/0 for none)."""
    try:
        return env_count("STITCH_MIN_BYTES", MIN_BYTES, "bytes") or 0
    except ConfigError as exc:
        raise SizeSettingError(str(exc)) from None


def argument_bytes(args: tuple, kwargs: dict) -> int:
    import jax
    total = 0
    for leaf in jax.tree_util.tree_leaves((args, kwargs)):
        dtype = getattr(leaf, "dtype", None)
        size = getattr(leaf, "size", None)
        if dtype is not None and isinstance(size, int):
            total += size * getattr(dtype, "itemsize", 0)
    return total


class SizeGated:
    """A jitted function: stock jax.jit below ``min_bytes`` of arguments, stitch.jit above."""

    def __init__(self, fun: Callable, kwargs: dict, original_jit: Callable,
                 make_stitched: Callable[[], Any], min_bytes: int) -> None:
        self._stock = original_jit(fun, **kwargs)
        self._make_stitched = make_stitched
        self._stitched: Any = None
        self.min_bytes = min_bytes
        self._below: SignatureCounters | None = None   # the calls kept stock, once there is one
        self._count_lock = threading.Lock()
        self.__wrapped__ = fun
        self.__name__ = getattr(fun, "__name__", "fn")
        self.__qualname__ = getattr(fun, "__qualname__", self.__name__)
        self.__doc__ = getattr(fun, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._stitched is None:
            size = argument_bytes(args, kwargs)
            if size < self.min_bytes:
                self._count_below(size)
                return self._stock(*args, **kwargs)
        if self._stitched is None:
            self._stitched = self._make_stitched()
            log.debug("%s: arguments of %d bytes or more: stitched", self.__qualname__,
                      self.min_bytes)
        return self._stitched(*args, **kwargs)

    def _count_below(self, size: int) -> None:
        """Count a call kept on stock jax.jit; the first one is said and recorded."""
        with self._count_lock:
            if self._below is not None:
                self._below.calls += 1
                return
            reason = (f"arguments of {size} bytes are under STITCH_MIN_BYTES={self.min_bytes}: "
                      "stays on stock jax.jit (STITCH_MIN_BYTES=0 stitches every call)")
            self._below = SignatureCounters(self.__qualname__, calls=1,
                                            state="below-size-gate", fallback_reason=reason)
        register_record(self._below)
        log.info("%s: %s", self.__qualname__, reason)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_stock"], name)
