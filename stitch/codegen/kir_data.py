"""Kernel IR as plain data (JSON), and back, for the compile cache: a lowering kept across
processes (``lowering_reuse``) is stored as data only, and reading it runs no code but the
constructors of Kernel IR's own dataclasses.

``kernel_to_data(kernel)`` numbers every dataclass object once, children first (expressions
are DAGs: a shared subexpression is written once and referred to by number), each as
``[type name, [field values]]`` over its constructor's fields; a tuple is ``{"t": [...]}``, a
reference ``{"r": n}``, strings, numbers, booleans and None are themselves.
``kernel_from_data(data)`` builds them back, in order, from Kernel IR's classes only
(``KIR_TYPES``): anything else (an unknown type name, a reference forward, a value of
another kind) is a ``KirDataError``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from . import kir
from .errors import CodegenError


class KirDataError(CodegenError):
    """Data that is not Kernel IR this code writes."""


def _kir_types() -> dict[str, type]:
    found = {}
    for name, value in vars(kir).items():
        if isinstance(value, type) and dataclasses.is_dataclass(value) and (
                issubclass(value, (kir.Expr, kir.Stmt))
                or value in (kir.Param, kir.Shared, kir.GlobalScratch, kir.Kernel)):
            found[name] = value
    return found


KIR_TYPES: dict[str, type] = _kir_types()
_INIT_FIELDS = {name: tuple(f.name for f in dataclasses.fields(cls) if f.init)
                for name, cls in KIR_TYPES.items()}


def kernel_to_data(kernel: kir.Kernel) -> dict:
    """``kernel`` as JSON-ready data (module docstring). A value of a kind the format does
    not hold (a numpy scalar, a NaN is fine) is a ``KirDataError``."""
    nodes: list[list] = []
    numbered: dict[int, int] = {}
    keep: list[object] = []               # ids stay valid while numbering

    def value(v: object) -> object:
        if v is None or isinstance(v, (str, bool, int)):
            return v
        if isinstance(v, float):
            return v if math.isfinite(v) else {"f": repr(v)}
        if isinstance(v, tuple):
            return {"t": [value(x) for x in v]}
        if isinstance(v, list):
            return [value(x) for x in v]
        name = type(v).__name__
        if name in KIR_TYPES and type(v) is KIR_TYPES[name]:
            return {"r": number(v)}
        raise KirDataError(f"Kernel IR value of type {type(v).__name__} has no data form")

    def number(obj: object) -> int:
        got = numbered.get(id(obj))
        if got is not None:
            return got
        name = type(obj).__name__
        fields = [value(getattr(obj, f)) for f in _INIT_FIELDS[name]]
        keep.append(obj)
        got = numbered[id(obj)] = len(nodes)
        nodes.append([name, fields])
        return got

    root = number(kernel)
    return {"nodes": nodes, "root": root}


def kernel_from_data(data: Any) -> kir.Kernel:
    """The kernel ``kernel_to_data`` wrote (module docstring)."""
    try:
        nodes, root = data["nodes"], data["root"]
    except (TypeError, KeyError) as exc:
        raise KirDataError(f"not Kernel IR data: {exc}") from exc
    built: list[object] = []

    def value(v: object) -> object:
        if v is None or isinstance(v, (str, bool, int, float)):
            return v
        if isinstance(v, list):
            return [value(x) for x in v]
        if isinstance(v, dict) and len(v) == 1:
            (tag, inner), = v.items()
            if tag == "t" and isinstance(inner, list):
                return tuple(value(x) for x in inner)
            if tag == "r" and isinstance(inner, int) and 0 <= inner < len(built):
                return built[inner]
            if tag == "f" and inner in ("nan", "inf", "-inf"):
                return float(inner)
        raise KirDataError(f"not a Kernel IR value: {str(v)[:80]}")

    for entry in nodes:
        if not (isinstance(entry, list) and len(entry) == 2 and entry[0] in KIR_TYPES
                and isinstance(entry[1], list)
                and len(entry[1]) == len(_INIT_FIELDS[entry[0]])):
            raise KirDataError(f"not a Kernel IR object: {str(entry)[:80]}")
        cls = KIR_TYPES[entry[0]]
        try:
            built.append(cls(*(value(v) for v in entry[1])))
        except (TypeError, ValueError) as exc:
            raise KirDataError(f"{entry[0]} cannot be built: {exc}") from exc
    if not (isinstance(root, int) and 0 <= root < len(built)
            and isinstance(built[root], kir.Kernel)):
        raise KirDataError("the data's root is not a kernel")
    return built[root]  # type: ignore[return-value]
