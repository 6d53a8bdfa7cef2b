"""stitch: FusionStitching for XLA.

The public surface: the HLO front end, the reference evaluator, the fusion planner
(``stitch.plan``), the compiler (``stitch.compile``: an executable on the CPU, PTX per
kernel) and ``stitch.jit`` for jax. Importing stitch imports neither jax nor tensorflow
(``stitch.jit`` imports jax on first use).

The layers are subpackages in the pipeline's order (docs/architecture.md): the HLO layer
(``stitch.hlo``), code generation (``stitch.codegen``), the optimizer
(``stitch.analysis``, ``stitch.cost``, ``stitch.schedule``, ``stitch.pricing``,
``stitch.explorer``, ``stitch.compiler``), the XLA pass (``stitch.xla_pass``) and the
front ends (``stitch.frontends``: ``jax``, ``tf``). Every public name here is resolved on
first access, so importing one subpackage does not import the others.
"""
from __future__ import annotations

import importlib
from typing import Any

from .version import __version__

# Public name -> the module that defines it.
_PUBLIC: dict[str, str] = {
    "HloModule": "stitch.hlo",
    "evaluate": "stitch.hlo",
    "parse_hlo": "stitch.hlo",
    "print_hlo": "stitch.hlo",
    "HloEvaluationError": "stitch.errors",
    "HloParseError": "stitch.errors",
    "StitchError": "stitch.errors",
    "UnsupportedOpcodeError": "stitch.errors",
    "Executable": "stitch.compiler",
    "compile": "stitch.compiler",
    "ExplorerOptions": "stitch.explorer.planner",
    "FusionPlan": "stitch.explorer.planner",
    "plan": "stitch.explorer.planner",
    "jit": "stitch.frontends.jax.jax_jit",
    "StitchedFunction": "stitch.frontends.jax.jax_jit",
}


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'stitch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value        # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])


__all__ = sorted([*_PUBLIC, "__version__"])
