"""An ordinary JAX training script (no stitch import): an MLP with layer norm and a
softmax cross-entropy loss, SGD, one jax.jit'ed step, a fresh batch per step. Prints one line per step:
`step <i> loss <value>`.

    python jax_train.py --steps 200
    python jax_train.py --seconds 30 --min-steps 50   # train for a time budget
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np


def layer_norm(h, gamma, beta):
    mean = h.mean(-1, keepdims=True)
    var = ((h - mean) ** 2).mean(-1, keepdims=True)
    return (h - mean) * jax.lax.rsqrt(var + 1e-5) * gamma + beta


def loss_fn(params, x, labels):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    h = layer_norm(h, params["g"], params["beta"])
    logits = h @ params["w2"] + params["b2"]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


@jax.jit
def train_step(params, x, labels):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, labels)
    params = jax.tree_util.tree_map(lambda p, g: p - 0.02 * g, params, grads)
    return params, loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=0.0)
    parser.add_argument("--min-steps", type=int, default=1)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    batch, features, hidden, classes = 256, 64, 128, 16
    params = {
        "w1": rng.standard_normal((features, hidden)).astype(np.float32) / np.sqrt(features),
        "b1": 0.1 * rng.standard_normal(hidden).astype(np.float32),
        "g": 1.0 + 0.1 * rng.standard_normal(hidden).astype(np.float32),
        "beta": 0.1 * rng.standard_normal(hidden).astype(np.float32),
        "w2": rng.standard_normal((hidden, classes)).astype(np.float32) / np.sqrt(hidden),
        "b2": 0.1 * rng.standard_normal(classes).astype(np.float32),
    }
    # A fresh batch per step from a noisy linear teacher: the loss settles well above zero
    # instead of memorizing one batch (relative loss comparisons stay meaningful).
    teacher = rng.standard_normal((features, classes)).astype(np.float32)
    start = time.monotonic()
    step = 0
    while True:
        x = rng.standard_normal((batch, features)).astype(np.float32)
        noisy = x @ teacher + 2.0 * rng.standard_normal((batch, classes)).astype(np.float32)
        labels = noisy.argmax(axis=1).astype(np.int32)
        params, loss = train_step(params, x, labels)
        print(f"step {step} loss {float(loss):.9g}", flush=True)
        step += 1
        if args.seconds > 0:
            if time.monotonic() - start >= args.seconds and step >= args.min_steps:
                break
        elif step >= args.steps:
            break


if __name__ == "__main__":
    main()
