"""GEMM chain kernels (codegen.gemm_chain): every MCFuser chain / attention model's tiny
configuration lowered, run on the host target with fresh random inputs and NaN-poisoned
outputs, against the reference evaluator (f32 1e-4, bf16 2e-2); tiles that do not divide
the dims; and the PTX of tiny and full-size chains assembled by ptxas for sm_80 / sm_90
without spills."""
from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

from codegen import kir
from codegen.errors import CodegenError, ToolchainError
from codegen.gemm_chain import ChainTiling, lower_gemm_chain
from codegen.host import NUMPY_DTYPES, compile_host
from hlo_passes.evaluator import evaluate
from hlo_passes.evaluator.dtypes import numpy_dtype
from hlo_passes.gemm_chains import GemmChain, find_gemm_chains
from hlo_passes.graph import OpGraph, build_op_graphs
from hlo_passes.ir import HloModule
from hlo_passes.parser import parse_hlo
from stitch.models.mcfuser import ATTENTIONS, GEMM_CHAINS
from tests.fixtures import DATA, REDUCERS

MODELS = sorted([f"gemm_chain_{g}" for g in GEMM_CHAINS] + [f"attention_{a}" for a in ATTENTIONS])


def _load(text: str) -> tuple[HloModule, OpGraph, GemmChain]:
    module = parse_hlo(text)
    graph = build_op_graphs(module)[0]
    chains = find_gemm_chains(graph)
    assert len(chains) == 1
    return module, graph, chains[0]


def _fixture(model: str, config: str, stage: str) -> str:
    return (DATA / model / f"{config}.{stage}.hlo").read_text()


def _random_args(module: HloModule, rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.standard_normal(p.shape.dims).astype(numpy_dtype(p.shape.element_type))
            for p in module.entry.parameters]


def run_chain(module: HloModule, graph: OpGraph, chain: GemmChain, args: list[np.ndarray],
              tiling: ChainTiling | None = None) -> np.ndarray:
    """The chain kernel's output (flat) on the host, its output buffer poisoned with NaN."""
    lowered = lower_gemm_chain(graph, chain, tiling, name="chain")
    kernel = compile_host(lowered.kernel)
    params = lowered.kernel.params
    ins = []
    for p, v in zip(params, lowered.inputs):
        number = graph.nodes[v].instruction.parameter_number
        assert graph.nodes[v].opcode == "parameter", "test chains read parameters only"
        ins.append(np.ascontiguousarray(args[number], dtype=NUMPY_DTYPES[p.dtype]).reshape(-1))
    out = np.full(params[-1].size, np.nan, NUMPY_DTYPES[params[-1].dtype])
    kernel(*ins, out)
    return out.astype(np.float64)


def _check(text: str, seed: int, tol: float, tiling: ChainTiling | None = None) -> GemmChain:
    module, graph, chain = _load(text)
    args = _random_args(module, np.random.default_rng(seed))
    want = evaluate(module, args)[0].astype(np.float64).reshape(-1)
    got = run_chain(module, graph, chain, args, tiling)
    assert not np.isnan(got).any(), "the kernel left poisoned elements"
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    return chain


@pytest.mark.parametrize("stage", ("gpu-h100", "gpu-a100"))
@pytest.mark.parametrize("model", MODELS)
def test_tiny_zoo_chain_matches_the_evaluator(model: str, stage: str) -> None:
    chain = _check(_fixture(model, "tiny", stage), seed=sum(map(ord, model + stage)), tol=1e-4)
    assert chain.softmax == model.startswith("attention_")


def _narrow(text: str, dtype: str) -> str:
    return re.sub(r"\bf32\[", f"{dtype}[", text)


@pytest.mark.parametrize("arch", ("sm_70", "sm_80"))       # FMA tiles / tensor cores
@pytest.mark.parametrize("dtype", ("bf16", "f16"))
@pytest.mark.parametrize("model", ("attention_bert_base", "attention_vit_huge",
                                   "gemm_chain_g1", "gemm_chain_g5"))
