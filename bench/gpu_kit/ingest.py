"""The kit's local step, run here on the folder a GPU check returned:

    python -m bench.gpu_kit.ingest RESULTS [--docs docs/benchmarks.md] [--calibration-dir D]
                                           [--partial]

``RESULTS`` is what came back: ``gpu_check.json``, ``gpu_check.md`` and
``gpu_check.tar.gz`` (the steps' files, unpacked here into a temporary folder; only regular
files and folders are taken out of it) — or an unpacked work folder.

Only a GPU's complete result is written: the ingest refuses (exit status 2, docs and
calibration untouched, the reason said) a missing folder, a missing or unreadable
``gpu_check.json``, a rehearsal, a check that found no GPU, and a result without the
device's facts, the timings or the saved kernels. ``--partial`` takes a GPU result that
stopped short (labelled "partial"); rehearsals are never taken into docs/benchmarks.md
(``--self-check``, the runner's own check of the ingest, writes only elsewhere).

Writes docs/benchmarks.md's section ``bench-gpu-check`` (the steps' outcomes, the device,
whole steps under stitch.jit vs jax.jit, each stitched kernel's measured µs beside the
latency-evaluator's with the error, rank correlation and achieved HBM bandwidth as a fraction
of the device's peak, the tensor-core kernels at real sizes against XLA, the LLVM pipelines'
kernel times) and the calibration table
``stitch/cost/calibration/<target>.json`` (``stitch.cost.calibration``), with the device and
date it came from; the tensor-core kernels that passed their check on the device become its
``efficiencies`` (``stitch.cost.mma_efficiency``). A run that measured only one of the two
keeps the other from the table already there for the same device. A rehearsal's folder (no GPU) gives the section without kernel times and
no calibration table.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tarfile
import tempfile
from pathlib import Path

from stitch.cost.calibration import (Calibration, KernelEfficiency, KernelSample,
                                     load_calibration, save_calibration, spearman)

SECTION = "bench-gpu-check"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
ARCHIVE = "gpu_check.tar.gz"
# What a complete GPU result holds besides gpu_check.json.
COMPLETE = ("env.json", "timings.json", "kernels/manifest.json", "kernels.json")


class IngestRefused(Exception):
    """The folder is not a result the docs may take (the message says why)."""


def unpacked(results: Path, scratch: Path) -> Path:
    """The folder holding the steps' files: ``results`` itself, or its archive unpacked
    into ``scratch`` (regular files and folders only: tarfile's "data" filter refuses links,
    devices and paths outside ``scratch``)."""
    archive = results / ARCHIVE
    if not archive.exists():
        return results
    try:
        with tarfile.open(archive, "r:gz") as tar:
            tar.extractall(scratch, filter="data")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise IngestRefused(f"{archive}: not a readable archive ({exc})") from exc
    for name in ("gpu_check.json", "gpu_check.md"):     # the top level's are the newest
        if (results / name).exists():
            (scratch / name).write_bytes((results / name).read_bytes())
    return scratch


def check_result(folder: Path, *, partial: bool, self_check: bool) -> dict:
    """The run's record, when ``folder`` holds a result the docs may take."""
    if not folder.is_dir():
        raise IngestRefused(f"{folder}: no such folder")
    path = folder / "gpu_check.json"
    if not path.exists():
        raise IngestRefused(f"{folder}: no gpu_check.json (not a GPU check's results)")
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise IngestRefused(f"{path}: unreadable ({exc})") from exc
    if self_check:
        return record
    if record.get("rehearse"):
        raise IngestRefused(f"{folder}: a rehearsal (no GPU); its results never replace the "
                            "GPU section")
    if not record.get("gpu"):
        raise IngestRefused(f"{folder}: the check found no GPU on its machine "
                            f"(device: {record.get('device')})")
    missing = [name for name in COMPLETE if _load(folder, name) is None]
    if missing and not partial:
        raise IngestRefused(f"{folder}: incomplete GPU result, missing or unreadable: "
                            f"{', '.join(missing)} (steps: " + ", ".join(
                                f"{s['name']} {s['status']}" for s in record.get("steps", []))
                            + "); --partial takes it labelled as partial")
    record["partial"] = bool(missing)
    return record


