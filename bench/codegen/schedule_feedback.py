"""How often ptxas feedback (stitch/schedule/ptxas_feedback.py) rebuilds a stitched kernel.

For every zoo model with XLA GPU fixtures (full config) and each target, the module is
planned; every scheduled stitched kernel is lowered, emitted as PTX for the target's arch and
assembled by ptxas (all through the on-disk compile cache: no host build, nothing runs on a
GPU); its schedule is revised with ptxas's register count. A kernel another schedule now wins
is lowered and assembled again with it (the rebuild), and that schedule is re-evaluated at
its own ptxas count: whether the modeled gain held. Counts are counted; times are modeled.

    python -m bench.codegen.schedule_feedback --out docs/benchmarks.md [--targets h100] [--models a,b]
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.report import REPO, stamp, write_section

DATA = REPO / "hlo_fixtures" / "data"
TARGETS = ("v100", "a100", "h100")
SECTION = "bench-ptxas-feedback"


@dataclass
class Row:
    model: str
    target: str
    kernel: str
    estimate: int
    measured: int
    spills: int
    before_us: float            # the built schedule at ptxas's count
    after_us: float             # the revised winner at the corrected counts
    changed: bool
    before: str = ""
    after: str = ""
    rebuilt_registers: int = 0
    confirmed_us: float = 0.0   # the rebuilt schedule at its own ptxas count
    note: str = ""


def _assemble(graph, evaluator, schedule, name: str, arch: str, cache, worker):
    from stitch.codegen.gpu_cache import assemble_cached, emit_ptx_cached
    from stitch.codegen.lower import lower_kernel

    # in_place: as stitch.compiler builds kernels (atomic scatters add into their operand).
    lowered = lower_kernel(graph, evaluator, schedule, name, in_place=True)
    ptx = emit_ptx_cached(lowered.kernel, arch, cache=cache, worker=worker).ptx
    return assemble_cached(ptx, arch, cache=cache,
                           kernel_name=lowered.kernel.name).reports[lowered.kernel.name]


def collect(models: list[str], targets: tuple[str, ...], progress=lambda s: None
            ) -> tuple[list[Row], list[str]]:
    from stitch.codegen.cache import CompileCache
    from stitch.codegen.isolation import IsolatedWorker

    cache = CompileCache()
    rows: list[Row] = []
    problems: list[str] = []
    # One child process emits all PTX (a fresh one per kernel costs an import each).
    with IsolatedWorker(name="stitch-ptx") as worker:
        for target in targets:
            _collect_target(models, target, cache, worker, rows, problems, progress)
    return rows, problems


def _collect_target(models: list[str], target: str, cache, worker, rows: list[Row],
                    problems: list[str], progress) -> None:
    """Rows for every scheduled kernel of ``models`` on ``target`` (appended to ``rows``)."""
    import stitch
    from stitch.hlo import parse_hlo
    from stitch.hlo.evaluator.interpreter import Evaluator
    from stitch.compiler import arch_of
    from stitch.cost.gpu_specs import get_spec
    from stitch.schedule import schedule_kernel
    from stitch.schedule.ptxas_feedback import revise

    spec, arch = get_spec(target), arch_of(target)
    for model in models:
        path = DATA / model / f"full.gpu-{target}.hlo"
        if not path.exists():
            continue
        start = time.perf_counter()
        module = parse_hlo(path.read_text())
        evaluator = Evaluator(module)
        plan = stitch.plan(module, target)
        for g in plan.graphs:
            for k in g.stitched.kernels:
                if k.schedule is None:
                    continue
                name = k.name.replace(".", "_").replace("-", "_")
                try:
                    report = _assemble(g.graph, evaluator, k.schedule, name, arch, cache,
                                       worker)
                except Exception as exc:  # a row of the report, not a crash
                    problems.append(f"{model} {target} {k.name}: "
                                    f"{type(exc).__name__}: {exc}"[:200])
                    continue
                rev = revise(g.graph, k.schedule, spec, report.registers,
                             spills=report.spill_store_bytes + report.spill_load_bytes)
                row = Row(model, target, k.name, rev.estimate, rev.measured, rev.spills,
                          rev.before_us, rev.after_us, rev.changed,
                          " ".join(rev.before), " ".join(rev.after), note=rev.note)
                if rev.changed:
                    try:
                        again = _assemble(g.graph, evaluator, rev.schedule, name, arch,
                                          cache, worker)
                        row.rebuilt_registers = again.registers
                        plain = schedule_kernel(g.graph, k.members, spec, pin=rev.schedule)
                        held = schedule_kernel(
                            g.graph, k.members, spec, pin=rev.schedule,
                            register_scale=again.registers / max(plain.regs_estimate, 1))
                        row.confirmed_us = held.modeled_us
                    except Exception as exc:  # noqa: BLE001
                        row.note = f"rebuild: {type(exc).__name__}: {exc}"[:200]
                rows.append(row)
        progress(f"{model} {target}: {time.perf_counter() - start:.1f} s")


def markdown(rows: list[Row], problems: list[str], command: str, seconds: float) -> str:
    lines = ["## ptxas feedback: kernels rebuilt with another schedule (counted, modeled)", "",
             stamp(command) + f" {seconds:.0f} s.", "",
             "Every stitched kernel of every zoo model's full-size plan (from XLA's optimized "
             "HLO) is lowered, emitted as PTX and assembled by `ptxas -v` for the target's "
             "arch (counted registers; nothing ran on a GPU). Its schedule is then re-tuned "
             "with every candidate's register estimate scaled by ptxas's count over the "
             "model's estimate for the built schedule (`stitch/schedule/ptxas_feedback.py`); "
             "a kernel is rebuilt, once, when another schedule wins by more than the tuner's "
             "1% tie (modeled by the latency-evaluator). *Held*: the rebuilt kernel, assembled "
             "again and re-evaluated at its own ptxas count, is still faster than the first "
             "build at its count.", "",
             "| target | kernels | ptxas > estimate | ptxas < estimate | rebuilt | held | "
             "modeled µs of rebuilt kernels: first build → rebuilt (at ptxas counts) | "
             "spills |", "|---|---:|---:|---:|---:|---:|---|---:|"]
    for target in TARGETS:
        rs = [r for r in rows if r.target == target]
        if not rs:
            continue
        changed = [r for r in rs if r.changed]
        held = [r for r in changed if r.confirmed_us and r.confirmed_us < r.before_us]
        before = sum(r.before_us for r in changed)
        after = sum(r.confirmed_us or r.after_us for r in changed)
        times = f"{before:.1f} → {after:.1f}" if changed else "–"
        lines.append(f"| {target} | {len(rs)} | {sum(r.measured > r.estimate for r in rs)} | "
                     f"{sum(r.measured < r.estimate for r in rs)} | {len(changed)} | "
                     f"{len(held)} | {times} | {sum(r.spills > 0 for r in rs)} |")
    changed = [r for r in rows if r.changed]
    if changed:
        lines += ["", "Rebuilt kernels:", "",
                  "| model | target | kernel | estimate → ptxas | first build | rebuilt | "
                  "µs (first at ptxas → rebuilt at its ptxas) |",
                  "|---|---|---|---|---|---|---|"]
        for r in changed[:30]:
            lines.append(f"| {r.model} | {r.target} | {r.kernel} | {r.estimate} → "
                         f"{r.measured} | {r.before} | {r.after} (ptxas "
                         f"{r.rebuilt_registers}) | {r.before_us:.2f} → "
                         f"{(r.confirmed_us or r.after_us):.2f} |")
    notes = [f"{r.model} {r.target} {r.kernel}: {r.note}" for r in rows if r.note]
    if notes or problems:
        lines += ["", "Not revised:", ""] + [f"- {x}" for x in (notes + problems)[:20]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the section into this markdown file")
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--models", default="")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from stitch.models import list_models
    models = [m for m in (args.models.split(",") if args.models else list_models())
              if (DATA / m).is_dir()]
    start = time.perf_counter()
    rows, problems = collect(models, tuple(args.targets.split(",")),
                             lambda s: print(s, file=sys.stderr, flush=True))
    body = markdown(rows, problems, "python -m bench.codegen.schedule_feedback --out docs/benchmarks.md",
                    time.perf_counter() - start)
    if args.out:
        write_section(args.out, SECTION, body, after="regs-vs-ptxas")
    else:
        print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
