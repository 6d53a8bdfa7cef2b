"""GPU build products through the compile cache: PTX emission and ptxas results.

The entry points every caller uses (stitch.compile and the XLA pass), so all get
caching, the per-key build lock and crash isolation by calling them:

- ``emit_ptx_cached(kernel, arch, cache=...)`` -> ``PtxBuild``: PTX from LLVM's NVPTX back end,
  emitted in an isolated child (an LLVM abort cannot take the caller down). Keyed by the
  Kernel IR (its complete repr), arch, PTX ISA version, libdevice (path, size, mtime), the
  llvmlite version, the stitch version and a digest of codegen's source (``source_digest``).
- ``assemble_cached(ptx, arch, cache=...)`` -> ``CubinBuild``: ptxas's cubin and per-entry
  resource reports. Keyed by the PTX text, arch, options, the ptxas binary and its version.
- ``build_in_child(kernel, arch, ...)`` -> ``ChildBuild``: both of the above, run inside an
  isolated child (``IsolatedWorker.call``), the cache opened there; the XLA pass's build
  threads make one round trip per kernel.

Host object code goes through the same cache in ``host.compile_host`` / ``ffi.compile_handler``
(``host.jit_module``). With ``cache=None`` everything is built, nothing stored.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import json
import logging
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from stitch.codegen import kir
from stitch.codegen.cache import CODEGEN_PACKAGES, CompileCache, cache_key, source_digest
from stitch.codegen.errors import CodegenError
from stitch.codegen.isolation import IsolatedWorker, run_isolated
from stitch.codegen.nvptx import (DEFAULT_PTX_VERSION, LlvmPipeline, default_libdevice_path, emit_ptx,
                                  pipeline_name, pipeline_setting)
from stitch.codegen.objcheck import cubin_problem
from stitch.codegen.toolchain import PtxasReport, assemble_cubin, find_ptxas, ptxas_version

LOG = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def stitch_version() -> str:
    """The installed stitch distribution's version (codegen never imports the stitch package)."""
    try:
        return importlib.metadata.version("stitch")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def kernel_ir_text(kernel: kir.Kernel) -> str:
    """The Kernel IR as text for keys, complete by construction (``printer.format_kernel``
    is written for people, not for identity): every dataclass field, in order, strings and
    numbers as their repr. Expressions are DAGs (the dataclasses' own repr writes every
    path: exponential in the sharing), so each structurally distinct expression is defined
    once, ``@n=Type(field=...)`` with its operands as ``@k``, and used as ``@n``: the text
    depends on the structure only, not on which equal subexpressions share an object."""
    numbers: dict[tuple, int] = {}        # an expression's flat key -> its number
    by_object: dict[int, int] = {}        # id -> number (the kernel keeps objects alive)
    definitions: list[str] = []

    def number(e: kir.Expr) -> int:
        got = by_object.get(id(e))
        if got is not None:
            return got
        fields = []
        for f in dataclasses.fields(e):
            value = getattr(e, f.name)
            fields.append(f"{f.name}=@{number(value)}" if isinstance(value, kir.Expr)
                          else f"{f.name}={value!r}")
        key = (type(e).__name__, *fields)
        got = numbers.get(key)
        if got is None:
            got = numbers[key] = len(numbers)
            definitions.append(f"@{got}={key[0]}({','.join(fields)})")
        by_object[id(e)] = got
        return got

    out: list[str] = []

    def write(obj: object) -> None:
        if isinstance(obj, kir.Expr):
            out.append(f"@{number(obj)}")
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            out.append(type(obj).__name__ + "(")
            for f in dataclasses.fields(obj):
                out.append(f.name + "=")
                write(getattr(obj, f.name))
                out.append(",")
            out.append(")")
        elif isinstance(obj, (list, tuple)):
            out.append("[" if isinstance(obj, list) else "(")
            for item in obj:
                write(item)
                out.append(",")
            out.append("]" if isinstance(obj, list) else ")")
        elif isinstance(obj, dict):
            out.append("{")
            for key, value in obj.items():
                write(key)
                out.append(":")
                write(value)
                out.append(",")
            out.append("}")
        else:
            out.append(repr(obj))

    write(kernel)
    return "\n".join(definitions) + "\n" + "".join(out)


