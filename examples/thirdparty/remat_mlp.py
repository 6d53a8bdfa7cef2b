"""An MLP train step whose hidden blocks are wrapped in `jax.checkpoint` (remat), so the
backward pass recomputes them behind XLA optimization barriers. An ordinary script: it
imports nothing from stitch. Prints one line at the end:
    STITCH_TEST_RESULT {"losses": [...], "donated_deleted": null, ...}
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

BATCH, DIM, DEPTH = 32, 64, 3
LEARNING_RATE = 0.01


def init_params(key: jax.Array) -> list[dict]:
    keys = jax.random.split(key, DEPTH + 1)
    blocks = [{"w": jax.random.normal(k, (DIM, DIM)) / jnp.sqrt(DIM), "b": jnp.zeros(DIM),
               "scale": jnp.ones(DIM)} for k in keys[:-1]]
    return blocks + [{"w": jax.random.normal(keys[-1], (DIM, 1)) / jnp.sqrt(DIM)}]


@jax.checkpoint
def block(params: dict, x: jax.Array) -> jax.Array:
    h = jnp.tanh(x @ params["w"] + params["b"])
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6) * params["scale"]
    return x + h


def loss_fn(params: list[dict], x: jax.Array, y: jax.Array) -> jax.Array:
    for p in params[:-1]:
        x = block(p, x)
    return jnp.mean((x @ params[-1]["w"] - y) ** 2)


@jax.jit
def train_step(params: list[dict], x: jax.Array, y: jax.Array):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads), loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    params = init_params(jax.random.key(0))
    x_key, y_key = jax.random.split(jax.random.key(1))
    x = jax.random.normal(x_key, (BATCH, DIM))
    y = jax.random.normal(y_key, (BATCH, 1))
    losses = []
    start = time.perf_counter()
    for _ in range(args.steps):
        params, loss = train_step(params, x, y)
        losses.append(float(loss))
    print("STITCH_TEST_RESULT " + json.dumps({
        "losses": losses, "donated_deleted": None, "train_s": time.perf_counter() - start}))


if __name__ == "__main__":
    main()
