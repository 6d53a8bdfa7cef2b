"""Attention's backward kernels (stitch/codegen/attention_backward.py): dQ, and dK with dV,
recomputing S and P from Q, K and the forward's row statistics. Host runs with fresh random
inputs and NaN-poisoned outputs against jax's gradient of softmax attention (f32: 1e-4;
bf16 operands: 2e-2 of the largest gradient; host builds at LLVM -O0: the sizes are
small and the build dominates); PTX assembled for sm_80 / sm_90 without spills at GPT-2's
attention sizes."""
from __future__ import annotations

import numpy as np
import pytest

from stitch.codegen.attention_backward import (DKV_OUTPUTS, DQ_INPUTS, STATS,
                                               OPERANDS, AttentionBackward, BackwardTiling,
                                               MatrixView, dq_params, lower_attention_backward,
                                               lower_dkv, lower_dq)
from stitch.codegen import kir
from stitch.codegen.errors import CodegenError
from stitch.codegen.host import NUMPY_DTYPES, compile_host


def _attention(q, k, v, scale: float, causal: bool):
    """Forward in float64 numpy: O, the rows' max and sum of the masked scaled scores."""
    s = scale * np.einsum("bmd,bnd->bmn", q, k)
    if causal:
        s = np.where(np.tril(np.ones(s.shape[1:], bool)), s, -1e9)
    mx = s.max(-1)
    e = np.exp(s - mx[..., None])
    total = e.sum(-1)
    return np.einsum("bmn,bnd->bmd", e / total[..., None], v), mx, total


def _jax_grads(q, k, v, d_o, scale: float, causal: bool):
    import jax
    import jax.numpy as jnp

    def out(q, k, v):
        s = scale * jnp.einsum("bmd,bnd->bmn", q, k)
        if causal:
            s = jnp.where(jnp.tril(jnp.ones(s.shape[1:], bool)), s, -1e9)
        return jnp.einsum("bmn,bnd->bmd", jax.nn.softmax(s, axis=-1), v)

    # float64 for this reference only: a global switch would leak into the worker's
    # later tests (jnp.arange turns s64 there).
    with jax.enable_x64(True):
        _, pull = jax.vjp(out, *(jnp.asarray(x, jnp.float64) for x in (q, k, v)))
        return [np.asarray(g) for g in pull(jnp.asarray(d_o, jnp.float64))]


def _store(x: np.ndarray, view: MatrixView, dtype) -> np.ndarray:
    """x [b, len, d] laid out in a flat buffer through ``view`` (a permutation)."""
    flat = np.full(x.size, np.nan, dtype)
    b, r, c = np.indices(x.shape)
    flat[b * view.batch_stride + r * view.row_stride + c * view.col_stride] = x
    return flat


def _load(flat: np.ndarray, view: MatrixView, shape) -> np.ndarray:
    b, r, c = np.indices(shape)
    return flat[b * view.batch_stride + r * view.row_stride + c * view.col_stride]


