"""A training step's attention backward is one stitch kernel in XLA GPU's module for an
H100 (stitch/xla_pass/attention_backward_jobs.py): XLA's dP GEMM, softmax-gradient
fusion and dQ / dK / dV GEMMs replaced by a two-phase kernel reading Q, K, V and dO only,
the forward chain then writing only O: no value of the final module is scores-sized.
Placed as the report says, assembled for sm_90 without spills, and the placed kernel's
gradients on the host (fresh random inputs, poisoned outputs; TF32 tensor cores as XLA's
default precision allows) match jax's in float64 to 5e-3. The bf16 step's too (S, P, dP
and dS bf16 as XLA stores them, bf16 tensor cores): to 2e-2 of the largest gradient.

Skipped unless the CUDA plugin is installed and GPUs are hidden: scripts/deviceless_check.sh.
"""
from __future__ import annotations

import numpy as np
import pytest

from stitch.codegen.host import NUMPY_DTYPES, compile_host
from stitch.hlo.parser import parse_hlo

from .conftest import assert_no_spills
from .test_gpu_deviceless import check_assembled, check_placement
from .test_training_attention import BATCH, HEADS, HEAD_DIM, SCALE, SEQ, _compile

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402


def _grads(q, k, v, d_o):
    """jax's gradients of causal softmax attention, float64, [batch x heads, seq, d]."""

    def out(q, k, v):
        s = jnp.einsum("bqd,bkd->bqk", q, k) * SCALE
        s = jnp.where(jnp.tril(jnp.ones((SEQ, SEQ), bool)), s, -1e9)
        return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, axis=-1), v)

    # float64 for this reference only: a global switch would leak into later tests.
    with jax.enable_x64(True):
        _, pull = jax.vjp(out, q, k, v)
        return [np.asarray(g) for g in pull(d_o)]


# dtype: (jax's, tolerance against float64 as a share of the largest gradient). bf16:
# inputs, S, P, dP, dS and results of 8 bits, as XLA's bf16 step computes them.
_DTYPES = {"f32": (jnp.float32, 5e-3), "bf16": (jnp.bfloat16, 2e-2)}


@pytest.mark.parametrize("dtype", list(_DTYPES))
def test_attention_backward_is_one_kernel_and_nothing_is_scores_sized(h100_mesh,
                                                                      monkeypatch, dtype):
    """Placed wherever it fits (whatever the model says: the second test)."""
    from stitch.xla_pass import attention_backward_jobs
    monkeypatch.setattr(attention_backward_jobs, "PLACEMENT", "always")
    jax_dtype, tol = _DTYPES[dtype]
    result = _compile(h100_mesh, jax_dtype)
    report = result.report
    placed = [name for name in report.placed if "attention_backward" in name]
    assert len(placed) == 1, (report.skipped, report.fallbacks)
    check_placement(result)
    check_assembled(result)
    assert_no_spills(report)
    final = parse_hlo(result.text)
    scores = [i.name for i in final.entry.instructions
              if any(s.dims[-2:] == (SEQ, SEQ) for s in (i.shape.leaves() if
                                                         i.shape.is_tuple else [i.shape]))]
    assert scores == [], scores
    built = next(k for k in report.kernels if k.name == placed[0])
    kernel = built.lowered.kernel
    rng = np.random.default_rng(51)
    bh = BATCH * HEADS
    storage = NUMPY_DTYPES[kernel.params[0].dtype]
    ins = [rng.standard_normal((bh, SEQ, HEAD_DIM)).astype(storage) for _ in range(4)]
    outs = [np.full(p.size, np.nan, NUMPY_DTYPES[p.dtype]) for p in kernel.params[4:]]
    compile_host(kernel)(*(x.reshape(-1) for x in ins), *outs)
    for name, got, want in zip(("dq", "dk", "dv"), outs,
                               _grads(*(x.astype(np.float64) for x in ins))):
        got = got.astype(np.float64)
        assert not np.isnan(got).any(), name
        # TF32 tensor cores (XLA's DEFAULT precision) or bf16 ones: of the largest gradient.
        np.testing.assert_allclose(got.reshape(want.shape), want, rtol=tol,
                                   atol=tol * np.abs(want).max(), err_msg=name)


def test_a_backward_modeled_slower_is_left_to_xla_with_the_reason(h100_mesh, monkeypatch):
    """Tensor cores assumed at 0.1% of their peak: the kernel loses to XLA's."""
    from stitch.cost import mma_efficiency
    monkeypatch.setattr(mma_efficiency, "MMA_EFFICIENCY", 1e-3)
    report = _compile(h100_mesh, jnp.float32).report
    assert not [n for n in report.placed if "attention_backward" in n]
    reasons = [why for name, why in report.skipped if "attention_backward" in name]
    assert len(reasons) == 1 and "slower than XLA" in reasons[0], report.skipped