def libdevice_identity(libdevice: str | Path | None = None) -> str:
    path = Path(libdevice) if libdevice is not None else default_libdevice_path()
    if path is None:
        return "none"
    try:
        st = path.stat()
    except OSError:
        return f"{path}:missing"
    return f"{path}:{st.st_size}:{int(st.st_mtime)}"


def ptx_key(kernel: kir.Kernel, arch: str, *, ptx_version: int = DEFAULT_PTX_VERSION,
            libdevice: str | Path | None = None, structure: str | None = None,
            pipeline: LlvmPipeline | None = None) -> str:
    """The PTX cache key. ``structure``: a canonical kernel's ``structure_key`` when the
    caller has it (``canonical_kernel``s of equal structure have equal PTX, so it identifies
    the PTX as well as the Kernel IR's text does, and saves writing that text again).
    ``pipeline``: the LLVM pipeline it is built with (None: ``pipeline_setting()``)."""
    import llvmlite
    identity = ("structure", structure) if structure is not None \
        else ("kernel", kernel_ir_text(kernel))
    return cache_key("ptx", *identity, arch, str(ptx_version),
                     libdevice_identity(libdevice), llvmlite.__version__, stitch_version(),
                     source_digest(CODEGEN_PACKAGES),
                     pipeline_name(pipeline or pipeline_setting()))


@dataclass(frozen=True)
class PtxBuild:
    ptx: str
    from_cache: bool


def _ptx_validator(kernel_name: str):
    def problem(payload: bytes) -> str | None:
        try:
            text = payload.decode("utf-8")
        except UnicodeDecodeError:
            return "PTX is not UTF-8 text"
        return None if f".entry {kernel_name}(" in text else f"PTX has no .entry {kernel_name}"
    return problem


def emit_ptx_cached(kernel: kir.Kernel, arch: str, *, cache: CompileCache | None,
                    worker: IsolatedWorker | None = None, libdevice: str | Path | None = None,
                    ptx_version: int = DEFAULT_PTX_VERSION, timeout: float = 300.0,
                    structure: str | None = None, isolated: bool = True) -> PtxBuild:
    """PTX for ``kernel`` on ``arch``: from ``cache`` when there, else emitted once (under the
    key's lock) in ``worker``'s child or a fresh isolated child, and stored. ``isolated``
    False: emitted in this process (the caller is an isolated child already). Errors in
    emission: CodegenError (IsolatedCrash when the child died)."""
    built = False
    # Read once: the key and the build agree on it ($STITCH_LLVM_PIPELINE).
    pipeline = pipeline_setting()

    def build() -> bytes:
        nonlocal built
        built = True
        kwargs = {"libdevice": libdevice, "ptx_version": ptx_version, "pipeline": pipeline}
        if not isolated:
            text = emit_ptx(kernel, arch, **kwargs)
        elif worker is not None:
            text = worker.call(emit_ptx, kernel, arch, timeout=timeout, **kwargs)
        else:
            text = run_isolated(emit_ptx, kernel, arch, timeout=timeout, **kwargs)
        return text.encode("utf-8")

    if cache is None:
        return PtxBuild(build().decode("utf-8"), False)
    key = ptx_key(kernel, arch, ptx_version=ptx_version, libdevice=libdevice,
                  structure=structure, pipeline=pipeline)
    payload = cache.get_or_create(key, build, validate=_ptx_validator(kernel.name))
    return PtxBuild(payload.decode("utf-8"), not built)


# Kernels that differ only by their names and their parameters' names (XLA modules repeat a
# fusion per layer; a training step's forward and backward share many) are emitted once:
# under CANONICAL_NAME, then renamed. A parameter's name never reaches the PTX (NVPTX names
# parameters <entry>_param_<i>); the kernel's name does, in its entry and the identifiers
# made from it (parameters, shared arrays).
CANONICAL_NAME = "stitch_canonical_kernel"
_CANONICAL = re.compile(r"(?<![A-Za-z0-9_$])" + CANONICAL_NAME + r"(?![A-Za-z0-9$])")


def canonical_kernel(kernel: kir.Kernel) -> kir.Kernel:
    """``kernel`` under CANONICAL_NAME (its PTX is the kernel's, renamed; a validated
    kernel's copy is known valid, so the PTX child does not walk it again)."""
    return kernel.renamed(CANONICAL_NAME)


def renamed_ptx(ptx: str, name: str) -> str:
    """The canonical kernel's PTX (``canonical_kernel``) for the kernel called ``name``: its
    entry and every identifier made from its name renamed."""
    return _CANONICAL.sub(name, ptx)


