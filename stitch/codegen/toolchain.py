"""Find and run the CUDA tools stitch needs: ``ptxas`` (PTX -> cubin, resource report) and
libdevice (the NVVM math library linked into kernels).

Discovery never guesses silently: when nothing is found, the ToolchainError lists every place
looked at and how to get the tools (``pip install stitch[cuda]`` or setting CUDA_HOME).
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import os
import pathlib
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field

from .errors import ToolchainError

log = logging.getLogger(__name__)

SUPPORTED_ARCHES: tuple[str, ...] = ("sm_70", "sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_90a")

# Toolkit roots probed after the environment; a module constant so tests can empty it.
DEFAULT_CUDA_ROOTS: tuple[pathlib.Path, ...] = (pathlib.Path("/usr/local/cuda"),)

# Inside the nvidia-cuda-nvcc-cu12 wheel: site-packages/nvidia/cuda_nvcc/{bin,nvvm/libdevice}.
# CUDA 13's wheels share one root: nvidia/cu13/bin/ptxas (nvidia-cuda-nvcc 13.x) and
# nvidia/cu13/nvvm/libdevice/libdevice.10.bc (nvidia-nvvm 13.x).
# ``nvidia`` and its subfolders are namespace packages (no __init__.py).
WHEEL_PACKAGES = ("cuda_nvcc", "cu13")
LIBDEVICE_NAME = "libdevice.10.bc"

_INSTALL_HINT = ("install the CUDA compiler wheel with `pip install stitch[cuda]`, or set CUDA_HOME "
                 "to a CUDA toolkit")


# ----------------------------------------------------------------------------------- discovery

def _cuda_roots() -> Iterator[tuple[str, pathlib.Path]]:
    """(label, root) for CUDA_HOME, CUDA_PATH and the default install locations."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(var)
        if value:
            yield f"${var}", pathlib.Path(value)
    for root in DEFAULT_CUDA_ROOTS:
        yield str(root), root