def test_narrow_chain_matches_the_evaluator(model: str, dtype: str, arch: str) -> None:
    text = _narrow(_fixture(model, "tiny", "gpu-h100"), dtype)
    module, _, chain = _load(text)
    assert chain.operand_dtype == dtype
    assert module.entry.parameters[0].shape.element_type == dtype
    tiling = ChainTiling.default_for(chain, arch)
    assert tiling.mma == (arch == "sm_80")
    _check(text, seed=11, tol=2e-2, tiling=tiling)


# ------------------------------------------------------------------ edges and masks

_EDGE = "HloModule edge\n" + REDUCERS + """
ENTRY e {
  a = f32[2,20,10] parameter(0)
  b = f32[2,24,10] parameter(1)
  c = f32[2,24,6] parameter(2)
  mask = f32[2,20,24] parameter(3)
  s = f32[2,20,24] dot(a, b), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={2}
  k = f32[] constant(0.3)
  kb = f32[2,20,24] broadcast(k), dimensions={}
  sc = f32[2,20,24] multiply(s, kb)
  x = f32[2,20,24] add(sc, mask)
  ninf = f32[] constant(-inf)
  mx = f32[2,20] reduce(x, ninf), dimensions={2}, to_apply=max
  mxb = f32[2,20,24] broadcast(mx), dimensions={0,1}
  d = f32[2,20,24] subtract(x, mxb)
  ex = f32[2,20,24] exponential(d)
  zero = f32[] constant(0)
  sm = f32[2,20] reduce(ex, zero), dimensions={2}, to_apply=add
  smb = f32[2,20,24] broadcast(sm), dimensions={0,1}
  p = f32[2,20,24] divide(ex, smb)
  ROOT o = f32[2,20,6] dot(p, c), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}
"""

_GATED = "HloModule gated\n" + """
ENTRY e {
  a = f32[2,20,10] parameter(0)
  b = f32[2,10,24] parameter(1)
  c = f32[2,24,6] parameter(2)
  gate = f32[2,20,24] parameter(3)
  s = f32[2,20,24] dot(a, b), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
  t = f32[2,20,24] tanh(s)
  p = f32[2,20,24] multiply(t, gate)
  ROOT o = f32[2,20,6] dot(p, c), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}
"""

# Tiles that divide none of m=20, n=24, k=10, h=6 (two n steps, three k stages).
_SMALL_TILES = ChainTiling(block_m=16, block_n=16, threads=32, thread_m=4, thread_n=2,
                           block_k=4, block_h=8)


def test_masked_softmax_chain_with_partial_tiles() -> None:
    chain = _check(_EDGE, seed=5, tol=1e-4, tiling=_SMALL_TILES)
    assert chain.softmax and (chain.m, chain.n, chain.k, chain.h) == (20, 24, 10, 6)
    assert len(chain.inputs) == 4


def test_gated_chain_with_partial_tiles() -> None:
    chain = _check(_GATED, seed=6, tol=1e-4, tiling=_SMALL_TILES)
    assert not chain.softmax


# Tensor-core tiles: one warp, 16-wide n steps and k stages, 8-wide h blocks.
_MMA_TILES = ChainTiling(block_m=16, block_n=16, threads=32, thread_m=1, thread_n=1,
                         block_k=16, block_h=8, mma=True)


@pytest.mark.parametrize("text", (_EDGE, _GATED), ids=("softmax", "gated"))
def test_tensor_core_chain_with_partial_tiles(text: str) -> None:
    chain = _check(_narrow(text, "bf16"), seed=12, tol=2e-2, tiling=_MMA_TILES)
    assert chain.operand_dtype == "bf16"


def test_tensor_cores_refuse_f32_chains() -> None:
    _, graph, chain = _load(_GATED)
    with pytest.raises(CodegenError, match="bf16/f16"):
        lower_gemm_chain(graph, chain, _MMA_TILES)


@pytest.mark.parametrize("model", ("attention_vit_base", "gemm_chain_g2"))
def test_scaled_second_cublas_gemm(model: str) -> None:
    """cuBLAS alpha on the second GEMM scales the stored result."""
    text = _fixture(model, "tiny", "gpu-v100")
    first = text.index('"alpha_real":')
    second = text.index('"alpha_real":', first + 1)
    end = text.index(",", second)
    text = text[:second] + '"alpha_real":0.75' + text[end:]
    chain = _check(text, seed=17, tol=1e-4)
    assert chain.output_scale == 0.75


