"""Global stitching scope: the Kernel IR grid barrier and global scratch on
the host target and NVPTX, and stitched kernels whose consumers need every block's data —
lowered as persistent kernels with grid barriers — run on the host against the reference
evaluator with poisoned outputs and fresh random inputs."""
from __future__ import annotations

import math

import numpy as np
import pytest

from stitch.codegen import kir
from stitch.codegen.errors import CodegenError
from stitch.codegen.host import compile_host
from stitch.codegen.kir import (Binary, Compare, For, GlobalScratch, GridBarrier, If, Kernel, Let,
                                Load, Local, Assign, Param, Ref, Store, ThreadIdx, WarpReduce, i32)
from stitch.codegen.printer import format_kernel

# ---------------------------------------------------------------- Kernel IR


def normalize_kernel(n: int, grid: int, block: int) -> Kernel:
    """out = x / sum(x) with one grid barrier: phase 1, each block reduces its grid-stride
    share (warp reduce, lane 0 of every warp adds into a block slot of the scratch... here
    simply one partial per warp); phase 2, every thread folds the partials and scales."""
    x = Param("x", "f32", n)
    out = Param("out", "f32", n, is_output=True)
    warps = block // 32
    partials = GlobalScratch("partials", "f32", grid * warps)
    tid = ThreadIdx()
    gtid = Binary("add", Binary("mul", kir.BlockIdx(), i32(block)), tid)
    phase1 = (
        Local("acc", "f32", kir.f32(0.0)),
        For("e", gtid, i32(n), i32(grid * block), (
            Assign("acc", Binary("add", Ref("acc", "f32"), Load(x, Ref("e", "i32")))),)),
        WarpReduce("wsum", Ref("acc", "f32"), "add"),
        If(Compare("eq", Binary("rem", tid, i32(32)), i32(0)), (
            Store("partials", Binary("add", Binary("mul", kir.BlockIdx(), i32(warps)),
                                     Binary("div", tid, i32(32))), Ref("wsum", "f32")),)),
    )
    phase2 = (
        Local("total", "f32", kir.f32(0.0)),
        For("p", i32(0), i32(grid * warps), i32(1), (
            Assign("total", Binary("add", Ref("total", "f32"),
                                   Load(partials, Ref("p", "i32")))),)),
        For("e", Binary("add", Binary("mul", kir.BlockIdx(), i32(block)), tid), i32(n),
            i32(grid * block), (
                Store("out", Ref("e", "i32"),
                      Binary("div", Load(x, Ref("e", "i32")), Ref("total", "f32"))),)),
    )
    return Kernel("normalize", (x, out), (), grid, block, (*phase1, GridBarrier(), *phase2),
                  (partials,))


def two_barrier_kernel(n: int, grid: int, block: int) -> Kernel:
    """Three phases: block b writes its index into scratch; after a grid barrier every
    block reads the neighbour's slot (another block's write) into a second scratch; after a
    second barrier every thread writes the sum of all of them — wrong unless both barriers
    hold across blocks."""
    out = Param("out", "i32", n, is_output=True)
    a = GlobalScratch("a", "i32", grid)
    c = GlobalScratch("c", "i32", grid)
    tid = ThreadIdx()
    first = Compare("eq", tid, i32(0))
    b = kir.BlockIdx()
    phase1 = (If(first, (Store("a", b, Binary("add", Binary("mul", b, i32(3)), i32(1))),)),)
    phase2 = (If(first, (Store("c", b, Load(a, Binary("rem", Binary("add", b, i32(1)),
                                                          i32(grid)))),)),)
    phase3 = (
        Local("s", "i32", i32(0)),
        For("p", i32(0), i32(grid), i32(1), (
            Assign("s", Binary("add", Ref("s", "i32"), Load(c, Ref("p", "i32")))),)),
        For("e", Binary("add", Binary("mul", b, i32(block)), tid), i32(n), i32(grid * block),
            (Store("out", Ref("e", "i32"), Binary("add", Ref("s", "i32"), Ref("e", "i32"))),)),
    )
    return Kernel("two_barriers", (out,), (), grid, block,
                  (*phase1, GridBarrier(), *phase2, GridBarrier(), *phase3), (a, c))


