"""GEMM chains of a training step's forward attention: the backward also reads S, the
softmax's row sums or P, so the chain kernel writes them too (``ChainOutput``), and the
causal mask XLA computes from iotas is recomputed in the kernel. Host-target runs with
fresh random inputs and NaN-poisoned outputs against the reference evaluator (f32 1e-4,
bf16 on tensor cores 2e-2); the kernels' PTX assembled for sm_80 / sm_90 without spills."""
from __future__ import annotations

import numpy as np
import pytest

from stitch.codegen import kir
from stitch.codegen.gemm_chain import ChainTiling, lower_gemm_chain
from stitch.codegen.host import NUMPY_DTYPES, compile_host
from stitch.hlo.evaluator import evaluate
from stitch.hlo.evaluator.dtypes import numpy_dtype
from stitch.hlo.gemm_chains import find_gemm_chains, needs_row_pass
from stitch.hlo.graph import build_op_graphs
from stitch.hlo.parser import parse_hlo
from tests.fixtures import REDUCERS

# Batch 4 (2 x 2 heads), m = 20, n = 24, k = 10, h = 6: no tile divides them.
_BODY = """
ENTRY e {
  a = f32[4,{m},{k}] parameter(0)
  b = f32[4,{k},{n}] parameter(1)
  c = f32[4,{n},{h}] parameter(2)
  s0 = f32[4,{m},{n}] dot(a, b), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
  scale = f32[] constant(0.3)
  scaleb = f32[4,{m},{n}] broadcast(scale), dimensions={}
  s = f32[4,{m},{n}] multiply(s0, scaleb)
  s4 = f32[2,2,{m},{n}] reshape(s)
  row = s32[{m},{n}] iota(), iota_dimension=0
  col = s32[{m},{n}] iota(), iota_dimension=1
  le = pred[{m},{n}] compare(col, row), direction=LE
  leb = pred[2,2,{m},{n}] broadcast(le), dimensions={2,3}
  big = f32[] constant(-1e+09)
  bigb = f32[2,2,{m},{n}] broadcast(big), dimensions={}
  x = f32[2,2,{m},{n}] select(leb, s4, bigb)
  ninf = f32[] constant(-inf)
  mx = f32[2,2,{m}] reduce(x, ninf), dimensions={3}, to_apply=max
  mxb = f32[2,2,{m},{n}] broadcast(mx), dimensions={0,1,2}
  d = f32[2,2,{m},{n}] subtract(x, mxb)
  ex = f32[2,2,{m},{n}] exponential(d)
  zero = f32[] constant(0)
  sm = f32[2,2,{m}] reduce(ex, zero), dimensions={3}, to_apply=add
  smb = f32[2,2,{m},{n}] broadcast(sm), dimensions={0,1,2}
  p = f32[2,2,{m},{n}] divide(ex, smb)
  p3 = f32[4,{m},{n}] reshape(p)
  o = f32[4,{m},{h}] dot(p3, c), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
  ROOT t = ROOT_TYPE tuple(ROOT_VALUES)
}
"""


def _text(values: str, types: str, m: int = 20, n: int = 24, k: int = 10, h: int = 6) -> str:
    body = _BODY.replace("{m}", str(m)).replace("{n}", str(n)).replace("{k}", str(k))
    return "HloModule train\n" + REDUCERS + body.replace("{h}", str(h)).replace(
        "ROOT_VALUES", values).replace("ROOT_TYPE", types.format(m=m, n=n, h=h))


# What XLA's GPT-2 step leaves for the backward at seq 1024 (S and the row sums) and at
# seq 256 (S and P).
_STATS = ("o, s, sm", "(f32[4,{m},{h}], f32[4,{m},{n}], f32[2,2,{m}])")
_PROBS = ("o, p, s", "(f32[4,{m},{h}], f32[2,2,{m},{n}], f32[4,{m},{n}])")
STATS = _text(*_STATS)
PROBS = _text(*_PROBS)
CAUSAL_ONLY = _text("o", "(f32[4,{m},{h}])")

# bf16 as XLA leaves a bf16 step: scores masked in bf16, the softmax in f32, P converted
# back to bf16 for the second GEMM (and for the backward, which reads it).
_BF16_BODY = _BODY.replace("f32[", "bf16[").replace(
    "  ninf = bf16[] constant(-inf)\n",
    "  xf = f32[2,2,{m},{n}] convert(x)\n  ninf = f32[] constant(-inf)\n").replace(
    "reduce(x, ninf)", "reduce(xf, ninf)").replace("subtract(x, mxb)", "subtract(xf, mxb)")
