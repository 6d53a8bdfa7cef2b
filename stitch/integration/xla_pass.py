"""stitch as an HLO pass inside XLA's compiler.

``ensure_registered(platform)`` registers one HLO module transformation with jax
(``jax.extend.xla.register_hlo_module_transformation``). XLA calls it on every fresh compile,
jax's own small jits included; it acts only on modules that carry the module-level frontend
attribute ``stitch.request=<token>`` of a live ``PassRequest`` (``PassRequest.prepare(lowered)``
returns a private copy of the lowered StableHLO carrying it, to ``compile()``). For those it:

1. reads XLA's module (``as_hlo_text(print_large_constants=True)``: without it large
   constants print as ``{...}`` and would come back as zeros);
2. plans it (``stitch.plan``: XLA's own fusions are the baseline, as in the paper);
3. lowers and builds every stitched kernel that can be placed (``hlo_rewrite.find_site``)
   and registers it as an XLA FFI target (host SIMT program on "cpu", PTX + the CUDA
   handler on "gpu");
4. replaces what each kernel covers with one typed-FFI custom call
   (``hlo_rewrite.replace_kernels``) and hands the module back. Everything else stays as
   XLA made it: rng, u64, opt-barrier, key types, collectives, aliasing and donation.

Stage: on CPU both stages already hold XLA's fusions; PRE_SCHEDULER is used so XLA
schedules the custom calls with the rest. On the CUDA plugin PRE_SCHEDULER is still
pre-fusion, so POST_SCHEDULER (fused, scheduled: the rewrite keeps a topological order that
follows XLA's) is the stage that sees XLA's fusions.

Without a GPU (the deviceless check, tests only): ``stitch/integration/deviceless.py`` registers the
same callback with the CUDA plugin's XlaTransform extension (jax's public registration needs
a started GPU backend) and compiles with ``PassRequest(compile_only=True)``: kernels are
built for the target spec's arch as compile-only CUDA FFI targets (``build_target``).

The callback raises into XLA only when its request was cancelled (the interpreter is
exiting), which stops that compile at once; any other failure leaves the module unchanged
and is kept on the request (``PassRequest.result()`` raises it as a ``StitchError`` on the
caller's side). CPU kernels' object code is built in a child process (``host_builds``), so
a cancelled pass never leaves LLVM running in this process.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from stitch.hlo_passes import HloModule, parse_hlo, print_hlo
from stitch.hlo_passes.literals import ELIDED
from stitch.errors import Cancelled, StitchError

from .collector import fewer_collections
from .config import ConfigError, env_flag, grid_sync_on_gpu
from .delivered import deliver, loses_with_copies
from .hlo_rewrite import (ComputationView, NotPlaceable, PlacedKernel, carried_copy_bytes,
                          find_site, replace_kernels, xla_layouts)
from . import ptx_children
from .snap import snap_kernels

log = logging.getLogger("stitch.xla_pass")

REQUEST_ATTR = "stitch.request"
_REQUEST_BYTES = REQUEST_ATTR.encode()
_TOKEN = re.compile(r'stitch\.request="?([0-9a-f]+)"?')


class PassError(StitchError):
    """The pass could not stitch the module it was asked to (module left to XLA)."""


class PassCancelled(PassError, Cancelled):
    """The request was cancelled (the interpreter is exiting) while the pass ran."""


@dataclass
class BuiltKernel:
    """A stitched kernel the pass placed: ``lowered.kernel`` is its Kernel IR."""
    name: str
    lowered: Any                      # stitch.codegen.lower.LoweredKernel
    target: Any                       # stitch.codegen.ffi.FfiTarget / the CUDA one


@dataclass
class PassReport:
    """What the pass did to one module."""
    module: str
    kernels_xla: int                  # kernels XLA launches for the module (the baseline)
    kernels_after: int                # kernels launched once stitch's calls are in
    kernels_stitched: int             # stitch custom calls placed
    placed: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)     # (kernel, reason)
    fallbacks: list[tuple[str, str]] = field(default_factory=list)   # build failures
    kernels: list[BuiltKernel] = field(default_factory=list)         # the placed ones
    in_loop_bodies: int = 0           # of those, placed in while bodies / branches
    timings: dict[str, float] = field(default_factory=dict)
    plan: Any = None                  # the FusionPlan
    # Kernels built at a narrower vector width than tuned (stitch.integration.code_budget).
    narrowed: list = field(default_factory=list)
    # Kernels left to XLA because they would not repay their build (stitch.integration.payback).
    unpaid: list = field(default_factory=list)
    # Planned vs delivered: the final module priced as XLA's is (stitch.integration.delivered).
    delivery: Any = None

    def summary(self) -> dict:
        return {"kernels_before": self.kernels_xla, "kernels_after": self.kernels_after,
                "stitched_kernels": self.kernels_stitched,
                "fallbacks": len(self.fallbacks),
                **{k: round(v, 3) for k, v in self.timings.items()},
                **(self.delivery.summary() if self.delivery is not None else {})}

    def reason_nothing_stitched(self) -> str:
        reasons = [f"{n}: {r}" for n, r in (self.fallbacks + self.skipped)
                   if not r.startswith("same as XLA")]
        if not reasons:
            return "the plan fuses nothing beyond XLA's own kernels"
        return "no stitched kernel could be placed (" + "; ".join(reasons[:3]) + \
            (f"; {len(reasons) - 3} more" if len(reasons) > 3 else "") + ")"


@dataclass
class PassRequest:
    """One compile stitch asked for. Use as a context manager around ``compile()``."""
    function: str
    target: str
    device: str                                   # "cpu" | "gpu"
    cancel: Callable[[], bool] | None = None
    options: Any = None                           # ExplorerOptions
    loop_bodies: bool = True                      # place kernels in while bodies/branches too
    # GPU without a device (stitch/integration/deviceless.py): compile-only CUDA targets, PTX
    # assembled for ``arch`` (default: the compute capability of ``target``'s spec).
    compile_only: bool = False
    arch: str | None = None
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    report: PassReport | None = None
    error: BaseException | None = None
    calls: int = 0                                # modules of this request the pass saw
    # GPU, where ``early_ptx_children()``: the PTX children, started as the compile begins
    # (``__enter__``) so that their start-up runs during XLA's own passes; the pass takes
    # them. Elsewhere the pass starts them as it begins, during planning.
    _ptx_workers: list = field(default_factory=list, init=False, repr=False, compare=False)

    def __enter__(self) -> "PassRequest":
        with _LOCK:
            _REQUESTS[self.token] = self
        if self.device == "gpu" and not self._ptx_workers:
            try:
                if early_ptx_children():
                    self._ptx_workers = start_ptx_workers()
            except ConfigError as exc:
                log.warning("%s: %s; the PTX children start with the pass", self.function, exc)
            except Exception as exc:  # noqa: BLE001 - the pass starts its own, or says why
                log.debug("%s: PTX children not started early: %s", self.function, exc)
        return self

    def __exit__(self, *exc: object) -> None:
        with _LOCK:
            _REQUESTS.pop(self.token, None)
        # The pass never ran (or never took them): back to the process's children.
        release_ptx_workers(self.take_ptx_workers())

    def take_ptx_workers(self) -> list:
        """The PTX children started for this request (the caller closes them), once."""
        workers, self._ptx_workers = self._ptx_workers, []
        return workers

    def prepare(self, lowered: Any) -> Any:
        """A private copy of a ``jax.stages.Lowered`` tagged so the pass recognises its
        compile. jax caches lowerings and their executables per function: tagging the
        shared one would be served the stock executable (the pass never called) and would
        leak the tag into later stock compiles, so the StableHLO module is cloned. The token
        is new per request, so jax's persistent compilation cache can never hand back a
        stitched executable whose FFI targets this process has not registered."""
        import copy

        from jax._src.interpreters import mlir

        try:
            lowering = copy.copy(lowered._lowering)
            source = lowered._lowering._hlo
        except AttributeError as exc:       # jax internals moved: say so, stay on stock
            raise PassError(f"cannot copy jax's lowering ({exc}); this jax version is "
                            "not supported by stitch's pass") from exc
        with source.context:
            module = mlir.ir.Module.parse(source.operation.get_asm(enable_debug_info=True))
            attrs = module.operation.attributes
            entries = {}
            if "mhlo.frontend_attributes" in attrs:
                entries = {named.name: named.attr
                           for named in mlir.ir.DictAttr(attrs["mhlo.frontend_attributes"])}
            entries[REQUEST_ATTR] = mlir.ir.StringAttr.get(self.token)
            attrs["mhlo.frontend_attributes"] = mlir.ir.DictAttr.get(entries)
        lowering._hlo = module
        lowering._executable = None
        private = copy.copy(lowered)
        private._lowering = lowering
        return private

    def result(self) -> PassReport:
        """The report, or the pass's failure as a StitchError."""
        if self.error is not None:
            if isinstance(self.error, StitchError):
                raise self.error
            raise PassError(f"{type(self.error).__name__}: {self.error}") from self.error
        if self.report is None:
            raise PassError("XLA compiled the module without calling stitch's pass "
                            "(was the executable served from a compilation cache?)")
        return self.report

    def gpu_arch(self) -> str | None:
        """sm_XY the GPU kernels are built for: ``arch``; else, compiling without a device,
        the compile's target (its spec's compute capability); else the device's. None on
        CPU."""
        if self.device != "gpu":
            return None
        if self.arch:
            return self.arch
        return target_arch(self.target) if self.compile_only else gpu_arch()

    def check_cancelled(self) -> None:
        if self.cancel is not None and self.cancel():
            raise PassCancelled("the compile was cancelled before it finished "
                                "(the interpreter is exiting)")