def test_grid_barrier_on_host_with_phases_and_blocks():
    rng = np.random.default_rng()
    n, grid, block = 5000, 7, 64
    x = rng.random(n, dtype=np.float32) + 0.5
    out = np.full(n, np.nan, np.float32)
    host = compile_host(normalize_kernel(n, grid, block).validate())
    host(x, out, threads=4)          # asks for 4 workers: the grid still runs as one
    np.testing.assert_allclose(out, x / x.astype(np.float64).sum(), rtol=1e-5)


def test_two_grid_barriers_on_host():
    n, grid, block = 1000, 5, 32
    out = np.full(n, -7, np.int32)
    compile_host(two_barrier_kernel(n, grid, block))(out)
    total = sum(3 * ((b + 1) % grid) + 1 for b in range(grid))
    np.testing.assert_array_equal(out, total + np.arange(n))


def test_grid_barrier_validation():
    k = normalize_kernel(256, 2, 32)
    text = format_kernel(k)
    assert "grid_sync()" in text and "global scratch" in text
    # Nested in control flow: refused.
    nested = Kernel("nested", k.params, (), 2, 32,
                    (If(Compare("eq", kir.BlockIdx(), i32(0)), (GridBarrier(),)),), k.scratch)
    with pytest.raises(CodegenError, match="top-level"):
        nested.validate()
    # A variable defined before a grid barrier is not visible after it.
    crossing = Kernel("crossing", k.params, (), 2, 32,
                      (Let("v", kir.f32(1.0)), GridBarrier(),
                       Store("out", i32(0), Ref("v", "f32"))), k.scratch)
    with pytest.raises(CodegenError, match="undefined variable 'v'"):
        crossing.validate()
    with pytest.raises(CodegenError, match="value dtype"):
        Kernel("bad", k.params, (), 2, 32, (), (GlobalScratch("s", "f16", 4),)).validate()


@pytest.mark.parametrize("arch", ["sm_70", "sm_80", "sm_90"])
def test_grid_barrier_ptx_assembles_without_spills(arch):
    from stitch.codegen.nvptx import default_libdevice_path, emit_ptx
    if default_libdevice_path() is None:
        pytest.skip("no libdevice")
    from tests.test_kir_nvptx import assemble
    for kernel in (normalize_kernel(4096, 8, 128), two_barrier_kernel(512, 4, 64)):
        ptx = emit_ptx(kernel, arch)
        # The arrival counter's atomic add, the spin on the generation, the gpu fence.
        assert "atom" in ptx and ("fence" in ptx or "membar" in ptx), ptx
        assert f"{kernel.name}__grid_sync" in ptx
        info = assemble(ptx, arch)
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0


# ---------------------------------------------------------------- stitched kernels

from stitch.codegen.lower import lower_kernel, reference_values, run_on_host  # noqa: E402
from stitch.codegen.values import leaf  # noqa: E402
from stitch.hlo import parse_hlo  # noqa: E402
from stitch.hlo.evaluator.dtypes import numpy_dtype  # noqa: E402
from stitch.hlo.evaluator.interpreter import Evaluator  # noqa: E402
from stitch.hlo.graph import build_op_graphs  # noqa: E402
from stitch.cost.gpu_specs import get_spec  # noqa: E402
from stitch.analysis.feasibility import analyze_pattern, infeasible_reason  # noqa: E402
from stitch.schedule import ScheduleError, schedule_kernel  # noqa: E402

HEAD = """HloModule m
add { a = f32[] parameter(0)  b = f32[] parameter(1)  ROOT s = f32[] add(a, b) }
max { a = f32[] parameter(0)  b = f32[] parameter(1)  ROOT s = f32[] maximum(a, b) }
ENTRY e {
"""


def _graph(body: str):
    module = parse_hlo(HEAD + body + "\n}\n")
    graph = build_op_graphs(module)[0]
    members = [n.id for n in graph.nodes if n.op_class.name != "SOURCE"
               and n.opcode != "constant" or (n.opcode == "constant" and n.users)]
    members = [v for v in members if graph.nodes[v].op_class.name != "SOURCE"]
    return module, graph, members


