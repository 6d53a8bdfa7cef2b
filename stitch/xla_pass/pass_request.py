"""One compile stitch's XLA pass is asked for (``PassRequest``), what the pass did to its
module (``PassReport``), the pass's errors, and the arch a request's GPU kernels are built for.

A request is live while its compile runs (``with request:``); the XLA callback
(``pass_registration``) finds it by the token its module carries (``live_request``).
"""
from __future__ import annotations

import logging
import re
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from stitch.errors import Cancelled, StitchError

from stitch.config import ConfigError
from . import early_imports
from .ptx_children import early_ptx_children, release_ptx_workers, start_ptx_workers

log = logging.getLogger("stitch.xla_pass.request")

REQUEST_ATTR = "stitch.request"
_TAG = re.compile(r',?\s*stitch\.request="?[0-9a-f]+"?')


def untagged_attributes(attributes: str) -> str | None:
    """A module's frontend attributes (``{...}``) without the request's token (it is unique
    per compile: left in, nothing keyed by the module would ever be found again); None where
    nothing else is left."""
    kept = _TAG.sub("", attributes[1:-1]).strip().lstrip(",")
    return "{" + kept + "}" if kept else None


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
    timings: dict[str, float] = field(default_factory=dict)       # seconds per phase
    # Kernel IR lowerings (stitch.codegen.lowering_reuse): kernels_lowered, lowerings_reused,
    # lowerings_from_cache.
    lowerings: dict[str, int] = field(default_factory=dict)
    plan: Any = None                  # the FusionPlan
    # Kernels built at a narrower vector width than tuned (stitch.xla_pass.code_budget).
    narrowed: list = field(default_factory=list)
    # Kernels left to XLA because they would not repay their build (stitch.xla_pass.payback).
    unpaid: list = field(default_factory=list)
    # Kernels left to XLA because their busiest thread as built runs longer than the kernel
    # was priced at, losing the saving (pass_planning.slower_as_built).
    thread_bound: list[str] = field(default_factory=list)
    # Planned vs delivered: the final module priced as XLA's is (stitch.xla_pass.delivered).
    delivery: Any = None
    # XLA's scatters (fused) the plan computed as row reductions: proved sorted fixed-length
    # segments (stitch.xla_pass.segment_rows); placed where a placed kernel holds them.
    segment_rows: list[str] = field(default_factory=list)
    # Each planned stitched kernel's place in the user's code (its functions, file:line,
    # from XLA's metadata; stitch.hlo.source_lines), "" where XLA kept none.
    where: dict[str, str] = field(default_factory=dict)
    # The result was the stored one of an earlier compile of the same module (no plan:
    # stitch.xla_pass.result_store).
    from_store: bool = False

    def sources(self) -> dict[str, dict[str, str]]:
        """Where the placed kernels and the dropped ones come from (STITCH_STATS' ``where``)."""
        placed = set(self.placed)
        dropped = [n for n, r in self.skipped + self.fallbacks
                   if n not in placed and not r.startswith("same as XLA")]
        return {"stitched": {n: self.where.get(n, "") for n in self.placed},
                "dropped": {n: self.where.get(n, "") for n in dict.fromkeys(dropped)}}

    def summary(self) -> dict:
        return {"kernels_before": self.kernels_xla, "kernels_after": self.kernels_after,
                "stitched_kernels": self.kernels_stitched,
                "fallbacks": len(self.fallbacks), "thread_bound": len(self.thread_bound),
                **self.lowerings, "from_store": self.from_store,
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
    # GPU without a device (stitch/xla_pass/deviceless.py): compile-only CUDA targets, PTX
    # assembled for ``arch`` (default: the compute capability of ``target``'s spec).
    compile_only: bool = False
    arch: str | None = None
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    report: PassReport | None = None
    error: BaseException | None = None
    calls: int = 0                                # modules of this request the pass saw
    # XLA's module printed with its metadata (op_name, source lines), read for the report's
    # ``where`` only: the pass's own text is printed without (pass_registration).
    metadata_text: str = ""
    # GPU, where ``early_ptx_children()``: the PTX children, started as the compile begins
    # (``__enter__``) so that their start-up runs during XLA's own passes; the pass takes
    # them. Elsewhere the pass starts them as it begins, during planning.
    _ptx_workers: list = field(default_factory=list, init=False, repr=False, compare=False)
    # What the pass leaves to do once XLA has compiled the module it handed back (kept:
    # XLA may still reject it), run by ``__exit__`` when the compile returned.
    _on_success: list = field(default_factory=list, init=False, repr=False, compare=False)

    def __enter__(self) -> "PassRequest":
        with _LOCK:
            _REQUESTS[self.token] = self
        early_imports.start()
        if self.device == "gpu" and not self._ptx_workers:
            try:
                if early_ptx_children():
                    self._ptx_workers = start_ptx_workers()
            except ConfigError as exc:
                log.warning("%s: %s; the PTX children start with the pass", self.function, exc)
            except Exception as exc:  # noqa: BLE001 - the pass starts its own, or says why
                log.debug("%s: PTX children not started early: %s", self.function, exc)
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        with _LOCK:
            _REQUESTS.pop(self.token, None)
        # The pass never ran (or never took them): back to the process's children.
        release_ptx_workers(self.take_ptx_workers())
        done, self._on_success = self._on_success, []
        if exc_type is None and self.error is None:
            for action in done:
                try:
                    action()
                except Exception as exc:  # noqa: BLE001 - the compile itself succeeded
                    log.warning("%s: after the compile: %s: %s", self.function,
                                type(exc).__name__, exc)

    def when_compiled(self, action: Callable[[], None]) -> None:
        """Run ``action`` once XLA has compiled the module the pass handed back (not if
        the compile fails: XLA rejected it, or it was cancelled)."""
        self._on_success.append(action)

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


def live_request(token: str) -> PassRequest | None:
    """The request whose compile is running with ``token``, if any."""
    with _LOCK:
        return _REQUESTS.get(token)


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
