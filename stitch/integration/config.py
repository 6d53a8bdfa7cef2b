"""Settings read from the environment (documented in the README).

STITCH_ENABLE   1/true: the autoload patches jax.jit / TF / Keras on import (stitch_autoload.py, stitch/integration/autoload.py)
STITCH_ASYNC    0/false: compile before the first call instead of in the background (default 1)
STITCH_TARGET   the GPU the plan is made for: v100 | a100 | h100 | h200 (default h100)
STITCH_DEVICE   where stitched kernels run: cpu | gpu (default: gpu when jax has one, else cpu)
STITCH_VERIFY   1/true: compare the first stitched call with stock XLA and fall back on mismatch;
                every:N compares every N-th stitched call (the first included)
STITCH_STATS    a path: at exit, JSON with one record per stitched function signature
STITCH_GUARD    0/false: keep the stitched kernels even where they time slower than stock
                XLA over the first calls after the switch (default 1: keep the faster)
STITCH_CACHE_DIR  the on-disk compile cache (stitch/codegen/cache.py)
STITCH_GRID_SYNC  how the GPU runs global-scope kernels (grid barriers): ``relaunch`` (default:
                one launch per phase on the stream inside one custom call, no co-residency
                needed), ``barrier`` (one persistent launch, cooperative, a software grid
                barrier between phases; opt-in until it has run on a GPU), ``auto`` (per
                kernel, the form the latency-evaluator models faster), ``off`` (none: the
                pass builds the block scopes' schedule; stitch.cost.launch_forms)
                It also lets the GPU pass split a GEMM chain's n across blocks (a second
                launch sums the f32 partials; ExplorerOptions.chain_grid_sync)
STITCH_CODE_BUDGET  Kernel IR statements above which the GPU pass builds a kernel at a
                narrower vector width when that models within 5% (default 1000; ``off``:
                every kernel as tuned; stitch/integration/code_budget.py)
STITCH_PAYBACK_STEPS  steps within which a kernel's modeled saving per step must repay its
                estimated build for the GPU pass to build it (default 100000; ``off``: every
                kernel is built; stitch/integration/payback.py)
STITCH_SEGMENT_ROWS  0/false: the XLA pass plans XLA's module as it is, its proved sorted
                fixed-length segment scatters/gathers left atomic scatters and gathers
                (default 1: planned and built as row reductions and broadcasts inside
                XLA's fusions; stitch/integration/segment_rows.py)
STITCH_COMMAND_BUFFERS  0/false: stitched GPU kernels are not offered to XLA's command
                buffers (CUDA graphs); default 1: every kernel without a grid barrier
                declares its FFI handler command-buffer compatible, so XLA records it in the
                graph with its own kernels instead of splitting the graph around it
STITCH_DUMP_MODULES  a folder: the XLA pass writes each module it plans there
                (``<function>.<n>.hlo``; profiling and bug reports)
STITCH_INJECT_FAILURE  testing aid: ``compile`` makes every stitched compile fail (the
                fallback path), ``run`` every stitched call
STITCH_LOG      a logging level (debug, info, warning...) for the ``stitch`` logger, printed to
                stderr; ``kernels`` = info plus every stitched kernel's Kernel IR
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable

from stitch.cost.launch_forms import GRID_SYNC_SETTINGS
from stitch.errors import StitchError

TARGETS = ("v100", "a100", "h100", "h200")
DEVICES = ("cpu", "gpu")
# Every STITCH_* variable stitch, its scripts and its tests read: any other is a misspelling
# (said once, with the nearest names).
KNOWN_SETTINGS = frozenset({
    "STITCH_ASYNC", "STITCH_BUILD_THREADS", "STITCH_CACHE_DIR", "STITCH_CODE_BUDGET",
    "STITCH_COMMAND_BUFFERS", "STITCH_DEVICE", "STITCH_DUMP_MODULES",
    "STITCH_EARLY_PTX_CHILDREN", "STITCH_ENABLE", "STITCH_GRID_SYNC", "STITCH_GUARD",
    "STITCH_INJECT_FAILURE", "STITCH_ISOLATE", "STITCH_LIBDEVICE", "STITCH_LLVM_PIPELINE",
    "STITCH_LOG", "STITCH_MIN_BYTES", "STITCH_PAYBACK_STEPS", "STITCH_PTXAS",
    "STITCH_SEGMENT_ROWS", "STITCH_STATS", "STITCH_TARGET", "STITCH_VERIFY",
    # scripts, the GPU kit and the tests
    "STITCH_BLOCK_MODULES", "STITCH_CUDA_VENV", "STITCH_DEVICE_PYTHON", "STITCH_DEVICE_VENV",
    "STITCH_FUZZ_SEEDS", "STITCH_FUZZ_START", "STITCH_SCENARIO_SECONDS", "STITCH_TEST_MARKER",
    "STITCH_TEST_RESULT", "STITCH_THIRDPARTY", "STITCH_THIRDPARTY_PLAIN_TIMEOUT",
    "STITCH_THIRDPARTY_TIMEOUT", "STITCH_WHEELS", "STITCH_XLA_CORPUS"})
DEFAULT_TARGET = "h100"          # STITCH_TARGET unset (a GPU pass plans for its device)
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class ConfigError(StitchError, ValueError):
    """A STITCH_* variable, or an argument of stitch's, has a value stitch does not
    understand (a ValueError too, as jax.jit's own argument errors are)."""


def env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r}: expected 1/0, true/false, yes/no or on/off")