def _random_inputs(graph, lowered, rng):
    out = {}
    for v in lowered.inputs:
        shape = leaf(graph.nodes[v].shape)
        dtype = numpy_dtype(shape.element_type)
        if dtype.kind == "f":
            out[v] = rng.standard_normal(shape.dims).astype(dtype)
        else:
            out[v] = rng.integers(0, shape.dims[-1] if shape.dims else 4, shape.dims
                                  ).astype(dtype)
    return out


def _run_global(module, graph, members, target="h100", inputs=None, tol=1e-4, rng=None):
    rng = rng or np.random.default_rng()
    schedule = schedule_kernel(graph, members, get_spec(target), force={"scope": "global"})
    part = schedule.parts[0]
    assert part.kind == "global" and schedule.grid <= part.scope.resident_blocks
    lowered = lower_kernel(graph, Evaluator(module), schedule, "global_k")
    assert kir.has_grid_barrier(lowered.kernel)
    inputs = inputs if inputs is not None else _random_inputs(graph, lowered, rng)
    want = reference_values(graph, Evaluator(module), sorted(members), inputs)
    got = run_on_host(lowered, graph, inputs, poison=True, opt=0)
    for v, value in got.items():
        ref = np.asarray(want[v], np.float64)
        val = value.astype(np.float64)
        assert not np.isnan(val).any(), graph.nodes[v].name
        err = np.linalg.norm(val - ref) / max(np.linalg.norm(ref), 1e-30)
        assert err <= tol, f"{graph.nodes[v].name}: relative error {err:.2e}"
    return schedule, lowered


NORMALIZE = """
  x = f32[300,257] parameter(0)
  z = f32[] constant(0)
  s = f32[] reduce(x, z), dimensions={0,1}, to_apply=add
  sb = f32[300,257] broadcast(s), dimensions={}
  ROOT y = f32[300,257] divide(x, sb)"""


def test_x_over_sum_x_is_one_persistent_kernel_matching_the_evaluator():
    module, graph, members = _graph(NORMALIZE)
    # The block scopes refuse it (one block would own all 77k elements) ...
    assert "every block" in infeasible_reason(graph, members)
    # ... the global scope takes it.
    analysis = analyze_pattern(graph, members, allow_global=True)
    assert analysis.scope == "global" and analysis.global_phases.phases == 2
    schedule, lowered = _run_global(module, graph, members)
    assert schedule.grid > 1 and len(kir.grid_phases(lowered.kernel.body)) == 2


LOSS = """
  x = f32[64,1000] parameter(0)
  lab = s32[64] parameter(1)
  ninf = f32[] constant(-inf)
  mx = f32[64] reduce(x, ninf), dimensions={1}, to_apply=max
  mxb = f32[64,1000] broadcast(mx), dimensions={0}
  sh = f32[64,1000] subtract(x, mxb)
  ex = f32[64,1000] exponential(sh)
  z = f32[] constant(0)
  se = f32[64] reduce(ex, z), dimensions={1}, to_apply=add
  lse = f32[64] log(se)
  lseb = f32[64,1000] broadcast(lse), dimensions={0}
  ls = f32[64,1000] subtract(sh, lseb)
  io = s32[64,1] iota(), iota_dimension=0
  labr = s32[64,1] reshape(lab)
  idx = s32[64,2] concatenate(io, labr), dimensions={1}
  g = f32[64] gather(ls, idx), offset_dims={}, collapsed_slice_dims={0,1},
    start_index_map={0,1}, index_vector_dim=1, slice_sizes={1,1}
  tot = f32[] reduce(g, z), dimensions={0}, to_apply=add
  n = f32[] constant(-0.015625)
  loss = f32[] multiply(tot, n)
  ROOT t = (f32[], f32[64,1000]) tuple(loss, ls)"""


