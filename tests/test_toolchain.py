"""ptxas/libdevice discovery and ptxas -v parsing, against the real ptxas where there is one."""
from __future__ import annotations

import os
import pathlib
import stat
import sys

import pytest

from stitch.codegen import toolchain
from stitch.codegen.errors import ToolchainError


def _have_ptxas() -> bool:
    try:
        toolchain.find_ptxas(refresh=True)
        return True
    except ToolchainError:
        return False


needs_ptxas = pytest.mark.skipif(not _have_ptxas(), reason="no ptxas on this machine")


@pytest.fixture(autouse=True)
def _fresh_discovery():
    toolchain.clear_caches()
    path = list(sys.path)
    yield
    toolchain.clear_caches()
    # (checked after monkeypatch's undo: this fixture is set up before it)
    assert sys.path == path, "a test left sys.path changed"


def _header(arch: str = "sm_70", version: str = "7.8") -> str:
    return f".version {version}\n.target {arch}\n.address_size 64\n\n"


# y[i] = x[i] + 1 guarded by n: a handful of registers, no stack, no shared memory.
ADD_ONE = """
.visible .entry add_one(.param .u64 p_x, .param .u64 p_y, .param .u32 p_n)
{
    .reg .pred %p<2>;
    .reg .b32 %r<6>;
    .reg .f32 %f<3>;
    .reg .b64 %rd<8>;
    ld.param.u64 %rd1, [p_x];
    ld.param.u64 %rd2, [p_y];
    ld.param.u32 %r1, [p_n];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.s32 %r5, %r2, %r3, %r4;
    setp.ge.s32 %p1, %r5, %r1;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd3, %rd1;
    cvta.to.global.u64 %rd4, %rd2;
    mul.wide.s32 %rd5, %r5, 4;
    add.s64 %rd6, %rd3, %rd5;
    ld.global.f32 %f1, [%rd6];
    add.f32 %f2, %f1, 0f3F800000;
    add.s64 %rd7, %rd4, %rd5;
    st.global.f32 [%rd7], %f2;
DONE:
    ret;
}
"""

# A 1 KiB shared buffer exchanged across a barrier, and a dynamically indexed local array.
SMEM_AND_LOCAL = """
.visible .entry smem_k(.param .u64 p_x)
{
    .shared .align 4 .b8 buf[1024];
    .reg .b32 %r<4>;
    .reg .f32 %f<3>;
    .reg .b64 %rd<6>;
    ld.param.u64 %rd1, [p_x];
    cvta.to.global.u64 %rd2, %rd1;
    mov.u32 %r1, %tid.x;
    mul.wide.u32 %rd3, %r1, 4;
    add.s64 %rd4, %rd2, %rd3;
    ld.global.f32 %f1, [%rd4];
    mov.u64 %rd5, buf;
    cvt.u32.u64 %r2, %rd5;
    shl.b32 %r3, %r1, 2;
    add.u32 %r2, %r2, %r3;
    st.shared.f32 [%r2], %f1;
    bar.sync 0;
    xor.b32 %r3, %r3, 4;
    cvt.u32.u64 %r2, %rd5;
    add.u32 %r2, %r2, %r3;
    ld.shared.f32 %f2, [%r2];
    st.global.f32 [%rd4], %f2;
    ret;
}

.visible .entry local_k(.param .u64 p_x, .param .u32 p_i)
{
    .local .align 4 .b8 arr[64];
    .reg .b32 %r<4>;
    .reg .f32 %f<3>;
    .reg .b64 %rd<8>;
    ld.param.u64 %rd1, [p_x];
    ld.param.u32 %r1, [p_i];
    cvta.to.global.u64 %rd2, %rd1;
    ld.global.f32 %f1, [%rd2];
    mov.u64 %rd3, arr;
    cvta.local.u64 %rd4, %rd3;
    and.b32 %r2, %r1, 15;
    mul.wide.u32 %rd5, %r2, 4;
    add.s64 %rd6, %rd4, %rd5;
    st.f32 [%rd6], %f1;
    xor.b32 %r3, %r2, 7;
    mul.wide.u32 %rd5, %r3, 4;
    add.s64 %rd6, %rd4, %rd5;
    ld.f32 %f2, [%rd6];
    st.global.f32 [%rd2+4], %f2;
    ret;
}
"""


