"""Segmented softmax, forward and gradient in one step, as jax writes it: the modeled
memory-intensive time of the XLA-like baseline and of stitch's plans.

    python -m bench plans --part segments      (or: python -m bench.plans.segments
                                               [--target h100] [--sizes 10000x64,50000x128])

The module is ``jax.vjp`` of a softmax within sorted segments (``jax.ops.segment_max`` /
``segment_sum`` with ``indices_are_sorted=True``, ids ``arange(n) // length``), lowered to
jax's pre-optimization HLO. Rows printed per size (times from the delta cost model, in µs,
memory-intensive kernels only; the latency-evaluator's sum over the tuned schedules where
every kernel has one):

- ``baseline``: ``stitch.hlo.base_fusion``'s XLA-GPU-like kernels of jax's module, scatters
  as atomic kernels of their own, priced with their atomics' contention
  (``stitch.cost.contention``: sorted segments of L give L collisions per address);
- ``stitch, scatters kept``: stitch's plan with ``segments_as_rows=False`` (the atomics
  stay, and end their kernels);
- ``stitch, segments as rows``: the default plan (``stitch.hlo.segments_as_rows``: the scatters are
  row reductions, the gathers broadcasts).

What it is not: XLA's own optimized module (a deviceless XLA GPU compile needs jax's CUDA
plugin; with it, ``scripts/gen_fixtures.py`` writes one) nor the XLA pass's delivered
module, and no measured GPU time.
"""
from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

DEFAULT_SIZES = ((10_000, 64), (50_000, 128))


def segmented_softmax_step_hlo(segments: int, length: int) -> str:
    """jax's pre-optimization HLO of (softmax, its input gradient) for one f32 score per
    member of ``segments`` sorted segments of ``length``."""
    import jax
    import jax.numpy as jnp

    from stitch.models.segment_models import segment_softmax

    n = segments * length

    def step(scores, upstream):
        probs, vjp = jax.vjp(lambda s: segment_softmax(s, length, segments), scores)
        return probs, vjp(upstream)[0]

    spec = jax.ShapeDtypeStruct((n,), jnp.float32)
    return jax.jit(step).lower(spec, spec).as_text(dialect="hlo")


@dataclass(frozen=True)
class Side:
    """One plan side: memory-intensive kernels, their HBM bytes, delta-modeled µs, the
    contention share of it, and the latency-evaluator's µs (None where a kernel has no
    schedule)."""
    label: str
    kernels: int
    hbm_bytes: int
    modeled_us: float
    contention_us: float
    latency_us: float | None


def _side(label: str, results, which: str) -> Side:
    from stitch.explorer.graph_plan import memory_intensive

    kernels = hbm = 0
    seconds = contention = latency = 0.0
    scheduled = True
    for g in results:
        side = getattr(g, which)
        for k in side.kernels:
            if not memory_intensive(k.kind, k.cost):
                continue
            kernels += 1
            hbm += k.cost.hbm_bytes
            seconds += k.cost.total_s
            contention += k.cost.contention_s
            if which == "stitched" and k.schedule is not None:
                latency += k.schedule.modeled_us * 1e-6
            else:
                scheduled = False
    return Side(label, kernels, hbm, seconds * 1e6, contention * 1e6,
                latency * 1e6 if scheduled else None)


def measure(segments: int, length: int, target: str = "h100") -> list[Side]:
    """The three sides (module docstring) for one size."""
    import stitch
    from stitch.hlo import parse_hlo
    from stitch.explorer.planner import ExplorerOptions

    module = parse_hlo(segmented_softmax_step_hlo(segments, length))
    start = time.perf_counter()
    kept = stitch.plan(module, target, options=ExplorerOptions(segments_as_rows=False))
    rows = stitch.plan(module, target)
    log.info("planned %dx%d twice in %.1f s", segments, length, time.perf_counter() - start)
    return [_side("baseline (XLA-like, atomics)", kept.graphs, "baseline"),
            _side("stitch, scatters kept", kept.graphs, "stitched"),
            _side("stitch, segments as rows", rows.graphs, "stitched")]


def render(results: dict[tuple[int, int], list[Side]], target: str) -> str:
    """A markdown table: per size and side, kernels, MB, modeled µs (atomics' share), the
    latency-evaluator's µs where every kernel has a schedule, and the speed-up."""
    lines = [f"Segmented softmax forward + gradient (jax's HLO, f32), {target}: memory-intensive "
             "kernels; **counted** kernels and MB, **modeled** µs (delta cost model, atomics' "
             "contention included; latency-evaluator beside it). Baseline: XLA-GPU-like base "
             "fusion of jax's module with atomic scatter kernels (not XLA's own optimized "
             "module).", "",
             "| size | side | kernels | MB | µs | of which atomics µs | latency-evaluator µs "
             "| vs baseline |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for (segments, length), sides in results.items():
        base = sides[0].modeled_us
        for side in sides:
            sched = f"{side.latency_us:.1f}" if side.latency_us is not None else "–"
            lines.append(f"| {segments}×{length} | {side.label} | {side.kernels} | "
                         f"{side.hbm_bytes / 1e6:.2f} | {side.modeled_us:.1f} | "
                         f"{side.contention_us:.1f} | {sched} | "
                         f"{base / side.modeled_us:.2f}× |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="h100")
    parser.add_argument("--sizes", default=",".join(f"{s}x{l}" for s, l in DEFAULT_SIZES),
                        help="segments x length, comma separated")
    args = parser.parse_args()
    sizes = [tuple(int(p) for p in item.split("x")) for item in args.sizes.split(",")]
    results = {(s, l): measure(s, l, args.target) for s, l in sizes}
    print(render(results, args.target))


if __name__ == "__main__":
    main()
