"""The stitched TF step's data path: TF's eager values to the stitched executable and its
results back, through DLPack, on the device they live on — no host copy, no numpy.

- in: every input (a tensor argument, a variable's current value, a captured constant) is
  handed to jax with ``jax.dlpack.from_dlpack``: jax wraps TF's buffer where it lies. TF's
  DLPack export takes no stream, so on a GPU TF's queued work is waited for first
  (``sync_tf``: ``tf.test.experimental.sync_devices``), once per step;
- out: the executable's results are waited for (``jax.block_until_ready``: TF cannot wait on
  jax's stream) and handed to TF with ``tf.experimental.dlpack.from_dlpack``; a variable is
  written with ``assign`` from that tensor, a device-to-device copy (TF never writes into a
  buffer someone else still reads: DLPack holds a reference, so TF copies on write).

Captured constants do not change between steps: they are wrapped once and kept. The same code
runs on the CPU (no waits) and on a GPU; the waits are injectable for tests.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

_DEVICE = re.compile(r"device:(?P<kind>[A-Za-z_]+):(?P<index>\d+)", re.IGNORECASE)


def device_of(name: str | None) -> tuple[str, int]:
    """A TF device name ('/job:localhost/replica:0/task:0/device:GPU:1') → ("gpu", 1); an
    empty or unplaced name is the host ("cpu", 0)."""
    match = _DEVICE.search(name or "")
    if match is None:
        return "cpu", 0
    kind = match["kind"].lower()
    return ("gpu" if kind == "gpu" else "cpu"), int(match["index"])


def tf_runs_on(values: Iterable[Any]) -> str:
    """The device TF runs a step on, from the values it reads: "gpu" when any variable or
    tensor lives on a GPU (TF places a step with its variables), else "cpu"."""
    for value in values:
        if device_of(getattr(value, "device", None))[0] == "gpu":
            return "gpu"
    return "cpu"


def _sync_tf() -> None:
    import tensorflow as tf
    tf.test.experimental.sync_devices()


def _tf_from_jax(array: Any) -> Any:
    import tensorflow as tf
    return tf.experimental.dlpack.from_dlpack(array.__dlpack__())


def _jax_from_tf(value: Any) -> Any:
    """A TF tensor (or any DLPack producer: a numpy batch) wrapped where it lies; a value
    without DLPack (a numpy scalar) is put on jax's default device."""
    import jax
    if hasattr(value, "__dlpack__"):
        return jax.dlpack.from_dlpack(value)
    return jax.device_put(value)


def _block(arrays: list) -> None:
    import jax
    jax.block_until_ready(arrays)


@dataclass
class Bridge:
    """One signature's exchange with TF. ``gpu``: the values live on a GPU (streams to wait
    for); the callables default to TF's and jax's own and are replaced by tests."""
    gpu: bool = False
    sync_tf: Callable[[], None] = _sync_tf
    jax_from_tf: Callable[[Any], Any] = _jax_from_tf
    tf_from_jax: Callable[[Any], Any] = _tf_from_jax
    block: Callable[[list], None] = _block
    _kept: dict[int, Any] = field(default_factory=dict)

    def to_jax(self, values: list[Any], keep: frozenset[int] = frozenset()) -> list[Any]:
        """TF tensors (and variables' values) → jax arrays on the same device. Positions in
        ``keep`` (captured constants) are converted on the first call and reused."""
        if self.gpu:
            self.sync_tf()                     # TF's export takes no stream: wait here
        out = []
        for i, value in enumerate(values):
            if i in keep:
                array = self._kept.get(i)
                if array is None:
                    array = self._kept[i] = self.jax_from_tf(value)
                out.append(array)
            else:
                out.append(self.jax_from_tf(value))
        return out

    def to_tf(self, arrays: list[Any]) -> list[Any]:
        """The executable's results → TF tensors on the same device, once jax is done."""
        self.block(arrays)                     # TF cannot wait on jax's stream
        return [self.tf_from_jax(a) for a in arrays]

    def wait_tf(self) -> None:
        """Wait for TF's queued device work (the guard times both sides to this point)."""
        self.sync_tf()