# A Llama-like bf16 step at small sizes: two heads of d = 128 (one 128-wide head block),
# rotary Q and K, RMS norm, SwiGLU (bench/real_steps.py's Llama-style step). Smaller
# batches or sequences take other XLA forms (split-K dQ GEMMs, e stored by the forward).
_LLAMA = dict(batch=4, seq=512, d_model=256, heads=2, mlp=256, vocab=128)


def test_llama_like_backward_is_one_kernel_with_128_wide_heads(h100_mesh, monkeypatch):
    """d = 128 and rotary: the backward of the step's one layer is one kernel (whatever
    planned kernel held its instructions yields to it), assembled for sm_90 without spills
    (the whole register file: one 128-wide head block), no [B,H,S,S] value is left, and
    the placed kernel's gradients on the host match jax's in float64 (bf16 tolerance)."""
    from bench import real_steps
    from stitch.codegen import attention_backward as codegen
    from stitch.xla_pass import attention_backward_jobs, deviceless
    from stitch.codegen.nvptx import emit_ptx
    from stitch.codegen.toolchain import assemble_cubin
    from tests.test_attention_backward import _load, _store

    monkeypatch.setattr(attention_backward_jobs, "PLACEMENT", "always")
    problems = []

    def recorded(match):
        problems.append(problem_for(match))
        return problems[-1]
    problem_for = codegen.problem_for
    monkeypatch.setattr(codegen, "problem_for", recorded)
    cfg = real_steps.config("llama", 1, "bfloat16", **_LLAMA)
    result = deviceless.compile_with_pass(real_steps.lower_for(cfg, "h100"), "tiny_llama",
                                          "h100")
    report = result.report
    placed = [name for name in report.placed if "attention_backward" in name]
    assert len(placed) == 1, (report.skipped, report.fallbacks)
    check_placement(result)
    check_assembled(result)
    kernel = next(k for k in report.kernels if k.name == placed[0]).lowered.kernel
    assert kernel.register_budget == codegen.WIDE_REGISTER_BUDGET
    _, entries = assemble_cubin(emit_ptx(kernel, "sm_90"), "sm_90")
    assert all(e.spill_store_bytes == e.spill_load_bytes == 0 for e in entries.values()), \
        entries
    seq = cfg.seq
    final = parse_hlo(result.text)
    scores = [i.name for i in final.entry.instructions
              if any(s.dims[-2:] == (seq, seq) and s.num_elements >= cfg.batch * cfg.heads *
                     seq * seq for s in (i.shape.leaves() if i.shape.is_tuple else [i.shape]))]
    assert scores == [], scores
    problem = problems[-1]
    assert (problem.head_dim, problem.batch, problem.queries) == (128, 8, seq)
    assert codegen.head_blocks(problem, codegen.BackwardTiling.default_for(
        problem, two_results=True, mma=True)) == 1
    rng = np.random.default_rng(np.random.SeedSequence().entropy)
    storage = NUMPY_DTYPES["bf16"]
    shape = (problem.batch, seq, problem.head_dim)
    values = [rng.standard_normal(shape).astype(storage) for _ in range(4)]
    ins = [_store(x, problem.view(n), storage)
           for n, x in zip(("q", "k", "v", "d_o"), values)]
    assert [p.size for p in kernel.params[:4]] == [x.size for x in ins]
    outs = [np.full(p.size, np.nan, NUMPY_DTYPES[p.dtype]) for p in kernel.params[4:]]
    compile_host(kernel)(*ins, *outs)
    wide = [x.astype(np.float64) for x in values]
    scale = problem.scale
    with jax.enable_x64(True):
        def out(q, k, v):
            s = jnp.einsum("bqd,bkd->bqk", q, k) * scale
            s = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), s, -1e9)
            return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, axis=-1), v)
        _, pull = jax.vjp(out, *wide[:3])
        want = [np.asarray(g) for g in pull(wide[3])]
    _, tol = _DTYPES["bf16"]
    for name, got, expected in zip(("dq", "dk", "dv"), outs, want):
        assert not np.isnan(got).any(), name
        got = _load(got.astype(np.float64), problem.view(name), shape)
        np.testing.assert_allclose(got, expected, rtol=tol,
                                   atol=tol * np.abs(expected).max(), err_msg=name)
