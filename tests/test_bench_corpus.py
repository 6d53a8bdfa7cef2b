"""The corpus harness's verdict on a compiled module that differs from the evaluator: f32
rounding (excepted) only where rounding explains the difference, otherwise wrong."""
from __future__ import annotations

import numpy as np

from bench.corpus import _within_f32_rounding
from stitch.hlo import evaluate, parse_hlo

ROW_SUM = """HloModule m
add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}
ENTRY e {
  p = f32[16,20000] parameter(0)
  z = f32[] constant(0)
  ROOT r = f32[16] reduce(p, z), dimensions={1}, to_apply=add
}"""

LOG_LOG_SUM = """HloModule m
add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}
ENTRY e {
  p = f32[64,226] parameter(0)
  z = f32[] constant(0)
  s = f32[64] reduce(p, z), dimensions={1}, to_apply=add
  l = f32[64] log(s)
  ROOT r = f32[64] log(l)
}"""


def _case(text, args):
    module = parse_hlo(text)
    return module, evaluate(module, args)


def test_a_long_sum_in_another_order_is_rounding_and_a_real_error_is_not():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 20000)).astype(np.float32)
    module, want = _case(ROW_SUM, [x])
    sequential = np.zeros(16, np.float32)          # lane-sequential f32, as a kernel sums
    for chunk in np.split(x, 625, axis=1):
        sequential += chunk.sum(axis=1, dtype=np.float32)
    assert _within_f32_rounding(module, ROW_SUM, [x], [sequential], want)
    off = np.asarray(want[0]).copy()
    off[5] += 0.05 * max(1.0, abs(off[5]))           # one wrong row
    assert not _within_f32_rounding(module, ROW_SUM, [x], [off], want)


def test_only_elements_f32_cannot_determine_are_left_out():
    rng = np.random.default_rng(4)
    x = (rng.random((64, 226)) * 0.05 + 0.01).astype(np.float32)
    x[7] = 0.0                   # f32 sums row 7 to exactly 1 (log(log) = -inf), f64 does not
    x[7, 0], x[7, 1] = 1.0, 3e-8
    module, want = _case(LOG_LOG_SUM, [x])
    assert np.isneginf(np.asarray(want[0])[7])
    near = np.asarray(want[0]).copy()
    near[7] = -20.0
    assert _within_f32_rounding(module, LOG_LOG_SUM, [x], [near], want)
    near[40] += 0.01                                 # a well-conditioned element wrong
    assert not _within_f32_rounding(module, LOG_LOG_SUM, [x], [near], want)
