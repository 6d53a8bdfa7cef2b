"""Runs the kit's steps (package docstring) under one time budget and writes the results.

    python -m bench.gpu_kit [--rehearse] [--out DIR] [--budget SECONDS]

Each step is a child process under coreutils ``timeout`` (SIGTERM, then SIGKILL 5 s later)
with the smaller of its own budget and what is left of the whole; a step whose turn comes
with under ``MIN_STEP_S`` left is recorded as skipped. Every step's outcome lands in
``gpu_check.json``: status (passed / failed / timeout / skipped), seconds, the last lines of
its output, and the JSON the step wrote itself (``<step>.json``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHIM = REPO / "scripts" / "pythonpath"        # sitecustomize: STITCH_ENABLE without install
BUDGET_S = 470            # the whole check on a GPU (8 minutes, less the shell's start)
REHEARSAL_BUDGET_S = 170  # on a CPU machine
MIN_STEP_S = 10
# What the GPU machine lacks; the rehearsal blocks them so an import of one fails here too.
ABSENT_ON_DEVICE = ("pulp", "highspy", "cupy", "keras", "keras_hub", "tensorflow",
                    "matplotlib")
TAIL_LINES = 40


@dataclass
class Step:
    name: str
    command: list[str]
    budget_s: int                        # on a GPU
    rehearsal_s: int                     # on a CPU machine
    needs_gpu: bool = False              # else: "skipped: no GPU" in a rehearsal
    needs: tuple[str, ...] = ()          # executables that must be on PATH
    env: dict[str, str] = field(default_factory=dict)
    critical: bool = False               # a failure makes the whole check fail loudly


@dataclass
class Outcome:
    name: str
    status: str                          # passed | failed | timeout | skipped
    seconds: float
    reason: str = ""
    tail: str = ""
    result: dict | None = None


def steps(out: Path, python: str) -> list[Step]:
    kernels = out / "kernels"
    sanitize = [python, "-m", "bench.opt_levels", "time", "--dir", str(kernels),
                "--check-only", "--json"]
    return [
        Step("env", [python, "-m", "bench.gpu_kit.env", "--out", str(out)], 30, 30),
        Step("smoke", [python, "-m", "bench.gpu_kit.smoke", "--out", str(out)], 90, 60,
             env={"STITCH_LOG": "debug"}, critical=True),
        Step("tests", [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                       "tests/gpu"], 150, 60),
        Step("timings", [python, "-m", "bench.gpu_kit.timings", "--out", str(out)], 150, 60),
        Step("kernels", [python, "-m", "bench.opt_levels", "time", "--dir", str(kernels),
                         "--json", str(out / "kernels.json")], 30, 0, needs_gpu=True),
        Step("memcheck", ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "3",
                          *sanitize, str(out / "memcheck.json")], 25, 0, needs_gpu=True,
             needs=("compute-sanitizer",)),
        Step("racecheck", ["compute-sanitizer", "--tool", "racecheck", "--error-exitcode",
                           "3", *sanitize, str(out / "racecheck.json")], 25, 0,
             needs_gpu=True, needs=("compute-sanitizer",)),
        Step("memcheck_jax", ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode",
                              "3", python, "-m", "bench.gpu_kit.smoke", "--out", str(out),
                              "--quick"], 45, 0, needs_gpu=True,
             needs=("compute-sanitizer",),
             env={"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}),
        Step("opt_levels", [python, "-m", "bench.opt_levels", "time", "--dir",
                            str(REPO / ".gpu_bench"), "--json",
                            str(out / "opt_levels.json")], 30, 0, needs_gpu=True),
    ]


def ingest_step(out: Path, python: str) -> Step:
    """The local step run on this folder at once (into copies under ``out``), so a broken
    ingest shows in the check itself, not after the GPU is gone."""
    return Step("ingest", [python, "-m", "bench.gpu_kit.ingest", str(out), "--docs",
                           str(out / "benchmarks_section.md"), "--calibration-dir",
                           str(out / "calibration")], 20, 20)


def child_env(rehearse: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), str(SHIM)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("PYTHONUNBUFFERED", "1")
    if rehearse:
        env["STITCH_BLOCK_MODULES"] = ",".join(ABSENT_ON_DEVICE)
        env["JAX_PLATFORMS"] = "cpu"
    return env


def run_step(step: Step, out: Path, env: dict[str, str], limit_s: float, gpu: bool,
             rehearse: bool) -> Outcome:
    if step.needs_gpu and not gpu:
        return Outcome(step.name, "skipped", 0.0, "skipped: no GPU")
    missing = [tool for tool in step.needs if shutil.which(tool) is None]
    if missing:
        return Outcome(step.name, "skipped", 0.0, f"skipped: {', '.join(missing)} not found")
    if step.name == "opt_levels" and not (REPO / ".gpu_bench" / "manifest.json").exists():
        return Outcome(step.name, "skipped", 0.0, "skipped: no .gpu_bench/manifest.json "
                       "(python -m bench.opt_levels prepare, here, before the check)")
    if step.name in ("kernels", "memcheck", "racecheck") and \
            not (out / "kernels" / "manifest.json").exists():
        return Outcome(step.name, "skipped", 0.0, "skipped: the timings step saved no kernels")
    if limit_s < MIN_STEP_S:
        return Outcome(step.name, "skipped", 0.0, f"skipped: {limit_s:.0f} s left of the budget")
    log = out / f"{step.name}.log"
    command = ["timeout", "-k", "5", str(int(limit_s)), *step.command]
    if rehearse and "--out" in step.command:
        command.append("--rehearse")
    start = time.monotonic()
    with log.open("w") as sink:
        proc = subprocess.Popen(command, cwd=REPO, env={**env, **step.env}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            sink.write(line)
            print(f"  [{step.name}] {line.rstrip()[:200]}", flush=True)
        code = proc.wait()
    seconds = time.monotonic() - start
    lines = log.read_text(errors="replace").splitlines()
    tail = "\n".join(lines[-TAIL_LINES:])
    result_file = out / f"{step.name}.json"
    result = None
    if result_file.exists():
        try:
            result = json.loads(result_file.read_text())
        except json.JSONDecodeError as exc:
            result = {"unreadable": str(exc)}
    if code in (124, 137):
        return Outcome(step.name, "timeout", seconds, f"timed out after {limit_s:.0f} s",
                       tail, result)
    if code != 0:
        return Outcome(step.name, "failed", seconds, f"exit status {code}", tail, result)
    return Outcome(step.name, "passed", seconds, "", tail, result)


def markdown(record: dict) -> str:
    lines = [f"# stitch GPU check ({'rehearsal, no GPU' if record['rehearse'] else 'GPU'})",
             "", f"{record['date']}; {record['device']}; {record['total_s']:.0f} s of a "
             f"{record['budget_s']} s budget", "",
             "| step | status | seconds | note |", "|---|---|---:|---|"]
    for o in record["steps"]:
        lines.append(f"| {o['name']} | {o['status']} | {o['seconds']:.1f} | "
                     f"{o['reason'].replace('|', '/')} |")
    failed = [o for o in record["steps"] if o["status"] in ("failed", "timeout")]
    for o in failed:
        lines += ["", f"## {o['name']}: {o['status']} ({o['reason']})", "", "```",
                  o["tail"][-3000:], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu_check.sh")
    parser.add_argument("--rehearse", action="store_true",
                        help="on a CPU machine: GPU steps skipped, the rest on the host")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu_check_out"))
    parser.add_argument("--budget", type=float, help="seconds for all steps")
    parser.add_argument("--only", help="comma-separated step names")
    args = parser.parse_args(argv)
    from bench.cuda_driver import available
    gpu = not args.rehearse and available()
    budget = args.budget or (REHEARSAL_BUDGET_S if args.rehearse else BUDGET_S)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = child_env(args.rehearse)
    python = sys.executable
    device = "GPU" if gpu else "no GPU"
    print(f"gpu_check: {'rehearsal' if args.rehearse else 'check'} on {device}, "
          f"budget {budget:.0f} s, results in {out}", flush=True)
    start = time.monotonic()
    outcomes: list[Outcome] = []
    wanted = set(args.only.split(",")) if args.only else None
    for step in steps(out, python):
        if wanted is not None and step.name not in wanted:
            continue
        left = budget - (time.monotonic() - start)
        own = step.rehearsal_s if args.rehearse else step.budget_s
        limit = min(own, left) if own else left
        if not (step.needs_gpu and not gpu):
            print(f"gpu_check: step {step.name} ({limit:.0f} s at most)", flush=True)
        outcome = run_step(step, out, env, limit, gpu, args.rehearse)
        outcomes.append(outcome)
        print(f"gpu_check: step {step.name}: {outcome.status} in {outcome.seconds:.1f} s"
              f"{' (' + outcome.reason + ')' if outcome.reason else ''}", flush=True)
        if step.critical and outcome.status != "passed":
            print("\n" + "!" * 78 + f"\ngpu_check: {step.name} FAILED: stitch's pass did not "
                  "run as it must; everything after this measures stock XLA only\n"
                  + "!" * 78 + "\n", flush=True)
    env_result = next((o.result for o in outcomes if o.name == "env" and o.result), {})
    record = {"rehearse": args.rehearse, "gpu": gpu,
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "device": env_result.get("device", {}).get("name", device) if env_result else device,
              "budget_s": int(budget), "total_s": round(time.monotonic() - start, 1),
              "steps": [asdict(o) for o in outcomes]}
    (out / "gpu_check.json").write_text(json.dumps(record, indent=1, default=str))
    (out / "gpu_check.md").write_text(markdown(record))
    if wanted is None or "ingest" in wanted:
        outcome = run_step(ingest_step(out, python), out, env, MIN_STEP_S * 2, gpu,
                           args.rehearse)
        outcomes.append(outcome)
        print(f"gpu_check: step ingest: {outcome.status}"
              f"{' (' + outcome.reason + ')' if outcome.reason else ''}", flush=True)
        record["steps"].append(asdict(outcome))
        record["total_s"] = round(time.monotonic() - start, 1)
        (out / "gpu_check.json").write_text(json.dumps(record, indent=1, default=str))
        (out / "gpu_check.md").write_text(markdown(record))
    bad = [o.name for o in outcomes if o.status in ("failed", "timeout")]
    print(f"gpu_check: done in {record['total_s']:.0f} s; "
          + (f"FAILED: {', '.join(bad)}" if bad else "every step passed or was skipped")
          + f"; summary in {out / 'gpu_check.md'}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
