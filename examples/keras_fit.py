"""An ordinary Keras script (no stitch import): a small classifier trained with model.fit.
Runs on whichever Keras backend KERAS_BACKEND names. Prints one line per batch:
`step <i> loss <value>` (Keras' running mean of the epoch's loss).

    python keras_fit.py --epochs 3
    python keras_fit.py --steps 500                   # stop after 500 batches
    python keras_fit.py --seconds 30 --min-steps 50   # stop after a time budget
"""
import argparse
import time

import keras
import numpy as np


class PrintLoss(keras.callbacks.Callback):
    def __init__(self, seconds: float, min_steps: int, max_steps: int):
        super().__init__()
        self.seconds, self.min_steps, self.max_steps = seconds, min_steps, max_steps
        self.step = 0
        self.start = time.monotonic()

    def on_train_batch_end(self, batch, logs=None):
        print(f"step {self.step} loss {float(logs['loss']):.9g}", flush=True)
        self.step += 1
        if self.seconds > 0 and time.monotonic() - self.start >= self.seconds \
                and self.step >= self.min_steps:
            self.model.stop_training = True
        if self.max_steps and self.step >= self.max_steps:
            self.model.stop_training = True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=0.0)
    parser.add_argument("--min-steps", type=int, default=1)
    parser.add_argument("--steps", type=int, default=0)
    args = parser.parse_args()
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    # Labels from a noisy linear teacher: the loss settles above zero (no memorization).
    x = rng.standard_normal((8192, 32)).astype(np.float32)
    noisy = x @ rng.standard_normal((32, 4)) + 1.5 * rng.standard_normal((8192, 4))
    y = noisy.argmax(axis=1).astype(np.int32)
    model = keras.Sequential([
        keras.Input((32,)),
        keras.layers.Dense(64, activation="gelu"),
        keras.layers.LayerNormalization(),
        keras.layers.Dense(4),
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    epochs = 10_000 if args.seconds > 0 or args.steps else args.epochs
    model.fit(x, y, batch_size=64, epochs=epochs, shuffle=False, verbose=0,
              callbacks=[PrintLoss(args.seconds, args.min_steps, args.steps)])


if __name__ == "__main__":
    main()