def _many_live_values(n: int = 48) -> str:
    """n volatile loads all live at once: spills when registers are capped."""
    body = [f"    ld.volatile.global.f32 %f{i}, [%rd2+{4 * i}];" for i in range(n)]
    body += [f"    mul.f32 %f{n + i}, %f{i}, %f{n - 1 - i};" for i in range(n)]
    body += [f"    st.volatile.global.f32 [%rd2+{4 * i}], %f{n + i};" for i in range(n)]
    return ("\n.visible .entry spill_k(.param .u64 p_x)\n{\n"
            f"    .reg .f32 %f<{2 * n}>;\n    .reg .b64 %rd<3>;\n"
            "    ld.param.u64 %rd1, [p_x];\n    cvta.to.global.u64 %rd2, %rd1;\n"
            + "\n".join(body) + "\n    ret;\n}\n")


def _ptxas_major() -> int:
    return int(toolchain.ptxas_version().split(".")[0])


# ------------------------------------------------------------------------------- real ptxas

@needs_ptxas
def test_ptxas_and_libdevice_found_and_versioned():
    ptxas = toolchain.find_ptxas()
    assert ptxas.is_file() and os.access(ptxas, os.X_OK)
    version = toolchain.ptxas_version()
    assert len(version.split(".")) == 3 and all(p.isdigit() for p in version.split("."))
    assert toolchain.find_libdevice().name == "libdevice.10.bc"


@needs_ptxas
@pytest.mark.parametrize("arch", ["sm_70", "sm_80", "sm_90"])
def test_assemble_simple_kernel(arch):
    ptx = _header("sm_70") + ADD_ONE
    if not any(arch in toolchain.ptxas_arches(p) for p in toolchain._ptxas_candidates()[0]):
        # CUDA 13 dropped Volta and no CUDA 12 ptxas is installed: the error must say so
        # and point at the fix.
        with pytest.raises(ToolchainError, match="sm_70") as info:
            toolchain.assemble(ptx, arch)
        assert "STITCH_PTXAS" in str(info.value)
        return
    assert arch in toolchain.ptxas_arches(toolchain.find_ptxas(arch))
    cubin, reports = toolchain.assemble_cubin(ptx, arch)
    assert cubin[:4] == b"\x7fELF"
    report = reports["add_one"]
    assert report.arch == arch
    assert 0 < report.registers <= 32
    assert (report.spill_store_bytes, report.spill_load_bytes, report.stack_bytes) == (0, 0, 0)
    assert report.shared_bytes == 0
    assert "add_one" in report.raw


@needs_ptxas
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_shared_and_local_memory_parsed(arch):
    reports = toolchain.assemble(_header("sm_75") + SMEM_AND_LOCAL, arch)
    assert set(reports) == {"smem_k", "local_k"}
    assert reports["smem_k"].shared_bytes == 1024
    assert reports["smem_k"].barriers == 1
    assert reports["local_k"].stack_bytes == 64
    assert reports["local_k"].shared_bytes == 0
    only = toolchain.assemble(_header("sm_75") + SMEM_AND_LOCAL, arch, kernel_name="smem_k")
    assert list(only) == ["smem_k"]


@needs_ptxas
def test_register_cap_forces_spills():
    ptx = _header("sm_80") + _many_live_values()
    free = toolchain.assemble(ptx, "sm_80")["spill_k"]
    capped = toolchain.assemble(ptx, "sm_80", max_registers=24)["spill_k"]
    assert free.spill_store_bytes == 0 and free.registers > 24
    assert capped.registers <= 24
    assert capped.spill_store_bytes > 0 and capped.spill_load_bytes > 0
    assert capped.stack_bytes >= capped.spill_store_bytes // 2


@needs_ptxas
def test_invalid_ptx_raises_with_ptxas_message():
    bad = (_header("sm_80") + ADD_ONE).replace("add.f32", "addx.f32")
    with pytest.raises(ToolchainError) as info:
        toolchain.assemble(bad, "sm_80")
    message = str(info.value)
    assert "sm_80" in message and "addx" in message
    assert "stitch-ptxas-" not in message  # temp paths hidden