def test_one_buffer_read_as_a_b_and_c() -> None:
    from tests.test_gemm_chains import SELF_ATTENTION
    chain = _check(SELF_ATTENTION, seed=13, tol=1e-4)
    assert len(chain.inputs) == 1


def test_default_tiling_on_partial_tiles() -> None:
    _check(_EDGE, seed=7, tol=1e-4)


def test_masked_row_gives_zero_probability_not_nan() -> None:
    """Columns masked with -inf drop out of the softmax; a whole n step masked keeps the
    running max at -inf without NaNs (exp(-inf - -inf))."""
    module, graph, chain = _load(_EDGE)
    rng = np.random.default_rng(9)
    args = _random_args(module, rng)
    args[3][:, :, :16] = -np.inf           # the first n step (16 columns) fully masked
    want = evaluate(module, args)[0].reshape(-1)
    got = run_chain(module, graph, chain, args, _SMALL_TILES)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_bad_tilings_are_refused() -> None:
    with pytest.raises(CodegenError):
        ChainTiling(block_m=16, block_n=16, threads=64, thread_m=4, thread_n=2).check()
    with pytest.raises(CodegenError):     # 64 lanes per row: more than a warp
        ChainTiling(block_m=4, block_n=64, threads=64, thread_m=4, thread_n=1).check()
    with pytest.raises(CodegenError):     # > 48 KiB of shared memory
        ChainTiling(block_m=64, block_n=64, threads=256, thread_m=4, thread_n=4,
                    block_h=256).check()


_NORMALIZED = "HloModule normalized\n" + REDUCERS + """
ENTRY e {
  a = f32[2,20,10] parameter(0)
  b = f32[2,10,24] parameter(1)
  c = f32[2,24,6] parameter(2)
  s = f32[2,20,24] dot(a, b), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
  zero = f32[] constant(0)
  inv_n = f32[] constant(0.041666668)
  inv_nb = f32[2,20] broadcast(inv_n), dimensions={}
  total = f32[2,20] reduce(s, zero), dimensions={2}, to_apply=add
  mean = f32[2,20] multiply(total, inv_nb)
  meanb = f32[2,20,24] broadcast(mean), dimensions={0,1}
  centered = f32[2,20,24] subtract(s, meanb)
  squares = f32[2,20,24] multiply(centered, centered)
  sq = f32[2,20] reduce(squares, zero), dimensions={2}, to_apply=add
  var = f32[2,20] multiply(sq, inv_nb)
  eps = f32[] constant(1e-05)
  epsb = f32[2,20] broadcast(eps), dimensions={}
  ve = f32[2,20] add(var, epsb)
  rs = f32[2,20] rsqrt(ve)
  rsb = f32[2,20,24] broadcast(rs), dimensions={0,1}
  p = f32[2,20,24] multiply(centered, rsb)
  ROOT o = f32[2,20,6] dot(p, c), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}
"""


def test_row_normalization_between_gemms_takes_a_pass_per_reduction() -> None:
    """A layer norm over n between the GEMMs: the mean's and the variance's passes over n
    (S recomputed), then the pass feeding the second GEMM; tiles that divide nothing."""
    chain = _check(_NORMALIZED, seed=14, tol=1e-4, tiling=_SMALL_TILES)
    assert not chain.softmax
    assert sum(op.kind == "reduce" for op in chain.program) == 2
    _, graph, _ = _load(_NORMALIZED)
    kernel = lower_gemm_chain(graph, chain, _SMALL_TILES).kernel
    assert sum(isinstance(s, kir.For) and s.var == "n0" for s in kernel.body) == 3


def test_row_normalization_on_tensor_cores() -> None:
    _check(_narrow(_NORMALIZED, "bf16"), seed=15, tol=3e-2, tiling=_MMA_TILES)


def test_max_and_tanh_sum_are_not_a_softmax_but_lower() -> None:
    text = _EDGE.replace("ex = f32[2,20,24] exponential(d)", "ex = f32[2,20,24] tanh(d)")
    _, _, chain = _load(text)
    assert not chain.softmax
    _check(text, seed=16, tol=1e-4, tiling=_SMALL_TILES)