def test_loss_gathering_full_log_softmax_rows_runs_in_one_kernel():
    module, graph, members = _graph(LOSS)
    members = [v for v in members if graph.nodes[v].opcode != "tuple"]
    # The mean over rows needs every block's rows: the block scopes refuse it.
    assert "every block" in (infeasible_reason(graph, members) or "")
    analysis = analyze_pattern(graph, members, allow_global=True)
    assert analysis.scope == "global" and analysis.global_phases.phases == 4
    schedule, lowered = _run_global(module, graph, members)
    assert len(kir.grid_phases(lowered.kernel.body)) >= 4


def _column_stats(rows: int, cols: int) -> str:
    """The zoo's column_reduce_broadcast (batch-norm statistics): two column reductions,
    each consumed by a broadcast along the rows."""
    return f"""
  x = f32[{rows},{cols}] parameter(0)
  scale = f32[{cols}] parameter(1)
  z = f32[] constant(0)
  s1 = f32[{cols}] reduce(x, z), dimensions={{0}}, to_apply=add
  inv = f32[{cols}] broadcast(f32[] constant({1.0 / rows})), dimensions={{}}
  mean = f32[{cols}] multiply(s1, inv)
  mb = f32[{rows},{cols}] broadcast(mean), dimensions={{1}}
  c = f32[{rows},{cols}] subtract(x, mb)
  sq = f32[{rows},{cols}] multiply(c, c)
  s2 = f32[{cols}] reduce(sq, z), dimensions={{0}}, to_apply=add
  var = f32[{cols}] multiply(s2, inv)
  eps = f32[{cols}] broadcast(f32[] constant(1e-5)), dimensions={{}}
  ve = f32[{cols}] add(var, eps)
  r = f32[{cols}] rsqrt(ve)
  rb = f32[{rows},{cols}] broadcast(r), dimensions={{1}}
  n = f32[{rows},{cols}] multiply(c, rb)
  sb = f32[{rows},{cols}] broadcast(scale), dimensions={{1}}
  ROOT y = f32[{rows},{cols}] multiply(n, sb)"""


@pytest.mark.parametrize("rows,cols,target", [(2048, 96, "h100"), (777, 40, "v100"),
                                              (4096, 768, "a100")])
def test_row_split_column_reductions_match_the_evaluator(rows, cols, target):
    module, graph, members = _graph(_column_stats(rows, cols))
    schedule, lowered = _run_global(module, graph, members, target)
    scope = schedule.parts[0].scope
    # Each column reduction is split across blocks (more blocks than 32-column tiles).
    assert all(not r.minor and r.splits > 1 for r in scope.reductions), scope.reductions
    assert schedule.grid > math.ceil(cols / 32)
    assert scope.stages == 2


def test_zoo_column_reduce_broadcast_runs_globally_and_the_tuner_prefers_it():
    from tests.fixtures import DATA
    module = parse_hlo((DATA / "column_reduce_broadcast" / "tiny.gpu-h100.hlo").read_text())
    graph = build_op_graphs(module)[0]
    members = [n.id for n in graph.nodes if n.op_class.name != "SOURCE"]
    _run_global(module, graph, members)
    # On the full-size graph the latency-evaluator picks the global scope for the whole
    # batch-norm (it uses every SM; column tiling ran on 24 of 132).
    full = parse_hlo((DATA / "column_reduce_broadcast" / "full.gpu-h100.hlo").read_text())
    fgraph = build_op_graphs(full)[0]
    fmembers = [n.id for n in fgraph.nodes if n.op_class.name != "SOURCE"]
    best = schedule_kernel(fgraph, fmembers, get_spec("h100"))
    assert best.parts[0].kind == "global" and best.grid >= 132


