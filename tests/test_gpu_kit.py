"""The GPU bring-up kit without a GPU: the rehearsal (``scripts/gpu_check.sh --rehearse``,
with everything the GPU machine lacks blocked), the no-install autoload shim, the step
runner's time boxes, the device → target mapping and the local step that turns returned
files into docs and a calibration table."""
from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_kit import ingest, runner
from stitch.xla_pass.device_target import pass_target, target_for_device_info
from stitch.cost.calibration import Calibration, KernelSample, load_calibration, spearman

REPO = Path(__file__).resolve().parents[1]


def _unpack(out: Path, into: Path) -> Path:
    import tarfile
    with tarfile.open(out / runner.ARCHIVE) as tar:
        tar.extractall(into, filter="data")
    return into


def test_rehearsal_passes_with_the_devices_missing_packages_blocked(tmp_path) -> None:
    out = tmp_path / "out"
    run = subprocess.run([str(REPO / "scripts" / "gpu_check.sh"), "--rehearse", "--out",
                          str(out), "--work", str(tmp_path / "work")], capture_output=True,
                         text=True, timeout=300, cwd="/")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    # What a GPU machine returns: at most 8 files, each under 16 MiB, all at the top.
    returned = sorted(p.name for p in out.rglob("*"))
    assert returned == sorted(runner.RESULT_FILES), returned
    assert all((out / name).stat().st_size < 16 * 2**20 for name in returned)
    record = json.loads((out / "gpu_check.json").read_text())
    status = {s["name"]: s for s in record["steps"]}
    for name in ("env", "smoke", "tests", "timings", "ingest"):
        assert status[name]["status"] == "passed", status[name]
    for name in ("tensor_cores", "kernels", "memcheck", "racecheck", "memcheck_jax",
                 "opt_levels"):
        assert status[name]["reason"] == "skipped: no GPU", status[name]
    files = _unpack(out, tmp_path / "unpacked")
    smoke = json.loads((files / "smoke.json").read_text())
    assert all(m["pass_called"] and m["matches_jax_jit"] for m in smoke["models"])
    assert smoke["autoload"]["patched"]
    # The kernels the timing step saved (for the device's kernel steps) exist.
    manifest = json.loads((files / "kernels" / "manifest.json").read_text())
    assert manifest["kernels"] and all(
        (files / "kernels" / e["variants"][next(iter(e["variants"]))]["cubin"]).exists()
        for e in manifest["kernels"])
    assert "bench-gpu-check:begin" in (files / "benchmarks_section.md").read_text()
    assert (out / "gpu_check.md").read_text().count("skipped: no GPU") == 6
    # A rehearsal never replaces the GPU section: the ingest refuses it, docs untouched.
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n")
    assert ingest.main([str(out), "--docs", str(docs)]) == 2
    assert docs.read_text() == "# Benchmarks\n"


def test_step_budgets_fit_the_devices_loan(tmp_path) -> None:
    """The steps' own budgets are what a check may cost: the whole check's budget is their
    sum, under 9 of the loan's 15 minutes (the start and the transfers take the rest)."""
    every = runner.steps(tmp_path, sys.executable)
    assert runner.budget_sum(every) == runner.BUDGET_S <= 9 * 60
    assert [s.name for s in every][:3] == ["env", "smoke", "tensor_cores"]
    assert runner.budget_sum(runner.steps(tmp_path, sys.executable, quick=True)) <= \
        runner.QUICK_BUDGET_S


def test_archive_over_the_limit_leaves_the_kernel_images_out(tmp_path, monkeypatch) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "kernels").mkdir(parents=True)
    out.mkdir()
    (work / "kernels" / "k.cubin").write_bytes(os.urandom(4096))
    (work / "timings.json").write_text("{}")
    monkeypatch.setattr(runner, "ARCHIVE_LIMIT", 2048)
    record = {"rehearse": False, "gpu": True, "date": "d", "device": "x", "budget_s": 1,
              "total_s": 1.0, "steps": []}
    runner.pack(work, out, record)
    import tarfile
    with tarfile.open(out / runner.ARCHIVE) as tar:
        assert tar.getnames() == ["timings.json"]
    assert "kernel images" in json.loads((out / "gpu_check.json").read_text())[
        "archive_left_out"]


