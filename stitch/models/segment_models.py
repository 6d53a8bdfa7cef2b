"""Segmented reductions and scatters as users write them in jax: a GAT-style segmented
softmax, an embedding bag and a mixture-of-experts layer routed by top-k, in f32 and with bf16 data.

Every model reduces over sorted, fixed-length segments through ``jax.ops.segment_*`` with
``indices_are_sorted=True`` and ids built in the function (``arange(n) // length``), so the
segments follow from the module (``stitch.hlo.segments_as_rows`` turns those scatters into row
reductions). What is data stays data: an embedding bag's token ids index a gather whose
rows collide, and an MoE layer's top-k choices index its dispatch gather and its combine
scatter-add (colliding updates: atomics).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from .spec import CONFIGS, ArgTable, ModelInstance, ModelSpec, pick_config

LOW = jnp.bfloat16


@dataclass(frozen=True)
class Segments:
    segments: int
    length: int
    width: int = 1          # features per member (heads for the softmax)


def segment_ids(count: int, length: int) -> jax.Array:
    """Sorted ids of ``count`` segments of ``length`` members: 0,0,..,1,1,.."""
    return jnp.arange(count * length, dtype=jnp.int32) // length


def segment_softmax(scores: jax.Array, length: int, segments: int) -> jax.Array:
    """Softmax of ``scores`` [n, ...] within each segment of ``length`` consecutive rows
    (GAT's attention over a node's incoming edges, edges sorted by destination)."""
    ids = segment_ids(segments, length)
    peak = jax.ops.segment_max(scores, ids, num_segments=segments, indices_are_sorted=True)
    shifted = jnp.exp(scores - peak[ids])
    total = jax.ops.segment_sum(shifted, ids, num_segments=segments, indices_are_sorted=True)
    return shifted / total[ids]


def _dtype(low: bool):
    return LOW if low else jnp.float32


def _with_dtype(t: ArgTable, low: bool) -> ArgTable:
    """``t`` with its float data args in bf16 when ``low``."""
    if low:
        t.specs = [jax.ShapeDtypeStruct(s.shape, LOW)
                   if i < t.num_data and kind == "float" else s
                   for i, (s, kind) in enumerate(zip(t.specs, t.kinds))]
    return t


SOFTMAX_SIZES = {"full": Segments(10_000, 64, 4), "tiny": Segments(12, 8, 2)}


def _segment_softmax(name: str, low: bool, gradient: bool):
    def build(config: str) -> ModelInstance:
        s = pick_config(name, SOFTMAX_SIZES, config)
        n = s.segments * s.length
        t = ArgTable()
        t.data("scores", (n, s.width))
        if gradient:
            t.data("upstream", (n, s.width))

        def forward(scores):
            return segment_softmax(scores, s.length, s.segments)

        def backward(scores, upstream):
            _, vjp = jax.vjp(forward, scores)
            return vjp(upstream)[0]

        return _with_dtype(t, low).instance(name, config, backward if gradient else forward)

    return build


@dataclass(frozen=True)
class BagSize:
    bags: int
    per_bag: int
    vocab: int
    dim: int
    empty_bags: int         # trailing bags no token goes to (padding in a batch)


BAG_SIZES = {"full": BagSize(4096, 32, 100_000, 128, 0), "tiny": BagSize(6, 4, 10, 8, 2)}


def _embedding_bag(name: str, low: bool):
    def build(config: str) -> ModelInstance:
        s = pick_config(name, BAG_SIZES, config)
        n = s.bags * s.per_bag
        t = ArgTable()
        t.ints("tokens", (n,), s.vocab)
        t.weight("table", (s.vocab, s.dim), fan_in=s.dim)

        def fn(tokens, table):
            rows = table.astype(_dtype(low))[tokens]
            bags = segment_ids(s.bags, s.per_bag)
            return jax.ops.segment_sum(rows, bags, num_segments=s.bags + s.empty_bags,
                                       indices_are_sorted=True)

        return t.instance(name, config, fn)

    return build


@dataclass(frozen=True)
class MoeSize:
    tokens: int
    dim: int
    hidden: int
    experts: int
    capacity: int           # tokens each expert takes (top-k over the tokens)


MOE_SIZES = {"full": MoeSize(8192, 512, 1024, 8, 2048), "tiny": MoeSize(8, 8, 12, 4, 4)}


def moe_layer(x, router, w_in, w_out, capacity: int):
    """Expert-choice routing: each expert takes the ``capacity`` tokens it scores highest
    (top-k over tokens), gathers them (dispatch), runs its two-layer MLP, and the
    gate-weighted outputs are scatter-added back into their tokens' rows (combine, in f32:
    a token several experts chose collects several updates, one no expert chose none)."""
    probs = jax.nn.softmax((x @ router).astype(jnp.float32), axis=-1)   # [tokens, experts]
    gates, chosen = jax.lax.top_k(probs.T, capacity)                    # [experts, capacity]
    dispatched = x[chosen]                                              # [experts, cap, dim]
    hidden = jax.nn.gelu(jnp.einsum("ecd,edh->ech", dispatched, w_in))
    out = jnp.einsum("ech,ehd->ecd", hidden, w_out).astype(jnp.float32) * gates[..., None]
    combined = jnp.zeros((x.shape[0], x.shape[1]), jnp.float32)
    return combined.at[chosen.reshape(-1)].add(out.reshape(-1, x.shape[1]))


def _moe(name: str, low: bool):
    def build(config: str) -> ModelInstance:
        s = pick_config(name, MOE_SIZES, config)
        t = ArgTable()
        t.data("x", (s.tokens, s.dim))
        t.weight("router", (s.dim, s.experts))
        t.weight("w_in", (s.experts, s.dim, s.hidden), fan_in=s.dim)
        t.weight("w_out", (s.experts, s.hidden, s.dim), fan_in=s.hidden)

        def fn(x, router, w_in, w_out):
            dt = _dtype(low)
            return moe_layer(x, router.astype(dt), w_in.astype(dt), w_out.astype(dt),
                             s.capacity)

        return _with_dtype(t, low).instance(name, config, fn)

    return build


def _variants() -> tuple[ModelSpec, ...]:
    specs: list[ModelSpec] = []
    for low in (False, True):
        suffix = "_bf16" if low else ""
        data = "bf16" if low else "f32"
        specs += [
            ModelSpec(f"segment_softmax{suffix}",
                      f"GAT-style softmax within 10,000 sorted segments of 64 edges, 4 heads "
                      f"({data}; jax.ops.segment_max / segment_sum)", "inference", CONFIGS,
                      _segment_softmax(f"segment_softmax{suffix}", low, False)),
            ModelSpec(f"segment_softmax_grad{suffix}",
                      f"the segmented softmax's input gradient (vjp) at the same sizes ({data})",
                      "inference", CONFIGS,
                      _segment_softmax(f"segment_softmax_grad{suffix}", low, True)),
            ModelSpec(f"embedding_bag{suffix}",
                      f"embedding bag: 4096 bags of 32 token rows of a 100k x 128 table, "
                      f"segment_sum over sorted bag ids ({data} rows)", "inference", CONFIGS,
                      _embedding_bag(f"embedding_bag{suffix}", low)),
            ModelSpec(f"moe_layer{suffix}",
                      f"expert-choice MoE: 8 experts each take their top 2048 of 8192 tokens, "
                      f"MLP 512 -> 1024 -> 512; gather dispatch, f32 scatter-add combine "
                      f"({data})", "inference", CONFIGS,
                      _moe(f"moe_layer{suffix}", low)),
        ]
    return tuple(specs)


SPECS: tuple[ModelSpec, ...] = _variants()
