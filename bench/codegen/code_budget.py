"""What the GPU pass's code budget (stitch/xla_pass/code_budget.py) does to the zoo's plans:
per model, the stitched kernels over the budget, the Kernel IR statements as tuned and as
built, and the modeled µs both ways (counted statements, modeled time).

``python -m bench.codegen.code_budget [--target h100] [--models a,b] [--out docs/benchmarks.md]``
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.report import REPO, stamp, write_section

DATA = REPO / "hlo_fixtures" / "data"

SECTION = "bench-code-budget"


ARCH = {"v100": "sm_70", "a100": "sm_80", "h100": "sm_90"}


def _build_seconds(kernel, arch: str) -> float:
    """Wall seconds of the kernel's GPU build, one at a time in this process: PTX through
    LLVM (O3, NVPTX), then ptxas."""
    from stitch.codegen.nvptx import emit_ptx
    from stitch.codegen.toolchain import assemble_cubin
    start = time.perf_counter()
    assemble_cubin(emit_ptx(kernel, arch), arch, kernel_name=kernel.name)
    return time.perf_counter() - start


def measure(model: str, target: str, config: str = "full", build: bool = False) -> dict:
    """The budget applied to every scheduled block-scope kernel of the model's plan;
    ``build``: the narrowed kernels' GPU builds timed both ways."""
    from stitch.codegen.errors import CodegenError
    from stitch.codegen.lower import lower_kernel
    from stitch.hlo import parse_hlo
    from stitch.hlo.evaluator.interpreter import Evaluator
    from stitch.xla_pass import code_budget
    from stitch.cost.gpu_specs import get_spec
    from stitch.errors import StitchError
    from stitch.explorer.planner import plan as make_plan

    module = parse_hlo((DATA / model / f"{config}.gpu-{target}.hlo").read_text())
    fusion_plan = make_plan(module, target)
    evaluator, spec = Evaluator(module), get_spec(target)
    row = {"model": model, "config": config, "kernels": 0, "narrowed": 0, "tuned_statements": 0,
           "built_statements": 0, "tuned_us": 0.0, "built_us": 0.0, "failed": 0,
           "tuned_build_s": 0.0, "built_build_s": 0.0}
    for graph_plan in fusion_plan.graphs:
        graph = graph_plan.graph
        for k in graph_plan.stitched.kernels:
            if k.schedule is None or not hasattr(k.schedule, "parts"):
                continue

            def lower(schedule, graph=graph, name=k.name):
                return lower_kernel(graph, evaluator, schedule, name, in_place=True)
            try:
                tuned = lower(k.schedule)
                # The tuned schedule's lowering is the one just made, not a second one.
                built, narrowed = code_budget.lower_within_budget(
                    graph, k.schedule, spec, k.name,
                    lambda s, tuned=tuned, k=k, lower=lower: tuned if s is k.schedule
                    else lower(s))
            except (CodegenError, StitchError):
                row["failed"] += 1
                continue
            row["kernels"] += 1
            row["tuned_statements"] += code_budget.statements(tuned.kernel)
            row["built_statements"] += code_budget.statements(built.kernel)
            row["tuned_us"] += k.schedule.modeled_us
            row["built_us"] += narrowed.narrow_modeled_us if narrowed else k.schedule.modeled_us
            row["narrowed"] += narrowed is not None
            if build and narrowed is not None:
                row["tuned_build_s"] += _build_seconds(tuned.kernel, ARCH[target])
                row["built_build_s"] += _build_seconds(built.kernel, ARCH[target])
    return row


def markdown(rows: list[dict], command: str, target: str, seconds: float,
             build: bool = False) -> str:
    from stitch.xla_pass.code_budget import CODE_BUDGET, CODE_TOLERANCE
    lines = ["## Code budget on the GPU path: kernels built narrower (counted statements, "
             "modeled time)", "", stamp(command) + f" Run time {seconds:.0f} s.", "",
             f"Every scheduled block-scope stitched kernel of the zoo's `<config>.gpu-{target}` "
             f"plans (the XLA GPU modules of the full-size and the tiny configurations), lowered as tuned and through `stitch.xla_pass.code_budget` (budget "
             f"{CODE_BUDGET} Kernel IR statements, tolerance {CODE_TOLERANCE:.0%} of the "
             f"kernel's modeled time). Statements are summed over the kernels; µs are the "
             f"latency-evaluator's, summed.", "",
             "| model | config | kernels | narrowed | statements tuned | statements built | "
             "modeled µs tuned | modeled µs built | change |"
             + (" narrowed kernels' build s, tuned → built |" if build else ""),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if build else "")]
    for r in rows:
        if not r["kernels"]:
            continue
        change = r["built_us"] / r["tuned_us"] - 1 if r["tuned_us"] else 0.0
        lines.append(f"| {r['model']} | {r['config']} | {r['kernels']} | {r['narrowed']} | "
                     f"{r['tuned_statements']:,} | {r['built_statements']:,} | "
                     f"{r['tuned_us']:.1f} | {r['built_us']:.1f} | {change:+.2%} |"
                     + (f" {r['tuned_build_s']:.1f} → {r['built_build_s']:.1f} |" if build
                        and r["narrowed"] else (" — |" if build else "")))
    empty = [r for r in rows if not r["kernels"]]
    narrowed = sum(r["narrowed"] for r in rows)
    lines += ["", f"{narrowed} of {sum(r['kernels'] for r in rows)} kernels narrowed; "
              f"{len(empty)} model configurations have no block-scope stitched kernel "
              "(GEMM chains only, or none) and are left out."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.codegen.code_budget")
    parser.add_argument("--target", default="h100")
    parser.add_argument("--models", type=lambda s: s.split(","))
    parser.add_argument("--configs", type=lambda s: s.split(","), default=["full", "tiny"])
    parser.add_argument("--build", action="store_true",
                        help="time the narrowed kernels' PTX + ptxas both ways")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    models = args.models or sorted(p.name for p in DATA.iterdir()
                                   if (p / f"full.gpu-{args.target}.hlo").is_file())
    start = time.perf_counter()
    rows = [measure(m, args.target, c, args.build) for m in models for c in args.configs
            if (DATA / m / f"{c}.gpu-{args.target}.hlo").is_file()]
    command = "python -m bench.codegen.code_budget" + (f" --target {args.target}"
                                               if args.target != "h100" else "") + \
        (" --build" if args.build else "") + (f" --out {args.out}" if args.out else "")
    text = markdown(rows, command, args.target, time.perf_counter() - start, args.build)
    if args.out:
        write_section(args.out, SECTION, text)
    print(text)


if __name__ == "__main__":
    main()
