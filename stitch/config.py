"""Settings read from the environment: one registry (``SETTINGS_TABLE``: name, kind,
default, accepted values, meaning) that every STITCH_* reader goes through (``setting_raw``,
``env_flag``, ``env_count`` and the readers below). The README's settings table is generated
from it: ``python -m stitch.config --markdown``. Modules below this layer
(``stitch.codegen``: STITCH_CACHE_DIR, STITCH_ISOLATE, STITCH_LLVM_PIPELINE, STITCH_PTXAS,
STITCH_LIBDEVICE) and ``stitch_autoload`` (STITCH_ENABLE, read before any of stitch is
imported) read their own variable; it is registered here all the same.
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
DEFAULT_TARGET = "h100"          # STITCH_TARGET unset (a GPU pass plans for its device)
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class ConfigError(StitchError, ValueError):
    """A STITCH_* variable, or an argument of stitch's, has a value stitch does not
    understand (a ValueError too, as jax.jit's own argument errors are)."""


# ------------------------------------------------------------------------------ registry
@dataclass(frozen=True)
class Setting:
    """One STITCH_* environment variable: what it holds and does (the README's settings
    table is generated from these: ``python -m stitch.config --markdown``)."""
    name: str
    kind: str                    # flag | count | choice | path | level | text
    default: str                 # as a user reads it ("" where unset means nothing)
    meaning: str                 # markdown, one table cell
    choices: tuple[str, ...] = ()   # a choice setting's accepted values
    audience: str = "user"       # "user": in the README's table; "tests": scripts, kit, tests

    def accepts(self) -> str:
        """What the setting accepts, in words (error messages name it)."""
        if self.choices:
            return "one of " + ", ".join(self.choices)
        return {"flag": "1/0, true/false, yes/no or on/off",
                "count": "a whole number or off", "path": "a path",
                "level": "a logging level (debug, info, warning...) or kernels",
                }.get(self.kind, "a value")


_FLAG = "flag"
SETTINGS_TABLE: tuple[Setting, ...] = (
    Setting("STITCH_ENABLE", _FLAG, "off",
            "on: patch jax.jit, tf.function(jit_compile=True) and Keras' TF trainer on import "
            "(read at interpreter start by `stitch_autoload`; a value neither on nor off is "
            "said and leaves stitch off)"),
    Setting("STITCH_ASYNC", _FLAG, "1",
            "`0`: compile before the first call instead of in the background"),
    Setting("STITCH_TARGET", "choice", "h100",
            "the GPU the plan is made for (a GPU pass plans for its own device unless this "
            "is set)", choices=TARGETS),
    Setting("STITCH_DEVICE", "choice", "jax.jit: gpu when jax has one; TF: where TF's "
            "variables live", "where stitched kernels run", choices=DEVICES),
    Setting("STITCH_VERIFY", "text", "unset: on a GPU the first stitched call, never on "
            "the host",
            "`1`: compare the first stitched call with XLA, fall back on a mismatch; "
            "`every:N`: every N-th stitched call; `0`: never (bf16/f16 outputs may differ by "
            "an ulp)"),
    Setting("STITCH_STATS", "path", "",
            "a path: at exit, JSON with one record per stitched function signature "
            "(`function`, `calls`, `stitched_calls`, `kernels_stitched`, `kernels_xla` = "
            "kernels XLA launched before stitching, `compile_s`, `state` = compiling / ready "
            "/ failed / stock-faster / dropped (its compile waited behind 8 newer ones and was "
            "cancelled; it is queued again on its next call) / cancelled (the program ended "
            "before its compile did: no failure, every call ran on stock XLA) / deciding "
            "(a multi-process job: built here, waiting for the job's decision) / "
            "below-size-gate (one record per function whose calls stayed under "
            "`STITCH_MIN_BYTES`, `calls` = those calls), `fallback_reason`, `where` (each "
            "stitched and each dropped kernel's user functions and file:line, from XLA's "
            "metadata), and the pass's modeled memory-intensive figures: `xla_mem_us`, "
            "`planned_mem_us`, `delivered_mem_us`, the same in bytes, `delivered_share`, "
            "`dropped_kernels`, `dropped_{payback,build,placement}_us`, `copies`, "
            "`copy_bytes`); once every signature of a function has fallen back, its calls go "
            "straight to jax and `calls` stops counting"),
    Setting("STITCH_GUARD", _FLAG, "1",
            "`0`: keep stitched kernels even where they time slower than XLA over the first "
            "calls after the switch"),
    Setting("STITCH_CACHE_DIR", "path", "`$XDG_CACHE_HOME/stitch`", "the compile cache"),
    Setting("STITCH_GRID_SYNC", "choice", "relaunch",
            "global-scope kernels (grid barriers) on the GPU: `off` (none: the block scopes' "
            "schedule, and the planner prices no kernel only the global scope builds), "
            "`relaunch` (one launch per phase on the stream, inside one custom call; the "
            "planner prices it as that chain of launches), `barrier` (one cooperative launch, "
            "registers capped so the grid stays resident), `auto` (per kernel, the form the "
            "latency-evaluator models faster); any value but `off` also lets a GEMM chain "
            "split its n across blocks (f32 partials summed by a second launch)",
            choices=GRID_SYNC_SETTINGS),
    Setting("STITCH_SEGMENT_ROWS", _FLAG, "1",
            "`1`: the XLA pass plans scatters and gathers over proved sorted fixed-length "
            "segments (ids `first + i // L`) as row reductions and broadcasts inside XLA's "
            "fusions, so they run without atomics; `0` keeps XLA's atomic scatters"),
    Setting("STITCH_PAYBACK_STEPS", "count", "100000",
            "steps within which a kernel's modeled saving per step must repay its estimated "
            "build for the GPU pass to build it; kernels equal but for names repay one build "
            "together (`off`: every kernel is built)"),
    Setting("STITCH_PASS_RESULTS", _FLAG, "1",
            "`1`: a compile of a module stitch's pass saw before, under the same settings and "
            "stitch code, takes that compile's stitched module and kernels from the compile "
            "cache instead of planning, lowering and rewriting it again (a restarted job, "
            "the other processes of a job on one host); `0`: every compile runs the whole "
            "pass"),
    Setting("STITCH_DUMP_MODULES", "path", "",
            "a folder: the XLA pass writes each module it plans there "
            "(`<function>.<n>.hlo`), for profiling and bug reports"),
    Setting("STITCH_CODE_BUDGET", "count", "1000",
            "Kernel IR statements above which the GPU pass builds a kernel at a narrower "
            "vector width, when the latency-evaluator prices that within 5% (LLVM and ptxas "
            "time grow with the code; `off`: every kernel as tuned)"),
    Setting("STITCH_BUILD_THREADS", "count", "one per core, at most 8",
            "threads (each with its own PTX child process) that build a module's GPU "
            "kernels"),
    Setting("STITCH_EARLY_PTX_CHILDREN", _FLAG, "early only where the cores outnumber the "
            "children by two",
            "1: start the PTX children as the compile begins (their start-up overlaps XLA's "
            "passes); 0: as stitch's pass begins (overlapping its planning). On 2 cores early "
            "start slowed XLA's own passes more than it saved"),
    Setting("STITCH_LLVM_PIPELINE", "choice", "O3",
            "the LLVM pipeline of the GPU kernels (`O3-no-memdep`: GVN without memory "
            "dependences). The others build faster and change some kernels' machine code; "
            "whether those run as fast has not been measured on a GPU yet "
            "(`bench.opt_levels`)",
            choices=("O3", "O3-no-unroll", "O2", "O3-noalias", "O3-no-memdep",
                     "O2-no-unroll-no-memdep")),
    Setting("STITCH_LOG", "level", "unset: warnings only",
            "`info`: one line when a function starts compiling, switches (call number, kernel "
            "counts), falls back (reason) or stays stock (under `STITCH_MIN_BYTES`), and per "
            "module the pass compiles its planned vs delivered memory-intensive µs / KB with "
            "every planned kernel that did not reach the module, its kind (payback / build / "
            "placement), reason and source lines; `debug`; `kernels`: info plus each stitched "
            "kernel's Kernel IR"),
    Setting("STITCH_INJECT_FAILURE", "choice", "",
            "testing aid: `compile` or `run` makes that stage fail (the fallback path)",
            choices=("compile", "run")),
    Setting("STITCH_ISOLATE", _FLAG, "1",
            "`0`: run LLVM in-process (debugging): the GPU path's PTX builds and the CPU "
            "path's object code are otherwise built in child processes, so an exit never "
            "waits for, or aborts in, a build"),
    Setting("STITCH_MIN_BYTES", "count", "1 MiB (1048576)",
            "under `STITCH_ENABLE=1`, jits whose arguments total fewer bytes stay on stock "
            "`jax.jit`, said once per function at `STITCH_LOG=info` (`off`/`0`: every jit)"),
    Setting("STITCH_COMMAND_BUFFERS", _FLAG, "1",
            "`0`: stitched GPU kernels are not offered to XLA's command buffers (CUDA "
            "graphs); on, every kernel without a grid barrier is"),
    Setting("STITCH_PTXAS", "path", "found on PATH, CUDA_HOME, /usr/local/cuda or the "
            "nvidia-cuda-nvcc wheels", "the ptxas to assemble GPU kernels with"),
    Setting("STITCH_LIBDEVICE", "path", "found beside ptxas or in the wheels",
            "the libdevice.10.bc to link math functions from"),
    # scripts, the GPU kit, bench and the tests (not in the README's table)
    *(Setting(name, "text", "", meaning, audience="tests") for name, meaning in (
        ("STITCH_BENCH_BACKWARD_PLACEMENT", "the real-size bench child's attention-backward "
         "placement (priced or always)"),
        ("STITCH_BLOCK_MODULES", "modules scripts/pythonpath hides (deviceless checks)"),
        ("STITCH_CUDA_VENV", "the venv with jax's CUDA plugin (deviceless check, bench)"),
        ("STITCH_DEVICE_PYTHON", "the GPU kit's Python"),
        ("STITCH_DEVICE_VENV", "the GPU kit's venv"),
        ("STITCH_FUZZ_SEEDS", "seeds the codegen fuzz test runs"),
        ("STITCH_FUZZ_START", "the codegen fuzz test's first seed"),
        ("STITCH_SCENARIO_SECONDS", "a scenario's time limit"),
        ("STITCH_TEST_MARKER", "the GPU kit's pytest marker"),
        ("STITCH_TEST_RESULT", "where the GPU kit writes its result"),
        ("STITCH_THIRDPARTY", "third-party harness selection"),
        ("STITCH_THIRDPARTY_PLAIN_TIMEOUT", "a third-party plain run's time limit (s)"),
        ("STITCH_THIRDPARTY_TIMEOUT", "a third-party stitched run's time limit (s)"),
        ("STITCH_WHEELS", "local wheels the deviceless check installs from"),
        ("STITCH_XLA_CORPUS", "the planner-scale bench's HLO corpus"))),
)
SETTINGS: dict[str, Setting] = {s.name: s for s in SETTINGS_TABLE}
# Every STITCH_* variable stitch, its scripts and its tests read: any other is a misspelling
# (said once, with the nearest names).
KNOWN_SETTINGS = frozenset(SETTINGS)


def setting_raw(name: str) -> str | None:
    """The environment's value of registered setting ``name`` (None: unset); a name not in
    the registry is a programming error (KeyError), so every reader goes through it."""
    if name not in SETTINGS:
        raise KeyError(f"{name} is not in stitch's settings registry (config.SETTINGS_TABLE)")
    return os.environ.get(name)


def bad_value(name: str, raw: str, accepts: str | None = None) -> ConfigError:
    """The ConfigError for a value ``name`` cannot use, naming what it accepts."""
    return ConfigError(f"{name}={raw!r}: expected {accepts or SETTINGS[name].accepts()}")


def settings_markdown() -> str:
    """The README's settings table, from the registry (user settings, in registry order)."""
    rows = ["| variable | accepts | default | meaning |", "|---|---|---|---|"]
    for s in SETTINGS_TABLE:
        if s.audience != "user":
            continue
        accepts = (", ".join(f"`{c}`" for c in s.choices) if s.choices
                   else {"flag": "on/off", "count": "a number or `off`", "path": "a path",
                         "level": "a logging level or `kernels`"}.get(s.kind, "see meaning"))
        rows.append(f"| `{s.name}` | {accepts} | {s.default or '—'} | {s.meaning} |")
    return "\n".join(rows)


def env_flag(name: str, default: bool | None = None) -> bool:
    """Flag ``name``: unset → ``default`` (None: the registry's), else on/off or a
    ConfigError naming what it accepts."""
    raw = setting_raw(name)
    if raw is None:
        return SETTINGS[name].default in ("1", "on") if default is None else default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise bad_value(name, raw)


def env_count(name: str, default: int, what: str) -> int | None:
    """A positive count from ``$name`` (``_`` separators allowed): unset → ``default``,
    ``off`` (or 0/false/no) → None, anything else a ConfigError naming ``what`` it counts."""
    raw = (setting_raw(name) or "").strip().lower().replace("_", "")
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
    return choice_setting("STITCH_TARGET") or DEFAULT_TARGET


def choice_setting(name: str) -> str | None:
    """Choice setting ``name`` lowered (None: unset), or a ConfigError naming its choices."""
    raw = (setting_raw(name) or "").strip()
    if not raw:
        return None
    by_lower = {c.lower(): c for c in SETTINGS[name].choices}
    if raw.lower() not in by_lower:
        raise bad_value(name, raw)
    return by_lower[raw.lower()]


def device_setting() -> str | None:
    """STITCH_DEVICE: where stitched kernels run (None: gpu when jax has one, else cpu)."""
    return choice_setting("STITCH_DEVICE")


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
    return choice_setting("STITCH_GRID_SYNC") or SETTINGS["STITCH_GRID_SYNC"].default


def command_buffers_setting() -> bool:
    """STITCH_COMMAND_BUFFERS: whether stitched GPU kernels may join XLA's command buffers."""
    return env_flag("STITCH_COMMAND_BUFFERS")


def segment_rows_setting() -> bool:
    """STITCH_SEGMENT_ROWS: whether the XLA pass plans proved sorted segments as rows."""
    return env_flag("STITCH_SEGMENT_ROWS")


def verify_setting() -> bool | int:
    """STITCH_VERIFY: a flag, or ``every:N`` for sampled verification."""
    raw = (setting_raw("STITCH_VERIFY") or "").strip().lower()
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
    if (setting_raw("STITCH_INJECT_FAILURE") or "").strip().lower() == stage:
        raise StitchError(f"failure injected by STITCH_INJECT_FAILURE={stage}")


def log_kernels() -> bool:
    """STITCH_LOG=kernels: log each stitched kernel's Kernel IR."""
    return (setting_raw("STITCH_LOG") or "").strip().lower() == "kernels"


_HANDLER: logging.Handler | None = None


def log_level_setting() -> int | None:
    """STITCH_LOG as a logging level (None: unset)."""
    raw = (setting_raw("STITCH_LOG") or "").strip()
    if not raw:
        return None
    level = logging.getLevelName("INFO" if raw.lower() == "kernels" else raw.upper())
    if not isinstance(level, int):
        raise bad_value("STITCH_LOG", raw)
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


def main(argv: list[str] | None = None) -> int:
    """``python -m stitch.config --markdown``: the README's settings table."""
    import argparse
    parser = argparse.ArgumentParser(prog="python -m stitch.config",
                                     description="stitch's STITCH_* settings")
    parser.add_argument("--markdown", action="store_true",
                        help="the README's settings table (the default output)")
    parser.parse_args(argv)
    sys.stdout.write(settings_markdown() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
