"""bf16 mixed-precision variants of the zoo's training steps, named ``<model>_bf16``.

The way H100 training runs: activations and gradients in bf16, f32 master weights. Float data
inputs arrive as bf16; the step casts every f32 parameter to bf16 for the forward, the
backward runs in bf16, and the transpose of that cast hands each gradient back as f32 for
the SGD update of the f32 master weights. The loss is returned in f32.

Separate registry entries (not a config of the f32 models) because the dtype changes the
model's HLO at every size: each variant keeps the f32 model's own configs (full, tiny), its
fixtures sit in their own hlo_fixtures/data/<model>_bf16/ folder, and the tables that compare f32
with bf16 name both models side by side.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import jax
import jax.numpy as jnp

from . import bert, blocks, dien, micro, transformer
from .spec import CONFIGS, ArgTable, ModelInstance, ModelSpec

LOW = jnp.bfloat16
SUFFIX = "_bf16"
Parts = Callable[[str], tuple[ArgTable, blocks.Loss]]


def low_precision_data(t: ArgTable) -> ArgTable:
    """A copy of ``t`` whose float data args are bf16 (int args and parameters unchanged)."""
    specs = [
        jax.ShapeDtypeStruct(spec.shape, LOW) if i < t.num_data and kind == "float" else spec
        for i, (spec, kind) in enumerate(zip(t.specs, t.kinds))
    ]
    return replace(t, names=list(t.names), specs=specs, kinds=list(t.kinds),
                   scales=list(t.scales), param_names=list(t.param_names))


def mixed_sgd_step(loss_fn: blocks.Loss, data_names, param_names, lr: float = blocks.SGD_LR):
    """fn(*data, *params) -> (loss f32, *params - lr * grads): params and updates in f32,
    forward and backward in bf16."""

    def low_loss(params: blocks.Params, data: blocks.Params) -> jax.Array:
        cast = {name: w.astype(LOW) for name, w in params.items()}
        return loss_fn(cast, data).astype(jnp.float32)

    return blocks.sgd_step(low_loss, data_names, param_names, lr)


def _training_variant(base: str, parts: Parts, description: str) -> ModelSpec:
    name = base + SUFFIX

    def build(config: str) -> ModelInstance:
        t, loss = parts(config)
        low = low_precision_data(t)
        fn = mixed_sgd_step(loss, low.data_names, low.param_names)
        return low.instance(name, config, fn)

    return ModelSpec(name, description, "training", CONFIGS, build)


def _xent_train(config: str) -> ModelInstance:
    """The loss layer alone has no weights: bf16 logits in, (f32 loss, bf16 dlogits) out."""
    name = "log_softmax_xent_train" + SUFFIX
    t = low_precision_data(micro.xent_args(name, config))

    def fn(logits, labels):
        def loss(x):
            return blocks.cross_entropy(x, labels).astype(jnp.float32)
        return jax.value_and_grad(loss)(logits)

    return t.instance(name, config, fn)


_MIXED = "bf16 activations and gradients, f32 master weights and update"

SPECS: tuple[ModelSpec, ...] = (
    ModelSpec(
        "log_softmax_xent_train" + SUFFIX,
        "log_softmax_xent_train in bf16: logits[4096,32000] bf16, labels[4096]; returns "
        "(f32 loss, bf16 dlogits)",
        "training",
        CONFIGS,
        _xent_train,
    ),
    _training_variant("bert_layer_train", bert.train_parts,
                      f"bert_layer_train mixed precision ({_MIXED}); x/target/mask bf16"),
    _training_variant("transformer_train", transformer.train_parts,
                      f"transformer_train mixed precision ({_MIXED}); embeddings cast to bf16 "
                      "for lookup and the tied output projection"),
    _training_variant("dien_train", dien.train_parts,
                      f"dien_train mixed precision ({_MIXED}); GRU/AUGRU states bf16"),
)