def test_sanitizer_refusing_the_device_is_unavailable_not_failed(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(runner, "MIN_STEP_S", 0)
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "manifest.json").write_text("{}")   # kernels were saved
    refuse = ("import sys; print('========= COMPUTE-SANITIZER'); "
              "print('========= Error: Device not supported'); sys.exit(1)")
    step = runner.Step("memcheck", [sys.executable, "-c", refuse], 5, 5,
                       needs=("compute-sanitizer",))
    monkeypatch.setattr(runner.shutil, "which", lambda tool: "/bin/" + tool)
    outcome = runner.run_step(step, tmp_path, dict(os.environ), 5, gpu=True, rehearse=False)
    assert outcome.status == "unavailable" and "Device not supported" in outcome.reason
    crash = runner.Step("memcheck", [sys.executable, "-c", "raise SystemExit(3)"], 5, 5,
                        needs=("compute-sanitizer",))
    assert runner.run_step(crash, tmp_path, dict(os.environ), 5, gpu=True,
                           rehearse=False).status == "failed"


def _shim_env(blocked: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("STITCH_ENABLE", "PYTHONPATH")}
    # -S: no site-packages .pth (an installed stitch's autoload) — only the shim can act.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "scripts" / "pythonpath"),
                                         *site.getsitepackages()])
    if blocked:
        env["STITCH_BLOCK_MODULES"] = blocked
    return env


def test_stitch_enable_works_from_a_checkout_on_pythonpath() -> None:
    code = ("import sitecustomize, jax\n"
            "print(getattr(jax.jit, '__stitch_original__', None) is not None)\n")
    env = _shim_env()
    run = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         env={**env, "STITCH_ENABLE": "1"}, timeout=120, cwd="/")
    assert run.stdout.strip() == "True", run.stderr[-2000:]
    off = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         env=env, timeout=120, cwd="/")
    assert off.stdout.strip() == "False", off.stderr[-2000:]


def test_blocked_modules_fail_to_import_as_on_the_device() -> None:
    code = ("import sitecustomize\n"
            "try:\n    import pulp\nexcept ImportError as e:\n    print('blocked', e)\n"
            "import numpy\nprint('numpy ok')\n")
    run = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         env=_shim_env("pulp,highspy"), timeout=60, cwd="/")
    assert run.stdout.splitlines()[0].startswith("blocked"), run.stdout + run.stderr
    assert "numpy ok" in run.stdout


def test_a_hanging_step_is_killed_and_the_next_one_runs(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(runner, "MIN_STEP_S", 0)
    hang = runner.Step("hang", ["sleep", "30"], 1, 1)
    fail = runner.Step("fail", [sys.executable, "-c", "raise SystemExit(3)"], 5, 5)
    ok = runner.Step("ok", [sys.executable, "-c", "print('fine')"], 5, 5)
    env = dict(os.environ)
    outcomes = [runner.run_step(s, tmp_path, env, s.budget_s, gpu=False, rehearse=False)
                for s in (hang, fail, ok)]
    assert [o.status for o in outcomes] == ["timeout", "failed", "passed"]
    assert outcomes[0].seconds < 10
    assert "exit status 3" in outcomes[1].reason and "fine" in outcomes[2].tail
    gpu_only = runner.Step("g", ["true"], 5, 5, needs_gpu=True)
    assert runner.run_step(gpu_only, tmp_path, env, 5, gpu=False,
                           rehearse=True).reason == "skipped: no GPU"


@pytest.mark.parametrize("name,cc,memory,want", [
    ("NVIDIA H100 80GB HBM3", (9, 0), 80 * 2**30, "h100"),
    ("NVIDIA H200", (9, 0), 141 * 2**30, "h200"),
    ("NVIDIA GH200 480GB", (9, 0), 96 * 2**30, "h200"),
    ("", (9, 0), 141 * 2**30, "h200"),
    ("", (9, 0), 80 * 2**30, "h100"),
    ("NVIDIA A100-SXM4-40GB", (8, 0), None, "a100"),
    ("NVIDIA L4", (8, 9), None, "a100"),
    ("Tesla V100-SXM2-16GB", (7, 0), None, "v100"),
    ("", None, None, "h100"),
])
def test_device_to_target(name, cc, memory, want) -> None:
    assert target_for_device_info(name, cc, memory) == want


def test_stitch_target_wins_over_the_device(monkeypatch) -> None:
    monkeypatch.setenv("STITCH_TARGET", "a100")
    assert pass_target("h100") == "a100"
    monkeypatch.delenv("STITCH_TARGET")
    assert pass_target("v100") == "v100"            # a caller's explicit non-default
    assert pass_target("h100") == "h100"            # no GPU here: the requested one


def test_spearman() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2], [1, 2]) is None
    assert spearman([1, 1, 1], [1, 2, 3]) is None


