"""Fusion plans against XLA's real GPU decisions, beam search against the BLP optimum, and
explorer cost against graph size: the data of the report's ``plans`` and ``planner``
sections (``python -m bench plans|planner``; ``python -m bench.plans.zoo`` runs both).

Plans are made from the committed XLA-optimized fixtures (hlo_fixtures/data/<model>/full.gpu-*.hlo):
the baseline is XLA's own fusion partition. Kernel counts and bytes are counted; times are
modeled twice, by stitch's latency-evaluator (both plans' kernels scheduled by
``schedule_kernel``) and by bench/xla_formula.py (XLA's GpuPerformanceModel formulas,
written independently); planning times are measured.
"""
from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Collection

import stitch
from bench.report import geomean, ratio
from bench.xla_formula import DEVICES, KernelTime, kernel_flops, kernel_time
from stitch.hlo.op_classes import OpClass
from stitch.pricing.delta import graph_facts, kernel_hbm_bytes, utilization
from stitch.cost.gpu_specs import get_spec
from stitch.explorer.graph_plan import GraphPlan, kernel_kind
from stitch.explorer.planner import schedule_plan
from hlo_fixtures import DATA

TARGETS = ("v100", "a100", "h100")
TRAINING = ("bert_layer_train", "transformer_train", "dien_train", "log_softmax_xent_train")
# A stitched figure above XLA's by more than this counts as worse (float noise aside).
WORSE_TOLERANCE = 1.001
Progress = Callable[[str], None]


def models() -> list[str]:
    return sorted(p.name for p in DATA.iterdir()
                  if p.is_dir() and (p / "full.gpu-h100.hlo").exists())


@dataclass
class KernelRow:
    """One memory-intensive kernel of one plan (per launch; ``weight`` launches a step)."""
    graph: str
    name: str
    ops: int
    weight: int
    bytes: int
    latency_us: float              # latency-evaluator (delta model when unscheduled)
    scheduled: bool
    formula: KernelTime            # XLA's formulas


@dataclass
class Side:
    """One plan's figures per step (loop bodies weighted by trip count, kernel counts
    static)."""
    kernels: int = 0
    mem_kernels: int = 0
    mem_bytes: float = 0.0
    latency_us: float = 0.0
    formula_us: float = 0.0
    floor_us: float = 0.0
    flops: float = 0.0
    unscheduled: int = 0
    rows: list[KernelRow] = field(default_factory=list)


@dataclass
class PlanRow:
    model: str
    target: str
    xla: Side
    stitch: Side
    plan_s: float
    # HBM bytes of values one stitched mem kernel writes and another reads, by why the
    # producer and consumer were not fused (see ``crossing_bytes``).
    crossing: Counter = field(default_factory=Counter)
    # Mem bytes if every mem op of each graph were one kernel: only values crossing GEMMs,
    # opaque ops and graph edges move (a lower bound for plans that keep GEMMs apart).
    bytes_bound: float = 0.0
    # Bytes of values a GEMM or opaque op separates from their readers (saved activations,
    # ``Crossing.forced``): the one-kernel bound does not count them, no plan avoids them.
    forced_bytes: float = 0.0


def measure(plan: GraphPlan, side: Side, target: str) -> None:
    """Add one graph plan's kernels to ``side``."""
    device = DEVICES[target]
    for k in plan.kernels:
        if not k.cost.launches:
            continue
        side.kernels += 1
        if not k.is_memory:
            continue
        w = plan.weight
        t = kernel_time(device, kernel_flops(plan.graph, k.members), k.cost.hbm_bytes)
        side.mem_kernels += 1
        side.mem_bytes += k.cost.hbm_bytes * w
        side.latency_us += k.modeled_us * w
        side.formula_us += t.total_s * 1e6 * w
        side.floor_us += t.floor_s * 1e6 * w
        side.flops += t.flops * w
        side.unscheduled += k.schedule is None
        side.rows.append(KernelRow(plan.graph.name, k.name, len(k.members), w,
                                   k.cost.hbm_bytes, k.modeled_us, k.schedule is not None, t))


# Instruction names in reason texts (reduce_sum.232.3, scatter-add.6.1): replaced by "X" so
# that alike reasons add up.
_NAME = re.compile(r"\b[A-Za-z_][\w-]*\.[\w.-]*\d\b")


def reason_kind(reason: str) -> str:
    """The category of an explorer reason: op names removed, details in brackets cut."""
    return _NAME.sub("X", reason).split(" (")[0].strip()


