"""Cached build products: a cached host object reaches MCJIT only when it is an ELF relocatable
object of this host (else rebuilt, never "LLVM ERROR: not a valid object file" or SIGILL);
every build takes the per-key lock (concurrent processes build each kernel once); PTX and
ptxas results go through the cache too."""
from __future__ import annotations

import multiprocessing
import os
import pathlib
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from stitch.codegen.cache import SECRET_NAME, CompileCache, decode_entry, encode_entry
from stitch.codegen.host import _object_key, compile_host, emit_host_ir
from stitch.codegen.objcheck import host_object_problem, host_objects_cacheable
from tests.test_kir_host import add, elementwise_kernel, mul

REPO = pathlib.Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not host_objects_cacheable(), reason="host objects are not ELF")


def fma_kernel(n: int = 777, name: str = "cache_fma"):
    return elementwise_kernel(name, ["f32", "f32"], "f32", n, lambda x, y: add(mul(x, y), x))


def entry_key(kernel) -> str:
    text, _ = emit_host_ir(kernel, True)
    return _object_key(text, 2)


def real_object(tmp_path: pathlib.Path) -> bytes:
    cache = CompileCache(tmp_path / "real")
    kernel = fma_kernel()
    compile_host(kernel, cache=cache)
    obj = cache.get(entry_key(kernel))
    assert obj is not None
    return obj


def with_machine(obj: bytes, machine: int) -> bytes:
    return obj[:18] + struct.pack("<H", machine) + obj[20:]


def aarch64_object() -> bytes:
    """The kernel compiled for aarch64 by LLVM's AArch64 back end (a real foreign object)."""
    import llvmlite.binding as llvm
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    text, _ = emit_host_ir(fma_kernel(), True)
    module = llvm.parse_assembly(text)
    module.triple = "aarch64-unknown-linux-gnu"
    tm = llvm.Target.from_triple(module.triple).create_target_machine(opt=2)
    module.data_layout = str(tm.target_data)
    return tm.emit_object(module)


