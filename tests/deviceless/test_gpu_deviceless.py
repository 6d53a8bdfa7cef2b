"""stitch's pass inside a real XLA GPU compile for an H100, on a machine without a GPU.

A jitted training step (dense layer, hand-written layer norm, MSE, SGD under
value_and_grad) is compiled by jax's CUDA plugin for a deviceless H100 topology with stitch's
pass registered through the plugin's XlaTransform extension. Checked: XLA's final GPU HLO
holds stitch's typed-FFI custom calls exactly where the pass report placed kernels (operands
and results matching each kernel's parameters), XLA compiled everything else into its own
fusions, and the PTX of every placed kernel was assembled by ptxas for sm_90. Nothing runs:
there is no device (the compile-only handlers would refuse to).

Skipped unless the CUDA plugin is installed and GPUs are hidden: scripts/deviceless_check.sh.
"""
from __future__ import annotations

import ctypes
import os
import struct
import subprocess
import sys

import pytest

from stitch.codegen.objcheck import cubin_problem
from stitch.hlo import parse_hlo
from stitch.hlo.graph import FREE_OPCODES
from stitch.xla_pass import deviceless

from .conftest import ARCH, TARGET

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from jax._src.lib import version as jaxlib_version  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BATCH, DIN, DOUT = 256, 512, 512
# What may stand unfused between XLA GPU's kernels in a computation that is not a fusion:
# no arithmetic, no reductions, no data movement XLA would have to emit a kernel for.
BETWEEN_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                   "fusion", "custom-call", "all-reduce-start", "all-reduce-done",
                   "copy-start", "copy-done"}


# ---------------------------------------------------------------- the training step


def layer_norm(x, gain, bias, eps=1e-5):
    """Hand-written: XLA sees the reductions and elementwise ops, not a library call."""
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * gain + bias


def loss_fn(params, x, y):
    h = layer_norm(jnp.tanh(x @ params["w"] + params["b"]), params["gain"], params["bias"])
    return jnp.mean((h.astype(jnp.float32) - y.astype(jnp.float32)) ** 2)


