"""MCFuser's memory-bound compute-intensive subgraphs: batch GEMM chains (Table II) and
self-attention modules (Table III) of MCFuser (Zhang et al.), one model per table row.

Reading of the tables (shared/papers/mcfuser.txt, section VI):
- Table II rows "G1/G2/G3 1 512 256 64 64/128/256" list columns batch M N K H; a slash splits a
  row into several configurations element-wise, the other columns being shared.
- The chain is (b,M,K) x (b,K,N) -> (b,M,N), then (b,M,N) x (b,N,H) -> (b,M,H) (§VI-B1).
- Table III uses the same M, N, K, H: Q[h,M,K], Kmat[h,N,K], V[h,N,H], out = softmax(Q Kmat^T
  / sqrt(K)) V [h,M,H], with #heads as the batch dimension (batch 1; no batch column is given).
- S7/S8/S9 (MLP-Mixer, 1 head) pair M 512/768/1024 with N 256/384/512 element-wise; we name them
  mlp_mixer_s/b/l in that order.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from . import blocks
from .spec import CONFIGS, ArgTable, ModelInstance, ModelSpec, pick_config


@dataclass(frozen=True)
class ChainShape:
    batch: int
    m: int
    n: int
    k: int
    h: int

    def tiny(self) -> "ChainShape":
        """Every dim at most 16: matrix dims divided by 16 (kept in [4, 16]), batch kept."""

        def shrink(d: int) -> int:
            return max(4, min(16, d // 16))

        return ChainShape(min(self.batch, 16), shrink(self.m), shrink(self.n),
                          shrink(self.k), shrink(self.h))

    def text(self) -> str:
        return f"batch={self.batch} M={self.m} N={self.n} K={self.k} H={self.h}"


# Table II: the Configuration of Batch GEMM chains (batch, M, N, K, H).
GEMM_CHAINS: dict[str, ChainShape] = {
    "g1": ChainShape(1, 512, 256, 64, 64),
    "g2": ChainShape(1, 512, 256, 64, 128),
    "g3": ChainShape(1, 512, 256, 64, 256),
    "g4": ChainShape(1, 512, 512, 256, 256),
    "g5": ChainShape(1, 512, 512, 512, 256),
    "g6": ChainShape(1, 512, 512, 1024, 256),
    "g7": ChainShape(1, 512, 512, 128, 128),
    "g8": ChainShape(1, 1024, 512, 128, 128),
    "g9": ChainShape(1, 2048, 512, 128, 128),
    "g10": ChainShape(1, 1024, 1024, 128, 128),
    "g11": ChainShape(4, 1024, 1024, 128, 128),
    "g12": ChainShape(8, 1024, 1024, 128, 128),
}

# Table III: the Configurations of Self Attention Modules (#heads as batch, M, N, K, H).
_MIXER = "MLP-Mixer; M/N of the row paired element-wise, named {} by row order"
ATTENTIONS: dict[str, tuple[str, str, ChainShape]] = {
    "bert_small": ("S1", "Bert-Small", ChainShape(8, 512, 512, 64, 64)),
    "bert_base": ("S2", "Bert-Base", ChainShape(12, 512, 512, 64, 64)),
    "bert_large": ("S3", "Bert-Large", ChainShape(16, 512, 512, 64, 64)),
    "vit_base": ("S4", "ViT-Base", ChainShape(12, 256, 256, 64, 64)),
    "vit_large": ("S5", "ViT-Large", ChainShape(16, 256, 256, 64, 64)),
    "vit_huge": ("S6", "ViT-Huge", ChainShape(16, 256, 256, 80, 80)),
    "mlp_mixer_s": ("S7", _MIXER.format("S"), ChainShape(1, 512, 256, 64, 64)),
    "mlp_mixer_b": ("S8", _MIXER.format("B"), ChainShape(1, 768, 384, 64, 64)),
    "mlp_mixer_l": ("S9", _MIXER.format("L"), ChainShape(1, 1024, 512, 64, 64)),
}


def _gemm_chain_builder(name: str, full: ChainShape):
    def build(config: str) -> ModelInstance:
        s = pick_config(name, {"full": full, "tiny": full.tiny()}, config)
        t = ArgTable()
        # Operand scales keep every product O(1): 1/sqrt of the reduced dimension.
        t.data("a", (s.batch, s.m, s.k))
        t.data("b", (s.batch, s.k, s.n), scale=s.k**-0.5)
        t.data("c", (s.batch, s.n, s.h), scale=s.n**-0.5)

        def fn(a, b, c):
            ab = jnp.einsum("bmk,bkn->bmn", a, b)
            return jnp.einsum("bmn,bnh->bmh", ab, c)

        return t.instance(name, config, fn)

    return build


def _attention_builder(name: str, full: ChainShape):
    def build(config: str) -> ModelInstance:
        s = pick_config(name, {"full": full, "tiny": full.tiny()}, config)
        t = ArgTable()
        t.data("q", (s.batch, s.m, s.k))
        t.data("k", (s.batch, s.n, s.k))
        t.data("v", (s.batch, s.n, s.h))
        return t.instance(name, config, blocks.scaled_dot_attention)

    return build


def _specs() -> tuple[ModelSpec, ...]:
    specs: list[ModelSpec] = []
    for gid, shape in GEMM_CHAINS.items():
        name = f"gemm_chain_{gid}"
        specs.append(
            ModelSpec(
                name,
                f"MCFuser Table II {gid.upper()} batch GEMM chain (b,M,K)x(b,K,N)x(b,N,H) -> "
                f"(b,M,H) with {shape.text()}",
                "inference",
                CONFIGS,
                _gemm_chain_builder(name, shape),
            )
        )
    for key, (sid, network, shape) in ATTENTIONS.items():
        name = f"attention_{key}"
        specs.append(
            ModelSpec(
                name,
                f"MCFuser Table III {sid} ({network}) self-attention softmax(Q K^T/sqrt(K)) V, "
                f"q[h,M,K] k[h,N,K] v[h,N,H] with heads={shape.batch} M={shape.m} N={shape.n} "
                f"K={shape.k} H={shape.h}, batch 1",
                "inference",
                CONFIGS,
                _attention_builder(name, shape),
            )
        )
    return tuple(specs)


SPECS: tuple[ModelSpec, ...] = _specs()
