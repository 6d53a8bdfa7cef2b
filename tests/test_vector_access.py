"""The schedule's vector width in the generated code: a thread takes ``vw``
CONSECUTIVE elements per step (element vw*s + j, j < vw), as the tuner's latency model
assumes, emitted as straight-line accesses at provably aligned offsets that the NVPTX back
end merges into ``ld.global.v{2,4}`` / ``st.global.v{2,4}``. Forced vw = 4 (a pinned
schedule) on plain elementwise kernels and warp/block row reductions, f32 and bf16: the host
run matches the reference evaluator (fresh random inputs, NaN-poisoned outputs), the PTX for
sm_80/sm_90 holds the vector accesses and assembles without spills."""
from __future__ import annotations

import dataclasses
import re
import shutil

import numpy as np
import pytest

from stitch.codegen import kir
from stitch.codegen.errors import CodegenError
from stitch.codegen.lower import lower_kernel, reference_values, run_on_host
from stitch.codegen.values import delinearize, leaf, linearize
from stitch.hlo import parse_hlo
from stitch.hlo.evaluator.dtypes import numpy_dtype
from stitch.hlo.evaluator.interpreter import Evaluator
from stitch.hlo.graph import build_op_graphs
from stitch.cost.gpu_specs import get_spec
from stitch.schedule import schedule_kernel
from tests.fixtures import BF16_TOLERANCE, REDUCERS

HEAD = "HloModule m\n" + REDUCERS + """add_bf16 {
  a = bf16[] parameter(0)
  b = bf16[] parameter(1)
  ROOT s = bf16[] add(a, b)
}
"""

KERNELS = {
    "elementwise_f32": """
  x = f32[96,256] parameter(0)
  y = f32[96,256] parameter(1)
  a = f32[96,256] add(x, y)
  e = f32[96,256] exponential(a)
  ROOT o = f32[96,256] multiply(e, x)""",
    "elementwise_bf16": """
  x = bf16[96,256] parameter(0)
  y = bf16[96,256] parameter(1)
  a = bf16[96,256] add(x, y)
  t = bf16[96,256] tanh(a)
  ROOT o = bf16[96,256] multiply(t, y)""",
    "softmax_f32": """
  x = f32[48,512] parameter(0)
  ninf = f32[] constant(-inf)
  zero = f32[] constant(0)
  m = f32[48] reduce(x, ninf), dimensions={1}, to_apply=max
  mb = f32[48,512] broadcast(m), dimensions={0}
  d = f32[48,512] subtract(x, mb)
  e = f32[48,512] exponential(d)
  s = f32[48] reduce(e, zero), dimensions={1}, to_apply=add
  sb = f32[48,512] broadcast(s), dimensions={0}
  ROOT o = f32[48,512] divide(e, sb)""",
    # XLA GPU's mixed-precision form: bf16 in and out, the statistics in f32.
    "layer_norm_bf16": """
  xb = bf16[40,384] parameter(0)
  x = f32[40,384] convert(xb)
  zero = f32[] constant(0)
  n = f32[] constant(0.00260416667)
  eps = f32[] constant(1e-5)
  s = f32[40] reduce(x, zero), dimensions={1}, to_apply=add
  nb = f32[40] broadcast(n), dimensions={}
  mean = f32[40] multiply(s, nb)
  mb = f32[40,384] broadcast(mean), dimensions={0}
  c = f32[40,384] subtract(x, mb)
  c2 = f32[40,384] multiply(c, c)
  v = f32[40] reduce(c2, zero), dimensions={1}, to_apply=add
  var = f32[40] multiply(v, nb)
  eb = f32[40] broadcast(eps), dimensions={}
  ve = f32[40] add(var, eb)
  r = f32[40] rsqrt(ve)
  rb = f32[40,384] broadcast(r), dimensions={0}
  y = f32[40,384] multiply(c, rb)
  ROOT o = bf16[40,384] convert(y)""",
    # A bf16 reduction with a bf16 combiner, its sum written per row.
    "row_sum_bf16": """
  x = bf16[64,256] parameter(0)
  zero = bf16[] constant(0)
  s = bf16[64] reduce(x, zero), dimensions={1}, to_apply=add_bf16
  sb = bf16[64,256] broadcast(s), dimensions={0}
  ROOT o = bf16[64,256] subtract(x, sb)""",
}
# Inputs read other than element-for-element (a transpose, a broadcast of a row vector):
# per-element loads, but the same vw-consecutive index mapping; numbers must not change.
STRIDED = {
    "transpose_broadcast_f32": """
  x = f32[64,128] parameter(0)
  y = f32[128,64] parameter(1)
  b = f32[128] parameter(2)
  t = f32[64,128] transpose(y), dimensions={1,0}
  bb = f32[64,128] broadcast(b), dimensions={1}
  a = f32[64,128] add(x, t)
  ROOT o = f32[64,128] multiply(a, bb)""",
    "reshape_bf16": """
  x = bf16[32,8,64] parameter(0)
  y = bf16[256,64] parameter(1)
  r = bf16[256,64] reshape(x)
  ROOT o = bf16[256,64] add(r, y)""",
}
# Reads through a reshape or a transpose that keeps the minor dim, and a bias broadcast
# along it: a thread's group is still consecutive in every buffer (vector loads too).
MINOR_KEPT = {
    "head_split_f32": """
  x = f32[2048,2304] parameter(0)
  b = f32[768] parameter(1)
  s = f32[2048,768] slice(x), slice={[0:2048], [768:1536]}
  bb = f32[2048,768] broadcast(b), dimensions={1}
  a = f32[2048,768] add(s, bb)
  r = f32[16,128,12,64] bitcast(a)
  ROOT t = f32[16,12,128,64] transpose(r), dimensions={0,2,1,3}""",
    "reshape_bf16": STRIDED["reshape_bf16"],
}
ROW_KERNELS = ("softmax_f32", "layer_norm_bf16", "row_sum_bf16")


