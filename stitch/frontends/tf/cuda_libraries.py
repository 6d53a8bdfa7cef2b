"""Which CUDA libraries TensorFlow's wheel and jax's CUDA plugin load, and whether both can
live in one process.

Both load NVIDIA's libraries by soname (TF through its stream executor's DSO loader, jax's
plugin from the ``nvidia.*`` wheels, ``jax_plugins/xla_cuda1x/__init__.py``); a soname is
loaded once per process, so two builds that want the same soname get one copy:

| wheel | cudart | cuBLAS | cuDNN | from |
|---|---|---|---|---|
| tensorflow 2.20/2.21 (build info: CUDA 12.5.1, cuDNN 9) | libcudart.so.12 | libcublas.so.12 | libcudnn.so.9 (≥ 9.3) | nvidia-*-cu12 |
| jax-cuda12-plugin 0.10 | libcudart.so.12 | libcublas.so.12 | libcudnn.so.9 (≥ 9.8) | nvidia-*-cu12 |
| jax-cuda13-plugin 0.10 | libcudart.so.13 | libcublas.so.13 | libcudnn.so.9 (a CUDA 13 build) | nvidia-*-cu13 |

- TF (CUDA 12) with jax's CUDA 12 plugin: one set of cu12 libraries serves both; cuDNN must
  satisfy the newer minimum (nvidia-cudnn-cu12 ≥ 9.8, < 10: cuDNN 9 keeps its ABI across
  minor versions, so TF built against 9.3 runs on it). Works.
- TF (CUDA 12) with jax's CUDA 13 plugin: cudart and cuBLAS have different sonames and load
  side by side, but both want ``libcudnn.so.9`` — a CUDA 12 build for TF, a CUDA 13 build for
  jax — and the first one loaded serves both. Refused.
- A TF build without CUDA, or no jax CUDA plugin: nothing to share (the stitched side cannot
  run on the GPU without jax's plugin; refused with that reason where TF has a GPU).
"""
from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass
from typing import Any, Callable

JAX_PLUGINS = {12: "jax-cuda12-plugin", 13: "jax-cuda13-plugin"}
CUDNN_WHEELS = {12: "nvidia-cudnn-cu12", 13: "nvidia-cudnn-cu13"}
JAX_CUDNN_MINIMUM = (9, 8)     # jax-cuda12-plugin 0.10's nvidia-cudnn-cu12 requirement


@dataclass(frozen=True)
class CudaCombination:
    """TF's CUDA build and jax's CUDA plugin side by side."""
    tf_cuda: str | None            # TF's build info "cuda_version" (None: not a CUDA build)
    tf_cudnn: str | None
    jax_cuda_major: int | None     # the installed jax CUDA plugin's major (None: none)
    cudnn_wheel: str | None        # the installed nvidia-cudnn wheel's version, where any
    compatible: bool
    reason: str                    # why not, or what loads

    def sonames(self) -> list[str]:
        """What this process would load for TF and jax."""
        names = []
        if self.tf_cuda:
            names += ["libcudart.so.12", "libcublas.so.12", "libcudnn.so.9 (TF)"]
        if self.jax_cuda_major:
            m = self.jax_cuda_major
            names += [f"libcudart.so.{m}", f"libcublas.so.{m}", "libcudnn.so.9 (jax)"]
        return names


def _version(dist: str, lookup: Callable[[str], str]) -> str | None:
    try:
        return lookup(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _major_minor(text: str | None) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text or "")[:2])


def check_combination(tf_module: Any,
                      version: Callable[[str], str] = importlib.metadata.version
                      ) -> CudaCombination:
    """TF's build info (``tf.sysconfig.get_build_info()``) against the jax CUDA plugin and
    cuDNN wheel installed (``version``: importlib.metadata's, or a test's)."""
    info = dict(tf_module.sysconfig.get_build_info())
    tf_cuda = info.get("cuda_version") if info.get("is_cuda_build") else None
    tf_cudnn = str(info.get("cudnn_version")) if tf_cuda else None
    plugins = [m for m, dist in JAX_PLUGINS.items() if _version(dist, version)]
    jax_major = max(plugins) if plugins else None
    cudnn = _version(CUDNN_WHEELS.get(jax_major or 12, ""), version) if jax_major else None

    def result(ok: bool, reason: str) -> CudaCombination:
        return CudaCombination(tf_cuda, tf_cudnn, jax_major, cudnn, ok, reason)

    if tf_cuda is None:
        return result(False, "TensorFlow is not a CUDA build: it runs nothing on the GPU")
    if jax_major is None:
        return result(False, "no jax CUDA plugin is installed (pip install "
                             "'jax[cuda12]'): the stitched program cannot run on the GPU")
    tf_major = _major_minor(tf_cuda)[0]
    if len(plugins) > 1:
        return result(False, f"both {JAX_PLUGINS[12]} and {JAX_PLUGINS[13]} are installed; "
                             "keep the one matching TensorFlow's CUDA "
                             f"{tf_major} ({JAX_PLUGINS.get(tf_major, '?')})")
    if jax_major != tf_major:
        return result(False, f"TensorFlow is built for CUDA {tf_cuda} (cuDNN {tf_cudnn}) and "
                             f"jax's plugin for CUDA {jax_major}: both load libcudnn.so.9, one "
                             f"built for each CUDA, and one process gets one copy. Install "
                             f"{JAX_PLUGINS.get(tf_major, 'a jax plugin for CUDA ' + str(tf_major))}"
                             f" instead of {JAX_PLUGINS[jax_major]}")
    if cudnn is not None and _major_minor(cudnn) < JAX_CUDNN_MINIMUM:
        return result(False, f"{CUDNN_WHEELS[jax_major]} {cudnn} is older than jax's plugin "
                             f"needs ({'.'.join(map(str, JAX_CUDNN_MINIMUM))}); TF and jax "
                             "share the one libcudnn.so.9 loaded. Install "
                             f"'{CUDNN_WHEELS[jax_major]}>=9.8,<10'")
    return result(True, f"TensorFlow (CUDA {tf_cuda}) and {JAX_PLUGINS[jax_major]} share one "
                        f"set of CUDA {jax_major} libraries (cuDNN wheel {cudnn or 'system'})")
