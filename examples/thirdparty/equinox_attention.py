"""A small equinox attention model (multihead self-attention + MLP + layer norm, mean-pooled
regression head) trained a few steps with optax adam under `eqx.filter_jit`. An ordinary
script: it imports nothing from stitch. Prints one line at the end:
    STITCH_TEST_RESULT {"losses": [...], "donated_deleted": null, ...}
"""
from __future__ import annotations

import argparse
import json
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

SEQ, BATCH, DIM, HEADS = 16, 8, 32, 4


class AttentionModel(eqx.Module):
    attention: eqx.nn.MultiheadAttention
    norm1: eqx.nn.LayerNorm
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP
    head: eqx.nn.Linear

    def __init__(self, key: jax.Array) -> None:
        k1, k2, k3 = jax.random.split(key, 3)
        self.attention = eqx.nn.MultiheadAttention(HEADS, DIM, key=k1)
        self.norm1 = eqx.nn.LayerNorm(DIM)
        self.norm2 = eqx.nn.LayerNorm(DIM)
        self.mlp = eqx.nn.MLP(DIM, DIM, 2 * DIM, depth=1, activation=jax.nn.gelu, key=k2)
        self.head = eqx.nn.Linear(DIM, 1, key=k3)

    def __call__(self, x: jax.Array) -> jax.Array:
        normed = jax.vmap(self.norm1)(x)
        x = x + self.attention(normed, normed, normed)
        x = x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))
        return self.head(x.mean(axis=0))[0]


def loss_fn(model: AttentionModel, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    model = AttentionModel(jax.random.key(0))
    optimizer = optax.adam(1e-3)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def train_step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    key = jax.random.key(1)
    x_key, y_key = jax.random.split(key)
    x = jax.random.normal(x_key, (BATCH, SEQ, DIM))
    y = jax.random.normal(y_key, (BATCH,))
    losses = []
    start = time.perf_counter()
    for _ in range(args.steps):
        model, opt_state, loss = train_step(model, opt_state, x, y)
        losses.append(float(loss))
    print("STITCH_TEST_RESULT " + json.dumps({
        "losses": losses, "donated_deleted": None, "train_s": time.perf_counter() - start}))


if __name__ == "__main__":
    main()
