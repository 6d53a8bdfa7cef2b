"""DIEN-like recommender (Zhou et al., "Deep Interest Evolution Network"), FusionStitching's
recommendation workload: embeddings -> GRU interest extractor -> target attention -> AUGRU
interest evolution -> Dice MLP 200-80-2. The auxiliary loss of the paper is omitted.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from . import blocks
from .spec import CONFIGS, ArgTable, ModelInstance, ModelSpec, pick_config


@dataclass(frozen=True)
class DienSize:
    batch: int
    history: int
    items: int
    cats: int
    embed: int  # per id; item+category concatenated is 2 * embed
    hidden: int  # GRU / AUGRU state
    mlp: tuple[int, ...]  # hidden widths; the output layer (2 classes) comes after


CONFIG_TABLE = {
    # Vocabulary sizes of the Amazon Books set in the DIEN paper; embedding 18, GRU 36.
    "full": DienSize(256, 50, 367982, 1600, 18, 36, (200, 80)),
    "tiny": DienSize(4, 5, 64, 16, 4, 8, (16, 8)),
}
NUM_CLASSES = 2


def _feature_dim(s: DienSize) -> int:
    # target, pooled history, their product (each 2 * embed) and the final AUGRU state.
    return 3 * 2 * s.embed + s.hidden


def _args(s: DienSize, with_labels: bool) -> ArgTable:
    t = ArgTable()
    t.ints("target_item", (s.batch,), s.items)
    t.ints("target_cat", (s.batch,), s.cats)
    t.ints("hist_items", (s.batch, s.history), s.items)
    t.ints("hist_cats", (s.batch, s.history), s.cats)
    # History length minus one: any value in [0, T) is a valid length of at least 1.
    t.ints("hist_len_m1", (s.batch,), s.history)
    if with_labels:
        t.ints("labels", (s.batch,), NUM_CLASSES)
    e2 = 2 * s.embed
    t.param("item_emb", (s.items, s.embed), 0.5)
    t.param("cat_emb", (s.cats, s.embed), 0.5)
    for prefix, width in (("gru", e2), ("augru", s.hidden)):
        t.weight(f"{prefix}_wx", (width, 3 * s.hidden))
        t.weight(f"{prefix}_wh", (s.hidden, 3 * s.hidden))
        t.bias(f"{prefix}_b", (3 * s.hidden,))
    t.weight("att_w", (s.hidden, e2))
    widths = (_feature_dim(s), *s.mlp, NUM_CLASSES)
    for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
        t.weight(f"mlp{i}_w", (fan_in, fan_out))
        t.bias(f"mlp{i}_b", (fan_out,))
        if i + 1 < len(widths) - 1:
            t.param(f"dice{i}_alpha", (fan_out,), 0.25)
    return t


def dice(x: jax.Array, alpha: jax.Array, eps: float = 1e-8) -> jax.Array:
    """Dice activation (DIN paper): a PReLU whose switch point follows batch statistics."""
    mean = jnp.mean(x, axis=0)
    var = jnp.mean(jnp.square(x - mean), axis=0)
    gate = jax.nn.sigmoid((x - mean) * lax.rsqrt(var + eps))
    return gate * x + (1.0 - gate) * alpha * x


def _logits(p: blocks.Params, d: dict[str, jax.Array], s: DienSize) -> jax.Array:
    def embed(items: jax.Array, cats: jax.Array) -> jax.Array:
        return jnp.concatenate(
            [jnp.take(p["item_emb"], items, axis=0), jnp.take(p["cat_emb"], cats, axis=0)], -1
        )

    target = embed(d["target_item"], d["target_cat"])  # [B, 2E]
    hist = embed(d["hist_items"], d["hist_cats"])  # [B, T, 2E]
    steps = lax.broadcasted_iota(jnp.int32, (s.batch, s.history), 1)
    # [B, T] in the embeddings' dtype: an f32 mask would widen bf16 activations.
    mask = (steps <= d["hist_len_m1"][:, None]).astype(p["item_emb"].dtype)

    # Interest extractor: GRU over the behaviour sequence (time-major for scan).
    states = blocks.gru_scan(hist.transpose(1, 0, 2), p, "gru", mask=mask.T)  # [T, B, H]

    # Target attention over the interest states, softmax over (valid) history steps.
    scores = jnp.einsum("tbh,he,be->bt", states, p["att_w"], target)
    scores = jnp.where(mask > 0, scores, blocks.MASK_NEG)
    att = blocks.softmax(scores, axis=-1)  # [B, T]

    # Interest evolution: AUGRU, attention scales the update gate; last state is the interest.
    evolved = blocks.gru_scan(states, p, "augru", gates=att.T, mask=mask.T)[-1]  # [B, H]

    pooled = jnp.sum(hist * mask[..., None], axis=1)
    x = jnp.concatenate([target, pooled, target * pooled, evolved], axis=-1)
    n_layers = len(s.mlp) + 1
    for i in range(n_layers):
        x = blocks.dense(x, p[f"mlp{i}_w"], p[f"mlp{i}_b"])
        if i + 1 < n_layers:
            x = dice(x, p[f"dice{i}_alpha"])
    return x


def _build_infer(config: str) -> ModelInstance:
    s = pick_config("dien_infer", CONFIG_TABLE, config)
    t = _args(s, with_labels=False)

    def fn(*args):
        a = t.bind(args)
        return blocks.softmax(_logits(a, a, s), axis=-1)

    return t.instance("dien_infer", config, fn)


def train_parts(config: str) -> tuple[ArgTable, blocks.Loss]:
    """The training step's args and loss(params, data) (shared with the bf16 variant)."""
    s = pick_config("dien_train", CONFIG_TABLE, config)
    t = _args(s, with_labels=True)

    def loss(p, d):
        return blocks.cross_entropy(_logits(p, d, s), d["labels"])

    return t, loss


def _build_train(config: str) -> ModelInstance:
    t, loss = train_parts(config)
    fn = blocks.sgd_step(loss, t.data_names, t.param_names)
    return t.instance("dien_train", config, fn)


_SHAPE = (
    "B=256, history 50, item/category embeddings 18 (vocab 367982/1600), GRU + attention + "
    "AUGRU (hidden 36) via lax.scan, Dice MLP 200-80-2 (FusionStitching Table 1)"
)

SPECS: tuple[ModelSpec, ...] = (
    ModelSpec(
        "dien_infer",
        f"DIEN inference, click probabilities [256,2]: {_SHAPE}",
        "inference",
        CONFIGS,
        _build_infer,
    ),
    ModelSpec(
        "dien_train",
        f"DIEN SGD step, softmax cross-entropy on int labels[256]: {_SHAPE}",
        "training",
        CONFIGS,
        _build_train,
    ),
)