_LOCK = threading.Lock()
_REQUESTS: dict[str, PassRequest] = {}
_REGISTERED: set[str] = set()
# LLVM (llvmlite's global context) is used by one thread at a time: the pass runs on an
# XLA thread, stitch.compile and the tests on others.
LLVM_LOCK = threading.RLock()


# The names a CUDA PJRT client may report as ``client.platform``: jax's public hook
# (0.10.2) compares them with the platforms it was given, and CUDA clients say "gpu".
CUDA_PLATFORM_NAMES = ("cuda", "gpu")


def ensure_registered(platform: str) -> None:
    """Register the pass for ``platform`` ("cpu" or "cuda") once per process.

    CUDA: jax's public call under every name a CUDA client reports (jax 0.10.2 registers on
    clients as they start, keyed on ``client.platform``; 0.11 at once), then directly on any
    CUDA client already started — 0.10.2's hook never fires for those. A client registered
    twice calls the pass twice per compile; the second call sees the module already
    stitched and leaves it (``PassRequest.calls``)."""
    import jax.extend.xla as xla_ext

    platform = platform.lower()
    with _LOCK:
        if platform in _REGISTERED:
            return
        stage = (xla_ext.PipelineStage.PRE_SCHEDULER if platform == "cpu"
                 else xla_ext.PipelineStage.POST_SCHEDULER)
        if platform == "cpu":
            xla_ext.register_hlo_module_transformation(_callback, name="stitch", stage=stage,
                                                       platforms=["cpu"])
        else:
            xla_ext.register_hlo_module_transformation(
                _callback, name="stitch", stage=stage, platforms=list(CUDA_PLATFORM_NAMES))
            for client in _started_clients(CUDA_PLATFORM_NAMES):
                _register_on_client(client, stage)
        _REGISTERED.add(platform)
    log.debug("stitch pass registered for %s at %s", platform, stage.name)


def _started_clients(names: tuple[str, ...]) -> list:
    """The XLA clients jax has already started for ``names`` (none started: empty; jax keeps
    them in ``xla_bridge._backends``, which asking for them would fill)."""
    try:
        from jax._src import xla_bridge
    except ImportError:
        return []
    backends = getattr(xla_bridge, "_backends", None) or {}
    return [c for c in list(backends.values()) if getattr(c, "platform", None) in names]


def _register_on_client(client: Any, stage: Any) -> None:
    """The pass registered on one started client through the PJRT C API."""
    try:
        from jax._src.lib import _xla
        _xla.register_xla_transform_c_api(client, "stitch", stage.value, _callback)
        log.debug("stitch pass registered on the started %s client", client.platform)
    except Exception as exc:  # noqa: BLE001 - said once; compile_with_pass warns per compile
        log.warning("stitch: could not register the pass on the started %s client (%s: %s); "
                    "compiles there will run without it", getattr(client, "platform", "?"),
                    type(exc).__name__, exc)


