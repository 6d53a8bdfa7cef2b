"""Stitching schedules: scheme choice across families of shapes, locality, sub-roots, shared
memory reuse, packing, and the latency-evaluator's basic responses."""
from __future__ import annotations

import pytest

from stitch.hlo import parse_hlo
from stitch.hlo.graph import build_op_graphs
from stitch.cost.gpu_specs import get_spec
from stitch.cost.latency import LaunchShape, WarpWork, evaluate
from stitch.analysis.feasibility import infeasible_reason
from stitch.schedule import schedule_kernel
from tests.fixtures import DATA, REDUCERS

HEAD = "HloModule m\n" + REDUCERS


def _graph(body: str):
    return build_op_graphs(parse_hlo(f"{HEAD}ENTRY main {{\n{body}\n}}\n"))[0]


def _computing(graph) -> list[int]:
    return [n.id for n in graph.nodes if n.opcode not in ("parameter", "constant")]


def softmax(rows: int, length: int):
    return _graph(f"""
  x = f32[{rows},{length}] parameter(0)
  ninf = f32[] constant(-inf)
  zero = f32[] constant(0)
  m = f32[{rows}] reduce(x, ninf), dimensions={{1}}, to_apply=max
  mb = f32[{rows},{length}] broadcast(m), dimensions={{0}}
  d = f32[{rows},{length}] subtract(x, mb)
  e = f32[{rows},{length}] exponential(d)
  s = f32[{rows}] reduce(e, zero), dimensions={{1}}, to_apply=add
  sb = f32[{rows},{length}] broadcast(s), dimensions={{0}}
  ROOT y = f32[{rows},{length}] divide(e, sb)""")


def layer_norm(rows: int, length: int):
    return _graph(f"""
  x = f32[{rows},{length}] parameter(0)
  zero = f32[] constant(0)
  n = f32[] constant({length})
  sum = f32[{rows}] reduce(x, zero), dimensions={{1}}, to_apply=add
  nb = f32[{rows}] broadcast(n), dimensions={{}}
  mean = f32[{rows}] divide(sum, nb)
  meanb = f32[{rows},{length}] broadcast(mean), dimensions={{0}}
  c = f32[{rows},{length}] subtract(x, meanb)
  sq = f32[{rows},{length}] multiply(c, c)
  vsum = f32[{rows}] reduce(sq, zero), dimensions={{1}}, to_apply=add
  var = f32[{rows}] divide(vsum, nb)
  r = f32[{rows}] rsqrt(var)
  rb = f32[{rows},{length}] broadcast(r), dimensions={{0}}
  ROOT y = f32[{rows},{length}] multiply(c, rb)""")


def _unit(graph, target: str) -> str:
    return schedule_kernel(graph, _computing(graph), get_spec(target)).parts[0].unit


# --- scheme choice follows the shapes --------------------------------------------------------

