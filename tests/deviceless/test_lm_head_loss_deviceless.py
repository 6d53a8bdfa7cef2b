"""The LM head + softmax cross-entropy in XLA GPU's optimized module for an H100 (jax's
``log_softmax`` + ``take_along_axis``, vocab 3000): recognized (``find_lm_head_losses``),
and the forward kernel built from the recognized description computes, on the host, the
loss the module computes (the reference evaluator on XLA's own module; fresh random
inputs, labels with negative ones, outputs poisoned). In a training step the backward reads
the softmax's sums and exps, so the site does not close (``escapes``) and stays XLA's.

Skipped unless the CUDA plugin is installed and GPUs are hidden: scripts/deviceless_check.sh.
"""
from __future__ import annotations

import numpy as np
import pytest

from stitch.codegen.host import NUMPY_DTYPES, compile_host
from stitch.codegen.lm_head_loss import default_tiling, lower_lm_head_loss
from stitch.hlo.evaluator import evaluate
from stitch.hlo.evaluator.dtypes import numpy_dtype
from stitch.hlo.graph import build_op_graphs
from stitch.hlo.lm_head_loss import find_lm_head_losses
from stitch.hlo.parser import parse_hlo

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

BATCH, SEQ, HIDDEN, VOCAB = 2, 64, 128, 3000


def loss(h, emb, labels):
    """As bench/real_steps.py writes the LM head's loss (tied embedding)."""
    logits = jnp.einsum("bsd,vd->bsv", h, emb).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1).mean()


def _module(mesh, dtype, train: bool):
    replicated = NamedSharding(mesh, P())
    dt = {"f32": jnp.float32, "bf16": jnp.bfloat16}[dtype]
    args = (jax.ShapeDtypeStruct((BATCH, SEQ, HIDDEN), dt, sharding=replicated),
            jax.ShapeDtypeStruct((VOCAB, HIDDEN), dt, sharding=replicated),
            jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32, sharding=replicated))
    fn = jax.value_and_grad(loss, argnums=(0, 1)) if train else loss
    return parse_hlo(jax.jit(fn).lower(*args).compile().as_text())


@pytest.mark.parametrize("dtype,tol", [("f32", 1e-5), ("bf16", 1e-3)])
def test_eval_loss_is_one_site_and_its_kernel_computes_the_modules_loss(h100_mesh, dtype,
                                                                        tol):
    module = _module(h100_mesh, dtype, train=False)
    graph = build_op_graphs(module)[0]
    sites = find_lm_head_losses(graph)
    assert len(sites) == 1 and not sites[0].escapes
    site = sites[0].loss
    assert (site.rows, site.vocab, site.hidden) == (BATCH * SEQ, VOCAB, HIDDEN)
    assert site.operand_dtype == site.logits_dtype == dtype and site.log_prob_sum >= 0

    rng = np.random.default_rng(41)
    params = sorted(module.entry.parameters, key=lambda p: p.parameter_number)
    args = [rng.standard_normal(p.shape.dims).astype(numpy_dtype(p.shape.element_type))
            for p in params[:2]]
    labels = rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)
    labels[0, :3] = (-1, -VOCAB, VOCAB - 1)          # jax wraps negative labels
    args.append(labels)
    by_node = {v: args[graph.nodes[v].instruction.parameter_number] for v in graph.inputs}
    want = float(evaluate(module, args)[0])

    lowered = lower_lm_head_loss(site, default_tiling(site, "sm_70"))
    params = lowered.kernel.params
    ins = [np.ascontiguousarray(by_node[v], NUMPY_DTYPES[p.dtype]).reshape(-1)
           for p, v in zip(params, lowered.inputs)]
    (total,) = [np.full(p.size, np.inf, np.float32) for p in params if p.is_output]
    compile_host(lowered.kernel)(*ins, total)
    assert np.isfinite(total).all()
    np.testing.assert_allclose(-float(total[0]) / (BATCH * SEQ), want, rtol=tol)


def test_training_step_site_reads_beyond_its_rows_and_stays_with_xla(h100_mesh):
    graph = build_op_graphs(_module(h100_mesh, "f32", train=True))[0]
    sites = find_lm_head_losses(graph)
    assert len(sites) == 1
    escaped = {graph.nodes[v].opcode for v in sites[0].escapes}
    assert sites[0].escapes and escaped <= {"reduce", "exponential", "subtract"}


def test_eval_loss_is_placed_and_the_logits_are_gone(h100_mesh):
    """With the pass, 512 rows (where the fused kernel is modeled faster than XLA): the GEMM,
    the softmax and the gather/reduce fusions are one stitched call; no [rows, vocab] value
    is left in XLA's final module; the call assembles for sm_90 without spills."""
    from stitch.xla_pass import deviceless

    from .conftest import TARGET, assert_no_spills
    from .test_gpu_deviceless import check_assembled, check_placement
    replicated = NamedSharding(h100_mesh, P())
    batch = 8
    args = (jax.ShapeDtypeStruct((batch, SEQ, HIDDEN), jnp.float32, sharding=replicated),
            jax.ShapeDtypeStruct((VOCAB, HIDDEN), jnp.float32, sharding=replicated),
            jax.ShapeDtypeStruct((batch, SEQ), jnp.int32, sharding=replicated))
    result = deviceless.compile_with_pass(jax.jit(loss).lower(*args), "lm_head_eval", TARGET)
    report = result.report
    assert any(name.startswith("lm_head_loss") for name in report.placed), (
        report.skipped, report.fallbacks)
    check_placement(result, xla_left=False)
    check_assembled(result)
    assert_no_spills(report)
    final = parse_hlo(result.text)
    sizes = {i.shape.num_elements for _, i in final.instructions() if i.shape.is_array}
    assert batch * SEQ * VOCAB not in sizes
