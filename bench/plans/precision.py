"""bf16 mixed-precision training steps (stitch/models/mixed_precision.py) next to their f32
models: plans, memory-intensive bytes against XLA and the one-kernel bound, modeled time,
and the accuracy of the stitched kernels on the host.

Plans come from the committed XLA-optimized fixtures (hlo_fixtures/data/<model>/full.gpu-*.hlo),
measured exactly as ``python -m bench plans`` does (bench/plans/zoo.py ``plan_model``): kernels
and bytes are counted, times modeled by the latency-evaluator. Errors: each tiny config is
compiled for h100 (``stitch.compiler.compile``, poisoned outputs), run on the host with fresh
random inputs and compared with the reference evaluator and with jax (measured).

    python -m bench.plans.precision --out docs/benchmarks.md [--targets h100] [--no-errors]
"""
from __future__ import annotations

import argparse
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.plans.zoo import TARGETS, TRAINING, PlanRow, plan_model
from bench.report import ratio, stamp, write_section

SECTION = "bench-bf16"
SUFFIX = "_bf16"
BF16_TOLERANCE = 2e-2     # tests/fixtures.py: the rule the tests apply


@dataclass
class ErrorRow:
    model: str
    kernels: int
    fallbacks: int
    vs_evaluator: float     # worst relative error over the outputs
    vs_jax: float


def _relative(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm((a - b).ravel()) / max(np.linalg.norm(b.ravel()), 1e-5))


def host_errors(models: list[str], target: str = "h100") -> list[ErrorRow]:
    import jax

    from stitch.hlo import evaluate
    from stitch import compiler
    from stitch.models import build
    from hlo_fixtures import zoo_fixture

    rows = []
    for model in models:
        exe = compiler.compile(zoo_fixture(model, "tiny", "pre").read_text(), target,
                               poison_outputs=True)
        inst = build(model, "tiny")
        args = inst.random_args(zlib.crc32(model.encode()))
        got = exe(*args)
        ref = evaluate(exe.module, args)
        want = jax.tree_util.tree_leaves(jax.jit(inst.fn)(*args))
        rows.append(ErrorRow(model, len(exe.kernels), len(exe.fallbacks),
                             max(_relative(g, r) for g, r in zip(got, ref)),
                             max(_relative(g, w) for g, w in zip(got, want))))
    return rows


def _cells(r: PlanRow) -> str:
    x, s = r.xla, r.stitch
    return (f"{x.mem_kernels} → {s.mem_kernels} | {x.mem_bytes / 1e6:.0f} | "
            f"{s.mem_bytes / 1e6:.0f} | {r.bytes_bound / 1e6:.0f} | "
            f"{ratio(s.mem_bytes, x.mem_bytes)} | {ratio(s.mem_bytes, r.bytes_bound)} | "
            f"{ratio(x.mem_bytes, r.bytes_bound)} | {x.latency_us:.0f} → {s.latency_us:.0f} "
            f"({ratio(x.latency_us, s.latency_us)}) |")


def markdown(rows: list[PlanRow], errors: list[ErrorRow], command: str, seconds: float) -> str:
    lines = ["## bf16 mixed-precision training steps: plans and bytes "
             "(counted), time (modeled), errors (measured)", "",
             stamp(command) + f" {seconds:.0f} s.", "",
             "`<model>_bf16` = the f32 training step with bf16 activations and gradients and "
             "f32 master weights (params cast to bf16 for the forward, gradients back to f32 "
             "for the SGD update; `stitch/models/mixed_precision.py`). Plans from XLA's "
             "optimized HLO for each target, measured as in the plans section: mem = "
             "memory-intensive kernels; bound = the mem bytes if every mem op of each graph "
             "were one kernel; µs = the latency-evaluator's mem time, XLA → stitch "
             "(speed-up).", ""]
    head = ("| model | mem kernels | XLA MB | stitch MB | bound MB | stitch/XLA | "
            "stitch/bound | XLA/bound | mem µs |")
    for target in TARGETS:
        rs = [r for r in rows if r.target == target]
        if not rs:
            continue
        lines += [f"#### {target.upper()}", "", head,
                  "|---|---|---:|---:|---:|---:|---:|---:|---|"]
        for r in rs:
            lines.append(f"| {r.model} | " + _cells(r))
        for label, pick in (("sum f32", lambda m: not m.endswith(SUFFIX)),
                            ("sum bf16", lambda m: m.endswith(SUFFIX))):
            part = [r for r in rs if pick(r.model)]
            if not part:
                continue
            total = PlanRow("", target, type(part[0].xla)(), type(part[0].stitch)(), 0.0)
            for r in part:
                for side, src in ((total.xla, r.xla), (total.stitch, r.stitch)):
                    side.mem_kernels += src.mem_kernels
                    side.mem_bytes += src.mem_bytes
                    side.latency_us += src.latency_us
                total.bytes_bound += r.bytes_bound
            lines.append(f"| **{label}** | " + _cells(total))
        pairs = [(a, b) for a in rs for b in rs if b.model == a.model + SUFFIX]
        if pairs:
            lines += ["", "bf16 / f32 stitched mem bytes: " + ", ".join(
                f"{a.model} {ratio(b.stitch.mem_bytes, a.stitch.mem_bytes)}"
                for a, b in pairs) + "; mem µs: " + ", ".join(
                f"{a.model} {ratio(b.stitch.latency_us, a.stitch.latency_us)}"
                for a, b in pairs) + ".", ""]
    if errors:
        lines += ["#### Accuracy on the host (tiny configs, h100 plans, measured)", "",
                  f"Tolerance rule (the tests' `BF16_TOLERANCE`): relative error "
                  f"‖out − ref‖/‖ref‖ ≤ {BF16_TOLERANCE:g} for modules that compute in bf16 "
                  "(8 significant bits, unit roundoff 2^-9; XLA rounds every bf16 result, so "
                  "evaluations rounding at other points differ by a few roundoffs: 2e-2 is "
                  "about ten); 1e-4 for the f32 models.", "",
                  "| model | stitched kernels | through the evaluator | vs evaluator | "
                  "vs jax |", "|---|---:|---:|---:|---:|"]
        for e in errors:
            lines.append(f"| {e.model} | {e.kernels} | {e.fallbacks} | {e.vs_evaluator:.1e} | "
                         f"{e.vs_jax:.1e} |")
        if any(e.fallbacks for e in errors):
            lines += ["", "Through the evaluator: kernels codegen refused (the compile log "
                      "names each with its reason)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the section into this markdown file")
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--no-errors", action="store_true", help="skip the host runs")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    models = [m for base in TRAINING for m in (base, base + SUFFIX)]
    rows = []
    for target in args.targets.split(","):
        for model in models:
            rows.append(plan_model(model, target))
            print(f"{model} {target}: {rows[-1].plan_s:.1f} s", file=sys.stderr, flush=True)
    errors = [] if args.no_errors else host_errors(
        [m for m in models if not m.startswith("transformer")])
    body = markdown(rows, errors, "python -m bench.plans.precision --out docs/benchmarks.md",
                    time.perf_counter() - start)
    if args.out:
        write_section(args.out, SECTION, body, after="bench-scatter")
    else:
        print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
