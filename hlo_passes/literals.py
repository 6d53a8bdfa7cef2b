"""Constant literals: ``constant(1.5)``, ``constant({ {1, 2}, {3, 4} })``, ``constant({...})``.

``literal_elements`` checks the text and returns its flat element strings (the parser uses it
to reject literals that do not match their shape); ``literal_to_numpy`` builds the array.
"""
from __future__ import annotations

import re

import numpy as np

from .ir import Shape

ELIDED = "{...}"

_TOKEN = re.compile(r"\s*(?:(?P<open>\{)|(?P<close>\})|(?P<comma>,)|"
                    r"(?P<complex>\(\s*[^()]*\))|"
                    r"(?P<scalar>[-+]?(?:inf|nan(?:\(0x[0-9a-fA-F]+\))?|true|false|0x[0-9a-fA-F]+|"
                    r"\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?)))")


def literal_elements(text: str, shape: Shape) -> list[str] | None:
    """Flat element texts of a literal, checked against ``shape``; None if elided ``{...}``.

    Raises ValueError (with a message) when the literal is malformed or has the wrong size.
    """
    text = text.strip()
    if text == ELIDED:
        return None
    if shape.is_tuple:
        # Tuple literals ( {1,2}, 3 ) are rare in dumps; accept them unchecked.
        if not (text.startswith("(") and text.endswith(")")):
            raise ValueError("a tuple constant needs a parenthesised literal")
        return []
    values: list[str] = []
    depth = max_depth = 0
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise ValueError(f"bad literal element at {text[pos:pos + 20]!r}")
        pos = m.end()
        if m.group("open"):
            depth += 1
            max_depth = max(max_depth, depth)
        elif m.group("close"):
            depth -= 1
            if depth < 0:
                raise ValueError("unbalanced '}' in literal")
        elif m.group("comma"):
            continue
        else:
            values.append((m.group("complex") or m.group("scalar")).strip())
    if depth != 0:
        raise ValueError("unbalanced '{' in literal")
    expected = shape.num_elements
    if shape.rank and max_depth not in (0, shape.rank):
        raise ValueError(f"literal nests {max_depth} deep but the shape has rank {shape.rank}")
    if len(values) != expected:
        raise ValueError(f"literal has {len(values)} elements but shape {shape} needs {expected}")
    return values


def _scalar(token: str, kind: str) -> object:
    if kind == "b":
        return token == "true" or (token not in ("false", "0") and float(token) != 0)
    if kind == "c":
        real, imag = (float(v) for v in token.strip("() ").split(","))
        return complex(real, imag)
    lowered = token.lower()
    if lowered.startswith(("nan", "+nan", "-nan")):
        return float("nan")
    if token in ("true", "false"):
        return 1 if token == "true" else 0
    if kind in "iu":
        return int(token, 16) if lowered.startswith(("0x", "-0x")) else int(float(token)) if "." in token or "e" in lowered else int(token)
    return float(token)


def literal_to_numpy(text: str, shape: Shape, dtype: np.dtype) -> np.ndarray:
    """The literal as an array of ``dtype`` with ``shape.dims``. Elided literals raise."""
    values = literal_elements(text, shape)
    if values is None:
        raise ValueError("the constant is elided ({...}); its values are not in the HLO text")
    kind = np.dtype(dtype).kind
    parsed = [_scalar(v, kind) for v in values]
    # Build in a wide type, then cast (bf16/f8 come from ml_dtypes and take float input).
    wide = {"b": np.bool_, "c": np.complex128, "i": np.int64, "u": np.uint64}.get(kind, np.float64)
    return np.asarray(parsed, dtype=wide).reshape(shape.dims).astype(dtype)
