"""The GPU build's shortcuts give the same code as the long way:

- kernels that differ only by their names and their parameters' names are emitted once and
  renamed (``stitch.codegen.gpu_cache.distinct_kernels`` / ``renamed_ptx``): the renamed PTX is the
  PTX of emitting each kernel itself, and kernels that differ in anything else stay apart;
- libdevice is linked as the subset a kernel calls (``stitch.codegen.nvptx._libdevice_subset``):
  the PTX is the PTX of linking all of libdevice;
- a constant integer divisor is emitted without the divide-by-zero guard: XLA's semantics
  still hold (checked on the host target against numpy);
- Kernel IR validation walks a subexpression shared within one expression once (lowering
  builds DAGs), and still finds what is wrong inside it.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import llvmlite.binding as llvm

from stitch.codegen import kir, nvptx
from stitch.codegen.gpu_cache import (CANONICAL_NAME, distinct_kernels, renamed_ptx,
                                      structure_key)
from stitch.codegen.host import NUMPY_DTYPES
from stitch.codegen.kir import Binary, Const, Kernel, Param, Unary
from tests.test_kir_host import (_xla_divrem, elementwise_kernel, run_elementwise,
                                 warp_softmax_kernel)

needs_libdevice = pytest.mark.skipif(nvptx.default_libdevice_path() is None,
                                     reason="no libdevice.10.bc")


def _renamed_params(kernel: Kernel, name: str, suffix: str) -> Kernel:
    """``kernel`` called ``name`` with every parameter renamed (``x0`` -> ``x0<suffix>``)
    wherever the body uses it (every string field naming one)."""
    names = {p.name: p.name + suffix for p in kernel.params}

    def walk(value: object) -> object:
        if isinstance(value, str):
            return names.get(value, value)
        if isinstance(value, tuple):
            return tuple(walk(v) for v in value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.replace(value, **{f.name: walk(getattr(value, f.name))
                                                 for f in dataclasses.fields(value)
                                                 if f.init})
        return value
    renamed = walk(kernel)
    return dataclasses.replace(renamed, name=name)


def _layer(name: str, scale: float) -> Kernel:
    return elementwise_kernel(name, ["f32", "f32"], "f32", 4096,
                              lambda x, y: Binary("mul", Unary("tanh", Binary("add", x, y)),
                                                  Const(scale, "f32")))


def test_structure_key_ignores_names_only() -> None:
    a = _layer("main_k3", 0.5)
    b = _renamed_params(_layer("main_k17", 0.5), "main_k17", "_layer2")
    assert [p.name for p in a.params] != [p.name for p in b.params]
    assert structure_key(a) == structure_key(b)
    assert structure_key(a) != structure_key(_layer("main_k3", 0.25))   # another constant
    swapped = Kernel(a.name, [a.params[1], a.params[0], a.params[2]], [], a.grid, a.block,
                     a.body)                                            # parameter order
    assert structure_key(swapped) != structure_key(a)


@needs_libdevice
def test_deduplicated_ptx_is_each_kernels_own() -> None:
    kernels = [_layer("main_k0", 0.5),
               _renamed_params(_layer("main_k10", 0.5), "main_k10", "_b"),
               _layer("main_k1", 2.0),
               warp_softmax_kernel(7, 300, "xor"),
               _renamed_params(warp_softmax_kernel(7, 300, "xor"), "softmax_k2", "_c")]
    distinct, groups = distinct_kernels(kernels)
    assert groups == [[0, 1], [2], [3, 4]]
    assert all(k.name == CANONICAL_NAME for k in distinct)
    for canonical, group in zip(distinct, groups):
        ptx = nvptx.emit_ptx(canonical, "sm_90")
        for i in group:
            own = nvptx.emit_ptx(kernels[i], "sm_90")
            assert renamed_ptx(ptx, kernels[i].name) == own
            assert CANONICAL_NAME not in renamed_ptx(ptx, kernels[i].name)


def _ptx_with_all_of_libdevice(kernel: Kernel, arch: str = "sm_90") -> str:
    """The PTX as emitted before libdevice was cut down: all of it linked, then O3."""
    tm = nvptx._target_machine(arch, nvptx.DEFAULT_PTX_VERSION)
    module = llvm.parse_assembly(nvptx.emit_llvm_ir(kernel, arch))
    lib = llvm.parse_bitcode(nvptx._libdevice_bytes(str(nvptx.default_libdevice_path())))
    lib.triple, lib.data_layout = module.triple, module.data_layout
    module.link_in(lib)
    for fn in module.functions:
        if not fn.is_declaration and fn.name != kernel.name:
            fn.linkage = llvm.Linkage.internal
    for gv in module.global_variables:
        if not gv.is_declaration:
            gv.linkage = llvm.Linkage.internal
    nvptx._optimize(module, tm)
    return tm.emit_assembly(module)


@needs_libdevice
@pytest.mark.parametrize("ops", [("tanh",), ("exp", "log", "sin"), ("rsqrt", "erf", "tan")])
def test_libdevice_subset_gives_the_same_ptx(ops: tuple[str, ...]) -> None:
    def chain(x: kir.Expr, y: kir.Expr) -> kir.Expr:
        acc = Binary("add", x, y)
        for op in ops:
            acc = Unary(op, acc)
        return acc
    kernel = elementwise_kernel("k_" + "_".join(ops), ["f32", "f32"], "f32", 1000, chain)
    ptx = nvptx.emit_ptx(kernel, "sm_90")
    assert ptx == _ptx_with_all_of_libdevice(kernel)


@pytest.mark.parametrize("dtype", ["i32", "u32", "i8", "u8"])
def test_constant_divisors_keep_xla_semantics(dtype: str) -> None:
    nd = NUMPY_DTYPES[dtype]
    info = np.iinfo(nd)
    rng = np.random.default_rng(11)
    a = rng.integers(info.min, info.max, 1000, dtype=nd, endpoint=True)
    a[:3] = info.min, info.max, 0
    divisors = [7, 1, 3, 0, info.max] + ([-1, -3, info.min] if info.min < 0 else [])
    for c in divisors:
        b = np.full_like(a, c)
        q, r = _xla_divrem(a, b, info.min == 0)
        for op, expected in (("div", q), ("rem", r)):
            out = run_elementwise([a], [dtype], dtype,
                                  lambda x, op=op, c=c: Binary(op, x, Const(int(c), dtype)))
            np.testing.assert_array_equal(out, expected.astype(nd), err_msg=f"{op} {c}")


@needs_libdevice
def test_one_ptxas_run_stands_for_the_renamed_copies() -> None:
    """``renamed_cubin_build``: ptxas's report of the canonical PTX is the report of each
    renamed copy's own PTX (same registers, spills, shared memory), filed under its name."""
    from stitch.codegen.errors import ToolchainError
    from stitch.codegen.gpu_cache import assemble_cached, canonical_kernel, renamed_cubin_build
    from stitch.codegen.toolchain import find_ptxas
    try:
        find_ptxas("sm_90")
    except ToolchainError:
        pytest.skip("no ptxas for sm_90")
    kernel = _renamed_params(warp_softmax_kernel(7, 300, "xor"), "softmax_k9", "_d")
    ptx = nvptx.emit_ptx(canonical_kernel(kernel), "sm_90")
    group = assemble_cached(ptx, "sm_90", cache=None, kernel_name=CANONICAL_NAME)
    own = assemble_cached(renamed_ptx(ptx, kernel.name), "sm_90", cache=None,
                          kernel_name=kernel.name)
    renamed = renamed_cubin_build(group, kernel.name)
    assert renamed.reports == own.reports and list(renamed.reports) == [kernel.name]
    from stitch.codegen.objcheck import cubin_problem
    assert cubin_problem(renamed.cubin) is None     # a valid sm_90 cubin (canonical names)


