"""Settings read from the environment (documented in the README).

STITCH_ENABLE   1/true: the autoload patches jax.jit / TF / Keras on import (stitch_autoload.py, integration/autoload.py)
STITCH_ASYNC    0/false: compile before the first call instead of in the background (default 1)
STITCH_TARGET   the GPU the plan is made for: v100 | a100 | h100 | h200 (default h100)
STITCH_DEVICE   where stitched kernels run: cpu | gpu (default: gpu when jax has one, else cpu)
STITCH_VERIFY   1/true: compare the first stitched call with stock XLA and fall back on mismatch;
                every:N compares every N-th stitched call (the first included)
STITCH_STATS    a path: at exit, JSON with one record per stitched function signature
STITCH_GUARD    0/false: keep the stitched kernels even where they time slower than stock
                XLA over the first calls after the switch (default 1: keep the faster)
STITCH_CACHE_DIR  the on-disk compile cache (codegen/cache.py)
STITCH_GRID_SYNC  how the GPU runs global-scope kernels (grid barriers): ``off`` (default, until
                they have run on a GPU: the pass builds the block scopes' schedule instead),
                ``relaunch`` (one launch per phase on the stream), ``barrier`` (one persistent
                launch, cooperative, a software grid barrier between phases), ``auto`` (per
                kernel, the form the latency-evaluator models faster)
                It also lets the GPU pass split a GEMM chain's n across blocks (a second
                launch sums the f32 partials; ExplorerOptions.chain_grid_sync)
STITCH_CODE_BUDGET  Kernel IR statements above which the GPU pass builds a kernel at a
                narrower vector width when that models within 5% (default 1000; ``off``:
                every kernel as tuned; integration/code_budget.py)
STITCH_PAYBACK_STEPS  steps within which a kernel's modeled saving per step must repay its
                estimated build for the GPU pass to build it (default 100000; ``off``: every
                kernel is built; integration/payback.py)
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
from dataclasses import dataclass

from stitch.errors import StitchError

TARGETS = ("v100", "a100", "h100", "h200")
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
    enable: bool
    async_compile: bool
    target: str
    device: str | None
    verify: bool | int          # True: the first stitched call; N: every N-th
    guard: bool

    @classmethod
    def from_env(cls) -> "Settings":
        target = os.environ.get("STITCH_TARGET", "h100").strip().lower()
        if target not in TARGETS:
            raise ConfigError(f"STITCH_TARGET={target!r}: expected one of {', '.join(TARGETS)}")
        device = os.environ.get("STITCH_DEVICE", "").strip().lower() or None
        if device not in (None, "cpu", "gpu"):
            raise ConfigError(f"STITCH_DEVICE={device!r}: expected cpu or gpu")
        return cls(enable=env_flag("STITCH_ENABLE", False),
                   async_compile=env_flag("STITCH_ASYNC", True), target=target, device=device,
                   verify=verify_setting(), guard=env_flag("STITCH_GUARD", True))


GRID_SYNC_SETTINGS = ("off", "relaunch", "barrier", "auto")


def grid_sync_on_gpu() -> str:
    """STITCH_GRID_SYNC: how the GPU pass builds global-scope (grid barrier) kernels — "off"
    (not at all: the block scopes' schedule), a codegen.kir.GRID_SYNC_MODES mode, or "auto"
    (per kernel, stitch.schedule.global_scope.launch_form)."""
    raw = os.environ.get("STITCH_GRID_SYNC", "relaunch").strip().lower() or "relaunch"
    if raw not in GRID_SYNC_SETTINGS:
        raise ConfigError(f"STITCH_GRID_SYNC={raw!r}: expected one of "
                          f"{', '.join(GRID_SYNC_SETTINGS)}")
    return raw


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


def configure_logging() -> None:
    """Honour STITCH_LOG for library use: a stderr handler on the ``stitch`` logger at that
    level (once; nothing happens when the variable is unset)."""
    global _HANDLER
    raw = os.environ.get("STITCH_LOG", "").strip()
    if not raw or _HANDLER is not None:
        return
    level_name = "INFO" if raw.lower() == "kernels" else raw.upper()
    level = logging.getLevelName(level_name)
    if not isinstance(level, int):
        raise ConfigError(f"STITCH_LOG={raw!r}: expected a logging level or 'kernels'")
    _HANDLER = logging.StreamHandler(sys.stderr)
    _HANDLER.setFormatter(logging.Formatter("stitch %(levelname)s: %(message)s"))
    logger = logging.getLogger("stitch")
    logger.addHandler(_HANDLER)
    logger.setLevel(level)
    logger.propagate = False