def train_step(params, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    new = jax.tree.map(lambda p, g: (p - 0.1 * g).astype(p.dtype), params, grads)
    return new, loss


def lower_step(mesh, dtype, batch_axis: str | None = None, donate: bool = False):
    """``train_step`` lowered for ``mesh``'s devices: parameters replicated, the batch split
    over ``batch_axis`` when given (data parallel); ``donate``: the parameters donated."""
    replicated = NamedSharding(mesh, P())
    batch = NamedSharding(mesh, P(batch_axis)) if batch_axis else replicated

    def spec(*shape, sharding=replicated):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    params = {"w": spec(DIN, DOUT), "b": spec(DOUT), "gain": spec(DOUT), "bias": spec(DOUT)}
    step = jax.jit(train_step, donate_argnums=(0,) if donate else ())
    return step.lower(params, spec(BATCH, DIN, sharding=batch), spec(BATCH, DOUT, sharding=batch))


# ---------------------------------------------------------------- reading XLA's HLO


def kernel_launches(comp) -> list:
    """Instructions of a non-fusion computation that launch work on the device (XLA's
    kernels, stitch's, collectives: what the pass report counts)."""
    return [i for i in comp.instructions
            if i.opcode not in FREE_OPCODES and i.opcode not in ("parameter", "constant")]


def top_level(module) -> list:
    """The computations XLA runs instruction by instruction (not fusion bodies, reducers)."""
    called = {c for _, i in module.instructions() if i.opcode == "fusion"
              for c in i.called_computations}
    applied = {c for _, i in module.instructions() if i.opcode not in ("while", "conditional",
                                                                       "call")
               for c in i.called_computations}
    return [c for c in module.computations if c.name not in called | applied]


def stitch_calls(module) -> dict[str, object]:
    """custom_call_target -> the custom-call instruction, for stitch's targets."""
    calls = {}
    for _, inst in module.instructions():
        if inst.opcode == "custom-call":
            target = inst.string("custom_call_target")
            if target.startswith("stitch_"):
                assert target not in calls, f"{target} placed twice"
                calls[target] = inst
    return calls


def cubin_sm(cubin: bytes) -> int:
    """The SM version a CUDA ELF was built for (e_flags: bits 8-15 in the ABI ptxas 12.8+
    writes, EI_OSABI 0x41; the low byte before)."""
    (flags,) = struct.unpack_from("<I", cubin, 48)
    return (flags >> 8) & 0xFF if cubin[7] == 0x41 else flags & 0xFF


def check_placement(result: deviceless.DevicelessCompile, xla_left: bool = True) -> None:
    """stitch's custom calls are exactly the report's kernels, wired to their parameters,
    and XLA compiled the rest (``xla_left``: there is a rest)."""
    report = result.report
    final = parse_hlo(result.text)
    calls = stitch_calls(final)
    built = {k.target.name: k for k in report.kernels}
    assert report.kernels_stitched == len(report.placed) == len(built) >= 1, report.summary()
    assert set(calls) == set(built), (sorted(calls), sorted(built))
    for target, inst in calls.items():
        kernel = built[target]
        assert inst.attrs.get("api_version") == "API_VERSION_TYPED_FFI"
        assert kernel.name in inst.name, (inst.name, kernel.name)
        comp = next(c for c, i in final.instructions() if i is inst)
        table = comp.by_name()
        params = kernel.lowered.kernel.params
        inputs = [p for p in params if not p.is_output]
        outputs = [p for p in params if p.is_output]
        assert len(inst.operands) == len(inputs), inst.name
        operands = [table[o].shape for o in inst.operands]
        leaves = list(inst.shape.tuple_shapes) if inst.shape.is_tuple else [inst.shape]
        assert len(leaves) == len(outputs), inst.name
        for shape, param in zip(operands + leaves, inputs + outputs):
            assert shape.num_elements == param.size, (inst.name, str(shape), param)
            if shape.element_type in ("f32", "bf16", "f16"):
                assert shape.element_type == param.dtype, (inst.name, str(shape), param)
    for comp in top_level(final):
        stray = {i.opcode for i in comp.instructions} - BETWEEN_KERNELS
        assert not stray, f"{comp.name}: XLA left {sorted(stray)} outside its kernels"
    if xla_left:
        assert any(i.opcode == "fusion" for _, i in final.instructions()), "no XLA fusion left"
    assert len(kernel_launches(final.entry)) == report.kernels_after, report.summary()


def check_assembled(result: deviceless.DevicelessCompile) -> None:
    from stitch.codegen.ffi_cuda import CompileOnlyCudaTarget
    for kernel in result.report.kernels:
        target = kernel.target
        assert isinstance(target, CompileOnlyCudaTarget), type(target)
        assert target.arch == ARCH
        assert f".target {ARCH}" in target.ptx and f".entry {kernel.lowered.kernel.name}(" \
            in target.ptx
        assert cubin_problem(target.cubin) is None
        assert cubin_sm(target.cubin) == int(ARCH[3:]), hex(struct.unpack_from(
            "<I", target.cubin, 48)[0])
        report = target.ptxas[kernel.lowered.kernel.name]
        assert report.arch == ARCH and report.registers > 0, report


# ---------------------------------------------------------------- tests


def test_the_plugin_has_the_xla_transform_extension(deviceless_ready):
    ext = deviceless.find_xla_transform_extension()
    assert ext.base.type == deviceless.XLA_TRANSFORM_EXTENSION_TYPE
    assert ext.base.struct_size >= 32
    assert ctypes.cast(ext.register_xla_transform, ctypes.c_void_p).value
    # Registered once per process (conftest did it).
    assert deviceless.register_transform(lambda b: None, "stitch", "post_scheduler") is False


@pytest.fixture(scope="module", params=["f32", "bf16"])
def stitched_step(request, h100_mesh):
    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}[request.param]
    lowered = lower_step(h100_mesh, dtype)
    stock = lowered.compile().as_text()
    return stock, deviceless.compile_with_pass(lowered, "train_step", TARGET)


