"""Runs the third-party training scripts (examples/thirdparty/) as subprocesses,
plain and under stitch, and explains what went wrong when a stitched run does not match.

Each script is an ordinary training script that never imports stitch; it prints one line
``STITCH_TEST_RESULT {"losses": [...], "donated_deleted": true|false|null, ...}`` at the
end. The stitched run is the same command with ``STITCH_ENABLE=1 STITCH_ASYNC=0
STITCH_GUARD=0 STITCH_STATS=<dir>/stats.json`` (the autoload .pth patches jax), and its
STITCH_STATS file says which functions ran stitched kernels.

Used by tests/thirdparty/test_thirdparty.py; also a command that prints a results table:
    python tests/thirdparty/harness.py [--stitched] [NAME ...]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPTS_DIR = REPO_ROOT / "examples" / "thirdparty"
RESULT_MARK = "STITCH_TEST_RESULT "
LOSS_RTOL = 1e-4
# bf16 steps: stitched kernels round to bf16 where XLA does, so losses agreed to 1.1e-7 on
# keras_hub Llama (2026-11-24); the bound is one bf16 unit roundoff (2^-9), for a kernel
# that rounds an intermediate XLA keeps in f32 (or the reverse).
BF16_LOSS_RTOL = 2e-3
# A stitched run compiles synchronously (STITCH_ASYNC=0) on a loaded 2-core machine.
PLAIN_TIMEOUT_S = float(os.environ.get("STITCH_THIRDPARTY_PLAIN_TIMEOUT", "300"))
STITCHED_TIMEOUT_S = float(os.environ.get("STITCH_THIRDPARTY_TIMEOUT", "900"))
TAIL_CHARS = 2500

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ThirdPartyScript:
    """One script and how to run it. ``requires``: modules that must be importable (else the
    test skips); ``slow``: kept out of the default test run (marker ``thirdparty``)."""
    name: str
    file: str
    args: tuple[str, ...] = ()
    requires: tuple[str, ...] = ("jax",)
    env: dict[str, str] = field(default_factory=dict)
    slow: bool = False
    checks_donation: bool = False
    # The stitched function(s) that must have run stitched kernels, matched in `function`.
    train_step: str = "train_step"
    # Relative loss agreement, plain vs stitched (LOSS_RTOL; BF16_LOSS_RTOL for bf16 steps).
    loss_rtol: float = LOSS_RTOL

    def missing_modules(self) -> list[str]:
        return [m for m in self.requires if importlib.util.find_spec(m) is None]


_KERAS_JAX = {"KERAS_BACKEND": "jax"}
_KERAS_TF = {"KERAS_BACKEND": "tensorflow"}
_KERAS_HUB = ("jax", "keras", "keras_hub")

SCRIPTS: tuple[ThirdPartyScript, ...] = (
    ThirdPartyScript("keras_hub_gpt2", "keras_hub_train.py", ("--model", "gpt2"),
                     _KERAS_HUB, _KERAS_JAX, slow=True),
    ThirdPartyScript("keras_hub_llama", "keras_hub_train.py", ("--model", "llama"),
                     _KERAS_HUB, _KERAS_JAX, slow=True),
    ThirdPartyScript("keras_hub_bert", "keras_hub_train.py", ("--model", "bert"),
                     _KERAS_HUB, _KERAS_JAX, slow=True),
    ThirdPartyScript("keras_hub_vit", "keras_hub_train.py", ("--model", "vit"),
                     _KERAS_HUB, _KERAS_JAX, slow=True),
    # Keras' mixed precision as H100 training runs it: bf16 compute, f32 variables.
    ThirdPartyScript("keras_hub_llama_bf16", "keras_hub_train.py",
                     ("--model", "llama", "--dtype-policy", "mixed_bfloat16"),
                     _KERAS_HUB, _KERAS_JAX, slow=True, loss_rtol=BF16_LOSS_RTOL),
    ThirdPartyScript("flax_nnx_lm", "flax_nnx_lm.py", (), ("jax", "flax", "optax"), slow=True),
    ThirdPartyScript("equinox_attention", "equinox_attention.py", (),
                     ("jax", "equinox", "optax"), slow=True),
    ThirdPartyScript("data_parallel_4dev", "data_parallel.py"),
    ThirdPartyScript("remat_mlp", "remat_mlp.py"),
    ThirdPartyScript("random_dropout", "random_dropout.py"),
    ThirdPartyScript("donate_params", "donate_params.py", checks_donation=True),
    # "--jit-compile": XLA as on a GPU machine (Keras turns it off on CPU-only ones), so the
    # plain run draws its dropout masks the way the stitched (XLA) program does.
    ThirdPartyScript("keras_hub_gpt2_tf", "keras_hub_train.py",
                     ("--model", "gpt2", "--jit-compile"),
                     ("keras", "keras_hub", "tensorflow"), _KERAS_TF, slow=True),
    ThirdPartyScript("keras_hub_llama_tf", "keras_hub_train.py",
                     ("--model", "llama", "--jit-compile"),
                     ("keras", "keras_hub", "tensorflow"), _KERAS_TF, slow=True),
)
BY_NAME = {s.name: s for s in SCRIPTS}


@dataclass
class ScriptRun:
    """What one subprocess run left behind."""
    script: ThirdPartyScript
    stitched: bool
    returncode: int | None  # None: killed at the timeout
    seconds: float
    stdout: str = field(repr=False)
    stderr: str = field(repr=False)
    result: dict | None
    stats: list | None = field(repr=False)
    stats_error: str | None

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.result is not None

    @property
    def losses(self) -> list[float]:
        return list(self.result["losses"]) if self.result else []

    def stitched_train_entries(self) -> list[dict]:
        """STITCH_STATS entries for the script's train step that ran stitched kernels."""
        pattern = re.compile(self.script.train_step)
        return [e for e in self.stats or []
                if isinstance(e, dict) and pattern.search(str(e.get("function", "")))
                and (e.get("kernels_stitched") or 0) > 0 and (e.get("stitched_calls") or 0) > 0]

    def summary(self) -> str:
        """One line: the outcome, the first error line and the fallbacks, for tables."""
        mode = "stitched" if self.stitched else "plain"
        if self.returncode is None:
            return f"{mode}: timed out after {self.seconds:.0f} s"
        if self.returncode != 0:
            return f"{mode}: exit {self.returncode}: {_last_error_line(self.stderr)}"
        if self.result is None:
            return f"{mode}: no {RESULT_MARK.strip()} line"
        return f"{mode}: ok in {self.seconds:.1f} s"

    def stitch_events(self) -> str:
        """What the stitch log says happened: switches to stitched kernels and the first
        fallback or failure reason (today's stand-in for STITCH_STATS when it is absent)."""
        switches = len(re.findall(r"switched to stitched kernels", self.stderr))
        problems = [ln for ln in _stitch_log_lines(self.stderr) if "switched" not in ln]
        text = f"{switches} switch(es) to stitched kernels"
        return text + (f"; {len(problems)} fallback/failure line(s), first: {problems[0]}"
                       if problems else "; no fallback logged")

    def diagnosis(self) -> str:
        """Everything a reader needs to see why a run failed: exit, time, result line,
        stderr tail, STITCH_STATS content."""
        lines = [f"{self.script.name} ({'stitched' if self.stitched else 'plain'}): "
                 f"{self.summary()}",
                 f"command: {' '.join(command(self.script))}",
                 f"result: {json.dumps(self.result) if self.result else None}"]
        if self.stitched:
            lines.append("STITCH_STATS: " + (self.stats_error or json.dumps(self.stats,
                                                                              indent=1)))
            lines.append(f"stitch log: {self.stitch_events()}")
            lines.append(f"stitch log lines: {_stitch_log_lines(self.stderr)}")
        lines.append(f"stderr tail:\n{self.stderr[-TAIL_CHARS:]}")
        if self.result is None:
            lines.append(f"stdout tail:\n{self.stdout[-TAIL_CHARS:]}")
        return "\n".join(lines)


