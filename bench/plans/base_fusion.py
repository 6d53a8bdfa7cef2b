"""Kernels of the base fusion (on pre-optimization HLO) against XLA GPU's own (optimized HLO).

    python -m bench.plans.base_fusion [--config full]

For every zoo model: the groups ``base_fusion`` makes on each graph of ``<config>.pre.hlo``
(entry, loop bodies and conditions, branches), without and with ``row_fusion``, and the
kernels ``count_kernels`` finds in ``<config>.gpu-{v100,a100,h100}.hlo``; static counts (a
loop body's kernels count once). "memory" kernels are those without a GEMM/convolution or
opaque op, as ``count_kernels`` splits them.
"""
from __future__ import annotations

import argparse
import math
import pathlib
import platform
import time
from dataclasses import dataclass
from typing import Callable

from stitch.hlo import parse_hlo
from stitch.hlo.base_fusion import base_fusion
from stitch.hlo.graph import build_op_graphs
from stitch.hlo.kernels import count_kernels
from stitch.hlo.op_classes import is_kernel_boundary
from hlo_fixtures import DATA, GPU_TARGETS


@dataclass
class Row:
    model: str
    base: tuple[int, int]                  # (total, memory)
    rows: tuple[int, int]                  # the same with row_fusion
    xla: dict[str, tuple[int, int]]        # target -> (total, memory)
    seconds: float                         # base fusion time, all graphs


def base_counts(path: pathlib.Path, row_fusion: bool) -> tuple[tuple[int, int], float]:
    graphs = build_op_graphs(parse_hlo(path.read_text()))
    start = time.perf_counter()
    total = memory = 0
    for g in graphs:
        for group in base_fusion(g, row_fusion=row_fusion):
            total += 1
            memory += not any(is_kernel_boundary(g.nodes[i].op_class) for i in group)
    return (total, memory), time.perf_counter() - start


def measure(model_dir: pathlib.Path, config: str) -> Row | None:
    pre = model_dir / f"{config}.pre.hlo"
    if not pre.exists():
        return None
    base, seconds = base_counts(pre, row_fusion=False)
    rows, _ = base_counts(pre, row_fusion=True)
    xla = {}
    for target in GPU_TARGETS:
        summary = count_kernels(parse_hlo((model_dir / f"{config}.gpu-{target}.hlo").read_text()))
        xla[target] = (summary.count(), summary.count("memory"))
    return Row(model_dir.name, base, rows, xla, seconds)


def ratio(ours: int, theirs: int) -> float | None:
    return ours / theirs if theirs else None


def fmt_ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def geomean(values: list[float]) -> float | None:
    values = [v for v in values if v]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def table(rows: list[Row]) -> list[str]:
    targets = " | ".join(f"XLA {t.upper()} (total / mem)" for t in GPU_TARGETS)
    lines = [f"| model | base (total / mem) | base+rows (total / mem) | {targets} "
             "| base / XLA H100 (mem) | base+rows / XLA H100 (mem) | base / XLA V100 (mem) |",
             "|---|---:|---:|" + "---:|" * len(GPU_TARGETS) + "---:|---:|---:|"]

    def ratios(base: int, rows_: int, xla: dict[str, tuple[int, int]]) -> str:
        return (f"{fmt_ratio(ratio(base, xla['h100'][1]))} "
                f"| {fmt_ratio(ratio(rows_, xla['h100'][1]))} "
                f"| {fmt_ratio(ratio(base, xla['v100'][1]))}")

    for r in rows:
        xla = " | ".join(f"{r.xla[t][0]} / {r.xla[t][1]}" for t in GPU_TARGETS)
        lines.append(f"| {r.model} | {r.base[0]} / {r.base[1]} | {r.rows[0]} / {r.rows[1]} "
                     f"| {xla} | {ratios(r.base[1], r.rows[1], r.xla)} |")
    base = (sum(r.base[0] for r in rows), sum(r.base[1] for r in rows))
    with_rows = (sum(r.rows[0] for r in rows), sum(r.rows[1] for r in rows))
    xla_total = {t: (sum(r.xla[t][0] for r in rows), sum(r.xla[t][1] for r in rows))
                 for t in GPU_TARGETS}
    xla = " | ".join(f"{xla_total[t][0]} / {xla_total[t][1]}" for t in GPU_TARGETS)
    lines.append(f"| **total** | {base[0]} / {base[1]} | {with_rows[0]} / {with_rows[1]} "
                 f"| {xla} | {ratios(base[1], with_rows[1], xla_total)} |")
    means = [geomean([ratio(ours(r), r.xla[t][1]) for r in rows])
             for ours, t in ((lambda r: r.base[1], "h100"), (lambda r: r.rows[1], "h100"),
                             (lambda r: r.base[1], "v100"))]
    lines.append("| **geometric mean** (models where both counts > 0) | | "
                 + "| " * len(GPU_TARGETS) + " | ".join(map(fmt_ratio, means)) + " |")
    return lines


def within(rows: list[Row], ours: Callable[[Row], int], target: str,
           tolerance: float = 0.3) -> str:
    """How many models' memory-kernel counts are within ±tolerance of XLA's (of the models
    where either side has memory kernels)."""
    both = [r for r in rows if r.xla[target][1] or ours(r)]
    close = [r for r in both
             if r.xla[target][1] and abs(ours(r) / r.xla[target][1] - 1) <= tolerance]
    return f"{len(close)}/{len(both)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="full", help="fixture config (full or tiny)")
    args = parser.parse_args()
    models = sorted(p for p in DATA.iterdir() if p.is_dir() and p.name != "tf")
    rows = [r for r in (measure(m, args.config) for m in models) if r is not None]
    print(f"machine: {platform.processor() or platform.machine()}, "
          f"Python {platform.python_version()}; config {args.config}, {len(rows)} models")
    for line in table(rows):
        print(line)
    print()
    base, with_rows = (lambda r: r.base[1]), (lambda r: r.rows[1])
    print("memory kernels within ±30% of XLA's: "
          + ", ".join(f"{t.upper()}: base {within(rows, base, t)}, "
                      f"base+rows {within(rows, with_rows, t)}" for t in GPU_TARGETS))
    slowest = max(rows, key=lambda r: r.seconds)
    print(f"base fusion time: {sum(r.seconds for r in rows) * 1e3:.0f} ms for all models, "
          f"slowest {slowest.model} {slowest.seconds * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
