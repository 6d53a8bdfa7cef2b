"""Shared building blocks of the zoo, written with jax.numpy / jax.lax only.

Parameters arrive as explicit arrays (never closed-over constants) so that every weight is an
HLO parameter of the lowered module.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array
Params = Mapping[str, Array]
# loss(params, data) -> scalar: what a training step differentiates.
Loss = Callable[[Params, Params], Array]

SGD_LR = 0.01
# Additive mask value: large but finite so a fully masked row gives a uniform softmax, not NaN.
MASK_NEG = -1e9


# ----------------------------------------------------------------------------- elementwise


def gelu_erf(x: Array) -> Array:
    """Exact GELU: x * Phi(x), via erf (the BERT definition)."""
    return 0.5 * x * (1.0 + lax.erf(x * (1.0 / math.sqrt(2.0))))


def gelu_tanh(x: Array) -> Array:
    """tanh approximation of GELU (Hendrycks & Gimpel)."""
    inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + jnp.tanh(inner))


def relu(x: Array) -> Array:
    return jnp.maximum(x, 0.0)


# ------------------------------------------------------------------------------ reductions


def softmax(x: Array, axis: int = -1) -> Array:
    """Numerically stable softmax (max-subtracted), spelled out so the HLO shows both reduces."""
    shifted = x - lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
    e = jnp.exp(shifted)
    return e / jnp.sum(e, axis=axis, keepdims=True)


def log_softmax(x: Array, axis: int = -1) -> Array:
    shifted = x - lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
    return shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=axis, keepdims=True))


def cross_entropy(logits: Array, labels: Array) -> Array:
    """Mean softmax cross-entropy over all leading positions; labels are int class ids."""
    logp = log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, labels[..., None].astype(jnp.int32), axis=-1)
    return -jnp.mean(picked)


def layer_norm(x: Array, gamma: Array, beta: Array, axis: int = -1, eps: float = 1e-5) -> Array:
    """LayerNorm over one axis; gamma/beta have that axis' length and broadcast along it."""
    axis = axis % x.ndim
    mean = jnp.mean(x, axis=axis, keepdims=True)
    centered = x - mean
    var = jnp.mean(centered * centered, axis=axis, keepdims=True)
    # Reshape the 1-D affine params so they line up with `axis`, wherever it is.
    bshape = [1] * x.ndim
    bshape[axis] = x.shape[axis]
    return centered * lax.rsqrt(var + eps) * gamma.reshape(bshape) + beta.reshape(bshape)


# ---------------------------------------------------------------------------------- linear


def dense(x: Array, w: Array, b: Array | None = None) -> Array:
    """x[..., in] @ w[in, out] (+ b[out])."""
    y = jnp.einsum("...i,io->...o", x, w)
    return y if b is None else y + b


def mlp(x: Array, p: Params, prefix: str, n_layers: int, act: Callable[[Array], Array]) -> Array:
    """Stack of dense layers `{prefix}{i}_w/_b`; activation between layers, not after the last."""
    for i in range(n_layers):
        x = dense(x, p[f"{prefix}{i}_w"], p[f"{prefix}{i}_b"])
        if i + 1 < n_layers:
            x = act(x)
    return x


# ------------------------------------------------------------------------------- attention


def scaled_dot_attention(q: Array, k: Array, v: Array, bias: Array | None = None) -> Array:
    """softmax(q k^T / sqrt(d) + bias) v with q[..., M, d], k[..., N, d], v[..., N, h]."""
    scores = jnp.einsum("...md,...nd->...mn", q, k) * (1.0 / math.sqrt(q.shape[-1]))
    if bias is not None:
        scores = scores + bias
    return jnp.einsum("...mn,...nh->...mh", softmax(scores, axis=-1), v)


ATTN_PARAMS: tuple[str, ...] = ("wq", "bq", "wk", "bk", "wv", "bv", "wo", "bo")


def multi_head_attention(
    x_q: Array, x_kv: Array, p: Params, prefix: str, num_heads: int, bias: Array | None = None
) -> Array:
    """Multi-head attention on [B, L, D] inputs; `bias` broadcasts to [B, heads, Lq, Lk]."""
    b, lq, d = x_q.shape
    lk = x_kv.shape[1]
    dh = d // num_heads

    def heads(t: Array, length: int) -> Array:
        # [B, L, D] -> [B, heads, L, dh]
        return t.reshape(b, length, num_heads, dh).transpose(0, 2, 1, 3)

    q = heads(dense(x_q, p[f"{prefix}_wq"], p[f"{prefix}_bq"]), lq)
    k = heads(dense(x_kv, p[f"{prefix}_wk"], p[f"{prefix}_bk"]), lk)
    v = heads(dense(x_kv, p[f"{prefix}_wv"], p[f"{prefix}_bv"]), lk)
    ctx = scaled_dot_attention(q, k, v, bias)
    ctx = ctx.transpose(0, 2, 1, 3).reshape(b, lq, d)
    return dense(ctx, p[f"{prefix}_wo"], p[f"{prefix}_bo"])


