"""What ``STITCH_ENABLE=1`` does once a framework is imported (called by stitch_autoload).

jax: ``jax.jit`` becomes a function with the same signature that returns ``stitch.jit``
functions (the original stays reachable as ``jax.jit.__stitch_original__``, which stitch's own
stock path uses); calls whose arguments total under STITCH_MIN_BYTES stay on stock jax.jit
(stitch/frontends/size_gate.py). Libraries that bind ``jax.jit`` after jax is imported — Keras' JAX trainer
among them — get stitch too. tensorflow / keras: ``tf.function(jit_compile=True)`` and Keras'
TF trainer go through ``stitch.frontends.tf.tf_frontend``. Settings come from the environment
(stitch/config.py).
"""
from __future__ import annotations

import functools
import logging
from types import ModuleType
from typing import Any, Callable

from .config import configure_logging

log = logging.getLogger("stitch.autoload")  # the user-facing hierarchy (STITCH_LOG)

# What the autoload patched in this process, in order ("jax.jit", "tf.function(jit_compile=
# True)", "Keras' TensorFlow trainer"); each patch adds its name once.
PATCHED: list[str] = []


def patch(name: str, module: ModuleType) -> None:
    configure_logging()
    if name == "jax":
        patch_jax(module)
        _patched("jax.jit")
    elif name in ("tensorflow", "keras"):
        # tf.function(jit_compile=True) and Keras' TF trainer (stitch/frontends/tf/tf_frontend.py); a
        # failure leaves the framework untouched.
        try:
            from stitch.frontends.tf import tf_frontend
            if name == "tensorflow":
                tf_frontend.patch_tensorflow(module)
                _patched("tf.function(jit_compile=True)")
                _configure_gpu_sharing(module)
            elif tf_frontend.patch_keras():
                _patched("Keras' TensorFlow trainer")
            else:
                log.info("STITCH_ENABLE: Keras runs on the %s backend: its trainer is not "
                         "patched (on jax it calls jax.jit)", _keras_backend())
        except Exception as exc:  # noqa: BLE001 - never break the user's import
            log.warning("STITCH_ENABLE: %s stays stock: %s: %s", name, type(exc).__name__, exc)


def _patched(what: str) -> None:
    if what not in PATCHED:
        PATCHED.append(what)
    log.info("STITCH_ENABLE: patched so far: %s", ", ".join(PATCHED))


def _keras_backend() -> str:
    try:
        import keras
        return str(keras.backend.backend())
    except Exception:  # noqa: BLE001 - only for the log line
        return "unknown"


def _configure_gpu_sharing(tf_module: ModuleType) -> None:
    """TensorFlow imported under STITCH_ENABLE: stitch brings jax into a TF program, so both
    runtimes are set to share a GPU before either starts (stitch/frontends/tf/gpu_sharing.py)."""
    from stitch.frontends.tf.gpu_sharing import share_gpu_with_tensorflow
    share_gpu_with_tensorflow(tf_module)


def patch_jax(jax_module: ModuleType) -> None:
    original = jax_module.jit
    if getattr(original, "__stitch_original__", None) is not None:
        return                                          # already patched

    def wrap(fun: Callable, kwargs: dict) -> Any:
        try:
            from stitch.frontends.jax.jax_jit import jit as stitch_jit
            from stitch.frontends.size_gate import SizeGated, min_bytes_setting
            min_bytes = min_bytes_setting()
            if min_bytes:          # tiny jits stay stock (stitch/frontends/size_gate.py)
                return SizeGated(fun, kwargs, original,
                                 lambda: stitch_jit(fun, **kwargs), min_bytes)
            return stitch_jit(fun, **kwargs)
        except Exception as exc:  # noqa: BLE001 - never break the user's jax.jit
            log.warning("%s stays on stock jax.jit: %s: %s",
                        getattr(fun, "__qualname__", fun), type(exc).__name__, exc)
            return original(fun, **kwargs)

    @functools.wraps(original)
    def jit(fun: Callable | None = None, /, **kwargs: Any) -> Any:
        if fun is None:                                 # @partial(jax.jit, ...) style
            return lambda f: wrap(f, kwargs)
        return wrap(fun, kwargs)

    jit.__stitch_original__ = original
    jax_module.jit = jit
    log.info("STITCH_ENABLE: jax.jit now compiles stitched kernels in the background")
