"""A plan's priced kernels as JSON data and back: kernel costs and tuned schedules
(``KernelCost``, ``KernelSchedule`` and its parts, ``GemmChainSchedule``), so the plan cache
stores what a rebuilt plan would otherwise price and tune again.

Only data: JSON scalars, lists, tuples (``{"t": [...]}``), string-keyed dicts
(``{"d": {...}}``) and the dataclasses of ``DATA_CLASSES`` (``{"c": name, "f": fields}``),
rebuilt through their constructors. Nothing read is imported or run by name; a class
outside the registry, a field missing or extra, or a scalar field of the wrong type is a
``DataError``.
"""
from __future__ import annotations

import dataclasses
import functools
import typing

from ..cost.gemm_tile import GemmChainSchedule
from ..cost.occupancy import Occupancy
from ..errors import StitchError
from ..pricing.delta import KernelCost
from ..schedule.global_scope import GlobalReduction, GlobalScope
from ..schedule.kernel_schedule import GroupSchedule, KernelSchedule, PartSchedule, SharedBuffer


class DataError(StitchError):
    """A value that is not (or does not decode to) plan data."""


DATA_CLASSES: dict[str, type] = {cls.__name__: cls for cls in (
    KernelCost, KernelSchedule, PartSchedule, GroupSchedule, SharedBuffer, GlobalScope,
    GlobalReduction, Occupancy, GemmChainSchedule)}

# Scalar annotations checked on decoding, and the JSON types each accepts (bool is an int
# subclass: never taken for an int; an int is a valid float field value).
_SCALARS: dict[type, tuple[type, ...]] = {int: (int,), float: (float, int), str: (str,),
                                          bool: (bool,)}


def to_data(value: object) -> object:
    """``value`` as JSON-ready data (DataError for anything outside the registry)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [to_data(v) for v in value]
    if isinstance(value, tuple):
        return {"t": [to_data(v) for v in value]}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise DataError("a dict with keys that are not strings")
        return {"d": {k: to_data(v) for k, v in value.items()}}
    name = type(value).__name__
    if DATA_CLASSES.get(name) is type(value):
        return {"c": name, "f": {f.name: to_data(getattr(value, f.name))
                                 for f in _init_fields(type(value))}}
    raise DataError(f"no data form for {type(value).__qualname__}")


def from_data(data: object) -> object:
    """The value ``to_data`` gave ``data`` for (DataError when it is not plan data)."""
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return _items(data)
    if not isinstance(data, dict) or len(data) not in (1, 2):
        raise DataError(f"not plan data: {type(data).__name__}")
    if len(data) == 1 and isinstance(data.get("t"), list):
        return tuple(_items(data["t"]))
    if len(data) == 1 and isinstance(data.get("d"), dict):
        return {k: from_data(v) for k, v in data["d"].items()}
    cls = DATA_CLASSES.get(data.get("c")) if isinstance(data.get("c"), str) else None
    fields = data.get("f")
    if cls is None or not isinstance(fields, dict):
        raise DataError(f"not plan data: {sorted(data)[:3]}")
    names = [f.name for f in _init_fields(cls)]
    if sorted(fields) != sorted(names):
        raise DataError(f"{cls.__name__}: fields {sorted(fields)} differ from {sorted(names)}")
    values = {name: v if type(v) in _PLAIN else from_data(v)
              for name, v in ((name, fields[name]) for name in names)}
    for name, accepted in _scalar_fields(cls).items():
        value = values[name]
        if not isinstance(value, accepted) or (isinstance(value, bool) and bool not in accepted):
            raise DataError(f"{cls.__name__}.{name}: {type(value).__name__} value")
    return cls(**values)


def _items(data: list) -> list:
    """A decoded list; one of scalars only (member ids, notes) as it is: most of a plan."""
    if all(type(v) in _PLAIN for v in data):
        return list(data)
    return [from_data(v) for v in data]


_PLAIN = frozenset({int, float, str, bool, type(None)})


def decoded(data: object, cls: type, optional: bool = False) -> object:
    """``from_data(data)``, which must be a ``cls`` (or None when ``optional``)."""
    value = from_data(data)
    if (value is None and optional) or type(value) is cls:
        return value
    raise DataError(f"expected {cls.__name__}, got {type(value).__name__}")


@functools.lru_cache(maxsize=None)
def _init_fields(cls: type) -> tuple[dataclasses.Field, ...]:
    return tuple(f for f in dataclasses.fields(cls) if f.init)


@functools.lru_cache(maxsize=None)
def _scalar_fields(cls: type) -> dict[str, tuple[type, ...]]:
    """The init fields annotated with a plain scalar type, and the types they accept."""
    hints = typing.get_type_hints(cls)
    return {f.name: _SCALARS[hints[f.name]] for f in _init_fields(cls)
            if hints.get(f.name) in _SCALARS}
