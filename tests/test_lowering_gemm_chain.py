"""GEMM chain kernels (stitch.codegen.gemm_chain): every MCFuser chain / attention model's tiny
configuration lowered, run on the host target with fresh random inputs and NaN-poisoned
outputs, against the reference evaluator (f32 1e-4, bf16 2e-2, f32 on TF32 tensor cores at
the tolerance of ``tf32_tolerance``); tiles that do not divide the dims; the host's TF32
rounding against an independent cvt.rna model on edge values; and the PTX of tiny and
full-size chains assembled by ptxas for sm_80 / sm_90 without spills."""
from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np
import pytest

from stitch.codegen import kir
from stitch.codegen.errors import CodegenError, ToolchainError
from stitch.codegen.gemm_chain import ChainTiling, lower_gemm_chain
from stitch.codegen.host import NUMPY_DTYPES, compile_host
from stitch.hlo.evaluator import evaluate
from stitch.hlo.evaluator.dtypes import numpy_dtype
from stitch.hlo.gemm_chains import GemmChain, find_gemm_chains
from stitch.hlo.graph import OpGraph, build_op_graphs
from stitch.hlo.ir import HloModule
from stitch.hlo.parser import parse_hlo
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


def tf32_tolerance(chain: GemmChain) -> float:
    """Absolute error allowed for a chain on TF32 tensor cores, relative to the output's RMS.

    TF32 keeps 10 mantissa bits, so each rounded operand is off by at most u = 2^-11
    relative and each product by at most 2u. An output element depends on k products per
    S element (the first GEMM) and n products (the second); with random inputs their
    errors have random signs and add like a random walk, so the error grows as sqrt(k + n)
    times one product's error, while the output itself grows as sqrt of its terms too.
    Rule: |got - want| <= 4 * 2^-11 * sqrt(k + n) * rms(want) (4 sigma of the walk, the
    program between the GEMMs passing S's error on with slope <= 1: tanh, gating, a
    normalized softmax). Measured on the tiny zoo chains: at most 0.3% of the RMS, within
    this bound (0.9% for k + n = 20) by 3x or more."""
    return 4 * 2.0 ** -11 * math.sqrt(chain.k + chain.n)


def cvt_rna_tf32(x: np.ndarray) -> np.ndarray:
    """An independent model of PTX ``cvt.rna.tf32.f32``, by arithmetic rather than bits:
    the nearest multiple of a tf32 ulp (2^(e - 10), e the binade, at least -126: tf32
    keeps f32's exponent range and its subnormals), ties away from zero; past the largest
    finite tf32 value, inf. Zeros, inf and NaN stay."""
    x = np.asarray(x, np.float32)
    with np.errstate(invalid="ignore"):         # signalling NaNs
        wide = x.astype(np.float64)
    plain = ~np.isfinite(wide) | (wide == 0)
    magnitude = np.where(plain, 1.0, np.abs(wide))
    _, e = np.frexp(magnitude)                  # |x| = m 2^e, m in [0.5, 1)
    ulp = np.ldexp(1.0, np.maximum(e - 1, -126) - 10)
    r = np.floor(magnitude / ulp + 0.5) * ulp
    r = np.where(r >= 2.0 ** 128, np.inf, r)
    return np.where(plain, x, np.copysign(r, wide).astype(np.float32))


def _with_tf32_algorithm(text: str) -> str:
    """Every dot of ``text`` marked ``algorithm=dot_tf32_tf32_f32`` (see _evaluate_rna)."""
    return re.sub(r"( dot\([^)]*\)[^\n]*)", r"\1, algorithm=dot_tf32_tf32_f32", text)


def _evaluate_rna(text: str, args: list[np.ndarray], monkeypatch) -> np.ndarray:
    """The evaluator's result with every dot's operands rounded as cvt.rna.tf32 does (its
    own TF32 algorithm rounds to nearest even: on values that came out of a short GEMM,
    with their low bits mostly zero, exact ties are common enough to matter)."""
    from stitch.hlo.evaluator import linalg

    def round_rna(algorithm: str, *operands: np.ndarray) -> list[np.ndarray]:
        assert "tf32" in algorithm.lower()
        return [cvt_rna_tf32(x) for x in operands]
    with monkeypatch.context() as patch:
        patch.setattr(linalg, "round_for_algorithm", round_rna)
        return evaluate(parse_hlo(_with_tf32_algorithm(text)), args)[0]


