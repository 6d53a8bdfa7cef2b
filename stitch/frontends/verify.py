"""Comparing a stitched result with the stock one (verify, guard checks, tests)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


# The least relative L2 error a comparison of narrow floats allows, whatever rtol asks: two
# correct programs that round an output to the type differ by up to one unit in the last
# place (2x the type's machine epsilon leaves room for a rounding upstream too).
NARROW_FLOAT_RTOL = {"bfloat16": 2 * 2.0 ** -7, "float16": 2 * 2.0 ** -10}


@dataclass(frozen=True)
class Difference:
    """What one comparison of a result ``a`` with a reference ``b`` (same shape and dtype)
    measured, wherever it was computed (numpy here, jax on the values' device in
    ``device_compare``); ``judge`` turns it into a verdict. Exact types (bool, integers):
    ``bad`` elements differ. Floats, in float64: ``finite_match`` (NaN/inf at the same
    positions), ``diff`` = ‖a − b‖₂ and ``ref`` = ‖b‖₂ over b's finite elements."""
    bad: int = 0
    finite_match: bool = True
    diff: float = 0.0
    ref: float = 0.0
    size: int = 0


def shape_problem(a_shape: tuple, a_dtype: np.dtype, b_shape: tuple, b_dtype: np.dtype
                  ) -> str | None:
    """Why two values cannot be compared element by element (None: they can)."""
    a_shape, b_shape = tuple(a_shape), tuple(b_shape)
    if a_shape != b_shape or np.dtype(a_dtype) != np.dtype(b_dtype):
        return (f"shape/dtype {np.dtype(a_dtype)}{list(a_shape)} vs "
                f"{np.dtype(b_dtype)}{list(b_shape)}")
    return None


def is_exact(dtype: np.dtype) -> bool:
    """Compared element by element, not by relative L2 error."""
    return np.dtype(dtype).kind in "biu"


def measure(a: np.ndarray, b: np.ndarray) -> Difference:
    """``Difference`` of two numpy arrays of one shape and dtype."""
    if is_exact(a.dtype):
        return Difference(bad=int(np.count_nonzero(a != b)), size=a.size)
    a64 = a.astype(np.float64)
    b64 = b.astype(np.float64)
    finite = np.isfinite(b64)
    if not np.array_equal(finite, np.isfinite(a64)):
        return Difference(finite_match=False, size=a.size)
    return Difference(diff=float(np.linalg.norm(a64[finite] - b64[finite])),
                      ref=float(np.linalg.norm(b64[finite])), size=a.size)


def judge(d: Difference, dtype: np.dtype, rtol: float) -> str | None:
    """None when the measured values match (relative L2 error ≤ rtol — at least
    ``NARROW_FLOAT_RTOL`` for bf16/f16 —, same NaN/inf positions), else what differs."""
    dtype = np.dtype(dtype)
    if is_exact(dtype):
        return None if d.bad == 0 else f"{d.bad} of {d.size} elements differ"
    if not d.finite_match:
        return "non-finite values at different positions"
    rtol = max(rtol, NARROW_FLOAT_RTOL.get(dtype.name, 0.0))
    err = d.diff / d.ref if d.ref > 0 else d.diff
    return None if err <= rtol else f"relative error {err:.3g} > {rtol:g}"


def poison_check(a: np.ndarray, b: np.ndarray, rtol: float) -> str | None:
    """None when ``a`` matches ``b`` (relative L2 error ≤ rtol — at least
    ``NARROW_FLOAT_RTOL`` for bf16/f16 —, same NaN/inf positions), else what differs."""
    a = np.asarray(a)
    b = np.asarray(b)
    problem = shape_problem(a.shape, a.dtype, b.shape, b.dtype)
    if problem is not None:
        return problem
    return judge(measure(a, b), a.dtype, rtol)


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
    stitched, plain, stock = (np.asarray(x) for x in (stitched, plain, stock))
    problem = shape_problem(stitched.shape, stitched.dtype, plain.shape, plain.dtype)
    if problem is not None:
        return problem
    ours = measure(stitched, plain)
    if shape_problem(stock.shape, stock.dtype, plain.shape, plain.dtype) is not None:
        return judge(ours, plain.dtype, rtol)    # no spread to allow
    return spread_verdict(ours, measure(stock, plain), plain.dtype, rtol)


def spread_verdict(stitched_vs_plain: Difference, stock_vs_plain: Difference,
                   dtype: np.dtype, rtol: float) -> str | None:
    """``spread_check``'s rule on measured differences (stitched and stock, each against
    ``plain``)."""
    why = judge(stitched_vs_plain, dtype, rtol)
    if why is None:
        return None
    if judge(stock_vs_plain, dtype, rtol) is None or np.dtype(dtype).kind not in "fc":
        return why  # the compilers agree, or exact types: no spread to allow
    if not (stitched_vs_plain.finite_match and stock_vs_plain.finite_match):
        return "non-finite values at different positions"
    spread, diff = stock_vs_plain.diff, stitched_vs_plain.diff
    if diff <= 2.0 * spread:
        return None
    return f"{why}; XLA's own compile differs from TF by {spread:.3g}, stitched by {diff:.3g}"
