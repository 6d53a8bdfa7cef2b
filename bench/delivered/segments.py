"""Segmented reductions through stitch's pass: XLA's module against the module the pass
returns (counted kernels and bytes, modeled µs; deviceless H100 compiles).

``python -m bench.delivered.segments [--cases NAME,...] [--out docs/benchmarks.md]``

The softmax within sorted fixed-length segments (GAT's attention over a node's incoming
edges; the pattern of jax-ml/jax#37511), written as users write it
(``stitch.models.segment_models.segment_softmax``: ``jax.ops.segment_max`` / ``segment_sum``
with ``indices_are_sorted=True``), compiled for an H100 without a device (jax's CUDA
plugin in ``STITCH_CUDA_VENV``), each case in a fresh child process with an empty
compile cache. XLA keeps every segment reduction as an atomic scatter kernel; the pass
plans from XLA's module with the proved segments as rows (``STITCH_SEGMENT_ROWS``). Both
sides are priced by the delta cost model with the atomics' contention
(``stitch.cost.contention``). The zoo's embedding bag and mixture-of-experts layer
(``stitch.models.segment_models``, full size) go through the same pass.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path


SECTION = "bench-delivered-segments"
MARK = "SEGMENTS "

# jax-ml/jax#37511 (A100, 10,000 segments of 64-256 members, forward): that report's own
# measurements, quoted as the anchor (another GPU, their timing method).
ANCHOR = "JAX 0.288–0.869 ms, one Triton kernel 0.032–0.035 ms (A100, 10k segments of 64–256)"


@dataclass(frozen=True)
class Case:
    segments: int
    length: int
    heads: int
    dtype: str          # "f32" | "bf16"
    gradient: bool      # forward + input gradient (vjp), else forward only

    @property
    def name(self) -> str:
        size = f"{self.segments}x{self.length}" + (f"x{self.heads}" if self.heads > 1 else "")
        return f"{size} {self.dtype} {'fwd+grad' if self.gradient else 'fwd'}"


CASES = tuple(Case(s, n, 1, dtype, gradient)
              for s, n in ((10_000, 64), (50_000, 128))
              for dtype in ("f32", "bf16") for gradient in (False, True)) + (
    Case(10_000, 64, 4, "f32", True),)          # the zoo's segment_softmax_grad
QUICK = (Case(10_000, 64, 1, "f32", True),)
MODELS = ("embedding_bag", "embedding_bag_bf16", "moe_layer", "moe_layer_bf16")
# Sorted ids that are data (any segment sizes: scatter-adds added in runs,
# stitch.hlo.sorted_runs): the zoo's bag sizes with the bag ids an input, and a
# GAT layer over a graph of variable in-degrees (edges sorted by destination).
VARIABLE_BAGS = ("variable bags", "variable bags bf16", "GAT layer with variable degrees")
# The MoE layer's training step (loss, gradients of the weights and the input, SGD update):
# the forward combine and the dispatch gather's gradient are both scatters over each
# expert's distinct top-k tokens (column tiles, stitch.hlo.grouped_scatter).
TRAIN_STEPS = ("moe_layer train step", "moe_layer_bf16 train step")
# Cases named by a string (their own table); the softmax cases are ``Case``s.
NAMED = MODELS + VARIABLE_BAGS + TRAIN_STEPS
EVERY_CASE = CASES + NAMED


def _case(name: str) -> Case | str:
    for case in CASES:
        if case.name == name:
            return case
    if name in NAMED:
        return name
    raise SystemExit(f"unknown case {name!r}: choose from "
                     f"{', '.join([c.name for c in CASES] + list(NAMED))}")


def _model_lowered(name: str, mesh):
    """jax's lowering of zoo model ``name`` (full size) for ``mesh``'s one device."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from stitch import models
    inst = models.build(name, "full")
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, PartitionSpec()))
             for a in inst.arg_specs]
    return jax.jit(inst.fn).lower(*specs)


