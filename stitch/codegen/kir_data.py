"""Kernel IR as plain data (JSON), and back, for the compile cache: a lowering kept across
processes (``lowering_reuse``) is stored as data only, and reading it runs no code but the
constructors of Kernel IR's own dataclasses.

``kernel_to_data(kernel)`` numbers every dataclass object once, children first (expressions
are DAGs: a shared subexpression is written once and referred to by number), each as
``[type name, [field values]]`` over its constructor's fields; a reference is the number
itself (the commonest value: one per operand), an int ``{"i": n}``, a tuple ``{"t": [...]}``,
a non-finite float ``{"f": "nan"}``; strings, finite floats, booleans, lists and None are
themselves.
``kernel_from_data(data)`` builds them back, in order, from Kernel IR's classes only
(``KIR_TYPES``): anything else (an unknown type name, a reference forward, a value of
another kind) is a ``KirDataError``.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Callable

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


def _field_reader(fields: tuple[str, ...]) -> Callable[[object], tuple]:
    """An object's values of ``fields``, as a tuple, in one C call where there are two or
    more (``operator.attrgetter``)."""
    if len(fields) > 1:
        return operator.attrgetter(*fields)
    if fields:
        one = operator.attrgetter(fields[0])
        return lambda obj: (one(obj),)
    return lambda obj: ()


# Per Kernel IR class (exact type): its name and its constructor fields' reader.
_WRITERS: dict[type, tuple[str, Callable[[object], tuple]]] = {
    cls: (name, _field_reader(_INIT_FIELDS[name])) for name, cls in KIR_TYPES.items()}


def kernel_to_data(kernel: kir.Kernel) -> dict:
    """``kernel`` as JSON-ready data (module docstring). A value of a kind the format does
    not hold (a numpy scalar, a NaN is fine) is a ``KirDataError``."""
    nodes: list[list] = []
    numbered: dict[int, int] = {}
    writers = _WRITERS

    # Dispatch on the exact type first (kernels hold tens of thousands of values); the
    # isinstance checks after it take what the exact types do not (a str subclass).
    def value(v: object) -> object:
        kind = type(v)
        if kind in writers:
            got = numbered.get(id(v))
            return got if got is not None else number(v, kind)
        if kind is str or kind is bool or v is None:
            return v
        if kind is int:
            return {"i": v}
        if kind is tuple:
            return {"t": [value(x) for x in v]}
        if kind is float:
            return v if math.isfinite(v) else {"f": repr(v)}
        if kind is list:
            return [value(x) for x in v]
        if isinstance(v, (str, bool)):
            return v
        if isinstance(v, int):
            return {"i": int(v)}
        if isinstance(v, float):
            return v if math.isfinite(v) else {"f": repr(v)}
        raise KirDataError(f"Kernel IR value of type {type(v).__name__} has no data form")

    def number(obj: object, kind: type) -> int:
        name, read = writers[kind]
        fields = [value(v) for v in read(obj)]
        # Numbered after its fields (children first); every object numbered is reachable
        # from ``kernel``, so its id stays its own while this runs.
        got = numbered[id(obj)] = len(nodes)
        nodes.append([name, fields])
        return got

    if type(kernel) not in writers:
        raise KirDataError(f"not a Kernel IR kernel: {type(kernel).__name__}")
    root = number(kernel, type(kernel))
    return {"nodes": nodes, "root": root}


def kernel_from_data(data: Any) -> kir.Kernel:
    """The kernel ``kernel_to_data`` wrote (module docstring)."""
    try:
        nodes, root = data["nodes"], data["root"]
    except (TypeError, KeyError) as exc:
        raise KirDataError(f"not Kernel IR data: {exc}") from exc
    built: list[object] = []

    def value(v: object) -> object:
        kind = type(v)
        if kind is int:                    # a reference, to an object built before
            if 0 <= v < len(built):        # type: ignore[operator]
                return built[v]            # type: ignore[index]
        elif kind is str or kind is bool or kind is float or v is None:
            return v
        elif kind is list:
            return [value(x) for x in v]   # type: ignore[attr-defined]
        elif kind is dict and len(v) == 1:  # type: ignore[arg-type]
            (tag, inner), = v.items()      # type: ignore[attr-defined]
            if tag == "i" and type(inner) is int:
                return inner
            if tag == "t" and isinstance(inner, list):
                return tuple(value(x) for x in inner)
            if tag == "f" and inner in ("nan", "inf", "-inf"):
                return float(inner)
        raise KirDataError(f"not a Kernel IR value: {str(v)[:80]}")

    types, init_fields = KIR_TYPES, _INIT_FIELDS
    for entry in nodes:
        if not (isinstance(entry, list) and len(entry) == 2 and entry[0] in types
                and isinstance(entry[1], list)
                and len(entry[1]) == len(init_fields[entry[0]])):
            raise KirDataError(f"not a Kernel IR object: {str(entry)[:80]}")
        cls = types[entry[0]]
        try:
            built.append(cls(*[value(v) for v in entry[1]]))
        except (TypeError, ValueError, AttributeError, CodegenError) as exc:
            # A constructor's own check (a dtype, an op) or a value of another kind where
            # it reads an operand's fields.
            raise KirDataError(f"{entry[0]} cannot be built: {exc}") from exc
    if not (type(root) is int and 0 <= root < len(built)
            and isinstance(built[root], kir.Kernel)):
        raise KirDataError("the data's root is not a kernel")
    return built[root]  # type: ignore[return-value]
