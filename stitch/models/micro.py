"""Single-pattern micro models (memory-intensive subgraphs from the FusionStitching study)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp

from . import blocks
from .spec import CONFIGS, ArgTable, ModelInstance, ModelSpec, pick_config


@dataclass(frozen=True)
class RowsCols:
    rows: int
    cols: int


def _layer_norm(config: str) -> ModelInstance:
    s = pick_config("layer_norm", {"full": RowsCols(4096, 768), "tiny": RowsCols(16, 32)}, config)
    t = ArgTable()
    t.data("x", (s.rows, s.cols))
    t.norm("ln", s.cols)

    def fn(x, gamma, beta):
        return blocks.layer_norm(x, gamma, beta, axis=-1, eps=1e-5)

    return t.instance("layer_norm", config, fn)


def _softmax(config: str) -> ModelInstance:
    shape = pick_config("softmax", {"full": (32, 12, 128, 128), "tiny": (2, 2, 8, 8)}, config)
    t = ArgTable()
    t.data("x", shape)

    def fn(x):
        return blocks.softmax(x, axis=-1)

    return t.instance("softmax", config, fn)


def _bias_gelu_builder(name: str, gelu: Callable[[jax.Array], jax.Array]):
    def build(config: str) -> ModelInstance:
        s = pick_config(name, {"full": RowsCols(4096, 3072), "tiny": RowsCols(16, 64)}, config)
        t = ArgTable()
        t.data("x", (s.rows, s.cols))
        t.bias("bias", (s.cols,))

        def fn(x, bias):
            return gelu(x + bias)

        return t.instance(name, config, fn)

    return build


@dataclass(frozen=True)
class XentSize:
    tokens: int
    vocab: int


_XENT = {"full": XentSize(4096, 32000), "tiny": XentSize(16, 64)}


def xent_args(name: str, config: str) -> ArgTable:
    s = pick_config(name, _XENT, config)
    t = ArgTable()
    t.data("logits", (s.tokens, s.vocab), scale=2.0)  # wider logits: a less flat softmax
    t.ints("labels", (s.tokens,), s.vocab)
    return t


def _log_softmax_xent(config: str) -> ModelInstance:
    t = xent_args("log_softmax_xent", config)
    return t.instance("log_softmax_xent", config, blocks.cross_entropy)


def _log_softmax_xent_train(config: str) -> ModelInstance:
    t = xent_args("log_softmax_xent_train", config)

    def fn(logits, labels):
        # The backward of the loss w.r.t. the logits: softmax - one_hot, scaled by 1/N.
        return jax.value_and_grad(blocks.cross_entropy)(logits, labels)

    return t.instance("log_softmax_xent_train", config, fn)


def _layer_norm_nonminor(config: str) -> ModelInstance:
    b, c, tt = pick_config(
        "layer_norm_nonminor", {"full": (32, 768, 128), "tiny": (2, 16, 8)}, config
    )
    t = ArgTable()
    t.data("x", (b, c, tt))
    t.norm("ln", c)

    def fn(x, gamma, beta):
        return blocks.layer_norm(x, gamma, beta, axis=1, eps=1e-5)

    return t.instance("layer_norm_nonminor", config, fn)


def _column_reduce_broadcast(config: str) -> ModelInstance:
    s = pick_config(
        "column_reduce_broadcast", {"full": RowsCols(4096, 768), "tiny": RowsCols(16, 32)}, config
    )
    t = ArgTable()
    t.data("x", (s.rows, s.cols))
    t.param("scale", (s.cols,), 0.5)

    def fn(x, scale):
        # Batch-norm statistics: two column reductions, each consumed by a row broadcast.
        mean = jnp.mean(x, axis=0)
        centered = x - mean
        var = jnp.mean(centered * centered, axis=0)
        return centered * jax.lax.rsqrt(var + 1e-5) * scale

    return t.instance("column_reduce_broadcast", config, fn)


SPECS: tuple[ModelSpec, ...] = (
    ModelSpec(
        "layer_norm",
        "LayerNorm over the last axis of x[4096,768] with gamma/beta[768], eps 1e-5 "
        "(BERT-base hidden size, FusionStitching §2 pattern)",
        "inference",
        CONFIGS,
        _layer_norm,
    ),
    ModelSpec(
        "softmax",
        "softmax over the last axis of x[32,12,128,128] (BERT-base attention scores, "
        "batch 32, FusionStitching)",
        "inference",
        CONFIGS,
        _softmax,
    ),
    ModelSpec(
        "bias_gelu",
        "x[4096,3072] + bias[3072] then exact erf GELU (BERT-base FFN, FusionStitching)",
        "inference",
        CONFIGS,
        _bias_gelu_builder("bias_gelu", blocks.gelu_erf),
    ),
    ModelSpec(
        "bias_gelu_tanh",
        "x[4096,3072] + bias[3072] then tanh-approximate GELU (BERT-base FFN)",
        "inference",
        CONFIGS,
        _bias_gelu_builder("bias_gelu_tanh", blocks.gelu_tanh),
    ),
    ModelSpec(
        "log_softmax_xent",
        "mean cross-entropy of logits[4096,32000] with int labels[4096] via log-softmax and "
        "take_along_axis (Transformer output layer, FusionStitching)",
        "inference",
        CONFIGS,
        _log_softmax_xent,
    ),
    ModelSpec(
        "log_softmax_xent_train",
        "loss and d loss/d logits of mean cross-entropy, logits[4096,32000], labels[4096] "
        "(Transformer output layer backward, FusionStitching); returns (loss, dlogits)",
        "training",
        CONFIGS,
        _log_softmax_xent_train,
    ),
    ModelSpec(
        "layer_norm_nonminor",
        "LayerNorm of x[B=32,C=768,T=128] over the non-minor axis 1 with gamma/beta[768] "
        "(column-style reduction, FusionStitching)",
        "inference",
        CONFIGS,
        _layer_norm_nonminor,
    ),
    ModelSpec(
        "column_reduce_broadcast",
        "batch-norm-style x[4096,768]: column mean and variance over axis 0, broadcast back, "
        "times scale[768] (column reduce feeding a broadcast consumer, FusionStitching)",
        "inference",
        CONFIGS,
        _column_reduce_broadcast,
    ),
)