@pytest.mark.parametrize("target", ["v100", "a100", "h100"])
@pytest.mark.parametrize("length", [32, 64, 128, 256])
def test_short_rows_get_a_warp_per_row(target, length):
    assert _unit(softmax(2 ** 22 // length, length), target) == "warp"


@pytest.mark.parametrize("target", ["v100", "a100", "h100"])
@pytest.mark.parametrize("rows,length", [(64, 32000), (512, 32000), (128, 16384),
                                         (256, 8192)])
def test_long_rows_get_a_block_per_row(target, rows, length):
    ks = schedule_kernel(softmax(rows, length), _computing(softmax(rows, length)),
                         get_spec(target))
    part = ks.parts[0]
    assert part.unit == "block" and part.rows_per_block == 1 and ks.grid == rows
    assert ks.smem_bytes > 0                      # partials and results in shared memory
    assert "block" in ks.schemes


@pytest.mark.parametrize("target", ["v100", "h100"])
@pytest.mark.parametrize("length", [2, 4])
def test_tiny_rows_are_recomputed_per_thread(target, length):
    graph = softmax(2 ** 20, length)
    ks = schedule_kernel(graph, _computing(graph), get_spec(target))
    assert ks.parts[0].unit == "thread" and "warp" not in ks.schemes
    warp = schedule_kernel(graph, _computing(graph), get_spec(target), force={"unit": "warp"})
    assert warp.modeled_us > ks.modeled_us


def test_forcing_a_unit_changes_the_schedule_and_costs_time():
    graph = softmax(512, 32000)
    best = schedule_kernel(graph, _computing(graph), get_spec("h100"))
    warp = schedule_kernel(graph, _computing(graph), get_spec("h100"), force={"unit": "warp"})
    assert warp.parts[0].unit == "warp" and warp.modeled_us > best.modeled_us


# --- sub-roots, shared memory, registers -------------------------------------------------------

def test_rsqrt_per_row_is_a_sub_root_computed_once():
    graph = layer_norm(4096, 768)
    ks = schedule_kernel(graph, _computing(graph), get_spec("v100"))
    groups = {graph.nodes[g.root].name: g for g in ks.parts[0].groups}
    assert groups["r"].sub_root and groups["sum"].sub_root and groups["vsum"].sub_root
    assert not groups["y"].sub_root and groups["y"].scheme == "thread"
    # Every computing op belongs to exactly one group.
    covered = [v for g in ks.parts[0].groups for v in g.members]
    assert sorted(covered) == sorted(set(covered))
    assert set(covered) >= {v for v in _computing(graph) if not graph.is_free(v)}


def test_block_result_buffers_are_reused_by_dominance():
    """vsum is computed after every consumer of sum (mean) has run: it takes sum's slot."""
    graph = layer_norm(256, 8192)
    ks = schedule_kernel(graph, _computing(graph), get_spec("a100"), force={"unit": "block"})
    results = {graph.nodes[b.node].name: b for b in ks.parts[0].shared_buffers
               if b.purpose == "result"}
    assert results["sum"].offset == results["vsum"].offset
    partials = [b for b in ks.parts[0].shared_buffers if b.purpose == "partials"]
    assert len(partials) == 1 and partials[0].bytes == 4 * ks.block // 32
    assert ks.smem_bytes == partials[0].bytes + results["sum"].bytes


def test_caching_too_many_values_in_registers_is_rejected_with_a_reason():
    graph = softmax(64, 32000)
    ks = schedule_kernel(graph, _computing(graph), get_spec("h100"))
    assert any("registers" in r for r in ks.rejected)
    assert ks.regs_estimate <= 255 and ks.occupancy.blocks_per_sm >= 1


# --- columns, locality, packing ----------------------------------------------------------------

COLUMN = """
  x = f32[8192,1024] parameter(0)
  zero = f32[] constant(0)
  s = f32[1024] reduce(x, zero), dimensions={0}, to_apply=add
  sb = f32[8192,1024] broadcast(s), dimensions={1}
  ROOT y = f32[8192,1024] subtract(x, sb)"""


def test_column_reduction_is_tiled_by_columns():
    graph = _graph(COLUMN)
    ks = schedule_kernel(graph, _computing(graph), get_spec("v100"))
    part = ks.parts[0]
    assert not part.minor and part.vector_width == 1 and part.unit in ("warp", "block")
    block = schedule_kernel(graph, _computing(graph), get_spec("v100"), force={"unit": "block"})
    assert block.parts[0].rows_per_block == 32 and block.grid == 1024 // 32
    assert any(b.purpose == "partials" for b in block.parts[0].shared_buffers)


def test_two_reductions_needing_different_partitions_fail_the_locality_check():
    graph = _graph("""
  x = f32[4096,512] parameter(0)
  zero = f32[] constant(0)
  e = f32[4096,512] exponential(x)
  rows = f32[4096] reduce(e, zero), dimensions={1}, to_apply=add
  cols = f32[512] reduce(e, zero), dimensions={0}, to_apply=add
  rb = f32[4096,512] broadcast(rows), dimensions={0}
  cb = f32[4096,512] broadcast(cols), dimensions={1}
  y1 = f32[4096,512] divide(e, rb)
  y2 = f32[4096,512] divide(e, cb)
  ROOT out = (f32[4096,512], f32[4096,512]) tuple(y1, y2)""")
    members = [v for v in _computing(graph) if graph.nodes[v].opcode != "tuple"]
    reason = infeasible_reason(graph, members)
    assert reason is not None and "different block partitions" in reason
    # The block scopes cannot schedule it; the global scope can.
    schedule = schedule_kernel(graph, members, get_spec("h100"))
    assert schedule.parts[0].kind == "global" and "global" in schedule.schemes
    # Each reduction with its own consumers is fine.
    assert infeasible_reason(graph, [graph.node(n).id for n in ("e", "rows", "rb", "y1")]) \
        is None


def test_independent_parts_are_packed_into_block_ranges():
    graph = _graph("""
  a = f32[4096,256] parameter(0)
  b = f32[1048576] parameter(1)
  zero = f32[] constant(0)
  s = f32[4096] reduce(a, zero), dimensions={1}, to_apply=add
  sb = f32[4096,256] broadcast(s), dimensions={0}
  y = f32[4096,256] subtract(a, sb)
  t = f32[1048576] tanh(b)
  ROOT out = (f32[4096,256], f32[1048576]) tuple(y, t)""")
    members = [v for v in _computing(graph) if graph.nodes[v].opcode != "tuple"]
    ks = schedule_kernel(graph, members, get_spec("h100"))
    assert ks.schemes[0] == "packing" and len(ks.parts) == 2
    ranges = sorted((p.block_offset, p.block_offset + p.blocks) for p in ks.parts)
    assert ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] and ranges[1][1] == ks.grid
    assert {p.kind for p in ks.parts} == {"row", "loop"}


# --- the latency-evaluator --------------------------------------------------------------------

def test_latency_grows_with_waves_and_shrinks_with_occupancy():
    spec = get_spec("v100")
    work = WarpWork(alu=40, global_bytes=4096, global_instr=8, memory_rounds=2)
    one = evaluate(spec, LaunchShape(80, 256, 32), work)
    many = evaluate(spec, LaunchShape(80 * 64, 256, 32), work)
    assert many.waves > one.waves and many.seconds > one.seconds
    # Registers that halve occupancy make a latency-bound grid take more waves.
    starved = evaluate(spec, LaunchShape(80 * 64, 256, 128), work)
    assert starved.occupancy.occupancy < many.occupancy.occupancy
    assert starved.waves > many.waves and starved.seconds >= many.seconds


def test_unlaunchable_shape_has_infinite_latency():
    lat = evaluate(get_spec("h100"), LaunchShape(10, 1024, 255), WarpWork(alu=1))
    assert lat.bound == "cannot launch" and lat.seconds == float("inf")


def test_final_pick_by_latency_evaluator_takes_the_lowest_latency_plan():
    import stitch
    from stitch.explorer.planner import ExplorerOptions, PlanError

    text = (DATA / "bert_layer_train" / "full.gpu-h100.hlo").read_text()
    p = stitch.plan(text, "h100", options=ExplorerOptions(final_pick="latency"))
    detail = p.graphs[0].report.detail
    options = [t for t in detail["latency_objectives_s"] if t is not None]
    assert detail["latency_objective_s"] == pytest.approx(min(options))
    # The chosen plan's latency objective is its stitched kernels' tuned times plus the
    # delta model's time of the rest.
    total = sum(k.schedule.modeled_us * 1e-6 if k.schedule else k.cost.total_s
                for k in p.graphs[0].stitched.kernels)
    assert total == pytest.approx(detail["latency_objective_s"], rel=1e-9)
    with pytest.raises(PlanError, match="final_pick"):
        stitch.plan(text, "h100", options=ExplorerOptions(final_pick="fastest"))


def test_column_reduction_with_many_outputs_per_row_fits_shared_memory():
    """A reduction over a non-minor axis whose rows hold many outputs (the row partition
    coarsened by a consumer) gets block tiling: the result buffer holds one value per output
    of the block's 32 column rows, not 32 times that."""
    g = _graph("""
  x = f32[4,256,200] parameter(0)
  zero = f32[] constant(0)
  s = f32[256,200] reduce(x, zero), dimensions={0}, to_apply=add
  e = f32[256,200] exponential(s)
  ROOT t = f32[200] reduce(e, zero), dimensions={0}, to_apply=add""")
    sched = schedule_kernel(g, _computing(g), get_spec("h100"), force={"unit": "block"})
    part = sched.parts[0]
    assert (part.rows, part.minor) == (200, False)
    assert sched.smem_bytes <= get_spec("h100").shared_memory_per_block_optin
    assert part.unit == "block"


# ---------------------------------------------------------------- coarsened rows


def _coarse_facts(last_is_column_sum: bool = True):
    """A part over one coarsened row of 16 x 32: row statistics (16 outputs of 32 elements:
    a mean, then a variance reading it) and, last, a column sum (32 outputs over the 16
    rows) or an elementwise consumer."""
    from stitch.schedule.space import PartFacts, PassWork, Reduction
    mean = Reduction(1, 1, 512, 16, True, True)
    var = Reduction(2, 1, 512, 16, True, True)
    colsum = Reduction(3, 1, 512, 32, True, False)
    passes = [PassWork(loads=1, alu=1, reductions=[1], elements=512),
              PassWork(loads=1, alu=2, reductions=[2], elements=512),
              PassWork(loads=1, alu=3, reductions=[3] if last_is_column_sum else [],
                       stores=0 if last_is_column_sum else 1, elements=512)]
    reductions = [mean, var] + ([colsum] if last_is_column_sum else [])
    return PartFacts(members=(1, 2, 3), reductions=reductions, rows=1, row_length=512,
                     minor=True, elements=512, passes=passes, per_row_expensive=[],
                     multi_pass_expensive=[], hbm_bytes=4096, thread_bytes=4096)


def test_thread_composition_recomputes_row_statistics_per_row_of_a_column_sum() -> None:
    from stitch.schedule.tuner import _thread_iterations
    facts = _coarse_facts()
    # One column output per thread: its loop over 16 rows; each row's variance (32) is
    # recomputed per row; the mean once per variance output (same rows: loop-invariant).
    assert _thread_iterations(facts, 1, consumers=32) == [32 * 16, 32 * 16, 16]


def test_thread_composition_of_an_elementwise_consumer_reads_its_rows_once() -> None:
    from stitch.schedule.tuner import _thread_iterations
    facts = _coarse_facts(last_is_column_sum=False)
    # vw = 4 consecutive elements of one row: one variance and one mean each.
    assert _thread_iterations(facts, 4, consumers=128) == [32 * 4, 32 * 4, 4]


def test_no_warp_or_block_composition_without_a_one_output_row() -> None:
    """Lowering proves a row layout only from a reduction with one output per row: the tuner
    must not price warp/block composition lowering would build as thread composition."""
    from stitch.hlo.graph import OpGraph
    from stitch.schedule.tuner import _row_work
    facts = _coarse_facts()
    graph = OpGraph.__new__(OpGraph)           # not read before the refusal
    for unit in ("warp", "block"):
        got = _row_work(graph, facts, unit, 128, 1, False, False)
        assert isinstance(got, str) and "one output per row" in got
