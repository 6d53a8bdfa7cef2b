"""A training step's forward attention (causal mask of iotas, the backward reading S, P or
the softmax's row sums) is one GEMM-chain kernel in XLA GPU's module for an H100: placed,
assembled for sm_90 without spills, and its values on the host (fresh random inputs,
poisoned outputs) match a float64 reference of the attention the step computes.

Skipped unless the CUDA plugin is installed and GPUs are hidden: scripts/deviceless_check.sh.
"""
from __future__ import annotations

import numpy as np
import pytest

from stitch.codegen.gemm_chain import ChainTiling, lower_gemm_chain
from stitch.codegen.host import NUMPY_DTYPES, compile_host
from stitch.hlo import parse_hlo
from stitch.hlo.gemm_chains import chain_of, softmax_parts
from stitch.xla_pass import deviceless

from .conftest import TARGET, assert_no_spills
from .test_gpu_deviceless import check_assembled, check_placement, stitch_calls

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

# Batch x heads 32: at 2 x 2, XLA splits the PV GEMM's contraction and fuses the split-K
# reduce with the heads' transpose, a form the chain does not take.
BATCH, HEADS, SEQ, HEAD_DIM = 4, 8, 256, 64
SCALE = 0.125
MASK_VALUE = -1e9


def causal_attention(q, k, v):
    """As bench/real_steps.py writes it: QK^T, scale, iota mask, f32 softmax, PV."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * SCALE
    row = lax.broadcasted_iota(jnp.int32, (SEQ, SEQ), 0)
    col = lax.broadcasted_iota(jnp.int32, (SEQ, SEQ), 1)
    s = jnp.where(col <= row, s, jnp.asarray(MASK_VALUE, s.dtype))
    p = jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(q.dtype)
    return jnp.einsum("bhqk,bhkd->bhqd", p, v)


def loss(q, k, v, wo):
    """The heads joined and projected (GPT-2's attention output), a nonlinear loss."""
    ctx = causal_attention(q, k, v).transpose(0, 2, 1, 3).reshape(BATCH, SEQ, HEADS * HEAD_DIM)
    return jnp.mean(jnp.tanh(ctx @ wo).astype(jnp.float32))


def _compile(mesh, dtype):
    replicated = NamedSharding(mesh, P())
    spec = jax.ShapeDtypeStruct((BATCH, HEADS, SEQ, HEAD_DIM), dtype, sharding=replicated)
    weight = jax.ShapeDtypeStruct((HEADS * HEAD_DIM, HEADS * HEAD_DIM), dtype,
                                  sharding=replicated)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    return deviceless.compile_with_pass(step.lower(spec, spec, spec, weight), "attention_step",
                                        TARGET)


def _matrix(buffer: np.ndarray, view, rows: int, cols: int, batch: int) -> np.ndarray:
    b = np.array([view.batch_offset(i) for i in range(batch)])[:, None, None]
    r = np.arange(rows)[None, :, None] * view.row_stride
    c = np.arange(cols)[None, None, :] * view.col_stride
    return buffer[b + r + c].astype(np.float64)


def _check_on_host(graph, chain, seed: int, tol: float) -> None:
    """The chain kernel (host build, FMA tiles) against float64 attention from the same
    input buffers, read through the chain's views."""
    lowered = lower_gemm_chain(graph, chain, ChainTiling.default_for(chain, "sm_70"),
                               name="chain")
    kernel = compile_host(lowered.kernel)
    params = lowered.kernel.params
    rng = np.random.default_rng(seed)
    ins = [rng.standard_normal(p.size).astype(NUMPY_DTYPES[p.dtype]) for p in params
           if not p.is_output]
    outs = [np.full(p.size, np.nan, NUMPY_DTYPES[p.dtype]) for p in params if p.is_output]
    kernel(*ins, *outs)
    buffers = dict(zip(lowered.inputs, ins))
    bsz, m, n = chain.batch, chain.m, chain.n
    a = _matrix(buffers[chain.a.node], chain.a, m, chain.k, bsz)
    b = _matrix(buffers[chain.b.node], chain.b, chain.k, n, bsz)
    c = _matrix(buffers[chain.c.node], chain.c, n, chain.h, bsz)
    s = a @ b * SCALE
    x = np.where(np.tril(np.ones((m, n), bool))[None], s, MASK_VALUE)
    e = np.exp(x - x.max(-1, keepdims=True))
    row_sum = e.sum(-1)
    p = e / row_sum[..., None]
    parts = softmax_parts(chain.program, through_convert=True)
    last = len(chain.program) - 1                    # P, or P converted (bf16)
    want = {chain.output: p @ c}
    for extra in chain.extra_outputs:
        want[extra.node] = {parts.p: p, last: p, parts.row_sum: row_sum, parts.e: e}.get(
            extra.value, s)
    for node, got in zip(lowered.outputs, outs):
        assert not np.isnan(got).any(), graph.nodes[node].name
        np.testing.assert_allclose(got.astype(np.float64).reshape(-1),
                                   want[node].reshape(-1), rtol=tol, atol=tol,
                                   err_msg=graph.nodes[node].name)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_training_forward_attention_is_one_chain_kernel(h100_mesh, dtype):
    """f32: P written with S and the row sums; bf16: the softmax in f32 between bf16
    GEMMs, P converted last (1e-4 / 2e-2 on the host)."""
    result = _compile(h100_mesh, {"f32": jnp.float32, "bf16": jnp.bfloat16}[dtype])
    report = result.report
    kinds = {k.name: k.kind for g in report.plan.graphs for k in g.stitched.kernels}
    placed = [name for name in report.placed if kinds.get(name) == "gemm_chain"]
    assert len(placed) == 1, (report.skipped, report.fallbacks)
    check_placement(result)
    check_assembled(result)
    assert_no_spills(report)
    built = next(k for k in report.kernels if k.name == placed[0])
    graph_plan = next(g for g in report.plan.graphs
                      if any(k.name == placed[0] for k in g.stitched.kernels))
    planned = next(k for k in graph_plan.stitched.kernels if k.name == placed[0])
    chain = chain_of(graph_plan.graph, tuple(planned.members))
    assert chain is not None and chain.extra_outputs
    assert softmax_parts(chain.program, through_convert=True) is not None
    assert (chain.batch, chain.m, chain.n, chain.k, chain.h) == (
        BATCH * HEADS, SEQ, SEQ, HEAD_DIM, HEAD_DIM)
    # The mask is computed in the kernel: it reads Q, K and V only.
    assert len(chain.inputs) == 3
    # With the attention backward placed (stitch/xla_pass/attention_backward_jobs.py),
    # nothing reads S, the row sums or P: the chain writes O alone.
    backward = any("attention_backward" in name for name in report.placed)
    assert len(built.lowered.outputs) == 1 + (0 if backward else len(chain.extra_outputs))
    _check_on_host(graph_plan.graph, chain, seed=31, tol={"f32": 1e-4, "bf16": 2e-2}[dtype])


# A one-layer GPT-2-style bf16 step (bench.real_steps at small sizes): XLA fuses the causal
# mask's iotas into a kernel of their own that the backward reads too, and the beam took it
# before it reached the chain (beam.offer_points).
SMALL_GPT2 = dict(batch=4, seq=256, d_model=HEADS * HEAD_DIM, heads=HEADS, mlp=512, vocab=256)


def test_bf16_training_step_plans_its_forward_attention_as_a_chain(deviceless_ready):
    from bench import real_steps
    cfg = real_steps.config("gpt2", 1, "bfloat16", **SMALL_GPT2)
    result = deviceless.compile_with_pass(real_steps.lower_for(cfg, TARGET), "gpt2_bf16",
                                          TARGET)
    report = result.report
    graph_plan = report.plan.graphs[0]
    chains = [k for k in graph_plan.stitched.kernels if k.kind == "gemm_chain"]
    assert len(chains) == 1, report.summary()
    assert chains[0].name in report.placed, (report.skipped, report.fallbacks)
    # The whole step keeps XLA's copies of donated state between kernels, so
    # check_placement's "only kernels at the top level" does not hold: the chain's call is
    # checked on its own.
    built = next(k for k in report.kernels if k.name == chains[0].name)
    calls = stitch_calls(parse_hlo(result.text))
    assert built.target.name in calls
    params = built.lowered.kernel.params
    assert len(calls[built.target.name].operands) == sum(not p.is_output for p in params)
    check_assembled(result)
    chain = chain_of(graph_plan.graph, tuple(chains[0].members))
    assert chain is not None and chain.extra_outputs
    assert (chain.batch, chain.m, chain.n, chain.k, chain.h) == (
        cfg.batch * cfg.heads, cfg.seq, cfg.seq, HEAD_DIM, HEAD_DIM)
    _check_on_host(graph_plan.graph, chain, seed=47, tol=2e-2)