def _callback(data: bytes) -> bytes | None:
    """XLA's hook (module docstring). Returns None (module unchanged) unless stitched."""
    if _REQUEST_BYTES not in data:          # cheap: most compiles are not stitch's
        return None
    request: PassRequest | None = None
    try:
        from jaxlib import _hlo

        text = _hlo.XlaComputation(data).as_hlo_text(print_large_constants=True)
        match = _TOKEN.search(text[:text.find("\n")] if "\n" in text else text)
        with _LOCK:
            request = _REQUESTS.get(match.group(1)) if match else None
        if request is None:
            return None
        request.calls += 1
        if request.calls > 1:               # a second module of the same compile
            log.debug("%s: pass called again (module %s); left to XLA", request.function,
                      text[:60])
            return None
        new_text = stitch_module_text(text, request)
        if new_text is None:
            return None
        return _to_proto(new_text)
    except Cancelled as exc:
        # The interpreter is exiting: raised into XLA, which stops this compile at once
        # (returning None would have XLA compile the whole module itself first).
        if request is not None:
            request.error = exc
        raise
    except BaseException as exc:  # noqa: BLE001 - never into XLA's compile
        if request is not None:
            request.error = exc
        log.debug("stitch pass failed: %s: %s", type(exc).__name__, exc, exc_info=True)
        return None


def _to_proto(text: str) -> bytes:
    """XLA's parser on stitch's rewritten text; a rejection names the offending line."""
    from jaxlib import _hlo
    try:
        return _hlo.hlo_module_from_text(text).as_serialized_hlo_module_proto()
    except Exception as exc:  # noqa: BLE001 - XLA's parser error, made specific
        where = re.search(r"parsing (\d+):(\d+)", str(exc))
        line = text.splitlines()[int(where.group(1)) - 1].strip() if where else ""
        raise PassError(f"XLA's parser rejects stitch's rewritten module: "
                        f"{str(exc).splitlines()[-1].strip()} in: {line[:300]}") from exc


def _untag(module: HloModule) -> None:
    """Drop the request's token from the module (it is unique per compile: left in, the
    plan cache, keyed by the printed module, would never hit)."""
    attrs = module.attrs.get("frontend_attributes")
    if attrs is None:
        return
    kept = re.sub(r',?\s*stitch\.request="?[0-9a-f]+"?', "", attrs[1:-1]).strip().lstrip(",")
    if kept:
        module.attrs["frontend_attributes"] = "{" + kept + "}"
    else:
        del module.attrs["frontend_attributes"]


DUMP_ENV = "STITCH_DUMP_MODULES"


def _dump_module(text: str, request: PassRequest) -> str | None:
    """With ``$STITCH_DUMP_MODULES`` set to a folder, write the module the pass plans there
    (``<function>.<n>.hlo``): planning can then be profiled in-process without XLA. The
    path written (None: none)."""
    folder = os.environ.get(DUMP_ENV, "").strip()
    if not folder:
        return None
    try:
        os.makedirs(folder, exist_ok=True)
        stem = re.sub(r"[^A-Za-z0-9_.-]", "_", request.function or "module")
        n = sum(1 for f in os.listdir(folder) if f.startswith(stem + ".") and
                f.endswith(".hlo"))
        path = os.path.join(folder, f"{stem}.{n}.hlo")
        with open(path, "w") as f:
            f.write(text)
        return path
    except OSError as exc:
        log.warning("%s: could not write the module: %s", DUMP_ENV, exc)
        return None


def _dump_summary(path: str | None, report: PassReport) -> None:
    """Next to a dumped module, the pass's ``PassReport.summary()`` (``<...>.summary.json``:
    planned and delivered figures, bench/delivered/units.py reads them)."""
    if path is None:
        return
    try:
        with open(path[:-len(".hlo")] + ".summary.json", "w") as f:
            json.dump(report.summary(), f)
    except OSError as exc:
        log.warning("%s: could not write the summary: %s", DUMP_ENV, exc)


def stitch_module_text(text: str, request: PassRequest) -> str | None:
    """The module with stitch's kernels in (None when none was placed); sets
    ``request.report``."""
    start = time.perf_counter()
    with fewer_collections():        # the pass allocates millions of objects (collector.py)
        dumped = _dump_module(text, request)
        module = parse_hlo(text)
        _untag(module)
        request.check_cancelled()
        report = stitch_module(module, request)
        report.timings["pass_s"] = time.perf_counter() - start
        request.report = report
        _dump_summary(dumped, report)
        if not report.placed:
            return None
        return print_hlo(module, operand_shapes=True)


# GEMM-chain kernels of f32 dots that allow TF32 use TF32 tensor cores on the GPU path
# (stitch.codegen.gemm_chain's m16n8k8 MMA); host paths keep f32 exact.
GPU_CHAIN_TF32 = True


def stitch_module(module: HloModule, request: PassRequest) -> PassReport:
    """Plan ``module``, build the kernels that fit, put them in (module docstring)."""
    timings: dict[str, float] = {}
    # GPU: PTX is emitted in isolated children, one per build thread, not a fresh
    # interpreter per kernel; ptxas runs in the same threads. The request started them as
    # its compile began; else they start now, so their start-up overlaps planning.
    ptx_workers = []
    if request.device == "gpu":
        ptx_workers = request.take_ptx_workers() or start_ptx_workers()
    try:
        return _plan_and_build(module, request, timings, ptx_workers)
    finally:
        release_ptx_workers(ptx_workers)


def start_ptx_workers() -> list:
    """``build_threads()`` PTX children taken from the process's (``ptx_children``), started
    where they are not running yet (not waited for); ``release_ptx_workers`` gives them
    back."""
    return ptx_children.acquire(build_threads())


def release_ptx_workers(workers: list) -> None:
    """PTX children a request or pass is done with, back to the process's for the next."""
    ptx_children.release(workers)


# The pass plans with XLA's instructions as the explorer's units (ExplorerOptions.xla_units;
# a request's own options choose for themselves).
XLA_UNITS = True

# GPU builds: a kernel whose Kernel IR is over the code budget ($STITCH_CODE_BUDGET, default
# code_budget.CODE_BUDGET statements) is built at a narrower vector width where the
# latency-evaluator prices that within tolerance (host builds are for checking, not speed).
CODE_BUDGET_ON_GPU = True

# GPU builds: a kernel whose modeled saving per step would not repay its build within
# $STITCH_PAYBACK_STEPS steps is left to XLA (stitch.integration.payback; host builds are checks).
PAYBACK_ON_GPU = True

# GPU builds: a kernel in a loop body that loses (time, or memory-intensive bytes) once the
# copies of the loop state it writes are counted is left to XLA (delivered.loses_with_copies;
# host builds are checks and keep them).
LOOP_COPIES_ON_GPU = True

# A kernel's whole build in its child: LLVM (emit_ptx_cached's 300 s) and ptxas (60 s).
BUILD_TIMEOUT_S = 360.0


