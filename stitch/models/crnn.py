"""CRNN text recognizer (Shi et al.), FusionStitching's OCR workload: three conv+ReLU+maxpool
blocks, height folded into features, a bidirectional LSTM, per-column softmax over classes.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from . import blocks
from .spec import CONFIGS, ArgTable, ModelInstance, ModelSpec, pick_config


@dataclass(frozen=True)
class CrnnSize:
    batch: int
    height: int
    width: int
    channels: tuple[int, int, int]
    hidden: int  # per LSTM direction
    classes: int = 37  # blank + 10 digits + 26 letters


CONFIG_TABLE = {
    "full": CrnnSize(batch=8, height=32, width=128, channels=(64, 128, 256), hidden=256),
    "tiny": CrnnSize(batch=2, height=8, width=16, channels=(4, 8, 8), hidden=8),
}
KERNEL = 3
# The last pool halves only the height, keeping more columns (time steps) for the LSTM.
POOLS: tuple[tuple[int, int], ...] = ((2, 2), (2, 2), (2, 1))


def _after_pools(s: CrnnSize) -> tuple[int, int]:
    h, w = s.height, s.width
    for ph, pw in POOLS:
        h, w = h // ph, w // pw
    return h, w


def _build(config: str) -> ModelInstance:
    s = pick_config("crnn_infer", CONFIG_TABLE, config)
    t = ArgTable()
    t.data("image", (s.batch, s.height, s.width, 1))
    cin = 1
    for i, cout in enumerate(s.channels):
        t.weight(f"conv{i}_w", (KERNEL, KERNEL, cin, cout), fan_in=KERNEL * KERNEL * cin)
        t.bias(f"conv{i}_b", (cout,))
        cin = cout
    h_out, _ = _after_pools(s)
    features = h_out * s.channels[-1]
    for direction in ("fwd", "bwd"):
        t.weight(f"{direction}_wx", (features, 4 * s.hidden))
        t.weight(f"{direction}_wh", (s.hidden, 4 * s.hidden))
        t.bias(f"{direction}_b", (4 * s.hidden,))
    t.weight("out_w", (2 * s.hidden, s.classes))
    t.bias("out_b", (s.classes,))

    def fn(*args):
        p = t.bind(args)
        x = p["image"]
        for i, pool in enumerate(POOLS):
            x = blocks.relu(blocks.conv2d_nhwc(x, p[f"conv{i}_w"], p[f"conv{i}_b"]))
            x = blocks.max_pool_nhwc(x, pool, pool)
        b, h, w, c = x.shape
        # Columns become time steps: [B, H, W, C] -> [W, B, H * C].
        seq = x.transpose(2, 0, 1, 3).reshape(w, b, h * c)
        fwd = blocks.lstm_scan(seq, p, "fwd")
        bwd = blocks.lstm_scan(seq, p, "bwd", reverse=True)
        both = jnp.concatenate([fwd, bwd], axis=-1).transpose(1, 0, 2)  # [B, W, 2H]
        return blocks.softmax(blocks.dense(both, p["out_w"], p["out_b"]), axis=-1)

    return t.instance("crnn_infer", config, fn)


SPECS: tuple[ModelSpec, ...] = (
    ModelSpec(
        "crnn_infer",
        "CRNN inference: image[8,32,128,1] -> 3x(3x3 conv 64/128/256 + ReLU + maxpool "
        "2x2/2x2/2x1) -> height folded into features [8,32,1024] -> BiLSTM 2x256 (lax.scan) "
        "-> linear 37 classes -> softmax [8,32,37] (FusionStitching Table 1, batch 8)",
        "inference",
        CONFIGS,
        _build,
    ),
)
