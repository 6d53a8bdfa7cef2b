"""Real-size training steps written as users write them: plain JAX, AdamW by hand.

Two families, at the sizes the field trains them:

* ``gpt2``: GPT-2 small — d 768, 12 heads, MLP 3072, seq 1024, batch 8, vocab 50257, tied LM head,
  learned positions, LayerNorm, GELU (tanh), softmax cross-entropy. Attention is written out:
  QKᵀ, scale, causal mask (iota compare + select), softmax, PV.
* ``llama``: a Llama-style step — d 2048, 16 heads, MLP 5632 (SwiGLU), seq 2048, batch 4,
  vocab 32000, RMSNorm, rotary positions, untied LM head, f32 master weights with bf16 compute.

``step_specs(config)`` gives the step function and its arguments as ``jax.ShapeDtypeStruct``
(nothing is allocated), with parameters and optimizer state donated as a real loop does;
``lower_for(config, topology_devices)`` lowers it for a deviceless topology. The steps never
allocate: the bench compiles them (``python -m bench delivered --part real``,
``python -m bench compile --part real``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable

# AdamW's constants (the values optax.adamw defaults to, with a small learning rate).
LEARNING_RATE = 3e-4
BETA1, BETA2, EPS, WEIGHT_DECAY = 0.9, 0.999, 1e-8, 1e-4
MASK_VALUE = -1e9


@dataclass(frozen=True)
class StepConfig:
    """One real-size step: family, depth and compute dtype (everything else from the family)."""

    family: str            # "gpt2" | "llama"
    layers: int
    dtype: str = "float32"  # compute dtype; master weights and optimizer state stay f32
    batch: int = 0
    seq: int = 0
    d_model: int = 0
    heads: int = 0
    mlp: int = 0
    vocab: int = 0

    @property
    def name(self) -> str:
        suffix = "" if self.dtype == "float32" else f" {self.dtype.replace('float', 'f')}"
        family = {"gpt2": "GPT-2 small", "llama": "Llama-style"}[self.family]
        return f"{family}, {self.layers} layer{'s' if self.layers != 1 else ''}{suffix}"


FAMILY_SIZES = {
    "gpt2": dict(batch=8, seq=1024, d_model=768, heads=12, mlp=3072, vocab=50257),
    "llama": dict(batch=4, seq=2048, d_model=2048, heads=16, mlp=5632, vocab=32000),
}


def config(family: str, layers: int, dtype: str = "float32", **sizes: int) -> StepConfig:
    """The family's real sizes, overridden by ``sizes`` (tests use small ones)."""
    if family not in FAMILY_SIZES:
        raise ValueError(f"unknown step family {family!r}; known: {sorted(FAMILY_SIZES)}")
    return replace(StepConfig(family, layers, dtype), **{**FAMILY_SIZES[family], **sizes})


# The bench's rows (one compile each).
REAL_STEPS: tuple[StepConfig, ...] = (
    config("gpt2", 1), config("gpt2", 12), config("gpt2", 12, "bfloat16"),
    config("gpt2", 48), config("llama", 8, "bfloat16"),
)


