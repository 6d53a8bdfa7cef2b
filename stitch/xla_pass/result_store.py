"""A compile's whole pass result, kept for the next compile of the same module: a restarted
job, another process of the same job on the host, or the same function compiled again gets
the stitched module and its kernels back from the compile cache instead of planning,
lowering and rewriting again (``STITCH_PASS_RESULTS``, on by default).

The key (``result_key``) is everything the pass's output depends on: the module's text as XLA
gave it, its header's frontend attributes left out (XLA's ``fingerprint_before_lhs`` there
hashes the module *with* the request's token, so it differs in every compile); the request
(target, device, build-only, arch, loop bodies, explorer options, whether source lines were
asked for); every ``STITCH_*`` setting but those that change nothing the pass hands back
(``NOT_OUTPUT``); a digest of all of stitch's source files and the release; jax's and jaxlib's
versions. What is stored (``store_result``): the rewritten module's text, the report as data
(counts, names, reasons, the delivery's figures) and the placed kernels' Kernel IR
(``kir_data``), once per kernel that differs from another only by its name (a repeated
layer's kernels share one lowering's objects, ``lowering_reuse``), with each kernel's name and
its FFI target's name. It is stored once XLA has compiled the module the pass handed back
(``PassRequest.when_compiled``), by a thread of its own; not where a kernel failed to build
(the failure may not happen again).

Replaying (``replayed``) makes every kernel's FFI target again, as the pass makes them
(``kernel_builds.build_target``; PTX and ptxas's result, or host object code, from the
compile cache or built where missing), and uses the stored result only if each target's name
(a digest of its code and launch) is the one the stored module calls; anything else
(an entry that does not read back, a build that fails, a name that differs) runs the whole
pass instead, logged. The kernels are marked checked (``Kernel.known_valid``): every one of
them passed the check in the process that stored them, and the entry is authenticated by the
compile cache. The replayed report has no plan (``PassReport.plan`` is None) and
``from_store`` set.
"""
from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import re
import threading
import time
import zlib
from typing import Any

from stitch.config import env_flag

from .delivered import Delivery, Dropped, LoopCopy, Mover, Side
from .kernel_builds import (GpuBuild, GpuPrebuild, assembly_mode, build_target, compile_cache,
                            cubins_for_device)
from .pass_request import BuiltKernel, PassReport, PassRequest, untagged_attributes

log = logging.getLogger("stitch.xla_pass.results")

SETTING = "STITCH_PASS_RESULTS"
FORMAT = 1

# Settings that change nothing the pass hands back (where the log goes, when the switch
# happens, how many threads build): left out of the key, so they do not void it.
NOT_OUTPUT = frozenset({
    "STITCH_ENABLE", "STITCH_ASYNC", "STITCH_VERIFY", "STITCH_STATS", "STITCH_GUARD",
    "STITCH_CACHE_DIR", "STITCH_DUMP_MODULES", "STITCH_BUILD_THREADS",
    "STITCH_EARLY_PTX_CHILDREN", "STITCH_LOG", "STITCH_MIN_BYTES", SETTING})

# Where the rewritten module's header had its frontend attributes: the compile's own go
# there when the result is replayed.
_ATTRIBUTES_MARK = "{@stitch-frontend-attributes@}"
_HEADER_ATTRIBUTES = re.compile(r",\s*frontend_attributes=(?=\{)")


def enabled() -> bool:
    return env_flag(SETTING)


def split_header_attributes(text: str) -> tuple[str, str | None]:
    """``text`` (a module) with its header's ``frontend_attributes={...}`` left out, and
    that value (None: the header has none, or it does not close)."""
    end = text.find("\n")
    header = text if end < 0 else text[:end]
    found = _HEADER_ATTRIBUTES.search(header)
    if found is None:
        return text, None
    close = _closing_brace(header, found.end())
    if close is None:
        return text, None
    return header[:found.start()] + header[close:] + text[len(header):], \
        header[found.end():close]