def _plan_and_build(module: HloModule, request: PassRequest, timings: dict[str, float],
                    ptx_workers: list) -> PassReport:
    from stitch.hlo_passes.evaluator.interpreter import Evaluator
    from stitch.cost.gpu_specs import get_spec
    from stitch.explorer.planner import ExplorerOptions, plan as make_plan

    t0, cpu0 = time.perf_counter(), time.thread_time()
    # Kernels are snapped to whole XLA instructions: plan with those as the units (an
    # op-level plan's cuts are undone by snapping, and it plans a ~10x larger graph).
    options = request.options or ExplorerOptions(xla_units=XLA_UNITS)
    if request.device == "gpu" and GPU_CHAIN_TF32:
        # XLA GPU runs f32 dots of DEFAULT precision on TF32 tensor cores: so may a chain.
        # And its chain schedules are assembled by ptxas, spilling ones struck.
        # Chains split n across blocks (a launch per phase) only where STITCH_GRID_SYNC
        # lets grid-barrier kernels run.
        options = dataclasses.replace(options, chain_tf32=True,
                                      chain_spill_check=True,
                                      chain_grid_sync=grid_sync_on_gpu() != "off")
    if request.device == "gpu":
        # The planner prices a global-scope kernel only in the launch form this pass builds
        # it in, and none under "off" (stitch.cost.launch_forms, STITCH_GRID_SYNC).
        options = dataclasses.replace(options, grid_sync=grid_sync_on_gpu())
    fusion_plan = make_plan(module, request.target, options=options,
                            cancel=request.cancel, cache=True)
    timings["plan_s"] = time.perf_counter() - t0
    # This thread's CPU seconds: what planning cost, whatever else shares the machine.
    timings["plan_cpu_s"] = time.thread_time() - cpu0
    summary = fusion_plan.summary()
    report = PassReport(module.name, summary["baseline"]["kernels"],
                        summary["baseline"]["kernels"], 0, plan=fusion_plan)
    evaluator = Evaluator(module)
    spec = get_spec(request.target)
    graphs = [g.graph for g in fusion_plan.graphs]
    placed: list[PlacedKernel] = []
    views: dict[int, ComputationView] = {}
    built: dict[str, BuiltKernel] = {}
    launching: dict[str, int] = {}
    t1 = time.perf_counter()
    _place_kernels(request, report, fusion_plan, module, spec, evaluator, placed, views,
                   built, launching, ptx_workers)
    timings["build_s"] = time.perf_counter() - t1
    rewrite = replace_kernels(module, graphs, placed, views)
    report.placed = rewrite.placed
    report.skipped.extend(rewrite.skipped)
    report.kernels_stitched = len(rewrite.placed)
    report.kernels_after = report.kernels_xla - sum(launching[n] - 1 for n in rewrite.placed)
    report.kernels = [built[name] for name in rewrite.placed]
    report.in_loop_bodies = sum(1 for p in placed if p.site.name in set(rewrite.placed)
                                and fusion_plan.graphs[p.site.graph_index].graph.kind != "entry")
    report.timings.update(timings)
    report.delivery = deliver(report, fusion_plan, spec, placed, rewrite)
    log.debug("%s: %d stitched kernels placed, %d skipped, %d failed to build",
              module.name, len(rewrite.placed), len(report.skipped), len(report.fallbacks))
    return report


def build_threads() -> int:
    """Threads (each with its own PTX child) that emit and assemble a module's GPU kernels:
    ``STITCH_BUILD_THREADS``, else one per core up to MAX_BUILD_THREADS."""
    configured = os.environ.get("STITCH_BUILD_THREADS", "").strip()
    if not configured:
        return max(1, min(os.cpu_count() or 1, MAX_BUILD_THREADS))
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    raise ConfigError(f"STITCH_BUILD_THREADS={configured!r}: expected a number of threads "
                      ">= 1")


MAX_BUILD_THREADS = 8      # each PTX child holds an interpreter with llvmlite (~150 MB)


def early_ptx_children() -> bool:
    """Whether a GPU request starts its PTX children as its compile begins, so that their
    start-up (~0.2 s each: an interpreter, llvmlite, the NVPTX target, libdevice's cut, the
    cache keys' facts) runs during XLA's passes before stitch's, rather than as the pass
    begins, during planning (which keeps one core busy and leaves the others idle).
    ``STITCH_EARLY_PTX_CHILDREN`` (1/0) decides; by default, early only where the cores
    outnumber the children by EARLY_START_SPARE_CORES. Measured on 2 cores (transformer_train
    tiny, deviceless H100): started early, the children slowed XLA's passes before stitch's
    by 0.3-0.5 s and saved the pass 0.1 s; the whole compile was 0.2-0.5 s slower."""
    default = (os.cpu_count() or 1) >= build_threads() + EARLY_START_SPARE_CORES
    return env_flag("STITCH_EARLY_PTX_CHILDREN", default)


# Cores XLA's own passes keep busy beside the children's start-up.
EARLY_START_SPARE_CORES = 2


@dataclass
class GpuBuild:
    """A kernel's GPU build products from ``GpuPrebuild``: its PTX and, for a compile-only
    build, ptxas's result (``stitch.codegen.gpu_cache.CubinBuild``)."""
    ptx: str
    assembled: Any = None


