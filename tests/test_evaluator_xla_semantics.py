"""The reference evaluator against XLA itself (the CPU backend of the installed jaxlib), where
they used to differ: single-participant collective-permute, complex division by infinities,
reduce-window with padding / base dilation and a non-identity init."""
from __future__ import annotations

import numpy as np
import pytest

from stitch.hlo import evaluate


def run_xla(text: str, args: list[np.ndarray]) -> list[np.ndarray]:
    """Compile HLO text with XLA's CPU backend and run it."""
    import jax
    import jax._src.xla_bridge as xb
    from jax._src.lib import xla_client as xc
    from jaxlib import _hlo
    module = _hlo.hlo_module_from_text(text)
    computation = xc.XlaComputation(module.as_serialized_hlo_module_proto())
    mlir = xc._xla.mlir.xla_computation_to_mlir_module(computation)
    backend = xb.get_backend("cpu")
    device = backend.devices()[0]
    exe = backend.compile_and_load(mlir, xc.DeviceList((device,)), xc.CompileOptions())
    with jax.enable_x64(True):  # f64/c128 arguments stay 64-bit
        return [np.asarray(o) for o in exe.execute([jax.device_put(a, device) for a in args])]


@pytest.mark.parametrize("pairs", ["{}", "{{0,0}}", "{{0,1}}", "{{0,0},{1,2}}"])
def test_single_participant_collective_permute(pairs):
    text = ("HloModule m\nENTRY e {\n  p = f32[5] parameter(0)\n  ROOT r = f32[5] "
            f"collective-permute(p), channel_id=1, source_target_pairs={pairs}\n}}\n")
    x = np.random.default_rng(3).standard_normal(5).astype(np.float32) + 2
    (want,) = run_xla(text, [x])
    (got,) = evaluate(text, [x])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype, ctype", [("c64", np.complex64), ("c128", np.complex128)])
def test_complex_division_by_infinities_and_zeros(dtype, ctype):
    inf, nan = np.inf, np.nan
    rng = np.random.default_rng(4)
    nums = [complex(*rng.standard_normal(2)) for _ in range(3)] + [
        0, complex(inf, 1), complex(1, -inf), complex(nan, 0), complex(-inf, inf)]
    dens = [complex(*rng.standard_normal(2))] + [
        complex(inf, 0), complex(inf, inf), complex(-inf, 2), complex(1, inf), 0,
        complex(0, -0.0), complex(0, inf), complex(nan, 1)]
    a = np.array([n for n in nums for d in dens], ctype)
    b = np.array([d for n in nums for d in dens], ctype)
    text = (f"HloModule m\nENTRY e {{\n  a = {dtype}[{a.size}] parameter(0)\n"
            f"  b = {dtype}[{a.size}] parameter(1)\n  ROOT r = {dtype}[{a.size}] divide(a, b)\n}}\n")
    (want,) = run_xla(text, [a, b])
    (got,) = evaluate(text, [a, b])
    special = ~(np.isfinite(a) & np.isfinite(b) & (b != 0))
    np.testing.assert_array_equal(got[special], want[special])
    np.testing.assert_allclose(got[~special], want[~special], rtol=1e-6)
    signed = ~np.isnan(want)  # zeros and infinities carry XLA's signs; NaN's sign is noise
    np.testing.assert_array_equal(np.signbit(got.real[signed]), np.signbit(want.real[signed]))
    np.testing.assert_array_equal(np.signbit(got.imag[signed]), np.signbit(want.imag[signed]))


_REDUCERS = {
    "add": "ROOT r = f32[] add(x, y)",
    # a maximum the evaluator cannot recognise as a single op: the general path
    "select_max": "c = pred[] compare(x, y), direction=GT\n  ROOT r = f32[] select(c, x, y)",
}


@pytest.mark.parametrize("reducer", sorted(_REDUCERS))
@pytest.mark.parametrize("window", [
    "size=3 stride=2 pad=2_2", "size=2x3 stride=1x2 pad=1_0x2_1",
    "size=1 stride=1 lhs_dilate=2", "size=3x2 stride=2x1 pad=1_1x0_1 lhs_dilate=2x1",
])
def test_reduce_window_padding_is_not_the_init_per_element(reducer, window):
    rank = window.split()[0].count("x") + 1
    dims = (5, 4)[:rank]
    init = 10.0 if reducer == "add" else 0.5  # not the reducer's identity
    text = f"""HloModule m
red {{
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  {_REDUCERS[reducer]}
}}
ENTRY e {{
  p = f32[{",".join(map(str, dims))}] parameter(0)
  i = f32[] constant({init})
  ROOT w = reduce-window(p, i), window={{{window}}}, to_apply=red
}}
"""
    x = np.random.default_rng(5).standard_normal(dims).astype(np.float32)
    (want,) = run_xla(text, [x])
    (got,) = evaluate(text, [x])
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_copy_start_with_the_array_shape_alone():
    """XLA's parser takes `f32[2,3] copy-start(p0)` (corpus 06350); it is a copy."""
    from stitch.hlo import evaluate, parse_hlo
    module = parse_hlo("""HloModule m
ENTRY e {
  p0 = f32[2,3] parameter(0)
  copy-start = f32[2,3] copy-start(p0)
  ROOT copy-done = f32[2,3] copy-done(copy-start)
}""")
    x = np.random.default_rng(5).standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_array_equal(evaluate(module, [x])[0], x)


def test_a_result_larger_than_memory_is_an_evaluation_error():
    """A broadcast is a numpy view until the result is copied out (corpus 01210: 70 GiB)."""
    from stitch.hlo import evaluate, parse_hlo
    from stitch.hlo.errors import HloEvaluationError
    module = parse_hlo("""HloModule m
ENTRY e {
  c = bf16[] constant(0)
  ROOT b = bf16[80,7,8192,8192] broadcast(c), dimensions={}
}""")
    with pytest.raises(HloEvaluationError, match="does not fit"):
        evaluate(module, [])