def _closing_brace(text: str, start: int) -> int | None:
    """The index after the brace closing the one at ``start`` (strings skipped)."""
    depth, quoted, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if quoted:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _stitch_packages() -> tuple[str, ...]:
    root = pathlib.Path(__file__).resolve().parent.parent
    return tuple(sorted(p.name for p in root.iterdir()
                        if p.is_dir() and (p / "__init__.py").exists())) + ("",)


def _versions() -> dict[str, str]:
    from stitch.codegen.cache import source_digest
    from stitch.codegen.gpu_cache import stitch_version
    versions = {"stitch": stitch_version(), "source": source_digest(_stitch_packages())}
    try:
        import jax
        import jaxlib
        versions["jax"] = jax.__version__
        versions["jaxlib"] = getattr(jaxlib, "__version__", "")
    except ImportError:
        pass
    return versions


def result_key(text: str, request: PassRequest) -> str | None:
    """The key of the pass's result for the module ``text`` under ``request`` (module
    docstring); None where results are not kept."""
    if not enabled():
        return None
    from stitch.codegen.cache import cache_key
    from stitch.explorer.plan_cache import options_key
    program, _ = split_header_attributes(text)
    described = json.dumps({
        "format": FORMAT, "versions": _versions(), "target": request.target,
        "device": request.device, "compile_only": request.compile_only,
        "arch": request.gpu_arch(), "loop_bodies": request.loop_bodies,
        "options": options_key(request.options) if request.options is not None else None,
        "sources": bool(request.metadata_text),
        "settings": {k: v for k, v in sorted(os.environ.items())
                     if k.startswith("STITCH_") and k not in NOT_OUTPUT},
    }, sort_keys=True, default=str)
    return cache_key("pass-result", described,
                     hashlib.sha256(program.encode("utf-8")).hexdigest())


# ------------------------------------------------------------------------- storing

# Results are written by a thread of their own (serialising a large module's kernels takes
# ~1 s, which the compile's caller need not wait for); the exit waits this long for writes
# still running.
EXIT_WAIT_S = 60.0
_WRITERS: list[threading.Thread] = []
_WRITERS_LOCK = threading.Lock()


def store_result(key: str | None, new_text: str, report: PassReport) -> None:
    """Keep the pass's result (``new_text``, the rewritten module) under ``key``, written in
    the background (``wait_for_writes``); nothing where there is no key, no kernel, a kernel
    failed to build or the cache is off."""
    if key is None or not report.kernels or report.fallbacks:
        return
    cache = compile_cache()
    if not (cache.enabled and cache.writable):
        return
    # What the thread reads is taken now: the report is the caller's once this returns.
    report_data = _report_to_data(report)
    kernels = [(b.name, b.lowered, b.target.name) for b in report.kernels]
    thread = threading.Thread(target=_write, args=(cache, key, new_text, report_data, kernels),
                              name="stitch-result-store", daemon=True)
    with _WRITERS_LOCK:
        if not _WRITERS:
            atexit.register(wait_for_writes, EXIT_WAIT_S)
        _WRITERS[:] = [t for t in _WRITERS if t.is_alive()] + [thread]
    thread.start()


def wait_for_writes(timeout: float | None = None) -> None:
    """Wait for the results being written (each at most ``timeout`` s)."""
    with _WRITERS_LOCK:
        writers = list(_WRITERS)
    for thread in writers:
        thread.join(timeout)


def _write(cache: Any, key: str, new_text: str, report_data: dict,
           kernels: list[tuple[str, Any, str]]) -> None:
    from stitch.codegen.kir_data import KirDataError
    started = time.perf_counter()
    try:
        payload = result_to_bytes(new_text, report_data, kernels)
    except (KirDataError, TypeError, ValueError) as exc:
        log.debug("%s: pass result not stored: %s", report_data["module"], exc)
        return
    cache.put(key, payload)
    log.debug("%s: pass result stored (%d kernels, %d bytes, %.2f s)", report_data["module"],
              len(kernels), len(payload), time.perf_counter() - started)