@needs_ptxas
def test_missing_kernel_name_raises():
    with pytest.raises(ToolchainError, match="no_such"):
        toolchain.assemble(_header("sm_80") + ADD_ONE, "sm_80", kernel_name="no_such")


def test_unknown_arch_rejected_before_running_anything():
    with pytest.raises(ToolchainError, match="sm_61"):
        toolchain.assemble(ADD_ONE, "sm_61")


# --------------------------------------------------------------------------------- parsing

def test_parse_verbose_formats():
    # Lines as printed by ptxas 13.0 (sm_80 with cmem; sm_90 without; a non-entry function).
    text = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k1' for 'sm_80'
ptxas info    : Function properties for k1
    48 bytes stack frame, 68 bytes spill stores, 60 bytes spill loads
ptxas info    : Used 24 registers, used 1 barriers, 48 bytes cumulative stack size, 2048 bytes smem, 360 bytes cmem[0], 8 bytes cmem[2]
ptxas info    : Compile time = 4.614 ms
ptxas info    : Function properties for helper
    16 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Compiling entry function 'k2' for 'sm_90'
ptxas info    : Function properties for k2
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, used 0 barriers
"""
    reports = toolchain.parse_ptxas_verbose(text)
    assert set(reports) == {"k1", "k2"}
    k1, k2 = reports["k1"], reports["k2"]
    assert (k1.arch, k1.registers, k1.barriers, k1.shared_bytes) == ("sm_80", 24, 1, 2048)
    assert (k1.spill_store_bytes, k1.spill_load_bytes, k1.stack_bytes) == (68, 60, 48)
    assert k1.cmem_bytes == 368
    assert (k2.arch, k2.registers, k2.cmem_bytes, k2.stack_bytes) == ("sm_90", 10, 0, 0)


def test_parse_cuda12_style_used_line():
    text = ("ptxas info    : Compiling entry function 'k' for 'sm_70'\n"
            "ptxas info    : Function properties for k\n"
            "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
            "ptxas info    : Used 8 registers, 356 bytes cmem[0]\n")
    report = toolchain.parse_ptxas_verbose(text)["k"]
    assert (report.registers, report.cmem_bytes, report.barriers) == (8, 356, 0)


# ------------------------------------------------------------------------------- discovery

def _isolate_environment(monkeypatch, tmp_path: pathlib.Path) -> None:
    """No ptxas anywhere: empty PATH, no CUDA_HOME/CUDA_PATH, no default roots, no wheel."""
    for var in ("STITCH_PTXAS", "STITCH_LIBDEVICE", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setattr(toolchain, "DEFAULT_CUDA_ROOTS", (tmp_path / "no-cuda",))
    monkeypatch.delitem(sys.modules, "nvidia", raising=False)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not (pathlib.Path(p or ".") / "nvidia").is_dir()])


def test_env_override_to_bogus_path(monkeypatch, tmp_path):
    bogus = tmp_path / "nowhere" / "ptxas"
    monkeypatch.setenv("STITCH_PTXAS", str(bogus))
    with pytest.raises(ToolchainError) as info:
        toolchain.find_ptxas(refresh=True)
    message = str(info.value)
    assert str(bogus) in message and "STITCH_PTXAS" in message
    assert "pip install stitch[cuda]" in message and "CUDA_HOME" in message


def test_nothing_found_lists_every_place(monkeypatch, tmp_path):
    _isolate_environment(monkeypatch, tmp_path)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda-home"))
    with pytest.raises(ToolchainError) as info:
        toolchain.find_ptxas(refresh=True)
    message = str(info.value)
    for place in ("$PATH", "$CUDA_HOME", str(tmp_path / "cuda-home"), str(tmp_path / "no-cuda"),
                  "nvidia-cuda-nvcc-cu12"):
        assert place in message
    with pytest.raises(ToolchainError, match="libdevice"):
        toolchain.find_libdevice(refresh=True)


def _prepend_syspath(monkeypatch, path: pathlib.Path) -> None:
    """sys.path with ``path`` first, undone with the other setattrs. Not
    monkeypatch.syspath_prepend: its undo runs after setattr's and writes the list it saved
    (the one _isolate_environment filtered, without site-packages once the CUDA wheel is
    installed there) into the restored sys.path: later tests' child processes then could
    not import llvmlite."""
    import importlib
    monkeypatch.setattr(sys, "path", [str(path), *sys.path])
    importlib.invalidate_caches()


def _fake_executable(path: pathlib.Path, script: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def test_wheel_layout_discovered(monkeypatch, tmp_path):
    real = None
    if _have_ptxas():
        real = toolchain.find_ptxas(refresh=True).resolve()
    _isolate_environment(monkeypatch, tmp_path)
    site = tmp_path / "site"
    pkg = site / "nvidia" / "cuda_nvcc"  # namespace packages, as the wheel ships them
    script = f'#!/bin/sh\nexec "{real}" "$@"\n' if real else "#!/bin/sh\necho 'Cuda compilation tools, release 12.9, V12.9.86'\n"
    _fake_executable(pkg / "bin" / "ptxas", script)
    libdevice = pkg / "nvvm" / "libdevice" / "libdevice.10.bc"
    libdevice.parent.mkdir(parents=True)
    libdevice.write_bytes(b"BC\xc0\xde")
    _prepend_syspath(monkeypatch, site)

    assert toolchain.find_ptxas(refresh=True) == pkg / "bin" / "ptxas"
    assert toolchain.find_libdevice(refresh=True) == libdevice
    version = toolchain.ptxas_version()
    assert version == (toolchain.ptxas_version(real) if real else "12.9.86")


def test_search_order_env_then_path_then_cuda_home(monkeypatch, tmp_path):
    _isolate_environment(monkeypatch, tmp_path)
    home = tmp_path / "cuda-home"
    _fake_executable(home / "bin" / "ptxas", "#!/bin/sh\nexit 0\n")
    (home / "nvvm" / "libdevice").mkdir(parents=True)
    (home / "nvvm" / "libdevice" / "libdevice.10.bc").write_bytes(b"BC")
    monkeypatch.setenv("CUDA_HOME", str(home))
    assert toolchain.find_ptxas(refresh=True) == home / "bin" / "ptxas"
    assert toolchain.find_libdevice(refresh=True) == home / "nvvm" / "libdevice" / "libdevice.10.bc"

    on_path = tmp_path / "empty-bin" / "ptxas"
    _fake_executable(on_path, "#!/bin/sh\nexit 0\n")
    assert toolchain.find_ptxas() == home / "bin" / "ptxas"  # cached until refresh
    assert toolchain.find_ptxas(refresh=True) == on_path

    explicit = tmp_path / "explicit" / "ptxas"
    _fake_executable(explicit, "#!/bin/sh\nexit 0\n")
    monkeypatch.setenv("STITCH_PTXAS", str(explicit))
    assert toolchain.find_ptxas(refresh=True) == explicit


def _fake_ptxas(path: pathlib.Path, version: str, arches: list[str]) -> pathlib.Path:
    """A ptxas that answers --version and --help like the real one (CUDA 12/13 layout);
    shell builtins only: the isolated PATH is empty."""
    allowed = ",".join(f"'{a}'" for a in arches)
    _fake_executable(path, f"""#!/bin/sh
