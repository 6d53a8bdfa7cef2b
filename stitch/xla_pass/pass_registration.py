"""stitch's HLO pass registered with XLA, and XLA's callback into it.

``ensure_registered(platform)`` registers one HLO module transformation with jax
(``jax.extend.xla.register_hlo_module_transformation``). XLA calls it (``xla_callback``) on
every fresh compile, jax's own small jits included; it acts only on modules that carry the
module-level frontend attribute ``stitch.request=<token>`` of a live ``PassRequest``
(``PassRequest.prepare(lowered)`` returns a private copy of the lowered StableHLO carrying it,
to ``compile()``). For those it:

1. reads XLA's module (``as_hlo_text(print_large_constants=True)``: without it large
   constants print as ``{...}`` and would come back as zeros);
2. has ``pass_planning.stitch_module`` plan it, build the stitched kernels that can be placed
   and put them in;
3. hands the rewritten module back to XLA (``to_proto``). Everything else stays as XLA made
   it: rng, u64, opt-barrier, key types, collectives, aliasing and donation (the printed
   module header keeps ``input_output_alias`` and ``buffer_donor``).
   Except on jaxlib 0.10.2, whose hook rebuilds XLA's module from the proto handed back
   with ``HloModule::ReplaceEntryComputation``, which resets the module's aliasing and
   buffer donors: every module handed back loses its donation, even XLA's own bytes
   unchanged (seen on CPU; the 0.10-era PJRT plugin adapter in XLA's source does the same).
   ``jax_jit._lost_donations`` then deletes the donated buffers after each call. jaxlib
   0.11.2 keeps the aliasing (seen: CPU PRE_SCHEDULER, deviceless GPU POST_SCHEDULER).
Stage: on CPU both stages already hold XLA's fusions; PRE_SCHEDULER is used so XLA
schedules the custom calls with the rest. On the CUDA plugin PRE_SCHEDULER is still
pre-fusion, so POST_SCHEDULER (fused, scheduled: the rewrite keeps a topological order that
follows XLA's) is the stage that sees XLA's fusions.

Without a GPU (the deviceless check, tests only): ``stitch/xla_pass/deviceless.py`` registers
``xla_callback`` with the CUDA plugin's XlaTransform extension (jax's public registration
needs a started GPU backend).

The callback raises into XLA only when its request was cancelled (the interpreter is
exiting), which stops that compile at once; any other failure leaves the module unchanged
and is kept on the request (``PassRequest.result()`` raises it as a ``StitchError`` on the
caller's side).
"""
from __future__ import annotations

import json
import logging
import os
import re
import threading
import time

from stitch.hlo import HloModule, parse_hlo, print_hlo
from stitch.errors import Cancelled

from . import early_imports
from .collector import fewer_collections
from stitch.config import setting_raw
from .pass_planning import stitch_module
from .pass_request import (REQUEST_ATTR, PassError, PassReport, PassRequest, live_request,
                           untagged_attributes)
from .result_store import replayed, result_key, store_result

log = logging.getLogger("stitch.xla_pass")

_REQUEST_BYTES = REQUEST_ATTR.encode()
_TOKEN = re.compile(r'stitch\.request="?([0-9a-f]+)"?')

_LOCK = threading.Lock()

_REGISTERED: set[str] = set()
_FAILED: dict[str, "PassRegistrationError"] = {}

# The names a CUDA plugin may be known by. jax 0.10.2 registers on clients as they start,
# keyed on ``client.platform`` ("gpu" for CUDA clients); jax 0.11 looks each name up among
# the loaded PJRT plugins at once, where CUDA's is "cuda" and "gpu" is NOT_FOUND.
CUDA_PLATFORM_NAMES = ("cuda", "gpu")


class PassRegistrationError(PassError):
    """jax would not register stitch's pass for a platform (every name it was tried under
    refused): nothing can be stitched there in this process."""


