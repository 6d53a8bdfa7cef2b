"""Runs the kit's steps (package docstring) under one time budget and writes the results.

    python -m bench.gpu_kit [--rehearse] [--quick] [--out DIR] [--work DIR] [--budget S]

Each step is a child process under coreutils ``timeout`` (SIGTERM, then SIGKILL 5 s later)
with the smaller of its own budget and what is left of the whole; a step whose turn comes
with under ``MIN_STEP_S`` left is recorded as skipped. Every step's outcome lands in
``gpu_check.json``: status (passed / failed / timeout / skipped / unavailable), seconds, the
last lines of its output, and the JSON the step wrote itself (``<step>.json``).

What comes back from a GPU machine is a few files at the top of ``$OUT`` (``RESULT_FILES``):
the steps write into a work folder (``--work``), and after every step the runner rewrites
``$OUT/gpu_check.json``, ``$OUT/gpu_check.md`` and ``$OUT/gpu_check.tar.gz`` (the whole work
folder, at most ``ARCHIVE_LIMIT`` bytes), so a check cut short still returns what it ran.
``--quick`` proves the essentials in ``QUICK_BUDGET_S``: registration and one stitched step
verified against XLA (``smoke``), one model's kernels saved and timed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHIM = REPO / "scripts" / "pythonpath"        # sitecustomize: STITCH_ENABLE without install
BUDGET_S = 540            # the whole check on a GPU: 9 minutes of a 15-minute loan (the
                          # sum of the steps' own budgets; budget_sum prints it)
QUICK_BUDGET_S = 180      # --quick: the essentials, leaving room for a second start
REHEARSAL_BUDGET_S = 170  # on a CPU machine
MIN_STEP_S = 10
RESULT_FILES = ("gpu_check.json", "gpu_check.md", "gpu_check.tar.gz")
ARCHIVE = "gpu_check.tar.gz"
ARCHIVE_LIMIT = 15 * 2**20          # what comes back: 16 MiB a file
QUICK_MODELS = "log_softmax_xent_train:full"
QUICK_STEPS = ("env", "smoke", "timings", "kernels")
# What the opt_levels step prepares on the device when no .gpu_bench was carried there.
OPT_LEVELS_MODELS = "bert_layer_train:tiny"
# compute-sanitizer's words on a machine where it cannot attach to the device (seen on one
# of the GPU machine's runtimes: "Device not supported", then error 999).
SANITIZER_UNAVAILABLE = ("Device not supported", "error 999", "CUDA_ERROR_UNKNOWN")
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
    status: str                          # passed | failed | timeout | skipped | unavailable
    seconds: float
    reason: str = ""
    tail: str = ""
    result: dict | None = None


def steps(out: Path, python: str, quick: bool = False) -> list[Step]:
    """The check's steps in the order they run: what tells most first (the pass runs, the
    stitched steps and kernels timed), then the device tests and the sanitizers. ``out`` is
    the work folder."""
    kernels = out / "kernels"
    sanitize = [python, "-m", "bench.opt_levels", "time", "--dir", str(kernels),
                "--check-only", "--json"]
    timings = [python, "-m", "bench.gpu_kit.timings", "--out", str(out)]
    every = [
        Step("env", [python, "-m", "bench.gpu_kit.env", "--out", str(out)], 20, 30),
        Step("smoke", [python, "-m", "bench.gpu_kit.smoke", "--out", str(out)], 45, 60,
             env={"STITCH_LOG": "debug"}, critical=True),
        # jax and the ctypes launches share the device: no preallocated pool.
        Step("tensor_cores", [python, "-m", "bench.gpu_kit.tensor_cores", "--out", str(out)],
             90, 0, needs_gpu=True, env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}),
        Step("timings", timings + (["--models", QUICK_MODELS] if quick else []),
             60 if quick else 110, 60),
        Step("kernels", [python, "-m", "bench.opt_levels", "time", "--dir", str(kernels),
                         "--json", str(out / "kernels.json")], 30, 0, needs_gpu=True),
        Step("profile", [python, "-m", "bench.gpu_kit.profile", "--out", str(out)], 40, 40),
        # -v: a cut-short log names the test it stopped in; --durations: which are slow.
        Step("tests", [python, "-m", "pytest", "-q", "-v", "-p", "no:cacheprovider", "-rs",
                       "--durations=25", "tests/gpu"], 120, 60),
        Step("memcheck", ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "3",
                          *sanitize, str(out / "memcheck.json")], 15, 0, needs_gpu=True,
             needs=("compute-sanitizer",)),
        Step("racecheck", ["compute-sanitizer", "--tool", "racecheck", "--error-exitcode",
                           "3", *sanitize, str(out / "racecheck.json")], 15, 0,
             needs_gpu=True, needs=("compute-sanitizer",)),
        Step("memcheck_jax", ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode",
                              "3", python, "-m", "bench.gpu_kit.smoke", "--out", str(out),
                              "--quick"], 25, 0, needs_gpu=True,
             needs=("compute-sanitizer",),
             env={"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}),
        # A carried .gpu_bench is timed as it is; else one small model is prepared here.
        Step("opt_levels", [python, "-m", "bench.opt_levels", "device", "--dir",
                            str(REPO / ".gpu_bench"), "--scratch", str(out / "gpu_bench"),
                            "--models", OPT_LEVELS_MODELS, "--json",
                            str(out / "opt_levels.json")], 30, 0, needs_gpu=True),
    ]
    return [s for s in every if s.name in QUICK_STEPS] if quick else every


def budget_sum(step_list: list[Step], rehearse: bool = False) -> int:
    """Seconds the steps may take together (each its own budget): what a check costs of
    the device's loan at most, besides the start and the transfers."""
    return sum(s.rehearsal_s if rehearse else s.budget_s for s in step_list
               if not (rehearse and s.needs_gpu))