def _users_through_free(graph, v: int) -> list[int]:
    """The users of v, looking through free aliases (bitcasts) to the ops reading them."""
    found, stack, seen = [], list(graph.nodes[v].users), set()
    while stack:
        u = stack.pop()
        if u in seen:
            continue
        seen.add(u)
        if graph.is_free(u) and graph.nodes[u].opcode not in ("while", "conditional"):
            stack.extend(graph.nodes[u].users)
        else:
            found.append(u)
    return sorted(found)


def crossing_bytes(result, target: str) -> Counter:
    """Bytes of values that cross between two memory-intensive kernels of the stitched plan
    (value size × (1 write + 1 read per other mem kernel reading it), per step), by the
    explorer's reason for not fusing the producer with its first such consumer: the traffic
    a better plan could still remove."""
    graph, plan = result.graph, result.stitched
    owners: dict[int, set[int]] = {}
    mem = [k for k in plan.kernels if k.is_memory]
    for i, k in enumerate(mem):
        for v in k.members:
            owners.setdefault(v, set()).add(i)
    out: Counter = Counter()
    for v, ks in owners.items():
        node = graph.nodes[v]
        if graph.is_free(v):
            continue
        readers: set[int] = set()
        reason = ""
        for u in _users_through_free(graph, v):
            uk = owners.get(u, set())
            if not uk or uk & ks:
                continue
            readers |= uk
            if not reason:
                if kernel_kind(graph, (u,)) == "opaque" or kernel_kind(graph, (v,)) == "opaque":
                    reason = "one side is an opaque op stitch does not generate (scatter)"
                else:
                    reason = reason_kind(result.reasons.get(
                        (v, u), "another pattern scored higher in beam search"))
        if readers:
            out[reason] += node.shape.byte_size * (1 + len(readers)) * plan.weight
    return out


@dataclass
class Crossing:
    """A value a stitched memory-intensive kernel writes and others read (``kind``
    "crossing"), or an outside value (graph input, GEMM result) several memory-intensive
    kernels read (``kind`` "re-read"): its bytes above the one-kernel bound, per step.
    ``forced``: every reader is behind a GEMM or opaque op on some path from the value
    (an activation saved for the backward pass): no plan that keeps GEMMs apart can
    avoid writing and reading it, though the one-kernel bound does not count it."""
    graph: str
    value: str
    kind: str
    nbytes: float
    producer: str
    readers: tuple[str, ...]
    reason: str
    forced: bool = False


_BOUNDARY = (OpClass.COMPUTE, OpClass.OPAQUE)


def _boundary_between(graph, v: int, u: int) -> bool:
    """Whether some path from v to u passes a GEMM/opaque op: one lies both downstream of v
    and upstream of u (node ids are topological)."""
    def walk(start: int, step, inside) -> set[int]:
        seen, stack = {start}, [start]
        while stack:
            for x in step(stack.pop()):
                if x not in seen and inside(x):
                    seen.add(x)
                    stack.append(x)
        return seen
    down = walk(v, lambda w: graph.nodes[w].users, lambda x: x < u)
    up = walk(u, lambda w: graph.nodes[w].operands, lambda x: x > v)
    return any(graph.nodes[w].op_class in _BOUNDARY for w in (down & up) - {v, u})