def _check_tf32(text: str, seed: int, monkeypatch,
                tiling: ChainTiling | None = None) -> GemmChain:
    """The chain on TF32 tensor cores against the evaluator: within ``tf32_tolerance`` of the
    f32 result; without a softmax also within 1e-5 of the RMS of the evaluator's own TF32
    result (same roundings, only the summation order differs): that one fails if the
    kernel does not round its operands, or rounds the wrong ones."""
    module, graph, chain = _load(text)
    assert chain.operand_dtype == "f32" and chain.tf32
    tiling = tiling or ChainTiling.default_for(chain, "sm_80", allow_tf32=True)
    assert tiling.mma
    args = _random_args(module, np.random.default_rng(seed))
    want = evaluate(module, args)[0].astype(np.float64).reshape(-1)
    got = run_chain(module, graph, chain, args, tiling)
    assert not np.isnan(got).any(), "the kernel left poisoned elements"
    rms = float(np.sqrt(np.mean(want ** 2)))
    np.testing.assert_allclose(got, want, rtol=0, atol=tf32_tolerance(chain) * rms)
    if not chain.softmax:
        # Softmax chains round exp(x - running max) before the division by the row sum;
        # the evaluator rounds the divided P: both within the TF32 tolerance, not equal.
        want_tf32 = _evaluate_rna(text, args, monkeypatch)
        np.testing.assert_allclose(got, want_tf32.astype(np.float64).reshape(-1), rtol=0,
                                   atol=1e-5 * rms)
        assert np.abs(want_tf32.reshape(-1) - want).max() > 1e-4 * rms, \
            "TF32 rounding should be visible against f32 here"
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


# ------------------------------------------------------------------ TF32 tensor cores

# TF32 tiles: one warp, 8-wide n steps, k stages of 8 (one MMA deep), 8-wide h blocks: two
# k stages (k = 10), three n steps (n = 24), every tile partial somewhere.
_TF32_TILES = ChainTiling(block_m=16, block_n=8, threads=32, thread_m=1, thread_n=1,
                          block_k=8, block_h=8, mma=True)
# Two warps, 16-wide n steps and k stages (two MMAs deep per stage, two S tiles per step).
_TF32_WIDE = ChainTiling(block_m=32, block_n=16, threads=64, thread_m=1, thread_n=1,
                         block_k=16, block_h=16, mma=True)


@pytest.mark.parametrize("model", MODELS)
def test_tf32_zoo_chain_matches_the_evaluator(model: str, monkeypatch) -> None:
    chain = _check_tf32(_fixture(model, "tiny", "gpu-h100"), sum(map(ord, model)) + 3,
                        monkeypatch)
    assert chain.softmax == model.startswith("attention_")


@pytest.mark.parametrize("tiling", (_TF32_TILES, _TF32_WIDE), ids=("k8", "k16"))
@pytest.mark.parametrize("text", (_EDGE, _GATED, _NORMALIZED),
                         ids=("softmax", "gated", "normalized"))
def test_tf32_chain_with_partial_tiles(text: str, tiling: ChainTiling, monkeypatch) -> None:
    _check_tf32(text, 23, monkeypatch, tiling)


def test_tf32_default_tiling_asks_and_checks() -> None:
    """TF32 only when asked, on sm_80+, and where the dots allow it."""
    _, _, chain = _load(_GATED)
    assert chain.tf32
    assert not ChainTiling.default_for(chain, "sm_80").mma
    assert not ChainTiling.default_for(chain, "sm_70", allow_tf32=True).mma
    for arch in ("sm_80", "sm_90"):
        tiling = ChainTiling.default_for(chain, arch, allow_tf32=True)
        assert tiling.mma and tiling.block_k % 8 == 0 and tiling.block_n % 8 == 0
    _, _, strict = _load(_GATED.replace("rhs_contracting_dims={1}\n",
                                        "rhs_contracting_dims={1}, "
                                        "operand_precision={highest,highest}\n", 1))
    assert not strict.tf32
    assert not ChainTiling.default_for(strict, "sm_90", allow_tf32=True).mma