def test_stock_compile_is_untouched_and_is_the_baseline(stitched_step):
    stock, result = stitched_step
    assert "stitch_" not in stock and "stitch.request" not in stock
    assert len(kernel_launches(parse_hlo(stock).entry)) == result.report.kernels_xla


def test_training_step_holds_stitch_calls_where_the_plan_placed_them(stitched_step):
    _, result = stitched_step
    report = result.report
    assert not report.fallbacks, report.fallbacks
    assert report.kernels_after < report.kernels_xla, report.summary()
    check_placement(result)


def test_every_placed_kernel_is_assembled_for_sm90(stitched_step):
    check_assembled(stitched_step[1])


@pytest.mark.xfail(tuple(jaxlib_version) < (0, 11), strict=True,
                   reason="jaxlib 0.10.2's transformation hook drops input_output_alias from "
                          "every module handed back")
def test_donated_parameters_stay_aliased_through_the_pass(h100_mesh):
    """The stitched module keeps XLA's input/output aliasing: the parameters are updated in
    place as in the stock compile (jaxlib 0.11's hook keeps the module's aliasing; 0.10.2's
    dropped it from every module handed back)."""
    stock = lower_step(h100_mesh, jnp.float32, donate=True).compile()
    result = deviceless.compile_with_pass(lower_step(h100_mesh, jnp.float32, donate=True),
                                          "train_step", TARGET)
    assert result.report.kernels_stitched >= 1, result.report.summary()
    aliased = stock.memory_analysis().alias_size_in_bytes
    assert aliased >= (DIN * DOUT + 3 * DOUT) * 4
    assert result.compiled.memory_analysis().alias_size_in_bytes == aliased

    def aliasing(text: str) -> str:
        header = text.splitlines()[0]
        return header[header.find("input_output_alias="):header.find(" entry_computation_layout")]
    assert aliasing(stock.as_text()).startswith("input_output_alias={ {0}: (0, {}")
    assert aliasing(result.text) == aliasing(stock.as_text())


def _xla_reads_back(text: str) -> str | None:
    """None when XLA's parser reads ``text`` (XLA's own print), else its complaint."""
    from jaxlib import _hlo
    try:
        _hlo.hlo_module_from_text(text)
    except Exception as exc:  # noqa: BLE001 - the parser's verdict
        return str(exc)
    return None


