"""A split row reduction lowered as ONE block-wide (or warp-wide) row reduction.

XLA GPU splits a wide row reduction in two: ``[rows, a*b] -> bitcast [rows, a, b]``,
reduce over b, then over a. Before, codegen lowered the first level one partial per thread
(thread t of the unit reduced elements t*b .. t*b+b-1 serially: stride b between
neighbouring threads, uncoalesced), while the schedule's latency model charged the row as
walked by the whole unit. Now both levels are one reduction over the row's a*b elements,
walked with the unit's stride. These tests run the kernels on the host target (fresh
random inputs, NaN-poisoned outputs) against the reference evaluator, check the Kernel IR's
loop structure (which fails on the old lowering), that the merge is refused where it would
be wrong or wasteful, and that the PTX assembles without spills.
"""
from __future__ import annotations

import numpy as np
import pytest

from stitch.codegen import kir
from stitch.codegen.lower import lower_kernel, reference_values, run_on_host
from stitch.codegen.values import leaf
from stitch.hlo import parse_hlo
from stitch.hlo.evaluator.dtypes import numpy_dtype
from stitch.hlo.evaluator.interpreter import Evaluator
from stitch.hlo.graph import build_op_graphs
from stitch.cost.gpu_specs import get_spec
from stitch.schedule import schedule_kernel
from tests.fixtures import REDUCERS as F32_REDUCERS

ROWS, SPLIT, INNER = 12, 16, 50          # rows of SPLIT * INNER = 800 elements
WIDTH = SPLIT * INNER
F32_TOL, BF16_TOL = 1e-5, 2e-2

# Reducers as XLA GPU writes them: f32 ones, and bf16 ones widened to f32 and rounded back.
REDUCERS = "\n" + F32_REDUCERS + """add_bf16 {
  a = bf16[] parameter(0)
  b = bf16[] parameter(1)
  wa = f32[] convert(a)
  wb = f32[] convert(b)
  s = f32[] add(wa, wb)
  ROOT r = bf16[] convert(s)
}
max_bf16 {
  a = bf16[] parameter(0)
  b = bf16[] parameter(1)
  wa = f32[] convert(a)
  wb = f32[] convert(b)
  s = f32[] maximum(wa, wb)
  ROOT r = bf16[] convert(s)
}
"""

_INIT = {"add": "0", "max": "-inf"}


def _split_reduce(dtype: str, reducer: str, inner_init: str | None = None,
                  write_partials: bool = False) -> str:
    """reduce(reduce(bitcast(x))) over a split row; ``write_partials``: the first level
    is also a kernel output (another reader)."""
    name = reducer if dtype == "f32" else f"{reducer}_bf16"
    init = _INIT[reducer]
    inner = init if inner_init is None else inner_init
    root = f"({dtype}[{ROWS}], {dtype}[{ROWS},{SPLIT}]) tuple(r2, r1)" if write_partials \
        else f"({dtype}[{ROWS}]) tuple(r2)"
    return f"""HloModule m
{REDUCERS}
ENTRY e {{
  x = {dtype}[{ROWS},{WIDTH}] parameter(0)
  c1 = {dtype}[] constant({inner})
  c2 = {dtype}[] constant({init})
  x3 = {dtype}[{ROWS},{SPLIT},{INNER}] bitcast(x)
  r1 = {dtype}[{ROWS},{SPLIT}] reduce(x3, c1), dimensions={{2}}, to_apply={name}
  r2 = {dtype}[{ROWS}] reduce(r1, c2), dimensions={{1}}, to_apply={name}
  ROOT t = {root}
}}
"""


def _softmax(dtype: str) -> str:
    """Log-softmax and softmax over split rows (XLA's form: max and sum both split in
    two; bf16 in and out, computed in f32 as XLA GPU does)."""
    r, s, i, n = ROWS, SPLIT, INNER, WIDTH
    return f"""HloModule m
{REDUCERS}
ENTRY e {{
  xin = {dtype}[{r},{n}] parameter(0)
  x = f32[{r},{n}] convert(xin)
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
  seb = f32[{r},{n}] broadcast(se), dimensions={{0}}
  sm = f32[{r},{n}] divide(ex, seb)
  lso = {dtype}[{r},{n}] convert(ls)
  smo = {dtype}[{r},{n}] convert(sm)
  ROOT t = ({dtype}[{r},{n}], {dtype}[{r},{n}]) tuple(lso, smo)
}}
"""


