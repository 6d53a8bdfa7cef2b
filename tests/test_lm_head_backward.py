"""The LM head + cross-entropy backward kernel (stitch/codegen/lm_head_backward.py): dH and
dE from H, E, the labels, the forward's lse and the per-row cotangent g, the logits tiles
recomputed, no [rows, vocab] buffer. Host runs with fresh random inputs and NaN-poisoned
outputs against jax's float64 gradient of optax's formula (logsumexp(S) - S[label] through
take_along_axis: negative labels from the end, labels outside the vocabulary without a
one-hot; masked rows g = 0): f32 FMA 1e-5, TF32 tensor cores 5e-3, bf16 tensor cores 3e-2
of the largest gradient. PTX at GPT-2 small's size (8192 x 50257 x 768) without spills on
sm_80 / sm_90."""
from __future__ import annotations

import numpy as np
import pytest

from stitch.codegen import kir
from stitch.codegen.attention_backward import BackwardTiling
from stitch.codegen.errors import CodegenError
from stitch.codegen.host import NUMPY_DTYPES, compile_host
from stitch.codegen.lm_head_backward import (DEMB, DH, INPUTS, LmHeadBackward, lower_demb,
                                             lower_dh, lower_lm_head_backward)
from tests.test_lm_head_loss import ptxas_or_skip

R, V, D = 37, 91, 12       # tokens, vocabulary, hidden: no tile divides them

_FMA = BackwardTiling(block_rows=16, block_cols=16, thread_rows=4, thread_cols=2,
                      block_k=4, block_h=8)
_MMA = BackwardTiling(block_rows=16, block_cols=16, thread_rows=1, thread_cols=1,
                      block_k=16, block_h=8, mma=True)


def _inputs(problem: LmHeadBackward, seed: int) -> dict[str, np.ndarray]:
    """H, E in the operands' type; labels with negative ones and some past the vocabulary;
    g with masked (zero) rows; lse in float64 from the operands as stored."""
    rng = np.random.default_rng(seed)
    store = NUMPY_DTYPES[problem.dtype]
    h = rng.standard_normal((problem.rows, problem.hidden)).astype(store)
    e = rng.standard_normal((problem.vocab, problem.hidden)).astype(store)
    labels = rng.integers(-problem.vocab, problem.vocab + 4, problem.rows).astype(np.int32)
    g = rng.standard_normal(problem.rows).astype(np.float32)
    g[rng.random(problem.rows) < 0.2] = 0.0
    s = h.astype(np.float64) @ e.astype(np.float64).T
    top = s.max(1)
    lse = top + np.log(np.exp(s - top[:, None]).sum(1))
    return {"h": h, "emb": e, "labels": labels, "lse": lse.astype(np.float32), "g": g}