# ------------------------------------------------------------------ PTX


def _ptxas_or_skip(arch: str) -> None:
    from codegen.nvptx import default_libdevice_path
    from codegen.toolchain import find_ptxas
    if default_libdevice_path() is None:
        pytest.skip("no libdevice")
    try:
        find_ptxas(arch)
    except ToolchainError:
        pytest.skip(f"no ptxas for {arch}")


@pytest.mark.parametrize("arch", ("sm_80", "sm_90"))
@pytest.mark.parametrize("dtype", ("f32", "bf16"))
@pytest.mark.parametrize("config", ("tiny", "full"))
@pytest.mark.parametrize("model", MODELS)
def test_chain_ptx_assembles_without_spills(model: str, config: str, dtype: str,
                                            arch: str) -> None:
    _ptxas_or_skip(arch)
    if config == "tiny" and dtype == "bf16":
        pytest.skip("tiny tensor-core tiles are checked on the host; full ones here")
    from codegen.nvptx import emit_ptx
    from codegen.toolchain import assemble
    _, graph, chain = _load(_narrow(_fixture(model, config, "gpu-h100"), dtype))
    lowered = lower_gemm_chain(graph, chain, name="chain", arch=arch)
    ptx = emit_ptx(lowered.kernel, arch)
    assert "bar.sync" in ptx
    assert ("shfl.sync.bfly" in ptx) == chain.softmax    # the row max / sum butterflies
    assert ("mma.sync.aligned.m16n8k16" in ptx) == (dtype == "bf16")
    report = assemble(ptx, arch, kernel_name="chain")["chain"]
    assert report.spill_store_bytes == 0 and report.spill_load_bytes == 0, report
    assert 0 < report.registers <= 128
    assert report.shared_bytes == ChainTiling.default_for(chain, arch).shared_bytes()


# ------------------------------------------------------------------ tensor-core MMA


