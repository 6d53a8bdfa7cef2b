"""Constant literals: ``constant(1.5)``, ``constant({ {1, 2}, {3, 4} })``, ``constant({...})``.

``check_literal`` validates the text against its shape (the parser rejects literals that do
not match); ``literal_to_numpy`` builds the array. A scalar literal for a non-scalar shape
(``f32[2,3] constant(1)``, which XLA's parser accepts) fills the whole shape.

Plain numeric literals (every element a decimal number, ``inf`` or ``nan``) take a numpy
fast path: a 10M-element constant parses in seconds without a Python object per element.
Everything else (pred, hex, complex, nan payloads) goes through the token-by-token reader.
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


_COMMENT = re.compile(r"/\*.*?\*/", re.S)
_NOT_PLAIN = re.compile(r"[^0-9eE.,+\-\s{}infaINFA]")


def _braces(text: str) -> tuple[int, int]:
    """(maximum nesting depth, final depth) of the '{' / '}' in ``text``; -1 if it dips below 0."""
    if text.count("{") + text.count("}") < 100_000:
        positions = [m.group() for m in _BRACE.finditer(text)]
        delta = np.array([1 if c == "{" else -1 for c in positions], np.int64)
    else:  # a literal with many rows: only the braces' bytes, never one per character
        codes = np.frombuffer(text.encode("latin-1", "replace"), np.uint8)
        braces = codes[(codes == ord("{")) | (codes == ord("}"))]
        delta = np.where(braces == ord("{"), 1, -1)
    if not delta.size:
        return 0, 0
    depth = np.cumsum(delta)
    if depth.min() < 0:
        return -1, int(depth[-1])
    return int(depth.max()), int(depth[-1])


_BRACE = re.compile(r"[{}]")


def _fast_values(text: str, shape: Shape, dtype: np.dtype | None) -> np.ndarray | None:
    """The flat values of a plain numeric literal (numpy's own number reader), or None when
    the literal is not plain (the token reader then handles it, with precise errors)."""
    text = _COMMENT.sub(" ", text) if "/*" in text else text
    if shape.is_tuple or "(" in text or _NOT_PLAIN.search(text):
        return None
    max_depth, final = _braces(text)
    if max_depth < 0 or final != 0:
        return None
    if shape.rank and max_depth not in (0, shape.rank):
        return None
    flat = text.translate(_NO_BRACES).strip()
    if not flat:
        return None
    kind = np.dtype(dtype).kind if dtype is not None else "f"
    if kind == "u" and np.dtype(dtype).itemsize == 8:
        return None  # above 2**63 numpy's int64 reader would saturate, not fail
    wide = np.int64 if kind in "iu" else np.float64
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a token numpy cannot read: it stops early, see below
        try:
            values = np.fromstring(flat, dtype=wide, sep=",")
        except ValueError:
            return None
    if values.size != flat.count(",") + 1:
        return None
    if values.size != shape.num_elements and not (values.size == 1 and max_depth == 0):
        return None
    return values


_NO_BRACES = str.maketrans("{}", "  ")


def check_literal(text: str, shape: Shape) -> None:
    """Raise ValueError (with a message) unless ``text`` is a valid literal of ``shape``."""
    if text.strip() == ELIDED or _fast_values(text, shape, None) is not None:
        return
    literal_elements(text, shape)


def literal_elements(text: str, shape: Shape) -> list[str] | None:
    """Flat element texts of a literal, checked against ``shape``; None if elided ``{...}``.

    Raises ValueError (with a message) when the literal is malformed or has the wrong size.
    """
    text = text.strip()
    if text == ELIDED:
        return None
    if "/*" in text:
        text = _COMMENT.sub(" ", text)
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
    # An empty array prints only the braces down to its first zero-sized dimension.
    if shape.rank and max_depth not in (0, shape.rank) and \
            not (expected == 0 and max_depth <= shape.rank and not values):
        raise ValueError(f"literal nests {max_depth} deep but the shape has rank {shape.rank}")
    if len(values) == 1 and max_depth == 0 and shape.is_array:
        return values  # a scalar for the whole shape: XLA broadcasts it
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
    kind = np.dtype(dtype).kind
    fast = _fast_values(text, shape, dtype) if kind in "iuf" or kind == "V" else None
    if fast is not None:
        flat = fast
    else:
        values = literal_elements(text, shape)
        if values is None:
            raise ValueError("the constant is elided ({...}); its values are not in the HLO text")
        parsed = [_scalar(v, kind) for v in values]
        # Build in a wide type, then cast (bf16/f8 come from ml_dtypes and take float input).
        wide = {"b": np.bool_, "c": np.complex128, "i": np.int64, "u": np.uint64}.get(kind, np.float64)
        flat = np.asarray(parsed, dtype=wide)
    if flat.size == 1 and shape.num_elements != 1:
        return np.full(shape.dims, flat.reshape(()), dtype=flat.dtype).astype(dtype)
    return flat.reshape(shape.dims).astype(dtype)