def crossing_values(result) -> list[Crossing]:
    """Every byte of a graph's stitched plan above its one-kernel bound, by value: values
    crossing between memory-intensive kernels (1 write + 1 read per reading kernel, with the
    explorer's reason the producer and its first such consumer stayed apart; readers behind
    a GEMM listed apart as forced) and outside values read by more than one memory-intensive
    kernel (each read but the largest). Reads are the delta model's (the fraction of a
    buffer a kernel's outputs depend on); the sum approximates, not equals, plan bytes minus
    the bound (the bound reads partially used values in part too). Node ids are topological (``build_op_graphs``)."""
    graph, plan = result.graph, result.stitched
    mem = [k for k in plan.kernels if k.is_memory]
    owners: dict[int, set[int]] = {}
    for i, k in enumerate(mem):
        for v in k.members:
            owners.setdefault(v, set()).add(i)
    buffer = graph_facts(graph).buffer
    reads: dict[int, dict[int, float]] = {}

    def read_bytes(i: int, v: int) -> float:
        """Bytes of v's buffer kernel i reads (the delta model's utilization: a slice,
        a dynamic-slice or a gather reads part of it)."""
        if i not in reads:
            reads[i] = utilization(graph, set(mem[i].members))[1]
        fraction = max((f for o, f in reads[i].items() if buffer[o] == buffer[v]),
                       default=1.0)
        return graph.nodes[v].shape.byte_size * fraction

    out: list[Crossing] = []
    for v, node in enumerate(graph.nodes):
        if graph.is_free(v) and v in owners:
            continue
        ks = owners.get(v, set())
        forced: set[int] = set()
        free: set[int] = set()
        reason = ""
        for u in _users_through_free(graph, v):
            uk = owners.get(u, set())
            if not uk or uk & ks:
                continue
            if ks and _boundary_between(graph, v, u):
                forced |= uk
                continue
            free |= uk
            if ks and not reason:
                reason = reason_kind(result.reasons.get(
                    (v, u), "another pattern scored higher in beam search"))
        forced -= free
        w = plan.weight
        size = node.shape.byte_size
        if ks and (free or forced):
            first = mem[min(ks)].name
            if free:
                out.append(Crossing(graph.name, node.name, "crossing",
                                    w * (size + sum(read_bytes(i, v) for i in free)),
                                    first, tuple(sorted(mem[i].name for i in free)), reason))
            if forced:
                write = 0 if free else size
                out.append(Crossing(graph.name, node.name, "crossing",
                                    w * (write + sum(read_bytes(i, v) for i in forced)),
                                    first, tuple(sorted(mem[i].name for i in forced)),
                                    "a GEMM or opaque op lies between", True))
        elif not ks and len(free) > 1 and size:
            each = sorted(read_bytes(i, v) for i in free)
            out.append(Crossing(graph.name, node.name, "re-read", w * sum(each[:-1]),
                                node.opcode, tuple(sorted(mem[i].name for i in free)),
                                "read by several kernels"))
    return sorted(out, key=lambda c: -c.nbytes)


def plan_model(model: str, target: str) -> PlanRow:
    text = (DATA / model / f"full.gpu-{target}.hlo").read_text()
    start = time.perf_counter()
    p = stitch.plan(text, target=target)
    seconds = time.perf_counter() - start
    spec = get_spec(target)
    xla, st = Side(), Side()
    for g in p.graphs:
        # XLA's fusions get the latency-evaluator's schedule too: the same yardstick.
        schedule_plan(g.graph, spec, g.baseline)
        measure(g.baseline, xla, target)
        measure(g.stitched, st, target)
    crossing = sum((crossing_bytes(g, target) for g in p.graphs), Counter())
    bound = 0.0
    for g in p.graphs:
        members = {v for k in g.baseline.kernels if k.is_memory for v in k.members}
        bound += kernel_hbm_bytes(g.graph, members) * g.baseline.weight if members else 0
    forced = sum(c.nbytes for g in p.graphs for c in crossing_values(g) if c.forced)
    return PlanRow(model, target, xla, st, seconds, crossing, bound, forced)


def collect_plans(names: list[str], targets=TARGETS, progress: Progress = lambda _: None
                  ) -> list[PlanRow]:
    rows = []
    for model in names:
        for target in targets:
            rows.append(plan_model(model, target))
            progress(f"plans {model} {target}: {rows[-1].plan_s:.2f} s")
    return rows


# --- markdown -------------------------------------------------------------------------

def _arrow(a: float, b: float, fmt: str = "{:.0f}", invert: bool = False) -> str:
    """'a → b (b/a)', or a/b (a speedup) with ``invert``."""
    r = ratio(a, b) if invert else ratio(b, a)
    return f"{fmt.format(a)} → {fmt.format(b)} ({r})"


def worse_columns(row: PlanRow) -> list[str]:
    """The columns where stitch's plan is worse than XLA's."""
    x, s = row.xla, row.stitch
    checks = {"kernels": (x.kernels, s.kernels), "mem kernels": (x.mem_kernels, s.mem_kernels),
              "mem bytes": (x.mem_bytes, s.mem_bytes),
              "latency-evaluator µs": (x.latency_us, s.latency_us),
              "XLA-formula µs": (x.formula_us, s.formula_us)}
    return [f"{name} {a:.4g} → {b:.4g}" for name, (a, b) in checks.items()
            if b > a * WORSE_TOLERANCE]


@dataclass
class Totals:
    """Sums and per-model geometric means of stitch/XLA ratios over a set of rows."""
    rows: list[PlanRow]

    def sum(self, attr: str) -> tuple[float, float]:
        return (sum(getattr(r.xla, attr) for r in self.rows),
                sum(getattr(r.stitch, attr) for r in self.rows))

    def geo(self, attr: str) -> float:
        return geomean(getattr(r.stitch, attr) / getattr(r.xla, attr) for r in self.rows
                       if getattr(r.xla, attr) > 0 and getattr(r.stitch, attr) > 0)


