"""stitch's latency-evaluator against XLA's own per-fusion estimates (both modeled).

    python -m bench.plans.estimates [--targets h100,a100,v100] [--models a,b] [--out FILE]

For every zoo model with ``hlo_fixtures/data/xla_costs/<model>.full.<target>.json`` (XLA's own
estimate of each final fusion, see docs/xla_costs.md), each memory-intensive XLA fusion of
``hlo_fixtures/data/<model>/full.gpu-<target>.hlo`` is paired with

- stitch's latency-evaluator: ``schedule_kernel`` on the fusion's ops (the same member set as
  the baseline kernel ``stitch.plan`` builds from XLA's partition), launch overhead removed;
- the delta cost model (``CostModel.kernel``) on the same member set, launch overhead removed.

XLA's ``us`` excludes launch overhead too. Per target: pairs, Spearman rank correlation,
Pearson correlation of log times, median stitch/XLA ratio and the worst outliers. With
``--out`` the report replaces the ``latency-vs-xla`` section of that markdown file (appended
when missing), keeping the section's hand-written ``Reading:`` block. Nothing here runs on a
GPU.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import pathlib
import platform
import re
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from bench.report import REPO, cpu_name
from stitch.hlo import parse_hlo
from stitch.hlo.graph import OpGraph, build_op_graphs
from stitch.pricing.delta import CostModel, kernel_hbm_bytes
from stitch.cost.gpu_specs import GpuSpec, get_spec
from stitch.explorer.patterns import is_plannable
from stitch.explorer.graph_plan import kernel_kind
from stitch.schedule import KernelSchedule, ScheduleError, schedule_kernel

log = logging.getLogger(__name__)

DATA = REPO / "hlo_fixtures" / "data"
COSTS = DATA / "xla_costs"
CONFIG = "full"
DEFAULT_TARGETS = ("h100", "a100", "v100")
BEGIN = "<!-- latency-vs-xla:begin -->"
END = "<!-- latency-vs-xla:end -->"
OUTLIERS = 10
# XLA kinds of GEMM kernels: their estimate is for a dot, which stitch does not schedule.
GEMM_KINDS = ("__triton_gemm", "__triton_nested_gemm_fusion", "__cublas", "__cudnn")
PERF_MODEL_SOURCE = "GpuPerformanceModel"


@dataclass(frozen=True)
class Pair:
    model: str
    fusion: str
    xla_kind: str
    xla_source: str                 # which XLA model gave ``xla_us``
    xla_us: float                   # XLA's estimate, launch excluded
    latency_us: float               # stitch's latency-evaluator, launch excluded
    delta_us: float                 # stitch's delta cost model, launch excluded
    description: str

    @property
    def ratio(self) -> float:
        return self.latency_us / self.xla_us


@dataclass(frozen=True)
class Skip:
    model: str
    fusion: str
    reason: str                     # short category
    detail: str = ""


@dataclass
class ModelResult:
    model: str
    pairs: list[Pair] = field(default_factory=list)
    skips: list[Skip] = field(default_factory=list)
    excluded: Counter = field(default_factory=Counter)   # not memory-intensive: why


@dataclass
class TargetReport:
    target: str
    models: list[ModelResult]
    seconds: float

    @property
    def pairs(self) -> list[Pair]:
        return [p for m in self.models for p in m.pairs]

    @property
    def skips(self) -> list[Skip]:
        return [s for m in self.models for s in m.skips]


# --- statistics -----------------------------------------------------------------------

def ranks(values) -> np.ndarray:
    """1-based ranks; tied values share the average of their ranks."""
    x = np.asarray(values, dtype=float)
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    # Start of each run of equal values in sorted order.
    starts = np.flatnonzero(np.r_[True, sorted_x[1:] != sorted_x[:-1]])
    ends = np.r_[starts[1:], len(x)]
    average = (starts + ends + 1) / 2.0          # mean of ranks starts+1 .. ends
    out = np.empty(len(x))
    out[order] = np.repeat(average, ends - starts)
    return out


def pearson(x, y) -> float:
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(x) < 2:
        return math.nan
    dx, dy = x - x.mean(), y - y.mean()
    denom = math.sqrt(float(dx @ dx) * float(dy @ dy))
    return float(dx @ dy) / denom if denom else math.nan


def spearman(x, y) -> float:
    """Spearman rank correlation (Pearson correlation of average-tie ranks)."""
    return pearson(ranks(x), ranks(y))


def log_pearson(x, y) -> float:
    return pearson(np.log(np.asarray(x, dtype=float)), np.log(np.asarray(y, dtype=float)))


# --- pairing --------------------------------------------------------------------------

def available_models(target: str) -> list[str]:
    suffix = f".{CONFIG}.{target}.json"
    return sorted(p.name[:-len(suffix)] for p in COSTS.glob(f"*{suffix}"))


def exclusion(entry: dict) -> str | None:
    """Why an XLA entry is no memory-intensive fusion with a usable estimate, or None."""
    kind = entry["kind"]
    if any(g in kind for g in GEMM_KINDS):
        return "GEMM fusion"
    if "__triton" in kind and PERF_MODEL_SOURCE in entry["source"]:
        # docs/xla_costs.md: GpuPerformanceModel does not understand Triton fusions (absurd
        # for softmax); three A100 transposes have no other estimate.
        return "Triton fusion estimated by GpuPerformanceModel"
    if not entry.get("us") or entry["us"] <= 0:
        return "no XLA estimate"
    return None


def xla_kernels(graphs: list[OpGraph]) -> dict[str, tuple[OpGraph, tuple[int, ...]]]:
    """XLA fusion name -> (graph, op ids): the baseline partition ``stitch.plan`` uses."""
    found: dict[str, tuple[OpGraph, tuple[int, ...]]] = {}
    for graph in graphs:
        for name, ids in graph.baseline_groups().items():
            if any(graph.nodes[v].xla_group == name for v in ids):
                found.setdefault(name, (graph, tuple(ids)))
    return found


def describe(graph: OpGraph, members: tuple[int, ...], schedule: KernelSchedule) -> str:
    """Op mix and row shape of a kernel, e.g. ``reduce×2 multiply×3; row 4096×768 warp``."""
    ops = Counter(graph.nodes[v].opcode for v in members if not graph.is_free(v))
    mix = " ".join(f"{op}×{n}" if n > 1 else op for op, n in ops.most_common(4))
    if len(ops) > 4:
        mix += " …"
    parts = []
    for p in schedule.parts:
        if p.kind == "row":
            layout = "" if p.minor else " cols"
            parts.append(f"row {p.rows}×{p.row_length}{layout} {p.unit}")
        else:
            parts.append(f"loop {p.rows} vw{p.vector_width}")
    # The bytes the latency-evaluator charged: what the outputs need (partial reads), with
    # the reductions of warp/block parts read in full.
    whole = [v for p in schedule.parts if p.kind == "row" and p.unit != "thread"
             for v in p.members if graph.nodes[v].opcode == "reduce"]
    mb = kernel_hbm_bytes(graph, members, whole) / 1e6
    return f"{mix}; {', '.join(parts)}; {mb:.3g} MB"


def _short_reason(message: str) -> str:
    """A ScheduleError message without the kernel name and numbers, for grouping."""
    text = re.sub(r"^.*?kernel at [^:]+: ", "", message)
    text = text.split(";")[0]
    return re.sub(r"\d+", "N", text)[:90]


def pair_entry(model: str, entry: dict, graph: OpGraph, members: tuple[int, ...],
               spec: GpuSpec, cost: CostModel) -> Pair | Skip:
    fusion = entry["fusion"]
    if kernel_kind(graph, members) != "fused":
        return Skip(model, fusion, f"stitch sees a {kernel_kind(graph, members)} kernel")
    blocked = sorted({graph.nodes[v].opcode for v in members if not is_plannable(graph, v)})
    if blocked:
        return Skip(model, fusion, f"holds ops stitch does not generate: {', '.join(blocked)}")
    try:
        schedule = schedule_kernel(graph, members, spec)
    except ScheduleError as exc:
        return Skip(model, fusion, f"no schedule: {_short_reason(str(exc))}", str(exc)[:300])
    launch_us = spec.kernel_launch_overhead_s * 1e6
    latency_us = schedule.modeled_us - launch_us
    k = cost.kernel(members)
    delta_us = (k.total_s - k.launches * spec.kernel_launch_overhead_s) * 1e6
    if latency_us <= 0 or delta_us <= 0:
        return Skip(model, fusion, "non-positive modeled time")
    source = "indexing" if "indexing" in entry["source"] else "gpu_perf_model"
    return Pair(model, fusion, entry["kind"], source, float(entry["us"]), latency_us, delta_us,
                describe(graph, members, schedule))


def pair_model(model: str, target: str) -> ModelResult:
    result = ModelResult(model)
    data = json.loads((COSTS / f"{model}.{CONFIG}.{target}.json").read_text())
    hlo = DATA / model / f"{CONFIG}.gpu-{target}.hlo"
    graphs = build_op_graphs(parse_hlo(hlo.read_text()))
    kernels = xla_kernels(graphs)
    spec = get_spec(target)
    costs: dict[str, CostModel] = {}
    for entry in data["entries"]:
        why = exclusion(entry)
        if why:
            result.excluded[why] += 1
            continue
        found = kernels.get(entry["fusion"])
        if found is None:
            result.skips.append(Skip(model, entry["fusion"], "fusion not found in stitch's graphs"))
            continue
        graph, members = found
        if graph.name not in costs:
            costs[graph.name] = CostModel(graph, spec)
        cost = costs[graph.name]
        got = pair_entry(model, entry, graph, members, spec, cost)
        (result.pairs if isinstance(got, Pair) else result.skips).append(got)
    return result


def run_target(target: str, models: list[str] | None) -> TargetReport:
    start = time.perf_counter()
    available = available_models(target)
    names = [m for m in available if models is None or m in models]
    for missing in sorted(set(models or ()) - set(available)):
        log.warning("%s: no XLA cost file for model %s", target, missing)
    results = []
    for model in names:
        t0 = time.perf_counter()
        results.append(pair_model(model, target))
        log.info("%s %s: %d pairs in %.2f s", target, model, len(results[-1].pairs),
                 time.perf_counter() - t0)
    return TargetReport(target, results, time.perf_counter() - start)


# --- report ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Stats:
    n: int
    spearman: float
    log_pearson: float
    median_ratio: float
    spearman_delta: float
    median_ratio_delta: float
    within_2x: int


def stats(pairs: list[Pair]) -> Stats:
    if not pairs:
        return Stats(0, math.nan, math.nan, math.nan, math.nan, math.nan, 0)
    xla = np.array([p.xla_us for p in pairs])
    lat = np.array([p.latency_us for p in pairs])
    dlt = np.array([p.delta_us for p in pairs])
    ratios = lat / xla
    return Stats(len(pairs), spearman(xla, lat), log_pearson(xla, lat), float(np.median(ratios)),
                 spearman(xla, dlt), float(np.median(dlt / xla)),
                 int(np.sum(np.abs(np.log(ratios)) <= math.log(2))))


@dataclass(frozen=True)
class Alike:
    """Pairs with the same kernel description and times (a training graph repeats one
    fusion per layer; small models share scalar kernels): the first, and how many."""
    first: Pair
    count: int
    models: tuple[str, ...]


def alike(pairs: list[Pair]) -> list[Alike]:
    groups: dict[tuple, list[Pair]] = {}
    for p in pairs:
        key = (p.xla_kind, p.description, f"{p.xla_us:.3g}", f"{p.latency_us:.3g}")
        groups.setdefault(key, []).append(p)
    return [Alike(g[0], len(g), tuple(dict.fromkeys(p.model for p in g)))
            for g in groups.values()]


def worst(pairs: list[Pair], count: int = OUTLIERS) -> list[Alike]:
    """The ``count`` worst by |log(latency/XLA)|, alike kernels merged."""
    return sorted(alike(pairs), key=lambda a: -abs(math.log(a.first.ratio)))[:count]


def largest_gaps(pairs: list[Pair], count: int = 5) -> list[Alike]:
    """The ``count`` largest |latency - XLA| in µs, alike kernels merged."""
    return sorted(alike(pairs),
                  key=lambda a: -abs(a.first.latency_us - a.first.xla_us))[:count]


def _f(value: float, digits: int = 3) -> str:
    return "—" if math.isnan(value) else f"{value:.{digits}f}"


def _us(value: float) -> str:
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def summary_table(reports: list[TargetReport]) -> list[str]:
    lines = ["| target | pairs | Spearman | Pearson of logs | median latency/XLA "
             "| within 2× | XLA ≥ 1 µs: pairs / Spearman / median | Spearman (delta) "
             "| median delta/XLA | skipped | excluded | time (s) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in reports:
        s = stats(r.pairs)
        big = stats([p for p in r.pairs if p.xla_us >= 1.0])
        excluded = sum(sum(m.excluded.values()) for m in r.models)
        lines.append(f"| {r.target} | {s.n} | {_f(s.spearman)} | {_f(s.log_pearson)} "
                     f"| {_f(s.median_ratio, 2)} | {s.within_2x} "
                     f"| {big.n} / {_f(big.spearman)} / {_f(big.median_ratio, 2)} "
                     f"| {_f(s.spearman_delta)} | {_f(s.median_ratio_delta, 2)} "
                     f"| {len(r.skips)} | {excluded} | {r.seconds:.1f} |")
    return lines


def by_kind_table(reports: list[TargetReport]) -> list[str]:
    lines = ["| target | XLA kind (XLA model) | pairs | Spearman | median latency/XLA "
             "| Spearman (delta) | median delta/XLA |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in reports:
        kinds = sorted({(p.xla_kind, p.xla_source) for p in r.pairs})
        for kind, source in kinds:
            s = stats([p for p in r.pairs if (p.xla_kind, p.xla_source) == (kind, source)])
            lines.append(f"| {r.target} | {kind} ({source}) | {s.n} | {_f(s.spearman)} "
                         f"| {_f(s.median_ratio, 2)} | {_f(s.spearman_delta)} "
                         f"| {_f(s.median_ratio_delta, 2)} |")
    return lines


def _models(models: tuple[str, ...]) -> str:
    return ", ".join(models[:2]) + (f" +{len(models) - 2}" if len(models) > 2 else "")


def _pair_rows(rows: list[Alike]) -> list[str]:
    lines = ["| model | fusion | XLA kind | XLA µs | latency µs | delta µs | latency/XLA "
             "| kernel (ops; schedule; HBM bytes) |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for a in rows:
        p = a.first
        name = p.fusion + (f" (+{a.count - 1} alike)" if a.count > 1 else "")
        lines.append(f"| {_models(a.models)} | {name} | {p.xla_kind} | {_us(p.xla_us)} "
                     f"| {_us(p.latency_us)} | {_us(p.delta_us)} | {p.ratio:.3g} "
                     f"| {p.description} |")
    return lines


def outlier_table(report: TargetReport) -> list[str]:
    return [f"**{report.target}**, worst {OUTLIERS} by |log(latency/XLA)| (alike fusions "
            "merged):", "", *_pair_rows(worst(report.pairs)), "",
            f"{report.target}, largest |latency − XLA|:", "",
            *_pair_rows(largest_gaps(report.pairs))]


def per_model_table(reports: list[TargetReport]) -> list[str]:
    targets = [r.target for r in reports]
    header = " | ".join(f"{t} pairs / skipped" for t in targets)
    lines = [f"| model | {header} |", "|---|" + "---:|" * len(targets)]
    rows: dict[str, dict[str, ModelResult]] = {}
    for r in reports:
        for m in r.models:
            rows.setdefault(m.model, {})[r.target] = m
    for model in sorted(rows):
        cells = []
        for t in targets:
            m = rows[model].get(t)
            cells.append("—" if m is None else f"{len(m.pairs)} / {len(m.skips)}")
        lines.append(f"| {model} | {' | '.join(cells)} |")
    return lines


def skip_lines(reports: list[TargetReport]) -> list[str]:
    lines = []
    for r in reports:
        reasons = Counter(s.reason for s in r.skips)
        if not reasons:
            lines.append(f"- {r.target}: none skipped")
            continue
        text = "; ".join(f"{n}× {reason}" for reason, n in reasons.most_common())
        lines.append(f"- {r.target}: {text}")
    return lines


def machine() -> str:
    cpu = cpu_name()
    return (f"this 2-core dev machine, no GPU ({cpu}, {platform.system()}, "
            f"Python {platform.python_version()})")


def render(reports: list[TargetReport], command: str, reading: list[str]) -> str:
    total = sum(r.seconds for r in reports)
    lines = [BEGIN, "## Latency-evaluator vs XLA's own per-fusion estimates (modeled vs modeled)",
             "",
             f"`{command}` — {datetime.date.today().isoformat()}, {machine()}; "
             f"{total:.1f} s for all targets (measured).", "",
             "Both sides are **modeled**, nothing was measured on a GPU: XLA's numbers are its "
             "own cost models' estimates (`us` of `hlo_fixtures/data/xla_costs/<model>.full.<target>"
             ".json`: GpuPerformanceModel for loop/input fusions, the tiled indexing model for "
             "Triton fusions; see docs/xla_costs.md), stitch's are the latency-evaluator "
             "(`schedule_kernel`, best tuned schedule) and the delta cost model on the same op "
             "set (XLA's fusion, as `stitch.plan`'s baseline partition has it). Launch overhead "
             "is removed from stitch's times (XLA's exclude it). Excluded: GEMM fusions and "
             "Triton fusions whose only estimate is GpuPerformanceModel (it does not model "
             "Triton); skipped: fusions stitch cannot schedule (reasons below). Statistics "
             "count every fusion, repeated layers included; \"within 2×\": pairs with "
             "latency/XLA in [0.5, 2]. Spearman ranks use average ties.",
             "", *summary_table(reports), "", "By XLA fusion kind:", "", *by_kind_table(reports),
             "", "Skipped (XLA memory-intensive fusions without a latency-evaluator time):", "",
             *skip_lines(reports), ""]
    for r in reports:
        lines += [*outlier_table(r), ""]
    lines += ["Pairs / skipped per model:", "", *per_model_table(reports), ""]
    if reading:
        lines += ["Reading:", "", *reading, ""]
    lines.append(END)
    return "\n".join(lines) + "\n"


def write_section(path: pathlib.Path, section: str) -> None:
    """Replace the text between the markers (inclusive) or append the section."""
    text = path.read_text() if path.exists() else ""
    start, end = text.find(BEGIN), text.find(END)
    if start >= 0 and end > start:
        text = text[:start] + section.rstrip("\n") + text[end + len(END):]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + section
    path.write_text(text)


def read_reading(path: pathlib.Path | None) -> list[str]:
    """Hand-written interpretation kept between runs: the ``Reading:`` block of the section."""
    if path is None or not path.exists():
        return []
    text = path.read_text()
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        return []
    block = text[start:end]
    at = block.find("\nReading:\n")
    if at < 0:
        return []
    return block[at + len("\nReading:\n"):].strip("\n").split("\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS))
    parser.add_argument("--models", default="", help="comma-separated; default all")
    parser.add_argument("--out", type=pathlib.Path, help="markdown file to write the section to")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    models = [m.strip() for m in args.models.split(",") if m.strip()] or None
    reports = [run_target(t, models) for t in targets]
    command = "python -m bench.plans.estimates" + (
        f" --targets {args.targets}" if targets != list(DEFAULT_TARGETS) else "") + (
        f" --models {args.models}" if models else "") + (
        f" --out {args.out}" if args.out else "")
    section = render(reports, command, read_reading(args.out))
    print(section)
    if args.out:
        write_section(args.out, section)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
