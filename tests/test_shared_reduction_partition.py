"""Memory-intensive bytes toward the one-kernel bound.

XLA GPU splits a long row reduction in two (``[rows, 32000] -> [rows, 128, 250]``, reduce
over 250, then over 128). A shared reduction downstream of another one (log-softmax's
sum(exp(x - max)) after the max) inherits the first one's row partition; the feasibility
rule used to count all of its own kept dims as rows (rows x 128), saw two partitions and
kept the max apart: one extra full read of the logits (log_softmax_xent_train: 1573 MB
against a bound of 1049). These tests check the partition rule, the lowered kernel on the
host target against the reference evaluator (fresh random inputs, NaN-poisoned outputs) and
the zoo plan's bytes."""
from __future__ import annotations

import numpy as np
import pytest

import stitch
from stitch.codegen.lower import lower_kernel, reference_values, run_on_host
from stitch.codegen.values import leaf
from stitch.hlo import parse_hlo
from stitch.hlo.evaluator.dtypes import numpy_dtype
from stitch.hlo.evaluator.interpreter import Evaluator
from stitch.hlo.graph import build_op_graphs
from stitch.cost.gpu_specs import get_spec
from stitch.analysis.feasibility import analyze_pattern, infeasible_reason
from stitch.schedule import schedule_kernel
from tests.fixtures import DATA

ROWS, SPLIT, INNER = 24, 8, 40          # rows of SPLIT * INNER elements, reduced in two steps


def _two_level_log_softmax(dtype: str = "f32") -> str:
    """XLA's form of log-softmax over long rows (both reductions split in two), with the
    softmax gradient's shape of use: outputs log_softmax and exp(x - max) * g."""
    r, s, i = ROWS, SPLIT, INNER
    n = s * i
    return f"""HloModule m
add {{ a = f32[] parameter(0)  b = f32[] parameter(1)  ROOT s = f32[] add(a, b) }}
max {{ a = f32[] parameter(0)  b = f32[] parameter(1)  ROOT s = f32[] maximum(a, b) }}
ENTRY e {{
  xin = {dtype}[{r},{n}] parameter(0)
  gin = {dtype}[{r}] parameter(1)
  x = f32[{r},{n}] convert(xin)
  g = f32[{r}] convert(gin)
  ninf = f32[] constant(-inf)
  z = f32[] constant(0)
  x3 = f32[{r},{s},{i}] bitcast(x)
  m1 = f32[{r},{s}] reduce(x3, ninf), dimensions={{2}}, to_apply=max
  mx = f32[{r}] reduce(m1, ninf), dimensions={{1}}, to_apply=max
  mxb = f32[{r},{n}] broadcast(mx), dimensions={{0}}
  sh = f32[{r},{n}] subtract(x, mxb)
  ex = f32[{r},{n}] exponential(sh)
  ex3 = f32[{r},{s},{i}] bitcast(ex)
  s1 = f32[{r},{s}] reduce(ex3, z), dimensions={{2}}, to_apply=add
  se = f32[{r}] reduce(s1, z), dimensions={{1}}, to_apply=add
  lse = f32[{r}] log(se)
  lseb = f32[{r},{n}] broadcast(lse), dimensions={{0}}
  ls = f32[{r},{n}] subtract(sh, lseb)
  gd = f32[{r}] divide(g, se)
  gb = f32[{r},{n}] broadcast(gd), dimensions={{0}}
  gr = f32[{r},{n}] multiply(ex, gb)
  lso = {dtype}[{r},{n}] convert(ls)
  gro = {dtype}[{r},{n}] convert(gr)
  ROOT t = ({dtype}[{r},{n}], {dtype}[{r},{n}]) tuple(lso, gro)
}}
"""


def _graph(dtype: str = "f32"):
    module = parse_hlo(_two_level_log_softmax(dtype))
    graph = build_op_graphs(module)[0]
    members = [n.id for n in graph.nodes
               if n.op_class.name != "SOURCE" and n.opcode not in ("tuple", "constant")]
    return module, graph, members


def _by_name(graph, name: str) -> int:
    return next(n.id for n in graph.nodes if n.name == name)


def test_reduction_after_a_shared_reduction_inherits_its_row_partition():
    _, graph, members = _graph()
    # Failed before: "s1 and m1 need different block partitions (192 vs 24 rows)".
    assert infeasible_reason(graph, members) is None
    analysis = analyze_pattern(graph, members)
    assert analysis.scope == "block"
    rows = {graph.nodes[r.node].name: (r.rows, r.row_length) for r in analysis.shared}
    n = SPLIT * INNER
    assert rows == {"m1": (ROWS, n), "mx": (ROWS, SPLIT), "s1": (ROWS, n), "se": (ROWS, SPLIT)}


