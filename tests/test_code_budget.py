"""The code budget (stitch/xla_pass/code_budget.py): a kernel whose Kernel IR is over the budget
is built at a narrower vector width when the latency-evaluator prices that within tolerance,
and the narrower kernel still computes the reference evaluator's values."""
from __future__ import annotations

import types

import numpy as np
import pytest

from stitch.codegen.lower import lower_kernel, reference_values, run_on_host
from stitch.codegen.values import leaf
from stitch.hlo import parse_hlo
from stitch.hlo.evaluator.dtypes import numpy_dtype
from stitch.hlo.evaluator.interpreter import Evaluator
from stitch.hlo.graph import build_op_graphs
from stitch.xla_pass import code_budget
from stitch.cost.gpu_specs import get_spec
from stitch.schedule import schedule_kernel
from tests.fixtures import REDUCERS

# Layer norm with an elementwise tail: the tuner gives its row part a vector width above 1.
LAYER_NORM = "HloModule m\n" + REDUCERS + """ENTRY main {
  x = f32[64,512] parameter(0)
  g = f32[512] parameter(1)
  zero = f32[] constant(0)
  n = f32[] constant(0.001953125)
  eps = f32[] constant(1e-5)
  s = f32[64] reduce(x, zero), dimensions={1}, to_apply=add
  nb = f32[64] broadcast(n), dimensions={}
  mean = f32[64] multiply(s, nb)
  mb = f32[64,512] broadcast(mean), dimensions={0}
  c = f32[64,512] subtract(x, mb)
  c2 = f32[64,512] multiply(c, c)
  v = f32[64] reduce(c2, zero), dimensions={1}, to_apply=add
  var = f32[64] multiply(v, nb)
  eb = f32[64] broadcast(eps), dimensions={}
  ve = f32[64] add(var, eb)
  r = f32[64] rsqrt(ve)
  rb = f32[64,512] broadcast(r), dimensions={0}
  y = f32[64,512] multiply(c, rb)
  gb = f32[64,512] broadcast(g), dimensions={1}
  yg = f32[64,512] multiply(y, gb)
  ROOT o = f32[64,512] tanh(yg)
}
"""


@pytest.fixture(scope="module")
def kernel():
    module = parse_hlo(LAYER_NORM)
    graph = build_op_graphs(module)[0]
    members = [n.id for n in graph.nodes if n.opcode not in ("parameter", "constant")]
    spec = get_spec("h100")
    schedule = schedule_kernel(graph, members, spec)
    # The premise of every test here: the tuner picked a width the budget can narrow.
    assert code_budget.widest(schedule) > 1, [p.vector_width for p in schedule.parts]
    evaluator = Evaluator(module)

    def lower(s, calls=None):
        if calls is not None:
            calls.append(code_budget.widest(s))
        return lower_kernel(graph, evaluator, s, "ln", in_place=True)
    return types.SimpleNamespace(module=module, graph=graph, members=members, spec=spec,
                                 schedule=schedule, lower=lower)


def test_tuner_keeps_to_the_vector_widths_asked(kernel):
    for widths in ((1,), (1, 2)):
        narrow = schedule_kernel(kernel.graph, kernel.members, kernel.spec,
                                 vector_widths=widths)
        assert all(p.vector_width in widths for p in narrow.parts)
        # The wider search space can only model as fast or faster.
        assert kernel.schedule.modeled_us <= narrow.modeled_us * (1 + 1e-9)