def plans_markdown(rows: list[PlanRow], image: Callable[[str], str | None],
                   models: Collection[str] | None = None,
                   full_table: str | None = None) -> list[str]:
    """The section: per target a table of ``models`` (all rows when None; ``full_table``
    names where every model's table is), the summary, the plot."""
    lines = [
        "Kernels and bytes are **counted** from XLA's optimized HLO (`hlo_fixtures/data/<model>/"
        "full.gpu-<target>.hlo`, jax 0.10.2 deviceless compilation) and from stitch's plan of "
        "the same module (`stitch.plan(hlo, target)`, beam planner); times are **modeled**, "
        "nothing ran on a GPU. Memory-intensive (mem) = every launching kernel that is not a "
        "GEMM/conv. Bytes: HBM bytes of the mem kernels per step (each kernel's counted reads "
        "and writes, partial reads of gathers/slices and in-place updates counted as "
        "`stitch.pricing.delta.kernel_hbm_bytes` does, the same rule on both sides); loop bodies "
        "count trip-count times, kernel counts once. Two yardsticks for the mem kernels' "
        "time, each applied to both plans:",
        "",
        "- **latency-evaluator**: stitch's §4.3 model; XLA's fusions are scheduled by "
        "`schedule_kernel` like stitch's (the few it cannot schedule, XLA fusions around a "
        "scatter, fall back to the delta model on both sides);",
        "- **XLA formula**: `bench/xla_formula.py`, XLA's GpuPerformanceModel formulas "
        "written independently of stitch's cost code: 1 µs launch per kernel, T = C + M − "
        "0.95·min(C, M), C = flops / (SMs × FPUs × 2 × clock), M = bytes / bandwidth, device "
        "figures from XLA's own target descriptions; flops by HloCostAnalysis's rules with "
        "recomputation through broadcasts.",
        "",
        "Roofline floor = Σ bytes / bandwidth of the mem kernels (no launch); gap = XLA-formula "
        "time / floor. Cells read `XLA → stitch (ratio)`; ratios are stitch/XLA for counts "
        "and bytes and XLA/stitch (speed-up, > 1 is better) for times.", ""]
    if models is not None and full_table:
        lines += [f"Every model's row per target: [{full_table}]({full_table}).", ""]
    lines += per_model_tables([r for r in rows if models is None or r.model in models])
    lines += summary_markdown(rows)
    link = image("plans_ratios")
    if link:
        lines += [link, ""]
    return lines


