"""Two runtimes, one GPU: what stitch sets when it brings jax into a TensorFlow program.

TensorFlow reserves nearly all of a GPU's memory when it creates its GPU devices, and jax
preallocates 75% of it when its GPU client starts: whichever starts second fails or starves.
Under ``STITCH_ENABLE`` the autoload calls ``share_gpu_with_tensorflow`` right after
``import tensorflow`` — before TF has created a device and before stitch has started jax's
client — and, where TF sees a GPU:

- TF: memory growth on every GPU (``tf.config.experimental.set_memory_growth``), unless the
  user set ``TF_FORCE_GPU_ALLOW_GROWTH`` (either way) or gave a GPU a logical-device
  (memory limit) configuration;
- jax: ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (jax allocates as it goes), unless the user
  set any of ``XLA_PYTHON_CLIENT_PREALLOCATE`` / ``XLA_PYTHON_CLIENT_MEM_FRACTION`` /
  ``XLA_PYTHON_CLIENT_ALLOCATOR``;

and says so at ``STITCH_LOG=info``. It refuses — the stitched side stays off the GPU and TF
runs its own steps — where the two cannot share: TF's GPU devices already created without
growth (it holds the memory), jax's GPU client already started with its default
preallocation, or CUDA libraries that cannot both load (``cuda_libraries.py``). The refusal
is logged once as a warning and kept (``refusal()``), and every TF function whose stitched
side would run on the GPU falls back with it.
"""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, MutableMapping

from stitch.errors import StitchError

from .cuda_libraries import CudaCombination, check_combination

log = logging.getLogger("stitch.gpu")

TF_GROWTH = "TF_FORCE_GPU_ALLOW_GROWTH"
JAX_PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
JAX_MEMORY_SETTINGS = (JAX_PREALLOCATE, "XLA_PYTHON_CLIENT_MEM_FRACTION",
                       "XLA_PYTHON_CLIENT_ALLOCATOR")


class GpuSharingError(StitchError):
    """TensorFlow and jax cannot share this GPU in one process (the message says why)."""


@dataclass
class SharingDecision:
    """What ``share_gpu_with_tensorflow`` did: settings it made, user settings it left
    alone, and the refusal (None: the two runtimes can share the GPU)."""
    gpus: int = 0
    made: list[str] = field(default_factory=list)
    left_alone: list[str] = field(default_factory=list)
    refusal: str | None = None
    cuda: CudaCombination | None = None


_DECISION: SharingDecision | None = None


def refusal() -> str | None:
    """Why the stitched side may not run on the GPU in this process (None: it may)."""
    return _DECISION.refusal if _DECISION is not None else None


def check_gpu_allowed() -> None:
    """Raise ``GpuSharingError`` where this process refused to share its GPU."""
    why = refusal()
    if why is not None:
        raise GpuSharingError(why)


def jax_gpu_started(modules: dict[str, Any] | None = None) -> bool:
    """Whether jax's client is already running (it read its memory settings then), asked
    without starting it: jax not imported, or its backends not yet made, means not started
    (jax has no public question for that; its ``xla_bridge.backends_are_initialized`` is
    read where it exists, else jax is taken as started — the careful answer)."""
    modules = sys.modules if modules is None else modules
    if "jax" not in modules:
        return False
    bridge = modules.get("jax._src.xla_bridge")
    if bridge is None:
        return False
    initialized = getattr(bridge, "backends_are_initialized", None)
    return True if initialized is None else bool(initialized())


def share_gpu_with_tensorflow(tf_module: Any,
                              environ: MutableMapping[str, str] | None = None,
                              jax_started: Callable[[], bool] | None = None,
                              cuda_check: Callable[[Any], CudaCombination] | None = None,
                              ) -> SharingDecision:
    """Set both runtimes to share the GPU TF sees (module docstring); the decision is kept
    for ``refusal()``. ``environ``, ``jax_started`` and ``cuda_check`` are for tests."""
    global _DECISION
    environ = os.environ if environ is None else environ
    decision = SharingDecision()
    gpus = list(tf_module.config.list_physical_devices("GPU"))
    decision.gpus = len(gpus)
    if not gpus:
        log.debug("TensorFlow sees no GPU: no memory settings needed")
        _DECISION = decision
        return decision
    decision.cuda = (cuda_check or check_combination)(tf_module)
    if not decision.cuda.compatible:
        decision.refusal = decision.cuda.reason
    _tf_growth(tf_module, gpus, environ, decision)
    _jax_memory(environ, decision, jax_started or _jax_started_here)
    for what in decision.made:
        log.info("TensorFlow and jax share the GPU: %s", what)
    for what in decision.left_alone:
        log.info("TensorFlow and jax share the GPU: left as the user set it: %s", what)
    if decision.refusal is not None:
        log.warning("stitch will not run TensorFlow steps on the GPU in this process: %s",
                    decision.refusal)
    _DECISION = decision
    return decision


def _jax_started_here() -> bool:
    return jax_gpu_started()


def _tf_growth(tf_module: Any, gpus: list, environ: MutableMapping[str, str],
               decision: SharingDecision) -> None:
    if TF_GROWTH in environ:
        decision.left_alone.append(f"{TF_GROWTH}={environ[TF_GROWTH]}")
        return
    experimental = tf_module.config.experimental
    for gpu in gpus:
        configured = tf_module.config.get_logical_device_configuration(gpu)
        if configured:
            decision.left_alone.append(f"{gpu.name}: logical device configuration "
                                       f"{configured}")
            continue
        if experimental.get_memory_growth(gpu):
            decision.left_alone.append(f"{gpu.name}: memory growth already on")
            continue
        try:
            experimental.set_memory_growth(gpu, True)
        except RuntimeError as exc:     # TF created its devices already: it holds the memory
            decision.refusal = decision.refusal or (
                f"TensorFlow's GPU devices were created before stitch could turn memory "
                f"growth on ({exc}); TF holds the GPU's memory and jax would not fit. Set "
                f"{TF_GROWTH}=true (or tf.config.experimental.set_memory_growth) before "
                f"TensorFlow first uses the GPU")
            return
        decision.made.append(f"memory growth on for TensorFlow's {gpu.name}")


def _jax_memory(environ: MutableMapping[str, str], decision: SharingDecision,
                jax_started: Callable[[], bool]) -> None:
    user = [f"{k}={environ[k]}" for k in JAX_MEMORY_SETTINGS if k in environ]
    if user:
        decision.left_alone.extend(user)
        return
    if jax_started():
        decision.refusal = decision.refusal or (
            "jax's GPU client started before TensorFlow was imported, with its default "
            "preallocation (75% of the GPU's memory); TensorFlow would be left the rest. Set "
            f"{JAX_PREALLOCATE}=false (or XLA_PYTHON_CLIENT_MEM_FRACTION) before jax starts")
        return
    environ[JAX_PREALLOCATE] = "false"
    decision.made.append(f"{JAX_PREALLOCATE}=false (jax allocates GPU memory as it goes)")
