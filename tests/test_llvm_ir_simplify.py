"""The GPU build's lean LLVM IR leaves the machine code alone.

``KernelEmitter(simplify=True)`` (the default) emits a pure operation once per basic block
and leaves integer identities (x + 0, x * 1) out, so LLVM parses and simplifies less; the
kernel's machine code must not change (no GPU can show a speed change on this machine):

- zoo kernels planned for the H100 and lowered as the pass lowers them: their sm_90 PTX is
  the PTX of emitting every operation as written (``simplify=False``), or, where the PTX
  differs, ptxas's machine code (the cubin's ``.text``) is;
- the reuse stays inside one block and to pure operations: a load is emitted again after a
  store, a value computed in a loop is computed again after it, and 0.0 and -0.0 stay apart.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

import stitch
from stitch.codegen import gpu_cache, kir, nvptx
from stitch.codegen.errors import ToolchainError
from stitch.codegen.host import compile_host
from stitch.codegen.kir import Binary, Const, For, Kernel, Let, Load, Param, Ref, Store, ThreadIdx
from stitch.codegen.lower import lower_kernel
from stitch.codegen.objcheck import cubin_code
from stitch.codegen.toolchain import assemble_cubin, find_ptxas
from stitch.hlo import parse_hlo
from stitch.hlo.evaluator.interpreter import Evaluator
from stitch.hlo.segments_as_rows import segments_as_rows
from stitch.schedule.chain_tiling import lower_planned_chain
from tests.fixtures import zoo_fixture

needs_libdevice = pytest.mark.skipif(nvptx.default_libdevice_path() is None,
                                     reason="no libdevice.10.bc")

# bf16 storage and MMA attention (bert_layer_train_bf16), a GEMM chain, f32 reductions with
# libdevice math, bf16 scatters and gathers (moe_layer_bf16): ~30 distinct kernels.
MODELS = ("bert_layer_train_bf16", "attention_bert_small", "log_softmax_xent_train",
          "moe_layer_bf16")
ARCH = "sm_90"


def _planned_kernels(model: str) -> list[Kernel]:
    module = segments_as_rows(parse_hlo(zoo_fixture(model, "tiny", "pre").read_text()))
    evaluator = Evaluator(module)
    kernels = []
    for g in stitch.plan(module, "h100").graphs:
        for k in g.stitched.kernels:
            if k.kind == "gemm_chain":
                kernels.append(lower_planned_chain(g.graph, k, ARCH).kernel)
            elif k.schedule is not None:
                kernels.append(lower_kernel(g.graph, evaluator, k.schedule, k.name,
                                            in_place=True).kernel)
    return gpu_cache.distinct_kernels(kernels)[0]


def _machine_code(ptx: str, kernel: Kernel) -> bytes:
    try:
        find_ptxas(ARCH)
    except ToolchainError:
        pytest.fail(f"{kernel.name}: the PTX changed and there is no ptxas to compare "
                    "the machine code")
    cubin, _ = assemble_cubin(ptx, ARCH, kernel_name=kernel.name)
    code = cubin_code(cubin, kernel.name)
    assert code is not None, f"{kernel.name}: no .text section in ptxas's cubin"
    return code


@needs_libdevice
@pytest.mark.parametrize("model", MODELS)
def test_lean_ir_builds_the_same_machine_code_as_the_ir_as_written(model: str) -> None:
    kernels = _planned_kernels(model)
    assert kernels, f"{model}: the plan stitched no kernel"
    leaner = 0
    for kernel in kernels:
        lean_ir = nvptx.emit_llvm_ir(kernel, ARCH)
        full_ir = nvptx.emit_llvm_ir(kernel, ARCH, simplify=False)
        leaner += _instructions(lean_ir) < _instructions(full_ir)
        lean = nvptx.emit_ptx(kernel, ARCH)
        full = nvptx.emit_ptx(kernel, ARCH, simplify=False)
        if lean != full:
            assert _machine_code(lean, kernel) == _machine_code(full, kernel), kernel.name
    assert leaner > 0, f"{model}: simplify emitted no fewer instructions for any kernel"


def _instructions(ir_text: str) -> int:
    return len(re.findall(r"^\s+%\S+ = ", ir_text, re.MULTILINE))


def _tid_index() -> kir.Expr:
    return Binary("add", Binary("mul", ThreadIdx(), Const(2, "i32")), Const(1, "i32"))


def test_pure_index_math_is_emitted_once_per_block_and_loads_again() -> None:
    # y[2t+1] = x[2t+1] * 2; z[t + 0] = y[2t+1] + x[2t+1], the index built afresh for each
    # use (as lowering builds them): one 2t, every load emitted (x twice, y after its
    # store), t + 0 left out.
    n = 64
    x, y, z = (Param(name, "f32", 2 * n + 1, is_output=name != "x") for name in "xyz")
    body = [Store("y", _tid_index(), Binary("mul", Load(x, _tid_index()), Const(2.0, "f32"))),
            Store("z", Binary("add", ThreadIdx(), Const(0, "i32")),
                  Binary("add", Load(y, _tid_index()), Load(x, _tid_index())))]
    kernel = Kernel("reuse", [x, y, z], [], 1, n, body)
    lean = nvptx.emit_llvm_ir(kernel, ARCH)
    full = nvptx.emit_llvm_ir(kernel, ARCH, simplify=False)
    # As written: 2t per use (a store's address takes it again: (y + 2t) + 1), t + 0.
    assert (lean.count(" = mul i32"), full.count(" = mul i32")) == (1, 5)
    assert (lean.count(" = add i32"), full.count(" = add i32")) == (1, 2)
    tid = 'call i32 @"llvm.nvvm.read.ptx.sreg.tid.x"'
    assert (lean.count(tid), full.count(tid)) == (1, 6)
    assert lean.count(" = load float") == 3


def test_reuse_stays_in_its_block_and_keeps_signed_zeros_apart() -> None:
    # In a loop: v = x[i*n + t]; out[i*n + t] = (v + 0.0) * (v + -0.0), and t * 3; after
    # it tail[t] = t * 3 again: the loop's block does not dominate the code after it, so
    # the product is computed again there, and v + 0.0 is not v + -0.0.
    n, trips = 32, 4
    x = Param("x", "f32", n * trips)
    out = Param("out", "f32", n * trips, is_output=True)
    tail = Param("tail", "i32", n, is_output=True)
    index = Binary("add", Binary("mul", Ref("i", "i32"), Const(n, "i32")), ThreadIdx())
    v = Ref("v", "f32")
    loop = For("i", Const(0, "i32"), Const(trips, "i32"), Const(1, "i32"), [
        Let("v", Load(x, index)),
        Let("t3", Binary("mul", ThreadIdx(), Const(3, "i32"))),
        Store("out", index, Binary("mul", Binary("add", v, Const(0.0, "f32")),
                                   Binary("add", v, Const(-0.0, "f32"))))])
    body = [loop, Store("tail", ThreadIdx(), Binary("mul", ThreadIdx(), Const(3, "i32")))]
    kernel = Kernel("blocks", [x, out, tail], [], 1, n, body)
    lean = nvptx.emit_llvm_ir(kernel, ARCH)
    assert lean.count(" = mul i32") == 3      # i * n and t * 3 in the loop, t * 3 after it
    assert lean.count(" = fadd float") == 2
    # The host build emits through the same KernelEmitter: the values are numpy's.
    values = np.random.default_rng().standard_normal(n * trips).astype(np.float32)
    values[:3] = [0.0, -0.0, np.nan]
    got = np.full(n * trips, np.nan, np.float32)
    got_tail = np.zeros(n, np.int32)
    compile_host(kernel)(values, got, got_tail)
    want = (values + np.float32(0.0)) * (values + np.float32(-0.0))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    np.testing.assert_array_equal(got_tail, np.arange(n, dtype=np.int32) * 3)
