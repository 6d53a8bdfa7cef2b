"""A tiny flax nnx language model (embedding, two attention blocks, layer norm) trained a
few steps with optax adamw under `nnx.jit`. An ordinary script: it imports nothing from
stitch. Prints one line at the end:
    STITCH_TEST_RESULT {"losses": [...], "donated_deleted": null, ...}
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import optax
from flax import nnx

VOCAB, SEQ, BATCH, DIM, HEADS = 128, 16, 4, 64, 4


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.norm1 = nnx.LayerNorm(DIM, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(num_heads=HEADS, in_features=DIM,
                                                decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(DIM, rngs=rngs)
        self.up = nnx.Linear(DIM, 4 * DIM, rngs=rngs)
        self.down = nnx.Linear(4 * DIM, DIM, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attention(self.norm1(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class LanguageModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(), (SEQ, DIM)))
        self.blocks = nnx.List([Block(rngs) for _ in range(2)])
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)
        self.head = nnx.Linear(DIM, VOCAB, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.position[...]
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


@nnx.jit
def train_step(model: LanguageModel, optimizer: nnx.Optimizer, tokens: jax.Array) -> jax.Array:
    def loss_fn(model: LanguageModel) -> jax.Array:
        logits = model(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    model = LanguageModel(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    data_key = jax.random.key(1)
    losses = []
    start = time.perf_counter()
    for _ in range(args.steps):
        data_key, batch_key = jax.random.split(data_key)
        tokens = jax.random.randint(batch_key, (BATCH, SEQ + 1), 0, VOCAB)
        losses.append(float(train_step(model, optimizer, tokens)))
    print("STITCH_TEST_RESULT " + json.dumps({
        "losses": losses, "donated_deleted": None, "train_s": time.perf_counter() - start}))


if __name__ == "__main__":
    main()
