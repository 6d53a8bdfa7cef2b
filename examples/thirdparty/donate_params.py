"""A train step jitted with `donate_argnums=(0, 1)` (params and optimizer momentum): after
each call the script checks that the donated input buffers were deleted (XLA reused them
for the outputs). An ordinary script: it imports nothing from stitch. Prints one line at
the end:
    STITCH_TEST_RESULT {"losses": [...], "donated_deleted": true|false, ...}
"""
from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp

BATCH, DIN, HIDDEN = 32, 32, 64
LEARNING_RATE, MOMENTUM = 0.05, 0.9


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    hidden = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] - y) ** 2)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def train_step(params: dict, velocity: dict, x: jax.Array, y: jax.Array):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    velocity = jax.tree.map(lambda v, g: MOMENTUM * v + g, velocity, grads)
    params = jax.tree.map(lambda p, v: p - LEARNING_RATE * v, params, velocity)
    return params, velocity, loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    k1, k2, kx, ky = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k1, (DIN, HIDDEN)) / 6.0, "b1": jnp.zeros(HIDDEN),
              "w2": jax.random.normal(k2, (HIDDEN, 1)) / 8.0}
    velocity = jax.tree.map(jnp.zeros_like, params)
    x = jax.random.normal(kx, (BATCH, DIN))
    y = jax.random.normal(ky, (BATCH, 1))
    losses, deleted = [], []
    start = time.perf_counter()
    for _ in range(args.steps):
        donated = jax.tree.leaves((params, velocity))
        params, velocity, loss = train_step(params, velocity, x, y)
        deleted.append(all(leaf.is_deleted() for leaf in donated))
        losses.append(float(loss))
    print("STITCH_TEST_RESULT " + json.dumps({
        "losses": losses, "donated_deleted": all(deleted), "deleted_per_step": deleted,
        "train_s": time.perf_counter() - start}))


if __name__ == "__main__":
    main()