class GpuPrebuild:
    """PTX (and, compile-only, ptxas) of a module's GPU kernels, built while the caller goes
    on lowering the next ones: ``submit`` each lowered kernel, then ``each_result()``.
    Emission runs in ``workers``' children on as many threads; kernels that differ only by
    name (and their parameters') are emitted and assembled once
    (``gpu_cache.structure_key``), then renamed. What needs llvmlite in this process (the FFI handler) is left to the caller,
    under LLVM_LOCK. Use as a context manager (the threads are joined on exit)."""

    def __init__(self, request: PassRequest, workers: list) -> None:
        import queue
        from concurrent.futures import ThreadPoolExecutor

        from stitch.codegen.nvptx import DEFAULT_PIPELINE, PIPELINE_ENV, pipeline_setting

        self.request = request
        self.arch = request.gpu_arch()
        # A bad $STITCH_LLVM_PIPELINE fails the pass once here, not every kernel's build.
        if pipeline_setting() != DEFAULT_PIPELINE:
            log.info("%s: kernels built with LLVM pipeline %s=%s", request.function,
                     PIPELINE_ENV, os.environ[PIPELINE_ENV].strip())
        # On a device, ptxas's cubin is loaded where a ptxas is found: assembled here in
        # parallel and cached, instead of the driver JIT-compiling each PTX in turn on the
        # pass's thread as its FFI target is made (PTX stays the fallback).
        self.cubins = not request.compile_only and cubins_for_device(self.arch)
        # The children use the compile cache this process would (opened here, not in a
        # thread: see gpu_cache.build_in_child); none where it is refused.
        cache = compile_cache()
        self._cache_dir = str(cache.directory) if cache.enabled else None
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        for worker in workers:
            self._idle.put(worker)
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(workers)),
                                        thread_name_prefix="stitch-build")
        self._groups: dict[str, Any] = {}                 # structure key -> Future
        self._kernels: list[tuple[Any, Any]] = []         # (kernel, its group's Future)

    def __enter__(self) -> "GpuPrebuild":
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def submit(self, kernel: Any, key: str | None = None) -> None:
        """Start ``kernel``'s build (``key``: its ``gpu_cache.structure_key`` if known)."""
        from stitch.codegen.gpu_cache import canonical_kernel, structure_key
        key = structure_key(kernel) if key is None else key
        future = self._groups.get(key)
        if future is None:
            future = self._groups[key] = self._pool.submit(self._build,
                                                           canonical_kernel(kernel), key)
        self._kernels.append((kernel, future))

    def _build(self, canonical: Any, structure: str) -> tuple[str, Any]:
        """The canonical kernel's PTX and ptxas's result for it: compile-only, and on a
        device while cubins are loaded there (``cubins_for_device``). The whole build
        (cache, LLVM, ptxas) runs in the worker's child, one round trip from this thread
        (``gpu_cache.build_in_child``)."""
        from stitch.codegen.ffi_cuda import cubins_refused
        from stitch.codegen.gpu_cache import build_in_child
        if self.request.compile_only:
            assembly = "must"                     # ptxas's check is the point there
        elif self.cubins and not cubins_refused():
            assembly = "try"
        else:
            assembly = "none"
        worker = self._idle.get()
        try:
            self.request.check_cancelled()
            built = worker.call(build_in_child, canonical, self.arch, structure=structure,
                                cache_dir=self._cache_dir, assembly=assembly,
                                timeout=BUILD_TIMEOUT_S, cancelled=self.request.cancel)
        finally:
            self._idle.put(worker)
        if built.assembly_error is not None:
            log.info("no cubin for a kernel of %s (%s): its PTX is loaded (the driver may "
                     "still take it)", self.request.function, built.assembly_error)
        return built.ptx, built.assembled

    def each_result(self) -> Iterator[Any]:
        """Per submitted kernel, in order: its ``GpuBuild`` or the exception that stopped
        its group's build, each as soon as that build is done (the caller can use a
        kernel's build while later ones still run)."""
        from stitch.codegen.gpu_cache import renamed_cubin_build, renamed_ptx
        for kernel, future in self._kernels:
            try:
                ptx, assembled = future.result()
            except Exception as exc:  # noqa: BLE001 - handed back per kernel
                yield exc
                continue
            yield GpuBuild(renamed_ptx(ptx, kernel.name),
                           renamed_cubin_build(assembled, kernel.name)
                           if assembled is not None else None)
        log.debug("%s: %d GPU kernels, %d distinct", self.request.function,
                  len(self._kernels), len(self._groups))


def _global_scope(schedule: Any) -> bool:
    return any(part.kind == "global" for part in getattr(schedule, "parts", ()))


def _block_scope_schedule(graph: Any, members: Any, spec: Any) -> Any:
    """The kernel's best schedule without the global scope: STITCH_GRID_SYNC=off builds no
    grid-barrier kernel (config.grid_sync_on_gpu; the planner then priced none either,
    stitch.cost.launch_forms)."""
    from stitch.schedule.tuner import ScheduleError, schedule_kernel
    try:
        return schedule_kernel(graph, members, spec, force={"scope": "block"})
    except ScheduleError as exc:
        raise PassError(f"only a global-scope (grid barrier) schedule, and "
                        f"STITCH_GRID_SYNC=off builds none: {exc}") from exc


def _chain_jobs(request: PassRequest, report: PassReport, view: ComputationView, gi: int,
                graph_plan: Any, snapped: list) -> list:
    """The graph's GEMM-chain kernels, lowered, as (view, kernel, site, lowered) jobs. A
    chain replaces whole XLA instructions (its GEMM fusions, the softmax fusion, split-K
    reduces) that no other stitched kernel touches; else it is left to XLA."""
    from stitch.codegen.errors import CodegenError
    from stitch.compiler import lower_chain_kernel

    taken = {view.top_of(m) for k in snapped for m in k.members}
    jobs = []
    for k in graph_plan.stitched.kernels:
        if k.kind != "gemm_chain":
            continue
        try:
            site = find_site(view, gi, k.name, frozenset(k.members))
            if taken & set(site.tops):
                raise NotPlaceable("shares XLA instructions with another stitched kernel")
        except NotPlaceable as exc:
            report.skipped.append((k.name, str(exc)))
            continue
        request.check_cancelled()
        try:
            with LLVM_LOCK:
                lowered = lower_chain_kernel(graph_plan.graph, k, request.gpu_arch() if
                                             request.device == "gpu" else "sm_70",
                                             fma=request.device != "gpu")
        except (CodegenError, StitchError) as exc:
            log.info("kernel %s stays with XLA: %s", k.name, exc)
            report.fallbacks.append((k.name, f"{type(exc).__name__}: {exc}"))
            continue
        taken |= set(site.tops)
        jobs.append((view, k, site, lowered))
    return jobs