@pytest.mark.parametrize("arch", ["sm_70", "sm_80", "sm_90"])
def test_global_kernels_ptx_assembles_without_spills(arch):
    from stitch.codegen.nvptx import default_libdevice_path, emit_ptx
    if default_libdevice_path() is None:
        pytest.skip("no libdevice")
    from tests.test_kir_nvptx import assemble
    target = {"sm_70": "v100", "sm_80": "a100", "sm_90": "h100"}[arch]
    for body in (NORMALIZE, LOSS, _column_stats(4096, 768)):
        module, graph, members = _graph(body)
        members = [v for v in members if graph.nodes[v].opcode != "tuple"]
        schedule = schedule_kernel(graph, members, get_spec(target), force={"scope": "global"})
        lowered = lower_kernel(graph, Evaluator(module), schedule, "global_k")
        ptx = emit_ptx(lowered.kernel, arch)
        assert "__grid_sync" in ptx
        info = assemble(ptx, arch)
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0, info
        # The residency the schedule relied on holds with ptxas's real register count.
        from stitch.cost.occupancy import occupancy
        occ = occupancy(get_spec(target), schedule.block, info["registers"],
                        schedule.smem_bytes)
        assert schedule.grid <= occ.blocks_per_sm * get_spec(target).sm_count, (
            info, schedule.grid)


@pytest.mark.parametrize("threads", [1, 3])
def test_ffi_host_handler_runs_the_whole_grid_in_one_worker(threads):
    from stitch.codegen import ffi
    from tests.test_ffi import FakeXla
    kernel = normalize_kernel(3000, 6, 64)
    target = ffi.host_ffi_target(kernel, threads=threads)
    x = np.random.default_rng().random(3000, dtype=np.float32) + 0.5
    out = np.full(3000, np.nan, np.float32)
    assert FakeXla().call(target.address, [x], [out]) is None
    np.testing.assert_allclose(out, x / x.astype(np.float64).sum(), rtol=1e-5)


def test_cuda_handler_launches_grid_barrier_kernels_cooperatively():
    """A grid barrier needs every block resident: the handler makes a cooperative launch
    (the driver's guarantee) for such a kernel and a plain launch for any other."""
    from stitch.codegen import ffi_cuda
    from tests.test_ffi import FakeDriver, FakeXla
    from tests.test_kir_host import elementwise_kernel, mul
    driver = FakeDriver(current=0x10)
    loaded = [ffi_cuda.LoadedFunction(0, 0x10, 0x20, 0x30)]
    kernel = normalize_kernel(3000, 6, 64)
    _, engine, address = ffi_cuda.build_cuda_handler(kernel, "coop_test",
                                                     loaded, driver.symbols)
    driver.n_params = len(kernel.params)
    x, out = np.ones(3000, np.float32), np.full(3000, np.nan, np.float32)
    assert FakeXla(stream=0x5EA).call(address, [x], [out]) is None
    (launch,) = driver.launches
    assert launch["cooperative"] and launch["grid"] == (6, 1, 1) and launch["stream"] == 0x5EA
    assert launch["params"] == [x.ctypes.data, out.ctypes.data]
    plain = elementwise_kernel("plain", ["f32"], "f32", 100, lambda a: mul(a, a))
    _, engine2, address = ffi_cuda.build_cuda_handler(plain, "plain_test",
                                                      loaded, driver.symbols)
    driver.n_params = len(plain.params)
    a = np.ones(100, np.float32)
    assert FakeXla().call(address, [a], [a.copy()]) is None
    assert not driver.launches[-1]["cooperative"]
    del engine, engine2


def test_cuda_handler_relaunches_a_relaunch_kernel_once_per_phase():
    """grid_sync="relaunch": plain launches, one per phase, in order on the call's stream; a
    failed launch stops the sequence and names which launch failed."""
    import dataclasses

    from stitch.codegen import ffi_cuda
    from tests.test_ffi import FakeDriver, FakeXla
    driver = FakeDriver(current=0x10)
    loaded = [ffi_cuda.LoadedFunction(0, 0x10, 0x20, 0x30)]
    kernel = dataclasses.replace(two_barrier_kernel(512, 4, 64), grid_sync="relaunch")
    assert kir.launches(kernel) == 3
    _, engine, address = ffi_cuda.build_cuda_handler(kernel, "relaunch_test",
                                                     loaded, driver.symbols)
    driver.n_params = len(kernel.params)
    from stitch.codegen.host import NUMPY_DTYPES
    arrays = [np.ones(p.size, NUMPY_DTYPES[p.dtype]) for p in kernel.params]
    inputs = [a for a, p in zip(arrays, kernel.params) if not p.is_output]
    outputs = [a for a, p in zip(arrays, kernel.params) if p.is_output]
    assert FakeXla(stream=0x5EA).call(address, inputs, outputs) is None
    assert [(l["cooperative"], l["grid"], l["stream"]) for l in driver.launches] == \
        [(False, (4, 1, 1), 0x5EA)] * 3
    driver.launch_result = 701
    xla = FakeXla()
    assert xla.call(address, inputs, outputs) is not None
    assert "launch 1 of 3" in xla.errors[0][0] and len(driver.launches) == 4
    # The device's phase counter is now unknown: later calls fail without launching.
    driver.launch_result = 0
    xla = FakeXla()
    assert xla.call(address, inputs, outputs) is not None
    assert "phase counter is unknown" in xla.errors[0][0] and len(driver.launches) == 4
    del engine


