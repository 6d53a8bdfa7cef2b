"""ASR-like acoustic model (DeepSpeech-2 style), FusionStitching's speech workload:
two stride-2 2-D convs over a log-mel spectrogram, a 2-layer LSTM, per-frame char log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import blocks
from .spec import CONFIGS, ArgTable, ModelInstance, ModelSpec, pick_config


@dataclass(frozen=True)
class AsrSize:
    batch: int
    frames: int
    mels: int
    channels: int  # conv output channels
    hidden: int  # LSTM hidden size
    chars: int = 29  # blank, space, apostrophe, a-z


CONFIG_TABLE = {
    "full": AsrSize(batch=8, frames=400, mels=80, channels=32, hidden=512),
    "tiny": AsrSize(batch=2, frames=16, mels=8, channels=4, hidden=16),
}
KERNEL = 3
LSTM_LAYERS = 2


def _down(n: int) -> int:
    """Length after a stride-2 SAME conv."""
    return -(-n // 2)


def _build(config: str) -> ModelInstance:
    s = pick_config("asr_infer", CONFIG_TABLE, config)
    t = ArgTable()
    t.data("spectrogram", (s.batch, s.frames, s.mels, 1))
    cin = 1
    for i in range(2):
        t.weight(f"conv{i}_w", (KERNEL, KERNEL, cin, s.channels), fan_in=KERNEL * KERNEL * cin)
        t.bias(f"conv{i}_b", (s.channels,))
        cin = s.channels
    width = _down(_down(s.mels)) * s.channels
    for i in range(LSTM_LAYERS):
        t.weight(f"lstm{i}_wx", (width, 4 * s.hidden))
        t.weight(f"lstm{i}_wh", (s.hidden, 4 * s.hidden))
        t.bias(f"lstm{i}_b", (4 * s.hidden,))
        width = s.hidden
    t.weight("out_w", (s.hidden, s.chars))
    t.bias("out_b", (s.chars,))

    def fn(*args):
        p = t.bind(args)
        x = p["spectrogram"]
        for i in range(2):
            x = blocks.relu(blocks.conv2d_nhwc(x, p[f"conv{i}_w"], p[f"conv{i}_b"], (2, 2)))
        b, frames, mels, ch = x.shape
        x = x.reshape(b, frames, mels * ch).transpose(1, 0, 2)  # time-major [T', B, F]
        for i in range(LSTM_LAYERS):
            x = blocks.lstm_scan(x, p, f"lstm{i}")
        logits = blocks.dense(x.transpose(1, 0, 2), p["out_w"], p["out_b"])
        return blocks.log_softmax(logits, axis=-1)  # [B, T', chars]

    return t.instance("asr_infer", config, fn)


SPECS: tuple[ModelSpec, ...] = (
    ModelSpec(
        "asr_infer",
        "ASR inference: spectrogram[8,400,80,1] -> two 3x3 stride-2 convs (32 ch, ReLU) -> "
        "2-layer LSTM (hidden 512, lax.scan) -> linear 29 chars -> log_softmax [8,100,29] "
        "(FusionStitching Table 1, batch 8)",
        "inference",
        CONFIGS,
        _build,
    ),
)