def ingest_step(out: Path, python: str) -> Step:
    """The local step run on this folder at once (into copies under ``out``), so a broken
    ingest shows in the check itself, not after the GPU is gone."""
    return Step("ingest", [python, "-m", "bench.gpu_kit.ingest", str(out), "--docs",
                           str(out / "benchmarks_section.md"), "--calibration-dir",
                           str(out / "calibration"), "--self-check"], 20, 20)


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
    if code != 0 and "compute-sanitizer" in step.needs:
        said = next((line.strip() for line in lines
                     if any(word in line for word in SANITIZER_UNAVAILABLE)), None)
        if said is not None:
            return Outcome(step.name, "unavailable", seconds,
                           f"unavailable on this machine: {said[:160]}", tail, result)
    if code != 0:
        return Outcome(step.name, "failed", seconds, f"exit status {code}", tail, result)
    return Outcome(step.name, "passed", seconds, "", tail, result)


def markdown(record: dict) -> str:
    kind = ("rehearsal, no GPU" if record["rehearse"] else
            ("GPU, quick" if record.get("quick") else "GPU") if record.get("gpu") else
            "no GPU found")
    lines = [f"# stitch GPU check ({kind})",
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


def pack(work: Path, out: Path, record: dict) -> None:
    """``$OUT``'s few files from the work folder (module docstring). Kernel images go first
    when the archive would pass ``ARCHIVE_LIMIT``; what was left out is recorded."""
    files = sorted(p for p in work.rglob("*") if p.is_file())
    images = [p for p in files if p.suffix in (".cubin", ".ptx")]
    for attempt in (files, [p for p in files if p not in images]):
        with tarfile.open(out / ARCHIVE, "w:gz") as tar:
            for path in attempt:
                tar.add(path, arcname=str(path.relative_to(work)))
        if (out / ARCHIVE).stat().st_size <= ARCHIVE_LIMIT:
            break
        record["archive_left_out"] = f"{len(images)} kernel images (archive over the limit)"
    (out / "gpu_check.json").write_text(json.dumps(record, indent=1, default=str))
    (out / "gpu_check.md").write_text(markdown(record))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu_check.sh")
    parser.add_argument("--rehearse", action="store_true",
                        help="on a CPU machine: GPU steps skipped, the rest on the host")
    parser.add_argument("--quick", action="store_true",
                        help="the essentials only: env, smoke, one model timed, its kernels")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu_check_out"))
    parser.add_argument("--work", type=Path, help="where the steps write (default: a new "
                        "temporary folder); $OUT gets the packed results")
    parser.add_argument("--budget", type=float, help="seconds for all steps")
    parser.add_argument("--only", help="comma-separated step names")
    args = parser.parse_args(argv)
    from bench.cuda_driver import available
    gpu = not args.rehearse and available()
    budget = args.budget or (REHEARSAL_BUDGET_S if args.rehearse
                             else QUICK_BUDGET_S if args.quick else BUDGET_S)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = (args.work or Path(tempfile.mkdtemp(prefix="stitch_gpu_check_"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = child_env(args.rehearse)
    python = sys.executable
    device = "GPU" if gpu else "no GPU"
    print(f"gpu_check: {'rehearsal' if args.rehearse else 'quick check' if args.quick else 'check'}"
          f" on {device}, budget {budget:.0f} s, steps write to {work}, results in {out}",
          flush=True)
    step_budgets = budget_sum(steps(work, python, args.quick), args.rehearse)
    print(f"gpu_check: the steps' own budgets sum to {step_budgets} s", flush=True)
    start = time.monotonic()
    record = {"rehearse": args.rehearse, "quick": args.quick, "gpu": gpu,
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": device,
              "budget_s": int(budget), "step_budgets_s": step_budgets, "total_s": 0.0,
              "steps": []}
    outcomes: list[Outcome] = []
    wanted = set(args.only.split(",")) if args.only else None
    for step in steps(work, python, args.quick):
        if wanted is not None and step.name not in wanted:
            continue
        left = budget - (time.monotonic() - start)
        own = step.rehearsal_s if args.rehearse else step.budget_s
        limit = min(own, left) if own else left
        if not (step.needs_gpu and not gpu):
            print(f"gpu_check: step {step.name} ({limit:.0f} s at most)", flush=True)
        unavailable = next((o for o in outcomes if o.status == "unavailable"
                            and step.needs and o.name in ("memcheck", "racecheck")), None)
        if unavailable is not None:     # the sanitizer said so once: not asked again
            outcome = Outcome(step.name, "unavailable", 0.0, unavailable.reason)
        else:
            outcome = run_step(step, work, env, limit, gpu, args.rehearse)
        outcomes.append(outcome)
        print(f"gpu_check: step {step.name}: {outcome.status} in {outcome.seconds:.1f} s"
              f"{' (' + outcome.reason + ')' if outcome.reason else ''}", flush=True)
        if step.critical and outcome.status != "passed":
            print("\n" + "!" * 78 + f"\ngpu_check: {step.name} FAILED: stitch's pass did not "
                  "run as it must; everything after this measures stock XLA only\n"
                  + "!" * 78 + "\n", flush=True)
        env_result = next((o.result for o in outcomes if o.name == "env" and o.result), None)
        if env_result:
            record["device"] = env_result.get("device", {}).get("name", device)
        record["steps"] = [asdict(o) for o in outcomes]
        record["total_s"] = round(time.monotonic() - start, 1)
        (work / "gpu_check.json").write_text(json.dumps(record, indent=1, default=str))
        pack(work, out, record)
    if wanted is None or "ingest" in wanted:
        outcome = run_step(ingest_step(work, python), work, env, MIN_STEP_S * 2, gpu,
                           args.rehearse)
        outcomes.append(outcome)
        print(f"gpu_check: step ingest: {outcome.status}"
              f"{' (' + outcome.reason + ')' if outcome.reason else ''}", flush=True)
        record["steps"].append(asdict(outcome))
        record["total_s"] = round(time.monotonic() - start, 1)
        pack(work, out, record)
    bad = [o.name for o in outcomes if o.status in ("failed", "timeout")]
    print(f"gpu_check: done in {record['total_s']:.0f} s; "
          + (f"FAILED: {', '.join(bad)}" if bad else "every step passed or was skipped")
          + f"; results in {out} ({', '.join(RESULT_FILES)})", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
