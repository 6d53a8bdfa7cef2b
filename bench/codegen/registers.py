"""The schedules' register estimate (liveness, stitch/schedule/tuner.py) against the
registers ptxas allocates for the kernel codegen emits from that schedule.

For every zoo model with an XLA GPU fixture (full config) and each target, the module is
planned and compiled (``stitch.compiler.compile``); every stitched kernel's
``schedule.regs_estimate`` is paired with ``ptxas -v``'s register count for the target's
arch. Reported: Spearman rank correlation, median ratio, how often the estimate is low (the
occupancy the latency-evaluator assumed was too optimistic), and the worst outliers.

    python -m bench.codegen.registers --out docs/benchmarks.md [--targets h100,v100] [--models m1,m2]
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.plans.estimates import spearman
from bench.report import REPO, stamp, write_section

DATA = REPO / "hlo_fixtures" / "data"
TARGETS = ("h100", "a100", "v100")


@dataclass
class Pair:
    model: str
    target: str
    kernel: str
    schemes: str
    estimate: int
    ptxas: int
    spills: int


def collect(models: list[str], targets: tuple[str, ...]) -> tuple[list[Pair], list[str]]:
    from stitch.compiler import compile as stitch_compile

    pairs: list[Pair] = []
    problems: list[str] = []
    for model in models:
        for target in targets:
            path = DATA / model / f"full.gpu-{target}.hlo"
            if not path.exists():
                continue
            try:
                exe = stitch_compile(path.read_text(), target, cache=False)
                reports = exe.ptxas()
            except Exception as exc:  # a row of the report, not a crash
                problems.append(f"{model} {target}: {type(exc).__name__}: {exc}"[:200])
                continue
            schedules = {(gi, frozenset(k.members)): k.schedule
                         for gi, g in enumerate(exe.plan.graphs) for k in g.stitched.kernels
                         if k.schedule is not None}
            for ck in exe.kernels:
                schedule = schedules.get((ck.graph_index, frozenset(ck.members)))
                report = reports.get(ck.name)
                if schedule is None or report is None:
                    continue
                pairs.append(Pair(model, target, ck.name, "/".join(schedule.schemes),
                                  schedule.regs_estimate, report.registers,
                                  report.spill_store_bytes + report.spill_load_bytes))
    return pairs, problems


def markdown(pairs: list[Pair], problems: list[str], command: str, seconds: float) -> str:
    lines = ["## Register estimate vs ptxas (counted)", "",
             stamp(command) + f" {seconds:.0f} s.", "",
             "Both numbers are counted, nothing ran on a GPU: the schedule's liveness "
             "estimate (`KernelSchedule.regs_estimate`, what occupancy and the "
             "latency-evaluator assume) and the registers `ptxas -v` allocates for the PTX "
             "codegen emits from that schedule (CUDA 13 ptxas for sm_80/sm_90, the CUDA 12 "
             "wheel's for sm_70). Every stitched kernel of every zoo model's full-size plan "
             "made from XLA's optimized HLO.", "",
             "| target | kernels | Spearman | median ptxas/estimate | estimate low | "
             "estimate low by > 2x | spills |", "|---|---:|---:|---:|---:|---:|---:|"]
    for target in TARGETS:
        rows = [p for p in pairs if p.target == target]
        if not rows:
            continue
        est = np.array([p.estimate for p in rows], float)
        got = np.array([p.ptxas for p in rows], float)
        ratio = got / np.maximum(est, 1)
        lines.append(f"| {target} | {len(rows)} | {spearman(est, got):.3f} | "
                     f"{np.median(ratio):.2f} | {int((got > est).sum())} | "
                     f"{int((got > 2 * est).sum())} | {sum(p.spills > 0 for p in rows)} |")
    worst = sorted(pairs, key=lambda p: -max(p.ptxas / max(p.estimate, 1),
                                            p.estimate / max(p.ptxas, 1)))[:10]
    lines += ["", "Worst outliers (either direction):", "",
              "| model | target | kernel | schemes | estimate | ptxas | ptxas/estimate |",
              "|---|---|---|---|---:|---:|---:|"]
    lines += [f"| {p.model} | {p.target} | {p.kernel} | {p.schemes} | {p.estimate} | "
              f"{p.ptxas} | {p.ptxas / max(p.estimate, 1):.2f} |" for p in worst]
    if problems:
        lines += ["", "Not measured:", ""] + [f"- {x}" for x in problems]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the section into this markdown file")
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--models", default="")
    parser.add_argument("--json", type=Path, help="also write the pairs as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from stitch.models import list_models
    models = [m for m in (args.models.split(",") if args.models else list_models())
              if (DATA / m).is_dir()]
    start = time.perf_counter()
    pairs, problems = collect(models, tuple(args.targets.split(",")))
    body = markdown(pairs, problems, "python -m bench.codegen.registers --out docs/benchmarks.md",
                    time.perf_counter() - start)
    if args.json:
        args.json.write_text(json.dumps([p.__dict__ for p in pairs], indent=1))
    if args.out:
        write_section(args.out, "regs-vs-ptxas", body, after="latency-vs-xla")
    else:
        print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
