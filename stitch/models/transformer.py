"""Encoder-decoder Transformer (Vaswani et al.) training step, FusionStitching's workload.

Post-LN layers, ReLU FFN, sinusoidal positions, one embedding matrix shared by source,
target and the output projection (as in the paper), softmax cross-entropy on int labels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from . import blocks
from .bert import add_attention_params, add_encoder_params, add_ffn_params, encoder_layer
from .spec import CONFIGS, ArgTable, ModelInstance, ModelSpec, pick_config


@dataclass(frozen=True)
class TransformerSize:
    batch: int
    seq: int  # source and target length
    d_model: int
    heads: int
    ffn: int
    vocab: int
    enc_layers: int
    dec_layers: int


CONFIG_TABLE = {
    # 128 x 32 = 4096 tokens per step, the FusionStitching Table 1 "batch size 4096".
    "full": TransformerSize(128, 32, 512, 8, 2048, 32000, 2, 2),
    "tiny": TransformerSize(2, 8, 32, 4, 64, 64, 2, 2),
}


def _add_decoder_params(t: ArgTable, prefix: str, d: int, ffn: int) -> None:
    for attn in ("self", "cross"):
        add_attention_params(t, f"{prefix}{attn}_", d)
    t.norm(f"{prefix}ln1", d)
    t.norm(f"{prefix}ln2", d)
    add_ffn_params(t, prefix, d, ffn)
    t.norm(f"{prefix}ln3", d)


def _decoder_layer(
    y: jax.Array, memory: jax.Array, p: blocks.Params, prefix: str, heads: int
) -> jax.Array:
    causal = blocks.causal_bias(y.shape[1], y.dtype)
    a = blocks.multi_head_attention(y, y, p, f"{prefix}self", heads, causal)
    y = blocks.layer_norm(y + a, p[f"{prefix}ln1_gamma"], p[f"{prefix}ln1_beta"])
    c = blocks.multi_head_attention(y, memory, p, f"{prefix}cross", heads)
    y = blocks.layer_norm(y + c, p[f"{prefix}ln2_gamma"], p[f"{prefix}ln2_beta"])
    f = blocks.mlp(y, p, f"{prefix}ffn", 2, blocks.relu)
    return blocks.layer_norm(y + f, p[f"{prefix}ln3_gamma"], p[f"{prefix}ln3_beta"])


def _positions(length: int, d: int) -> jax.Array:
    """Sinusoidal position encodings [L, d], computed from iota rather than a literal."""
    pos = lax.broadcasted_iota(jnp.float32, (length, d // 2), 0)
    idx = lax.broadcasted_iota(jnp.float32, (length, d // 2), 1)
    angle = pos * jnp.exp(idx * (-2.0 * math.log(10000.0) / d))
    return jnp.concatenate([jnp.sin(angle), jnp.cos(angle)], axis=-1)


def _embed(ids: jax.Array, table: jax.Array) -> jax.Array:
    d = table.shape[1]
    looked_up = jnp.take(table, ids, axis=0) * math.sqrt(d)
    # Positions in the table's dtype: an f32 constant would widen bf16 activations.
    return looked_up + _positions(ids.shape[1], d).astype(table.dtype)


def train_parts(config: str) -> tuple[ArgTable, blocks.Loss]:
    """The training step's args and loss(params, data) (shared with the bf16 variant)."""
    s = pick_config("transformer_train", CONFIG_TABLE, config)
    t = ArgTable()
    t.ints("src_ids", (s.batch, s.seq), s.vocab)
    t.ints("tgt_in_ids", (s.batch, s.seq), s.vocab)
    t.ints("labels", (s.batch, s.seq), s.vocab)
    t.weight("embedding", (s.vocab, s.d_model), fan_in=s.d_model)
    for i in range(s.enc_layers):
        add_encoder_params(t, f"enc{i}_", s.d_model, s.ffn)
    for i in range(s.dec_layers):
        _add_decoder_params(t, f"dec{i}_", s.d_model, s.ffn)

    def loss(p, d):
        emb = p["embedding"]
        x = _embed(d["src_ids"], emb)
        for i in range(s.enc_layers):
            x = encoder_layer(x, p, f"enc{i}_", s.heads, None, blocks.relu)
        y = _embed(d["tgt_in_ids"], emb)
        for i in range(s.dec_layers):
            y = _decoder_layer(y, x, p, f"dec{i}_", s.heads)
        logits = jnp.einsum("bld,vd->blv", y, emb)  # tied output projection
        return blocks.cross_entropy(logits, d["labels"])

    return t, loss


def _build(config: str) -> ModelInstance:
    t, loss = train_parts(config)
    fn = blocks.sgd_step(loss, t.data_names, t.param_names)
    return t.instance("transformer_train", config, fn)


SPECS: tuple[ModelSpec, ...] = (
    ModelSpec(
        "transformer_train",
        "SGD step of an encoder-decoder Transformer: batch 128 x len 32 (4096 tokens, "
        "FusionStitching Table 1), d_model 512, 8 heads, FFN 2048, vocab 32000, 2 enc + 2 dec "
        "layers, tied embeddings, causal + cross attention, softmax cross-entropy",
        "training",
        CONFIGS,
        _build,
    ),
)