def test_fresh_reduction_joining_a_row_partition_gets_whole_rows():
    """A reduction reading no shared value (s1 over y: rows x s units of its own) joined with
    the max's partition (whole rows): the join drops s1's split dim, so one unit owns a whole
    row of both — one partition of ROWS rows, not two."""
    r, s, i = ROWS, SPLIT, INNER
    text = f"""HloModule m
add {{ a = f32[] parameter(0)  b = f32[] parameter(1)  ROOT s = f32[] add(a, b) }}
max {{ a = f32[] parameter(0)  b = f32[] parameter(1)  ROOT s = f32[] maximum(a, b) }}
ENTRY e {{
  x = f32[{r},{s * i}] parameter(0)
  y = f32[{r},{s},{i}] parameter(1)
  ninf = f32[] constant(-inf)
  z = f32[] constant(0)
  mx = f32[{r}] reduce(x, ninf), dimensions={{1}}, to_apply=max
  mxb = f32[{r},{s * i}] broadcast(mx), dimensions={{0}}
  sh = f32[{r},{s * i}] subtract(x, mxb)
  sh3 = f32[{r},{s},{i}] bitcast(sh)
  s1 = f32[{r},{s}] reduce(y, z), dimensions={{2}}, to_apply=add
  s1b = f32[{r},{s},{i}] broadcast(s1), dimensions={{0,1}}
  ROOT o = f32[{r},{s},{i}] multiply(sh3, s1b)
}}
"""
    graph = build_op_graphs(parse_hlo(text))[0]
    members = [n.id for n in graph.nodes if n.opcode not in ("parameter", "constant")]
    analysis = analyze_pattern(graph, members)
    rows = {graph.nodes[r.node].name: r.rows for r in analysis.shared}
    assert rows == {"mx": ROWS, "s1": ROWS}


def _check_on_host(module, graph, members, schedule, tol):
    lowered = lower_kernel(graph, Evaluator(module), schedule, "k")
    rng = np.random.default_rng()
    inputs = {}
    for v in lowered.inputs:
        shape = leaf(graph.nodes[v].shape)
        values = rng.standard_normal(shape.dims) * 3.0
        inputs[v] = values.astype(numpy_dtype(shape.element_type))
    want = reference_values(graph, Evaluator(module), sorted(members), inputs)
    got = run_on_host(lowered, graph, inputs, poison=True, opt=0)
    outputs = {_by_name(graph, "lso"), _by_name(graph, "gro")}
    assert outputs <= set(got)
    for v, value in got.items():
        ref = np.asarray(want[v], np.float64)
        val = np.asarray(value, np.float64)
        assert not np.isnan(val).any(), graph.nodes[v].name
        err = np.linalg.norm(val - ref) / max(np.linalg.norm(ref), 1e-30)
        assert err <= tol, f"{graph.nodes[v].name}: relative error {err:.2e}"
    return lowered


@pytest.mark.parametrize("unit", [None, "warp", "block"])
def test_stitched_two_level_log_softmax_matches_the_evaluator(unit):
    module, graph, members = _graph()
    force = {"unit": unit} if unit else None
    schedule = schedule_kernel(graph, members, get_spec("h100"), force=force)
    if unit:
        assert {p.unit for p in schedule.parts} == {unit}
    _check_on_host(module, graph, members, schedule, tol=1e-5)


def test_bf16_two_level_log_softmax_matches_the_evaluator():
    module, graph, members = _graph("bf16")
    schedule = schedule_kernel(graph, members, get_spec("a100"))
    # bf16 outputs are rounded per op like XLA: the tolerance is bf16's half ulp.
    _check_on_host(module, graph, members, schedule, tol=4e-3)


@pytest.mark.parametrize("target", ["v100", "a100", "h100"])
@pytest.mark.parametrize("model", ["log_softmax_xent_train", "log_softmax_xent_train_bf16"])
def test_cross_entropy_training_step_reads_the_logits_once(model, target):
    """The zoo's cross-entropy step: max, sum(exp), loss gather and gradient in one kernel;
    its memory-intensive bytes are within 1% of the one-kernel bound (logits read once,
    gradient written once), 1.50x before."""
    from stitch.pricing.delta import kernel_hbm_bytes

    text = (DATA / model / f"full.gpu-{target}.hlo").read_text()
    plan = stitch.plan(text, target=target)
    stitched = bound = 0.0
    for g in plan.graphs:
        mem = [k for k in g.stitched.kernels if k.is_memory]
        stitched += sum(k.cost.hbm_bytes for k in mem) * g.stitched.weight
        members = {v for k in g.baseline.kernels if k.is_memory for v in k.members}
        bound += kernel_hbm_bytes(g.graph, members) * g.baseline.weight
        names = {g.graph.nodes[v].name for k in mem for v in k.members}
        # The row max shares a kernel with the gradient it feeds.
        big = max(mem, key=lambda k: k.cost.hbm_bytes)
        reduces = [v for v in big.members if g.graph.nodes[v].opcode == "reduce"]
        assert len(reduces) >= 6, sorted(names)
    assert stitched <= 1.01 * bound, (stitched, bound)


