"""The benchmark report: ``python -m bench all --out docs/benchmarks.md``.

Sections (each also on its own: ``python -m bench plans planner ...``):

- ``plans``   stitch's plans vs XLA's real GPU fusion decisions, zoo × V100/A100/H100:
              kernels, HBM bytes, modeled time under stitch's latency-evaluator and under
              XLA's GpuPerformanceModel formulas, roofline floor (bench/plans.py);
- ``planner`` beam vs BLP objective and time, explorer time vs graph size (bench/plans.py);
- ``planner-scale`` planning ms per instruction over the zoo, the XLA corpus's real models and
              synthetic chains/graphs of 1k-32k ops, with the growth exponent (bench/planner.py);
- ``compile`` stitch.compiler.compile vs jax.jit's XLA compile per model (bench/compile_cost.py);
- ``runtime`` stitch.jit vs jax.jit step time on this CPU (bench/runtime.py);
- ``gpu``     placeholder for measurements on a GPU;
- ``corpus``  XLA's own HLO test modules through parse / round trip / evaluate / plan /
              compile + run, each stage under a timeout (bench/corpus.py; not part of
              ``all``: about 10 minutes; ``--limit``/``--stages`` for quick runs).

With ``--out`` every section replaces its own ``<!-- bench-NAME:begin/end -->`` block of the
file (re-read right before writing; other blocks untouched) and its plots go to
``docs/img/`` (``--img-dir``); ``all`` also writes the ``bench-overview`` block (headline
numbers, per-section and total run time). Without ``--out`` the markdown is printed.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Callable

from bench import plans as plans_mod
from bench.report import machine, stamp, write_section

SECTIONS = ("plans", "planner", "planner-scale", "compile", "runtime", "gpu", "gemm-chains")
EXTRA_SECTIONS = ("corpus", "layouts")  # run only when named
LEGACY = [("<!-- plan-report:start -->", "<!-- plan-report:end -->")]
TITLES = {
    "plans": "Stitched plans vs XLA's GPU fusion decisions (counted kernels and bytes, modeled time)",
    "planner": "Planner quality and cost (modeled objective, measured time)",
    "planner-scale": "Planning time at scale: ms per instruction (measured)",
    "compile": "Compile cost: stitch pipeline vs jax.jit's XLA compile (measured)",
    "runtime": "Step time on this CPU: stitch.jit vs jax.jit (measured)",
    "gpu": "On a GPU (measured)",
    "corpus": "XLA's own test modules through every stage (counted outcomes)",
    "layouts": "Layouts chosen with the schedules (ALT; modeled)",
    "gemm-chains": "GEMM chains and attention in one kernel vs XLA's kernels; schedule search "
                   "(modeled, search time measured)",
}


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Report:
    """Where sections and plots go, and what the run has measured so far."""

    def __init__(self, args: argparse.Namespace, command: str):
        self.args = args
        self.command = command
        self.out: Path | None = args.out
        self.img_dir: Path | None = args.img_dir or (args.out.parent / "img" if args.out else None)
        self.seconds: dict[str, float] = {}
        self.plan_rows: list[plans_mod.PlanRow] = []
        self.load: tuple[float, ...] = os.getloadavg()    # at the current section's start

    def image(self, name: str, draw: Callable[[Path], Path]) -> None:
        if self.img_dir is not None:
            draw(self.img_dir / f"{name}.png")

    def link(self, name: str) -> str | None:
        if self.img_dir is None or not (self.img_dir / f"{name}.png").exists():
            return None
        where = os.path.relpath(self.img_dir / f"{name}.png",
                                self.out.parent if self.out else Path.cwd())
        return f"![{name}]({where})"

    def write(self, name: str, lines: list[str], seconds: float | None = None) -> None:
        head = [f"## {TITLES[name]}", "", stamp(self.command, self.load)
                + (f" Section run time {seconds:.0f} s (measured)." if seconds else ""), ""]
        body = "\n".join(head + lines)
        if self.out is None:
            print(body + "\n")
            return
        write_section(self.out, f"bench-{name}", body, after="bench-overview",
                      remove=LEGACY if name == "plans" else ())
        log(f"wrote section bench-{name} of {self.out}")


def run_plans(report: Report) -> None:
    args = report.args
    names = args.models or plans_mod.models()
    start = time.perf_counter()
    rows = plans_mod.collect_plans(names, args.targets, log)
    report.plan_rows = rows
    from bench import plots
    report.image("plans_ratios", lambda p: plots.plans_ratios(rows, p))
    report.image("plans_roofline", lambda p: plots.plans_roofline(rows, p))
    seconds = time.perf_counter() - start
    report.seconds["plans"] = seconds
    report.write("plans", plans_mod.plans_markdown(rows, report.link), seconds)


def run_planner(report: Report) -> None:
    args = report.args
    start = time.perf_counter()
    lines: list[str] = []
    if not args.skip_blp:
        names = args.models or plans_mod.models()
        rows = plans_mod.collect_blp(names, "h100", args.blp_time_limit, log)
        lines += plans_mod.blp_markdown(rows, "h100", args.blp_time_limit) + [""]
    points = plans_mod.collect_scaling([int(s) for s in args.sizes.split(",")], log)
    from bench import plots
    report.image("planner_scaling", lambda p: plots.planner_scaling(points, p))
    lines += plans_mod.scaling_markdown(points, report.link)
    seconds = time.perf_counter() - start
    report.seconds["planner"] = seconds
    report.write("planner", lines, seconds)


def run_planner_scale(report: Report) -> None:
    from bench import planner as scale
    args = report.args
    start = time.perf_counter()
    rows = scale.collect(args.scale_limit, tuple(int(x) for x in args.chains.split(",") if x),
                         progress=log, corpus=args.corpus_dir)
    seconds = time.perf_counter() - start
    report.seconds["planner-scale"] = seconds
    report.write("planner-scale", scale.markdown(rows, args.scale_limit), seconds)


def run_compile(report: Report) -> None:
    from bench import compile_cost
    start = time.perf_counter()
    reason = compile_cost._available()
    if reason:
        report.write("compile", [f"**Not measured: {reason}.**"])
        return
    rows = compile_cost.collect(report.args.zoo_models, progress=log)
    ok = [(r.model, r.stitch_s, r.jax_s) for r in rows if not r.error]
    if ok:
        from bench import plots
        report.image("compile_times", lambda p: plots.compile_times(ok, p))
    seconds = time.perf_counter() - start
    report.seconds["compile"] = seconds
    report.write("compile", compile_cost.markdown(rows, report.link), seconds)


def run_runtime(report: Report) -> None:
    from bench import runtime
    start = time.perf_counter()
    reason = runtime.unavailable()
    rows = None
    if not reason:
        rows = runtime.collect(report.args.zoo_models, progress=log)
        ok = [(f"{r.model} ({r.config})", (r.forced_s or r.stitch_s) / r.jax_s) for r in rows
              if not r.error and r.jax_s > 0]
        if ok:
            from bench import plots
            report.image("runtime_ratios", lambda p: plots.runtime_ratios(ok, p))
    else:
        log(f"runtime: {reason}")
    seconds = time.perf_counter() - start
    report.seconds["runtime"] = seconds
    report.write("runtime", runtime.markdown(rows, reason, report.link),
                 seconds if rows is not None else None)


def run_gpu(report: Report) -> None:
    report.write("gpu", [
        "**No GPU was lent for these measurements**: every time in this report is either "
        "modeled or measured on the CPU named above. This section is for a session that has a "
        "GPU: kernel times of the stitched kernels (CUDA FFI handler, `stitch.jit(fn)` on "
        "`device=\"gpu\"`) against XLA GPU's own kernels, per zoo model, and the step time of "
        "the whole function against `jax.jit`, next to the modeled numbers above. Ready to run "
        "there in one call: `tests/gpu/` and `python3 -m bench.opt_levels time --dir "
        ".gpu_bench` (the pass's kernels under three LLVM pipelines, prepared here by "
        "`python -m bench.opt_levels prepare`; the `bench-opt-levels` section)."])


def run_corpus(report: Report) -> None:
    from bench import corpus
    args = report.args
    start = time.perf_counter()
    results = corpus.run_corpus(args.corpus, tuple(args.stages), args.limit, args.size_cap,
                                args.timeout, progress=log, budget=args.budget)
    seconds = time.perf_counter() - start
    report.seconds["corpus"] = seconds
    report.write("corpus", corpus.summary_markdown(results, tuple(args.stages), "", seconds),
                 seconds)


def run_gemm_chains(report: Report) -> None:
    from bench import gemm_chains
    args = report.args
    start = time.perf_counter()
    targets = tuple(t for t in args.targets if t in gemm_chains.TARGETS) or gemm_chains.TARGETS
    rows = gemm_chains.collect(None, targets, log)
    search = gemm_chains.search_rows(targets, log)
    seconds = time.perf_counter() - start
    report.seconds["gemm-chains"] = seconds
    report.write("gemm-chains", gemm_chains.markdown(rows, search), seconds)


RUNNERS = {"gemm-chains": run_gemm_chains, "plans": run_plans, "planner": run_planner, "planner-scale": run_planner_scale,
           "compile": run_compile, "runtime": run_runtime, "gpu": run_gpu,
           "corpus": run_corpus, "layouts": lambda r: __import__("bench.layouts").layouts.run(r)}


def overview(report: Report, total_s: float) -> list[str]:
    """Headline numbers of an ``all`` run and where its time went."""
    lines = [f"## Benchmark report: overview", "", stamp(report.command), ""]
    rows = report.plan_rows
    if rows:
        train = [r for r in rows if r.model in plans_mod.TRAINING]
        lines += ["Over the zoo's training graphs (" + ", ".join(plans_mod.TRAINING) + "), "
                  "stitch's plan against XLA's own fusions (kernels and bytes counted, times "
                  "modeled; details in the sections below):", "",
                  "| target | mem kernels | mem HBM bytes | mem time, latency-evaluator | "
                  "mem time, XLA formula |", "|---|---:|---:|---:|---:|"]
        for target in report.args.targets:
            t = plans_mod.Totals([r for r in train if r.target == target])
            if not t.rows:
                continue
            k, b, lat, f = (t.sum(a) for a in ("mem_kernels", "mem_bytes", "latency_us",
                                               "formula_us"))
            lines.append(f"| {target} | {k[1] / k[0]:.2f}× | {b[1] / b[0]:.2f}× | "
                         f"{lat[0] / lat[1]:.2f}× faster | {f[0] / f[1]:.2f}× faster |")
        lines.append("")
    lines += ["Run time (measured): " + ", ".join(f"{n} {s:.0f} s" for n, s in
                                                  report.seconds.items())
              + f"; all together {total_s / 60:.1f} min on {machine()}."]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("sections", nargs="+", choices=("all", *SECTIONS, *EXTRA_SECTIONS))
    parser.add_argument("--out", type=Path, help="markdown file whose bench-* sections to replace")
    parser.add_argument("--img-dir", type=Path, help="plots (default: img/ next to --out)")
    parser.add_argument("--models", type=lambda s: s.split(","),
                        help="fixture models for plans/planner (default: every zoo fixture)")
    parser.add_argument("--zoo-models", type=lambda s: s.split(","),
                        help="zoo models for compile/runtime (default: all)")
    parser.add_argument("--targets", type=lambda s: tuple(s.split(",")), default=plans_mod.TARGETS)
    parser.add_argument("--sizes", default="1000,2000,4000,8000,16000",
                        help="synthetic graph sizes (ops) for the explorer scaling run")
    parser.add_argument("--blp-time-limit", type=float, default=60.0)
    parser.add_argument("--skip-blp", action="store_true")
    parser.add_argument("--scale-limit", type=float, default=60.0,
                        help="planner-scale: seconds per module before it is cut off")
    parser.add_argument("--chains", default="1000,2000,4000,8000,16000,32000",
                        help="planner-scale: chain / synthetic graph sizes (ops)")
    parser.add_argument("--corpus-dir", type=Path, default=None,
                        help="planner-scale: the extracted xla_hlo_corpus directory")
    from bench import corpus
    corpus.add_arguments(parser)
    args = parser.parse_args(argv)
    sections = list(SECTIONS) if "all" in args.sections else list(dict.fromkeys(args.sections))
    shown = " ".join(a for a in (argv if argv is not None else sys.argv[1:]))
    report = Report(args, f"python -m bench {shown}")
    start = time.perf_counter()
    for name in sections:
        log(f"section {name}")
        report.load = os.getloadavg()
        RUNNERS[name](report)
    total = time.perf_counter() - start
    if "all" in args.sections:
        body = "\n".join(overview(report, total))
        if args.out:
            write_section(args.out, "bench-overview", body)
        else:
            print(body)
    log(f"done in {total:.0f} s")


if __name__ == "__main__":
    main()
