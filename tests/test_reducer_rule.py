"""One rule for reductions: the planner never offers a kernel holding a reduction codegen
does not generate (argmax's variadic (value, index) reduce, a combiner of several ops); the
rule lives in the HLO layer (stitch.hlo.combiners), where codegen and the evaluator read it."""
from __future__ import annotations

import numpy as np
import pytest

from stitch.hlo import combiners, parse_hlo
from stitch.hlo.evaluator.interpreter import Evaluator
from stitch.analysis.buildable import build_problem


def _accuracy_and_loss(logits, labels):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    p = jax.nn.log_softmax(jnp.tanh(logits) * 3.0, axis=-1)
    hit = (jnp.argmax(p, axis=-1) == labels).astype(jnp.float32)
    return hit.mean(), -jnp.take_along_axis(p, labels[..., None], -1).mean()


def test_the_pass_plans_no_reduction_codegen_refuses():
    jax = pytest.importorskip("jax")
    from stitch.xla_pass import entry as xla_pass
    rng = np.random.default_rng()
    rows, classes = int(rng.integers(8, 64)), int(rng.integers(16, 200))
    logits = rng.standard_normal((rows, classes)).astype(np.float32)
    labels = rng.integers(0, classes, rows).astype(np.int32)
    xla_pass.ensure_registered("cpu")
    request = xla_pass.PassRequest("argmax_rule", "h100", "cpu")
    lowered = request.prepare(jax.jit(_accuracy_and_loss).lower(logits, labels))
    with request:
        compiled = lowered.compile()
    report = request.result()
    graphs = [g.graph for g in report.plan.graphs]
    assert any(n.opcode == "reduce" and len(n.operands) == 4 for g in graphs for n in g.nodes)
    refused = [k for k in report.delivery.dropped if k.kind == "build"]
    assert not refused, refused
    for g in report.plan.graphs:
        for k in g.stitched.kernels:
            if k.schedule is not None:
                assert all(build_problem(g.graph, v) is None for v in k.members), k.name
    got = compiled(logits, labels)
    want = jax.jit(_accuracy_and_loss)(logits, labels)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_combiner_kinds_are_the_evaluators():
    text = """HloModule m
add_f32 {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}
argmax {
  a = f32[] parameter(0)
  i = s32[] parameter(1)
  b = f32[] parameter(2)
  j = s32[] parameter(3)
  gt = pred[] compare(a, b), direction=GT
  v = f32[] select(gt, a, b)
  k = s32[] select(gt, i, j)
  ROOT t = (f32[], s32[]) tuple(v, k)
}
ENTRY e {
  x = f32[4] parameter(0)
  z = f32[] constant(0)
  ROOT r = f32[] reduce(x, z), dimensions={0}, to_apply=add_f32
}"""
    module = parse_hlo(text)
    ev = Evaluator(module)
    comps = {c.name: c for c in module.computations}
    assert combiners.combiner_kind(comps["add_f32"]) == ev.binary_kind("add_f32") == "add"
    assert combiners.combiner_kind(comps["argmax"]) is None
    assert combiners.reduction_problem(2, "add") is None
    assert combiners.reduction_problem(4, None) is not None
    assert combiners.reduction_problem(2, "xor") is not None


_SCATTER = """HloModule m
add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}
assign {
  a = f32[] parameter(0)
  ROOT b = f32[] parameter(1)
}
ENTRY main {
  table = f32[20,8] parameter(0)
  ids = s32[30] parameter(1)
  g = f32[30,8] parameter(2)
  two = f32[] constant(2)
  tb = f32[30,8] broadcast(two), dimensions={}
  gg = f32[30,8] multiply(g, tb)
  ROOT sc = f32[20,8] scatter(table, ids, gg), update_window_dims={1},
    inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1,
    to_apply=COMBINER
}"""


@pytest.mark.parametrize("combiner, refused", [("add", False), ("assign", True)])
def test_feasibility_asks_codegens_scatter_rule(combiner, refused):
    from stitch.hlo.graph import build_op_graphs
    from stitch.analysis.feasibility import infeasible_reason
    graph = build_op_graphs(parse_hlo(_SCATTER.replace("COMBINER", combiner)))[0]
    members = [n.id for n in graph.nodes if n.opcode not in ("parameter", "constant")]
    reason = infeasible_reason(graph, members)
    if refused:
        # Colliding assignments: XLA keeps an unspecified one; codegen generates only add.
        assert reason is not None and "combiner assign" in reason
    else:
        assert reason is None
    sc = next(n.id for n in graph.nodes if n.name == "sc")
    assert (build_problem(graph, sc) is not None) == refused


_XLA_FUSION = """HloModule m
max_f32 {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT m = f32[] maximum(a, b)
}
fused {
  p0 = f32[ROWS,COLS] parameter(0)
  c = f32[] constant(-inf)
  r = f32[ROWS] reduce(p0, c), dimensions={1}, to_apply=max_f32
  b = f32[ROWS,COLS] broadcast(r), dimensions={0}
  s = f32[ROWS,COLS] subtract(p0, b)
  i = u64[ROWS,COLS] iota(), iota_dimension=1
  t = u32[ROWS,COLS] convert(i)
  f = f32[ROWS,COLS] convert(t)
  ROOT o = f32[ROWS,COLS] add(s, f)
}
ENTRY e {
  x = f32[ROWS,COLS] parameter(0)
  ROOT fu = f32[ROWS,COLS] fusion(x), kind=kLoop, calls=fused
}"""


def test_xlas_kernels_are_priced_whatever_codegen_can_build(monkeypatch):
    """One of XLA's own kernels holding what stitch's codegen refuses (a u64 counter next
    to a shared row max) is priced by the stitching analysis of its structure, as with no
    codegen limits: the XLA side of every comparison does not depend on them."""
    from stitch.hlo.graph import build_op_graphs
    from stitch.pricing import delta
    from stitch.cost.gpu_specs import get_spec
    from stitch.analysis import feasibility
    rng = np.random.default_rng()
    rows, cols = int(rng.integers(16, 512)), int(rng.integers(64, 2048))
    text = _XLA_FUSION.replace("ROWS", str(rows)).replace("COLS", str(cols))
    graph = build_op_graphs(parse_hlo(text))[0]
    spec = get_spec("h100")
    (group,) = [frozenset(g) for g in graph.baseline_groups().values() if len(g) > 1]
    assert any(build_problem(graph, v) for v in group)
    priced = delta.CostModel(graph, spec).kernel(group)
    monkeypatch.setattr(feasibility, "build_problem", lambda graph, v: None)
    monkeypatch.setattr(delta, "build_problem", lambda graph, v: None, raising=False)
    unlimited = delta.CostModel(graph, spec).kernel(group)
    assert priced.total_s == pytest.approx(unlimited.total_s)
    assert priced.hbm_bytes == unlimited.hbm_bytes