def structure_key(kernel: kir.Kernel) -> str:
    """Equal for kernels whose PTX differs only by the kernel's name: the Kernel IR's text
    under CANONICAL_NAME with each parameter's name (quoted, wherever it is used) replaced
    by its position. Names are identifiers, so the quoted forms cannot clash."""
    text = kernel_ir_text(canonical_kernel(kernel))
    if not kernel.params:
        return text
    position = {repr(p.name): f"'#{i}'" for i, p in enumerate(kernel.params)}
    pattern = re.compile("|".join(re.escape(quoted) for quoted in position))
    return pattern.sub(lambda m: position[m.group(0)], text)


def renamed_cubin_build(build: "CubinBuild", name: str) -> "CubinBuild":
    """ptxas's result for a canonical kernel's PTX (``canonical_kernel``), as the result for
    the kernel called ``name``: its resource report filed under ``name`` (ptxas's text
    renamed too). The cubin itself is
    the canonical one (its entry keeps CANONICAL_NAME): registers, spills and the machine
    code are those of the renamed PTX, which differs only by identifiers."""
    reports = {name if entry == CANONICAL_NAME else entry:
               dataclasses.replace(report, raw=_CANONICAL.sub(name, report.raw))
               for entry, report in build.reports.items()}
    return CubinBuild(build.cubin, reports, build.from_cache, entry=CANONICAL_NAME)


def distinct_kernels(kernels: list[kir.Kernel]) -> tuple[list[kir.Kernel], list[list[int]]]:
    """One canonical kernel (``canonical_kernel`` of the first) per group of ``kernels`` with
    equal ``structure_key``, in first-seen order, and for each the indices of its group."""
    groups: dict[str, list[int]] = {}
    for i, kernel in enumerate(kernels):
        groups.setdefault(structure_key(kernel), []).append(i)
    members = list(groups.values())
    return [canonical_kernel(kernels[group[0]]) for group in members], members


@dataclass(frozen=True)
class CubinBuild:
    cubin: bytes
    reports: dict[str, PtxasReport]
    from_cache: bool
    # The kernel's entry in ``cubin`` where it is not the kernel's own name (a renamed
    # canonical build: the cubin keeps CANONICAL_NAME).
    entry: str | None = None


_LEN = struct.Struct("<I")


def _pack_cubin(cubin: bytes, reports: dict[str, PtxasReport]) -> bytes:
    meta = json.dumps({name: dataclasses.asdict(r) for name, r in reports.items()}).encode()
    return _LEN.pack(len(meta)) + meta + cubin


def _unpack_cubin(payload: bytes) -> tuple[bytes, dict[str, PtxasReport]]:
    (n,) = _LEN.unpack_from(payload)
    meta = json.loads(payload[_LEN.size:_LEN.size + n])
    return payload[_LEN.size + n:], {name: PtxasReport(**fields) for name, fields in meta.items()}


def _cubin_entry_problem(payload: bytes) -> str | None:
    try:
        cubin, _ = _unpack_cubin(payload)
    except (struct.error, ValueError, TypeError, UnicodeDecodeError) as exc:
        return f"unreadable ptxas entry ({exc})"
    return cubin_problem(cubin)


def ptxas_key(ptx: str, arch: str, kernel_name: str | None = None,
              max_registers: int | None = None) -> str:
    """The cache key of ptxas's result for ``ptx`` (ToolchainError without a ptxas)."""
    ptxas = find_ptxas(arch)
    return cache_key("ptxas", ptx, arch, str(kernel_name), str(max_registers), str(ptxas),
                     ptxas_version(ptxas))


def assemble_cached(ptx: str, arch: str, *, cache: CompileCache | None,
                    kernel_name: str | None = None, max_registers: int | None = None,
                    timeout: float = 60) -> CubinBuild:
    """``toolchain.assemble_cubin`` through ``cache``: the cubin and per-entry reports."""
    built = False

    def build() -> bytes:
        nonlocal built
        built = True
        cubin, reports = assemble_cubin(ptx, arch, kernel_name=kernel_name, timeout=timeout,
                                        max_registers=max_registers)
        return _pack_cubin(cubin, reports)

    if cache is None:
        cubin, reports = _unpack_cubin(build())
        return CubinBuild(cubin, reports, False)
    key = ptxas_key(ptx, arch, kernel_name, max_registers)
    payload = cache.get_or_create(key, build, validate=_cubin_entry_problem)
    try:
        cubin, reports = _unpack_cubin(payload)
    except (struct.error, ValueError, TypeError) as exc:  # only a fresh build can get here
        raise CodegenError(f"ptxas result for {arch} cannot be read back: {exc}") from exc
    return CubinBuild(cubin, reports, not built)


