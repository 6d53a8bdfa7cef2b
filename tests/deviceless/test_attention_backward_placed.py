"""A training step's attention backward is one stitch kernel in XLA GPU's module for an
H100 (stitch/integration/attention_backward_jobs.py): XLA's dP GEMM, softmax-gradient
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
from stitch.hlo_passes.parser import parse_hlo

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
    from stitch.integration import attention_backward_jobs
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
    from stitch.integration import attention_backward_jobs
    monkeypatch.setattr(attention_backward_jobs, "MMA_EFFICIENCY", 1e-3)
    report = _compile(h100_mesh, jnp.float32).report
    assert not [n for n in report.placed if "attention_backward" in n]
    reasons = [why for name, why in report.skipped if "attention_backward" in name]
    assert len(reasons) == 1 and "slower than XLA" in reasons[0], report.skipped
