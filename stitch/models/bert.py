"""One BERT-base encoder layer (Devlin et al.), inference and an SGD training step.

Post-LN: x = LN(x + Attn(x)); x = LN(x + FFN(x)), GELU (erf) in the FFN, dropout omitted.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from . import blocks
from .spec import CONFIGS_WITH_MEDIUM, ArgTable, ModelInstance, ModelSpec, pick_config


@dataclass(frozen=True)
class BertSize:
    batch: int
    seq: int
    hidden: int
    heads: int
    ffn: int


CONFIG_TABLE = {
    "full": BertSize(batch=32, seq=128, hidden=768, heads=12, ffn=3072),
    "medium": BertSize(batch=8, seq=64, hidden=256, heads=4, ffn=1024),
    "tiny": BertSize(batch=2, seq=8, hidden=32, heads=4, ffn=64),
}


def add_attention_params(t: ArgTable, prefix: str, hidden: int) -> None:
    """Q/K/V/output projections of one attention block (weights then biases per blocks.ATTN_PARAMS)."""
    for name in blocks.ATTN_PARAMS:
        if name.startswith("w"):
            t.weight(f"{prefix}{name}", (hidden, hidden))
        else:
            t.bias(f"{prefix}{name}", (hidden,))


def add_ffn_params(t: ArgTable, prefix: str, hidden: int, ffn: int) -> None:
    t.weight(f"{prefix}ffn0_w", (hidden, ffn))
    t.bias(f"{prefix}ffn0_b", (ffn,))
    t.weight(f"{prefix}ffn1_w", (ffn, hidden))
    t.bias(f"{prefix}ffn1_b", (hidden,))


def add_encoder_params(t: ArgTable, prefix: str, hidden: int, ffn: int) -> None:
    """Parameters of one post-LN encoder layer (shared with the Transformer encoder)."""
    add_attention_params(t, f"{prefix}attn_", hidden)
    t.norm(f"{prefix}ln1", hidden)
    add_ffn_params(t, prefix, hidden, ffn)
    t.norm(f"{prefix}ln2", hidden)


def encoder_layer(
    x: jax.Array, p: blocks.Params, prefix: str, heads: int, bias: jax.Array | None, act
) -> jax.Array:
    attn = blocks.multi_head_attention(x, x, p, f"{prefix}attn", heads, bias)
    x = blocks.layer_norm(x + attn, p[f"{prefix}ln1_gamma"], p[f"{prefix}ln1_beta"])
    ffn = blocks.mlp(x, p, f"{prefix}ffn", 2, act)
    return blocks.layer_norm(x + ffn, p[f"{prefix}ln2_gamma"], p[f"{prefix}ln2_beta"])


def _args(s: BertSize, with_target: bool) -> ArgTable:
    t = ArgTable()
    t.data("x", (s.batch, s.seq, s.hidden))
    t.data("mask", (s.batch, s.seq))  # additive attention mask over keys
    if with_target:
        t.data("target", (s.batch, s.seq, s.hidden))
    add_encoder_params(t, "", s.hidden, s.ffn)
    return t


def _forward(p: blocks.Params, x: jax.Array, mask: jax.Array, heads: int) -> jax.Array:
    return encoder_layer(x, p, "", heads, blocks.padding_bias(mask), blocks.gelu_erf)


def _build_infer(config: str) -> ModelInstance:
    s = pick_config("bert_layer_infer", CONFIG_TABLE, config)
    t = _args(s, with_target=False)

    def fn(*args):
        a = t.bind(args)
        return _forward(a, a["x"], a["mask"], s.heads)

    return t.instance("bert_layer_infer", config, fn)


def train_parts(config: str) -> tuple[ArgTable, blocks.Loss]:
    """The training step's args and loss(params, data) (shared with the bf16 variant)."""
    s = pick_config("bert_layer_train", CONFIG_TABLE, config)
    t = _args(s, with_target=True)

    def loss(p, d):
        out = _forward(p, d["x"], d["mask"], s.heads)
        diff = out - d["target"]
        return (diff * diff).mean()

    return t, loss


def _build_train(config: str) -> ModelInstance:
    t, loss = train_parts(config)
    fn = blocks.sgd_step(loss, t.data_names, t.param_names)
    return t.instance("bert_layer_train", config, fn)


SPECS: tuple[ModelSpec, ...] = (
    ModelSpec(
        "bert_layer_infer",
        "one BERT-base encoder layer, x[32,128,768] + additive mask[32,128], 12 heads, "
        "FFN 3072, erf GELU, post-LN (FusionStitching Table 1, batch 32)",
        "inference",
        CONFIGS_WITH_MEDIUM,
        _build_infer,
    ),
    ModelSpec(
        "bert_layer_train",
        "SGD step (lr 0.01) of one BERT-base encoder layer, x/target[32,128,768], "
        "mask[32,128], MSE loss; returns (loss, *updated params) (FusionStitching Table 1)",
        "training",
        CONFIGS_WITH_MEDIUM,
        _build_train,
    ),
)