# ---------------------------------------------------------------- a kernel's build in a child

@dataclass(frozen=True)
class ChildBuild:
    """A canonical kernel's GPU build as its PTX child hands it back (``build_in_child``):
    the PTX, ptxas's result when asked for, and why ptxas refused where that was allowed."""
    ptx: str
    assembled: CubinBuild | None = None
    assembly_error: CodegenError | None = None


ASSEMBLY_MODES = ("none", "try", "must")


@functools.lru_cache(maxsize=4)
def _child_cache(directory: str) -> CompileCache:
    return CompileCache(directory)


def build_in_child(kernel: kir.Kernel, arch: str, *, structure: str | None,
                   cache_dir: str | None, assembly: str = "none",
                   libdevice: str | Path | None = None,
                   ptx_version: int = DEFAULT_PTX_VERSION) -> ChildBuild:
    """A kernel's whole GPU build, run inside a PTX child (``IsolatedWorker.call``): the PTX
    from the compile cache at ``cache_dir`` or emitted here, then, per ``assembly``, ptxas
    (through the cache too): "none", "try" (a ToolchainError/CodegenError is handed back in
    ``assembly_error``) or "must" (it is raised).

    Why in the child: a build thread of the pass that did the cache's file work and ran
    ptxas itself gave up the GIL at each file operation and waited up to the interpreter's
    switch interval to get it back while the pass's thread lowered the next kernels in
    Python (0.2-0.4 s of a transformer step's build where the PTX children sat idle). The
    thread now makes one round trip per kernel."""
    if assembly not in ASSEMBLY_MODES:
        raise CodegenError(f"unknown assembly mode {assembly!r}: one of {ASSEMBLY_MODES}")
    cache = _child_cache(cache_dir) if cache_dir is not None else None
    ptx = emit_ptx_cached(kernel, arch, cache=cache, libdevice=libdevice,
                          ptx_version=ptx_version, structure=structure, isolated=False).ptx
    if assembly == "none":
        return ChildBuild(ptx)
    try:
        assembled = assemble_cached(ptx, arch, cache=cache, kernel_name=kernel.name)
    except CodegenError as exc:
        if assembly == "must":
            raise
        return ChildBuild(ptx, assembly_error=exc)
    return ChildBuild(ptx, assembled)


def cached_build(kernel: kir.Kernel, arch: str, *, cache: CompileCache, structure: str,
                 assembly: str = "none") -> ChildBuild | None:
    """``build_in_child``'s result where ``cache`` holds all of it (the PTX and, unless
    ``assembly`` is "none", ptxas's result), read in this process; None where any part is
    missing (nothing is built here)."""
    if assembly not in ASSEMBLY_MODES:
        raise CodegenError(f"unknown assembly mode {assembly!r}: one of {ASSEMBLY_MODES}")
    payload = cache.get(ptx_key(kernel, arch, structure=structure),
                        validate=_ptx_validator(kernel.name))
    if payload is None:
        return None
    ptx = payload.decode("utf-8")
    if assembly == "none":
        return ChildBuild(ptx)
    try:
        key = ptxas_key(ptx, arch, kernel.name)
    except CodegenError:                  # no ptxas: the build reports it
        return None
    assembled = cache.get(key, validate=_cubin_entry_problem)
    if assembled is None:
        return None
    cubin, reports = _unpack_cubin(assembled)
    return ChildBuild(ptx, CubinBuild(cubin, reports, True))


def warm_child() -> None:
    """A PTX child's start-up share of ``build_in_child``'s work, done while the pass still
    plans: the per-process facts every key holds (codegen's source digest, ~200 file reads;
    the stitch version; libdevice's identity; ptxas's version) and the default compile
    cache opened. A missing toolchain is left for the first build to report."""
    from stitch.codegen.cache import default_cache_dir
    source_digest(CODEGEN_PACKAGES)
    stitch_version()
    libdevice_identity()
    try:
        ptxas_version(find_ptxas())
    except CodegenError as exc:
        LOG.debug("warm_child: no ptxas yet (%s)", exc)
    _child_cache(str(default_cache_dir()))