def _graph(body: str):
    module = parse_hlo(f"{HEAD}ENTRY main {{\n{body}\n}}\n")
    graph = build_op_graphs(module)[0]
    members = [n.id for n in graph.nodes if n.opcode not in ("parameter", "constant")]
    return module, graph, members


def _forced(graph, members, unit: str | None, vw: int):
    """The tuner's schedule with ``unit`` forced, re-evaluated with vector width ``vw`` on
    every part (``pin``)."""
    spec = get_spec("h100")
    force = {"unit": unit} if unit else None
    base = schedule_kernel(graph, members, spec, force=force)
    pin = dataclasses.replace(base, parts=[dataclasses.replace(p, vector_width=vw)
                                           for p in base.parts])
    schedule = schedule_kernel(graph, members, spec, force=force, pin=pin)
    assert [p.vector_width for p in schedule.parts] == [vw] * len(schedule.parts)
    if unit:
        assert all(p.unit == unit for p in schedule.parts if p.kind == "row")
    return schedule


def _check_on_host(graph, module, members, lowered, seed: int) -> None:
    rng = np.random.default_rng(seed)
    inputs = {}
    for v in lowered.inputs:
        shape = leaf(graph.nodes[v].shape)
        inputs[v] = rng.standard_normal(shape.dims).astype(numpy_dtype(shape.element_type))
    want = reference_values(graph, Evaluator(module), sorted(members), inputs)
    got = run_on_host(lowered, graph, inputs)       # outputs start as NaN
    bf16 = any(leaf(graph.nodes[v].shape).element_type == "bf16" for v in members)
    tol = BF16_TOLERANCE if bf16 else 1e-5
    assert got
    for v, value in got.items():
        ref = np.asarray(want[v], np.float64)
        val = value.astype(np.float64)
        assert np.isfinite(val).all(), f"{graph.nodes[v].name}: elements left unwritten"
        error = np.linalg.norm(val - ref) / max(np.linalg.norm(ref), 1e-30)
        assert error <= tol, f"{graph.nodes[v].name}: relative error {error:.2e}"


CASES = [(name, None) for name in ("elementwise_f32", "elementwise_bf16")] + \
    [(name, unit) for name in ROW_KERNELS for unit in ("warp", "block")]


@pytest.mark.parametrize("vw", [2, 4])
@pytest.mark.parametrize("name,unit", CASES + [(n, None) for n in STRIDED] +
                         [(n, "thread") for n in ROW_KERNELS])