def _wheel_dirs() -> list[pathlib.Path]:
    """The wheels' toolkit roots (``nvidia/cuda_nvcc``, ``nvidia/cu13``), per namespace
    portion."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):  # ValueError: a broken half-imported 'nvidia' module
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return [pathlib.Path(p) / package for package in WHEEL_PACKAGES
            for p in spec.submodule_search_locations]


def _is_executable(path: pathlib.Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _not_found(what: str, searched: list[str], extra: str = "") -> ToolchainError:
    places = "\n".join(f"  - {s}" for s in searched)
    return ToolchainError(f"{what} not found{extra}. Searched:\n{places}\nTo fix: {_INSTALL_HINT}.")


def _ptxas_candidates() -> tuple[list[pathlib.Path], list[str]]:
    """Every ptxas found, in search order, and where each place looked was (for errors)."""
    searched: list[str] = []
    found: list[pathlib.Path] = []

    def add(path: pathlib.Path) -> None:
        if path not in found:
            found.append(path)

    on_path = shutil.which("ptxas")
    searched.append("ptxas on $PATH")
    if on_path:
        add(pathlib.Path(on_path))
    for label, root in _cuda_roots():
        candidate = root / "bin" / "ptxas"
        searched.append(f"{label}/bin/ptxas ({candidate})")
        if _is_executable(candidate):
            add(candidate)
    wheel_dirs = _wheel_dirs()
    if not wheel_dirs:
        searched.append("nvidia-cuda-nvcc-cu12 wheel (package 'nvidia' not importable)")
    for d in wheel_dirs:
        candidate = d / "bin" / "ptxas"
        searched.append(f"nvidia-cuda-nvcc-cu12 / nvidia-cuda-nvcc 13 wheel ({candidate})")
        if _is_executable(candidate):
            add(candidate)
    return found, searched


@functools.lru_cache(maxsize=16)
def _find_ptxas_cached(arch: str | None) -> pathlib.Path:
    explicit = os.environ.get("STITCH_PTXAS")
    if explicit:
        # An explicit override that is wrong is a configuration error, not a hint to keep
        # looking; it also wins for every arch (its own error then says what it lacks).
        path = pathlib.Path(explicit)
        if _is_executable(path):
            return path
        raise _not_found("ptxas", [f"$STITCH_PTXAS={path} (missing or not executable)"],
                         " at the path named by STITCH_PTXAS")
    found, searched = _ptxas_candidates()
    if not found:
        raise _not_found("ptxas", searched)
    if arch is None:
        return found[0]
    for path in found:
        arches = ptxas_arches(path)
        # An unreadable --help (a wrapper, an odd build) cannot rule the arch out.
        if not arches or arch in arches:
            return path
    seen = "\n".join(f"  - {p} (CUDA {_version_or_unknown(p)}: "
                      f"{', '.join(sorted(ptxas_arches(p), key=_arch_order)) or 'unknown'})"
                      for p in found)
    hint = (" CUDA 13 dropped Volta (sm_70): install a CUDA 12 ptxas with "
            "`pip install stitch[cuda]` or point STITCH_PTXAS at one."
            if arch.startswith("sm_7") else f" {_INSTALL_HINT}.")
    raise ToolchainError(f"no ptxas found supports {arch}; found:\n{seen}\n{hint.strip()}")


def _version_or_unknown(ptxas: pathlib.Path) -> str:
    try:
        return ptxas_version(ptxas)
    except ToolchainError:
        return "unknown"


def _arch_order(arch: str) -> tuple[int, str]:
    digits = re.sub(r"\D", "", arch)
    return (int(digits) if digits else 0, arch)


def find_ptxas(arch: str | None = None, *, refresh: bool = False) -> pathlib.Path:
    """Path of ``ptxas``. Order: $STITCH_PTXAS (always wins), $PATH, $CUDA_HOME/bin,
    $CUDA_PATH/bin, /usr/local/cuda/bin, the nvidia-cuda-nvcc-cu12 wheel. With ``arch``,
    the first of those that can assemble for it (CUDA 13's ptxas has no sm_70; the CUDA 12
    wheel's has). Cached; ``refresh`` searches again."""
    if refresh:
        _find_ptxas_cached.cache_clear()
    path = _find_ptxas_cached(arch)
    log.debug("ptxas%s: %s", f" for {arch}" if arch else "", path)
    return path


_ALLOWED_RE = re.compile(r"Allowed values for this option:(.*?)(?:Default value|\n\s*\n|$)",
                         re.S)


@functools.lru_cache(maxsize=16)
def _ptxas_arches_of(ptxas: pathlib.Path) -> frozenset[str]:
    try:
        proc = subprocess.run([str(ptxas), "--help"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return frozenset()
    text = proc.stdout + proc.stderr
    start = text.find("--gpu-name")
    match = _ALLOWED_RE.search(text, start) if start >= 0 else None
    if match is None:
        return frozenset()
    return frozenset(a for a in re.findall(r"'([a-z_0-9]+)'", match.group(1))
                     if a.startswith("sm_"))


def ptxas_arches(ptxas: pathlib.Path | None = None) -> frozenset[str]:
    """The real GPU arches (``sm_*``) ``ptxas`` can assemble for, from its ``--help``;
    empty when that cannot be read."""
    return _ptxas_arches_of(ptxas or find_ptxas())


@functools.lru_cache(maxsize=1)
def _find_libdevice_cached() -> pathlib.Path:
    searched: list[str] = []
    explicit = os.environ.get("STITCH_LIBDEVICE")
    if explicit:
        path = pathlib.Path(explicit)
        if path.is_file():
            return path
        searched.append(f"$STITCH_LIBDEVICE={path} (missing)")
        raise _not_found("libdevice", searched, " at the path named by STITCH_LIBDEVICE")

    candidates: list[tuple[str, pathlib.Path | None]] = [
        (f"{label}/nvvm/libdevice", root / "nvvm" / "libdevice" / LIBDEVICE_NAME)
        for label, root in _cuda_roots()]
    try:
        # resolve(): a ptxas on PATH may be a symlink into the real toolkit.
        ptxas = find_ptxas().resolve()
        candidates.append(("next to ptxas", ptxas.parent.parent / "nvvm" / "libdevice" / LIBDEVICE_NAME))
    except ToolchainError:
        candidates.append(("next to ptxas (no ptxas found)", None))
    wheel_dirs = _wheel_dirs()
    candidates += [("nvidia-cuda-nvcc-cu12 / nvidia-nvvm 13 wheel",
                    d / "nvvm" / "libdevice" / LIBDEVICE_NAME) for d in wheel_dirs]
    if not wheel_dirs:
        candidates.append(("nvidia-cuda-nvcc-cu12 wheel (package 'nvidia' not importable)", None))
    for label, candidate in candidates:
        if candidate is None:
            searched.append(label)
            continue
        searched.append(f"{label} ({candidate})")
        if candidate.is_file():
            return candidate
    raise _not_found("libdevice", searched)


def find_libdevice(*, refresh: bool = False) -> pathlib.Path:
    """Path of ``libdevice.10.bc``. Order: $STITCH_LIBDEVICE, $CUDA_HOME, $CUDA_PATH,
    /usr/local/cuda (each /nvvm/libdevice), ../nvvm/libdevice next to ptxas, the wheel."""
    if refresh:
        _find_libdevice_cached.cache_clear()
    return _find_libdevice_cached()


def clear_caches() -> None:
    """Forget every discovery result (tests, or after installing the toolkit at run time)."""
    _find_ptxas_cached.cache_clear()
    _find_libdevice_cached.cache_clear()
    _ptxas_version_of.cache_clear()
    _ptxas_arches_of.cache_clear()


_VERSION_RE = re.compile(r"\bV(\d+\.\d+\.\d+)\b")
_RELEASE_RE = re.compile(r"release (\d+\.\d+)")


@functools.lru_cache(maxsize=8)
def _ptxas_version_of(ptxas: pathlib.Path) -> str:
    try:
        proc = subprocess.run([str(ptxas), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ToolchainError(f"cannot run {ptxas} --version: {exc}") from exc
    text = proc.stdout + proc.stderr
    match = _VERSION_RE.search(text) or _RELEASE_RE.search(text)
    if proc.returncode != 0 or match is None:
        raise ToolchainError(f"cannot read the version of {ptxas} (exit {proc.returncode}): {text.strip()}")
    return match.group(1)


def ptxas_version(ptxas: pathlib.Path | None = None) -> str:
    """``ptxas --version`` as "major.minor.patch" (e.g. "13.0.88"); cached per binary."""
    return _ptxas_version_of(ptxas or find_ptxas())


# ------------------------------------------------------------------------------------ assembly

@dataclass(frozen=True)
class PtxasReport:
    """Resources ptxas reports (``-v``) for one kernel entry. Byte counts are per thread except
    shared (per block) and constant memory (per kernel; sm_90 ptxas stops reporting it -> 0)."""
    arch: str
    registers: int
    shared_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int
    cmem_bytes: int
    raw: str = field(repr=False)
    barriers: int = 0


_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_PROPS_RE = re.compile(r"Function properties for (\S+)")
_FRAME_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED_RE = re.compile(r"Used (\d+) registers")
_BARRIERS_RE = re.compile(r"used (\d+) barriers")
_SMEM_RE = re.compile(r"(\d+) bytes smem")
_CMEM_RE = re.compile(r"(\d+) bytes cmem\[\d+\]")
_CUMULATIVE_STACK_RE = re.compile(r"(\d+) bytes cumulative stack size")


@dataclass
class _EntryInfo:
    arch: str
    lines: list[str] = field(default_factory=list)
    registers: int = 0
    barriers: int = 0
    shared: int = 0
    cmem: int = 0
    cumulative_stack: int = 0


def parse_ptxas_verbose(text: str) -> dict[str, PtxasReport]:
    """Per-entry reports from ``ptxas -v`` output (it goes to stderr).

    Formats (CUDA 13.0): ``Compiling entry function 'k' for 'sm_80'``; ``Function properties for
    k`` followed by ``    N bytes stack frame, N bytes spill stores, N bytes spill loads``; ``Used N
    registers, used N barriers[, N bytes cumulative stack size][, N bytes smem][, N bytes
    cmem[0]]``. Property blocks also appear for non-entry functions; those are not reported.
    """
    entries: dict[str, _EntryInfo] = {}
    frames: dict[str, tuple[int, int, int]] = {}
    current: str | None = None   # entry whose "Used ..." line comes next
    props_of: str | None = None  # function whose stack-frame line comes next
    for line in text.splitlines():
        if m := _ENTRY_RE.search(line):
            current = m.group(1)
            entries[current] = _EntryInfo(arch=m.group(2))
            entries[current].lines.append(line)
            continue
        if m := _PROPS_RE.search(line):
            props_of = m.group(1)
            if props_of in entries:
                entries[props_of].lines.append(line)
            continue
        if m := _FRAME_RE.search(line):
            if props_of is not None:
                frames[props_of] = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
                if props_of in entries:
                    entries[props_of].lines.append(line)
            props_of = None
            continue
        if (m := _USED_RE.search(line)) and current is not None:
            info = entries[current]
            info.lines.append(line)
            info.registers = int(m.group(1))
            if b := _BARRIERS_RE.search(line):
                info.barriers = int(b.group(1))
            if s := _SMEM_RE.search(line):
                info.shared = int(s.group(1))
            info.cmem = sum(int(c) for c in _CMEM_RE.findall(line))
            if c := _CUMULATIVE_STACK_RE.search(line):
                info.cumulative_stack = int(c.group(1))
            current = None
    reports: dict[str, PtxasReport] = {}
    for name, info in entries.items():
        frame, spill_st, spill_ld = frames.get(name, (0, 0, 0))
        reports[name] = PtxasReport(
            arch=info.arch, registers=info.registers, shared_bytes=info.shared,
            spill_store_bytes=spill_st, spill_load_bytes=spill_ld,
            # cumulative stack includes callees' frames; the entry's own frame is a lower bound.
            stack_bytes=max(frame, info.cumulative_stack), cmem_bytes=info.cmem,
            raw="\n".join(info.lines), barriers=info.barriers)
    return reports


def _check_arch(arch: str) -> None:
    if arch not in SUPPORTED_ARCHES:
        raise ToolchainError(f"unsupported GPU arch {arch!r}; expected one of {', '.join(SUPPORTED_ARCHES)}")


def assemble_cubin(ptx: str, arch: str, *, kernel_name: str | None = None, timeout: float = 60,
                   max_registers: int | None = None) -> tuple[bytes, dict[str, PtxasReport]]:
    """Assemble ``ptx`` for ``arch`` with ``ptxas -v``; return the cubin and per-entry reports.

    ``kernel_name`` restricts the reports to that entry (ToolchainError if absent);
    ``max_registers`` passes ``-maxrregcount``.
    """
    _check_arch(arch)
    ptxas = find_ptxas(arch)
    with tempfile.TemporaryDirectory(prefix="stitch-ptxas-") as tmp:
        src = pathlib.Path(tmp) / "kernel.ptx"
        out = pathlib.Path(tmp) / "kernel.cubin"
        src.write_text(ptx)
        cmd = [str(ptxas), f"-arch={arch}", "-v", str(src), "-o", str(out)]
        if max_registers is not None:
            cmd.insert(2, f"-maxrregcount={max_registers}")
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise ToolchainError(f"ptxas timed out after {timeout}s assembling for {arch}") from exc
        except OSError as exc:
            raise ToolchainError(f"cannot run {ptxas}: {exc}") from exc
        # Temp paths mean nothing to the reader; name the input as ptxas's caller sees it.
        output = (proc.stderr + proc.stdout).replace(str(src), "<ptx>")
        if proc.returncode != 0:
            raise ToolchainError(_failure_message(ptxas, arch, proc.returncode, output))
        cubin = out.read_bytes()
    reports = parse_ptxas_verbose(output)
    if kernel_name is not None:
        if kernel_name not in reports:
            raise ToolchainError(f"ptxas reported no entry {kernel_name!r} for {arch} "
                                 f"(entries: {sorted(reports)})")
        reports = {kernel_name: reports[kernel_name]}
    log.debug("ptxas %s: %s", arch, reports)
    return cubin, reports


def _failure_message(ptxas: pathlib.Path, arch: str, code: int, output: str) -> str:
    errors = [ln for ln in output.splitlines() if "error" in ln or "fatal" in ln] or output.splitlines()
    message = f"ptxas failed for {arch} (exit {code}):\n" + "\n".join(errors)
    if f"'{arch.removesuffix('a')}' is not defined" in output or f"'{arch}' is not defined" in output:
        try:
            version = ptxas_version(ptxas)
        except ToolchainError:
            version = "unknown"
        # CUDA 13 dropped offline compilation for Volta (sm_70); point at the way out.
        message += (f"\nThis ptxas ({ptxas}, version {version}) cannot target {arch}; point "
                    f"STITCH_PTXAS at a ptxas that does (e.g. from CUDA 12: `pip install stitch[cuda]`).")
    return message


def assemble(ptx: str, arch: str, *, kernel_name: str | None = None, timeout: float = 60,
             max_registers: int | None = None) -> dict[str, PtxasReport]:
    """Per-entry ptxas resource reports for ``ptx`` on ``arch`` (the cubin is discarded)."""
    return assemble_cubin(ptx, arch, kernel_name=kernel_name, timeout=timeout,
                          max_registers=max_registers)[1]