def _mma_kernel(dtype: str, warps: int = 2):
    """Each warp loads its own A[16x16], B[16x8], C[16x8] in the m16n8k16 fragment layout
    (kir.MmaSync's docstring), runs one MmaSync and stores D by the same layout."""
    from codegen.kir import (Binary, Kernel, Let, Load, MmaSync, Param, Ref, Store, ThreadIdx,
                             i32)
    a_buf, b_buf = Param("a", "f32", warps * 256), Param("b", "f32", warps * 128)
    c_buf, d_buf = Param("c", "f32", warps * 128), Param("d", "f32", warps * 128, True)

    def add(x, y):
        return Binary("add", x, y)

    def mul(x, y):
        return Binary("mul", x, y)
    t = ThreadIdx()
    body = [Let("lane", Binary("rem", t, i32(32))), Let("warp", Binary("div", t, i32(32)))]
    lane, warp = Ref("lane", "i32"), Ref("warp", "i32")
    body += [Let("g", Binary("div", lane, i32(4))),
             Let("q2", mul(Binary("rem", lane, i32(4)), i32(2)))]
    g, q2 = Ref("g", "i32"), Ref("q2", "i32")
    a = [Load(a_buf, add(mul(warp, i32(256)), add(mul(add(g, i32(8 * ((i // 2) % 2))), i32(16)),
                                                  add(q2, i32(i % 2 + 8 * (i // 4))))))
         for i in range(8)]
    b = [Load(b_buf, add(mul(warp, i32(128)), add(mul(add(q2, i32(i % 2 + 8 * (i // 2))),
                                                      i32(8)), g))) for i in range(4)]
    places = [add(mul(warp, i32(128)), add(mul(add(g, i32(8 * (i // 2))), i32(8)),
                                           add(q2, i32(i % 2)))) for i in range(4)]
    c = [Load(c_buf, p) for p in places]
    body.append(MmaSync(("d0", "d1", "d2", "d3"), a, b, c, dtype))
    body += [Store("d", p, Ref(f"d{i}", "f32")) for i, p in enumerate(places)]
    return Kernel("mma_test", (a_buf, b_buf, c_buf, d_buf), (), 1, 32 * warps, body).validate()


@pytest.mark.parametrize("dtype", ("bf16", "f16"))
def test_mma_sync_on_the_host_is_the_rounded_product(dtype: str) -> None:
    kernel = compile_host(_mma_kernel(dtype))
    rng = np.random.default_rng(3)
    a = rng.standard_normal((2, 16, 16)).astype(np.float32)
    b = rng.standard_normal((2, 16, 8)).astype(np.float32)
    c = rng.standard_normal((2, 16, 8)).astype(np.float32)
    d = np.full(256, np.nan, np.float32)
    kernel(a.reshape(-1), b.reshape(-1), c.reshape(-1), d)
    narrow = {"bf16": ml_dtypes.bfloat16, "f16": np.float16}[dtype]
    want = a.astype(narrow).astype(np.float64) @ b.astype(narrow).astype(np.float64) + c
    np.testing.assert_allclose(d.reshape(2, 16, 8), want, rtol=1e-5, atol=1e-5)
    # Unrounded operands would miss by far more than that.
    assert np.abs(a.astype(np.float64) @ b + c - want).max() > 1e-3


@pytest.mark.parametrize("arch", ("sm_80", "sm_90"))
@pytest.mark.parametrize("dtype", ("bf16", "f16"))
def test_mma_sync_ptx_is_the_tensor_core_instruction(dtype: str, arch: str) -> None:
    _ptxas_or_skip(arch)
    from codegen.nvptx import emit_ptx
    from codegen.toolchain import assemble
    ptx = emit_ptx(_mma_kernel(dtype), arch)
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{dtype}.{dtype}.f32" in ptx
    report = assemble(ptx, arch, kernel_name="mma_test")["mma_test"]
    assert report.spill_store_bytes == 0


def test_mma_sync_prints() -> None:
    from codegen.printer import format_kernel
    assert "mma_m16n8k16_bf16(" in format_kernel(_mma_kernel("bf16"))


# ------------------------------------------------------------------ chains in a program


@pytest.mark.parametrize("stage", ("gpu-v100", "gpu-a100", "gpu-h100", "pre"))
def test_bert_layer_runs_with_its_chains_as_kernels(stage: str) -> None:
    """The BERT layer (tiny) with every chain (attention with its mask; in jax's form the
    FFN too) run as a chain kernel on the host, the rest by the reference ops, as the
    compiler's runner does; outputs poisoned; against the evaluator on the whole module."""
    from hlo_passes.graph_exec import GraphRunner, NumpyBackend, Unit
    from hlo_passes.op_classes import OpClass
    from codegen.values import leaf
    module = parse_hlo(_fixture("bert_layer_infer", "tiny", stage))
    graphs = build_op_graphs(module)
    graph = graphs[0]
    units = []
    for index, chain in enumerate(find_gemm_chains(graph)):
        lowered = lower_gemm_chain(graph, chain, name=f"chain{index}")
        kernel = compile_host(lowered.kernel)
        shape = leaf(graph.nodes[chain.output].shape)

        def run(values, kernel=kernel, params=lowered.kernel.params, shape=shape):
            ins = [np.ascontiguousarray(np.asarray(v), dtype=NUMPY_DTYPES[p.dtype]).reshape(-1)
                   for p, v in zip(params, values)]
            out = np.full(params[-1].size, np.nan, NUMPY_DTYPES[params[-1].dtype])
            kernel(*ins, out)
            return [out.reshape(shape.dims).astype(numpy_dtype(shape.element_type))]
        members = frozenset(v for v in chain.members
                            if graph.nodes[v].op_class is not OpClass.SOURCE
                            or graph.nodes[v].opcode == "constant") - set(lowered.inputs)
        units.append(Unit(members, tuple(lowered.inputs), tuple(lowered.outputs), run,
                          f"chain{index}"))
    assert len(units) == (2 if stage == "pre" else 1)
    args = _random_args(module, np.random.default_rng(21))
    want = evaluate(module, args)
    got = GraphRunner(module, graphs, NumpyBackend(module), {0: units}).run(args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64),
                                   rtol=1e-4, atol=1e-4)