@pytest.mark.parametrize("attrs, allowed", (
    ("", True),
    (", operand_precision={default,default}", True),
    (", operand_precision={high,high}", True),
    (", operand_precision={highest,default}", False),
    (", algorithm=dot_tf32_tf32_f32", True),
    (", algorithm=dot_f32_f32_f32", False),
    (", algorithm=dot_bf16_bf16_f32", False),
    (", algorithm=dot_tf32_tf32_f32_x3", False),
))
def test_chain_tf32_follows_the_dots_precision(attrs: str, allowed: bool) -> None:
    """GemmChain.tf32: both dots must allow TF32 (here only the second one varies)."""
    text = _GATED.replace("ROOT o = f32[2,20,6] dot(p, c), lhs_batch_dims={0}, "
                          "lhs_contracting_dims={2}, rhs_batch_dims={0}, "
                          "rhs_contracting_dims={1}",
                          "ROOT o = f32[2,20,6] dot(p, c), lhs_batch_dims={0}, "
                          "lhs_contracting_dims={2}, rhs_batch_dims={0}, "
                          "rhs_contracting_dims={1}" + attrs)
    assert text != _GATED or not attrs
    _, _, chain = _load(text)
    assert chain.tf32 == allowed


def test_cublas_highest_precision_forbids_tf32() -> None:
    text = _fixture("attention_bert_base", "tiny", "gpu-v100")
    assert _load(text)[2].tf32
    strict = text.replace('"operand_precision":["DEFAULT","DEFAULT"]',
                          '"operand_precision":["HIGHEST","HIGHEST"]', 1)
    assert strict != text
    assert not _load(strict)[2].tf32


def test_tensor_cores_refuse_full_precision_f32_chains() -> None:
    """An f32 chain whose dots ask for HIGHEST precision must not run on TF32, and tensor
    cores need sm_80+."""
    text = _GATED.replace("rhs_contracting_dims={1}\n",
                          "rhs_contracting_dims={1}, operand_precision={highest,highest}\n", 1)
    _, graph, chain = _load(text)
    with pytest.raises(CodegenError, match="full f32 precision"):
        lower_gemm_chain(graph, chain, _TF32_TILES)
    _, graph, chain = _load(_GATED)
    with pytest.raises(CodegenError, match="sm_80"):
        lower_gemm_chain(graph, chain, _TF32_TILES, arch="sm_75")
    with pytest.raises(CodegenError, match="block_k"):     # bf16 MMAs are 16 deep
        lower_gemm_chain(*_load(_narrow(_GATED, "bf16"))[1:], _TF32_TILES)


# ------------------------------------------------------------------ PTX


def _ptxas_or_skip(arch: str) -> None:
    from stitch.codegen.nvptx import default_libdevice_path
    from stitch.codegen.toolchain import find_ptxas
    if default_libdevice_path() is None:
        pytest.skip("no libdevice")
    try:
        find_ptxas(arch)
    except ToolchainError:
        pytest.skip(f"no ptxas for {arch}")