def _run(problem: AttentionBackward, seed: int, tol: float,
         tiling: BackwardTiling | None = None, stats_pass: bool = False) -> None:
    """dQ then dK/dV (with ``stats_pass`` the first writes the statistics the second
    reads), every output poisoned, against jax's gradients."""
    rng = np.random.default_rng(seed)
    b, m, n, d = problem.batch, problem.queries, problem.keys, problem.head_dim
    store = NUMPY_DTYPES[problem.dtype]
    q, d_o = (rng.standard_normal((b, m, d)).astype(store) for _ in range(2))
    k, v = (rng.standard_normal((b, n, d)).astype(store) for _ in range(2))
    wide = [x.astype(np.float64) for x in (q, k, v, d_o)]
    o, mx, total = _attention(*wide[:3], problem.scale, problem.causal)
    # The forward's O in the operands' type, as the backward reads it.
    delta = (wide[3] * o.astype(store).astype(np.float64)).sum(-1)
    values = {"q": q, "k": k, "v": v, "d_o": d_o}
    buffers = {name: _store(x, problem.view(name), store) for name, x in values.items()}
    if not stats_pass:
        buffers.update({"row_max": mx, "row_sum": total, "delta": delta})
    want = dict(zip(("dq", "dk", "dv"), _jax_grads(*wide, problem.scale, problem.causal)))
    dq_ins, dq_outs = dq_params(stats_pass)
    for kernel, ins, outs in ((lower_dq(problem, tiling, stats_pass=stats_pass), dq_ins,
                               dq_outs), (lower_dkv(problem, tiling), DQ_INPUTS, DKV_OUTPUTS)):
        assert [p.name for p in kernel.params] == [*ins, *outs]
        args = [np.ascontiguousarray(buffers[p.name], NUMPY_DTYPES[p.dtype]).reshape(-1)
                for p in kernel.params[:len(ins)]]
        results = [np.full(p.size, np.nan, NUMPY_DTYPES[p.dtype])
                   for p in kernel.params[len(ins):]]
        compile_host(kernel, opt=0)(*args, *results)
        for name, got in zip(outs, results):
            assert not np.isnan(got).any(), f"{name}: poisoned elements left"
            buffers[name] = got
            if name in STATS:
                continue
            got = _load(got, problem.view(name), want[name].shape).astype(np.float64)
            expected = want[name]
            np.testing.assert_allclose(got, expected, rtol=tol,
                                       atol=tol * np.abs(expected).max(), err_msg=name)
    if stats_pass:
        for name, expected in zip(STATS, (mx, total, delta)):
            np.testing.assert_allclose(buffers[name].reshape(b, m), expected, rtol=tol,
                                       atol=tol * np.abs(expected).max(), err_msg=name)


_SMALL = BackwardTiling(block_rows=16, block_cols=16, thread_rows=4, thread_cols=2,
                        block_k=4, block_h=8)


@pytest.mark.parametrize("causal,tiling", ((True, _SMALL), (False, None)),
                         ids=("causal-small", "full-default"))
def test_gradients_match_jax_with_edges_no_tile_divides(causal: bool, tiling) -> None:
    """m = n = 37, d = 12: partial row, column and head-dim tiles; the causal walk skips
    the tiles above the diagonal."""
    _run(AttentionBackward(3, 37, 37, 12, 0.29, causal), seed=31, tol=1e-4, tiling=tiling)


def test_rectangular_scores_without_a_mask() -> None:
    _run(AttentionBackward(2, 20, 45, 8, 0.35, False), seed=32, tol=1e-4, tiling=_SMALL)


def test_bf16_operands_on_fma() -> None:
    _run(AttentionBackward(2, 24, 24, 8, 0.25, True, "bf16"), seed=33, tol=2e-2,
         tiling=_SMALL)


@pytest.mark.parametrize("causal,tiling", ((False, _SMALL), (True, None)),
                         ids=("full-small", "causal-default"))
def test_statistics_pass_needs_nothing_from_the_forward(causal: bool, tiling) -> None:
    """The dQ kernel's first walk writes M, L and D (D as XLA's sum over keys, no O); the
    dK/dV kernel reads them."""
    _run(AttentionBackward(3, 37, 37, 12, 0.29, causal), seed=34, tol=1e-4, tiling=tiling,
         stats_pass=True)


def test_strided_operands_and_results_as_xla_lays_them_out() -> None:
    """dQ/dK/dV written [batch, head_dim, length] (XLA's GPT-2 backward), K read through
    a [length, batch, head_dim] view."""
    b, s, d = 2, 24, 8
    heads_minor = MatrixView(s * d, 1, s)
    views = (("dq", heads_minor), ("dk", heads_minor), ("dv", heads_minor),
             ("k", MatrixView(d, b * d, 1)))
    _run(AttentionBackward(b, s, s, d, 0.4, True, views=views), seed=35, tol=1e-4,
         tiling=_SMALL, stats_pass=True)