case "$1" in
  --version) echo 'Cuda compilation tools, release {version.rsplit(".", 1)[0]}, V{version}';;
  --help) echo "--gpu-name <gpu name>   (-arch)"
          echo "        Allowed values for this option:  {allowed}."
          echo "        Default value:  'sm_75'."
          echo ""
          echo "--help (-h)";;
  *) exit 0;;
esac
""")
    return path


def test_ptxas_arches_parsed_from_help(monkeypatch, tmp_path):
    fake = _fake_ptxas(tmp_path / "bin" / "ptxas", "12.9.86",
                       ["compute_70", "sm_70", "sm_80", "sm_90", "sm_90a"])
    assert toolchain.ptxas_arches(fake) == {"sm_70", "sm_80", "sm_90", "sm_90a"}
    silent = tmp_path / "silent" / "ptxas"
    _fake_executable(silent, "#!/bin/sh\nexit 0\n")
    assert toolchain.ptxas_arches(silent) == frozenset()


def test_ptxas_chosen_by_arch(monkeypatch, tmp_path):
    """CUDA 13's ptxas on PATH wins for sm_80/sm_90; sm_70 goes to the CUDA 12 wheel's."""
    _isolate_environment(monkeypatch, tmp_path)
    new = _fake_ptxas(tmp_path / "empty-bin" / "ptxas", "13.0.88", ["sm_75", "sm_80", "sm_90"])
    site = tmp_path / "site"
    old = _fake_ptxas(site / "nvidia" / "cuda_nvcc" / "bin" / "ptxas", "12.9.86",
                      ["sm_70", "sm_75", "sm_80", "sm_90"])
    _prepend_syspath(monkeypatch, site)
    assert toolchain.find_ptxas(refresh=True) == new
    assert toolchain.find_ptxas("sm_90") == new
    assert toolchain.find_ptxas("sm_70") == old
    with pytest.raises(ToolchainError, match="no ptxas found supports sm_60") as info:
        toolchain.find_ptxas("sm_60")
    assert "13.0.88" in str(info.value) and "12.9.86" in str(info.value)


def test_no_ptxas_for_volta_says_how_to_get_one(monkeypatch, tmp_path):
    _isolate_environment(monkeypatch, tmp_path)
    _fake_ptxas(tmp_path / "empty-bin" / "ptxas", "13.0.88", ["sm_75", "sm_80", "sm_90"])
    with pytest.raises(ToolchainError) as info:
        toolchain.find_ptxas("sm_70", refresh=True)
    message = str(info.value)
    assert "sm_70" in message and "pip install stitch[cuda]" in message
    assert "STITCH_PTXAS" in message


def test_explicit_ptxas_wins_for_every_arch(monkeypatch, tmp_path):
    explicit = _fake_ptxas(tmp_path / "explicit" / "ptxas", "13.0.88", ["sm_80"])
    monkeypatch.setenv("STITCH_PTXAS", str(explicit))
    assert toolchain.find_ptxas("sm_70", refresh=True) == explicit


@needs_ptxas
def test_a_kernels_machine_code_read_from_its_cubin():
    """``objcheck.cubin_code``: equal for PTX that differs only in what ptxas ignores (a
    comment, register names), different when the instructions differ, None for an entry
    the cubin does not hold; a non-cubin is refused."""
    from stitch.codegen.objcheck import cubin_code
    arch = "sm_90" if "sm_90" in toolchain.ptxas_arches(toolchain.find_ptxas()) else "sm_80"
    base, _ = toolchain.assemble_cubin(_header(arch) + ADD_ONE, arch)
    code = cubin_code(base, "add_one")
    assert code is not None and len(code) % 16 == 0 and len(code) > 0
    renamed = ADD_ONE.replace("%f", "%g").replace("DONE", "OUT")
    commented, _ = toolchain.assemble_cubin(_header(arch) + "// a comment\n" + renamed, arch)
    assert cubin_code(commented, "add_one") == code
    plus_two, _ = toolchain.assemble_cubin(
        _header(arch) + ADD_ONE.replace("0f3F800000", "0f40000000"), arch)
    assert cubin_code(plus_two, "add_one") != code
    assert cubin_code(base, "add_two") is None
    with pytest.raises(ValueError, match="not a cubin"):
        cubin_code(b"\x7fELF" + bytes(100), "add_one")


def test_cuda13_wheel_layout_discovered(monkeypatch, tmp_path):
    """CUDA 13's wheels put ptxas in nvidia/cu13/bin (nvidia-cuda-nvcc) and libdevice in
    nvidia/cu13/nvvm/libdevice (nvidia-nvvm), the layout the GPU machine's jax plugin has."""
    _isolate_environment(monkeypatch, tmp_path)
    site = tmp_path / "site"
    root = site / "nvidia" / "cu13"
    _fake_executable(root / "bin" / "ptxas",
                     "#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    libdevice = root / "nvvm" / "libdevice" / "libdevice.10.bc"
    libdevice.parent.mkdir(parents=True)
    libdevice.write_bytes(b"BC\xc0\xde")
    _prepend_syspath(monkeypatch, site)
    assert toolchain.find_ptxas(refresh=True) == root / "bin" / "ptxas"
    assert toolchain.ptxas_version() == "13.0.88"
    # libdevice alone (nvidia-nvvm without the nvcc wheel) is found too.
    (root / "bin" / "ptxas").unlink()
    toolchain.clear_caches()
    assert toolchain.find_libdevice(refresh=True) == libdevice
