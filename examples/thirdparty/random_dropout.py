"""A plain `jax.jit` training loop with dropout drawn from `jax.random`: a fresh key is
split off per step and passed into the jitted step. An ordinary script: it imports nothing
from stitch. Prints one line at the end:
    STITCH_TEST_RESULT {"losses": [...], "donated_deleted": null, ...}
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

BATCH, DIN, HIDDEN, DOUT = 32, 16, 64, 4
DROP_RATE = 0.2
LEARNING_RATE = 0.05


def loss_fn(params: dict, x: jax.Array, y: jax.Array, key: jax.Array) -> jax.Array:
    hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
    keep = jax.random.bernoulli(key, 1.0 - DROP_RATE, hidden.shape)
    hidden = jnp.where(keep, hidden / (1.0 - DROP_RATE), 0.0)
    return jnp.mean((hidden @ params["w2"] - y) ** 2)


@jax.jit
def train_step(params: dict, x: jax.Array, y: jax.Array, key: jax.Array):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y, key)
    return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads), loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    k1, k2, kx, ky, key = jax.random.split(jax.random.key(0), 5)
    params = {"w1": jax.random.normal(k1, (DIN, HIDDEN)) / 4.0, "b1": jnp.zeros(HIDDEN),
              "w2": jax.random.normal(k2, (HIDDEN, DOUT)) / 8.0}
    x = jax.random.normal(kx, (BATCH, DIN))
    y = jax.random.normal(ky, (BATCH, DOUT))
    losses = []
    start = time.perf_counter()
    for _ in range(args.steps):
        key, step_key = jax.random.split(key)
        params, loss = train_step(params, x, y, step_key)
        losses.append(float(loss))
    print("STITCH_TEST_RESULT " + json.dumps({
        "losses": losses, "donated_deleted": None, "train_s": time.perf_counter() - start}))


if __name__ == "__main__":
    main()