@pytest.mark.parametrize("arch", ["sm_70", "sm_80", "sm_90"])
def test_relaunch_ptx_runs_one_phase_per_launch_without_waiting(arch):
    """The relaunch form's PTX: no register cap and no spin (no block waits on another), the
    phase counter advanced by the last block to arrive; assembles without spills."""
    import dataclasses

    from stitch.codegen.nvptx import default_libdevice_path, emit_ptx
    if default_libdevice_path() is None:
        pytest.skip("no libdevice")
    from tests.test_kir_nvptx import assemble
    for kernel in (normalize_kernel(4096, 8, 128), two_barrier_kernel(512, 4, 64)):
        relaunch = dataclasses.replace(kernel, grid_sync="relaunch")
        ptx = emit_ptx(relaunch, arch)
        assert ".maxnreg" not in ptx
        # The phase (generation) is read once, at the start: no spin re-reads it; the last
        # block stores the next phase (the persistent form bumps it with an atomic add).
        generation = f"[{kernel.name}__grid_sync+4]"
        reads = [l for l in ptx.splitlines() if l.strip().startswith("ld.") and generation in l]
        stores = [l for l in ptx.splitlines() if l.strip().startswith("st.") and generation in l]
        assert len(reads) == 1 and len(stores) == 1, (reads, stores)
        persistent = emit_ptx(kernel, arch)
        barriers = len(kir.grid_phases(kernel.body)) - 1     # a read and a spin read each
        assert len([l for l in persistent.splitlines()
                    if l.strip().startswith("ld.") and generation in l]) == 2 * barriers
        info = assemble(ptx, arch)
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0
    with pytest.raises(CodegenError, match="grid_sync"):
        dataclasses.replace(normalize_kernel(64, 2, 32), grid_sync="sometimes").validate()


def test_grid_barrier_kernels_are_capped_at_the_registers_the_grid_was_sized_for():
    from stitch.codegen.nvptx import GRID_BARRIER_MAX_REGISTERS, default_libdevice_path, emit_ptx
    from stitch.schedule.global_scope import GLOBAL_REGISTERS
    assert GRID_BARRIER_MAX_REGISTERS == GLOBAL_REGISTERS
    if default_libdevice_path() is None:
        pytest.skip("no libdevice")
    assert f".maxnreg {GLOBAL_REGISTERS}" in emit_ptx(normalize_kernel(4096, 8, 128), "sm_90")
    from tests.test_kir_host import elementwise_kernel, mul
    plain = elementwise_kernel("plain", ["f32"], "f32", 100, lambda a: mul(a, a))
    assert ".maxnreg" not in emit_ptx(plain, "sm_90")


def test_rows_and_columns_of_one_tensor_in_one_kernel():
    """Two reductions partitioning the same tensor differently (rows and columns): no
    block scope holds both, the global scope reduces both in one phase."""
    module, graph, members = _graph("""
  x = f32[300,70] parameter(0)
  zero = f32[] constant(0)
  e = f32[300,70] exponential(x)
  rows = f32[300] reduce(e, zero), dimensions={1}, to_apply=add
  cols = f32[70] reduce(e, zero), dimensions={0}, to_apply=add
  rb = f32[300,70] broadcast(rows), dimensions={0}
  cb = f32[300,70] broadcast(cols), dimensions={1}
  y1 = f32[300,70] divide(e, rb)
  y2 = f32[300,70] divide(e, cb)
  ROOT out = (f32[300,70], f32[300,70]) tuple(y1, y2)""")
    members = [v for v in members if graph.nodes[v].opcode != "tuple"]
    assert "different block partitions" in infeasible_reason(graph, members)
    schedule, _ = _run_global(module, graph, members, "v100")
    assert {r.minor for r in schedule.parts[0].scope.reductions} == {True, False}