def _load(folder: Path, name: str):
    path = folder / name
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def kernel_rows(folder: Path, peak_gbs: float | None) -> list[dict]:
    """Measured kernels joined with their manifest entries (modeled µs, bytes)."""
    manifest = _load(folder / "kernels", "manifest.json") or {"kernels": []}
    timed = {(r["model"], r["config"], r["entry"]): r
             for r in _load(folder, "kernels.json") or [] if "us" in r}
    rows = []
    for entry in manifest["kernels"]:
        measured = timed.get((entry["model"], entry["config"], entry["entry"]))
        moved = sum(p["size"] * p["bytes"] for p in entry["params"])
        row = {"model": entry["model"], "config": entry["config"], "entry": entry["entry"],
               "modeled_us": entry.get("modeled_us"), "bytes": moved,
               "measured_us": measured["us"] if measured else None,
               "unwritten_outputs": measured.get("unwritten_outputs") if measured else None}
        if row["measured_us"]:
            row["gbs"] = moved / row["measured_us"] / 1e3
            row["peak_fraction"] = row["gbs"] / peak_gbs if peak_gbs else None
            if row["modeled_us"]:
                row["error"] = (row["modeled_us"] - row["measured_us"]) / row["measured_us"]
        rows.append(row)
    return rows


def profile_lines(profile: dict | None) -> list[str]:
    """The profile step's table: device time and kernels per call, stock vs stitched, and
    the host's dispatch per call (``bench.gpu_kit.profile``)."""
    if not profile or not profile.get("models"):
        return []
    lines = ["", "Where a step's time goes (perfetto trace, per call):", "",
             "| model | side | device µs | device events | host µs (largest event) | "
             "busiest device event |", "|---|---|---:|---:|---|---|"]
    for row in profile["models"]:
        if "error" in row:
            lines.append(f"| {row['model']} ({row['config']}) | – | – | – | – | "
                         f"{row['error'][:100]} |")
            continue
        for side in ("stock", "stitched"):
            got = row[side]
            host = max(got["host_us_per_call"].items(), key=lambda kv: kv[1],
                       default=("–", 0.0))
            top = got["top_device"][0] if got["top_device"] else None
            lines.append(f"| {row['model']} ({row['config']}) | {side} | "
                         f"{got['device_us_per_call']:.1f} | "
                         f"{got['device_events_per_call']:.0f} | "
                         f"{host[1]:.1f} ({host[0]}) | "
                         + (f"{top['name'][:60]} {top['us_per_call']:.1f} µs" if top else "–")
                         + " |")
    return lines


def tensor_core_rows(folder: Path) -> list[dict]:
    """The ``tensor_cores`` step's rows (``bench.gpu_kit.tensor_cores``)."""
    return (_load(folder, "tensor_cores.json") or {}).get("kernels", [])


def efficiencies(rows: list[dict]) -> tuple[KernelEfficiency, ...]:
    """The rows a calibration may take: checked correct on the device and timed."""
    return tuple(KernelEfficiency(r["name"], r["kind"], r["unit"], float(r["flops"]),
                                  float(r["us"]), float(r["fraction_of_peak"]),
                                  r.get("xla_us"))
                 for r in rows if r.get("correct") and r.get("us")
                 and r.get("fraction_of_peak") is not None)


def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def tensor_core_lines(rows: list[dict]) -> list[str]:
    """The table of GEMM-bound kernels at real sizes: µs, achieved TFLOP/s, fraction of the
    unit's peak, XLA's µs for the same math, and the check against jax."""
    if not rows:
        return []
    lines = ["", "Tensor-core kernels at real sizes (`bench.gpu_kit.tensor_cores`: flops as "
             "the kernel executes them, recomputation included; checked against jax.vjp in "
             "f32 at max |error| / max |jax| ≤ the tolerance; XLA: jax.jit of the same "
             "math on the kernel's storage type):", "",
             "| kernel | unit | µs | TFLOP/s | of peak | XLA µs | vs XLA | check | registers "
             "| notes |", "|---|---|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | – | – | – | – | – | – | failed | – | "
                         f"{r['error'][:120].replace('|', '/')} |")
            continue
        worst = max(r.get("errors", {}).values(), default=None)
        check = "ok" if r.get("correct") else "WRONG"
        if worst is not None:
            check += f" ({worst:.1e}, tolerance {r['tolerance']:.0e})"
        ratio = (r["xla_us"] / r["us"]) if r.get("us") and r.get("xla_us") else None
        lines.append(f"| {r['name']} | {r.get('unit')} | {_fmt(r.get('us'), '.1f')} | "
                     f"{_fmt(r.get('tflops'), '.1f')} | {_fmt(r.get('fraction_of_peak'), '.0%')}"
                     f" | {_fmt(r.get('xla_us'), '.1f')} | "
                     f"{'–' if ratio is None else f'{ratio:.2f}×'} | {check} | "
                     f"{r.get('registers', '–')} | {r.get('notes', '')} |")
    return lines