def ensure_registered(platform: str) -> None:
    """Register the pass for ``platform`` ("cpu" or "cuda") once per process.

    CUDA: jax's public call once per name a CUDA plugin may be known by
    (``CUDA_PLATFORM_NAMES``); a name this jax does not know is skipped, and at least one
    must be taken. jax 0.10.2 registers through a hook that runs on the clients already
    started and on each one as it starts; jax 0.11 registers on the plugin itself, which
    covers its clients. Should a client get the pass twice, the second call per compile
    sees the module already stitched and leaves it (``PassRequest.calls``).

    Raises ``PassRegistrationError`` naming every name tried and jax's answer; the failure
    is kept, so later compiles get the same error at once instead of retrying."""
    import jax.extend.xla as xla_ext

    platform = platform.lower()
    with _LOCK:
        if platform in _REGISTERED:
            return
        if platform in _FAILED:
            raise _FAILED[platform]
        stage = (xla_ext.PipelineStage.PRE_SCHEDULER if platform == "cpu"
                 else xla_ext.PipelineStage.POST_SCHEDULER)
        names = ("cpu",) if platform == "cpu" else CUDA_PLATFORM_NAMES
        refused: dict[str, str] = {}
        taken = []
        for name in names:
            try:
                xla_ext.register_hlo_module_transformation(xla_callback, name="stitch",
                                                           stage=stage, platforms=[name])
                taken.append(name)
            except Exception as exc:  # noqa: BLE001 - jax's runtime errors carry the reason
                refused[name] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
        if not taken:
            error = PassRegistrationError(_refusal_message(platform, refused))
            _FAILED[platform] = error
            raise error
        _REGISTERED.add(platform)
    log.debug("stitch pass registered for %s at %s under %s%s", platform, stage.name,
              ", ".join(taken), "".join(f"; {n} refused ({why})" for n, why in refused.items()))


def _refusal_message(platform: str, refused: dict[str, str]) -> str:
    try:
        import jax
        version = f"jax {jax.__version__}"
    except Exception:  # noqa: BLE001 - only for the message
        version = "jax"
    tried = "; ".join(f"{name!r}: {why}" for name, why in refused.items())
    hint = (" Is jax's CUDA plugin installed and a GPU visible (jax.devices('gpu'))?"
            if platform != "cpu" else "")
    return (f"stitch's pass could not be registered with {version} for {platform}: every "
            f"platform name was refused ({tried}); nothing is stitched on {platform} in this "
            f"process, every function runs on stock XLA.{hint}")


def registers_on_client_start() -> bool:
    """Whether this jax registers passes through a hook on clients as they start (0.10.2),
    rather than on the loaded plugin at once (0.11: ``get_pjrt_plugin``)."""
    from jax._src import xla_bridge
    return hasattr(xla_bridge, "register_backend_initialization_hook")


def registered_platforms() -> list[str]:
    """The platforms the pass is registered for in this process, sorted."""
    with _LOCK:
        return sorted(_REGISTERED)


def xla_callback(data: bytes) -> bytes | None:
    """XLA's hook (module docstring). Returns None (module unchanged) unless stitched."""
    if _REQUEST_BYTES not in data:          # cheap: most compiles are not stitch's
        return None
    request: PassRequest | None = None
    try:
        from jaxlib import _hlo

        text = _hlo.XlaComputation(data).as_hlo_text(print_large_constants=True)
        match = _TOKEN.search(text[:text.find("\n")] if "\n" in text else text)
        request = live_request(match.group(1)) if match else None
        if request is None:
            return None
        request.calls += 1
        if request.calls > 1:               # a second module of the same compile
            log.debug("%s: pass called again (module %s); left to XLA", request.function,
                      text[:60])
            return None
        request.metadata_text = metadata_text(data) if wants_sources() else ""
        new_text = stitch_module_text(text, request)
        if new_text is None:
            return None
        return to_proto(new_text)
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


def to_proto(text: str) -> bytes:
    """XLA's parser on stitch's rewritten text; a rejection names the offending line."""
    from jaxlib import _hlo
    try:
        return _hlo.hlo_module_from_text(text).as_serialized_hlo_module_proto()
    except Exception as exc:  # noqa: BLE001 - XLA's parser error, made specific
        where = re.search(r"parsing (\d+):(\d+)", str(exc))
        line = text.splitlines()[int(where.group(1)) - 1].strip() if where else ""
        raise PassError(f"XLA's parser rejects stitch's rewritten module: "
                        f"{str(exc).splitlines()[-1].strip()} in: {line[:300]}") from exc