def test_ops_with_fewer_elements_per_row_are_charged_per_row_not_per_element():
    """The latency-evaluator's walk over a row (warp/block units): a split reduction's
    second level (SPLIT partials per row) and a broadcast of a per-row value run once per
    row or per partial, not once per row element (codegen hoists them out of the element
    loop); thread composition's per-consumer counts are unchanged."""
    from stitch.schedule.space import op_instructions, part_facts

    _, graph, members = _graph()
    analysis = analyze_pattern(graph, members)
    facts = part_facts(graph, members, analysis)
    n = SPLIT * INNER
    mx, se = _by_name(graph, "mx"), _by_name(graph, "se")
    second = [p for p in facts.passes if set(p.reductions) & {mx, se}]
    assert second
    for p in second:
        # reduce over SPLIT partials: 2 instructions per partial, per row of n elements.
        assert p.walk_alu == pytest.approx(2.0 * SPLIT / n * len(p.reductions))
        assert p.alu >= 2.0 * len(p.reductions)
    # The pass computing exp(x - max) and reducing it: the broadcast of the row max is
    # hoisted (its 2 instructions once per row), every other op runs per element.
    mxb, s1 = _by_name(graph, "mxb"), _by_name(graph, "s1")
    exp_pass = next(p for p in facts.passes if s1 in p.reductions)
    assert mxb in exp_pass.full_ops
    per_element = sum(op_instructions(graph, v)[0] for v in exp_pass.full_ops if v != mxb)
    broadcast = op_instructions(graph, mxb)[0]
    assert exp_pass.walk_alu == pytest.approx(per_element + broadcast / n)
    assert exp_pass.alu == pytest.approx(per_element + broadcast)


@pytest.mark.parametrize("target", ["a100"])
def test_bf16_cross_entropy_step_is_not_slower_than_xla(target):
    """No model x target slower than XLA on the latency-evaluator
    (log_softmax_xent_train_bf16 on A100 was 1502 vs 1394 us)."""
    from bench.plans.zoo import plan_model

    row = plan_model("log_softmax_xent_train_bf16", target)
    assert row.stitch.latency_us < row.xla.latency_us


def test_crossing_values_marks_activations_a_gemm_separates_as_forced():
    """e = exp(x) feeds a GEMM and, after it, an add with the GEMM's result: e must be
    written and read back whatever the plan (forced); the one-kernel bound does not count
    it, ``PlanRow.forced_bytes`` does."""
    from bench.plans.zoo import crossing_values

    text = """HloModule m
ENTRY e {
  x = f32[256,512] parameter(0)
  w = f32[512,512] parameter(1)
  e = f32[256,512] exponential(x)
  d = f32[256,512] dot(e, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT y = f32[256,512] add(e, d)
}
"""
    plan = stitch.plan(text, target="h100")
    result = plan.graphs[0]
    found = [c for c in crossing_values(result) if c.value == "e"]
    assert len(found) == 1 and found[0].forced, found
    # Written once, read once by the add's kernel.
    assert found[0].nbytes == pytest.approx(2 * 256 * 512 * 4)


def test_repacking_brings_the_gru_loop_body_to_the_blp_optimum():
    """dien_train_bf16's GRU loop body (`region_44.71`, h100): packing by level put 40
    independent ops into the first kernel (beam 7.94 us vs the BLP's 7.47 us, 1.063); the
    refinement's repack move puts them in the second, as the BLP does."""
    from stitch.hlo.graph import build_op_graphs
    from stitch.explorer.planner import ExplorerOptions, plan_graph

    module = parse_hlo((DATA / "dien_train_bf16" / "full.gpu-h100.hlo").read_text())
    graph = next(g for g in build_op_graphs(module) if g.name == "region_44.71")
    spec = get_spec("h100")
    options = ExplorerOptions(blp_time_limit_s=30.0)
    beam = plan_graph(graph, spec, "beam", "xla", options)
    blp = plan_graph(graph, spec, "blp", "xla", options)
    assert blp.report.status == "optimal"
    assert beam.stitched.objective_s <= 1.01 * blp.stitched.objective_s
    assert "refinement" in beam.report.detail["choice"]