def padding_bias(mask_add: Array) -> Array:
    """Additive key mask [B, Lk] -> [B, 1, 1, Lk] for multi_head_attention."""
    return mask_add[:, None, None, :]


def causal_bias(length: int, dtype=jnp.float32) -> Array:
    """[1, 1, L, L] additive mask hiding future positions (built from iota, not a literal)."""
    row = lax.broadcasted_iota(jnp.int32, (length, length), 0)
    col = lax.broadcasted_iota(jnp.int32, (length, length), 1)
    return jnp.where(col <= row, 0.0, MASK_NEG).astype(dtype)[None, None]


# ----------------------------------------------------------------------------- recurrences
# Input projections for all time steps are one batched matmul outside the scan; only the
# recurrent matmul stays inside, as cuDNN-style RNN implementations do.


def gru_scan(
    xs: Array, p: Params, prefix: str, gates: Array | None = None, mask: Array | None = None
) -> Array:
    """GRU over time-major xs[T, B, in] -> states[T, B, H] via lax.scan (an HLO while loop).

    Convention of the DIEN paper: h' = (1 - u) * h + u * h~. `gates[T, B]` scales the update
    gate (AUGRU when given attention scores); `mask[T, B]` (1 = valid) keeps h on padding.
    """
    w_x, w_h, bias = p[f"{prefix}_wx"], p[f"{prefix}_wh"], p[f"{prefix}_b"]
    hidden = w_h.shape[0]
    t, b = xs.shape[0], xs.shape[1]
    x_proj = dense(xs, w_x, bias)  # [T, B, 3H]
    ones = jnp.ones((t, b), xs.dtype)
    step_in = (x_proj, ones if gates is None else gates, ones if mask is None else mask)

    def step(h: Array, inp: tuple[Array, Array, Array]) -> tuple[Array, Array]:
        xp, g, m = inp
        hp = h @ w_h
        xu, xr, xn = jnp.split(xp, 3, axis=-1)
        hu, hr, hn = jnp.split(hp, 3, axis=-1)
        u = jax.nn.sigmoid(xu + hu) * g[:, None]
        r = jax.nn.sigmoid(xr + hr)
        n = jnp.tanh(xn + r * hn)
        h_new = (1.0 - u) * h + u * n
        h_new = m[:, None] * h_new + (1.0 - m[:, None]) * h
        return h_new, h_new

    h0 = jnp.zeros((b, hidden), xs.dtype)
    _, states = lax.scan(step, h0, step_in)
    return states


def lstm_scan(xs: Array, p: Params, prefix: str, reverse: bool = False) -> Array:
    """LSTM over time-major xs[T, B, in] -> hidden states[T, B, H] via lax.scan."""
    w_x, w_h, bias = p[f"{prefix}_wx"], p[f"{prefix}_wh"], p[f"{prefix}_b"]
    hidden = w_h.shape[0]
    b = xs.shape[1]
    x_proj = dense(xs, w_x, bias)  # [T, B, 4H]

    def step(carry: tuple[Array, Array], xp: Array) -> tuple[tuple[Array, Array], Array]:
        h, c = carry
        z = xp + h @ w_h
        i, f, g, o = jnp.split(z, 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c), h

    zeros = jnp.zeros((b, hidden), xs.dtype)
    _, hs = lax.scan(step, (zeros, zeros), x_proj, reverse=reverse)
    return hs


# ----------------------------------------------------------------------------- convolution


def conv2d_nhwc(
    x: Array, w: Array, b: Array, stride: tuple[int, int] = (1, 1), padding: str = "SAME"
) -> Array:
    """2-D convolution, NHWC input and HWIO kernel."""
    y = lax.conv_general_dilated(
        x, w, window_strides=stride, padding=padding, dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return y + b


def max_pool_nhwc(x: Array, window: tuple[int, int], stride: tuple[int, int]) -> Array:
    """Max pooling over H and W with lax.reduce_window (VALID padding)."""
    return lax.reduce_window(
        x, -jnp.inf, lax.max, (1, *window, 1), (1, *stride, 1), padding="VALID"
    )


# -------------------------------------------------------------------------------- training


def sgd_step(
    loss_fn: Loss,
    data_names: Sequence[str],
    param_names: Sequence[str],
    lr: float = SGD_LR,
) -> Callable[..., tuple[Array, ...]]:
    """Wrap loss(params, data) into fn(*data, *params) -> (loss, *params - lr * grads).

    value_and_grad over the parameter tuple puts forward, backward and update in one HLO.
    """
    n_data = len(data_names)
    data_names = tuple(data_names)
    param_names = tuple(param_names)

    def step(*args: Array) -> tuple[Array, ...]:
        if len(args) != n_data + len(param_names):
            raise TypeError(f"expected {n_data + len(param_names)} args, got {len(args)}")
        data = dict(zip(data_names, args[:n_data]))
        params = tuple(args[n_data:])

        def loss_of(ps: tuple[Array, ...]) -> Array:
            return loss_fn(dict(zip(param_names, ps)), data)

        loss, grads = jax.value_and_grad(loss_of)(params)
        return (loss, *(w - lr * g for w, g in zip(params, grads)))

    return step
