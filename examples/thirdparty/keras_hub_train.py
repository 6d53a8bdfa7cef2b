"""A few `model.fit` steps of a tiny keras_hub model built from a config with random init.

An ordinary Keras script (it imports nothing from stitch); the backend comes from
KERAS_BACKEND (jax or tensorflow). Each epoch is one batch, so the epoch's loss is that
step's loss. Prints one line at the end:
    STITCH_TEST_RESULT {"losses": [...], "donated_deleted": null, ...}
"""
from __future__ import annotations

import argparse
import json
import time

import keras
import keras_hub
import numpy as np

VOCAB = 128
SEQ = 16
BATCH = 4


def gpt2() -> tuple[keras.Model, object, np.ndarray]:
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=64, intermediate_dim=128,
        dropout=0.1, max_sequence_length=SEQ)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None), *_lm_data()


def llama() -> tuple[keras.Model, object, np.ndarray]:
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=64, intermediate_dim=128)
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None), *_lm_data()


def bert() -> tuple[keras.Model, object, np.ndarray]:
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=64, intermediate_dim=128,
        dropout=0.1, max_sequence_length=SEQ)
    model = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2,
                                                preprocessor=None)
    rng = np.random.default_rng(1)
    x = {"token_ids": rng.integers(1, VOCAB, size=(BATCH, SEQ)).astype("int32"),
         "segment_ids": np.zeros((BATCH, SEQ), dtype="int32"),
         "padding_mask": np.ones((BATCH, SEQ), dtype="int32")}
    return model, x, rng.integers(0, 2, size=(BATCH,))


def vit() -> tuple[keras.Model, object, np.ndarray]:
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(32, 32, 3), patch_size=8, num_layers=2, num_heads=2, hidden_dim=64,
        mlp_dim=128)
    model = keras_hub.models.ViTImageClassifier(backbone=backbone, num_classes=10,
                                                preprocessor=None)
    rng = np.random.default_rng(1)
    images = rng.standard_normal((BATCH, 32, 32, 3)).astype("float32")
    labels = rng.integers(0, 10, size=(BATCH,))
    return model, images, labels


def _lm_data() -> tuple[dict, np.ndarray]:
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, VOCAB, size=(BATCH, SEQ + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((BATCH, SEQ), dtype="int32")}
    return x, tokens[:, 1:]


class _StepLosses(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def on_epoch_end(self, epoch, logs=None):
        self.losses.append(float(logs["loss"]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("gpt2", "llama", "bert", "vit"), required=True)
    parser.add_argument("--steps", type=int, default=5)
    # Keras' jit_compile="auto" turns XLA off on a CPU-only machine (on a GPU it is on);
    # with dropout, TF's own kernels and XLA draw different random masks.
    parser.add_argument("--jit-compile", action="store_true")
    parser.add_argument("--dtype-policy", default="float32",
                        help="Keras dtype policy, e.g. mixed_bfloat16")
    args = parser.parse_args()
    keras.mixed_precision.set_global_policy(args.dtype_policy)
    keras.utils.set_random_seed(0)
    model, x, y = {"gpt2": gpt2, "llama": llama, "bert": bert, "vit": vit}[args.model]()
    model.compile(optimizer=keras.optimizers.AdamW(learning_rate=1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=True if args.jit_compile else "auto")
    record = _StepLosses()
    start = time.perf_counter()
    model.fit(x, y, batch_size=BATCH, epochs=args.steps, shuffle=False, verbose=0,
              callbacks=[record])
    print("STITCH_TEST_RESULT " + json.dumps({
        "losses": record.losses, "donated_deleted": None,
        "backend": keras.backend.backend(), "dtype_policy": args.dtype_policy, "train_s": time.perf_counter() - start}))


if __name__ == "__main__":
    main()