def _sharing(kernel: Any) -> tuple:
    """Equal for kernels that differ at most by name: the same objects in every other
    field (a lowering bound to several sites shares its params, body, shared buffers)."""
    return tuple(id(v) if isinstance(v, (tuple, list)) else v
                 for f in dataclasses.fields(kernel) if f.name != "name"
                 for v in [getattr(kernel, f.name)])


def result_to_bytes(new_text: str, report_data: dict,
                    kernels: list[tuple[str, Any, str]]) -> bytes:
    """The result as stored (module docstring): zlib-compressed JSON. ``kernels``: per placed
    kernel, its name, ``LoweredKernel`` and FFI target's name."""
    from stitch.codegen.gpu_cache import canonical_kernel, structure_key
    from stitch.codegen.kir_data import kernel_to_data
    program, attributes = split_header_attributes(new_text)
    if attributes is not None:
        end = program.find("\n")
        header = program if end < 0 else program[:end]
        program = header + f", frontend_attributes={_ATTRIBUTES_MARK}" + program[len(header):]
    groups: dict[tuple, int] = {}
    group_data: list[dict] = []
    stored = []
    for name, lowered, target in kernels:
        kernel = lowered.kernel
        sharing = _sharing(kernel)
        index = groups.get(sharing)
        if index is None:
            index = groups[sharing] = len(group_data)
            group_data.append({"kernel": kernel_to_data(canonical_kernel(kernel)),
                               "structure": structure_key(kernel)})
        stored.append({
            "group": index, "name": name, "kernel": kernel.name, "target": target,
            "inputs": list(lowered.inputs), "outputs": list(lowered.outputs), "schemes": list(lowered.schemes),
            "notes": list(lowered.notes),
            "initial": [[o, i] for o, i in lowered.initial.items()],
            "layouts": [[v, list(layout)] for v, layout in lowered.layouts.items()],
            "split_rows": [[n, k] for n, k in lowered.split_rows.items()]})
    data = {"format": FORMAT, "module": program, "report": report_data,
            "groups": group_data, "kernels": stored}
    return zlib.compress(json.dumps(data).encode("utf-8"), 1)


def _report_to_data(report: PassReport) -> dict:
    return {
        "module": report.module, "kernels_xla": report.kernels_xla,
        "kernels_after": report.kernels_after, "kernels_stitched": report.kernels_stitched,
        "placed": list(report.placed), "skipped": [list(s) for s in report.skipped],
        "in_loop_bodies": report.in_loop_bodies,
        "narrowed": [dataclasses.asdict(n) for n in report.narrowed],
        "unpaid": [dataclasses.asdict(u) for u in report.unpaid],
        "thread_bound": list(report.thread_bound), "segment_rows": list(report.segment_rows),
        "where": dict(report.where),
        "delivery": dataclasses.asdict(report.delivery) if report.delivery is not None
        else None}


# ------------------------------------------------------------------------- replaying

class _Unusable(Exception):
    """A stored result that cannot stand for this compile (the reason)."""


def replayed(key: str | None, text: str, request: PassRequest
             ) -> tuple[str, PassReport] | None:
    """The stored result for ``key`` made live for this compile: the rewritten module's text
    (this compile's frontend attributes in its header) and the report, its kernels' FFI
    targets made and registered. None where nothing is stored or it cannot be used
    (logged; the caller runs the whole pass)."""
    if key is None:
        return None
    cache = compile_cache()
    if not cache.enabled:
        return None
    payload = cache.get(key)
    if payload is None:
        return None
    started = time.perf_counter()
    try:
        data = json.loads(zlib.decompress(payload))
        if data.get("format") != FORMAT:
            raise _Unusable(f"format {data.get('format')!r}, not {FORMAT}")
        _calls_its_kernels(str(data["module"]), data["kernels"])
        lowered = _lowered_kernels(data)
        report = _report_from_data(data["report"])
        renamed: dict[str, str] = {}
        report.kernels = _built(request, data["kernels"], lowered,
                                [g["structure"] for g in data["groups"]], renamed)
        module = _with_attributes(str(data["module"]), text)
        for stored, live in renamed.items():
            module = module.replace(f'custom_call_target="{stored}"',
                                    f'custom_call_target="{live}"')
    except (_Unusable, ValueError, KeyError, TypeError, IndexError, AttributeError,
            zlib.error) as exc:
        log.info("%s: the stored pass result is not used (%s); running the whole pass",
                 request.function, exc)
        return None
    report.from_store = True
    report.timings["replay_s"] = time.perf_counter() - started
    log.info("%s: stitched module and %d kernels from the compile cache (%.2f s)",
             request.function, len(report.kernels), report.timings["replay_s"])
    return module, report