# XLA prints some instructions in a form its own parser refuses: XLA 0.11.2 gives
# ``all-reduce-start`` a tuple shape whose output aliases its operand
# (``output_to_operand_aliasing``), which its parser rejects as an attribute and whose shape
# its verifier rejects. Such a module cannot come back from text at all.
UNREADABLE_HINT = "output_to_operand_aliasing"
_PLAIN_ALIASING_OPS = (" custom-call(", " fusion(")


def check_readable(text: str) -> None:
    """PassError when XLA's parser cannot read back XLA's own print of the module (checked
    only when a line carries ``UNREADABLE_HINT`` outside the ops that always take it)."""
    suspect = next((line for line in text.splitlines() if UNREADABLE_HINT in line
                    and not any(op in line for op in _PLAIN_ALIASING_OPS)), None)
    if suspect is None:
        return
    from jaxlib import _hlo
    try:
        _hlo.hlo_module_from_text(text)
    except Exception as exc:  # noqa: BLE001 - XLA's parser error, made specific
        import jax
        said = next((line.strip() for line in str(exc).splitlines() if "error:" in line),
                    str(exc).splitlines()[0])
        raise PassError(f"XLA (jax {jax.__version__}) cannot read back its own print of this "
                        f"module ({said[:200]}), so no rewrite of "
                        f"it can be handed back; left to XLA. The line: "
                        f"{suspect.strip()[:200]}") from exc


def _untag(module: HloModule) -> None:
    """Drop the request's token from the module (``untagged_attributes``)."""
    attrs = module.attrs.get("frontend_attributes")
    if attrs is None:
        return
    kept = untagged_attributes(attrs)
    if kept:
        module.attrs["frontend_attributes"] = kept
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
    planned and delivered figures, bench/xla_units.py reads them)."""
    if path is None:
        return
    try:
        with open(path[:-len(".hlo")] + ".summary.json", "w") as f:
            json.dump(report.summary(), f)
    except OSError as exc:
        log.warning("%s: could not write the summary: %s", DUMP_ENV, exc)


def wants_sources() -> bool:
    """Whether anyone reads the kernels' source lines (STITCH_LOG=info or STITCH_STATS):
    printing XLA's module again with its metadata costs ~0.1 s on a large module."""
    return (logging.getLogger("stitch").isEnabledFor(logging.INFO)
            or bool((setting_raw("STITCH_STATS") or "").strip()))


def metadata_text(data: bytes) -> str:
    """XLA's module (a serialized proto) printed with its metadata and source tables."""
    try:
        from jaxlib import _hlo
        options = _hlo.HloPrintOptions.short_parsable()
        options.print_metadata = True
        options.print_large_constants = False
        return _hlo.XlaComputation(data).get_hlo_module().to_string(options)
    except Exception as exc:  # noqa: BLE001 - the source lines are a nicety
        log.debug("no source lines for the report: %s", exc)
        return ""


def stitch_module_text(text: str, request: PassRequest) -> str | None:
    """The module with stitch's kernels in (None when none was placed); sets
    ``request.report``."""
    start = time.perf_counter()
    # Nothing is imported here while the early imports run (a module imported by two
    # threads at once can be seen half-initialised: ImportError).
    early_imports.wait()
    dumped = _dump_module(text, request)
    # The same module compiled before under the same settings and code: its result.
    key = result_key(text, request)
    stored = replayed(key, text, request)
    if stored is not None:
        new_text, report = stored
        report.timings["pass_s"] = time.perf_counter() - start
        request.report = report
        _dump_summary(dumped, report)
        return new_text
    with fewer_collections():        # the pass allocates millions of objects (collector.py)
        check_readable(text)
        module = parse_hlo(text)
        _untag(module)
        request.check_cancelled()
        report = stitch_module(module, request)
        report.timings["pass_s"] = time.perf_counter() - start
        request.report = report
        _dump_summary(dumped, report)
        if not report.placed:
            return None
        new_text = print_hlo(module, operand_shapes=True)
    # Kept only once XLA has compiled it: a module XLA rejects is not a result.
    request.when_compiled(lambda: store_result(key, new_text, report))
    return new_text