def _lower_jobs(request: PassRequest, report: PassReport, fusion_plan: Any,
                module: HloModule, spec: Any, evaluator: Any, views: dict,
                submit: Callable[..., None] | None) -> list:
    """The plan's placeable kernels lowered to Kernel IR, as (view, kernel, site, lowered)
    jobs in plan order; ``submit(kernel IR)`` is called for each as soon as it is lowered."""
    from stitch.codegen import kir
    from stitch.codegen.errors import CodegenError
    from stitch.codegen.lower import lower_kernel
    from stitch.codegen.gpu_cache import structure_key
    from stitch.cost.delta import CostModel
    from stitch.schedule.global_scope import launch_form

    from .code_budget import (budget_setting, estimated_statements, lower_within_budget,
                              statements)
    from .payback import Unpaid, modeled_gain_s, payback_setting, unpaid

    jobs: list[tuple[ComputationView, Any, Any, Any]] = []
    # How global-scope kernels run: read once per pass (a bad STITCH_GRID_SYNC fails the
    # pass with its ConfigError, not every kernel with a copy of it).
    grid_sync_setting = grid_sync_on_gpu() if request.device == "gpu" else "barrier"
    budget = budget_setting() if request.device == "gpu" and CODE_BUDGET_ON_GPU else None
    payback = payback_setting() if request.device == "gpu" and PAYBACK_ON_GPU else None

    def add(job: tuple, key: str | None = None) -> None:
        try:
            # Checked only now: a kernel the code budget or payback drops is never built.
            job[3].kernel.validate()
        except CodegenError as exc:
            log.info("kernel %s stays with XLA: %s", job[1].name, exc)
            report.fallbacks.append((job[1].name, f"{type(exc).__name__}: {exc}"))
            return
        jobs.append(job)
        if submit is not None:
            submit(job[3].kernel, key)

    def leave(left: Unpaid) -> None:
        log.info("kernel %s: %s", left.name, left.reason(payback))
        report.unpaid.append(left)
        report.skipped.append((left.name, left.reason(payback)))

    # Payback by kernel structure: kernels equal but for names are built once
    # (GpuPrebuild), so a repeated layer's kernel repays one build with all its copies'
    # savings. Structures built so far; structures waiting for enough copies to pay.
    built_keys: set[str] = set()
    waiting: dict[str, list[tuple[tuple, float, Unpaid]]] = {}

    def add_if_paid(job: tuple, gain_s: float) -> None:
        assert payback is not None
        kernel = job[3].kernel
        key = structure_key(kernel)
        size = statements(kernel)
        group = waiting.get(key, [])
        total = gain_s + sum(g for _, g, _ in group)
        if key in built_keys or unpaid(job[1].name, total, size, payback) is None:
            for earlier, _, _ in waiting.pop(key, []):
                add(earlier, key)
            built_keys.add(key)
            add(job, key)
            return
        alone = unpaid(job[1].name, gain_s, size, payback)
        assert alone is not None            # the group's total did not repay it either
        waiting.setdefault(key, []).append((job, gain_s, alone))

    for gi, graph_plan in enumerate(fusion_plan.graphs):
        if not request.loop_bodies and graph_plan.graph.kind != "entry":
            report.skipped.extend((k.name, "in a loop body or branch: left to XLA on retry")
                                  for k in graph_plan.stitched.kernels if k.schedule)
            continue
        try:
            view = views[gi] = ComputationView(module, graph_plan.graph)
        except KeyError as exc:
            report.skipped.extend((k.name, f"graph not found: {exc}")
                                  for k in graph_plan.stitched.kernels if k.schedule)
            continue
        scheduled = [k for k in graph_plan.stitched.kernels if k.schedule is not None]
        snapped, left_out = snap_kernels(view, scheduled, spec)
        # Memory-intensive kernels only (GEMM-chain kernels are always built): no chain
        # pricing, so a GEMM inside XLA's kernels is priced as the planner's baseline was.
        cost = CostModel(graph_plan.graph, spec, gemm_chains=False) \
            if payback is not None else None
        loop_copies = (cost or CostModel(graph_plan.graph, spec, gemm_chains=False)) \
            if request.device == "gpu" and LOOP_COPIES_ON_GPU and \
            graph_plan.graph.kind != "entry" else None
        report.skipped.extend(left_out)
        for job in _chain_jobs(request, report, view, gi, graph_plan, snapped):
            add(job)
        gains = {k.name: modeled_gain_s(graph_plan, k.members, cost) for k in snapped} \
            if payback is not None else {}

        def likely_paid(k: Any) -> bool:
            """Whether the kernel's estimated size repays its build alone (its exact size,
            and its copies, are known only once lowered)."""
            gain = gains[k.name]
            size = estimated_statements(k.schedule) if getattr(k.schedule, "parts", None) \
                else 0
            return gain > 0 and unpaid(k.name, gain, size, payback) is None

        order = _largest_first(snapped, likely_paid if payback is not None else None,
                               lead=build_threads() if submit is not None else 0)
        for k in order:
            try:
                site = find_site(view, gi, k.name, k.members)
            except NotPlaceable as exc:
                report.skipped.append((k.name, str(exc)))
                continue
            if loop_copies is not None:
                # A kernel the copies of its loop body make lose is left to XLA.
                loses = loses_with_copies(graph_plan, frozenset(k.members),
                                          carried_copy_bytes(view, site), spec,
                                          loop_copies)
                if loses:
                    log.info("kernel %s: %s: left to XLA", k.name, loses)
                    report.skipped.append((k.name, loses))
                    continue
            request.check_cancelled()
            gain_s = 0.0
            if payback is not None:
                # A kernel modeled to save nothing is not even lowered. Any other may still
                # repay its build, alone or with copies of its structure: its size decides.
                gain_s = gains[k.name]
                if gain_s <= 0:
                    leave(Unpaid(k.name, gain_s * 1e6, 0.0, None))
                    continue
            try:
                schedule = k.schedule
                grid_sync = launch_form(schedule, grid_sync_setting) \
                    if _global_scope(schedule) else None
                if _global_scope(schedule) and grid_sync is None:
                    schedule = _block_scope_schedule(graph_plan.graph, k.members, spec)
                def lower(schedule: Any, graph: Any = graph_plan.graph, name: str = k.name,
                          layouts: dict = xla_layouts(graph_plan.graph, k.members)) -> Any:
                    with LLVM_LOCK:
                        # in_place: the rewrite makes an atomic scatter's output alias its
                        # operand (output_to_operand_aliasing, PlacedKernel.initial).
                        # layouts: buffers are read and written in XLA's layouts.
                        return lower_kernel(graph, evaluator, schedule, name, in_place=True,
                                            validate=False,    # add() validates
                                            layouts=layouts)
                if budget is not None:
                    lowered, narrowed = lower_within_budget(graph_plan.graph, schedule, spec,
                                                            k.name, lower, budget)
                    if narrowed is not None:
                        report.narrowed.append(narrowed)
                else:
                    lowered = lower(schedule)
                if grid_sync == "relaunch" and kir.has_grid_barrier(lowered.kernel):
                    lowered = dataclasses.replace(lowered, kernel=dataclasses.replace(
                        lowered.kernel, grid_sync="relaunch"))
            except (CodegenError, StitchError) as exc:
                log.info("kernel %s stays with XLA: %s", k.name, exc)
                report.fallbacks.append((k.name, f"{type(exc).__name__}: {exc}"))
                continue
            if payback is not None:
                add_if_paid((view, k, site, lowered), gain_s)
            else:
                add((view, k, site, lowered))
    for group in waiting.values():
        for _, _, left in group:
            leave(left)
    return jobs