def gat_layer_lowered(mesh, nodes: int = 10_000, edges: int = 320_000, features: int = 64,
                 heads: int = 4):
    """One GAT layer as GNN code writes it: attention logits per edge, a softmax over each
    node's incoming edges (segment_max / segment_sum over the sorted destination ids, data)
    and the weighted sum of the source features."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    def gat(x, w, a_src, a_dst, src, dst):
        h = (x @ w).reshape(nodes, heads, features // heads)
        logits = jax.nn.leaky_relu((h * a_src).sum(-1)[src] + (h * a_dst).sum(-1)[dst], 0.2)
        peak = jax.ops.segment_max(logits, dst, num_segments=nodes, indices_are_sorted=True)
        weights = jnp.exp(logits - peak[dst])
        total = jax.ops.segment_sum(weights, dst, num_segments=nodes, indices_are_sorted=True)
        alpha = weights / total[dst]
        out = jax.ops.segment_sum(alpha[..., None] * h[src], dst, num_segments=nodes,
                                  indices_are_sorted=True)
        return out.reshape(nodes, features)
    sharding = NamedSharding(mesh, PartitionSpec())

    def spec(shape, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    return jax.jit(gat).lower(spec((nodes, features)), spec((features, features)),
                              spec((heads, features // heads)), spec((heads, features // heads)),
                              spec((edges,), jnp.int32), spec((edges,), jnp.int32))


def moe_train_lowered(name: str, mesh):
    """One SGD step of the zoo's MoE layer (full size): the mean square of its output as
    the loss, gradients of the router, the experts' weights and the input."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from stitch.models.segment_models import MOE_SIZES, moe_layer
    size = MOE_SIZES["full"]
    dtype = jnp.bfloat16 if "bf16" in name else jnp.float32

    def loss(params, x):
        router, w_in, w_out = params
        y = moe_layer(x, router.astype(dtype), w_in.astype(dtype), w_out.astype(dtype),
                      size.capacity)
        return jnp.mean(y * y)

    def step(params, x):
        value, (grads, dx) = jax.value_and_grad(loss, argnums=(0, 1))(params, x)
        return value, jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), dx
    sharding = NamedSharding(mesh, PartitionSpec())

    def spec(shape, dt=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
    params = (spec((size.dim, size.experts)), spec((size.experts, size.dim, size.hidden)),
              spec((size.experts, size.hidden, size.dim)))
    return jax.jit(step).lower(params, spec((size.tokens, size.dim), dtype))


def _variable_bags_lowered(name: str, mesh):
    """An embedding bag of the zoo's full size whose sorted bag ids are an input."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from stitch.models.segment_models import BAG_SIZES
    size = BAG_SIZES["full"]
    dtype = jnp.bfloat16 if name.endswith("bf16") else jnp.float32

    def variable_bags(tokens, bag_ids, table):
        return jax.ops.segment_sum(table.astype(dtype)[tokens], bag_ids,
                                   num_segments=size.bags, indices_are_sorted=True)
    sharding = NamedSharding(mesh, PartitionSpec())
    n = size.bags * size.per_bag
    specs = [jax.ShapeDtypeStruct((n,), jnp.int32, sharding=sharding),
             jax.ShapeDtypeStruct((n,), jnp.int32, sharding=sharding),
             jax.ShapeDtypeStruct((size.vocab, size.dim), jnp.float32, sharding=sharding)]
    return jax.jit(variable_bags).lower(*specs)


def measure_one(case: Case | str) -> dict:
    """In the deviceless venv: the pass's report on one case (or zoo model)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    from stitch.xla_pass import deviceless
    from stitch.models.segment_models import segment_softmax

    deviceless.check_environment()
    mesh = topologies.make_mesh(deviceless.topology("h100", "1x1x1"), (1,), ("d",))
    if isinstance(case, str):
        if case.startswith("GAT"):
            lowered = gat_layer_lowered(mesh)
        elif case in VARIABLE_BAGS:
            lowered = _variable_bags_lowered(case, mesh)
        elif case in TRAIN_STEPS:
            lowered = moe_train_lowered(case, mesh)
        else:
            lowered = _model_lowered(case, mesh)
        report = deviceless.compile_with_pass(lowered, case, "h100").report
        return {"case": case, **report.summary(),
                "segment_rows": len(report.segment_rows), "skipped": report.skipped[:3]}
    dtype = jnp.bfloat16 if case.dtype == "bf16" else jnp.float32
    spec = jax.ShapeDtypeStruct((case.segments * case.length, case.heads), dtype,
                                sharding=NamedSharding(mesh, PartitionSpec()))

    def forward(scores):
        return segment_softmax(scores, case.length, case.segments)

    if case.gradient:
        def step(scores, upstream):
            _, vjp = jax.vjp(forward, scores)
            return vjp(upstream)[0]
        lowered = jax.jit(step).lower(spec, spec)
    else:
        lowered = jax.jit(forward).lower(spec)
    report = deviceless.compile_with_pass(lowered, "segment_softmax", "h100").report
    return {"case": case.name, **report.summary(),
            "segment_rows": len(report.segment_rows), "skipped": report.skipped[:3]}


def collect(cases: list[Case | str], timeout: float = 900.0) -> list[dict]:
    from bench.delivered.children import run_one
    return [run_one("bench.delivered.segments", case if isinstance(case, str) else case.name,
                    MARK, "case", timeout) for case in cases]


HEADER = ["| case | XLA kernels | delivered kernels | stitched | XLA MB | delivered MB | "
          "XLA µs | delivered µs | faster |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]


def _table(rows: list[dict]) -> list[str]:
    lines = list(HEADER)
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['error']} ||||||||")
            continue
        lines.append(
            f"| {r['case']} | {r['kernels_before']} | {r['kernels_after']} | "
            f"{r['stitched_kernels']} | {r['xla_mem_bytes'] / 1e6:.1f} | "
            f"{r['delivered_mem_bytes'] / 1e6:.1f} | {r['xla_mem_us']:.1f} | "
            f"{r['delivered_mem_us']:.1f} | {r['xla_mem_us'] / r['delivered_mem_us']:.1f}× |")
    return lines


def markdown(rows: list[dict], command: str) -> str:
    from bench.report import stamp
    softmax = [r for r in rows if r["case"] not in NAMED]
    others = [r for r in rows if r["case"] in NAMED]
    lines = ["## Segmented reductions through the pass (counted and modeled)", "",
             stamp(command, os.getloadavg()), "",
             "Compiled for an H100 without a device with stitch's pass on. *XLA*: XLA's own "
             "optimized module (each segment reduction an atomic scatter kernel), priced "
             "with its atomics' contention; *delivered*: the module the pass returns. "
             "Memory-intensive kernels only: **counted** kernels and MB, **modeled** µs "
             "(delta cost model). *stitched*: stitch kernels in the returned module. No GPU "
             "time here.", ""]
    if softmax:
        lines += ["jax's segmented softmax (`jax.ops.segment_max` / `segment_sum`, sorted ids "
                  "`arange(n) // length`, one score per member unless ×heads). Anchor, "
                  f"measured elsewhere: {ANCHOR}.", "", *_table(softmax), "",
                  "XLA's bf16 figures are mostly the contention term of its `segment_max`: "
                  "bf16 max has no native atomic in the model (stitch.cost.contention), so "
                  "each address's `length` updates retry a compare-and-swap loop, one winner "
                  "a round. That term is an assumption from microbenchmark papers, not a "
                  "measurement: the GPU kit times it.", ""]
    if others:
        lines += ["The zoo's embedding bag (4096 bags of 32 rows of a 100k × 128 table: XLA "
                  "fuses the row gather into its atomic scatter) and expert-choice MoE layer "
                  "(its combine scatters to data-dependent tokens, each expert's distinct: "
                  "stitch generates it without atomics in column tiles, "
                  "stitch.hlo.grouped_scatter, XLA atomically), full size; "
                  "*variable bags*: the same bag sum with the sorted bag ids an input "
                  "(any bag sizes), which stitch adds in runs of equal ids before its atomics "
                  "(stitch.hlo.sorted_runs) while XLA adds every element atomically; "
                  "*GAT layer*: 10k nodes, 320k edges sorted by destination (variable "
                  "in-degrees, ids an input), 4 heads of 16: its segment sums and its "
                  "segment_max go in runs (a run's maximum by a compare-and-swap loop); "
                  "*train step*: one SGD step of the "
                  "MoE layer (gradients of the weights and the input: the dispatch gather's "
                  "gradient is a second scatter over each expert's distinct tokens).",
                  "", *_table(others)]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.delivered.segments",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--quick", action="store_true", help="one case")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(MARK + json.dumps(measure_one(_case(args.one))), flush=True)
        return
    cases = [_case(n) for n in args.cases.split(",")] if args.cases else \
        list(QUICK if args.quick else EVERY_CASE)
    text = markdown(collect(cases), "python -m bench delivered --part segments")
    if args.out:
        from bench.report import write_section
        write_section(args.out, SECTION, text)
    else:
        print(text)


if __name__ == "__main__":
    main()
