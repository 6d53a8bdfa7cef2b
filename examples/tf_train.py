"""An ordinary TensorFlow training script (no stitch import): an MLP with layer norm and a
softmax cross-entropy loss, tf.Variables, tf.GradientTape, SGD, one
``tf.function(jit_compile=True)`` step, a fresh batch per step. Prints one line per step:
`step <i> loss <value>`.

    python tf_train.py --steps 200
    python tf_train.py --seconds 30 --min-steps 50   # train for a time budget
"""
import argparse
import time

import numpy as np
import tensorflow as tf


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=0.0)
    parser.add_argument("--min-steps", type=int, default=1)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    batch, features, hidden, classes = 256, 64, 128, 16
    w1 = tf.Variable((rng.standard_normal((features, hidden)) / np.sqrt(features))
                     .astype(np.float32), name="w1")
    b1 = tf.Variable(0.1 * rng.standard_normal(hidden).astype(np.float32), name="b1")
    gamma = tf.Variable(1.0 + 0.1 * rng.standard_normal(hidden).astype(np.float32), name="g")
    beta = tf.Variable(0.1 * rng.standard_normal(hidden).astype(np.float32), name="beta")
    w2 = tf.Variable((rng.standard_normal((hidden, classes)) / np.sqrt(hidden))
                     .astype(np.float32), name="w2")
    b2 = tf.Variable(0.1 * rng.standard_normal(classes).astype(np.float32), name="b2")
    params = [w1, b1, gamma, beta, w2, b2]

    @tf.function(jit_compile=True)
    def train_step(x, labels):
        with tf.GradientTape() as tape:
            h = tf.tanh(x @ w1 + b1)
            mean, var = tf.nn.moments(h, axes=[-1], keepdims=True)
            h = (h - mean) * tf.math.rsqrt(var + 1e-5) * gamma + beta
            logits = h @ w2 + b2
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=labels, logits=logits))
        grads = tape.gradient(loss, params)
        for p, g in zip(params, grads):
            p.assign_sub(0.02 * g)
        return loss

    # A fresh batch per step from a noisy linear teacher: the loss settles well above zero.
    teacher = rng.standard_normal((features, classes)).astype(np.float32)
    start = time.monotonic()
    step = 0
    while True:
        x = rng.standard_normal((batch, features)).astype(np.float32)
        noisy = x @ teacher + 2.0 * rng.standard_normal((batch, classes)).astype(np.float32)
        labels = noisy.argmax(axis=1).astype(np.int32)
        loss = train_step(tf.constant(x), tf.constant(labels))
        print(f"step {step} loss {float(loss):.9g}", flush=True)
        step += 1
        if args.seconds > 0:
            if time.monotonic() - start >= args.seconds and step >= args.min_steps:
                break
        elif step >= args.steps:
            break


if __name__ == "__main__":
    main()