@pytest.mark.parametrize("arch", ("sm_80", "sm_90"))
@pytest.mark.parametrize("dtype", ("f32", "bf16", "tf32"))
@pytest.mark.parametrize("config", ("tiny", "full"))
@pytest.mark.parametrize("model", MODELS)
def test_chain_ptx_assembles_without_spills(model: str, config: str, dtype: str,
                                            arch: str) -> None:
    """dtype "tf32": the f32 fixture on TF32 tensor cores (default_for's allow_tf32)."""
    _ptxas_or_skip(arch)
    if config == "tiny" and dtype == "bf16":
        pytest.skip("tiny tensor-core tiles are checked on the host; full ones here")
    from stitch.codegen.nvptx import emit_ptx
    from stitch.codegen.toolchain import assemble
    _, graph, chain = _load(_narrow(_fixture(model, config, "gpu-h100"),
                                    "f32" if dtype == "tf32" else dtype))
    tiling = ChainTiling.default_for(chain, arch, allow_tf32=dtype == "tf32")
    assert tiling.mma == (dtype != "f32")
    lowered = lower_gemm_chain(graph, chain, tiling, name="chain", arch=arch)
    ptx = emit_ptx(lowered.kernel, arch)
    assert "bar.sync" in ptx
    assert ("shfl.sync.bfly" in ptx) == chain.softmax    # the row max / sum butterflies
    assert ("mma.sync.aligned.m16n8k16" in ptx) == (dtype == "bf16")
    assert ("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in ptx) == (dtype == "tf32")
    assert ("cvt.rna.tf32.f32" in ptx) == (dtype == "tf32")
    report = assemble(ptx, arch, kernel_name="chain")["chain"]
    assert report.spill_store_bytes == 0 and report.spill_load_bytes == 0, report
    assert 0 < report.registers <= 128
    assert report.shared_bytes == tiling.shared_bytes()


# ------------------------------------------------------------------ tensor-core MMA


# (m, n, k) per MMA operand type, and where a lane's fragment values sit, straight from
# the PTX ISA ("Matrix Fragments for mma.m16n8k16 / mma.m16n8k8"): (row, col) as functions
# of g = lane >> 2 and q = lane & 3.
_SHAPES = {"bf16": (16, 8, 16), "f16": (16, 8, 16), "tf32": (16, 8, 8)}
_A_PLACES = {
    "bf16": [lambda g, q, i=i: (g + 8 * ((i // 2) % 2), 2 * q + i % 2 + 8 * (i // 4))
             for i in range(8)],
    "tf32": [lambda g, q: (g, q), lambda g, q: (g + 8, q),
             lambda g, q: (g, q + 4), lambda g, q: (g + 8, q + 4)],
}
_B_PLACES = {
    "bf16": [lambda g, q, i=i: (2 * q + i % 2 + 8 * (i // 2), g) for i in range(4)],
    "tf32": [lambda g, q: (q, g), lambda g, q: (q + 4, g)],
}
_A_PLACES["f16"], _B_PLACES["f16"] = _A_PLACES["bf16"], _B_PLACES["bf16"]


def _mma_kernel(dtype: str, warps: int = 2):
    """Each warp loads its own A[16 x k], B[k x 8], C[16 x 8] in the fragment layout of
    dtype's MMA shape (kir.MmaSync's docstring), runs one MmaSync and stores D by C's
    layout."""
    from stitch.codegen.kir import (Binary, Kernel, Let, Load, MmaSync, Param, Ref, Store, ThreadIdx,
                                    i32)
    _, _, depth = _SHAPES[dtype]
    a_size, b_size = 16 * depth, depth * 8
    a_buf, b_buf = Param("a", "f32", warps * a_size), Param("b", "f32", warps * b_size)
    c_buf, d_buf = Param("c", "f32", warps * 128), Param("d", "f32", warps * 128, True)

    def add(x, y):
        return Binary("add", x, y)

    def mul(x, y):
        return Binary("mul", x, y)

    class Lin:
        """An affine index in g and q (so the ISA's formulas apply to Kernel IR refs)."""
        def __init__(self, expr):
            self.expr = expr

        def __add__(self, other):
            return Lin(add(self.expr, other.expr if isinstance(other, Lin) else i32(other)))

        __radd__ = __add__

        def __rmul__(self, factor):
            return Lin(mul(self.expr, i32(factor)))
    t = ThreadIdx()
    body = [Let("lane", Binary("rem", t, i32(32))), Let("warp", Binary("div", t, i32(32)))]
    lane, warp = Ref("lane", "i32"), Ref("warp", "i32")
    body += [Let("g", Binary("div", lane, i32(4))), Let("q", Binary("rem", lane, i32(4)))]
    g, q = Lin(Ref("g", "i32")), Lin(Ref("q", "i32"))

    def at(size, width, place):
        row, col = place(g, q)
        return add(mul(warp, i32(size)), (width * row + col).expr)
    a = [Load(a_buf, at(a_size, depth, f)) for f in _A_PLACES[dtype]]
    b = [Load(b_buf, at(b_size, 8, f)) for f in _B_PLACES[dtype]]
    places = [at(128, 8, lambda g, q, i=i: (g + 8 * (i // 2), 2 * q + i % 2)) for i in range(4)]
    c = [Load(c_buf, p) for p in places]
    body.append(MmaSync(("d0", "d1", "d2", "d3"), a, b, c, dtype))
    body += [Store("d", p, Ref(f"d{i}", "f32")) for i, p in enumerate(places)]
    return Kernel("mma_test", (a_buf, b_buf, c_buf, d_buf), (), 1, 32 * warps, body).validate()


@pytest.mark.parametrize("dtype", ("bf16", "f16", "tf32"))
def test_mma_sync_on_the_host_is_the_rounded_product(dtype: str) -> None:
    _, _, depth = _SHAPES[dtype]
    kernel = compile_host(_mma_kernel(dtype))
    rng = np.random.default_rng(3)
    a = rng.standard_normal((2, 16, depth)).astype(np.float32)
    b = rng.standard_normal((2, depth, 8)).astype(np.float32)
    c = rng.standard_normal((2, 16, 8)).astype(np.float32)
    d = np.full(256, np.nan, np.float32)
    kernel(a.reshape(-1), b.reshape(-1), c.reshape(-1), d)
    narrow = {"bf16": lambda x: x.astype(ml_dtypes.bfloat16),
              "f16": lambda x: x.astype(np.float16), "tf32": cvt_rna_tf32}[dtype]
    want = narrow(a).astype(np.float64) @ narrow(b).astype(np.float64) + c
    np.testing.assert_allclose(d.reshape(2, 16, 8), want, rtol=1e-5, atol=1e-5)
    # Unrounded operands would miss by far more than that.
    assert np.abs(a.astype(np.float64) @ b + c - want).max() > 1e-3


def _bits(*patterns: int) -> np.ndarray:
    return np.array(patterns, np.uint32).view(np.float32)


# Edge values of the TF32 rounding (bit patterns; tf32 keeps bits 13..31 of an f32).
_TF32_EDGES = _bits(
    0x3F800000, 0x3F802000,                 # 1.0 and 1 + 2^-10: already tf32
    0x3F801000, 0xBF801000,                 # exact ties, kept lsb even: away (RNE would not)
    0x3F803000, 0xBF803000,                 # exact ties, kept lsb odd
    0x3F800FFF, 0x3F801001, 0xBF801001,     # just below / above a tie
    0x3FFFFFFF, 0x3FFFF000, 0x3FFFEFFF,     # full mantissa: carry into the exponent, tie, not
    0x7F7FFFFF, 0x7F7FF000, 0xFF7FF000,     # the largest f32s: round to +-inf
    0x7F7FEFFF, 0x7F7FE000,                 # ... or to the largest tf32
    0x00000001, 0x00000FFF, 0x00001000,     # subnormals: to 0, to 0, tie away to 2^-136
    0x80001000, 0x00003000, 0x007FFFFF,     # negative tie, odd tie, up to the smallest normal
    0x00800FFF, 0x00801000,                 # the smallest normal binade
    0x00000000, 0x80000000,                 # zeros keep their sign
    0x7F800000, 0xFF800000,                 # inf
    0x7FC00000, 0xFFC01234, 0x7F800001,     # NaNs (one with its payload in the dropped bits)
)


@pytest.mark.parametrize("operand", ("a", "b"))
def test_host_tf32_rounding_is_cvt_rna(operand: str) -> None:
    """The host's TF32 operand rounding, bit for bit, against ``cvt_rna_tf32`` on edge values
    and random bit patterns. Each value goes through one MMA as A[r][0] x 1 (or 1 x B[0][c])
    with every other product -0 x 0 and C = -0, so D[r][0] (D[0][c]) is the rounded value
    itself, signed zeros and infinities included."""
    rng = np.random.default_rng(29)
    random = rng.integers(0, 2 ** 32, 200, dtype=np.uint64).astype(np.uint32).view(np.float32)
    values = np.concatenate([_TF32_EDGES, random[np.isfinite(random)]])
    per_warp = 16 if operand == "a" else 8
    warps = -(-len(values) // per_warp)
    assert warps <= 32
    values = np.concatenate([values, np.full(warps * per_warp - len(values), 3.0, np.float32)])
    a = np.zeros((warps, 16, 8), np.float32)
    b = np.zeros((warps, 8, 8), np.float32)
    if operand == "a":
        a[:, :, 1:] = -0.0
        a[:, :, 0] = values.reshape(warps, 16)
        b[:, 0, 0] = 1.0
    else:
        a[:] = -0.0
        a[:, 0, 0] = 1.0
        b[:, 0, :] = values.reshape(warps, 8)
    c = np.full((warps, 16, 8), -0.0, np.float32)
    d = np.full(warps * 128, np.nan, np.float32)
    compile_host(_mma_kernel("tf32", warps))(a.reshape(-1), b.reshape(-1), c.reshape(-1), d)
    d = d.reshape(warps, 16, 8)
    got = (d[:, :, 0] if operand == "a" else d[:, 0, :]).reshape(-1)
    want = cvt_rna_tf32(values)
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all()
    assert (got[~nan].view(np.uint32) == want[~nan].view(np.uint32)).all(), [
        (hex(v), hex(g), hex(w)) for v, g, w in zip(values.view(np.uint32)[~nan],
                                                   got[~nan].view(np.uint32),
                                                   want[~nan].view(np.uint32)) if g != w][:5]
    # The model itself: ties away from zero, overflow to inf, subnormal ties.
    assert cvt_rna_tf32(_bits(0x3F801000)).view(np.uint32)[0] == 0x3F802000
    assert cvt_rna_tf32(_bits(0x7F7FF000))[0] == np.inf
    assert cvt_rna_tf32(_bits(0x80001000)).view(np.uint32)[0] == 0x80002000


@pytest.mark.parametrize("arch", ("sm_80", "sm_90"))
@pytest.mark.parametrize("dtype", ("bf16", "f16", "tf32"))
def test_mma_sync_ptx_is_the_tensor_core_instruction(dtype: str, arch: str) -> None:
    _ptxas_or_skip(arch)
    from stitch.codegen.nvptx import emit_ptx
    from stitch.codegen.toolchain import assemble
    ptx = emit_ptx(_mma_kernel(dtype), arch)
    m, n, k = _SHAPES[dtype]
    assert f"mma.sync.aligned.m{m}n{n}k{k}.row.col.f32.{dtype}.{dtype}.f32" in ptx
    # TF32: every A and B value rounded by the cvt (4 + 2 per lane), not just truncated.
    assert ptx.count("cvt.rna.tf32.f32") == (6 if dtype == "tf32" else 0)
    report = assemble(ptx, arch, kernel_name="mma_test")["mma_test"]
    assert report.spill_store_bytes == 0


def test_mma_sync_fragment_sizes_follow_the_shape() -> None:
    """tf32 (m16n8k8) takes 4 A and 2 B values per lane, bf16 (m16n8k16) 8 and 4: the
    validator refuses one shape's fragments under the other's type."""
    from stitch.codegen.kir import Kernel, MmaSync, Param, Ref, Store, ThreadIdx, f32
    out = Param("d", "f32", 128, True)

    def kernel(dtype: str, a: int, b: int) -> Kernel:
        mma = MmaSync(("d0", "d1", "d2", "d3"), [f32(1.5)] * a, [f32(0.5)] * b,
                      [f32(0.25)] * 4, dtype)
        return Kernel("k", (out,), (), 1, 32, [mma, Store("d", ThreadIdx(), Ref("d0", "f32"))])
    kernel("tf32", 4, 2).validate()
    kernel("bf16", 8, 4).validate()
    with pytest.raises(CodegenError, match="m16n8k8"):
        kernel("tf32", 8, 4).validate()
    with pytest.raises(CodegenError, match="m16n8k16"):
        kernel("bf16", 4, 2).validate()
    with pytest.raises(CodegenError, match="dtype"):
        MmaSync(("d0", "d1", "d2", "d3"), [f32(1.0)] * 4, [f32(1.0)] * 2, [f32(1.0)] * 4, "f32")


def test_mma_sync_prints() -> None:
    from stitch.codegen.printer import format_kernel
    assert "mma_m16n8k16_bf16(" in format_kernel(_mma_kernel("bf16"))
    assert "mma_m16n8k8_tf32(" in format_kernel(_mma_kernel("tf32"))


# ------------------------------------------------------------------ chains in a program


@pytest.mark.parametrize("stage", ("gpu-v100", "gpu-a100", "gpu-h100", "pre"))
def test_bert_layer_runs_with_its_chains_as_kernels(stage: str) -> None:
    """The BERT layer (tiny) with every chain (attention with its mask; in jax's form the
    FFN too) run as a chain kernel on the host, the rest by the reference ops, as the
    compiler's runner does; outputs poisoned; against the evaluator on the whole module."""
    from stitch.hlo.graph_exec import GraphRunner, NumpyBackend, Unit
    from stitch.hlo.op_classes import OpClass
    from stitch.codegen.values import leaf
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