def _largest_first(kernels: list, likely_paid: Callable[[Any], bool] | None = None,
                   lead: int = 0) -> list:
    """``kernels`` in the order to lower them: the largest first (estimated Kernel IR
    statements), so that on the GPU the longest PTX builds start first and the small ones
    fill the end of the build instead of a large one trailing it alone. The rewrite puts
    the kernels back in plan order (``_place_kernels``).

    ``lead``: that many of the largest kernels ``likely_paid`` says will be built go first.
    At tiny sizes the largest kernels are often the ones payback then leaves to XLA: lowered
    first, they kept the PTX children idle for the pass's first 0.17 s (transformer_train
    tiny: three of them before the first build). The rest stays largest first, so a kernel
    the rough estimate misjudges is still lowered in its place."""
    from .code_budget import estimated_statements
    ordered = sorted(kernels, key=lambda k: -estimated_statements(k.schedule)
                     if getattr(k.schedule, "parts", None) else 0)
    if likely_paid is None or lead <= 0:
        return ordered
    first = [k for k in ordered if likely_paid(k)][:lead]
    taken = {id(k) for k in first}
    return first + [k for k in ordered if id(k) not in taken]


def _place_kernels(request: PassRequest, report: PassReport, fusion_plan: Any,
                   module: HloModule, spec: Any, evaluator: Any, placed: list,
                   views: dict, built: dict, launching: dict, ptx_workers: list) -> None:
    """Snap, lower and build every stitched kernel of the plan; what builds is appended to
    ``placed``/``built``, what does not to the report's skipped kernels and fallbacks.
    Lowering runs in plan order; on the GPU each lowered kernel's PTX and ptxas start at
    once, in parallel with the lowering of the next (``GpuPrebuild``); the FFI targets are
    made and registered in order, each as soon as its kernel's PTX is there."""
    from stitch.codegen.errors import CodegenError

    def place(job: tuple, ptx: Any) -> None:
        view, k, site, lowered = job
        try:
            if isinstance(ptx, Exception):
                raise ptx
            with LLVM_LOCK:
                ffi_target = build_target(lowered.kernel, request.device,
                                          arch=request.gpu_arch(),
                                          compile_only=request.compile_only,
                                          worker=ptx_workers[0] if ptx_workers else None,
                                          ptx=ptx.ptx if ptx is not None else None,
                                          assembled=ptx.assembled if ptx is not None
                                          else None, cancelled=request.cancel)
        except Cancelled:
            raise
        except (CodegenError, StitchError) as exc:
            log.info("kernel %s stays with XLA: %s", k.name, exc)
            report.fallbacks.append((k.name, f"{type(exc).__name__}: {exc}"))
            return
        placed.append(PlacedKernel(site, list(lowered.inputs), list(lowered.outputs),
                                   ffi_target.name, dict(lowered.initial),
                                   dict(getattr(lowered, "layouts", {}) or {})))
        built[k.name] = BuiltKernel(k.name, lowered, ffi_target)
        launching[k.name] = sum(1 for t in site.tops if view.launches(t))

    start = time.perf_counter()
    targets_s = 0.0
    if request.device == "gpu":
        with GpuPrebuild(request, ptx_workers) as prebuild:
            jobs = _lower_jobs(request, report, fusion_plan, module, spec, evaluator, views,
                               prebuild.submit)
            report.timings["lower_s"] = time.perf_counter() - start
            mark = time.perf_counter()
            # Each kernel's target is made as soon as its PTX is there, while later
            # kernels' PTX and ptxas still run.
            for job, ptx in zip(jobs, prebuild.each_result()):
                request.check_cancelled()
                begun = time.perf_counter()
                place(job, ptx)
                targets_s += time.perf_counter() - begun
        # The PTX and ptxas left to wait for once every kernel was lowered.
        report.timings["ptx_s"] = time.perf_counter() - mark - targets_s
    else:
        jobs = _lower_jobs(request, report, fusion_plan, module, spec, evaluator, views, None)
        report.timings["lower_s"] = time.perf_counter() - start
        begun = time.perf_counter()
        for job in jobs:
            request.check_cancelled()    # per kernel: an exit waits for one build at most
            place(job, None)
        targets_s = time.perf_counter() - begun
    report.timings["targets_s"] = targets_s
    # Lowered largest first (_largest_first): the rewrite places them in plan order.
    plan_order = {k.name: i for i, k in enumerate(fusion_plan.kernels)}
    placed.sort(key=lambda p: plan_order.get(p.site.name, len(plan_order)))


def compile_cache() -> Any:
    """The process's on-disk compile cache (stitch.codegen.cache: per-user, authenticated; a
    refused or unwritable directory turns caching off, logged, and compiles go on)."""
    global _CACHE
    with _LOCK:
        if _CACHE is None:
            from stitch.codegen.cache import CompileCache
            _CACHE = CompileCache()
        return _CACHE


_CACHE: Any = None


def build_target(kernel: Any, device: str, *, arch: str | None = None,
                 compile_only: bool = False, worker: Any = None, ptx: str | None = None,
                 assembled: Any = None, cancelled: Callable[[], bool] | None = None) -> Any:
    """The kernel as a registered XLA FFI target for ``device`` ("cpu" | "gpu"), its object
    code or PTX through the compile cache. GPU: PTX for ``arch`` (default: the device's);
    ``compile_only`` builds a target XLA compiles against without a device (ptxas checks
    the PTX; the handler never runs, see stitch.codegen.ffi_cuda.compile_only_cuda_target).
    ``worker``: a stitch.codegen.isolation.IsolatedWorker to emit PTX in (one child for all the
    kernels of a module, instead of a fresh interpreter per kernel). ``ptx``: the kernel's
    PTX for ``arch`` when already emitted (``GpuPrebuild``), ``assembled`` ptxas's result
    for it: compile-only, checked; on a device, its cubin is what the driver loads (the
    PTX where the driver refuses it). ``cancelled``: polled while a CPU kernel's object
    code is built in the host-build child (``host_builds``); once true the build is given
    up with ``Cancelled``."""
    if device == "cpu":
        from stitch.codegen.ffi import host_ffi_target

        from .host_builds import host_object_builder
        target = host_ffi_target(kernel, cache=compile_cache(),
                                 object_builder=host_object_builder(cancelled))
    elif device == "gpu":
        from stitch.codegen.ffi_cuda import compile_only_cuda_target, cuda_ffi_target
        from stitch.codegen.gpu_cache import emit_ptx_cached
        arch = arch or gpu_arch()
        if ptx is None:
            ptx = emit_ptx_cached(kernel, arch, cache=compile_cache(), worker=worker).ptx
        if compile_only:
            target = compile_only_cuda_target(kernel, ptx, arch, cache=compile_cache(),
                                              assembled=assembled)
        elif assembled is not None:
            target = cuda_ffi_target(kernel, assembled.cubin,
                                     entry=assembled.entry or kernel.name, fallback_ptx=ptx)
        else:
            target = cuda_ffi_target(kernel, ptx)
    else:
        raise PassError(f"device {device!r} is not supported (cpu, gpu)")
    target.register()
    return target