def test_forced_vector_width_matches_the_reference_on_the_host(name, unit, vw):
    module, graph, members = _graph({**KERNELS, **STRIDED}[name])
    schedule = _forced(graph, members, unit, vw)
    lowered = lower_kernel(graph, Evaluator(module), schedule, f"{name}_{vw}")
    if unit in ("warp", "block"):
        assert lowered.schemes == [unit], lowered.notes
    assert not [n for n in lowered.notes if "walked" in n], lowered.notes
    _check_on_host(graph, module, members, lowered, seed=vw * 1000 + len(name))


def _loops_with(stmts, kind) -> list[int]:
    """Per For loop of the kernel: how many ``kind`` statements its body holds directly
    or under Ifs (not in nested loops)."""
    counts = []

    def inside(body) -> int:
        n = 0
        for s in body:
            if isinstance(s, kind):
                n += 1
            elif isinstance(s, kir.If):
                n += inside(s.then) + inside(s.orelse)
        return n

    for s in kir.walk_stmts(stmts):
        if isinstance(s, kir.For):
            counts.append(inside(s.body))
    return counts


@pytest.mark.parametrize("name,unit", CASES)
def test_a_thread_takes_vw_consecutive_elements_per_step(name, unit):
    """The index mapping the schedule assumes: each walk stores vw elements per step, at
    offsets first, first + 1, ..., first + vw-1 with first a multiple of vw."""
    module, graph, members = _graph(KERNELS[name])
    lowered = lower_kernel(graph, Evaluator(module), _forced(graph, members, unit, 4), name)
    stores = [n for n in _loops_with(lowered.kernel.body, kir.Store) if n]
    assert stores and all(n == 4 for n in stores), stores
    for s in kir.walk_stmts(lowered.kernel.body):
        if isinstance(s, kir.For) and _loops_with((s,), kir.Store)[0]:
            offsets = [st.index for st in kir.walk_stmts(s.body) if isinstance(st, kir.Store)]
            first = offsets[0]
            assert offsets[1:] == [kir.Binary("add", first, kir.i32(j)) for j in (1, 2, 3)]


_VECTOR = {
    "ld": re.compile(r"ld\.global(?:\.nc)?\.v(\d)\.\w+"),
    "st": re.compile(r"st\.global\.v(\d)\.\w+"),
}


# A global load or store of one element: its type follows ``global`` (or ``global.nc``, the
# read-only path inputs take) at once, where a vector access has ``.v2`` / ``.v4`` first.
SCALAR_ACCESS = re.compile(r"(?:ld|st)\.global(?:\.nc)?\.[bfsu]\d+\b")


def _vector_accesses(ptx: str, op: str) -> list[int]:
    return [int(w) for w in _VECTOR[op].findall(ptx)]


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not found")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name,unit", CASES)
def test_ptx_holds_vector_loads_and_stores(name, unit, arch):
    """vw = 4 (and 2): every global load and store of the kernel's own contiguous walk is
    a v4 (v2) access; ptxas assembles it without spills."""
    from stitch.codegen.isolation import run_isolated
    from stitch.codegen.nvptx import emit_ptx
    from stitch.codegen.toolchain import assemble

    module, graph, members = _graph(KERNELS[name])
    for vw in (4, 2):
        lowered = lower_kernel(graph, Evaluator(module), _forced(graph, members, unit, vw),
                               f"{name}_vw{vw}")
        ptx = run_isolated(emit_ptx, lowered.kernel, arch)
        loads, stores = _vector_accesses(ptx, "ld"), _vector_accesses(ptx, "st")
        assert loads and set(loads) == {vw}, (vw, loads)
        assert stores and set(stores) == {vw}, (vw, stores)
        # No scalar global access is left (every walk here is contiguous).
        scalar = re.findall(SCALAR_ACCESS, ptx)
        assert not scalar, scalar
        report = assemble(ptx, arch)[lowered.kernel.name]
        assert report.spill_store_bytes == 0 and report.spill_load_bytes == 0
        assert report.registers > 0