for name in ("mx", "mxb", "d", "ex", "zero", "sm", "smb", "p"):
    _BF16_BODY = _BF16_BODY.replace(f"  {name} = bf16[", f"  {name} = f32[")
_BF16_BODY = _BF16_BODY.replace(
    "  p3 = bf16[4,{m},{n}] reshape(p)",
    "  pb = bf16[2,2,{m},{n}] convert(p)\n  p3 = bf16[4,{m},{n}] reshape(pb)")
BF16_PROBS = ("HloModule train_bf16\n" + REDUCERS + _BF16_BODY.replace("{m}", "20").replace(
    "{n}", "24").replace("{k}", "10").replace("{h}", "6").replace("ROOT_VALUES", "o, pb, sm")
    .replace("ROOT_TYPE", "(bf16[4,20,6], bf16[2,2,20,24], f32[2,2,20])"))

_SMALL_TILES = ChainTiling(block_m=16, block_n=16, threads=32, thread_m=4, thread_n=2,
                           block_k=4, block_h=8)
_MMA_TILES = ChainTiling(block_m=16, block_n=16, threads=32, thread_m=1, thread_n=1,
                         block_k=16, block_h=8, mma=True)


def _narrow(text: str, dtype: str) -> str:
    return text.replace("f32[", f"{dtype}[")


def _chain(text: str):
    module = parse_hlo(text)
    graph = build_op_graphs(module)[0]
    chains = find_gemm_chains(graph)
    assert len(chains) == 1
    return module, graph, chains[0]


def _run(text: str, seed: int, tol: float, tiling: ChainTiling | None) -> None:
    """Every value the kernel writes against the evaluator's, all outputs poisoned."""
    module, graph, chain = _chain(text)
    rng = np.random.default_rng(seed)
    args = [rng.standard_normal(p.shape.dims).astype(numpy_dtype(p.shape.element_type))
            for p in module.entry.parameters]
    want = evaluate(module, args)
    lowered = lower_gemm_chain(graph, chain, tiling, name="chain")
    kernel = compile_host(lowered.kernel)
    params = lowered.kernel.params
    ins = [np.ascontiguousarray(args[graph.nodes[v].instruction.parameter_number],
                                dtype=NUMPY_DTYPES[p.dtype]).reshape(-1)
           for p, v in zip(params, lowered.inputs)]
    outs = [np.full(p.size, np.nan, NUMPY_DTYPES[p.dtype]) for p in params[len(ins):]]
    kernel(*ins, *outs)
    root = module.entry.root
    names = [graph.nodes[v].name for v in lowered.outputs]
    for name, got in zip(names, outs):
        # The tuple element the node is (through a reshape for P's [4, 20, 24] view).
        position = next(i for i, o in enumerate(root.operands) if o == name)
        expected = np.asarray(want[position], np.float64).reshape(-1)
        got = got.astype(np.float64)
        assert not np.isnan(got).any(), f"{name}: poisoned elements left"
        np.testing.assert_allclose(got, expected, rtol=tol, atol=tol, err_msg=name)
    assert len(outs) == len(root.operands)


@pytest.mark.parametrize("tiling", (_SMALL_TILES, None), ids=("partial", "default"))
def test_scores_and_row_sums_written_in_one_online_pass(tiling) -> None:
    module, graph, chain = _chain(STATS)
    assert chain.softmax and not needs_row_pass(chain)
    assert sorted(o.rank for o in chain.extra_outputs) == ["row", "tile"]
    assert len(chain.inputs) == 3        # the mask is computed, not read
    _run(STATS, seed=21, tol=1e-4, tiling=tiling)
    kernel = lower_gemm_chain(graph, chain, _SMALL_TILES).kernel
    assert sum(isinstance(s, kir.For) and s.var == "n0" for s in kernel.body) == 1


@pytest.mark.parametrize("tiling", (_SMALL_TILES, None), ids=("partial", "default"))
def test_probabilities_written_exactly_after_a_row_pass(tiling) -> None:
    module, graph, chain = _chain(PROBS)
    assert chain.softmax and needs_row_pass(chain)
    _run(PROBS, seed=22, tol=1e-4, tiling=tiling)
    kernel = lower_gemm_chain(graph, chain, _SMALL_TILES).kernel
    assert sum(isinstance(s, kir.For) and s.var == "n0" for s in kernel.body) == 2


def test_causal_mask_of_iotas_is_computed_in_the_kernel() -> None:
    _, _, chain = _chain(CAUSAL_ONLY)
    assert not chain.extra_outputs and len(chain.inputs) == 3
    assert sum(op.kind == "iota" for op in chain.program) == 2
    _run(CAUSAL_ONLY, seed=23, tol=1e-4, tiling=_SMALL_TILES)