def _doubling_dag(depth: int, leaf: kir.Expr) -> kir.Expr:
    """An expression DAG of ``depth`` levels, each using the one below twice: 2**depth
    paths, ``depth`` objects (as lowering builds guarded concatenates and index math)."""
    e = leaf
    for _ in range(depth):
        e = Binary("add", e, e)
    return e


def test_validation_walks_shared_subexpressions_once() -> None:
    import time
    from stitch.codegen.errors import CodegenError
    from stitch.codegen.kir import Ref
    kernel = elementwise_kernel("dag", ["f32"], "f32", 256,
                                lambda x: _doubling_dag(40, x))   # 2**40 paths
    start = time.perf_counter()
    kernel.validate()
    assert time.perf_counter() - start < 2.0
    # An error inside the shared part is still found (and named).
    bad = elementwise_kernel("dag_bad", ["f32"], "f32", 256,
                             lambda x: _doubling_dag(40, Binary("add", x, Ref("nowhere", "f32"))))
    with pytest.raises(CodegenError, match="undefined variable 'nowhere'"):
        bad.validate()


def test_renamed_copy_of_a_valid_kernel_is_not_walked_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from stitch.codegen.errors import CodegenError
    from stitch.codegen.gpu_cache import canonical_kernel

    walks: list[str] = []
    real_run = kir.KernelChecker.run
    monkeypatch.setattr(kir.KernelChecker, "run", lambda self: (walks.append(self.k.name),
                                                           real_run(self))[1])
    kernel = _layer("main_k3", 0.5)
    canonical_kernel(kernel).validate()          # not validated yet: its copy is walked
    assert walks == [CANONICAL_NAME]
    kernel.validate()
    canonical = canonical_kernel(kernel)
    canonical.validate()
    assert walks == [CANONICAL_NAME, "main_k3"]
    assert canonical.name == CANONICAL_NAME and structure_key(canonical) == structure_key(kernel)
    # A name that is not an identifier makes the copy invalid: it is walked, and refused.
    with pytest.raises(CodegenError, match="not an identifier"):
        kernel.renamed("3 bad").validate()


