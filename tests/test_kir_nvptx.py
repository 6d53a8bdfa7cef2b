"""Kernel IR on the NVPTX target: the host-tested kernels emit PTX that ptxas accepts for
sm_70 / sm_80 / sm_90 without spills, with the expected entry, barriers, shuffles and shared
memory, and no unresolved libdevice calls."""
from __future__ import annotations

import functools
import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest

from stitch.codegen import kir
from stitch.codegen.errors import CodegenError
from stitch.codegen.kir import (Binary, Compare, Const, Convert, Kernel, Let, Load, Param, Ref, Select,
                                Store, ThreadIdx, Unary, WarpReduce, f32, i32)
from stitch.codegen.nvptx import LlvmPipeline, default_libdevice_path, emit_llvm_ir, emit_ptx
from tests.test_kir_host import (UNARY_CASES, block_softmax_kernel, elementwise_kernel,
                                 tiled_sum_kernel, warp_softmax_kernel)

ARCHS = ("sm_70", "sm_80", "sm_90")

pytestmark = pytest.mark.skipif(default_libdevice_path() is None, reason="no libdevice.10.bc")


@functools.lru_cache(maxsize=None)
def ptxas_for(arch: str) -> str | None:
    """A ptxas that knows `arch` (CUDA 13 dropped sm_70; the CUDA 12 wheel of the `test`
    extra still has it), as stitch.codegen.toolchain picks it."""
    from stitch.codegen.errors import ToolchainError
    from stitch.codegen.toolchain import find_ptxas
    try:
        return str(find_ptxas(arch))
    except ToolchainError:
        return None


