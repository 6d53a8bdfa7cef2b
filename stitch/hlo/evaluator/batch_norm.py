"""batch-norm-training, batch-norm-inference, batch-norm-grad (as TensorFlow's XLA bridge
emits them), computed in f32 (f64 for f64) over every dimension but ``feature_index``.

Training uses the biased (population) variance; the gradient is the exact derivative of
training-mode normalisation with respect to operand, scale and offset.
"""
from __future__ import annotations

import numpy as np

from .dtypes import compute_dtype
from .registry import handles


def _setup(inst, x: np.ndarray):
    axis = inst.int("feature_index")
    axes = tuple(d for d in range(x.ndim) if d != axis)
    shape = [1] * x.ndim
    shape[axis] = x.shape[axis]
    eps = float(inst.attrs.get("epsilon", "0.001"))
    return axes, shape, eps


def _cast(values, dtype):
    return [np.asarray(v).astype(dtype) for v in values]


@handles("batch-norm-training")
def batch_norm_training(ev, inst, ops):
    x = np.asarray(ops[0])
    dtype = compute_dtype(x.dtype)
    x, scale, offset = _cast(ops, dtype)
    axes, shape, eps = _setup(inst, x)
    mean = x.mean(axis=axes, dtype=dtype)
    var = np.square(x - mean.reshape(shape)).mean(axis=axes, dtype=dtype)
    norm = (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + dtype.type(eps))
    out = norm * scale.reshape(shape) + offset.reshape(shape)
    return out, mean, var


@handles("batch-norm-inference")
def batch_norm_inference(ev, inst, ops):
    x = np.asarray(ops[0])
    dtype = compute_dtype(x.dtype)
    x, scale, offset, mean, var = _cast(ops, dtype)
    axes, shape, eps = _setup(inst, x)
    norm = (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + dtype.type(eps))
    return norm * scale.reshape(shape) + offset.reshape(shape)


@handles("batch-norm-grad")
def batch_norm_grad(ev, inst, ops):
    x = np.asarray(ops[0])
    dtype = compute_dtype(x.dtype)
    x, scale, mean, var, dy = _cast(ops, dtype)
    axes, shape, eps = _setup(inst, x)
    inv_std = 1 / np.sqrt(var + dtype.type(eps))
    centered = x - mean.reshape(shape)
    grad_offset = dy.sum(axis=axes, dtype=dtype)
    grad_scale = (dy * centered).sum(axis=axes, dtype=dtype) * inv_std
    count = dtype.type(max(x.size // max(int(np.prod(shape)), 1), 1))
    mean_dy = (grad_offset / count).reshape(shape)
    mean_dy_centered = ((dy * centered).sum(axis=axes, dtype=dtype) / count).reshape(shape)
    grad_x = (scale * inv_std).reshape(shape) * (
        dy - mean_dy - centered * mean_dy_centered * (inv_std ** 2).reshape(shape))
    return grad_x, grad_scale, grad_offset
