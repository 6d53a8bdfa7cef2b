"""The op-graph runner (stitch.hlo.graph_exec) against the reference evaluator: whole zoo
modules node by node, units replacing node sets, loops, conditionals and tuple plumbing."""
from __future__ import annotations

import numpy as np
import pytest

from stitch.hlo import HloEvaluationError, evaluate, parse_hlo
from stitch.hlo.evaluator.dtypes import numpy_dtype
from stitch.hlo.graph import build_op_graphs
from stitch.hlo.graph_exec import GraphRunner, Unit, run_graphs
from tests.fixtures import DATA

FIXTURES = sorted(str(p.relative_to(DATA)) for p in DATA.glob("*/tiny.*.hlo")
                  if p.name in ("tiny.pre.hlo", "tiny.gpu-h100.hlo", "tiny.gpu-v100.hlo"))


def random_args(module, rng) -> list[np.ndarray]:
    out = []
    for p in module.entry.parameters:
        dtype = numpy_dtype(p.shape.element_type)
        if dtype.kind == "f":
            out.append(rng.standard_normal(p.shape.dims).astype(dtype))
        elif dtype == np.bool_:
            out.append(rng.random(p.shape.dims) < 0.5)
        else:  # small non-negative integers: valid indices for gathers and dynamic slices
            out.append(rng.integers(0, 3, p.shape.dims).astype(dtype))
    return out


def assert_same(got, want) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, f"output {i}"
        assert np.array_equal(g, w, equal_nan=True), f"output {i} differs"


@pytest.mark.parametrize("fixture", FIXTURES)
def test_running_the_graphs_equals_evaluating_the_module(fixture):
    module = parse_hlo((DATA / fixture).read_text())
    args = random_args(module, np.random.default_rng(len(fixture)))
    assert_same(run_graphs(module, build_op_graphs(module), args), evaluate(module, args))


_ROW_SUM = """
HloModule m
add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}
ENTRY e {
  x = f32[4,8] parameter(0)
  y = f32[8] parameter(1)
  e1 = f32[4,8] exponential(x)
  zero = f32[] constant(0)
  r = f32[4] reduce(e1, zero), dimensions={1}, to_apply=add
  b = f32[4,8] broadcast(y), dimensions={1}
  m = f32[4,8] multiply(x, b)
  ROOT t = (f32[4], f32[4,8]) tuple(r, m)
}
"""


def test_a_unit_replaces_its_members_and_runs_once():
    module = parse_hlo(_ROW_SUM)
    graphs = build_op_graphs(module)
    g = graphs[0]
    e1, r = g.node("e1").id, g.node("r").id
    calls = []

    def row_sum(values):
        calls.append(1)
        return [np.exp(values[0]).sum(axis=1).astype(np.float32) + 100]   # marked: +100
    unit = Unit(frozenset({e1, r, g.node("zero").id}), (g.node("x").id,), (r,), row_sum, "k")
    rng = np.random.default_rng(0)
    args = [rng.standard_normal((4, 8)).astype(np.float32),
            rng.standard_normal(8).astype(np.float32)]
    got = run_graphs(module, graphs, args, units={0: [unit]})
    want = evaluate(module, args)
    assert calls == [1]
    np.testing.assert_allclose(got[0], want[0] + 100, rtol=1e-6)
    np.testing.assert_array_equal(got[1], want[1])


def test_parameters_bind_by_number_not_by_first_use():
    module = parse_hlo("""
HloModule m
ENTRY e {
  b = f32[3] parameter(1)
  a = f32[3] parameter(0)
  ROOT d = f32[3] subtract(b, a)
}""")
    args = [np.float32([1, 2, 3]), np.float32([10, 20, 30])]
    np.testing.assert_array_equal(run_graphs(module, build_op_graphs(module), args)[0],
                                  np.float32([9, 18, 27]))


def test_units_forming_a_cycle_are_reported():
    module = parse_hlo(_ROW_SUM)
    graphs = build_op_graphs(module)
    g = graphs[0]
    # Unit a claims to need r, which unit b computes from a's e1.
    a = Unit(frozenset({g.node("e1").id}), (g.node("r").id,), (g.node("e1").id,),
             lambda v: v, "a")
    b = Unit(frozenset({g.node("r").id}), (g.node("e1").id,), (g.node("r").id,),
             lambda v: v, "b")
    with pytest.raises(HloEvaluationError, match="cycle"):
        GraphRunner(module, graphs, units={0: [a, b]}).run([np.ones((4, 8), np.float32),
                                                            np.ones(8, np.float32)])


_LOOP_AND_BRANCH = """
HloModule m
cond {
  p = (s32[], f32[4]) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  n = s32[] constant(5)
  ROOT lt = pred[] compare(i, n), direction=LT
}
body {
  p = (s32[], f32[4]) parameter(0)
  i = s32[] get-tuple-element(p), index=0
  x = f32[4] get-tuple-element(p), index=1
  one = s32[] constant(1)
  j = s32[] add(i, one)
  y = f32[4] sine(x)
  ROOT t = (s32[], f32[4]) tuple(j, y)
}
neg {
  p = (f32[4], f32[4]) parameter(0)
  a = f32[4] get-tuple-element(p), index=0
  ROOT n = f32[4] negate(a)
}
mul {
  p = f32[4] parameter(0)
  ROOT m = f32[4] multiply(p, p)
}
ENTRY e {
  x = f32[4] parameter(0)
  k = s32[] parameter(1)
  zero = s32[] constant(0)
  init = (s32[], f32[4]) tuple(zero, x)
  w = (s32[], f32[4]) while(init), condition=cond, body=body
  wx = f32[4] get-tuple-element(w), index=1
  pair = (f32[4], f32[4]) tuple(wx, x)
  c = f32[4] conditional(k, pair, wx), branch_computations={neg, mul}
  ROOT out = (f32[4], (s32[], f32[4])) tuple(c, w)
}
"""


@pytest.mark.parametrize("selector", [0, 1, 7, -2])
def test_loops_and_conditionals_run_their_graphs(selector):
    module = parse_hlo(_LOOP_AND_BRANCH)
    args = [np.random.default_rng(selector + 3).standard_normal(4).astype(np.float32),
            np.int32(selector)]
    got = run_graphs(module, build_op_graphs(module), args)
    assert_same(got, evaluate(module, args))
    assert len(got) == 3 and int(got[1]) == 5