def _padded_softmax(dtype: str, pad: int = 3) -> str:
    """Softmax over rows XLA pads before splitting (a 50257-wide vocabulary: padded by 3 to
    140 * 359): each split reduction reads pad(x, init) — -inf for the max, 0 for the sum
    of exp."""
    r, s, i, n = ROWS, SPLIT, INNER, WIDTH - pad
    return f"""HloModule m
{REDUCERS}
ENTRY e {{
  xin = {dtype}[{r},{n}] parameter(0)
  x = f32[{r},{n}] convert(xin)
  ninf = f32[] constant(-inf)
  z = f32[] constant(0)
  xp = f32[{r},{WIDTH}] pad(x, ninf), padding=0_0x0_{pad}
  x3 = f32[{r},{s},{i}] bitcast(xp)
  m1 = f32[{r},{s}] reduce(x3, ninf), dimensions={{2}}, to_apply=max
  mx = f32[{r}] reduce(m1, ninf), dimensions={{1}}, to_apply=max
  mxb = f32[{r},{n}] broadcast(mx), dimensions={{0}}
  sh = f32[{r},{n}] subtract(x, mxb)
  ex = f32[{r},{n}] exponential(sh)
  exp_ = f32[{r},{WIDTH}] pad(ex, z), padding=0_0x0_{pad}
  ex3 = f32[{r},{s},{i}] bitcast(exp_)
  s1 = f32[{r},{s}] reduce(ex3, z), dimensions={{2}}, to_apply=add
  se = f32[{r}] reduce(s1, z), dimensions={{1}}, to_apply=add
  seb = f32[{r},{n}] broadcast(se), dimensions={{0}}
  sm = f32[{r},{n}] divide(ex, seb)
  smo = {dtype}[{r},{n}] convert(sm)
  ROOT t = ({dtype}[{r},{n}], f32[{r}]) tuple(smo, se)
}}
"""


def _graph(text: str):
    module = parse_hlo(text)
    graph = build_op_graphs(module)[0]
    members = [n.id for n in graph.nodes
               if n.opcode not in ("parameter", "constant", "tuple")]
    return module, graph, members


def _lowered(text: str, unit: str, target: str = "h100"):
    module, graph, members = _graph(text)
    schedule = schedule_kernel(graph, members, get_spec(target), force={"unit": unit})
    assert [p.unit for p in schedule.parts] == [unit]
    lowered = lower_kernel(graph, Evaluator(module), schedule, f"split_{unit}")
    assert lowered.schemes == [unit], lowered.notes
    return module, graph, members, lowered


def _run_and_compare(module, graph, members, lowered, tol: float, seed: int | None = None):
    rng = np.random.default_rng(seed)
    inputs = {}
    for v in lowered.inputs:
        shape = leaf(graph.nodes[v].shape)
        values = rng.standard_normal(shape.dims) * 3.0 + rng.uniform(-2, 2)
        inputs[v] = values.astype(numpy_dtype(shape.element_type))
    want = reference_values(graph, Evaluator(module), sorted(members), inputs)
    got = run_on_host(lowered, graph, inputs, poison=True, opt=0)
    assert set(got) == set(lowered.outputs)
    for v, value in got.items():
        name = graph.nodes[v].name
        out = np.asarray(value, np.float64)
        ref = np.asarray(want[v], np.float64)
        assert not np.isnan(out).any(), f"{name}: elements never written"
        err = np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30)
        assert err <= tol, f"{name}: relative error {err:.2e}"


def _loops(stmts) -> list[kir.For]:
    out = []
    for s in stmts:
        if isinstance(s, kir.For):
            out.append(s)
            out.extend(_loops(s.body))
        elif isinstance(s, kir.If):
            out.extend(_loops(s.then))
            out.extend(_loops(s.orelse or ()))
    return out


def _const(e: kir.Expr) -> int | None:
    return e.value if isinstance(e, kir.Const) else None


