"""bench/real_steps.py at small sizes on the CPU: the steps the real-size bench compiles are
real training steps (loss at init, AdamW's update, shapes, donation)."""
from __future__ import annotations

import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from bench import real_steps as rs  # noqa: E402

SMALL = dict(batch=2, seq=16, d_model=32, heads=4, mlp=64, vocab=97)
CASES = [("gpt2", "float32"), ("llama", "bfloat16")]


def _init(cfg: rs.StepConfig, seed: int):
    """Fresh random parameters as a model initializes them: small weights, unit gains,
    zero biases; zero optimizer state; random tokens."""
    rng = np.random.default_rng(seed)
    _, (specs, *_rest) = rs.step_specs(cfg)
    params = {}
    for name, spec in specs.items():
        if name.endswith(("_g", "norm1", "norm2", "normf")) or name in ("lnf_g",):
            value = np.ones(spec.shape, np.float32)
        elif name.endswith(("_b", "bqkv", "bo", "b1", "b2")) or name == "lnf_b":
            value = np.zeros(spec.shape, np.float32)
        else:
            value = rng.normal(0.0, 0.02, spec.shape).astype(np.float32)
        params[name] = jnp.asarray(value)
    zeros = {k: jnp.zeros_like(v) for k, v in params.items()}
    tokens = rng.integers(0, cfg.vocab, (2, cfg.batch, cfg.seq), dtype=np.int32)
    return params, zeros, jnp.asarray(tokens[0]), jnp.asarray(tokens[1])


# Tiny programs: LLVM's optimizations would take most of the test's time.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@pytest.mark.parametrize("family,dtype", CASES)
def test_small_step_trains(family, dtype):
    cfg = rs.config(family, 1, dtype, **SMALL)
    params, zeros, ids, labels = _init(cfg, seed=np.random.SeedSequence().entropy % 2**32)
    state = (params, zeros, {k: jnp.zeros_like(v) for k, v in zeros.items()},
             jnp.zeros((), jnp.int32))
    step = jax.jit(rs.train_step(cfg), donate_argnums=rs.DONATED).lower(
        *state, ids, labels).compile(compiler_options=FAST_COMPILE)
    before = {k: np.array(v, copy=True) for k, v in params.items()}
    leaves_in = [(x.shape, x.dtype) for x in jax.tree.leaves(state)]
    loss, *state = step(*state, ids, labels)
    state = tuple(state)
    # Outputs: the loss a f32 scalar, the state exactly the shapes and types it came in.
    assert loss.shape == () and loss.dtype == jnp.float32
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(state)] == leaves_in
    assert int(state[3]) == 1
    # Near-uniform predictions at init: the loss (of the parameters before the update) is
    # about ln(vocab).
    first = float(loss)
    assert math.isfinite(first) and abs(first - math.log(cfg.vocab)) < 0.05 * math.log(cfg.vocab)
    # AdamW's first step from zero moments: m = (1 − β1) g and v = (1 − β2) g², so
    # v = (1 − β2) / (1 − β1)² m², and w' = w − lr (g / (|g| + eps) + wd · w).
    for name in ("wte", "h0_wo", "h0_w1" if family == "gpt2" else "h0_w_gate"):
        m, v = np.asarray(state[1][name]), np.asarray(state[2][name])
        g = m / (1 - rs.BETA1)
        assert np.abs(g).max() > 0, name
        np.testing.assert_allclose(v, (1 - rs.BETA2) * g * g, rtol=1e-4,
                                   atol=1e-30)
        want = before[name] - rs.LEARNING_RATE * (g / (np.abs(g) + rs.EPS)
                                                 + rs.WEIGHT_DECAY * before[name])
        np.testing.assert_allclose(np.asarray(state[0][name]), want, atol=1e-6, rtol=1e-5)

    losses = [first]
    for _ in range(3):
        loss, *state = step(*state, ids, labels)
        state = tuple(state)
        losses.append(float(loss))
    assert all(math.isfinite(x) for x in losses)
    # One fixed batch: AdamW drives its loss down step after step.
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


def test_donation_is_the_optimizer_state():
    cfg = rs.config("gpt2", 1, **SMALL)
    fn, args = rs.step_specs(cfg)
    lowered = jax.jit(fn, donate_argnums=rs.DONATED).lower(*args)
    donated = [[leaf.donated for leaf in jax.tree.leaves(info)]
               for info in lowered.args_info[0]]
    # params, m, v and the step count are donated; the token batches are not.
    assert [all(d) for d in donated] == [True, True, True, True, False, False]
    assert rs.parameter_count(cfg) == sum(
        math.prod(s.shape) for s in jax.tree.leaves(args[0]))