def test_a_width_that_does_not_divide_the_part_is_refused():
    module, graph, members = _graph("""
  x = f32[6,7] parameter(0)
  ROOT o = f32[6,7] exponential(x)""")
    schedule = schedule_kernel(graph, members, get_spec("h100"))
    assert schedule.parts[0].vector_width in (1, 2)        # 42 elements
    schedule.parts[0].vector_width = 4
    with pytest.raises(CodegenError, match="not a multiple of vector width 4"):
        lower_kernel(graph, Evaluator(module), schedule, "odd")


def _evaluate(e: kir.Expr, env: dict[str, np.ndarray]) -> np.ndarray:
    """Integer value of an index expression (i32 arithmetic on non-negative values)."""
    if isinstance(e, kir.Const):
        return np.asarray(e.value, np.int64)
    if isinstance(e, kir.Ref):
        return env[e.name]
    a, b = _evaluate(e.a, env), _evaluate(e.b, env)
    if e.op == "add":
        return a + b
    if e.op == "mul":
        return a * b
    assert e.op in ("div", "rem") and int(b) > 0, e
    return a // b if e.op == "div" else a % b


@pytest.mark.parametrize("dims", [(7,), (3, 5), (4, 1, 6), (1, 8, 2, 3)])
def test_linearize_folds_a_whole_delinearization_back(dims):
    x = kir.Ref("x", "i32")
    index = delinearize(x, dims)
    assert linearize(index, dims) == x
    size = int(np.prod(dims))
    env = {"x": np.arange(size)}
    # Offsets added to the minor digit (a vector group inside one run) fold too.
    shifted = index[:-1] + (kir.Binary("add", index[-1], kir.i32(1)),)
    got = _evaluate(linearize(shifted, dims), {"x": np.arange(size - 1)})
    assert np.array_equal(got, np.arange(1, size))
    # The minor digits of another value's index (a broadcast operand) keep their
    # remainders: x runs over the whole result, not the operand.
    if len(dims) > 1:
        big = (5,) + dims
        part = delinearize(x, big)[1:]
        want = np.arange(size * 5) % size
        assert np.array_equal(_evaluate(linearize(part, dims), {"x": np.arange(size * 5)}),
                              want)
    assert np.array_equal(_evaluate(linearize(index, dims), env), env["x"])


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not found")
@pytest.mark.parametrize("name", sorted(MINOR_KEPT))
def test_reads_through_reshapes_and_minor_kept_transposes_are_vector_loads(name):
    """The group's offsets stay base + j through a slice, a bitcast, a transpose keeping
    the minor dim and a broadcast along it (``delinearize`` keeps the constant on the
    minor digit, the access carries the alignment its index proves): every global access
    is a v4; the host run matches the evaluator."""
    from stitch.codegen.isolation import run_isolated
    from stitch.codegen.nvptx import emit_ptx

    module, graph, members = _graph(MINOR_KEPT[name])
    schedule = _forced(graph, members, None, 4)
    lowered = lower_kernel(graph, Evaluator(module), schedule, name)
    ptx = run_isolated(emit_ptx, lowered.kernel, "sm_90")
    scalar = re.findall(SCALAR_ACCESS, ptx)
    assert not scalar and set(_vector_accesses(ptx, "ld")) == {4}, scalar
    assert set(_vector_accesses(ptx, "st")) == {4}
    _check_on_host(graph, module, members, lowered, seed=len(name))


def test_a_part_with_an_atomic_scatter_is_priced_at_width_one():
    """Colliding updates are walked one guarded atomic add each (no vector accesses): the
    tuner offers that part width 1 only; the same part without the scatter goes wide."""
    body = """
  table = f32[64,16] parameter(0)
  ids = s32[96] parameter(1)
  g = f32[96,16] parameter(2)
  two = f32[] constant(2)
  tb = f32[96,16] broadcast(two), dimensions={}
  gg = f32[96,16] multiply(g, tb)
  ROOT sc = f32[64,16] scatter(table, ids, gg), update_window_dims={1},
    inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1,
    to_apply=add"""
    module, graph, members = _graph(body)
    schedule = schedule_kernel(graph, members, get_spec("h100"))
    assert [p.vector_width for p in schedule.parts] == [1]
    plain = [v for v in members if graph.nodes[v].opcode != "scatter"]
    assert schedule_kernel(graph, plain, get_spec("h100")).parts[0].vector_width > 1