def _gpu_results(results: Path, *, rehearse: bool = False, gpu: bool = True) -> None:
    (results / "kernels").mkdir(parents=True)
    (results / "gpu_check.json").write_text(json.dumps({
        "rehearse": rehearse, "gpu": gpu, "date": "2030-01-02 03:04:05 UTC", "total_s": 300,
        "steps": [{"name": "env", "status": "passed", "seconds": 1.0, "reason": ""}]}))
    (results / "env.json").write_text(json.dumps({
        "target": "h200", "versions": {"jax": "0.11.2"},
        "toolchain": {"ptxas_version": "13.0.88", "ptxas": "/x/ptxas", "libdevice": "/x/l"},
        "device": {"name": "NVIDIA H200", "compute_capability": [9, 0],
                   "driver_version": 13000, "peak_hbm_gbs": 4800.0}}))
    params = [{"name": "a", "dtype": "f32", "size": 1000, "bytes": 4, "output": False},
              {"name": "b", "dtype": "f32", "size": 1000, "bytes": 4, "output": True}]
    entries = [{"model": "m", "config": "tiny", "entry": f"k{i}", "params": params,
                "modeled_us": float(m)} for i, m in enumerate((2.0, 4.0, 8.0))]
    (results / "kernels" / "manifest.json").write_text(json.dumps({"kernels": entries}))
    measured = (4.0, 6.0, 16.0)
    (results / "kernels.json").write_text(json.dumps([
        {"model": "m", "config": "tiny", "entry": f"k{i}", "variant": "O3", "us": us,
         "unwritten_outputs": 0} for i, us in enumerate(measured)]))
    (results / "timings.json").write_text(json.dumps({"models": [
        {"model": "m", "config": "tiny", "stitched_ms": 1.0, "stock_ms": 1.5, "speedup": 1.5,
         "report": {"kernels_before": 5, "kernels_after": 2}},
        {"model": "segment_softmax_grad", "config": "full", "stitched_ms": 0.05,
         "stock_ms": 0.3, "speedup": 6.0, "report": {"kernels_before": 9,
                                                     "kernels_after": 1}}]}))


def _packed(results: Path, into: Path) -> Path:
    """``results`` as a GPU machine returns it: the record, the summary, one archive."""
    import tarfile
    into.mkdir()
    with tarfile.open(into / runner.ARCHIVE, "w:gz") as tar:
        for path in results.rglob("*"):
            if path.is_file():
                tar.add(path, arcname=str(path.relative_to(results)))
    (into / "gpu_check.json").write_bytes((results / "gpu_check.json").read_bytes())
    (into / "gpu_check.md").write_text("# summary\n")
    return into


def test_ingest_writes_the_docs_section_and_a_calibration_table(tmp_path) -> None:
    _gpu_results(tmp_path / "results")
    results = _packed(tmp_path / "results", tmp_path / "returned")
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\nkept\n")
    assert ingest.main([str(results), "--docs", str(docs), "--calibration-dir",
                        str(tmp_path / "cal")]) == 0
    text = docs.read_text()
    assert "kept" in text and "NVIDIA H200" in text and "| m (tiny) | k2 | 8.00 | 16.00 |" in text
    assert "GPU check (measured)" in text
    assert "rank correlation 1.00" in text
    # The segmented softmax is timed beside the issue's own measurements (the anchor).
    assert "| segment_softmax_grad (full) | 0.050 | 0.300 | 6.0× | 9 → 1 |" in text
    assert "one Triton kernel 0.032–0.035 ms" in text
    # 8000 bytes in 16 µs = 0.5 GB/s... of 4800: written as a fraction
    assert "| 0% |" in text
    cal = load_calibration("h200", tmp_path / "cal")
    assert cal is not None and cal.device == "NVIDIA H200" and cal.date.startswith("2030")
    assert cal.scale == pytest.approx(2.0)          # median of 2, 1.5, 2
    assert cal.rank_correlation == pytest.approx(1.0)
    assert cal.calibrated_us(3.0) == pytest.approx(6.0)