def env_count(name: str, default: int, what: str) -> int | None:
    """A positive count from ``$name`` (``_`` separators allowed): unset → ``default``,
    ``off`` (or 0/false/no) → None, anything else a ConfigError naming ``what`` it counts."""
    raw = os.environ.get(name, "").strip().lower().replace("_", "")
    if not raw:
        return default
    if raw in _FALSE:
        return None
    if raw.isdigit():
        return int(raw)
    raise ConfigError(f"{name}={raw!r}: expected a number of {what} or off")


@dataclass(frozen=True)
class Settings:
    """What ``stitch.jit`` and the TF front end read from the environment.

    ``problems`` names each setting that could not be read (its default was used instead):
    a function whose settings have problems stays on the stock path (``read()``)."""
    async_compile: bool
    target: str
    device: str | None
    verify: bool | int          # True: the first stitched call; N: every N-th
    guard: bool
    problems: tuple[str, ...] = ()

    @classmethod
    def read(cls) -> "Settings":
        """The settings, each unreadable one at its default and named in ``problems`` (and
        logged once per process): never raises."""
        problems: list[str] = []

        def lenient(reader: Callable[[], Any], default: Any) -> Any:
            try:
                return reader()
            except ConfigError as exc:
                problems.append(str(exc))
                return default

        settings = cls(async_compile=lenient(lambda: env_flag("STITCH_ASYNC", True), True),
                       target=lenient(target_setting, DEFAULT_TARGET),
                       device=lenient(device_setting, None),
                       verify=lenient(verify_setting, False),
                       guard=lenient(lambda: env_flag("STITCH_GUARD", True), True),
                       problems=())
        lenient(log_level_setting, None)
        for problem in problems:
            report_setting_once(problem)
        return replace(settings, problems=tuple(problems))

    @classmethod
    def from_env(cls) -> "Settings":
        """The settings; the first unreadable one raises its ConfigError (the CLI's way)."""
        settings = cls.read()
        if settings.problems:
            raise ConfigError(settings.problems[0])
        return settings


def unknown_settings(environ: dict[str, str] | None = None) -> list[str]:
    """One line per STITCH_* variable stitch does not read, with the nearest known names."""
    import difflib
    environ = os.environ if environ is None else environ
    lines = []
    for name in sorted(n for n in environ if n.startswith("STITCH_") and
                       n not in KNOWN_SETTINGS):
        near = difflib.get_close_matches(name, sorted(KNOWN_SETTINGS), n=1, cutoff=0.75)
        lines.append(f"{name} is not a stitch setting and is ignored"
                     + (f" (did you mean {near[0]}?)" if near else ""))
    return lines


def check_target(target: str | None) -> str | None:
    """``target`` lowered, or ConfigError naming the targets stitch plans for."""
    return _one_of(target, TARGETS, "target", f"stitch plans for {', '.join(TARGETS)}")


def check_device(device: str | None) -> str | None:
    """``device`` lowered, or ConfigError naming the devices stitch runs kernels on."""
    return _one_of(device, DEVICES, "device", f"stitched kernels run on {' or '.join(DEVICES)}")


def check_options(*, async_compile: Any, verify: Any, guard: Any) -> None:
    """stitch.jit's own switches: ``async_compile``/``guard`` None or a bool, ``verify`` None,
    a bool or a whole N >= 1 (every N-th call); anything else a TypeError, as jax.jit
    refuses an argument it cannot use."""
    for name, value in (("async_compile", async_compile), ("guard", guard)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"stitch.jit: {name}={value!r}: expected True, False or None")
    if verify is None or isinstance(verify, bool):
        return
    if not isinstance(verify, int) or verify < 1:
        raise TypeError(f"stitch.jit: verify={verify!r}: expected True, False, None or a "
                        "whole N >= 1 (every N-th stitched call)")


def _one_of(value: str | None, allowed: tuple[str, ...], name: str, says: str) -> str | None:
    if value is None:
        return None
    got = str(value).strip().lower()
    if got not in allowed:
        raise ConfigError(f"{name}={value!r}: {says}")
    return got


