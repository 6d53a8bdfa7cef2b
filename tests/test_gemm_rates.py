"""GEMMs priced at the target's tensor-core rate (stitch/cost/gemm_rates.py) through the
delta cost model: operand type, precision setting, the roofline's memory side."""
from __future__ import annotations

import random

import pytest

from stitch.pricing.delta import CostModel
from stitch.cost.gemm_rates import (ACHIEVABLE_GEMM_FRACTION, FP32, HALF, TF32, peak_flops,
                                    precision_class)
from stitch.cost.gpu_specs import get_spec
from stitch.hlo.graph import build_op_graphs
from stitch.hlo.op_classes import OpClass
from stitch.hlo.parser import parse_hlo


def _dot_module(m: int, k: int, n: int, dtype: str, precision: str = "") -> str:
    extra = f", operand_precision={{{precision},{precision}}}" if precision else ""
    return f"""HloModule gemm
ENTRY e {{
  a = {dtype}[{m},{k}]{{1,0}} parameter(0)
  b = {dtype}[{k},{n}]{{1,0}} parameter(1)
  ROOT d = {dtype}[{m},{n}]{{1,0}} dot(a, b), lhs_contracting_dims={{1}}, \
rhs_contracting_dims={{0}}{extra}
}}
"""


def _fusion_module(m: int, k: int, n: int) -> str:
    """XLA's GEMM fusion form: f32 parameters converted to bf16 inside the fusion body."""
    return f"""HloModule gemm_fusion
gemm_body {{
  p0 = f32[{m},{k}]{{1,0}} parameter(0)
  p1 = f32[{k},{n}]{{1,0}} parameter(1)
  c0 = bf16[{m},{k}]{{1,0}} convert(p0)
  c1 = bf16[{k},{n}]{{1,0}} convert(p1)
  ROOT d = bf16[{m},{n}]{{1,0}} dot(c0, c1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}
ENTRY e {{
  a = f32[{m},{k}]{{1,0}} parameter(0)
  b = f32[{k},{n}]{{1,0}} parameter(1)
  ROOT f = bf16[{m},{n}]{{1,0}} fusion(a, b), kind=kCustom, calls=gemm_body
}}
"""


def _gemm_price(text: str, target: str = "h100"):
    graph = build_op_graphs(parse_hlo(text))[0]
    gemm = next(n for n in graph.nodes if n.op_class is OpClass.COMPUTE)
    return CostModel(graph, get_spec(target)).singleton(gemm.id)


def _dims(rng: random.Random, low: int, high: int) -> tuple[int, int, int]:
    return tuple(rng.randrange(low, high, 64) for _ in range(3))  # type: ignore[return-value]


@pytest.fixture
def rng() -> random.Random:
    return random.Random()


def test_large_bf16_gemm_runs_at_the_achievable_tensor_core_rate(rng):
    m, k, n = _dims(rng, 4096, 8192)
    cost = _gemm_price(_dot_module(m, k, n, "bf16"))
    spec = get_spec("h100")
    flops = 2.0 * m * k * n
    rate = flops / (cost.total_s - spec.kernel_launch_overhead_s)
    # Compute-bound: within the memory overlap's 5% of the achievable bf16 rate, far above
    # what the CUDA cores could do.
    assert rate == pytest.approx(ACHIEVABLE_GEMM_FRACTION * peak_flops(spec, HALF), rel=0.05)
    assert rate > 5 * spec.fp32_flops
    assert cost.compute_s > cost.memory_s


def test_f32_default_precision_is_tf32_and_highest_is_cuda_cores(rng):
    m, k, n = _dims(rng, 4096, 8192)
    bf16 = _gemm_price(_dot_module(m, k, n, "bf16")).compute_s
    default = _gemm_price(_dot_module(m, k, n, "f32")).compute_s
    highest = _gemm_price(_dot_module(m, k, n, "f32", "highest")).compute_s
    spec = get_spec("h100")
    assert default == pytest.approx(bf16 * peak_flops(spec, HALF) / peak_flops(spec, TF32))
    assert highest == pytest.approx(bf16 * peak_flops(spec, HALF) / spec.fp32_flops)
    assert bf16 < default < highest


def test_the_dot_inside_a_gemm_fusion_sets_the_rate(rng):
    m, k, n = _dims(rng, 2048, 4096)
    fused = _gemm_price(_fusion_module(m, k, n))
    plain = _gemm_price(_dot_module(m, k, n, "bf16"))
    # Same flops at the same bf16 rate; f32 operands read from HBM take twice the bytes.
    assert fused.compute_s == pytest.approx(plain.compute_s)
    assert fused.memory_s > plain.memory_s