def assemble(ptx: str, arch: str) -> dict[str, int]:
    """ptxas -v; returns registers and spill bytes (skips if no ptxas knows `arch`)."""
    exe = ptxas_for(arch)
    if exe is None:
        pytest.skip(f"no ptxas supports {arch}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.ptx"
        path.write_text(ptx)
        run = subprocess.run([exe, f"-arch={arch}", "-v", str(path), "-o", os.devnull],
                             capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    regs = re.search(r"Used (\d+) registers", run.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", run.stderr)
    assert regs and spills, run.stderr
    return {"registers": int(regs.group(1)), "spill_stores": int(spills.group(1)),
            "spill_loads": int(spills.group(2))}


# ---------------------------------------------------------------- kernels


def _chain_kernel(name: str, in_dtypes: list[str], dtype: str, steps) -> Kernel:
    """out[i] = the last of a chain of Lets; `steps(x, y, acc)` yields expressions, each
    becoming the next `acc` (Lets keep shared values shared: expressions are trees)."""
    n = 1000
    params = [Param(f"x{j}", d, n) for j, d in enumerate(in_dtypes)]
    out = Param("out", dtype, n, is_output=True)
    idx = Ref("i", "i32")
    body: list[kir.Stmt] = [Let(f"in{j}", Load(p, idx)) for j, p in enumerate(params)]
    ins = [Ref(f"in{j}", value) for j, value in enumerate(kir.value_dtype(d) for d in in_dtypes)]
    acc = ins[0]
    for j, make in enumerate(steps):
        body.append(Let(f"acc{j}", make(*ins, acc)))
        acc = Ref(f"acc{j}", dtype)
    body.append(Store(out, idx, acc))
    grid = (n + 127) // 128
    return Kernel(name, [*params, out], [], grid, 128,
                  [Let("i", Binary("add", Binary("mul", kir.BlockIdx(), kir.BlockDim()),
                                   ThreadIdx())),
                   kir.If(Compare("lt", idx, i32(n)), body)])


def all_float_ops_kernel(dtype: str) -> Kernel:
    """Every float Unary / Binary op, converts and compares, chained into one output."""
    steps = [lambda x, acc, op=op: Binary("add", acc, Unary(op, x)) for op in sorted(UNARY_CASES)]
    steps += [lambda x, acc, op=op: Binary(op, x, acc)
              for op in ("add", "sub", "mul", "div", "rem", "min", "max", "pow", "atan2")]
    steps += [
        lambda x, acc: Select(Binary("and", Unary("is_finite", x),
                                     Compare("ne", x, Convert(Convert(x, "i32"), dtype))),
                              Binary("add", acc, Convert(Convert(x, "u8"), dtype)), acc),
    ]
    return _chain_kernel(f"float_ops_{dtype}", [dtype], dtype, steps)


def all_int_ops_kernel(dtype: str) -> Kernel:
    ops = ("add", "sub", "mul", "div", "rem", "min", "max", "and", "or", "xor", "shl",
           "shr_logical", "shr_arith")
    # A different right operand per step, so no step folds away (x & c | c == c).
    steps = [lambda a, b, acc, op=op, j=j: Binary(op, acc, Binary("xor", b if j % 2 else a,
                                                                  Const(3 * j + 1, dtype)))
             for j, op in enumerate(ops)]
    steps += [lambda a, b, acc, op=op: Binary("add", a, Unary(op, acc))
              for op in ("neg", "abs", "sign", "not")]
    steps += [lambda a, b, acc: Select(Compare("lt", acc, b), acc,
                                       Convert(Convert(acc, "f32"), dtype))]
    return _chain_kernel(f"int_ops_{dtype}", [dtype, dtype], dtype, steps)


def half_kernel(dtype: str) -> Kernel:
    return elementwise_kernel(f"half_{dtype}", [dtype, "f32", "i1"], dtype, 1000,
                              lambda a, b, c: Select(c, Unary("exp", Binary("mul", a, b)), a))


def warp_reduce_dtypes_kernel() -> Kernel:
    """64-bit and narrow shuffles (split / widened) through WarpReduce."""
    params = [Param(f"x_{d}", d, 128) for d in ("f64", "i64", "u8", "i32")]
    outs = [Param(f"o_{d}", d, 128, is_output=True) for d in ("f64", "i64", "u8", "i32")]
    body: list[kir.Stmt] = [Let("i", ThreadIdx())]
    for p, o, op in zip(params, outs, ("add", "max", "add", "min")):
        body += [WarpReduce(f"r_{p.dtype}", Load(p, Ref("i", "i32")), op),
                 Store(o, Ref("i", "i32"), Ref(f"r_{p.dtype}", p.dtype))]
    return Kernel("warp_reduce_dtypes", [*params, *outs], [], 1, 128, body)


KERNELS = {
    "float_ops_f32": lambda: all_float_ops_kernel("f32"),
    "float_ops_f64": lambda: all_float_ops_kernel("f64"),
    "int_ops_i32": lambda: all_int_ops_kernel("i32"),
    "int_ops_u8": lambda: all_int_ops_kernel("u8"),
    "int_ops_i64": lambda: all_int_ops_kernel("i64"),
    "half_f16": lambda: half_kernel("f16"),
    "half_bf16": lambda: half_kernel("bf16"),
    "softmax_warp_reduce": lambda: warp_softmax_kernel(10, 300, "reduce"),
    "softmax_warp_xor": lambda: warp_softmax_kernel(10, 100, "xor"),
    "softmax_warp_down": lambda: warp_softmax_kernel(10, 33, "down"),
    "softmax_block": lambda: block_softmax_kernel(3, 32000),
    "tiled_sum": lambda: tiled_sum_kernel(3, 4096),
    "warp_reduce_dtypes": warp_reduce_dtypes_kernel,
}


def _uses(kernel: Kernel, kind: type | tuple[type, ...]) -> bool:
    return any(isinstance(s, kind) for s in kir.walk_stmts(kernel.body))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_ptx_assembles(name: str, arch: str) -> None:
    kernel = KERNELS[name]()
    ptx = emit_ptx(kernel, arch)
    assert f".target {arch}" in ptx
    assert f".visible .entry {kernel.name}(" in ptx
    assert f".maxntid {kernel.block}" in ptx
    assert ".extern .func" not in ptx and "__nv_" not in ptx
    assert ("bar.sync" in ptx or "barrier.sync" in ptx) == _uses(kernel, kir.Barrier)
    assert ("shfl.sync" in ptx) == _uses(kernel, (kir.WarpShuffle, kir.WarpReduce))
    assert (".shared" in ptx) == bool(kernel.shared)
    assert ptx.count(".param .u64") == len(kernel.params)
    info = assemble(ptx, arch)
    assert info["spill_stores"] == 0 and info["spill_loads"] == 0, info
    assert 0 < info["registers"] <= 255


def test_shuffle_flavours_in_ptx() -> None:
    ptx = emit_ptx(warp_softmax_kernel(10, 33, "down"), "sm_80")
    assert "shfl.sync.down.b32" in ptx and "shfl.sync.idx.b32" in ptx
    assert "shfl.sync.bfly.b32" in ptx  # the WarpReduce max


def test_libdevice_is_linked_and_pruned() -> None:
    kernel = elementwise_kernel("one_exp", ["f32"], "f32", 100, lambda a: Unary("exp", a))
    ir_text = emit_llvm_ir(kernel)
    assert "declare float @\"__nv_expf\"" in ir_text and "ptx_kernel" in ir_text
    ptx = emit_ptx(kernel, "sm_80")
    assert "ex2.approx" in ptx and ".func" not in ptx  # inlined, nothing else kept


def test_missing_libdevice_is_a_toolchain_error(tmp_path: Path) -> None:
    kernel = elementwise_kernel("one_exp", ["f32"], "f32", 100, lambda a: Unary("exp", a))
    with pytest.raises(CodegenError, match="libdevice"):
        emit_ptx(kernel, "sm_80", libdevice=tmp_path / "missing.bc")
    plain = elementwise_kernel("plain", ["f32"], "f32", 100, lambda a: Binary("add", a, f32(1)))
    assert ".entry plain(" in emit_ptx(plain, "sm_80", libdevice=tmp_path / "missing.bc")


def test_errors() -> None:
    with pytest.raises(CodegenError, match="unsupported arch"):
        emit_ptx(KERNELS["half_f16"](), "sm_10")
    bad = Kernel("bad", [Param("o", "f32", 32, is_output=True)], [], 1, 32,
                 [kir.If(Compare("lt", ThreadIdx(), i32(3)), [kir.Barrier()])])
    with pytest.raises(CodegenError, match="kernel 'bad'.*thread-dependent"):
        emit_ptx(bad)
    big = Kernel("big", [], [kir.Shared("s", "f32", 20000)], 1, 32, [])
    with pytest.raises(CodegenError, match="shared memory"):
        emit_ptx(big)


def test_kernels_pickle_and_emit_deterministically() -> None:
    """emit_ptx runs in a child process for isolation: kernels must pickle, output be stable."""
    import pickle
    kernel = KERNELS["tiled_sum"]()
    clone = pickle.loads(pickle.dumps(kernel))
    assert clone == kernel
    assert emit_ptx(clone, "sm_90") == emit_ptx(kernel, "sm_90")


def _param_attributes(ir_text: str, kernel_name: str) -> dict[str, str]:
    """Each param's attribute text in the entry's definition line of ``ir_text``."""
    line = next(line for line in ir_text.splitlines()
                if line.startswith("define") and f"@\"{kernel_name}\"(" in line
                or line.startswith("define") and f"@{kernel_name}(" in line)
    found = re.findall(r"ptr addrspace\(1\) ([^%,)]*)%\"?(\w+)\"?", line)
    return {name: attrs for attrs, name in found}


def test_noalias_inputs_load_through_the_read_only_path():
    """``LlvmPipeline(noalias_inputs=True)``: inputs are ``noalias`` (nothing writes them
    while the kernel runs), outputs are not, and every input load is ld.global.nc. The
    default builds plain params and plain loads."""
    kernel = elementwise_kernel("ew_private", ["f32", "f32"], "f32", 4096,
                                lambda a, b: Binary("add", a, b), grid_stride=True)
    plain = _param_attributes(emit_llvm_ir(kernel, "sm_90"), kernel.name)
    assert set(plain) == {"x0", "x1", "out"}
    assert not any("noalias" in a for a in plain.values()), plain
    assert ".nc." not in emit_ptx(kernel, "sm_90")
    private = LlvmPipeline(noalias_inputs=True)
    attrs = _param_attributes(emit_llvm_ir(kernel, "sm_90", noalias_inputs=True), kernel.name)
    assert "noalias" in attrs["x0"] and "noalias" in attrs["x1"]
    assert "noalias" not in attrs["out"]
    ptx = emit_ptx(kernel, "sm_90", pipeline=private)
    loads = re.findall(r"\bld\.global(\.nc)?\.", ptx)
    assert loads and all(loads), loads            # every global load is .nc
    assert re.search(r"\bst\.global\.", ptx)


def test_a_kernel_adding_in_place_keeps_its_inputs_aliasable():
    """An atomic scatter's output starts as its operand's buffer (output_to_operand_aliasing):
    such a kernel's inputs may share memory with the output, so none is noalias, even when
    the pipeline asks for it, and no input is read through the non-coherent path."""
    n = 1024
    idx, val = Param("idx", "i32", n), Param("val", "f32", n)
    operand, out = Param("operand", "f32", 8), Param("out", "f32", 8, is_output=True)
    g = Ref("g", "i32")
    kernel = Kernel("scatter_in_place", [idx, val, operand, out], [], n // 128, 128, [
        Let("g", Binary("add", Binary("mul", kir.BlockIdx(), i32(128)), ThreadIdx())),
        Let("first", Load(operand, i32(0))),
        kir.AtomicAdd(out, Load(idx, g), Binary("mul", Load(val, g), Ref("first", "f32")))])
    attrs = _param_attributes(emit_llvm_ir(kernel, "sm_90", noalias_inputs=True), kernel.name)
    assert set(attrs) == {"idx", "val", "operand", "out"}
    assert not any("noalias" in a for a in attrs.values()), attrs
    assert ".nc." not in emit_ptx(kernel, "sm_90", pipeline=LlvmPipeline(noalias_inputs=True))


def test_libdevice_cut_once_per_process_links_the_same_functions(monkeypatch):
    """``warm_up`` cuts libdevice to the functions stitch calls; a kernel's own subset is then
    cut from that, and its PTX is the same as from the whole of libdevice."""
    from stitch.codegen import nvptx
    kernel = elementwise_kernel("exp_tanh", ["f32"], "f32", 100,
                                lambda a: Unary("tanh", Unary("exp", a)))
    nvptx._libdevice_subset.cache_clear()
    nvptx._libdevice_stitch_cut.cache_clear()
    nvptx.warm_up()
    assert nvptx._libdevice_stitch_cut.cache_info().currsize == 1
    via_cut = emit_ptx(kernel, "sm_90")
    assert nvptx._libdevice_stitch_cut.cache_info().hits == 1   # warm_up's cut, not a new one
    nvptx._libdevice_subset.cache_clear()
    monkeypatch.setattr(nvptx, "LIBDEVICE_FUNCTIONS", frozenset())   # whole libdevice
    assert emit_ptx(kernel, "sm_90") == via_cut
    nvptx._libdevice_subset.cache_clear()


def _twice_loaded_kernel() -> Kernel:
    """out[g] = (y[g] < 0 ? x[g] : exp(x[g])) + x[g]: the last load of x[g] repeats the
    one each branch made, which only GVN's memory dependences see (no single load before
    it dominates it)."""
    n = 4096
    x, y = Param("x", "f32", n), Param("y", "f32", n)
    out = Param("out", "f32", n, is_output=True)
    g = Ref("g", "i32")
    return Kernel("twice_loaded", [x, y, out], [], n // 128, 128, [
        Let("g", Binary("add", Binary("mul", kir.BlockIdx(), kir.i32(128)), kir.ThreadIdx())),
        kir.Local("acc", "f32"),
        kir.If(Compare("lt", Load(y, g), kir.f32(0.0)), (kir.Assign("acc", Load(x, g)),),
               (kir.Assign("acc", kir.Unary("exp", Load(x, g))),)),
        kir.Store(out, g, Binary("add", Ref("acc", "f32"), Load(x, g)))])


def _global_loads(ptx: str) -> int:
    return len(re.findall(r"\bld\.global", ptx))


def test_gvn_without_memory_dependences_keeps_a_redundant_load_and_is_put_back():
    """``LlvmPipeline(gvn_memdep=False)`` (LLVM's process-wide -enable-gvn-memdep) keeps the
    load the default removes; the setting is put back after the build, so the default's
    next build is the same as its first."""
    from stitch.codegen.nvptx import PIPELINES
    kernel = _twice_loaded_kernel()
    first = emit_ptx(kernel, "sm_90")
    without = emit_ptx(kernel, "sm_90", pipeline=PIPELINES["O3-no-memdep"])
    assert _global_loads(first) == 2                  # y[g] and one x[g]
    assert _global_loads(without) == 3
    assert emit_ptx(kernel, "sm_90") == first


def test_gvn_memdep_is_put_back_when_the_build_fails(monkeypatch):
    from stitch.codegen import nvptx
    calls = []
    monkeypatch.setattr(nvptx.llvm, "set_option", lambda name, opt: calls.append(opt))

    def broken(*args, **kwargs):
        raise CodegenError("optimiser failed")
    monkeypatch.setattr(nvptx, "_optimize", broken)
    with pytest.raises(CodegenError, match="optimiser failed"):
        emit_ptx(_twice_loaded_kernel(), "sm_90", pipeline=LlvmPipeline(gvn_memdep=False))
    assert calls == ["-enable-gvn-memdep=false", "-enable-gvn-memdep=true"]
    calls.clear()
    with pytest.raises(CodegenError):
        emit_ptx(_twice_loaded_kernel(), "sm_90", pipeline=LlvmPipeline())
    assert calls == []                                # the default never touches it


def test_stitch_llvm_pipeline_names_the_pipeline(monkeypatch):
    """$STITCH_LLVM_PIPELINE picks one of PIPELINES for builds that name none; an unknown
    name is an error naming the known ones."""
    from stitch.codegen.nvptx import DEFAULT_PIPELINE, PIPELINE_ENV, PIPELINES, pipeline_setting
    monkeypatch.delenv(PIPELINE_ENV, raising=False)
    assert pipeline_setting() is DEFAULT_PIPELINE
    assert list(PIPELINES)[0] == "O3" and PIPELINES["O3"] == DEFAULT_PIPELINE
    monkeypatch.setenv(PIPELINE_ENV, " O2 ")
    assert pipeline_setting() == LlvmPipeline(speed_level=2)
    monkeypatch.setenv(PIPELINE_ENV, "O3-no-memdep")
    assert _global_loads(emit_ptx(_twice_loaded_kernel(), "sm_90")) == 3
    monkeypatch.setenv(PIPELINE_ENV, "O1")
    with pytest.raises(CodegenError, match=r"STITCH_LLVM_PIPELINE='O1'.*O3-no-unroll"):
        pipeline_setting()
    monkeypatch.setenv(PIPELINE_ENV, "")
    assert pipeline_setting() is DEFAULT_PIPELINE