_CALLED_TARGET = re.compile(r'custom_call_target="(stitch_[^"]*)"')


def _calls_its_kernels(module: str, kernels: list[dict]) -> None:
    """_Unusable unless the stored module calls exactly the stored kernels' targets."""
    called = set(_CALLED_TARGET.findall(module))
    held = {str(k["target"]) for k in kernels}
    if called != held:
        raise _Unusable(f"the stored module calls {len(called - held)} stitched targets none "
                        f"of its {len(held)} kernels makes, and {len(held - called)} of "
                        f"theirs not")


def _with_attributes(program: str, text: str) -> str:
    """The stored module with this compile's header attributes (untagged) put back."""
    _, attributes = split_header_attributes(text)
    value = untagged_attributes(attributes) if attributes is not None else None
    mark = f", frontend_attributes={_ATTRIBUTES_MARK}"
    if mark in program[:program.find("\n")]:
        return program.replace(mark, f", frontend_attributes={value}" if value else "", 1)
    if value is None:
        return program
    end = program.find("\n")
    return program[:end] + f", frontend_attributes={value}" + program[end:]


def _lowered_kernels(data: dict) -> list[Any]:
    """Each stored kernel's ``LoweredKernel``, its Kernel IR its group's renamed."""
    from stitch.codegen.kir_data import KirDataError, kernel_from_data
    from stitch.codegen.lower import LoweredKernel
    try:
        canonical = [kernel_from_data(g["kernel"]).known_valid() for g in data["groups"]]
    except KirDataError as exc:
        raise _Unusable(str(exc)) from exc
    out = []
    for k in data["kernels"]:
        kernel = canonical[int(k["group"])].renamed(str(k["kernel"]))
        out.append(LoweredKernel(
            kernel, [int(v) for v in k["inputs"]], [int(v) for v in k["outputs"]],
            [str(s) for s in k["schemes"]], [str(n) for n in k["notes"]],
            {int(o): int(i) for o, i in k["initial"]},
            {int(v): tuple(int(d) for d in layout) for v, layout in k["layouts"]},
            {str(n): int(m) for n, m in k["split_rows"]}))
    return out


def _content_name(name: str) -> str:
    """An FFI target's name without the generation ``ffi.cached_target`` adds when a target
    of the same content was registered in this process and freed since."""
    return _GENERATION.sub("", name)


_GENERATION = re.compile(r"_g\d+$")