@pytest.mark.parametrize("dtype", ("f32",))
def test_one_kernel_of_two_phases(dtype: str) -> None:
    """dQ with the statistics pass, a grid barrier, dK/dV: the statistics in global
    scratch; results strided as XLA writes them."""
    b, s, d = 3, 37, 12
    rng = np.random.default_rng(36)
    heads_minor = MatrixView(s * d, 1, s)
    views = (("dq", heads_minor), ("dk", heads_minor), ("dv", heads_minor))
    problem = AttentionBackward(b, s, s, d, 0.3, True, dtype, views)
    store = NUMPY_DTYPES[dtype]
    values = {name: rng.standard_normal((b, s, d)).astype(store) for name in OPERANDS}
    kernel = lower_attention_backward(problem, _SMALL if dtype == "f32" else None)
    assert [p.name for p in kernel.params] == [*OPERANDS, "dq", "dk", "dv"]
    outs = [np.full(p.size, np.nan, NUMPY_DTYPES[p.dtype]) for p in kernel.params[4:]]
    compile_host(kernel, opt=0)(*(values[n].reshape(-1) for n in OPERANDS), *outs)
    wide = [values[n].astype(np.float64) for n in OPERANDS]
    tol = 1e-4 if dtype == "f32" else 2e-2
    for name, got, want in zip(("dq", "dk", "dv"), outs,
                               _jax_grads(*wide, problem.scale, problem.causal)):
        assert not np.isnan(got).any(), name
        got = _load(got, problem.view(name), want.shape).astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max(),
                                   err_msg=name)


_MMA = BackwardTiling(block_rows=16, block_cols=16, thread_rows=1, thread_cols=1,
                      block_k=16, block_h=8, mma=True)


def test_tensor_cores_tf32() -> None:
    """MMA tiles, f32 operands as TF32 (5e-3 of the largest gradient), edges that no tile
    divides, the statistics pass (bf16 on tensor cores: the two-phase test)."""
    _run(AttentionBackward(2, 37, 37, 12, 0.29, True), seed=37, tol=5e-3, tiling=_MMA,
         stats_pass=True)


def test_two_phase_kernel_on_tensor_cores() -> None:
    b, s, d = 2, 40, 16
    rng = np.random.default_rng(38)
    problem = AttentionBackward(b, s, s, d, 0.25, True, "bf16")
    kernel = lower_attention_backward(problem, _MMA, arch="sm_90")
    assert any(isinstance(st, kir.MmaSync) for st in kir.walk_stmts(kernel.body))
    values = {n: rng.standard_normal((b, s, d)).astype(NUMPY_DTYPES["bf16"]) for n in OPERANDS}
    outs = [np.full(p.size, np.nan, NUMPY_DTYPES[p.dtype]) for p in kernel.params[4:]]
    compile_host(kernel, opt=0)(*(values[n].reshape(-1) for n in OPERANDS), *outs)
    wide = [values[n].astype(np.float64) for n in OPERANDS]
    for name, got, want in zip(("dq", "dk", "dv"), outs, _jax_grads(*wide, 0.25, True)):
        got = got.astype(np.float64).reshape(want.shape)
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max(),
                                   err_msg=name)
    with pytest.raises(CodegenError):       # f32 without TF32 allowed: no tensor cores
        lower_attention_backward(AttentionBackward(b, s, s, d, 0.25, True), _MMA,
                                 arch="sm_90")


