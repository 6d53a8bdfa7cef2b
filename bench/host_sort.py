"""XLA's own [64, 8732] sort modules (corpus 03878: a permutation sort, 03906: two stable
sorts) as stitch.compile's host program against XLA's CPU sort of the same computation in
jax, per call (median of ``ROUNDS`` after one warm call), results checked equal:
``python -m bench runtime --part host-sort``."""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

CORPUS = Path(__file__).resolve().parent.parent / "hlo_fixtures" / "data" / "corpus"
ROUNDS = 5
SHAPE = (64, 8732)


def _jax_reference(module: str):
    import jax
    import jax.numpy as jnp

    if module == "03906":
        return jax.jit(lambda a, b: (jnp.sort(a, axis=1) + jnp.sort(b, axis=1),))

    def permutation_sort(keys):
        iota = jnp.broadcast_to(jnp.arange(keys.shape[1], dtype=jnp.int32), keys.shape)
        _, perm = jax.lax.sort((keys, iota), num_keys=1)
        desc, payload = jax.lax.sort((-perm, iota), num_keys=1)
        return -desc, payload
    return jax.jit(permutation_sort)


def _median_s(fn, args) -> float:
    import jax
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rows() -> list[tuple[str, float, float, bool]]:
    """(module, stitch s, XLA s, equal) per module."""
    import stitch
    out = []
    rng = np.random.default_rng(0)
    for module, operands in (("03878", 1), ("03906", 2)):
        exe = stitch.compile(CORPUS.joinpath(f"{module}.hlo.txt").read_text(), "h100",
                             device="cpu")
        args = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(operands)]
        reference = _jax_reference(module)
        stitch_s, xla_s = _median_s(exe, args), _median_s(reference, args)
        equal = all(np.array_equal(np.asarray(a), np.asarray(b))
                    for a, b in zip(exe(*args), reference(*args)))
        out.append((module, stitch_s, xla_s, equal))
    return out


def run_part(ctx) -> list[str]:
    lines = ["stitch.compile(..., device=\"cpu\") runs a sort through the reference evaluator: "
             "a comparator that is one compare of a function of one operand (both modules') "
             "is numpy's stable argsort, any other the vectorised merge sort (which took "
             "31.7 s per call on 03906). XLA: the same computation in jax on XLA CPU. "
             f"Median of {ROUNDS} calls after a warm one.", "",
             "| module | stitch host (ms) | XLA CPU (ms) | stitch/XLA | equal |",
             "|---|---:|---:|---:|---|"]
    for module, stitch_s, xla_s, equal in rows():
        lines.append(f"| {module} | {stitch_s * 1e3:.1f} | {xla_s * 1e3:.1f} | "
                     f"{stitch_s / xla_s:.2f} | {'yes' if equal else 'NO'} |")
    return lines
