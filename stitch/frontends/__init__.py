"""Front ends that take stitch's results back into a framework.

``jax_ops``: re-emit HLO instructions (and whole computations) as jax.lax ops. It imports jax,
so it is loaded on first use: ``from stitch.frontends import JaxOpEmitter`` works, but merely
importing ``stitch.frontends`` does not pull jax in.
"""
from __future__ import annotations

from typing import Any

_LAZY = {"JaxOpEmitter": "jax_ops", "JaxEmitError": "jax_ops", "supported_opcodes": "jax_ops"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module
    return getattr(import_module(f"{__name__}.{module}"), name)
