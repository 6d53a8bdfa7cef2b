"""The GPU kernels' LLVM build CPU: the IR as written against the lean IR stitch builds
(``KernelEmitter(simplify=True)``, the collector paused while the IR is built), with the
"same code" check.

Per module: its plan's distinct kernels (``gpu_cache.distinct_kernels``) lowered for the
H100 as ``stitch.compile`` lowers them, each built for sm_90 both ways in turn, in this one
process (other processes share the machine: alternating the two builds kernel by kernel
lets both meet the same load). Seconds are this process's CPU: *IR* is the Python that
writes the LLVM IR text, *LLVM* the rest of ``emit_ptx`` (parse, libdevice, O3, NVPTX
codegen); per kernel the fastest of ``--reps`` runs, and the mean total of a run (where
the collector's pauses show: a full collection lands on some runs only). *same PTX*:
kernels whose PTX text is equal; where it differs, *same code* compares ptxas's machine
code (the cubin's .text), which must be equal.

``python -m bench.codegen.llvm_build_cpu [--hlo PATH ...] [--reps 3] [--out docs/benchmarks.md]``
(default modules: the zoo's full-size transformer_train and bert_layer_train_bf16 GPU
modules; a module the XLA pass dumped, ``STITCH_DUMP_MODULES``, plans the same way).
"""
from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

from bench.report import REPO, stamp, write_section

DATA = REPO / "hlo_fixtures" / "data"
SECTION = "bench-codegen-llvm-build-cpu"
ARCH = "sm_90"
DEFAULT_MODULES = (DATA / "transformer_train" / "full.gpu-h100.hlo",
                   DATA / "bert_layer_train_bf16" / "full.gpu-h100.hlo")


def planned_kernels(path: Path) -> list:
    """The distinct kernels of ``path``'s H100 plan, lowered (GEMM chains as planned)."""
    from stitch.codegen.errors import CodegenError
    from stitch.codegen.gpu_cache import distinct_kernels
    from stitch.codegen.lower import lower_kernel
    from stitch.explorer.planner import plan
    from stitch.hlo import parse_hlo
    from stitch.hlo.evaluator.interpreter import Evaluator
    from stitch.schedule.chain_tiling import lower_planned_chain

    module = parse_hlo(path.read_text())
    evaluator = Evaluator(module)
    kernels = []
    for graph_plan in plan(module, "h100").graphs:
        for k in graph_plan.stitched.kernels:
            try:
                if k.kind == "gemm_chain":
                    kernels.append(lower_planned_chain(graph_plan.graph, k, ARCH).kernel)
                elif k.schedule is not None:
                    kernels.append(lower_kernel(graph_plan.graph, evaluator, k.schedule,
                                                k.name, in_place=True).kernel)
            except CodegenError:
                continue            # stitch.compile's fallback: not built
    return distinct_kernels(kernels)[0]


@contextlib.contextmanager
def as_written(on: bool):
    """The build as it was before the lean IR: every operation emitted, the collector
    left running while the IR is built."""
    from stitch.codegen import nvptx
    if not on:
        yield {}
        return
    paused = nvptx.collector_paused
    nvptx.collector_paused = contextlib.nullcontext
    try:
        yield {"simplify": False}
    finally:
        nvptx.collector_paused = paused