def _built(request: PassRequest, stored: list[dict], lowered: list[Any],
           structures: list[str], renamed: dict[str, str]) -> list[BuiltKernel]:
    """The kernels' FFI targets made as the pass makes them; _Unusable where one fails or
    is not the target the stored module calls. ``renamed``: the stored module's target
    names that are registered under another generation in this process -> that name."""
    from stitch.codegen.errors import CodegenError
    from stitch.errors import Cancelled, StitchError

    from .pass_planning import LLVM_LOCK
    from .ptx_children import release_ptx_workers, start_ptx_workers
    builds: list[Any] = [None] * len(lowered)
    workers: list = []
    try:
        if request.device == "gpu":
            cached = _cached_gpu_builds(request, stored, lowered, structures)
            if cached is not None:
                builds = cached
            else:       # built (or read) in the PTX children, as the pass builds them
                workers = request.take_ptx_workers() or start_ptx_workers()
                with GpuPrebuild(request, workers) as prebuild:
                    for k, low in zip(stored, lowered):
                        prebuild.submit(low.kernel, key=structures[int(k["group"])])
                    builds = list(prebuild.each_result())
        out = []
        for k, low, ptx in zip(stored, lowered, builds):
            request.check_cancelled()
            try:
                if isinstance(ptx, Exception):
                    raise ptx
                with LLVM_LOCK:
                    target = build_target(
                        low.kernel, request.device, arch=request.gpu_arch(),
                        compile_only=request.compile_only,
                        worker=workers[0] if workers else None,
                        ptx=ptx.ptx if ptx is not None else None,
                        assembled=ptx.assembled if ptx is not None else None,
                        cancelled=request.cancel)
            except Cancelled:
                raise
            except (CodegenError, StitchError) as exc:
                raise _Unusable(f"kernel {k['name']}: {type(exc).__name__}: {exc}") from exc
            if target.name != k["target"]:
                if _content_name(target.name) == _content_name(k["target"]):
                    renamed[k["target"]] = target.name
                else:
                    raise _Unusable(f"kernel {k['name']} builds as {target.name}, not the "
                                    f"stored module's {k['target']}")
            out.append(BuiltKernel(str(k["name"]), low, target))
        return out
    finally:
        if workers:
            release_ptx_workers(workers)


def _cached_gpu_builds(request: PassRequest, stored: list[dict], lowered: list[Any],
                       structures: list[str]) -> list[GpuBuild] | None:
    """Each kernel's GPU build read from the compile cache in this process (a warm
    process then starts no PTX child); None where a group's PTX or ptxas result is not
    there."""
    from stitch.codegen.gpu_cache import cached_build, canonical_kernel
    cache = compile_cache()
    arch = request.gpu_arch()
    assembly = assembly_mode(request, not request.compile_only and cubins_for_device(arch))
    groups: dict[int, Any] = {}
    builds = []
    for k, low in zip(stored, lowered):
        group = int(k["group"])
        if group not in groups:
            groups[group] = cached_build(canonical_kernel(low.kernel), arch, cache=cache,
                                         structure=structures[group], assembly=assembly)
            if groups[group] is None:
                return None
        built = groups[group]
        builds.append(GpuBuild.renamed(built.ptx, built.assembled, low.kernel.name))
    return builds


def _fields(cls: type, data: dict) -> dict:
    """``data`` as ``cls``'s constructor arguments (every field, nothing else)."""
    names = {f.name for f in dataclasses.fields(cls)}
    if set(data) != names:
        raise _Unusable(f"{cls.__name__} stored as {sorted(data)}")
    return data


def _delivery_from_data(data: dict) -> Delivery:
    return Delivery(
        Side(**_fields(Side, data["xla"])), Side(**_fields(Side, data["planned"])),
        Side(**_fields(Side, data["delivered"])),
        [Dropped(**_fields(Dropped, d)) for d in data["dropped"]],
        [LoopCopy(**_fields(LoopCopy, c)) for c in data["copies"]], float(data["copy_us"]),
        [Mover(**{**_fields(Mover, m), "tops": tuple(m["tops"])}) for m in data["movers"]])


def _report_from_data(data: dict) -> PassReport:
    from .code_budget import Narrowed
    from .payback import Unpaid
    return PassReport(
        str(data["module"]), int(data["kernels_xla"]), int(data["kernels_after"]),
        int(data["kernels_stitched"]), placed=[str(n) for n in data["placed"]],
        skipped=[(str(n), str(r)) for n, r in data["skipped"]],
        in_loop_bodies=int(data["in_loop_bodies"]),
        narrowed=[Narrowed(**_fields(Narrowed, n)) for n in data["narrowed"]],
        unpaid=[Unpaid(**_fields(Unpaid, u)) for u in data["unpaid"]],
        thread_bound=[str(n) for n in data["thread_bound"]],
        segment_rows=[str(n) for n in data["segment_rows"]],
        where={str(k): str(v) for k, v in data["where"].items()},
        delivery=_delivery_from_data(data["delivery"]) if data["delivery"] is not None
        else None)