def _jax_grads(values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import jax
    import jax.numpy as jnp

    labels = jnp.asarray(values["labels"])

    def loss(h, e):
        s = h @ e.T
        picked = jnp.take_along_axis(s, labels[:, None], axis=-1)[:, 0]
        per_row = jax.nn.logsumexp(s, axis=-1) - jnp.where(jnp.isnan(picked), 0.0, picked)
        return (jnp.asarray(values["g"], jnp.float64) * per_row).sum()

    with jax.enable_x64(True):
        wide = [jnp.asarray(values[n], jnp.float64) for n in ("h", "emb")]
        dh, de = jax.grad(loss, (0, 1))(*wide)
        return {DH: np.asarray(dh), DEMB: np.asarray(de)}


def _run(kernel: kir.Kernel, problem: LmHeadBackward, seed: int, tol: float) -> None:
    values = _inputs(problem, seed)
    want = _jax_grads(values)
    names = [p.name for p in kernel.params]
    assert names[:len(INPUTS)] == list(INPUTS)
    outs = kernel.params[len(INPUTS):]
    results = [np.full(p.size, np.nan, NUMPY_DTYPES[p.dtype]) for p in outs]
    compile_host(kernel, opt=0)(*(np.ascontiguousarray(values[n]).reshape(-1)
                                  for n in INPUTS), *results)
    for param, got in zip(outs, results):
        assert not np.isnan(got).any(), f"{param.name}: poisoned elements left"
        expected = want[param.name]
        got = got.astype(np.float64).reshape(expected.shape)
        np.testing.assert_allclose(got, expected, rtol=tol,
                                   atol=tol * np.abs(expected).max(), err_msg=param.name)


def test_one_launch_f32_with_edges_no_tile_divides() -> None:
    """Both phases in one launch (dH blocks first), FMA; partial row, vocabulary and
    hidden tiles; masked rows, negative labels and labels past the vocabulary."""
    problem = LmHeadBackward(R, V, D)
    kernel = lower_lm_head_backward(problem, _FMA)
    assert [p.name for p in kernel.params] == [*INPUTS, DH, DEMB]
    _run(kernel, problem, seed=41, tol=1e-5)


@pytest.mark.parametrize("phase", (DH, DEMB))
def test_each_phase_alone_at_default_tiles(phase: str) -> None:
    problem = LmHeadBackward(70, 130, 20)
    kernel = (lower_dh if phase == DH else lower_demb)(problem)
    assert [p.name for p in kernel.params] == [*INPUTS, phase]
    _run(kernel, problem, seed=42, tol=1e-5)


def test_tensor_cores_tf32() -> None:
    problem = LmHeadBackward(R, V, 24, tf32=True)
    kernel = lower_lm_head_backward(problem, _MMA, arch="sm_80", allow_tf32=True)
    assert any(isinstance(st, kir.MmaSync) for st in kir.walk_stmts(kernel.body))
    _run(kernel, problem, seed=43, tol=5e-3)


def test_tensor_cores_bf16_with_bf16_logits() -> None:
    """bf16 operands and logits (XLA's bf16 step: S and dS rounded as it stores them)."""
    problem = LmHeadBackward(R, V, 32, "bf16", "bf16")
    kernel = lower_lm_head_backward(problem, _MMA, arch="sm_90")
    assert any(isinstance(st, kir.MmaSync) for st in kir.walk_stmts(kernel.body))
    _run(kernel, problem, seed=44, tol=3e-2)


def test_refused_problems() -> None:
    with pytest.raises(CodegenError):       # f32 dots that ask for full precision
        lower_lm_head_backward(LmHeadBackward(R, V, D), _MMA, arch="sm_90", allow_tf32=True)
    with pytest.raises(CodegenError):       # tensor cores before sm_80
        lower_lm_head_backward(LmHeadBackward(R, V, 32, "bf16"), _MMA, arch="sm_70")
    with pytest.raises(CodegenError):
        lower_dh(LmHeadBackward(R, V, D, "bf16", "f16"))
    with pytest.raises(CodegenError):
        lower_dh(LmHeadBackward(R, V, D, "f64"))


@pytest.mark.parametrize("arch", ("sm_80", "sm_90"))
@pytest.mark.parametrize("dtype", ("f32", "tf32", "bf16"))
def test_ptx_assembles_without_spills(dtype: str, arch: str) -> None:
    """GPT-2 small's LM head (8 x 1024 tokens, vocabulary 50257, 768 wide) in XLA's
    training form (the layer norm's scale and shift on load, row max and sum), default
    tiles, the one-launch kernel: f32 on FMA, f32 as TF32 and bf16 (bf16 logits) on
    tensor cores (result blocks of 256: 250-254 registers)."""
    from stitch.codegen.nvptx import emit_ptx
    from stitch.codegen.toolchain import assemble
    ptxas_or_skip(arch)
    store = "f32" if dtype == "tf32" else dtype
    problem = LmHeadBackward(8192, 50257, 768, store, store, tf32=dtype == "tf32",
                             norm_affine=True, stats="max_sum")
    kernel = lower_lm_head_backward(problem, name="bwd", arch=arch,
                                    allow_tf32=dtype == "tf32")
    assert any(isinstance(st, kir.MmaSync) for st in kir.walk_stmts(kernel.body)) == \
        (dtype != "f32")
    report = assemble(emit_ptx(kernel, arch), arch, kernel_name="bwd")["bwd"]
    assert report.spill_store_bytes == 0 and report.spill_load_bytes == 0, report
    assert 0 < report.registers <= 255


@pytest.mark.parametrize("dtype,tiling,tol", (("f32", _FMA, 1e-5), ("bf16", _MMA, 3e-2)),
                         ids=("f32-fma", "bf16-mma"))
def test_xla_training_form_inputs(dtype: str, tiling: BackwardTiling, tol: float) -> None:
    """XLA's GPT-2 training form: H given as the normalized x with the layer norm's scale
    and shift applied on load, the row max and sum of exp instead of lse, g the lse
    cotangent of jax's log_softmax form (0 where the label is out of range): against
    jax's gradient of -log_softmax(S)[label] with respect to H and E."""
    import jax
    import jax.numpy as jnp
    problem = LmHeadBackward(R, V, 32, dtype, dtype, norm_affine=True, stats="max_sum")
    kernel = lower_lm_head_backward(problem, tiling, arch="sm_90")
    names = [p.name for p in kernel.params]
    assert names == ["h", "emb", "labels", "row_max", "row_sum", "g", "ln_scale",
                     "ln_shift", DH, DEMB]
    rng = np.random.default_rng(45)
    store = NUMPY_DTYPES[dtype]
    x = rng.standard_normal((R, 32)).astype(store)
    scale = (1 + 0.3 * rng.standard_normal(32)).astype(store)
    shift = (0.2 * rng.standard_normal(32)).astype(store)
    e = rng.standard_normal((V, 32)).astype(store)
    h = x.astype(np.float64) * scale.astype(np.float64) + shift.astype(np.float64)
    labels = rng.integers(-V, V + 4, R).astype(np.int32)
    wrapped = np.where(labels < 0, labels + V, labels)
    mean = 1.0 / R
    g = np.where((wrapped >= 0) & (wrapped < V), mean, 0.0).astype(np.float32)
    s = h @ e.astype(np.float64).T
    top = s.max(1)
    total = np.exp(s - top[:, None]).sum(1)

    def loss(h, e):
        logp = jax.nn.log_softmax(h @ e.T, axis=-1)
        picked = jnp.take_along_axis(logp, jnp.asarray(labels)[:, None], axis=-1)[:, 0]
        return -mean * jnp.where(jnp.isnan(picked), 0.0, picked).sum()

    with jax.enable_x64(True):
        want = [np.asarray(w) for w in jax.grad(loss, (0, 1))(
            jnp.asarray(h), jnp.asarray(e, jnp.float64))]
    args = {"h": x, "emb": e, "labels": labels, "row_max": top.astype(np.float32),
            "row_sum": total.astype(np.float32), "g": g, "ln_scale": scale, "ln_shift": shift}
    outs = [np.full(p.size, np.nan, NUMPY_DTYPES[p.dtype]) for p in kernel.params[-2:]]
    compile_host(kernel, opt=0)(*(np.ascontiguousarray(args[n]).reshape(-1)
                                  for n in names[:-2]), *outs)
    for name, got, expected in zip((DH, DEMB), outs, want):
        assert not np.isnan(got).any(), name
        got = got.astype(np.float64).reshape(expected.shape)
        np.testing.assert_allclose(got, expected, rtol=tol,
                                   atol=tol * np.abs(expected).max(), err_msg=name)
