"""The project's third-party training steps as pure jax functions with their arguments, for
benches that compile them (deviceless) rather than run them: the steps of
examples/thirdparty/ (their own modules and loss functions, imported), the zoo's
transformer step, one ``model.fit`` step of each keras_hub model of
examples/thirdparty/keras_hub_train.py (GPT2, Llama, BERT, ViT: the project's
configs) and a lax.scan training loop. ``STEPS`` maps a name to a builder returning
``(fn, args, devices)``; ``available(name)`` says why a step cannot be built here (a missing
package), else None.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable

SCRIPTS = Path(__file__).resolve().parents[1] / "examples" / "thirdparty"


def _script(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"_thirdparty_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _zoo(name: str) -> tuple[Callable, tuple, int]:
    from stitch.models import build
    inst = build(name, "tiny")
    return inst.fn, tuple(inst.random_args(0)), 1


def _keras_hub(model_name: str) -> tuple[Callable, tuple, int]:
    """One ``model.fit`` step of examples/thirdparty/keras_hub_train.py's model
    (its config, random init, AdamW, sparse cross-entropy) as Keras' JAX trainer runs it:
    ``train_step(state, (x, y))``, pure in the trainer's state. One ``train_on_batch``
    first builds the optimizer's and metrics' variables."""
    import keras
    m = _script("keras_hub_train")
    keras.utils.set_random_seed(0)
    model, x, y = getattr(m, model_name)()
    model.compile(optimizer=keras.optimizers.AdamW(learning_rate=1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=True)
    model.train_on_batch(x, y)
    state = tuple([v.value for v in variables] for variables in (
        model.trainable_variables, model.non_trainable_variables,
        model.optimizer.variables, model.metrics_variables))

    def step(state, x, y):
        return model.train_step(state, (x, y))
    return step, (state, x, y), 1


def _random_dropout() -> tuple[Callable, tuple, int]:
    import jax
    import jax.numpy as jnp
    m = _script("random_dropout")
    k1, k2, kx, ky, key = jax.random.split(jax.random.key(0), 5)
    params = {"w1": jax.random.normal(k1, (m.DIN, m.HIDDEN)), "b1": jnp.zeros(m.HIDDEN),
              "w2": jax.random.normal(k2, (m.HIDDEN, m.DOUT))}
    return m.train_step.__wrapped__, (params, jax.random.normal(kx, (m.BATCH, m.DIN)),
                                      jax.random.normal(ky, (m.BATCH, m.DOUT)), key), 1


def _remat_mlp() -> tuple[Callable, tuple, int]:
    import jax
    m = _script("remat_mlp")
    params = m.init_params(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (m.BATCH, m.DIM))
    y = jax.random.normal(jax.random.key(2), (m.BATCH, 1))
    return m.train_step.__wrapped__, (params, x, y), 1


def _data_parallel() -> tuple[Callable, tuple, int]:
    import jax
    m = _script("data_parallel")
    params = m.init_params(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (m.BATCH, m.DIN))
    y = jax.nn.one_hot(jax.random.randint(jax.random.key(2), (m.BATCH,), 0, m.DOUT), m.DOUT)
    return m.train_step, (params, x, y), 4


def _flax_nnx_lm() -> tuple[Callable, tuple, int]:
    import jax
    import optax
    from flax import nnx
    m = _script("flax_nnx_lm")
    model = m.LanguageModel(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def fn(state, tokens):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model):
            logits = model(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, tokens[:, 1:]).mean()
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss
    tokens = jax.random.randint(jax.random.key(1), (m.BATCH, m.SEQ + 1), 0, m.VOCAB)
    return fn, (state, tokens), 1


def _equinox_attention() -> tuple[Callable, tuple, int]:
    import equinox as eqx
    import jax
    import optax
    m = _script("equinox_attention")
    model = m.AttentionModel(jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    optimizer = optax.adam(1e-3)
    opt_state = optimizer.init(params)

    def fn(params, opt_state, x, y):
        model = eqx.combine(params, static)
        loss, grads = eqx.filter_value_and_grad(m.loss_fn)(model, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), opt_state, loss
    x = jax.random.normal(jax.random.key(1), (m.BATCH, m.SEQ, m.DIM))
    y = jax.random.normal(jax.random.key(2), (m.BATCH,))
    return fn, (params, opt_state, x, y), 1


def _scan_loop() -> tuple[Callable, tuple, int]:
    """Eight SGD steps of a small MLP with softmax cross-entropy inside one lax.scan."""
    import jax
    import jax.numpy as jnp

    def loss(params, x, labels):
        h = jax.nn.gelu(x @ params["w1"] + params["b1"])
        h = (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)
        logits = h @ params["w2"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))

    def fn(params, xs, labels):
        def step(params, batch):
            value, grads = jax.value_and_grad(loss)(params, *batch)
            return jax.tree.map(lambda p, g: p - 0.05 * g, params, grads), value
        return jax.lax.scan(step, params, (xs, labels))
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k1, (64, 256)) / 8, "b1": jax.numpy.zeros(256),
              "w2": jax.random.normal(k2, (256, 128)) / 16}
    return fn, (params, jax.random.normal(k3, (8, 32, 64)),
                jax.random.randint(k4, (8, 32), 0, 128)), 1


STEPS: dict[str, tuple[Callable[[], tuple[Callable, tuple, int]], tuple[str, ...]]] = {
    "transformer_train (zoo)": (lambda: _zoo("transformer_train"), ()),
    "bert_layer_train (zoo)": (lambda: _zoo("bert_layer_train"), ()),
    "keras_hub GPT2": (lambda: _keras_hub("gpt2"), ("keras", "keras_hub")),
    "keras_hub Llama": (lambda: _keras_hub("llama"), ("keras", "keras_hub")),
    "keras_hub BERT": (lambda: _keras_hub("bert"), ("keras", "keras_hub")),
    "keras_hub ViT": (lambda: _keras_hub("vit"), ("keras", "keras_hub")),
    "flax nnx LM": (_flax_nnx_lm, ("flax", "optax")),
    "equinox attention": (_equinox_attention, ("equinox", "optax")),
    "data-parallel (4 devices)": (_data_parallel, ()),
    "lax.scan training loop": (_scan_loop, ()),
    "random dropout": (_random_dropout, ()),
    "remat MLP": (_remat_mlp, ()),
}


# XLA flags a step's deviceless compile needs (the child's XLA_FLAGS), with why: without a
# device XLA GPU does not autotune, and its Triton GEMM tiling finds no tile for the ViT's
# 68-row (4 images x 17 tokens) attention-output dot ("Couldn't find output tile sizes"),
# stitch's pass on or off; cuBLAS GEMMs instead, on both sides of the comparison.
XLA_FLAGS: dict[str, str] = {"keras_hub ViT": "--xla_gpu_enable_triton_gemm=false"}


def available(name: str) -> str | None:
    """None when ``name`` can be built here, else what is missing."""
    missing = [m for m in STEPS[name][1] if importlib.util.find_spec(m) is None]
    return f"needs {', '.join(missing)}" if missing else None


def build(name: str) -> tuple[Callable, tuple, int]:
    os.environ.setdefault("KERAS_BACKEND", "jax")
    return STEPS[name][0]()