@pytest.mark.parametrize("text", (STATS, PROBS), ids=("stats", "probs"))
def test_training_chain_on_tensor_cores(text: str) -> None:
    _run(_narrow(text, "bf16"), seed=24, tol=2e-2, tiling=_MMA_TILES)


def test_bf16_step_form_with_p_converted_last() -> None:
    """softmax_parts through the final convert: P (bf16) and the row sums written after a
    row pass; the chain is no online softmax (``chain.softmax``), as before."""
    _, _, chain = _chain(BF16_PROBS)
    assert not chain.softmax and needs_row_pass(chain)
    _run(BF16_PROBS, seed=25, tol=2e-2, tiling=_MMA_TILES)
    _run(BF16_PROBS, seed=26, tol=2e-2, tiling=_SMALL_TILES)


def test_warp_columns_and_n_splits_are_refused_with_outputs_read_outside() -> None:
    from stitch.codegen.errors import CodegenError
    _, graph, chain = _chain(STATS)
    wide = ChainTiling(block_m=16, block_n=32, threads=64, thread_m=1, thread_n=1,
                       block_k=16, block_h=8, mma=True)
    with pytest.raises(CodegenError):
        lower_gemm_chain(graph, chain, wide, arch="sm_80")


def test_written_values_and_the_row_pass_are_priced() -> None:
    """chain_pricing: the values written out are HBM bytes of the chain kernel, the row
    pass the first GEMM's flops again; neither allows warp columns or n splits."""
    from dataclasses import replace

    from stitch.cost import get_spec
    from stitch.pricing.chain_pricing import chain_dims
    from stitch.cost.gemm_tile import chain_cost
    from stitch.schedule.chain_tiling import buildable
    from stitch.schedule.gemm_chain_space import best_schedule
    _, graph, stats = _chain(STATS)
    dims = chain_dims(graph, stats, tf32=True, grid_sync=True)
    assert dims.extra_output_bytes == 4 * 20 * 24 * 4 + 4 * 20 * 4
    assert not dims.row_pass and dims.row_reductions and not dims.n_splittable
    _, graph, probs = _chain(PROBS)
    dims = chain_dims(graph, probs, tf32=True)
    assert dims.row_pass and dims.extra_output_bytes == 2 * 4 * 20 * 24 * 4
    spec = get_spec("h100")
    # GPT-2 small's attention sizes, per layer.
    big = replace(dims, batch=96, m=1024, n=1024, k=64, h=64,
                  extra_output_bytes=2 * 96 * 1024 * 1024 * 4)
    found = best_schedule(spec, big)
    assert buildable(big, found.schedule)
    plain = replace(big, extra_output_bytes=0.0, row_pass=False)
    written = replace(plain, extra_output_bytes=big.extra_output_bytes)
    costs = [chain_cost(spec, d, found.schedule) for d in (plain, written, big)]
    assert costs[1].hbm_bytes - costs[0].hbm_bytes == pytest.approx(big.extra_output_bytes)
    assert costs[0].seconds < costs[1].seconds <= costs[2].seconds
    assert costs[1].flops < costs[2].flops < 2 * costs[1].flops    # S once more


@pytest.mark.parametrize("arch", ("sm_80", "sm_90"))
@pytest.mark.parametrize("dtype", ("f32", "bf16", "tf32"))
@pytest.mark.parametrize("form", (_STATS, _PROBS), ids=("stats", "probs"))
def test_training_chain_ptx_assembles_without_spills(form, dtype: str, arch: str) -> None:
    """Attention-sized (m = n = 256, k = h = 64) with codegen's default tiles; "tf32":
    f32 on TF32 tensor cores."""
    from stitch.codegen.nvptx import emit_ptx
    from tests.test_lowering_gemm_chain import _ptxas_or_skip
    _ptxas_or_skip(arch)
    from stitch.codegen.toolchain import assemble
    text = _text(*form, m=256, n=256, k=64, h=64)
    _, graph, chain = _chain(_narrow(text, dtype) if dtype == "bf16" else text)
    tiling = ChainTiling.default_for(chain, arch, allow_tf32=dtype == "tf32")
    assert tiling.mma == (dtype != "f32") and tiling.warp_cols == 1
    ptx = emit_ptx(lower_gemm_chain(graph, chain, tiling, name="chain", arch=arch).kernel, arch)
    report = assemble(ptx, arch, kernel_name="chain")["chain"]
    assert report.spill_store_bytes == 0 and report.spill_load_bytes == 0, report
    assert 0 < report.registers <= 255