def markdown(folder: Path, command: str,
             record: dict | None = None) -> tuple[str, Calibration | None]:
    from bench.report import stamp
    record = record or _load(folder, "gpu_check.json") or {"steps": [], "rehearse": True}
    env = _load(folder, "env.json") or {}
    device = env.get("device", {})
    peak = device.get("peak_hbm_gbs")
    label = ("rehearsal: no GPU" if record.get("rehearse") else
             "no GPU found" if not record.get("gpu") else
             "measured, partial" if record.get("partial") else
             "measured, quick" if record.get("quick") else "measured")
    lines = [f"### GPU check ({label})",
             "", stamp(command), "",
             f"Device: {device.get('name', 'none')}"
             + (f", compute capability {'.'.join(map(str, device['compute_capability']))}, "
                f"driver {device.get('driver_version')}, peak HBM {peak:.0f} GB/s"
                if device.get("compute_capability") else "")
             + f"; the check ran {record.get('date', '?')} "
             f"({record.get('total_s', 0):.0f} s). jax {env.get('versions', {}).get('jax')}, "
             f"ptxas {env.get('toolchain', {}).get('ptxas_version')} "
             f"({env.get('toolchain', {}).get('ptxas')}), libdevice "
             f"{env.get('toolchain', {}).get('libdevice')}; planned as "
             f"{env.get('target', '?')}.", "",
             "| step | status | seconds | note |", "|---|---|---:|---|"]
    for step in record.get("steps", []):
        lines.append(f"| {step['name']} | {step['status']} | {step['seconds']:.1f} | "
                     f"{step['reason'].replace('|', '/')} |")
    timings = _load(folder, "timings.json") or {"models": []}
    lines += ["", "Whole steps (median of alternating calls, after warm-up):", "",
              "| model | stitch.jit ms | jax.jit ms | speed-up | kernels XLA → stitched |",
              "|---|---:|---:|---:|---|"]
    for row in timings["models"]:
        if "error" in row:
            lines.append(f"| {row['model']} ({row['config']}) | – | – | – | {row['error'][:120]} |")
            continue
        report = row.get("report", {})
        lines.append(f"| {row['model']} ({row['config']}) | {row['stitched_ms']:.3f} | "
                     f"{row['stock_ms']:.3f} | {row['speedup']}× | "
                     f"{report.get('kernels_before')} → {report.get('kernels_after')} |")
    if any(row["model"].startswith("segment_softmax") for row in timings["models"]):
        from bench.delivered.segments import ANCHOR
        lines += ["", f"The segmented softmax's anchor, measured elsewhere (jax-ml/jax#37511, "
                  f"forward only): {ANCHOR}. The zoo's case here is 10k segments of 64 × 4 "
                  "heads, forward and gradient."]
    lines += profile_lines(_load(folder, "profile.json"))
    rows = kernel_rows(folder, peak)
    measured = [r for r in rows if r["measured_us"] and r["modeled_us"]]
    calibration = None
    if measured:
        rho = spearman([r["modeled_us"] for r in measured], [r["measured_us"] for r in measured])
        lines += ["", f"Stitched kernels on the device: {len(measured)} timed; the "
                  f"latency-evaluator's median relative error "
                  f"{statistics.median(abs(r['error']) for r in measured):.2f}, rank "
                  f"correlation {'–' if rho is None else f'{rho:.2f}'}.", "",
                  "| model | kernel | modeled µs | measured µs | error | GB/s | of peak | "
                  "unwritten outputs |", "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in measured:
            of_peak = "–" if r["peak_fraction"] is None else f"{r['peak_fraction']:.0%}"
            lines.append(f"| {r['model']} ({r['config']}) | {r['entry']} | "
                         f"{r['modeled_us']:.2f} | {r['measured_us']:.2f} | "
                         f"{r['error']:+.0%} | {r['gbs']:.0f} | {of_peak} | "
                         f"{r['unwritten_outputs']} |")
        calibration = Calibration(
            target=env.get("target", "h100"), device=device.get("name", "unknown"),
            date=str(record.get("date", "")),
            samples=tuple(KernelSample(f"{r['model']}:{r['config']}", r["entry"],
                                       float(r["modeled_us"]), float(r["measured_us"]))
                          for r in measured))
    else:
        lines += ["", "No stitched kernel was timed on a device in this run."]
    lines += tensor_core_lines(tensor_core_rows(folder))
    measured_efficiencies = efficiencies(tensor_core_rows(folder))
    if calibration is not None or measured_efficiencies:
        calibration = Calibration(
            target=env.get("target", "h100"), device=device.get("name", "unknown"),
            date=str(record.get("date", "")),
            samples=calibration.samples if calibration is not None else (),
            efficiencies=measured_efficiencies)
    opt = _load(folder, "opt_levels.json")
    if opt:
        lines += ["", f"LLVM pipelines: {len(opt)} kernel runs timed (`python -m "
                  "bench.opt_levels report --timings` makes their table)."]
    for name in ("memcheck", "racecheck"):
        step = next((s for s in record.get("steps", []) if s["name"] == name), None)
        if step and step["status"] != "skipped":
            lines.append(f"compute-sanitizer {name}: {step['status']}.")
    return "\n".join(lines), calibration


def kept_from(new: Calibration, old: Calibration | None) -> Calibration:
    """``new`` with what it did not measure (kernel samples, or efficiencies) taken from
    ``old``, the table already there, where that came from the same device."""
    if old is None or old.device != new.device:
        return new
    return dataclasses.replace(new, samples=new.samples or old.samples,
                               efficiencies=new.efficiencies or old.efficiencies)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_kit.ingest")
    parser.add_argument("results", type=Path)
    parser.add_argument("--docs", type=Path, default=DOCS)
    parser.add_argument("--calibration-dir", type=Path)
    parser.add_argument("--partial", action="store_true",
                        help="take a GPU result that stopped short (labelled partial)")
    parser.add_argument("--self-check", action="store_true",
                        help="the runner's check of the ingest: any result, never into "
                        "docs/benchmarks.md")
    parser.add_argument("--rehearse", action="store_true")   # the runner passes it
    parser.add_argument("--out", type=Path)                  # the runner's; unused
    args = parser.parse_args(argv)
    if args.self_check and args.docs.resolve() == DOCS.resolve():
        print("ingest: --self-check never writes docs/benchmarks.md; name --docs",
              file=sys.stderr)
        return 2
    from bench.report import publish
    with tempfile.TemporaryDirectory(prefix="stitch_gpu_ingest_") as scratch:
        try:
            if not args.results.is_dir():
                raise IngestRefused(f"{args.results}: no such folder")
            folder = unpacked(args.results, Path(scratch))
            record = check_result(folder, partial=args.partial, self_check=args.self_check)
        except IngestRefused as exc:
            said = str(exc).replace(scratch, str(args.results))
            print(f"ingest: refused, nothing written: {said}", file=sys.stderr)
            return 2
        text, calibration = markdown(folder, "python -m bench.gpu_kit.ingest "
                                     + str(args.results), record)
    publish(args.docs, SECTION, text)
    print(f"ingest: section {SECTION} written to {args.docs}")
    if calibration is not None and not record.get("rehearse"):
        calibration = kept_from(calibration, load_calibration(calibration.target,
                                                              args.calibration_dir))
        path = save_calibration(calibration, args.calibration_dir)
        print(f"ingest: calibration for {calibration.target} ({calibration.device}) in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
