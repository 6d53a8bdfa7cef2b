"""Comparing a stitched result with the stock one (verify, guard checks, tests)."""
from __future__ import annotations

import numpy as np


def poison_check(a: np.ndarray, b: np.ndarray, rtol: float) -> str | None:
    """None when ``a`` matches ``b`` (relative L2 error ≤ rtol, same NaN/inf positions),
    else what differs."""
    a = np.asarray(a)
    b = np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    if a.dtype.kind in "biu":
        bad = int(np.count_nonzero(a != b))
        return None if bad == 0 else f"{bad} of {a.size} elements differ"
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