def test_data_parallel_step_on_two_h100s(h100_mesh2, tmp_path, monkeypatch):
    """jax's SPMD partitioner hands the pass the per-device module: stitch's kernels sit
    between XLA's collectives, which stay XLA's. Where XLA cannot read back its own print of
    the module the pass is given (XLA 0.11.2's in-place ``all-reduce-start``), the pass must
    say so and leave the module to XLA: checked on the very module the pass saw."""
    from stitch.xla_pass.pass_registration import DUMP_ENV
    from stitch.xla_pass.pass_request import PassError
    monkeypatch.setenv(DUMP_ENV, str(tmp_path))
    lowered = lower_step(h100_mesh2, jnp.float32, "d")
    stock = parse_hlo(lowered.compile().as_text())
    try:
        result = deviceless.compile_with_pass(lowered, "train_step", TARGET)
    except PassError as exc:
        assert "cannot read back its own print" in str(exc), exc
        (seen,) = tmp_path.glob("*.hlo")
        complaint = _xla_reads_back(seen.read_text())
        assert complaint is not None and "all-reduce-start" in complaint, complaint
        return
    (seen,) = tmp_path.glob("*.hlo")
    assert _xla_reads_back(seen.read_text()) is None
    assert len(kernel_launches(stock.entry)) == result.report.kernels_xla
    final = parse_hlo(result.text)
    entry_params = [i.shape.dims for i in final.entry.parameters]
    assert (BATCH // 2, DIN) in entry_params, entry_params      # the per-device shard
    assert any(i.opcode.startswith("all-reduce") for _, i in final.instructions())
    check_placement(result)
    check_assembled(result)


def test_public_registration_reaches_a_deviceless_compile_only_where_jax_registers_at_once(
        deviceless_ready):
    """jax 0.10.2's public registration waits for a started GPU client (never, without a
    device), so only the extension registration reaches a deviceless compile; jax 0.11
    registers on the loaded CUDA plugin at once, and the public call alone stitches. Checked
    in a child with only the public call (this process has the extension registration)."""
    from stitch.xla_pass.pass_registration import registers_on_client_start
    code = (
        "import jax, jax.numpy as jnp\n"
        "from jax.experimental import topologies\n"
        "from jax.sharding import NamedSharding, PartitionSpec as P\n"
        "from stitch.xla_pass import deviceless, entry as xla_pass\n"
        "xla_pass.ensure_registered('cuda')\n"
        "mesh = topologies.make_mesh(deviceless.topology('h100'), (1,), ('d',))\n"
        "s = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=NamedSharding(mesh, P()))\n"
        "f = lambda x: jax.nn.softmax(jnp.tanh(x), -1).sum()\n"
        "req = xla_pass.PassRequest('f', 'h100', 'gpu', compile_only=True)\n"
        "with req:\n"
        "    req.prepare(jax.jit(f).lower(s)).compile()\n"
        "try:\n"
        "    req.result()\n"
        "    print('STITCHED')\n"
        "except xla_pass.PassError as e:\n"
        "    print('NOT-CALLED' if 'without calling' in str(e) else 'OTHER', e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    want = "NOT-CALLED" if registers_on_client_start() else "STITCHED"
    assert want in out.stdout, out.stdout + out.stderr[-2000:]


# ---------------------------------------------------------------- numbers for docs/benchmarks.md


def measure() -> list[dict]:
    """Kernel counts and compile seconds of the steps above, stock vs with the pass (one
    process; run twice for warm compile caches)."""
    import time

    from jax.experimental import topologies
    deviceless.check_environment()
    deviceless.ensure_pass_registered()
    rows = []
    for label, shape, n, dtype, axis in (
            ("f32, 1×H100", "1x1x1", 1, jnp.float32, None),
            ("bf16, 1×H100", "1x1x1", 1, jnp.bfloat16, None),
            ("f32, 2×H100 data-parallel", "1x2x1", 2, jnp.float32, "d")):
        mesh = topologies.make_mesh(deviceless.topology(TARGET, shape), (n,), ("d",))
        lowered = lower_step(mesh, dtype, axis)
        start = time.perf_counter()
        stock = parse_hlo(lowered.compile().as_text())
        stock_s = time.perf_counter() - start
        start = time.perf_counter()
        result = deviceless.compile_with_pass(lowered, "train_step", TARGET)
        pass_s = time.perf_counter() - start
        report = result.report
        rows.append({
            "step": label, "xla_kernels": report.kernels_xla,
            "xla_fusions": sum(1 for i in stock.entry.instructions if i.opcode == "fusion"),
            "kernels_after": report.kernels_after, "stitched": report.kernels_stitched,
            "final_launches": len(kernel_launches(parse_hlo(result.text).entry)),
            "stock_compile_s": round(stock_s, 2), "pass_compile_s": round(pass_s, 2),
            **{k: round(v, 2) for k, v in report.timings.items()},
            "ptxas_registers": {k.name: k.target.ptxas[k.lowered.kernel.name].registers
                                for k in report.kernels}})
    return rows


if __name__ == "__main__":
    import json
    for row in measure():
        print(json.dumps(row))


def attention(q, k, v):
    s = jnp.einsum("bmd,bnd->bmn", q, k) * 0.125
    return jnp.einsum("bmn,bnh->bmh", jax.nn.softmax(s, axis=-1), v)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_attention_is_one_gemm_chain_kernel_in_xla_gpus_module(h100_mesh, dtype):
    """XLA GPU runs attention as a GEMM, a softmax and a GEMM; the pass places one stitched
    chain kernel for the three (bf16: tensor-core MMA), assembled for sm_90."""
    replicated = NamedSharding(h100_mesh, P())
    spec = jax.ShapeDtypeStruct((16, 512, 64), {"f32": jnp.float32, "bf16": jnp.bfloat16}[dtype],
                                sharding=replicated)
    result = deviceless.compile_with_pass(jax.jit(attention).lower(spec, spec, spec),
                                          "attention", TARGET)
    report = result.report
    kinds = {k.name: k.kind for g in report.plan.graphs for k in g.stitched.kernels}
    placed = [kinds[name] for name in report.placed]
    assert placed.count("gemm_chain") == 1, (report.summary(), report.skipped)
    check_placement(result, xla_left=False)       # the chain is the whole function
    check_assembled(result)
    final = parse_hlo(result.text)
    assert not [i for _, i in final.instructions() if i.opcode == "dot"], "a GEMM is left"
    if dtype == "bf16":
        chain = next(k for k in report.kernels if kinds[k.name] == "gemm_chain")
        assert "mma.sync.aligned.m16n8k16" in chain.target.ptx


def _normalize_on_h100(h100_mesh, monkeypatch=None, expect_global=True):
    # Its kernel saves ~1 µs a step: built whatever it repays (stitch/xla_pass/payback.py).
    if monkeypatch is not None:
        monkeypatch.setenv("STITCH_PAYBACK_STEPS", "off")
    spec = jax.ShapeDtypeStruct((2048, 1024), jnp.float32,
                                sharding=NamedSharding(h100_mesh, P()))
    result = deviceless.compile_with_pass(
        jax.jit(lambda x: x / jnp.sum(x)).lower(spec), "normalize", TARGET)
    report = result.report
    planned = [k for g in report.plan.graphs for k in g.stitched.kernels
               if k.schedule is not None and any(p.kind == "global" for p in k.schedule.parts)]
    if expect_global:
        assert planned, "the plan has no global-scope kernel: the test no longer tests anything"
    return result


def test_gpu_kernels_are_relaunched_per_phase_by_default(h100_mesh, monkeypatch):
    """x / sum(x) plans as a global-scope (grid barrier) kernel; by default (STITCH_GRID_SYNC
    unset) the pass builds it in the relaunch form — a launch per phase inside one custom
    call, no co-residency needed — and the planner priced it in that form."""
    from stitch.codegen import kir
    monkeypatch.delenv("STITCH_GRID_SYNC", raising=False)
    result = _normalize_on_h100(h100_mesh, monkeypatch)
    report = result.report
    phased = [k for k in report.kernels if kir.has_grid_barrier(k.lowered.kernel)]
    assert phased, report.summary()
    for kernel in phased:
        assert kernel.lowered.kernel.grid_sync == "relaunch"
    assert not report.delivery.dropped, report.delivery.log_lines("normalize")


def test_grid_sync_off_plans_no_kernel_only_the_global_scope_builds(h100_mesh, monkeypatch):
    """STITCH_GRID_SYNC=off: no grid-barrier kernel is built, and the planner (asking the
    same launch-form rule, stitch.cost.launch_forms) prices none, so no planned kernel is
    dropped for want of one."""
    from stitch.codegen import kir
    monkeypatch.setenv("STITCH_GRID_SYNC", "off")
    report = _normalize_on_h100(h100_mesh, monkeypatch, expect_global=False).report
    for kernel in report.kernels:
        assert not kir.has_grid_barrier(kernel.lowered.kernel), kernel.name
        assert "grid_sync" not in kernel.target.ptx
    left = [why for _, why in report.fallbacks]
    assert not any("global-scope" in why for why in left), left


def test_grid_barrier_kernels_as_one_cooperative_launch(h100_mesh, monkeypatch):
    """STITCH_GRID_SYNC=barrier: the global-scope kernel is built as planned — grid barriers
    in the PTX, registers capped (.maxnreg) at what the schedule sized its resident grid for,
    and ptxas's count within it (the CUDA handler launches it cooperatively on a GPU)."""
    from stitch.codegen import kir
    from stitch.codegen.nvptx import GRID_BARRIER_MAX_REGISTERS
    monkeypatch.setenv("STITCH_GRID_SYNC", "barrier")
    result = _normalize_on_h100(h100_mesh, monkeypatch)
    report = result.report
    barriers = [k for k in report.kernels if kir.has_grid_barrier(k.lowered.kernel)]
    assert barriers, report.summary()
    check_assembled(result)
    for kernel in barriers:
        assert kernel.lowered.kernel.grid_sync == "barrier"
        assert "grid_sync" in kernel.target.ptx
        assert f".maxnreg {GRID_BARRIER_MAX_REGISTERS}" in kernel.target.ptx
        info = kernel.target.ptxas[kernel.lowered.kernel.name]
        assert 0 < info.registers <= GRID_BARRIER_MAX_REGISTERS, info


def test_a_kernel_that_does_not_repay_its_build_is_left_to_xla(h100_mesh, monkeypatch):
    """stitch.xla_pass.payback: x / sum(x)'s one kernel saves ~1 µs per step for a ~0.1 s build;
    within 1,000 steps it does not repay it and XLA keeps its kernels, with the reason."""
    monkeypatch.setenv("STITCH_GRID_SYNC", "barrier")
    monkeypatch.setenv("STITCH_PAYBACK_STEPS", "1000")
    report = _normalize_on_h100(h100_mesh).report
    assert report.unpaid and not report.placed, report.summary()
    assert report.kernels_after == report.kernels_xla
    (left,) = report.unpaid
    assert 0 < left.gain_us and left.steps > 1000
    assert "STITCH_PAYBACK_STEPS=1,000" in dict(report.skipped)[left.name]


def test_grid_barrier_kernels_relaunched_per_phase(h100_mesh, monkeypatch):
    """STITCH_GRID_SYNC=relaunch: the global-scope kernel is built as planned, in the form
    the CUDA handler launches once per phase (no register cap, no residency needed)."""
    from stitch.codegen import kir
    monkeypatch.setenv("STITCH_GRID_SYNC", "relaunch")
    result = _normalize_on_h100(h100_mesh, monkeypatch)
    report = result.report
    phased = [k for k in report.kernels if kir.has_grid_barrier(k.lowered.kernel)]
    assert phased, report.summary()
    check_assembled(result)
    for kernel in phased:
        assert kernel.lowered.kernel.grid_sync == "relaunch"
        assert kir.launches(kernel.lowered.kernel) >= 2
        assert ".maxnreg" not in kernel.target.ptx


def test_grid_barrier_kernels_take_the_modeled_faster_form(h100_mesh, monkeypatch):
    """STITCH_GRID_SYNC=auto: each global-scope kernel is built in the launch form the
    latency-evaluator models faster (stitch.schedule.global_scope.launch_form)."""
    from stitch.codegen import kir
    from stitch.schedule.global_scope import launch_form
    monkeypatch.setenv("STITCH_GRID_SYNC", "auto")
    result = _normalize_on_h100(h100_mesh, monkeypatch)
    report = result.report
    planned = {k.name: k.schedule for g in report.plan.graphs for k in g.stitched.kernels
               if k.schedule is not None and any(p.kind == "global" for p in k.schedule.parts)}
    built = [k for k in report.kernels if kir.has_grid_barrier(k.lowered.kernel)]
    assert built, report.summary()
    check_assembled(result)
    for kernel in built:
        assert kernel.lowered.kernel.grid_sync == launch_form(planned[kernel.name])


# ---------------------------------------------------------------- kernels as built


def test_kernels_slower_as_built_than_priced_are_left_to_xla(h100_mesh):
    """The zoo's BERT training step (tiny): its layer-norm backward kernels, planned as
    warp/block parts over coarsened rows, are built with thread composition and recompute
    row statistics per row (95-850 µs on an H200 against 2-4 µs priced). The pass must leave
    each such kernel to XLA with the busiest thread's counts in the reason, and every kernel
    it places must be one whose busiest thread fits the price plus its saving."""
    from stitch.codegen.thread_work import busiest_thread
    from stitch.cost.gpu_specs import get_spec
    from stitch.cost.latency import thread_bound_seconds
    from stitch.models import build

    inst = build("bert_layer_train", "tiny")
    replicated = NamedSharding(h100_mesh, P())
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated)
             for a in inst.random_args(0)]
    result = deviceless.compile_with_pass(jax.jit(inst.fn).lower(*specs), "bert", TARGET)
    report = result.report
    assert report.thread_bound, report.skipped
    reasons = dict(report.skipped)
    for name in report.thread_bound:
        assert "busiest thread" in reasons[name] and "left to XLA" in reasons[name]
    spec = get_spec(TARGET)
    for built in report.kernels:
        work = busiest_thread(built.lowered.kernel)
        assert thread_bound_seconds(spec, work.loads, work.ops) < 20e-6, (built.name, work)
    check_placement(result)