def test_bf16_reduction_results_are_rounded_like_xla():
    body = NORMALIZE.replace("f32[300,257]", "bf16[300,257]").replace(
        "s = f32[] reduce", "s = bf16[] reduce").replace("z = f32[] constant(0)",
                                                         "z = bf16[] constant(0)")
    head = HEAD.replace("ENTRY e {", """addb { a = bf16[] parameter(0)  b = bf16[] parameter(1)
  ROOT s = bf16[] add(a, b) }
ENTRY e {""")
    module = parse_hlo(head + body.replace("to_apply=add", "to_apply=addb") + "\n}\n")
    graph = build_op_graphs(module)[0]
    members = [n.id for n in graph.nodes if n.op_class.name != "SOURCE"]
    rng = np.random.default_rng()
    x = (rng.random((300, 257)) + 0.5).astype(numpy_dtype("bf16"))
    _run_global(module, graph, members, inputs={graph.node("x").id: x}, tol=2e-2)


def test_compile_plans_and_runs_the_global_kernel_end_to_end():
    import stitch.hlo
    from stitch import compiler
    module = parse_hlo(HEAD + NORMALIZE + "\n}\n")
    exe = compiler.compile(module, "h100", cache=False, poison_outputs=True)
    assert not exe.fallbacks and not exe.plan_notes
    kernels = [k for g in exe.plan.graphs for k in g.stitched.kernels if k.schedule]
    assert len(kernels) == 1 and "global" in kernels[0].schemes
    x = np.random.default_rng().standard_normal((300, 257)).astype(np.float32)
    got, = exe(x)
    want, = stitch.hlo.evaluate(module, [x])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_root_column_reduction_is_stored_by_its_combine_step():
    module, graph, members = _graph("""
  x = f32[3000,80] parameter(0)
  z = f32[] constant(0)
  ROOT s = f32[80] reduce(x, z), dimensions={0}, to_apply=add""")
    schedule, lowered = _run_global(module, graph, members, "a100")
    (r,) = schedule.parts[0].scope.reductions
    assert r.combine and r.splits > 1
    # Partials, a barrier, the combine writing the output: no phase after it.
    assert len(kir.grid_phases(lowered.kernel.body)) == 2
    assert schedule.parts[0].scope.barriers == 1


def test_a_value_two_units_write_is_read_from_the_first():
    """Regression (seen when the global scope changed bert_layer_train's plan): a
    broadcast recomputed and written by two kernels was keyed by the later one, so a kernel
    between them that reads it seemed to wait for a kernel that waits for it."""
    from stitch.hlo.graph_exec import GraphRunner, Unit
    module = parse_hlo("""HloModule m
ENTRY e {
  x = f32[4] parameter(0)
  k = f32[] constant(2)
  bc = f32[4] broadcast(k), dimensions={}
  a1 = f32[4] multiply(x, bc)
  m1 = f32[4] add(a1, bc)
  b1 = f32[4] multiply(m1, bc)
  ROOT t = (f32[4], f32[4]) tuple(m1, b1)
}
""")
    graph = build_op_graphs(module)[0]
    n = {name: graph.node(name).id for name in ("x", "k", "bc", "a1", "m1", "b1")}
    units = [Unit(frozenset({n["k"], n["bc"], n["a1"]}), (n["x"],), (n["bc"], n["a1"]),
                  lambda v: [np.full(4, 2.0, np.float32), v[0] * 2], "first"),
             Unit(frozenset({n["m1"]}), (n["a1"], n["bc"]), (n["m1"],),
                  lambda v: [v[0] + v[1]], "middle"),
             Unit(frozenset({n["k"], n["bc"], n["b1"]}), (n["m1"],), (n["bc"], n["b1"]),
                  lambda v: [np.full(4, 2.0, np.float32), v[0] * 2], "last")]
    x = np.random.default_rng().standard_normal(4).astype(np.float32)
    m1, b1 = GraphRunner(module, [graph], units={0: units}).run([x])
    np.testing.assert_allclose(m1, x * 2 + 2, rtol=1e-6)
    np.testing.assert_allclose(b1, (x * 2 + 2) * 2, rtol=1e-6)


