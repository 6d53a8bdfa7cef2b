"""Comparisons of jax arrays measured where the arrays live: one host read for all of them.

The TF front end's first stitched call is checked against the stock step on every output
and every updated variable (``tf_frontend``). Reading each of those values into numpy costs
a host copy per value (hundreds for a keras_hub model: its weights and the optimizer's
slots, twice or three times over). Here each pair's ``verify.Difference`` (mismatching
elements of exact types; the finite masks' agreement and the float64 L2 norms of the
difference and of the reference for floats) is computed by jax on the arrays' device, the
figures of all pairs are stacked into one small float64 array, and that array is the only
value read to the host. ``verify.judge`` / ``verify.spread_verdict`` then apply the same
rules as the numpy checks (``first_mismatch``).
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Sequence

import numpy as np

from .verify import Difference, is_exact, judge, shape_problem, spread_verdict

log = logging.getLogger("stitch.tf")

# float64 columns per pair: mismatching elements (exact types), finite masks agree (1/0),
# ‖a − b‖ and ‖b‖ over b's finite elements (floats)
_BAD, _FINITE, _DIFF, _REF = range(4)


def _figures(a: Any, b: Any) -> Any:
    """One pair's four float64 figures (a jax vector on the pair's device)."""
    import jax.numpy as jnp

    if is_exact(np.dtype(a.dtype)):
        bad = jnp.count_nonzero(a != b).astype(jnp.float64)
        zero = jnp.zeros((), jnp.float64)
        return jnp.stack([bad, jnp.ones((), jnp.float64), zero, zero])
    a64 = jnp.ravel(a).astype(jnp.float64)
    b64 = jnp.ravel(b).astype(jnp.float64)
    finite = jnp.isfinite(b64)
    agree = jnp.all(finite == jnp.isfinite(a64)).astype(jnp.float64)
    d = jnp.where(finite, a64 - b64, 0.0)
    r = jnp.where(finite, b64, 0.0)
    zero = jnp.zeros((), jnp.float64)
    return jnp.stack([zero, agree, jnp.sqrt(jnp.sum(d * d)), jnp.sqrt(jnp.sum(r * r))])


@functools.cache
def _jitted_figures() -> Any:
    """``_figures`` compiled once per shape and dtype (a model has a few dozen)."""
    import jax
    return jax.jit(_figures)


def _on_device_of(a: Any, b: Any) -> Any:
    """``b`` on ``a``'s device (a copy only where they differ: TF on a GPU and the stitched
    program on the CPU, STITCH_DEVICE=cpu)."""
    import jax

    devices = a.devices()
    if b.devices() == devices:
        return b
    return jax.device_put(b, next(iter(devices)))


def differences(pairs: Sequence[tuple[Any, Any]]) -> list[Difference]:
    """``verify.Difference`` of each (result, reference) pair of jax arrays of one shape and
    dtype, computed on their device; the only host transfer is one array of 4 float64
    figures per pair. Shapes and dtypes are the caller's to check first (metadata)."""
    import jax
    import jax.numpy as jnp

    if not pairs:
        return []
    with jax.enable_x64(True):
        figures_of = _jitted_figures()
        rows = [figures_of(a, _on_device_of(a, b)) for a, b in pairs]
        device = next(iter(rows[0].devices()))
        stacked = jnp.stack([jax.device_put(r, device) for r in rows])
        figures = np.asarray(stacked)          # the one host read
    out = []
    for (a, _), row in zip(pairs, figures):
        size = int(np.prod(a.shape, dtype=np.int64))
        if is_exact(np.dtype(a.dtype)):
            out.append(Difference(bad=int(row[_BAD]), size=size))
        elif row[_FINITE] != 1.0:
            out.append(Difference(finite_match=False, size=size))
        else:
            out.append(Difference(diff=float(row[_DIFF]), ref=float(row[_REF]), size=size))
    log.debug("compared %d pairs on %s with one host read", len(pairs), device)
    return out


def first_mismatch(checks: Sequence[tuple[str, Any, Any, Any | None]],
                   rtol: float) -> str | None:
    """The first of ``checks`` — (what, stitched result, stock result, XLA's own compile's
    result or None), jax arrays — whose stitched result differs from the stock one, as
    "what: why"; None when all agree. A pair that fails ``verify.judge`` passes where
    ``verify.spread_verdict`` allows it against XLA's own compile. One host read when
    everything agrees, a second for the spread of those that did not."""
    whys: list[str | None] = []
    measured: list[int] = []
    pairs = []
    for i, (_, got, want, _) in enumerate(checks):
        problem = shape_problem(got.shape, got.dtype, want.shape, want.dtype)
        whys.append(problem)
        if problem is None:
            measured.append(i)
            pairs.append((got, want))
    for i, d in zip(measured, differences(pairs)):
        whys[i] = judge(d, checks[i][1].dtype, rtol)
    spread = [i for i in measured if whys[i] is not None and checks[i][3] is not None
              and shape_problem(checks[i][1].shape, checks[i][1].dtype, checks[i][3].shape,
                                checks[i][3].dtype) is None]
    pairs = [p for i in spread for p in ((checks[i][1], checks[i][3]),
                                          (checks[i][2], checks[i][3]))]
    found = differences(pairs)
    for k, i in enumerate(spread):
        whys[i] = spread_verdict(found[2 * k], found[2 * k + 1], checks[i][1].dtype, rtol)
    for (what, *_), why in zip(checks, whys):
        if why is not None:
            return f"{what}: {why}"
    return None