def test_lm_head_loss_over_a_padded_vocabulary_is_delivered(h100_mesh):
    """GPT-2's vocabulary (50257) is not a multiple of XLA's row split: XLA pads each row
    to 140 * 359 before splitting the max and the sum of exp. Its logits ([2048, 50257]: 103M
    elements) are too large for the row proof's full index arrays, so the compact proof
    must carry the pad; before, the loss-and-gradient kernel fell back to thread
    composition and was left to XLA as slower as built. Now it is built with its planned
    warp/block composition and placed, and every placed kernel's busiest thread is small."""
    from stitch.codegen.thread_work import busiest_thread
    from stitch.cost.gpu_specs import get_spec
    from stitch.cost.latency import thread_bound_seconds

    tokens, d, vocab = 2048, 64, 50257

    def loss(x, w, labels):
        logits = x @ w.T
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, labels[:, None], axis=-1).mean()

    replicated = NamedSharding(h100_mesh, P())
    specs = (jax.ShapeDtypeStruct((tokens, d), jnp.float32, sharding=replicated),
             jax.ShapeDtypeStruct((vocab, d), jnp.float32, sharding=replicated),
             jax.ShapeDtypeStruct((tokens,), jnp.int32, sharding=replicated))
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    result = deviceless.compile_with_pass(step.lower(*specs), "lm_head_loss", TARGET)
    report = result.report
    assert not report.thread_bound, report.skipped
    wide = [b for b in report.kernels if set(b.lowered.schemes) & {"warp", "block"}]
    assert wide, [(b.name, b.lowered.schemes, b.lowered.notes) for b in report.kernels]
    assert not [n for b in report.kernels for n in b.lowered.notes
                if "too large to prove" in n], [b.lowered.notes for b in report.kernels]
    spec = get_spec(TARGET)
    for built in report.kernels:
        work = busiest_thread(built.lowered.kernel)
        assert thread_bound_seconds(spec, work.loads, work.ops) < 50e-6, (built.name, work)
    assert report.summary()["delivered_share"] > 0.9, report.summary()
    check_placement(result)
