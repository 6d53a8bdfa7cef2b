"""The LM head's backward through the softmax cross-entropy as GEMM chains over the
vocabulary, the logits recomputed from H and E (Cut Cross-Entropy's backward):

* dH = (exp(logits - lse) - onehot(label)) * g . E   (rows: tokens, n: vocabulary)
* dE = (exp(logits^T - lse) - onehot(label))^T-form * g . H   (rows: vocabulary, n:
  tokens; the row values lse, g and the labels are column broadcasts there)

written as HLO in that recomputed form. The chain recognizer takes the one-hot (a select on
a compare of the column iota with the labels spread over the tile) into the kernel: the chain reads
H, E, lse, labels and g, no [tokens, vocab] buffer. Host runs (fresh random inputs,
poisoned output) against numpy in float64 (f32 1e-4, bf16 tensor cores 3e-2 relative to
the largest element); PTX at GPT-2 small's size without spills on sm_80 / sm_90."""
from __future__ import annotations

import numpy as np
import pytest

from stitch.codegen.gemm_chain import ChainTiling, lower_gemm_chain
from stitch.codegen.host import NUMPY_DTYPES, compile_host
from stitch.hlo.gemm_chains import find_gemm_chains
from stitch.hlo.graph import build_op_graphs
from stitch.hlo.parser import parse_hlo
from hlo_fixtures.lm_head_backward import DE, DH, D, N, V, backward_text
from tests.test_lm_head_loss import ptxas_or_skip

_FMA = ChainTiling(block_m=16, block_n=16, threads=32, thread_m=4, thread_n=2, block_k=4,
                   block_h=8)
_MMA = ChainTiling(block_m=16, block_n=16, threads=32, thread_m=1, thread_n=1, block_k=16,
                   block_h=8, mma=True)



def one_chain(text: str):
    graph = build_op_graphs(parse_hlo(text))[0]
    chains = find_gemm_chains(graph)
    assert len(chains) == 1
    return graph, chains[0]


@pytest.mark.parametrize("form", (DH, DE), ids=("dH", "dE"))
def test_the_one_hot_is_computed_in_the_chain(form: str) -> None:
    graph, chain = one_chain(backward_text(form))
    assert sorted(graph.nodes[v].name for v in chain.inputs) == ["emb", "g", "h", "label",
                                                                   "lse"]
    names = {graph.nodes[v].name for v in chain.members}
    assert {"row" if form is DE else "col", "labelb", "hit", "onehot"} <= names
    assert max(graph.nodes[v].shape.num_elements for v in chain.inputs) == V * D


@pytest.mark.parametrize("form", (DH, DE), ids=("dH", "dE"))
@pytest.mark.parametrize("dtype,tiling,tol", [("f32", _FMA, 1e-4), ("f32", None, 1e-4),
                                              ("bf16", _MMA, 3e-2)],
                         ids=("f32-partial", "f32-default", "bf16-mma"))
def test_gradient_against_numpy(form: str, dtype: str, tiling, tol: float) -> None:
    graph, chain = one_chain(backward_text(form, dtype))
    rng = np.random.default_rng(61)
    store = NUMPY_DTYPES[dtype]
    h = rng.standard_normal((N, D)).astype(store)
    emb = rng.standard_normal((V, D)).astype(store)
    logits = h.astype(np.float64) @ emb.astype(np.float64).T
    if dtype != "f32":
        logits = logits.astype(store).astype(np.float64)
    top = logits.max(axis=1)
    lse = (top + np.log(np.exp(logits - top[:, None]).sum(axis=1))).astype(np.float32)
    labels = rng.integers(0, V, N).astype(np.int32)
    g = rng.standard_normal(N).astype(np.float32)
    args = [h, emb, lse, labels, g]
    lowered = lower_gemm_chain(graph, chain, tiling)
    params = lowered.kernel.params
    ins = [np.ascontiguousarray(args[graph.nodes[v].instruction.parameter_number],
                                NUMPY_DTYPES[p.dtype]).reshape(-1)
           for p, v in zip(params, lowered.inputs)]
    out = np.full(params[-1].size, np.nan, NUMPY_DTYPES[params[-1].dtype])
    compile_host(lowered.kernel)(*ins, out)
    dlogits = (np.exp(logits - lse[:, None]) - (np.arange(V)[None] == labels[:, None])) \
        * g[:, None]
    want = dlogits @ emb.astype(np.float64) if form is DH else dlogits.T @ h.astype(np.float64)
    got = out.astype(np.float64).reshape(want.shape)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("arch", ("sm_80", "sm_90"))
@pytest.mark.parametrize("dtype", ("f32", "tf32", "bf16"))
@pytest.mark.parametrize("form", (DH, DE), ids=("dH", "dE"))
def test_gpt2_sized_backward_ptx_assembles_without_spills(form: str, dtype: str,
                                                          arch: str) -> None:
    """8192 tokens, vocabulary 50257, 768 wide, codegen's default tiles."""
    from stitch.codegen.nvptx import emit_ptx
    from stitch.codegen.toolchain import assemble
    ptxas_or_skip(arch)
    operands = "bf16" if dtype == "bf16" else "f32"
    graph, chain = one_chain(backward_text(form, operands, 8192, 50257, 768))
    tiling = ChainTiling.default_for(chain, arch, allow_tf32=dtype == "tf32")
    assert tiling.mma == (dtype != "f32")
    kernel = lower_gemm_chain(graph, chain, tiling, name="lmb", arch=arch).kernel
    report = assemble(emit_ptx(kernel, arch), arch, kernel_name="lmb")["lmb"]
    assert report.spill_store_bytes == 0 and report.spill_load_bytes == 0, report