@pytest.mark.parametrize("case,why", [
    ("missing", "no such folder"), ("no_record", "no gpu_check.json"),
    ("rehearsal", "a rehearsal"), ("no_gpu", "found no GPU"),
    ("incomplete", "incomplete GPU result"), ("bad_archive", "not a readable archive")])
def test_ingest_refuses_what_is_not_a_complete_gpu_result(tmp_path, capsys, case, why) -> None:
    results = tmp_path / "results"
    if case != "missing":
        _gpu_results(results, rehearse=case == "rehearsal", gpu=case != "no_gpu")
    if case == "no_record":
        (results / "gpu_check.json").unlink()
    if case == "incomplete":
        (results / "kernels" / "manifest.json").unlink()
    if case == "bad_archive":
        (results / runner.ARCHIVE).write_bytes(b"not gzip")
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n")
    cal = tmp_path / "cal"
    assert ingest.main([str(results), "--docs", str(docs), "--calibration-dir", str(cal)]) == 2
    assert why in capsys.readouterr().err
    assert docs.read_text() == "# Benchmarks\n" and not cal.exists()


def test_ingest_takes_a_partial_gpu_result_only_when_asked(tmp_path) -> None:
    results = tmp_path / "results"
    _gpu_results(results)
    (results / "kernels.json").unlink()
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n")
    assert ingest.main([str(results), "--docs", str(docs)]) == 2
    assert ingest.main([str(results), "--docs", str(docs), "--partial",
                        "--calibration-dir", str(tmp_path / "cal")]) == 0
    assert "GPU check (measured, partial)" in docs.read_text()
    assert ingest.main([str(results), "--self-check"]) == 2      # never into the real docs


def test_an_archive_cannot_write_outside_its_folder(tmp_path) -> None:
    import io
    import tarfile
    results = tmp_path / "results"
    _gpu_results(results)
    with tarfile.open(results / runner.ARCHIVE, "w:gz") as tar:
        data = b"x"
        info = tarfile.TarInfo("../escaped.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n")
    assert ingest.main([str(results), "--docs", str(docs)]) == 2
    assert not (tmp_path / "escaped.txt").exists()


def test_calibration_round_trip(tmp_path) -> None:
    cal = Calibration("h100", "NVIDIA H100", "2030-01-01",
                      (KernelSample("m", "k", 1.0, 3.0), KernelSample("m", "j", 2.0, 2.0)))
    from stitch.cost.calibration import save_calibration
    path = save_calibration(cal, tmp_path)
    assert path.name == "h100.json"
    assert load_calibration("h100", tmp_path) == cal
    assert load_calibration("a100", tmp_path) is None


def test_profile_summary_splits_device_kernels_from_host_events() -> None:
    """A perfetto trace's complete events: kernels on the GPU process summed per call inside
    the marker's window, host dispatch apart, events outside the window ignored."""
    from bench.gpu_kit.profile import summarize
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}}]
    marks = [{"ph": "X", "pid": 1, "name": "m", "ts": 100 * i, "dur": 50} for i in (1, 2)]
    kernels = [{"ph": "X", "pid": 2, "name": k, "ts": 100 * i + 5, "dur": d}
               for i in (1, 2) for k, d in (("stitch_main_k0", 7.0), ("gemm_fusion", 3.0))]
    host = [{"ph": "X", "pid": 1, "name": "PjitFunction(step)", "ts": 100 * i, "dur": 20}
            for i in (1, 2)]
    outside = [{"ph": "X", "pid": 2, "name": "warmup_kernel", "ts": 10, "dur": 99}]
    got = summarize({"traceEvents": meta + marks + kernels + host + outside}, 2, "m")
    assert got["device_us_per_call"] == pytest.approx(10.0)
    assert got["device_events_per_call"] == pytest.approx(2.0)
    assert got["top_device"][0] == {"name": "stitch_main_k0", "us_per_call": 7.0,
                                    "count_per_call": 1.0}
    assert got["host_us_per_call"] == {"PjitFunction(step)": 20.0}