def cubins_for_device(arch: str) -> bool:
    """Whether the pass loads ptxas's cubins for ``arch`` on a device: a ptxas for it is
    found and the driver has not refused one in this process (stitch.codegen.ffi_cuda)."""
    from stitch.codegen.errors import ToolchainError
    from stitch.codegen.ffi_cuda import cubins_refused
    from stitch.codegen.toolchain import find_ptxas
    if cubins_refused():
        return False
    try:
        find_ptxas(arch)
    except ToolchainError as exc:
        log.info("no ptxas for %s (%s): the driver JIT-compiles the kernels' PTX", arch, exc)
        return False
    return True


def gpu_arch() -> str:
    """sm_XY of the first CUDA device jax sees."""
    import jax
    capability = getattr(jax.devices("gpu")[0], "compute_capability", None)
    if not capability:
        raise PassError("the GPU device does not report its compute capability")
    return "sm_" + str(capability).replace(".", "")


def target_arch(target: str) -> str:
    """sm_XY of a GPU spec (``stitch.cost.gpu_specs``): the arch a compile for ``target``
    without a device builds for."""
    from stitch.cost.gpu_specs import get_spec
    major, minor = get_spec(target).compute_capability
    return f"sm_{major}{minor}"


def compile_with_pass(lowered: Any, request: PassRequest) -> tuple[Any, PassReport]:
    """``lowered`` compiled by XLA with the pass on for it: (executable, report).

    XLA CPU has failed to link an FFI call placed in a loop body (jax's threefry loop:
    "Symbols not found: __xla_cpu_runtime_HandleFfiCall"); when XLA rejects a module with
    kernels in loop bodies, the compile is retried once with ENTRY kernels only."""
    if request.device == "gpu" and not request.compile_only:
        from stitch.integration.device_target import pass_target
        request.target = pass_target(request.target)     # the device's, unless named
    private = request.prepare(lowered)
    try:
        with request:
            compiled = private.compile()
        if request.report is None and request.error is None and request.calls == 0:
            log.warning("%s: XLA compiled for %s without calling stitch's pass (registered "
                        "for %s); the program runs as stock XLA", request.function,
                        request.device, ", ".join(sorted(_REGISTERED)) or "nothing")
        return _holding_kernels(compiled, request.result())
    except Exception as exc:  # noqa: BLE001 - XLA's own error on the rewritten module
        if isinstance(request.error, Cancelled):
            raise request.error from None       # the pass stopped XLA's compile
        report = request.report
        if report is None or not report.in_loop_bodies:
            raise
        log.info("%s: XLA rejected stitched kernels in loop bodies (%s: %s); retrying with "
                 "ENTRY kernels only", request.function, type(exc).__name__,
                 str(exc).splitlines()[0][:200])
    retry = PassRequest(request.function, request.target, request.device, request.cancel,
                        request.options, loop_bodies=False,
                        compile_only=request.compile_only, arch=request.arch)
    private = retry.prepare(lowered)
    with retry:
        compiled = private.compile()
    return _holding_kernels(compiled, retry.result())


def _holding_kernels(executable: Any, report: PassReport) -> tuple[Any, PassReport]:
    """The executable made to hold its kernels' FFI targets: the targets' code lives as long
    as something holds them (stitch.codegen.ffi.cached_target), and XLA calls it by address."""
    executable._stitch_ffi_targets = tuple(k.target for k in report.kernels)
    return executable, report


def compile_hlo_text(text: str, request: PassRequest | None, platform: str = "cpu"
                     ) -> tuple[Callable[..., list], PassReport | None]:
    """An HLO module (text, e.g. tf2xla's) compiled on jax's XLA client with the pass on:
    (call, report). ``call(*arrays)`` runs it on the first device and returns the root's
    leaves. The module is tagged with the request's token (a module-level frontend
    attribute, which survives the conversion to StableHLO). With ``request=None`` it is
    XLA's own compile of the module (no pass, report None): the reference a stitched
    program is checked against where the module came from another XLA (TF's)."""
    import jax
    import jax.extend.backend as jax_backend
    from jax._src.lib import _jax

    module = parse_hlo(text)
    elided = [inst.name for _, inst in module.instructions()
              if inst.opcode == "constant" and inst.literal == ELIDED]
    if elided:
        # XLA's parser reads an elided constant as zeros: the program would run wrong.
        raise PassError(f"module {module.name!r}: {len(elided)} constant(s) printed without "
                        f"their values ({ELIDED}), e.g. {elided[0]!r}; print the HLO with "
                        f"print_large_constants=True")
    if request is not None:
        attrs = module.attrs.get("frontend_attributes", "{}").strip()
        inner = attrs[1:-1].strip()
        module.attrs["frontend_attributes"] = \
            "{" + (inner + "," if inner else "") + f'{REQUEST_ATTR}="{request.token}"' + "}"
    proto = _to_proto(print_hlo(module, operand_shapes=True))
    stablehlo = _jax.mlir.hlo_to_stablehlo(proto)
    backend = jax_backend.get_backend(platform)
    device = backend.local_devices()[0]
    options = jax_backend.get_compile_options(num_replicas=1, num_partitions=1)
    if request is None:
        executable = backend.compile_and_load(stablehlo, _jax.DeviceList((device,)), options)
    else:
        ensure_registered("cpu" if platform == "cpu" else "cuda")
        with request:
            executable = backend.compile_and_load(stablehlo, _jax.DeviceList((device,)),
                                                  options)

    def call(*arrays: Any) -> list:
        return executable.execute([jax.device_put(a, device) for a in arrays])
    if request is None:
        return call, None
    report = request.result()
    return _holding_kernels(call, report)