def command(script: ThirdPartyScript) -> list[str]:
    return [sys.executable, str(SCRIPTS_DIR / script.file), *script.args]


def environment(script: ThirdPartyScript, stitched: bool, stats_path: Path | None) -> dict:
    """The caller's environment without its STITCH_* settings, with this checkout first on
    the path (so the autoload .pth and stitch come from here, not another install)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STITCH_")}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PYTHONHASHSEED"] = "0"
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env.update(script.env)
    if stitched:
        # GUARD=0 keeps stitched kernels even where they time slower on this CPU, so the
        # losses compared are theirs; ASYNC=0 stitches from the first call.
        # MIN_BYTES=off: the scripts' small models would stay stock under the size gate.
        env.update({"STITCH_ENABLE": "1", "STITCH_ASYNC": "0", "STITCH_GUARD": "0",
                    "STITCH_LOG": "info", "STITCH_STATS": str(stats_path),
                    "STITCH_MIN_BYTES": "off"})
    return env


def run_script(script: ThirdPartyScript, stitched: bool, workdir: Path,
               timeout_s: float | None = None) -> ScriptRun:
    timeout_s = timeout_s or (STITCHED_TIMEOUT_S if stitched else PLAIN_TIMEOUT_S)
    stats_path = workdir / f"{script.name}.stats.json"
    stats_path.unlink(missing_ok=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(command(script), env=environment(script, stitched, stats_path),
                              cwd=workdir, capture_output=True, text=True, timeout=timeout_s)
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as expired:
        returncode = None
        stdout, stderr = _text(expired.stdout), _text(expired.stderr)
    seconds = time.perf_counter() - start
    stats, stats_error = _read_stats(stats_path) if stitched else (None, None)
    run = ScriptRun(script, stitched, returncode, seconds, stdout, stderr,
                    parse_result(stdout), stats, stats_error)
    log.info("%s %s", script.name, run.summary())
    return run


def parse_result(stdout: str) -> dict | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    return None


def loss_mismatch(plain: list[float], stitched: list[float],
                  rtol: float = LOSS_RTOL) -> str | None:
    """None when every step's loss agrees within ``rtol`` relative; else what differs."""
    if len(plain) != len(stitched):
        return f"{len(stitched)} stitched losses vs {len(plain)} plain"
    for step, (a, b) in enumerate(zip(plain, stitched)):
        if abs(a - b) > rtol * max(abs(a), 1e-30):
            return (f"step {step}: stitched loss {b!r} vs plain {a!r} "
                    f"(relative {abs(a - b) / max(abs(a), 1e-30):.3g} > {rtol})")
    return None


