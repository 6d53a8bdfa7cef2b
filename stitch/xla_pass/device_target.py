"""Which of stitch's GPU specs (``stitch.cost.gpu_specs``) a device is planned as.

``target_for_device_info(name, capability, memory_bytes)`` is the mapping (pure, tested
without a GPU); ``device_target()`` applies it to the first CUDA device jax sees;
``pass_target(requested)`` is what the XLA pass plans for: ``STITCH_TARGET`` when it is set,
else a target a caller named that is not the default, else the device's.
"""
from __future__ import annotations

import logging
import os

from stitch.config import DEFAULT_TARGET

log = logging.getLogger(__name__)

H200_MIN_MEMORY = 100 * 2**30    # H100: 80 / 94 GB, H200: 141 GB


def target_for_device_info(name: str, capability: tuple[int, int] | None,
                           memory_bytes: int | None = None) -> str:
    """The spec a device is planned as: by name where it says (H200, H100, A100, V100),
    else by compute capability (7.x → v100, 8.x → a100, 9.x → h100, or h200 with over
    100 GiB of memory; newer → h200, the largest spec), else the default."""
    upper = name.upper()
    for marker, target in (("H200", "h200"), ("H100", "h100"), ("H800", "h100"),
                           ("A100", "a100"), ("A800", "a100"), ("V100", "v100")):
        if marker in upper:
            return target
    if capability is None:
        return DEFAULT_TARGET
    major = capability[0]
    if major <= 7:
        return "v100"
    if major == 8:
        return "a100"
    if major == 9:
        return "h200" if memory_bytes and memory_bytes >= H200_MIN_MEMORY else "h100"
    log.info("device %r (compute capability %d.%d) is newer than every spec stitch has: "
             "planned as an H200", name, *capability)
    return "h200"


def device_target() -> str | None:
    """The first CUDA device's target (None without one)."""
    try:
        import jax
        devices = jax.devices("gpu")
    except Exception:  # noqa: BLE001 - no GPU backend
        return None
    if not devices:
        return None
    device = devices[0]
    capability = getattr(device, "compute_capability", None)
    cc = tuple(int(v) for v in str(capability).split(".")[:2]) if capability else None
    memory = None
    try:
        memory = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 - not every backend reports it
        pass
    return target_for_device_info(getattr(device, "device_kind", "") or "", cc, memory)


def pass_target(requested: str | None) -> str:
    """The target a GPU compile plans for (module docstring)."""
    explicit = os.environ.get("STITCH_TARGET", "").strip().lower()
    if explicit:
        return explicit
    if requested and requested.lower() != DEFAULT_TARGET:
        return requested.lower()
    found = device_target()
    if found is None:
        return (requested or DEFAULT_TARGET).lower()
    if found != (requested or DEFAULT_TARGET).lower():
        log.info("planning for %s, the device's target (STITCH_TARGET unset)", found)
    return found