def test_a_thin_gemm_is_memory_bound(rng):
    m, k = _dims(rng, 8192, 16384)[:2]
    n = rng.choice((1, 2, 4, 8))
    cost = _gemm_price(_dot_module(m, k, n, "bf16"))
    spec = get_spec("h100")
    nbytes = 2 * (m * k + k * n + m * n)
    assert cost.memory_s > 10 * cost.compute_s
    assert cost.hbm_bytes == nbytes
    assert cost.total_s == pytest.approx(spec.kernel_launch_overhead_s + nbytes / spec.hbm_bandwidth
                                         + 0.05 * cost.compute_s)


def test_targets_without_the_unit_fall_back_to_cuda_cores():
    v100, a100, h100 = get_spec("v100"), get_spec("a100"), get_spec("h100")
    # V100: f16 tensor cores, none for bf16 or TF32.
    assert precision_class(v100, ("f16", "f16"), True) == HALF
    assert precision_class(v100, ("bf16", "bf16"), True) == FP32
    assert precision_class(v100, ("f32", "f32"), True) == FP32
    # FP8 only on Hopper; elsewhere an f8 GEMM runs at the half-precision rate.
    assert precision_class(a100, ("f8e4m3fn", "f8e4m3fn"), True) == HALF
    assert precision_class(h100, ("f8e4m3fn", "f8e4m3fn"), True) == "fp8"
    # A mixed GEMM runs at its widest operand's rate.
    assert precision_class(h100, ("bf16", "f32"), False) == FP32
    assert precision_class(h100, ("bf16", "f32"), True) == TF32
    m, k, n = 4096, 4096, 4096
    assert _gemm_price(_dot_module(m, k, n, "bf16"), "v100").compute_s == pytest.approx(
        2.0 * m * k * n / (ACHIEVABLE_GEMM_FRACTION * v100.fp32_flops))


def _algorithm_module(m: int, k: int, n: int, algorithm: str) -> str:
    return _dot_module(m, k, n, "f32").replace(
        "rhs_contracting_dims={0}", f"rhs_contracting_dims={{0}}, algorithm={algorithm}")


def test_a_named_algorithm_sets_unit_and_passes(rng):
    m, k, n = _dims(rng, 4096, 8192)
    bf16 = _gemm_price(_dot_module(m, k, n, "bf16")).compute_s
    # jax's "bfloat16" / "high" precisions on f32 operands: one or three bf16 passes.
    one = _gemm_price(_algorithm_module(m, k, n, "dot_bf16_bf16_f32")).compute_s
    three = _gemm_price(_algorithm_module(m, k, n, "dot_bf16_bf16_f32_x3")).compute_s
    exact = _gemm_price(_algorithm_module(m, k, n, "dot_f32_f32_f32")).compute_s
    assert one == pytest.approx(bf16)
    assert three == pytest.approx(3 * bf16)
    assert exact == pytest.approx(_gemm_price(_dot_module(m, k, n, "f32", "highest")).compute_s)
    # On V100 a bf16 algorithm has no tensor cores to run on.
    assert _gemm_price(_algorithm_module(m, k, n, "dot_bf16_bf16_f32"), "v100").compute_s == \
        pytest.approx(2.0 * m * k * n / (ACHIEVABLE_GEMM_FRACTION * get_spec("v100").fp32_flops))


@pytest.mark.parametrize("target", ["a100", "h100"])
@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_the_tile_model_never_beats_the_roofline(rng, target, dtype):
    """Chain kernels and the GEMMs they replace are priced by the GEMM-tile model; the rule
    XLA's other GEMMs are priced by bounds it: no tiling is faster than the roofline."""
    from stitch.cost.gemm_rates import gemm_time
    from stitch.cost.gemm_tile import GemmTile, gemm_cost
    spec = get_spec(target)
    m, k, n = _dims(rng, 2048, 8192)
    batch = rng.choice((1, 4, 12))
    tile = gemm_cost(spec, batch, m, n, k, GemmTile(128, 128, 32, 8, 3), dtype, True, 4)
    unit = precision_class(spec, (dtype,), True)
    roof = gemm_time(spec, 2.0 * batch * m * n * k, tile.hbm_bytes, unit)
    assert tile.seconds >= roof.total_s * (1 - 1e-9)