def measure(path: Path, reps: int) -> dict:
    from stitch.codegen import nvptx
    kernels = planned_kernels(path)
    nvptx.warm_up()
    ways = (True, False)                      # as written, lean
    best = {w: [float("inf")] * len(kernels) for w in ways}
    totals = {w: 0.0 for w in ways}
    ptx: dict[bool, list[str]] = {w: [""] * len(kernels) for w in ways}
    for rep in range(reps):
        for i, kernel in enumerate(kernels):
            for way in (ways if rep % 2 == 0 else ways[::-1]):
                with as_written(way) as kwargs:
                    start = time.process_time()
                    ptx[way][i] = nvptx.emit_ptx(kernel, ARCH, **kwargs)
                    seconds = time.process_time() - start
                best[way][i] = min(best[way][i], seconds)
                totals[way] += seconds
    same_ptx = sum(a == b for a, b in zip(ptx[True], ptx[False]))
    same_code = same_ptx + sum(_same_machine_code(k, a, b) for k, a, b
                               in zip(kernels, ptx[True], ptx[False]) if a != b)
    resolved = path.resolve()
    return {"module": resolved.parent.name if resolved.parent.parent == DATA.resolve()
            else path.name, "kernels": len(kernels), "same_ptx": same_ptx,
            "same_code": same_code, "old_best": sum(best[True]), "new_best": sum(best[False]),
            "old_mean": totals[True] / reps, "new_mean": totals[False] / reps}


def _same_machine_code(kernel, a: str, b: str) -> bool:
    from stitch.codegen.objcheck import cubin_code
    from stitch.codegen.toolchain import assemble_cubin
    codes = [cubin_code(assemble_cubin(p, ARCH, kernel_name=kernel.name)[0], kernel.name)
             for p in (a, b)]
    return codes[0] is not None and codes[0] == codes[1]


def markdown(rows: list[dict], command: str, reps: int, seconds: float,
             load: tuple[float, ...]) -> str:
    # No heading: `python -m bench codegen --part llvm-build-cpu` gives the part's.
    lines = [stamp(command, load) + f" Run time {seconds:.0f} s.", "",
             "Each module's plan for the H100, its distinct kernels lowered and built for sm_90 "
             "in one process, both ways in turn per kernel. *as written*: every operation "
             "emitted, Python's collector running while the IR is built (the build before "
             "the lean IR); *lean*: pure operations emitted once per basic block, integer "
             "identities left out, the collector paused (`KernelEmitter(simplify=True)`, "
             "`nvptx.collector_paused`). CPU seconds of `emit_ptx` in this process (the "
             "IR's Python, parse, libdevice, O3, NVPTX codegen) summed over the kernels: "
             f"*fastest*: each kernel's fastest of {reps} runs; *mean run*: a whole run's "
             "total, averaged (the collector's full collections land on some runs only, "
             "which the fastest run leaves out). *same PTX* / *same code*: kernels whose PTX "
             "/ machine code (ptxas's cubin .text, compared where the PTX differs) is the "
             "as-written build's.", "",
             "| module | kernels | fastest s as written → lean | mean run s as written → lean "
             "| same PTX | same code |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['module']} | {r['kernels']} | {r['old_best']:.2f} → {r['new_best']:.2f} "
            f"({_less(r['old_best'], r['new_best'])}) | {r['old_mean']:.2f} → "
            f"{r['new_mean']:.2f} ({_less(r['old_mean'], r['new_mean'])}) | "
            f"{r['same_ptx']}/{r['kernels']} | {r['same_code']}/{r['kernels']} |")
    return "\n".join(lines)


def _less(old: float, new: float) -> str:
    change = (old - new) / old if old else 0.0
    return f"{change:.0%} less" if change >= 0 else f"{-change:.0%} more"


def main(argv: list[str] | None = None) -> None:
    import os
    parser = argparse.ArgumentParser(prog="python -m bench.codegen.llvm_build_cpu")
    parser.add_argument("--hlo", type=Path, nargs="+", default=list(DEFAULT_MODULES))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    load, start = os.getloadavg(), time.perf_counter()
    rows = [measure(path, args.reps) for path in args.hlo]
    command = "python -m bench.codegen.llvm_build_cpu" + \
        ("" if args.hlo == list(DEFAULT_MODULES) else " --hlo " + " ".join(map(str, args.hlo))) + \
        (f" --reps {args.reps}" if args.reps != 3 else "") + \
        (f" --out {args.out}" if args.out else "")
    text = markdown(rows, command, args.reps, time.perf_counter() - start, load)
    if args.out:
        write_section(args.out, SECTION, text)
    print(text)


if __name__ == "__main__":
    main()
