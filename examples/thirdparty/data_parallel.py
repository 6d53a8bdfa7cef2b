"""A data-parallel MLP train step over 4 host devices: the batch is sharded over a "data"
mesh axis, params are replicated, and `jax.jit` gets NamedSharding in/out shardings (XLA's
SPMD partitioner inserts the gradient all-reduce). An ordinary script: it imports nothing
from stitch. Prints one line at the end:
    STITCH_TEST_RESULT {"losses": [...], "donated_deleted": null, ...}
"""
from __future__ import annotations

import os

# Must be set before jax starts its CPU backend; keep any flags the caller already set.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=4").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

BATCH, DIN, HIDDEN, DOUT = 32, 16, 64, 8
LEARNING_RATE = 0.05


def init_params(key: jax.Array) -> dict:
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (DIN, HIDDEN)) / np.sqrt(DIN),
            "b1": jnp.zeros((HIDDEN,)),
            "w2": jax.random.normal(k2, (HIDDEN, DOUT)) / np.sqrt(HIDDEN),
            "b2": jnp.zeros((DOUT,))}


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    hidden = jax.nn.gelu(x @ params["w1"] + params["b1"])
    logits = hidden @ params["w2"] + params["b2"]
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * y, axis=-1))


def train_step(params: dict, x: jax.Array, y: jax.Array) -> tuple[dict, jax.Array]:
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads), loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    assert len(jax.devices()) == 4, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated = NamedSharding(mesh, P())
    batch_sharded = NamedSharding(mesh, P("data"))
    step = jax.jit(train_step,
                   in_shardings=(replicated, batch_sharded, batch_sharded),
                   out_shardings=(replicated, replicated))
    params = jax.device_put(init_params(jax.random.key(0)), replicated)
    data_key = jax.random.key(1)
    losses = []
    start = time.perf_counter()
    for _ in range(args.steps):
        data_key, x_key, y_key = jax.random.split(data_key, 3)
        x = jax.device_put(jax.random.normal(x_key, (BATCH, DIN)), batch_sharded)
        labels = jax.random.randint(y_key, (BATCH,), 0, DOUT)
        y = jax.device_put(jax.nn.one_hot(labels, DOUT), batch_sharded)
        params, loss = step(params, x, y)
        losses.append(float(loss))
    assert params["w1"].sharding == replicated
    print("STITCH_TEST_RESULT " + json.dumps({
        "losses": losses, "donated_deleted": None, "devices": len(jax.devices()),
        "train_s": time.perf_counter() - start}))


if __name__ == "__main__":
    main()