def per_model_tables(rows: list[PlanRow]) -> list[str]:
    """Per target, one row per model: XLA → stitch kernels, MB, µs both ways, floor, gap."""
    lines: list[str] = []
    for target in TARGETS:
        rs = [r for r in rows if r.target == target]
        if not rs:
            continue
        lines += [f"#### {target.upper()}", "",
                  "| model | mem kernels | mem MB | latency-evaluator µs | XLA-formula µs | "
                  "floor µs | gap XLA / stitch | plan (s) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rs:
            x, s = r.xla, r.stitch
            gap = f"{ratio(x.formula_us, x.floor_us, 1)} / {ratio(s.formula_us, s.floor_us, 1)}"
            lines.append(
                f"| {r.model} | {_arrow(x.mem_kernels, s.mem_kernels)} | "
                f"{_arrow(x.mem_bytes / 1e6, s.mem_bytes / 1e6, '{:.1f}')} | "
                f"{_arrow(x.latency_us, s.latency_us, '{:.0f}', True)} | "
                f"{_arrow(x.formula_us, s.formula_us, '{:.0f}', True)} | "
                f"{x.floor_us:.0f} → {s.floor_us:.0f} | {gap} | {r.plan_s:.2f} |")
        lines.append("")
    return lines


def summary_markdown(rows: list[PlanRow]) -> list[str]:
    lines = ["### Summary", "",
             "Geometric means are over models where both sides are non-zero (the "
             "`gemm_chain_*` models have no mem kernels on V100).", "",
             "| graphs | target | mem kernels (sum) | geo-mean | mem bytes (sum) | geo-mean | "
             "latency-evaluator speed-up (sum) | geo-mean | XLA-formula speed-up (sum) | "
             "geo-mean |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, pick in (("training (" + ", ".join(TRAINING) + ")", lambda r: r.model in TRAINING),
                        ("all zoo models", lambda r: True)):
        for target in TARGETS:
            t = Totals([r for r in rows if r.target == target and pick(r)])
            if not t.rows:
                continue
            k, b, lat, f = (t.sum(a) for a in ("mem_kernels", "mem_bytes", "latency_us",
                                               "formula_us"))
            lines.append(
                f"| {label} | {target} | {k[0]:.0f} → {k[1]:.0f} ({ratio(k[1], k[0])}) | "
                f"{t.geo('mem_kernels'):.2f} | {ratio(b[1], b[0])} | {t.geo('mem_bytes'):.2f} | "
                f"{ratio(lat[0], lat[1])} | {1 / t.geo('latency_us'):.2f} | "
                f"{ratio(f[0], f[1])} | {1 / t.geo('formula_us'):.2f} |")
    lines.append("")
    worse = [(r, w) for r in rows for w in [worse_columns(r)] if w]
    lines += [f"**Worse than XLA** (any column, more than {100 * (WORSE_TOLERANCE - 1):.1f}% "
              f"above): {len(worse)} of {len(rows)} model × target pairs."]
    lines += [f"- {r.model} {r.target}: {'; '.join(w)}" for r, w in worse]
    bound = [(t, k) for t in TARGETS for r in rows if r.target == t
             for side in (r.xla, r.stitch) for k in side.rows
             if k.formula.compute_s > k.formula.memory_s]
    every = sum(len(side.rows) for r in rows for side in (r.xla, r.stitch))
    lines += ["", f"Under the XLA formula {len(bound)} of {every} mem kernels (all models and "
              "targets, both sides, each kernel once) are compute-bound (C > M; ridge points "
              + ", ".join(f"{t} {DEVICES[t].flops_per_s / DEVICES[t].memory_bandwidth:.1f}"
                          for t in TARGETS) + " flops/byte)"
              + (": " + ", ".join(sorted({f"{k.name} ({t}, {k.formula.flops / max(k.bytes, 1):.0f}"
                                          " flops/byte)" for t, k in bound})[:6])
                 if bound else "")
              + "; every other mem kernel costs launch + bytes/bandwidth + 5% of its C."]
    unscheduled = Counter()
    for r in rows:
        unscheduled[(r.target, "XLA")] += r.xla.unscheduled
        unscheduled[(r.target, "stitch")] += r.stitch.unscheduled
    lines += ["", "Kernels without a latency-evaluator schedule (delta-model time used): " +
              ", ".join(f"{t} XLA {unscheduled[(t, 'XLA')]} / stitch "
                        f"{unscheduled[(t, 'stitch')]}" for t in TARGETS) + ".", ""]
    return lines + bytes_markdown(rows) + [""]


def bytes_markdown(rows: list[PlanRow]) -> list[str]:
    """Where the training graphs' remaining mem bytes are (counted)."""
    train = [r for r in rows if r.model in TRAINING]
    if not train:
        return []
    lines = ["#### Where the remaining bytes are (training graphs, counted)", "",
             "Bound = the mem bytes if all mem ops of each graph were one kernel (only values "
             "crossing GEMMs, opaque ops and graph edges move): no plan that keeps GEMMs "
             "apart goes below it. Crossing = values one stitched mem kernel writes and "
             "another reads (size × (1 write + 1 read per reading kernel)), by the explorer's "
             "reason for not fusing the producer with its consumer (op names replaced by X).",
             "", "| target | XLA MB | stitch MB | bound MB | stitch/XLA | bound/XLA | "
             "crossing MB |", "|---|---:|---:|---:|---:|---:|---:|"]
    for t in TARGETS:
        rs = [r for r in train if r.target == t]
        if not rs:
            continue
        x, s_ = Totals(rs).sum("mem_bytes")
        b = sum(r.bytes_bound for r in rs)
        c = sum(sum(r.crossing.values()) for r in rs)
        lines.append(f"| {t} | {x / 1e6:.0f} | {s_ / 1e6:.0f} | {b / 1e6:.0f} | {ratio(s_, x)} | "
                     f"{ratio(b, x)} | {c / 1e6:.0f} |")
    reasons = Counter()
    for r in train:
        reasons.update(r.crossing)
    lines += ["", "| reason the producer stays apart | " + " | ".join(
        f"{t} MB (largest model)" for t in TARGETS) + " |",
        "|---|" + "---:|" * len(TARGETS)]
    for reason, _ in reasons.most_common(4):
        cells = []
        for t in TARGETS:
            per = {r.model: r.crossing.get(reason, 0) for r in train if r.target == t}
            top = max(per, key=per.get)
            cells.append(f"{sum(per.values()) / 1e6:.0f} ({top})" if per[top] else "0")
        lines.append(f"| {reason} | " + " | ".join(cells) + " |")
    return lines


# --- beam vs BLP, explorer scaling ---------------------------------------------------
