"""The zoo's name -> ModelSpec table and the lookup functions of the public API."""

from __future__ import annotations

from functools import lru_cache

from . import (asr, bert, crnn, dien, mcfuser, micro, mixed_precision, segment_models,
               transformer)
from .spec import ModelInstance, ModelSpec

# Order of listing: micro patterns first, then whole models, then MCFuser subgraphs, then the
# bf16 mixed-precision training variants, then the segmented reductions and scatters.
_MODULES = (micro, bert, transformer, dien, asr, crnn, mcfuser, mixed_precision, segment_models)


@lru_cache(maxsize=1)
def _table() -> dict[str, ModelSpec]:
    table: dict[str, ModelSpec] = {}
    for module in _MODULES:
        for spec in module.SPECS:
            if spec.name in table:
                raise RuntimeError(f"model {spec.name!r} registered twice")
            table[spec.name] = spec
    return table


def list_models() -> list[str]:
    return list(_table())


def get_model(name: str) -> ModelSpec:
    table = _table()
    if name not in table:
        raise KeyError(f"unknown model {name!r}; valid models: {', '.join(table)}")
    return table[name]


def build(name: str, config: str = "tiny") -> ModelInstance:
    spec = get_model(name)
    if config not in spec.configs:
        raise ValueError(
            f"model {name!r} has no config {config!r}; valid configs: {', '.join(spec.configs)}"
        )
    return spec.build(config)