def target_setting() -> str:
    """STITCH_TARGET: the GPU the plan is made for (default h100)."""
    target = os.environ.get("STITCH_TARGET", "").strip().lower() or DEFAULT_TARGET
    if target not in TARGETS:
        raise ConfigError(f"STITCH_TARGET={target!r}: expected one of {', '.join(TARGETS)}")
    return target


def device_setting() -> str | None:
    """STITCH_DEVICE: where stitched kernels run (None: gpu when jax has one, else cpu)."""
    device = os.environ.get("STITCH_DEVICE", "").strip().lower() or None
    if device not in (None, "cpu", "gpu"):
        raise ConfigError(f"STITCH_DEVICE={device!r}: expected cpu or gpu")
    return device


_REPORTED: set[str] = set()
_REPORTED_LOCK = threading.Lock()


def report_setting_once(problem: str) -> None:
    """Log an unreadable setting once per process (every function reads the settings)."""
    with _REPORTED_LOCK:
        if problem in _REPORTED:
            return
        _REPORTED.add(problem)
    # Logged on the "stitch" logger: with STITCH_LOG itself unreadable no handler is set up,
    # and logging's last-resort handler still prints a warning to stderr.
    logging.getLogger("stitch.config").warning(
        "%s; ignored: stitched compiles stay off where it applies", problem)




def grid_sync_on_gpu() -> str:
    """STITCH_GRID_SYNC: how the GPU pass builds global-scope (grid barrier) kernels —
    "relaunch" (the default), "barrier", "auto" or "off" (stitch.cost.launch_forms, the rule
    the planner prices by too)."""
    raw = os.environ.get("STITCH_GRID_SYNC", "relaunch").strip().lower() or "relaunch"
    if raw not in GRID_SYNC_SETTINGS:
        raise ConfigError(f"STITCH_GRID_SYNC={raw!r}: expected one of "
                          f"{', '.join(GRID_SYNC_SETTINGS)}")
    return raw


def command_buffers_setting() -> bool:
    """STITCH_COMMAND_BUFFERS: whether stitched GPU kernels may join XLA's command buffers."""
    return env_flag("STITCH_COMMAND_BUFFERS", True)


def segment_rows_setting() -> bool:
    """STITCH_SEGMENT_ROWS: whether the XLA pass plans proved sorted segments as rows."""
    return env_flag("STITCH_SEGMENT_ROWS", True)


def verify_setting() -> bool | int:
    """STITCH_VERIFY: a flag, or ``every:N`` for sampled verification."""
    raw = os.environ.get("STITCH_VERIFY", "").strip().lower()
    if raw.startswith("every:"):
        try:
            n = int(raw[len("every:"):])
        except ValueError:
            n = 0
        if n < 1:
            raise ConfigError(f"STITCH_VERIFY={raw!r}: every:N needs a whole N >= 1")
        return True if n == 1 else n
    return env_flag("STITCH_VERIFY", False)


def injected_failure(stage: str) -> None:
    """Raise when STITCH_INJECT_FAILURE names ``stage`` (fault injection for tests)."""
    if os.environ.get("STITCH_INJECT_FAILURE", "").strip().lower() == stage:
        raise StitchError(f"failure injected by STITCH_INJECT_FAILURE={stage}")


def log_kernels() -> bool:
    """STITCH_LOG=kernels: log each stitched kernel's Kernel IR."""
    return os.environ.get("STITCH_LOG", "").strip().lower() == "kernels"


_HANDLER: logging.Handler | None = None


def log_level_setting() -> int | None:
    """STITCH_LOG as a logging level (None: unset)."""
    raw = os.environ.get("STITCH_LOG", "").strip()
    if not raw:
        return None
    level = logging.getLevelName("INFO" if raw.lower() == "kernels" else raw.upper())
    if not isinstance(level, int):
        raise ConfigError(f"STITCH_LOG={raw!r}: expected a logging level or 'kernels'")
    return level


_NAMES_CHECKED = False


def configure_logging() -> None:
    """Honour STITCH_LOG for library use: a stderr handler on the ``stitch`` logger at that
    level (once; nothing happens when the variable is unset, and an unreadable value is
    reported once and ignored). Misspelled STITCH_* variables are said once here too."""
    global _HANDLER, _NAMES_CHECKED
    if not _NAMES_CHECKED:
        _NAMES_CHECKED = True
        for line in unknown_settings():
            logging.getLogger("stitch.config").warning("%s", line)
    if _HANDLER is not None:
        return
    try:
        level = log_level_setting()
    except ConfigError as exc:
        report_setting_once(str(exc))
        return
    if level is None:
        return
    _HANDLER = logging.StreamHandler(sys.stderr)
    _HANDLER.setFormatter(logging.Formatter("stitch %(levelname)s: %(message)s"))
    logger = logging.getLogger("stitch")
    logger.addHandler(_HANDLER)
    logger.setLevel(level)
    logger.propagate = False