def test_stitch_jit_runs_a_global_kernel_inside_xla_cpu():
    """Through the XLA pass: x / sum(x) becomes one custom call whose host program has a
    grid barrier (the FFI handler runs the whole grid in one worker)."""
    jnp = pytest.importorskip("jax.numpy")
    import stitch

    def f(x):
        return x / jnp.sum(x)
    stitched = stitch.jit(f, target="h100", async_compile=False, guard=False)
    x = np.random.default_rng().standard_normal((300, 257)).astype(np.float32)
    stitched(x)
    assert stitched.wait()
    y = np.asarray(stitched(x))
    stats = stitched.stats
    assert stats.stitched_calls == 2 and stats.kernels_after == 1, stats
    report = stitched.programs()[0]
    assert any("global" in k.schemes for g in report.plan.graphs
               for k in g.stitched.kernels if k.schedule)
    np.testing.assert_allclose(y, x / x.astype(np.float64).sum(), rtol=1e-4, atol=1e-6)


def test_out_of_bounds_scratch_access_is_named():
    out = Param("out", "f32", 64, is_output=True)
    scratch = GlobalScratch("parts", "f32", 4)
    kernel = Kernel("oob_scratch", (out,), (), 2, 32,
                    (Store("parts", Binary("add", kir.BlockIdx(), i32(3)), kir.f32(1.0)),
                     GridBarrier(),
                     Store("out", ThreadIdx(), Load(scratch, i32(0)))), (scratch,))
    with pytest.raises(CodegenError, match=r"parts\[4\]"):
        compile_host(kernel)(np.zeros(64, np.float32))
    from stitch.codegen import ffi
    from tests.test_ffi import FakeXla
    target = ffi.host_ffi_target(kernel, threads=2)
    xla = FakeXla()
    assert xla.call(target.address, [], [np.zeros(64, np.float32)]) is not None
    (text, _, _), = xla.errors
    assert "out-of-bounds access parts[4] (size 4) in block 1" in text


def test_launch_form_follows_the_modeled_times():
    """launch_form picks the relaunch form exactly where the chain of launches is modeled
    faster than the persistent kernel; a block-scope schedule is refused."""
    import dataclasses

    from stitch.schedule.global_scope import launch_form
    seen = set()
    for body in (NORMALIZE, LOSS, _column_stats(4096, 768), _column_stats(777, 40)):
        module, graph, members = _graph(body)
        members = [v for v in members if graph.nodes[v].opcode != "tuple"]
        for target in ("v100", "a100", "h100"):
            try:
                schedule = schedule_kernel(graph, members, get_spec(target),
                                           force={"scope": "global"})
            except ScheduleError:       # no global schedule launches for this one
                continue
            scope = schedule.parts[0].scope
            want = "relaunch" if scope.chain_us < schedule.modeled_us else "barrier"
            assert launch_form(schedule) == want
            seen.add(want)
            # Slower launches make the chain lose; free ones make it win.
            slow = dataclasses.replace(scope, chain_us=schedule.modeled_us * 2)
            fast = dataclasses.replace(scope, chain_us=schedule.modeled_us / 2)
            for s_, form in ((slow, "barrier"), (fast, "relaunch")):
                part = dataclasses.replace(schedule.parts[0], scope=s_)
                assert launch_form(dataclasses.replace(schedule, parts=[part])) == form
    assert seen, "no global schedule built"
    module, graph, members = _graph(_column_stats(4096, 768))   # block-stitchable too
    members = [v for v in members if graph.nodes[v].opcode != "tuple"]
    block = schedule_kernel(graph, members, get_spec("h100"), force={"scope": "block"})
    with pytest.raises(ValueError):
        launch_form(block)