def _row_walks(lowered, unit: str) -> tuple[list[kir.For], list[kir.For]]:
    """(loops over a whole split row with the unit's stride, loops over one partial's
    INNER elements). A row walk of vector width w steps over WIDTH / w groups of w
    consecutive elements."""
    stride = lowered.kernel.block if unit == "block" else 32
    loops = _loops(lowered.kernel.body)
    walks = [f for f in loops if _const(f.step) == stride and
             any(_const(f.stop) == WIDTH // w for w in (1, 2, 4))]
    partials = [f for f in loops if _const(f.stop) == INNER]
    return walks, partials


@pytest.mark.parametrize("unit", ["block", "warp"])
@pytest.mark.parametrize("reducer", ["add", "max"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_split_row_reduction_is_one_strided_row_walk(dtype, reducer, unit):
    module, graph, members, lowered = _lowered(_split_reduce(dtype, reducer), unit)
    assert lowered.split_rows == {"r2": 2}
    walks, partials = _row_walks(lowered, unit)
    # One loop walks the row's SPLIT*INNER elements with the unit's stride (consecutive
    # threads read consecutive elements); no thread reduces a partial's INNER elements.
    assert len(walks) == 1, [(f.stop, f.step) for f in _loops(lowered.kernel.body)]
    assert not partials
    assert _const(walks[0].start) is None           # starts at the thread's own element
    _run_and_compare(module, graph, members, lowered, F32_TOL if dtype == "f32" else BF16_TOL)


@pytest.mark.parametrize("unit", ["block", "warp"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_split_softmax_walks_each_row_with_the_unit_stride(dtype, unit):
    module, graph, members, lowered = _lowered(_softmax(dtype), unit)
    walks, partials = _row_walks(lowered, unit)
    # The max and the sum each walk the row once; the two stores walk it too.
    assert len(walks) >= 2 and not partials
    _run_and_compare(module, graph, members, lowered, F32_TOL if dtype == "f32" else BF16_TOL)


def test_softmax_on_the_tuned_schedule_matches_the_evaluator():
    module, graph, members = _graph(_softmax("f32"))
    for target in ("v100", "a100", "h100"):
        schedule = schedule_kernel(graph, members, get_spec(target))
        lowered = lower_kernel(graph, Evaluator(module), schedule, f"softmax_{target}")
        if lowered.schemes != ["thread"]:
            assert not _row_walks(lowered, lowered.schemes[0])[1]
        _run_and_compare(module, graph, members, lowered, F32_TOL)


@pytest.mark.parametrize("case", ["written partials", "non-identity init"])
def test_merge_refused_where_partials_are_needed(case):
    """The first level keeps its per-partial lowering when its partials have another
    reader (here: the kernel writes them) or its init is not the identity (1.0 would be
    added once per partial): still right numbers."""
    text = _split_reduce("f32", "add", write_partials=True) if case == "written partials" \
        else _split_reduce("f32", "add", inner_init="1")
    module, graph, members, lowered = _lowered(text, "block")
    walks, partials = _row_walks(lowered, "block")
    assert not walks and partials
    _run_and_compare(module, graph, members, lowered, F32_TOL)


def test_three_level_split_merges_into_one_walk():
    """reduce over [rows, 4, 4, 50]: three levels with the same combiner, one walk."""
    a, b = 4, SPLIT // 4
    text = f"""HloModule m
{REDUCERS}
ENTRY e {{
  x = f32[{ROWS},{WIDTH}] parameter(0)
  z = f32[] constant(0)
  x4 = f32[{ROWS},{a},{b},{INNER}] bitcast(x)
  r1 = f32[{ROWS},{a},{b}] reduce(x4, z), dimensions={{3}}, to_apply=add
  r2 = f32[{ROWS},{a}] reduce(r1, z), dimensions={{2}}, to_apply=add
  r3 = f32[{ROWS}] reduce(r2, z), dimensions={{1}}, to_apply=add
  ROOT t = (f32[{ROWS}]) tuple(r3)
}}
"""
    module, graph, members, lowered = _lowered(text, "block")
    walks, partials = _row_walks(lowered, "block")
    assert len(walks) == 1 and not partials
    assert not [f for f in _loops(lowered.kernel.body) if _const(f.stop) == b]
    _run_and_compare(module, graph, members, lowered, F32_TOL)


@pytest.mark.parametrize("arch", ["sm_70", "sm_80", "sm_90"])
def test_split_row_kernels_assemble_without_spills(arch):
    from stitch.codegen.nvptx import default_libdevice_path, emit_ptx
    from tests.test_kir_nvptx import assemble
    if default_libdevice_path() is None:
        pytest.skip("no libdevice")
    for text in (_softmax("bf16"), _split_reduce("f32", "max")):
        for unit in ("block", "warp"):
            _, _, _, lowered = _lowered(text, unit)
            ptx = emit_ptx(lowered.kernel, arch)
            info = assemble(ptx, arch)
            assert info["spill_stores"] == 0 and info["spill_loads"] == 0, info
            assert "shfl.sync" in ptx


# ------------------------------------------------- the row-layout proof on compact ids
# At full size the zoo's cross-entropy logits (f32[4096, 32000]) are too large for the
# proof's full index arrays: their ids are kept compact (stitch/codegen/compact_rows.py). Here the
# threshold is lowered to 0, so small kernels are proved the compact way too: the proof
# must agree with the full one wherever it proves a layout, and the kernels must run right.

def _layouts(graph, module, schedule):
    from stitch.codegen.lower import row_layouts
    return row_layouts(graph, Evaluator(module), schedule, in_place=True)


def _same_layout(a, b) -> bool:
    return a.reductions == b.reductions and a.splits == b.splits and a.per_row == b.per_row


def _compare_proofs(monkeypatch, graph, module, schedule) -> tuple[int, int]:
    """(layouts both proofs found, layouts only the full proof found)."""
    import stitch.codegen.row_layout as row_layout
    full = _layouts(graph, module, schedule)
    with monkeypatch.context() as m:
        m.setattr(row_layout, "FULL_IDS_ELEMENTS", 0)
        compact = _layouts(graph, module, schedule)
    agreed = only_full = 0
    for f, c in zip(full, compact):
        if f is None:
            continue
        if not isinstance(c, str):
            # Never a layout the full proof refuses, never a different one.
            assert not isinstance(f, str), f"compact proof accepts what the full one " \
                                           f"refuses: {f}"
            assert _same_layout(f, c), (f, c)
            agreed += 1
        elif not isinstance(f, str):
            only_full += 1
    return agreed, only_full


@pytest.mark.parametrize("unit", ["block", "warp"])
@pytest.mark.parametrize("text", [_softmax("f32"), _softmax("bf16"), _split_reduce("f32", "max"),
                                  _split_reduce("bf16", "add", write_partials=True),
                                  _padded_softmax("f32"), _padded_softmax("bf16")],
                         ids=["softmax", "softmax-bf16", "max", "written-partials",
                              "padded-softmax", "padded-softmax-bf16"])
def test_compact_proof_lowers_split_kernels_right(monkeypatch, text, unit):
    import stitch.codegen.row_layout as row_layout
    module, graph, members = _graph(text)
    schedule = schedule_kernel(graph, members, get_spec("h100"), force={"unit": unit})
    assert _compare_proofs(monkeypatch, graph, module, schedule) == (1, 0)
    monkeypatch.setattr(row_layout, "FULL_IDS_ELEMENTS", 0)
    lowered = lower_kernel(graph, Evaluator(module), schedule, "compact")
    assert lowered.schemes == [unit], lowered.notes
    bf16 = "bf16" in text.split("ENTRY")[1]
    _run_and_compare(module, graph, members, lowered, BF16_TOL if bf16 else F32_TOL)


ZOO_TINY = ["log_softmax_xent_train", "log_softmax_xent_train_bf16", "layer_norm",
            "softmax", "layer_norm_nonminor", "column_reduce_broadcast", "bert_layer_train",
            "transformer_train_bf16", "dien_train"]


@pytest.mark.parametrize("model, stage", [(m, "pre") for m in ZOO_TINY] + [
    # XLA GPU's form of the loss's gather: concatenate(iota, label) start indices.
    ("log_softmax_xent_train", "gpu-h100"), ("log_softmax_xent_train_bf16", "gpu-a100")])
def test_compact_proof_agrees_with_the_full_one_on_zoo_kernels(monkeypatch, model, stage):
    """Every warp/block part of the tiny zoo plans (h100), each forced unit: where the
    compact proof finds a layout it is the full proof's; the compacted kernels run right
    on the host target."""
    import stitch.codegen.row_layout as row_layout
    from tests.fixtures import forced_reduction_schedules, zoo_fixture
    module = parse_hlo(zoo_fixture(model, "tiny", stage).read_text())
    rng = np.random.default_rng()
    agreed = only_full = 0
    for graph, members, forced in forced_reduction_schedules(module):
        a, b = _compare_proofs(monkeypatch, graph, module, forced)
        agreed, only_full = agreed + a, only_full + b
        if not a:
            continue
        with monkeypatch.context() as m:
            m.setattr(row_layout, "FULL_IDS_ELEMENTS", 0)
            # In place: a kernel ending in an embedding gradient's scatter-add.
            lowered = lower_kernel(graph, Evaluator(module), forced, "c",
                                   in_place=True)
        inputs = {}
        for v in lowered.inputs:
            shape = leaf(graph.nodes[v].shape)
            dtype = numpy_dtype(shape.element_type)
            inputs[v] = (rng.standard_normal(shape.dims) if dtype.kind == "f" else
                         rng.integers(0, 4, shape.dims)).astype(dtype)
        want = reference_values(graph, Evaluator(module), sorted(members), inputs)
        got = run_on_host(lowered, graph, inputs, poison=True, opt=0)
        for v, out in got.items():
            ref = np.asarray(want[v], np.float64)
            val = np.asarray(out, np.float64)
            # Random inputs reach log(0) or rsqrt(-x): non-finite results must match.
            odd = ~np.isfinite(ref)
            assert np.array_equal(val[odd], ref[odd], equal_nan=True), \
                graph.nodes[v].name
            assert np.isfinite(val[~odd]).all(), graph.nodes[v].name
            ok = ~odd
            err = np.linalg.norm(val[ok] - ref[ok]) / max(np.linalg.norm(ref[ok]), 1e-5)
            tol = BF16_TOL if "bf16" in model else 1e-4
            assert err <= tol, f"{model} {forced} {graph.nodes[v].name}: {err}"
    if agreed + only_full == 0:
        pytest.skip(f"{model}: no warp/block part")
    print(f"{model}: {agreed} layouts proved both ways, {only_full} only in full")


@pytest.mark.parametrize("unit", ["block", "warp"])
def test_split_column_reduction_merges_and_matches(unit):
    """XLA's split of a column reduction (a bias gradient: [a*b, cols] -> [a, b, cols],
    reduce over b, then over a) in a column part: merged into one walk over a*b elements
    per column; lanes own consecutive columns either way."""
    a, b, cols = 8, 24, 64
    text = f"""HloModule m
{REDUCERS}
ENTRY e {{
  x = f32[{a * b},{cols}] parameter(0)
  z = f32[] constant(0)
  x3 = f32[{a},{b},{cols}] bitcast(x)
  r1 = f32[{a},{cols}] reduce(x3, z), dimensions={{1}}, to_apply=add
  r2 = f32[{cols}] reduce(r1, z), dimensions={{0}}, to_apply=add
  ROOT t = (f32[{cols}]) tuple(r2)
}}
"""
    module, graph, members, lowered = _lowered(text, unit)
    assert lowered.split_rows == {"r2": 2}
    loops = _loops(lowered.kernel.body)
    assert [f for f in loops if _const(f.stop) == a * b]
    assert not [f for f in loops if _const(f.stop) == b]
    _run_and_compare(module, graph, members, lowered, F32_TOL)


# ------------------------------------------------------ the zoo's full-size kernels
ARCH = {"v100": "sm_70", "a100": "sm_80", "h100": "sm_90"}
FULL_SIZE = [(m, t) for m in ("log_softmax_xent_train", "log_softmax_xent_train_bf16")
             for t in ("v100", "a100", "h100")] + [("transformer_train", "h100"),
                                                   ("transformer_train_bf16", "h100")]


@pytest.mark.parametrize("model, target", FULL_SIZE)
def test_full_size_cross_entropy_kernel_walks_its_rows_as_planned(model, target):
    """The cross-entropy kernel of the full-size plans (f32/bf16[4096, 32000] logits, XLA's
    [4096, 128, 250] split of the max, the sum of exp and the gradient's sum): lowered with
    the block composition the plan chose (before: refused by the row proof as too large,
    thread composition), its three split reductions as one row walk each, and the PTX
    assembles without spills."""
    import stitch
    from stitch.codegen.nvptx import default_libdevice_path, emit_ptx
    from tests.fixtures import DATA
    from tests.test_kir_nvptx import assemble
    module = parse_hlo((DATA / model / f"full.gpu-{target}.hlo").read_text())
    plan = stitch.plan(module, target=target)
    found = []
    for g in plan.graphs:
        for k in g.stitched.kernels:
            # XLA's split of the 32000-wide rows: reduce over 250 of [4096, 128, 250].
            if k.schedule is None or not any(
                    g.graph.nodes[v].opcode == "reduce" and
                    leaf(g.graph.nodes[g.graph.nodes[v].operands[0]].shape).dims ==
                    (4096, 128, 250) for v in k.members):
                continue
            lowered = lower_kernel(g.graph, Evaluator(module), k.schedule, k.name)
            found.append(lowered)
            assert lowered.schemes == [p.unit for p in k.schedule.parts], lowered.notes
    [lowered] = found
    assert lowered.schemes == ["block"]
    assert sorted(lowered.split_rows.values()) == [2, 2, 2]
    walks = [f for f in _loops(lowered.kernel.body)
             if _const(f.step) == lowered.kernel.block and
             any(_const(f.stop) == 32000 // w for w in (1, 2, 4))]
    assert len(walks) >= 3
    assert not [f for f in _loops(lowered.kernel.body) if _const(f.stop) == 250]
    if default_libdevice_path() is not None:
        info = assemble(emit_ptx(lowered.kernel, ARCH[target]), ARCH[target])
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0, info


@pytest.mark.parametrize("in_dims, out_dims, keep", [
    ((6, 20), (6, 4, 5), (0,)), ((6, 20), (6, 4, 5), (1,)), ((6, 4, 5), (6, 20), (0, 2)),
    ((2, 3, 20), (6, 4, 5), (0,)), ((2, 3, 20), (6, 4, 5), (1,)), ((6, 1, 20), (120,), (0,)),
    ((4, 6), (2, 2, 2, 3), (1,)), ((1, 6, 1), (2, 3), (1,)), ((12, 10), (3, 4, 10), (0,))])
def test_compact_reshape_and_broadcast_match_numpy(in_dims, out_dims, keep):
    """compact_rows.reshape (a row-major reshape of compact ids) equals numpy's reshape of
    the full ids, for ids that change along ``keep`` only; broadcast likewise."""
    from stitch.codegen import compact_rows
    rng = np.random.default_rng()
    shape = tuple(n if d in keep else 1 for d, n in enumerate(in_dims))
    ids = rng.integers(-1, 50, shape)
    full = np.broadcast_to(ids, in_dims).reshape(out_dims)
    got = compact_rows.reshape(ids, in_dims, out_dims, 1 << 20)
    assert got is not None and compact_rows.fits(got, out_dims)
    assert np.array_equal(np.broadcast_to(got, out_dims), full)
    out = (3,) + in_dims + (2,)
    b = compact_rows.broadcast(ids, out, tuple(range(1, len(in_dims) + 1)))
    want = np.broadcast_to(np.broadcast_to(ids, in_dims)[None, ..., None], out)
    assert np.array_equal(np.broadcast_to(b, out), want)


@pytest.mark.parametrize("pads", [((0, 0, 0), (0, 3, 0)), ((1, 2, 0), (0, 3, 0)),
                                  ((0, 0, 1), (-2, 1, 0)), ((0, -1, 0), (2, 0, 2))])
@pytest.mark.parametrize("keep", [(0,), (1,), (0, 1)])
def test_compact_pad_is_the_full_pad_where_rows_change(pads, keep):
    """compact_rows.pad: along dims where the ids change it is the evaluator's pad with -1
    (row-independent); along the others the result stays compact and each padding element
    takes its row's id, so the full result equals the full pad wherever that pad is not -1
    and names one of the row's ids where it is."""
    from stitch.codegen import compact_rows
    from stitch.hlo.evaluator.shape_ops import pad_array
    from stitch.hlo.ir import PadDim
    dims = (5, 7)
    pad_dims = [PadDim(*p) for p in pads]
    rng = np.random.default_rng()
    ids = rng.integers(0, 50, tuple(n if d in keep else 1 for d, n in enumerate(dims)))
    got = compact_rows.pad(ids, pad_dims, 1 << 20)
    want = pad_array(np.broadcast_to(ids, dims), -1, pad_dims)
    assert got is not None and compact_rows.fits(got, want.shape)
    full = np.broadcast_to(got, want.shape)
    assert np.array_equal(full[want >= 0], want[want >= 0])
    # Padding elements of a dim the ids are constant on carry that row's id, never -1.
    if len(keep) == 1:
        constant = 1 - keep[0]
        along = np.moveaxis(full, constant, 0)
        assert (along == along[:1]).all()
    assert compact_rows.pad(ids, pad_dims, 1) is None or full.size <= 1
