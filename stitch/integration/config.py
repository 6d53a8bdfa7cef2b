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
DEFAULT_TARGET = "h100"          # STITCH_TARGET unset (a GPU pass plans for its device)
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class ConfigError(StitchError):
    """A STITCH_* variable has a value stitch does not understand."""


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


def configure_logging() -> None:
    """Honour STITCH_LOG for library use: a stderr handler on the ``stitch`` logger at that
    level (once; nothing happens when the variable is unset, and an unreadable value is
    reported once and ignored)."""
    global _HANDLER
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