@pytest.mark.parametrize("dtype", ("bf16", "tf32"))
def test_head_dim_128_is_one_head_block_on_tensor_cores(dtype: str) -> None:
    """d = 128 (Llama's heads): the default tensor-core tiling takes the head dim in one
    128-wide block, so S and dP are computed once per tile (priced so), under the whole
    register file; the two-phase kernel's gradients against jax's in float64 (bf16:
    S, P, dP, dS rounded as XLA's bf16 step stores them; f32 operands as TF32)."""
    from stitch.codegen.attention_backward import (WIDE_REGISTER_BUDGET, head_blocks,
                                                   register_budget)
    b, s, d = 2, 40, 128
    rng = np.random.default_rng(np.random.SeedSequence().entropy)
    half = dtype == "bf16"
    problem = AttentionBackward(b, s, s, d, d ** -0.5, True, "bf16" if half else "f32",
                                intermediates="bf16" if half else "f32")
    tiling = BackwardTiling.default_for(problem, two_results=True, mma=True)
    assert tiling.block_h == 128 and head_blocks(problem, tiling) == 1
    assert register_budget(tiling) == WIDE_REGISTER_BUDGET
    kernel = lower_attention_backward(problem, arch="sm_90", allow_tf32=not half)
    assert kernel.register_budget == WIDE_REGISTER_BUDGET
    store = NUMPY_DTYPES[problem.dtype]
    values = {n: rng.standard_normal((b, s, d)).astype(store) for n in OPERANDS}
    outs = [np.full(p.size, np.nan, NUMPY_DTYPES[p.dtype]) for p in kernel.params[4:]]
    compile_host(kernel, opt=0)(*(values[n].reshape(-1) for n in OPERANDS), *outs)
    wide = [values[n].astype(np.float64) for n in OPERANDS]
    tol = 2e-2 if half else 5e-3
    for name, got, want in zip(("dq", "dk", "dv"), outs,
                               _jax_grads(*wide, problem.scale, True)):
        assert not np.isnan(got).any(), name
        got = got.astype(np.float64).reshape(want.shape)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max(),
                                   err_msg=name)


def test_refused_problems() -> None:
    with pytest.raises(CodegenError):
        lower_dq(AttentionBackward(2, 20, 30, 8, 0.3, True))
    with pytest.raises(CodegenError):
        lower_dq(AttentionBackward(2, 20, 20, 8, 0.3, True, "f64"))
    with pytest.raises(CodegenError):       # scores stored in another half type
        lower_dq(AttentionBackward(2, 20, 20, 8, 0.3, True, "bf16", intermediates="f16"))
    with pytest.raises(CodegenError):
        BackwardTiling(block_rows=16, block_cols=48, thread_cols=4).check()


# (batch x heads, sequence, head dim): GPT-2 small's and the Llama-style step's attention.
_SIZES = {"gpt2": (96, 1024, 64), "llama": (64, 2048, 128)}


@pytest.mark.parametrize("arch", ("sm_80", "sm_90"))
@pytest.mark.parametrize("dtype,size", (("f32", "gpt2"), ("bf16", "gpt2"), ("tf32", "gpt2"),
                                        ("bf16", "llama"), ("tf32", "llama")))
def test_ptx_assembles_without_spills(dtype: str, size: str, arch: str) -> None:
    """One layer's attention (GPT-2 small: 96 heads x 1024 x 1024, d = 64; Llama-style:
    64 x 2048 x 2048, d = 128 in one head block), default tiles, the two-phase kernel:
    "tf32" (f32 operands) and bf16 on tensor cores (S, P, dP, dS rounded to bf16 as XLA's
    bf16 step stores them), f32 on FMA."""
    from stitch.codegen.nvptx import emit_ptx
    from stitch.codegen.toolchain import assemble
    from tests.test_lowering_gemm_chain import _ptxas_or_skip
    _ptxas_or_skip(arch)
    heads, seq, d = _SIZES[size]
    problem = AttentionBackward(heads, seq, seq, d, d ** -0.5, True,
                                "f32" if dtype == "tf32" else dtype,
                                intermediates="bf16" if dtype == "bf16" else "f32")
    kernels = [lower_attention_backward(problem, name="bwd", arch=arch,
                                        allow_tf32=dtype == "tf32")]
    for kernel in kernels:
        report = assemble(emit_ptx(kernel, arch), arch, kernel_name="bwd")["bwd"]
        assert report.spill_store_bytes == 0 and report.spill_load_bytes == 0, report
        assert 0 < report.registers <= 255
