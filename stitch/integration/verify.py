"""Comparing a stitched result with the stock one (verify, guard checks, tests)."""
from __future__ import annotations

import numpy as np


# The least relative L2 error a comparison of narrow floats allows, whatever rtol asks: two
# correct programs that round an output to the type differ by up to one unit in the last
# place (2x the type's machine epsilon leaves room for a rounding upstream too).
NARROW_FLOAT_RTOL = {"bfloat16": 2 * 2.0 ** -7, "float16": 2 * 2.0 ** -10}


def poison_check(a: np.ndarray, b: np.ndarray, rtol: float) -> str | None:
    """None when ``a`` matches ``b`` (relative L2 error ≤ rtol — at least
    ``NARROW_FLOAT_RTOL`` for bf16/f16 —, same NaN/inf positions), else what differs."""
    a = np.asarray(a)
    b = np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    if a.dtype.kind in "biu":
        bad = int(np.count_nonzero(a != b))
        return None if bad == 0 else f"{bad} of {a.size} elements differ"
    rtol = max(rtol, NARROW_FLOAT_RTOL.get(a.dtype.name, 0.0))
    a64 = a.astype(np.float64)
    b64 = b.astype(np.float64)
    finite = np.isfinite(b64)
    if not np.array_equal(finite, np.isfinite(a64)):
        return "non-finite values at different positions"
    diff = np.linalg.norm(a64[finite] - b64[finite])
    ref = np.linalg.norm(b64[finite])
    err = diff / ref if ref > 0 else diff
    return None if err <= rtol else f"relative error {err:.3g} > {rtol:g}"


def compare_trees(got: object, want: object, rtol: float) -> str | None:
    """None when every leaf of the pytree ``got`` matches ``want``'s (poison_check at
    ``rtol``), else which output differs and how."""
    import jax

    got_leaves, want_leaves = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    if len(got_leaves) != len(want_leaves):
        return f"{len(got_leaves)} outputs, expected {len(want_leaves)}"
    for i, (a, b) in enumerate(zip(got_leaves, want_leaves)):
        why = poison_check(np.asarray(a), np.asarray(b), rtol)
        if why is not None:
            return f"output {i}: {why}"
    return None


def spread_check(stitched: np.ndarray, plain: np.ndarray, stock: np.ndarray,
                 rtol: float) -> str | None:
    """None when the stitched result is as close to XLA's own compile of the same module
    (``plain``) as two correct compilers are to each other. ``stock`` is the result of the
    other program (TF's: its own kernels or its XLA): an output that is rounding noise (a
    gradient that is zero in exact arithmetic, e.g. an attention key bias) or that depends on
    how random numbers are drawn (TF's kernels and XLA draw other dropout masks) differs
    between them, and
    the stitched result may differ from ``plain`` up to twice that spread; anything else must
    match ``plain`` at ``rtol``."""
    why = poison_check(stitched, plain, rtol)
    if why is None:
        return None
    if poison_check(stock, plain, rtol) is None or stitched.dtype.kind not in "fc":
        return why  # the compilers agree, or exact types: no spread to allow
    s, p, t = (np.asarray(x, np.float64) for x in (stitched, plain, stock))
    finite = np.isfinite(p)
    if not (np.array_equal(finite, np.isfinite(s)) and np.array_equal(finite, np.isfinite(t))):
        return "non-finite values at different positions"
    spread = np.linalg.norm(t[finite] - p[finite])
    diff = np.linalg.norm(s[finite] - p[finite])
    if diff <= 2.0 * spread:
        return None
    return f"{why}; XLA's own compile differs from TF by {spread:.3g}, stitched by {diff:.3g}"
