"""Regenerate the TensorFlow/Keras HLO fixtures under hlo_fixtures/data/tf/.

Needs tensorflow (or tensorflow-cpu) in the running interpreter, e.g.::

    python -m venv /tmp/venv-tf && /tmp/venv-tf/bin/pip install tensorflow-cpu
    /tmp/venv-tf/bin/python scripts/gen_tf_fixtures.py

For each Keras model it writes ``<name>.hlo`` (``experimental_get_compiler_ir(...)('hlo')``),
``<name>.optimized_hlo`` (stage 'optimized_hlo', XLA CPU) and ``<name>.npz`` holding the ENTRY
arguments (``arg0``, ``arg1``...) and the values TF computed for every ENTRY output
(``out0``...), so tests can check the reference evaluator without TensorFlow installed.
"""
from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np
import tensorflow as tf

OUT = pathlib.Path(__file__).resolve().parent.parent / "hlo_fixtures" / "data" / "tf"


def mlp_classifier() -> tf.keras.Model:
    return tf.keras.Sequential([
        tf.keras.Input((16,)),
        tf.keras.layers.Dense(32, activation="gelu"),
        tf.keras.layers.LayerNormalization(),
        tf.keras.layers.Dense(32, activation="tanh"),
        tf.keras.layers.Dense(8),
    ])


def attention_block() -> tf.keras.Model:
    inputs = tf.keras.Input((6, 16))
    attn = tf.keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)(inputs, inputs)
    x = tf.keras.layers.LayerNormalization()(inputs + attn)
    ffn = tf.keras.layers.Dense(32, activation="relu")(x)
    x = tf.keras.layers.LayerNormalization()(x + tf.keras.layers.Dense(16)(ffn))
    pooled = tf.keras.layers.GlobalAveragePooling1D()(x)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(8)(pooled))


def conv_net() -> tf.keras.Model:
    return tf.keras.Sequential([
        tf.keras.Input((12, 12, 3)),
        tf.keras.layers.Conv2D(8, 3, padding="same", activation="relu"),
        tf.keras.layers.MaxPooling2D(2),
        tf.keras.layers.Conv2D(8, 3, strides=2, activation="relu"),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(8),
    ])


MODELS = {"keras_mlp_train": (mlp_classifier, (4, 16)),
          "keras_attention_train": (attention_block, (4, 6, 16)),
          "keras_conv_train": (conv_net, (4, 12, 12, 3))}


def train_step_fixture(name: str, seed: int) -> None:
    build, x_shape = MODELS[name]
    tf.keras.utils.set_random_seed(seed)
    model = build()
    optimizer = tf.keras.optimizers.SGD(0.05)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(jit_compile=True)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape).astype(np.float32)
    y = rng.integers(0, 8, size=(x_shape[0],)).astype(np.int32)
    optimizer.build(model.trainable_variables)
    concrete = step.get_concrete_function(x, y)
    ir = step.experimental_get_compiler_ir(x, y)
    hlo, optimized = ir(stage="hlo"), ir(stage="optimized_hlo")

    # ENTRY parameters: x, y, then the captured variables in capture order.
    by_handle = {id(v.handle): v for v in model.variables + optimizer.variables}
    captured = [by_handle[id(t)] for t in concrete.captured_inputs]
    args = [x, y] + [v.numpy() for v in captured]
    loss = float(step(x, y))
    # Outputs: the loss, then the new value of every variable the step assigns (aliased
    # outputs, in order); TF prints the pairs in input_output_alias.
    aliases = _output_aliases(hlo)
    outs = [np.asarray(loss, np.float32)]
    for out_index in sorted(aliases):
        outs.append(captured[aliases[out_index] - 2].numpy())
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}.hlo").write_text(hlo)
    (OUT / f"{name}.optimized_hlo").write_text(optimized)
    np.savez(OUT / f"{name}.npz", **{f"arg{i}": a for i, a in enumerate(args)},
             **{f"out{i}": o for i, o in enumerate(outs)})
    print(f"{name}: {len(args)} args, {len(outs)} outputs, hlo {len(hlo)} chars")


def _output_aliases(hlo: str) -> dict[int, int]:
    """``input_output_alias={ {1}: (2, {}, may-alias), ...}`` -> {1: 2, ...}."""
    import re
    header = hlo.split("\n", 1)[0]
    return {int(o): int(p) for o, p in re.findall(r"\{(\d+)\}: \((\d+),", header)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name in MODELS:
        train_step_fixture(name, args.seed)
    (OUT / "versions.json").write_text(json.dumps({"tensorflow": tf.__version__}, indent=1) + "\n")


if __name__ == "__main__":
    main()