def test_over_budget_kernel_is_built_narrower_and_computes_the_same(kernel, monkeypatch):
    wide = kernel.lower(kernel.schedule)
    wide_size = code_budget.statements(wide.kernel)
    monkeypatch.setattr(code_budget, "CODE_BUDGET", wide_size // 2)
    monkeypatch.setattr(code_budget, "CODE_TOLERANCE", 1.0)
    lowered, narrowed = code_budget.lower_within_budget(
        kernel.graph, kernel.schedule, kernel.spec, "ln", kernel.lower)
    assert narrowed is not None
    assert narrowed.width == code_budget.widest(kernel.schedule)
    assert narrowed.narrow_width < narrowed.width
    assert narrowed.statements == code_budget.statements(lowered.kernel) < wide_size
    assert narrowed.narrow_modeled_us <= narrowed.modeled_us * 2.0

    rng = np.random.default_rng(7)
    inputs = {}
    for v in lowered.inputs:
        shape = leaf(kernel.graph.nodes[v].shape)
        inputs[v] = rng.standard_normal(shape.dims).astype(numpy_dtype(shape.element_type))
    want = reference_values(kernel.graph, Evaluator(kernel.module), sorted(kernel.members),
                            inputs)
    got = run_on_host(lowered, kernel.graph, inputs)        # outputs start as NaN
    assert got
    for v, value in got.items():
        ref = np.asarray(want[v], np.float64)
        assert np.isfinite(value).all(), f"{kernel.graph.nodes[v].name}: elements unwritten"
        error = np.linalg.norm(value - ref) / max(np.linalg.norm(ref), 1e-30)
        assert error <= 1e-5, f"{kernel.graph.nodes[v].name}: relative error {error:.2e}"


def test_kernel_within_budget_is_built_as_tuned(kernel, monkeypatch):
    monkeypatch.setattr(code_budget, "CODE_BUDGET", 10**9)
    calls: list[int] = []
    lowered, narrowed = code_budget.lower_within_budget(
        kernel.graph, kernel.schedule, kernel.spec, "ln", lambda s: kernel.lower(s, calls))
    assert narrowed is None
    assert calls == [code_budget.widest(kernel.schedule)]
    assert code_budget.statements(lowered.kernel) == \
        code_budget.statements(kernel.lower(kernel.schedule).kernel)


def test_narrower_schedule_outside_the_tolerance_is_not_taken(kernel, monkeypatch):
    monkeypatch.setattr(code_budget, "CODE_BUDGET", 1)
    monkeypatch.setattr(code_budget, "CODE_TOLERANCE", -0.5)    # nothing can be within
    calls: list[int] = []
    _, narrowed = code_budget.lower_within_budget(
        kernel.graph, kernel.schedule, kernel.spec, "ln", lambda s: kernel.lower(s, calls))
    assert narrowed is None
    assert calls == [code_budget.widest(kernel.schedule)]


def test_estimate_over_budget_lowers_once_and_a_missed_estimate_twice(kernel, monkeypatch):
    monkeypatch.setattr(code_budget, "CODE_TOLERANCE", 1.0)
    estimate = code_budget.estimated_statements(kernel.schedule)
    # Over the budget by the estimate: only the narrow schedule is lowered.
    monkeypatch.setattr(code_budget, "CODE_BUDGET", estimate - 1)
    calls: list[int] = []
    _, narrowed = code_budget.lower_within_budget(
        kernel.graph, kernel.schedule, kernel.spec, "ln", lambda s: kernel.lower(s, calls))
    assert narrowed is not None and len(calls) == 1 and calls[0] < narrowed.width
    # An estimate within the budget whose Kernel IR is over it: lowered wide, then narrow.
    actual = code_budget.statements(kernel.lower(kernel.schedule).kernel)
    monkeypatch.setattr(code_budget, "estimated_statements", lambda schedule: 0)
    monkeypatch.setattr(code_budget, "CODE_BUDGET", actual - 1)
    calls = []
    _, narrowed = code_budget.lower_within_budget(
        kernel.graph, kernel.schedule, kernel.spec, "ln", lambda s: kernel.lower(s, calls))
    assert narrowed is not None
    assert calls == [narrowed.width, narrowed.narrow_width]


def test_global_scope_schedules_are_left_alone(kernel, monkeypatch):
    monkeypatch.setattr(code_budget, "CODE_BUDGET", 1)
    part = types.SimpleNamespace(kind="global", vector_width=4, members=tuple(range(500)))
    persistent = types.SimpleNamespace(parts=[part], members=tuple(kernel.members),
                                       modeled_us=1.0)
    seen: list = []
    got, narrowed = code_budget.lower_within_budget(
        kernel.graph, persistent, kernel.spec, "ln", lambda s: seen.append(s) or "built")
    assert (got, narrowed) == ("built", None)
    assert seen == [persistent]


def test_explicit_budget_overrides_the_default(kernel, monkeypatch):
    monkeypatch.setattr(code_budget, "CODE_BUDGET", 10**9)
    monkeypatch.setattr(code_budget, "CODE_TOLERANCE", 1.0)
    _, narrowed = code_budget.lower_within_budget(
        kernel.graph, kernel.schedule, kernel.spec, "ln", kernel.lower, budget=1)
    assert narrowed is not None and narrowed.narrow_width < narrowed.width