def _read_stats(path: Path) -> tuple[list | None, str | None]:
    if not path.exists():
        return None, f"{path.name} was not written"
    try:
        stats = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        return None, f"{path.name} is not JSON: {error}"
    if not isinstance(stats, list):
        return None, f"{path.name} holds a {type(stats).__name__}, expected a list"
    return stats, None


def _text(raw: bytes | str | None) -> str:
    if isinstance(raw, bytes):
        return raw.decode(errors="replace")
    return raw or ""


def _last_error_line(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception)\b", ln)]
    return (errors or lines or ["(no stderr)"])[-1][:300]


def _stitch_log_lines(stderr: str) -> list[str]:
    """The stitch logger's notable lines: switches, fallbacks and failures."""
    keys = ("falls back", "fallback", "failed", "switched", "unsupported", "Error")
    return [ln.strip()[:300] for ln in stderr.splitlines()
            if "stitch" in ln and any(k in ln for k in keys)][-12:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"default: all of {sorted(BY_NAME)}")
    parser.add_argument("--stitched", action="store_true", help="also run under stitch")
    parser.add_argument("--verbose", action="store_true", help="print failure diagnoses")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.names or [s.name for s in SCRIPTS]:
            script = BY_NAME[name]
            if script.missing_modules():
                rows.append((name, f"skipped: missing {script.missing_modules()}", ""))
                continue
            plain = run_script(script, stitched=False, workdir=Path(tmp))
            cell = ""
            if args.stitched and plain.ok:
                stitched = run_script(script, stitched=True, workdir=Path(tmp))
                cell = _stitched_cell(plain, stitched)
                if args.verbose and not stitched.ok:
                    sys.stderr.write(stitched.diagnosis() + "\n")
            rows.append((name, plain.summary(), cell))
    for row in rows:
        sys.stdout.write(" | ".join(row) + "\n")


def _stitched_cell(plain: ScriptRun, stitched: ScriptRun) -> str:
    if not stitched.ok:
        return f"{stitched.summary()}; {stitched.stitch_events()}"
    notes = [stitched.summary(), stitched.stitch_events()]
    mismatch = loss_mismatch(plain.losses, stitched.losses, stitched.script.loss_rtol)
    notes.append(mismatch or "losses match")
    if stitched.script.checks_donation:
        notes.append(f"donated_deleted={stitched.result.get('donated_deleted')}")
    notes.append(f"stitched train-step entries: {len(stitched.stitched_train_entries())}"
                 + (f" ({stitched.stats_error})" if stitched.stats_error else ""))
    return "; ".join(notes)


if __name__ == "__main__":
    main()