def _warm_state() -> tuple[int, int, bool]:
    """In a PTX child: the source digests it holds, the compile caches it has open, and
    whether the default one is among them (asking for it is then a hit)."""
    from stitch.codegen import cache, gpu_cache
    opened = gpu_cache._child_cache.cache_info()
    gpu_cache._child_cache(str(cache.default_cache_dir()))
    return (cache.source_digest.cache_info().currsize, opened.currsize,
            gpu_cache._child_cache.cache_info().hits == opened.hits + 1)


def test_a_ptx_child_warms_the_key_facts_and_the_cache_as_it_starts(monkeypatch, tmp_path):
    """The PTX children the pass starts compute the facts every cache key holds (codegen's
    source digest, versions) and open the compile cache as they start (while the pass
    still plans): a kernel's build finds them ready. GpuPrebuild names that cache to them,
    opened in the calling thread, not in a build thread."""
    from stitch.codegen.isolation import IsolatedWorker
    from stitch.xla_pass import kernel_builds, ptx_children, entry as xla_pass

    monkeypatch.setenv("STITCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(kernel_builds, "_CACHE", None)
    worker = IsolatedWorker(name="warm-test", preload=ptx_children.PTX_CHILD_PRELOAD,
                            warm_up=ptx_children.PTX_CHILD_WARM_UP)
    try:
        worker.start()
        digests, caches_open, default_open = worker.call(_warm_state)
    finally:
        worker.close()
    assert digests >= 1 and caches_open == 1 and default_open
    with xla_pass.GpuPrebuild(xla_pass.PassRequest("f", "h100", "gpu", compile_only=True),
                              []) as prebuild:
        assert prebuild.arch == "sm_90" and prebuild._cache_dir == str(tmp_path / "cache")
        assert kernel_builds._CACHE is not None and kernel_builds._CACHE.enabled


@needs_libdevice
def test_a_structure_keyed_ptx_entry_serves_kernels_equal_but_for_names(tmp_path) -> None:
    """GpuPrebuild keys a canonical kernel's PTX by the structure key it already has: a
    kernel equal but for its parameters' names is a cache hit, with the same PTX."""
    from stitch.codegen.cache import CompileCache
    from stitch.codegen.gpu_cache import canonical_kernel, emit_ptx_cached, ptx_key

    cache = CompileCache(tmp_path / "cache")
    a = canonical_kernel(_layer("main_k3", 0.5))
    b = canonical_kernel(_renamed_params(_layer("main_k17", 0.5), "main_k17", "_layer2"))
    assert ptx_key(a, "sm_90", structure=structure_key(a)) != ptx_key(a, "sm_90")
    first = emit_ptx_cached(a, "sm_90", cache=cache, structure=structure_key(a))
    second = emit_ptx_cached(b, "sm_90", cache=cache, structure=structure_key(b))
    assert not first.from_cache and second.from_cache and second.ptx == first.ptx
    other = canonical_kernel(_layer("main_k3", 0.25))
    assert not emit_ptx_cached(other, "sm_90", cache=cache,
                               structure=structure_key(other)).from_cache


@needs_libdevice
def test_a_kernels_build_in_its_child_assembles_as_asked_and_caches(monkeypatch, tmp_path):
    """``build_in_child`` (what a PTX child runs for the pass): the PTX always, ptxas's
    result per ``assembly`` — "none" none, "must" the cubin or ptxas's error raised, "try"
    the cubin or the error handed back — and both through the cache it names."""
    from stitch.codegen import gpu_cache
    from stitch.codegen.errors import CodegenError, ToolchainError
    from stitch.codegen.toolchain import find_ptxas

    try:
        find_ptxas("sm_90")
    except ToolchainError as exc:
        pytest.skip(f"no ptxas for sm_90: {exc}")
    kernel = gpu_cache.canonical_kernel(_layer("main_k3", 0.5))
    key = structure_key(kernel)
    cache_dir = str(tmp_path / "cache")
    plain = gpu_cache.build_in_child(kernel, "sm_90", structure=key, cache_dir=cache_dir)
    assert f".entry {CANONICAL_NAME}(" in plain.ptx and plain.assembled is None
    must = gpu_cache.build_in_child(kernel, "sm_90", structure=key, cache_dir=cache_dir,
                                    assembly="must")
    assert must.ptx == plain.ptx and must.assembled.cubin[:4] == b"\x7fELF"
    assert not must.assembled.from_cache and must.assembly_error is None
    again = gpu_cache.build_in_child(kernel, "sm_90", structure=key, cache_dir=cache_dir,
                                     assembly="try")
    assert again.assembled.from_cache and again.assembled.cubin == must.assembled.cubin

    def refused(ptx, arch, **kwargs):
        raise ToolchainError("ptxas refused it (test)")
    monkeypatch.setattr(gpu_cache, "assemble_cached", refused)
    tried = gpu_cache.build_in_child(kernel, "sm_90", structure=key, cache_dir=None,
                                     assembly="try")
    assert tried.ptx == plain.ptx and tried.assembled is None
    assert "refused it" in str(tried.assembly_error)
    with pytest.raises(ToolchainError, match="refused it"):
        gpu_cache.build_in_child(kernel, "sm_90", structure=key, cache_dir=None,
                                 assembly="must")
    with pytest.raises(CodegenError, match="unknown assembly mode"):
        gpu_cache.build_in_child(kernel, "sm_90", structure=key, cache_dir=None,
                                 assembly="sometimes")


def test_a_bad_llvm_pipeline_setting_fails_the_gpu_build_once(monkeypatch, tmp_path, caplog):
    """GpuPrebuild reads $STITCH_LLVM_PIPELINE before any kernel is handed to a child: an
    unknown name stops the pass's build with one error naming it (the pass then leaves the
    module to XLA), a known one other than the default is logged."""
    import logging

    from stitch.codegen.errors import CodegenError
    from stitch.xla_pass import entry as xla_pass

    monkeypatch.setenv("STITCH_CACHE_DIR", str(tmp_path / "cache"))
    request = xla_pass.PassRequest("f", "h100", "gpu", compile_only=True)
    monkeypatch.setenv("STITCH_LLVM_PIPELINE", "O4")
    with pytest.raises(CodegenError, match="'O4' names no LLVM pipeline"):
        xla_pass.GpuPrebuild(request, [])
    monkeypatch.setenv("STITCH_LLVM_PIPELINE", "O2")
    with caplog.at_level(logging.INFO, logger=xla_pass.log.name):
        with xla_pass.GpuPrebuild(request, []):
            pass
    assert "LLVM pipeline STITCH_LLVM_PIPELINE=O2" in caplog.text