def _param_shapes(cfg: StepConfig) -> dict[str, tuple[int, ...]]:
    d, f = cfg.d_model, cfg.mlp
    shapes: dict[str, tuple[int, ...]] = {"wte": (cfg.vocab, d)}
    if cfg.family == "gpt2":
        shapes |= {"wpe": (cfg.seq, d), "lnf_g": (d,), "lnf_b": (d,)}
        per_layer = {"ln1_g": (d,), "ln1_b": (d,), "wqkv": (d, 3 * d), "bqkv": (3 * d,),
                     "wo": (d, d), "bo": (d,), "ln2_g": (d,), "ln2_b": (d,),
                     "w1": (d, f), "b1": (f,), "w2": (f, d), "b2": (d,)}
    else:
        shapes |= {"normf": (d,), "lm_head": (d, cfg.vocab)}
        per_layer = {"norm1": (d,), "wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d),
                     "norm2": (d,), "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}
    for i in range(cfg.layers):
        shapes |= {f"h{i}_{n}": s for n, s in per_layer.items()}
    return shapes


def _loss_fn(cfg: StepConfig) -> Callable[..., Any]:
    import jax
    import jax.numpy as jnp
    from jax import lax

    b, s, d, h = cfg.batch, cfg.seq, cfg.d_model, cfg.heads
    hd = d // h
    compute = jnp.dtype(cfg.dtype)

    def split_heads(t):
        return t.reshape(b, s, h, hd).transpose(0, 2, 1, 3)

    def attention(q, k, v):
        scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) * (1.0 / math.sqrt(hd))
        row = lax.broadcasted_iota(jnp.int32, (s, s), 0)
        col = lax.broadcasted_iota(jnp.int32, (s, s), 1)
        scores = jnp.where(col <= row, scores, jnp.asarray(MASK_VALUE, scores.dtype))
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(compute)
        ctx = jnp.einsum("bhqk,bhkd->bhqd", probs, v)
        return ctx.transpose(0, 2, 1, 3).reshape(b, s, d)

    def layer_norm(x, g, beta):
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
        return ((x32 - mean) * lax.rsqrt(var + 1e-5) * g + beta).astype(compute)

    def rms_norm(x, g):
        x32 = x.astype(jnp.float32)
        return (x32 * lax.rsqrt((x32 * x32).mean(-1, keepdims=True) + 1e-6) * g).astype(compute)

    def rotary(t):
        # t: [b, h, s, hd]; rotate halves by position-dependent angles.
        half = hd // 2
        inv = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
        angles = jnp.arange(s, dtype=jnp.float32)[:, None] * inv[None, :]
        cos, sin = jnp.cos(angles).astype(t.dtype), jnp.sin(angles).astype(t.dtype)
        t1, t2 = t[..., :half], t[..., half:]
        return jnp.concatenate([t1 * cos - t2 * sin, t1 * sin + t2 * cos], axis=-1)

    def cross_entropy(logits, labels):
        logits = logits.astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, labels[..., None], axis=-1).mean()

    def gpt2(p, ids, labels):
        c = {k: v.astype(compute) for k, v in p.items()}
        x = c["wte"][ids] + c["wpe"][None]
        for i in range(cfg.layers):
            q = lambda n: c[f"h{i}_{n}"]  # noqa: E731
            y = layer_norm(x, q("ln1_g"), q("ln1_b"))
            qq, kk, vv = jnp.split(y @ q("wqkv") + q("bqkv"), 3, axis=-1)
            x = x + attention(split_heads(qq), split_heads(kk), split_heads(vv)) @ q("wo") \
                + q("bo")
            y = layer_norm(x, q("ln2_g"), q("ln2_b"))
            x = x + jax.nn.gelu(y @ q("w1") + q("b1"), approximate=True) @ q("w2") + q("b2")
        x = layer_norm(x, c["lnf_g"], c["lnf_b"])
        return cross_entropy(jnp.einsum("bsd,vd->bsv", x, c["wte"]), labels)

    def llama(p, ids, labels):
        c = {k: v.astype(compute) for k, v in p.items()}
        x = c["wte"][ids]
        for i in range(cfg.layers):
            q = lambda n: c[f"h{i}_{n}"]  # noqa: E731
            y = rms_norm(x, q("norm1"))
            qq, kk, vv = (split_heads(y @ q(w)) for w in ("wq", "wk", "wv"))
            x = x + attention(rotary(qq), rotary(kk), vv) @ q("wo")
            y = rms_norm(x, q("norm2"))
            x = x + (jax.nn.silu(y @ q("w_gate")) * (y @ q("w_up"))) @ q("w_down")
        x = rms_norm(x, c["normf"])
        return cross_entropy(x @ c["lm_head"], labels)

    return gpt2 if cfg.family == "gpt2" else llama


def train_step(cfg: StepConfig) -> Callable[..., Any]:
    """(params, m, v, count, ids, labels) -> (loss, params, m, v, count): one AdamW step."""
    import jax
    import jax.numpy as jnp

    loss_fn = _loss_fn(cfg)

    def step(params, m, v, count, ids, labels):
        loss, grads = jax.value_and_grad(loss_fn)(params, ids, labels)
        count = count + 1
        c1 = 1.0 - BETA1 ** count.astype(jnp.float32)
        c2 = 1.0 - BETA2 ** count.astype(jnp.float32)
        m = jax.tree.map(lambda m_, g: BETA1 * m_ + (1 - BETA1) * g, m, grads)
        v = jax.tree.map(lambda v_, g: BETA2 * v_ + (1 - BETA2) * g * g, v, grads)
        params = jax.tree.map(
            lambda w, m_, v_: w - LEARNING_RATE * ((m_ / c1) / (jnp.sqrt(v_ / c2) + EPS)
                                                   + WEIGHT_DECAY * w),
            params, m, v)
        return loss, params, m, v, count

    return step


DONATED = (0, 1, 2, 3)  # params, m, v, count: updated in place by a real training loop


def step_specs(cfg: StepConfig, sharding: Any = None) -> tuple[Callable[..., Any], tuple]:
    """The step and its arguments as ShapeDtypeStructs (``sharding`` on each, if given)."""
    import jax
    import jax.numpy as jnp

    def spec(shape, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    params = {k: spec(s) for k, s in _param_shapes(cfg).items()}
    tokens = spec((cfg.batch, cfg.seq), jnp.int32)
    return train_step(cfg), (params, params, params, spec((), jnp.int32), tokens, tokens)


def parameter_count(cfg: StepConfig) -> int:
    return sum(math.prod(s) for s in _param_shapes(cfg).values())


def lower_for(cfg: StepConfig, target: str = "h100") -> Any:
    """``jax.jit(step, donate_argnums=DONATED).lower(...)`` for one deviceless ``target``
    device (needs jax's CUDA plugin: scripts/deviceless_check.sh makes the venv)."""
    import jax
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    from stitch.xla_pass import deviceless

    mesh = topologies.make_mesh(deviceless.topology(target, "1x1x1"), (1,), ("d",))
    fn, args = step_specs(cfg, NamedSharding(mesh, PartitionSpec()))
    return jax.jit(fn, donate_argnums=DONATED).lower(*args)