def test_host_object_check(tmp_path):
    obj = real_object(tmp_path)
    assert host_object_problem(obj) is None
    assert "not an ELF" in host_object_problem(b"#!/bin/sh\nrm -rf ~\n")
    assert "not an ELF" in host_object_problem(b"")
    assert "truncated" in host_object_problem(obj[:40])
    assert "outside the file" in host_object_problem(obj[: len(obj) // 2]) or \
        "truncated" in host_object_problem(obj[: len(obj) // 2])
    assert "machine 183" in host_object_problem(with_machine(obj, 183)) or \
        "machine" in host_object_problem(with_machine(obj, 62))  # aarch64 (or x86-64 on arm)
    if host_object_problem(obj) is None and struct.unpack_from("<H", obj, 18)[0] != 183:
        assert "machine 183" in host_object_problem(aarch64_object())
    exe = obj[:16] + struct.pack("<H", 2) + obj[18:]
    assert "not a relocatable" in host_object_problem(exe)
    big_endian = obj[:5] + b"\x02" + obj[6:]
    assert "byte order" in host_object_problem(big_endian)


_LOADER = """
import sys
sys.path.insert(0, {repo!r})
import numpy as np
from stitch.codegen.cache import CompileCache
from stitch.codegen.host import compile_host
from tests.test_cache_objects import fma_kernel
cache = CompileCache({cache!r})
kernel = fma_kernel()
rng = np.random.default_rng(7)
x, y = (rng.standard_normal(777).astype(np.float32) for _ in range(2))
out = np.full(777, np.nan, np.float32)
host = compile_host(kernel, cache=cache)
host(x, y, out)
np.testing.assert_allclose(out, x * y + x, rtol=1e-6, atol=1e-6)
print("from_cache", host.from_cache, "invalid", cache.stats.invalid)
"""


@pytest.mark.parametrize("payload", ["truncated", "not-an-object", "aarch64", "valid"])
def test_planted_mac_valid_bad_object_is_rebuilt_not_loaded(tmp_path, payload):
    """Defence in depth behind the MAC: an entry that authenticates (made here with the
    secret) but is not a loadable object for this host is dropped and rebuilt; the process
    that meets it exits 0 with right numbers."""
    obj = real_object(tmp_path)
    directory = tmp_path / "planted"
    cache = CompileCache(directory)
    key = entry_key(fma_kernel())
    bad = {"truncated": obj[: len(obj) * 2 // 3], "not-an-object": b"\x00garbage" * 64,
           "aarch64": aarch64_object() if os.uname().machine != "aarch64" else with_machine(obj, 62),
           "valid": obj}[payload]
    secret = (directory / SECRET_NAME).read_bytes()
    (directory / f"{key}.bin").write_bytes(encode_entry(secret, key, bad))
    assert cache.get(key) == bad  # it authenticates: only the object check stands in the way
    script = _LOADER.format(repo=str(REPO), cache=str(directory))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=240, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "LLVM ERROR" not in run.stderr
    if payload == "valid":
        assert run.stdout.split() == ["from_cache", "True", "invalid", "0"]
    else:
        assert run.stdout.split() == ["from_cache", "False", "invalid", "1"]
        healed = decode_entry(secret, key, (directory / f"{key}.bin").read_bytes())
        assert healed is not None and host_object_problem(healed) is None


def _cold_builder(directory: str, start_at: float, out: multiprocessing.Queue) -> None:
    kernels = [fma_kernel(300 + 64 * i, f"race_{i}") for i in range(4)]
    cache = CompileCache(directory)
    time.sleep(max(0.0, start_at - time.time()))
    rng = np.random.default_rng(os.getpid())
    built = 0
    for kernel in kernels:
        host = compile_host(kernel, cache=cache)
        n = kernel.params[0].size
        x, y = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
        result = np.full(n, np.nan, np.float32)
        host(x, y, result)
        np.testing.assert_allclose(result, x * y + x, rtol=1e-6, atol=1e-6)
        built += not host.from_cache
    out.put(built)


def test_cold_processes_build_each_kernel_once(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    start_at = time.time() + 4.0  # all past interpreter and llvmlite start-up before racing
    procs = [ctx.Process(target=_cold_builder, args=(str(tmp_path / "c"), start_at, out))
             for _ in range(3)]
    for p in procs:
        p.start()
    builds = [out.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert sum(builds) == 4, f"builds per process: {builds} (4 kernels)"


# ---------------------------------------------------------------------------- GPU products

def _ptx_kernel():
    return elementwise_kernel("cache_ptx", ["f32"], "f32", 1000, lambda x: add(mul(x, x), x))


def test_ptx_built_once_then_served_and_forgeries_rebuilt(tmp_path):
    from stitch.codegen.gpu_cache import emit_ptx_cached, ptx_key
    from stitch.codegen.isolation import IsolatedWorker

    kernel = _ptx_kernel()
    with IsolatedWorker() as worker:
        cold = emit_ptx_cached(kernel, "sm_80", cache=CompileCache(tmp_path), worker=worker)
        warm = emit_ptx_cached(kernel, "sm_80", cache=CompileCache(tmp_path), worker=worker)
        assert not cold.from_cache and warm.from_cache and warm.ptx == cold.ptx
        assert ".entry cache_ptx(" in cold.ptx and worker.starts == 1
        other_arch = emit_ptx_cached(kernel, "sm_90", cache=CompileCache(tmp_path), worker=worker)
        assert not other_arch.from_cache and other_arch.ptx != cold.ptx
        key = ptx_key(kernel, "sm_80")
        (tmp_path / f"{key}.bin").write_bytes(encode_entry(os.urandom(32), key, b".entry evil("))
        cache = CompileCache(tmp_path)
        again = emit_ptx_cached(kernel, "sm_80", cache=cache, worker=worker)
        assert not again.from_cache and again.ptx == cold.ptx and cache.stats.corrupt == 1


def test_ptx_cached_per_llvm_pipeline(tmp_path, monkeypatch):
    """PTX built under one $STITCH_LLVM_PIPELINE is never served for another."""
    from stitch.codegen.gpu_cache import emit_ptx_cached, ptx_key
    from stitch.codegen.nvptx import PIPELINE_ENV, PIPELINES

    kernel = _ptx_kernel()
    monkeypatch.delenv(PIPELINE_ENV, raising=False)
    default = emit_ptx_cached(kernel, "sm_80", cache=CompileCache(tmp_path), isolated=False)
    assert ptx_key(kernel, "sm_80") == ptx_key(kernel, "sm_80", pipeline=PIPELINES["O3"])
    monkeypatch.setenv(PIPELINE_ENV, "O3-no-unroll")
    assert ptx_key(kernel, "sm_80") != ptx_key(kernel, "sm_80", pipeline=PIPELINES["O3"])
    other = emit_ptx_cached(kernel, "sm_80", cache=CompileCache(tmp_path), isolated=False)
    again = emit_ptx_cached(kernel, "sm_80", cache=CompileCache(tmp_path), isolated=False)
    assert not default.from_cache and not other.from_cache and again.from_cache
    monkeypatch.delenv(PIPELINE_ENV)
    assert emit_ptx_cached(kernel, "sm_80", cache=CompileCache(tmp_path),
                           isolated=False).from_cache


def test_ptxas_results_cached(tmp_path):
    from stitch.codegen.errors import ToolchainError
    from stitch.codegen.gpu_cache import assemble_cached, emit_ptx_cached
    from stitch.codegen.toolchain import find_ptxas

    try:
        find_ptxas("sm_80")
    except ToolchainError:
        pytest.skip("no ptxas for sm_80")
    ptx = emit_ptx_cached(_ptx_kernel(), "sm_80", cache=None).ptx
    cold = assemble_cached(ptx, "sm_80", cache=CompileCache(tmp_path), kernel_name="cache_ptx")
    warm = assemble_cached(ptx, "sm_80", cache=CompileCache(tmp_path), kernel_name="cache_ptx")
    assert not cold.from_cache and warm.from_cache
    assert warm.cubin == cold.cubin and warm.cubin[:4] == b"\x7fELF"
    assert warm.reports == cold.reports and cold.reports["cache_ptx"].registers > 0
