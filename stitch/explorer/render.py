"""Render a FusionPlan for people: Graphviz DOT and a self-contained HTML page.

Both show, per op graph, the baseline plan (XLA's fusions or the base fusion pass) next to
the stitched plan, kernels in launch order. Rendering only reads the plan; it never plans.
"""
from __future__ import annotations

import html
import logging
from collections.abc import Iterable

from hlo_passes.graph import OpGraph
from hlo_passes.op_classes import OpClass

from .plan import GraphPlan, PlannedKernel
from .planner import FusionPlan, GraphResult

log = logging.getLogger(__name__)

# Pastel fills cycled over fused kernels so that neighbouring kernels stay distinguishable;
# the kernel kinds that are boundaries of fusion get fixed colours.
_PALETTE = ("#cfe2f3", "#d9ead3", "#fff2cc", "#f4cccc", "#d0e0e3", "#ead1dc", "#e6e6fa",
            "#fce5cd", "#d9d2e9", "#c9daf8")
_KIND_FILL = {"gemm": "#f9cb9c", "opaque": "#d9d9d9", "control": "#b4a7d6"}
_KIND_BORDER = {"fused": "#3d85c6", "gemm": "#b45f06", "opaque": "#666666",
                "control": "#674ea7"}
SIDES = ("baseline", "stitched")


def human_bytes(n: float) -> str:
    """Binary units, 3 significant digits: 1.23 GiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def kernel_fill(kernel: PlannedKernel, index: int) -> str:
    return _KIND_FILL.get(kernel.kind, _PALETTE[index % len(_PALETTE)])


def kernel_us(kernel: PlannedKernel) -> float:
    """Modeled time of one launch of the kernel, in microseconds."""
    return kernel.cost.total_s * 1e6


def _side(result: GraphResult, side: str) -> GraphPlan:
    return result.baseline if side == "baseline" else result.stitched


def _kernels_of(plan: GraphPlan) -> dict[int, list[int]]:
    """Op id -> indices of the kernels holding it (several when an op is recomputed)."""
    where: dict[int, list[int]] = {}
    for ki, kernel in enumerate(plan.kernels):
        for v in kernel.members:
            where.setdefault(v, []).append(ki)
    return where


def _is_boundary_op(graph: OpGraph, nid: int) -> bool:
    return graph.nodes[nid].op_class in (OpClass.COMPUTE, OpClass.OPAQUE)


# ---------------------------------------------------------------------------------- DOT


def _dot_str(text: str) -> str:
    """A DOT double-quoted string; newlines become DOT's centred line breaks."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("\n", "\\n") + '"'


def _dot_side(result: GraphResult, gi: int, side: str) -> list[str]:
    graph, gplan = result.graph, _side(result, side)
    prefix = f"g{gi}{side[0]}"
    where = _kernels_of(gplan)
    lines = [f"    subgraph {_dot_str(f'cluster_{prefix}')} {{",
             f"      label={_dot_str(f'{side}: {len(gplan.kernels)} kernels')};",
             '      style="rounded"; color="#999999"; fontsize=16;']

    def node_id(v: int, ki: int | None) -> str:
        return f"{prefix}_n{v}" if ki is None else f"{prefix}_k{ki}_n{v}"

    def node_line(v: int, ki: int | None, indent: str) -> str:
        node = graph.nodes[v]
        attrs = [f"label={_dot_str(f'{node.name}{chr(10)}{node.opcode}')}"]
        if _is_boundary_op(graph, v):
            attrs.append("shape=box")
        if ki is None:
            # Ops outside every kernel: sources and free plumbing, drawn faintly.
            attrs.append('style="dashed", color="#aaaaaa", fontcolor="#777777"')
        else:
            attrs.append('style="filled", fillcolor="white"')
        return f"{indent}{node_id(v, ki)} [{', '.join(attrs)}];"

    for ki, kernel in enumerate(gplan.kernels):
        label = (f"k{ki} {kernel.kind} ({kernel.origin})\n"
                 f"{human_bytes(kernel.cost.hbm_bytes)}, {kernel_us(kernel):.2f} µs")
        lines += [f"      subgraph {_dot_str(f'cluster_{prefix}_k{ki}')} {{",
                  f"        label={_dot_str(label)};",
                  f'        style="filled,rounded"; fillcolor="{kernel_fill(kernel, ki)}"; '
                  f'color="{_KIND_BORDER.get(kernel.kind, "#333333")}";']
        lines += [node_line(v, ki, "        ") for v in kernel.members]
        lines.append("      }")
    lines += [node_line(v, None, "      ") for v in range(len(graph.nodes)) if v not in where]

    # Edges: a consumer copy reads its producer from its own kernel when the producer is
    # recomputed there, otherwise from the first kernel (in launch order) holding it.
    edges: set[tuple[str, str]] = set()
    for v in range(len(graph.nodes)):
        for ki in where.get(v, [None]):
            members = set(gplan.kernels[ki].members) if ki is not None else set()
            for u in dict.fromkeys(graph.nodes[v].operands):
                if u in members:
                    src = node_id(u, ki)
                else:
                    src = node_id(u, where[u][0] if u in where else None)
                edges.add((src, node_id(v, ki)))
    lines += [f"      {a} -> {b};" for a, b in sorted(edges)]
    lines.append("    }")
    return lines


def to_dot(plan: FusionPlan) -> str:
    """One Graphviz digraph: per op graph, a baseline and a stitched cluster side by side,
    each kernel a coloured sub-cluster of its ops."""
    title = (f"{plan.module_name}: {plan.planner} plan for {plan.target} "
             f"(baseline: {plan.baseline_source})")
    lines = [f"digraph {_dot_str(plan.module_name)} {{",
             f"  label={_dot_str(title)}; labelloc=t; fontsize=20;",
             '  rankdir=TB; newrank=true; node [fontsize=10, shape=ellipse];']
    for gi, result in enumerate(plan.graphs):
        graph = result.graph
        label = (f"{graph.name} ({graph.kind}, {len(graph.nodes)} ops, "
                 f"runs x{result.stitched.weight})")
        lines += [f"  subgraph {_dot_str(f'cluster_g{gi}')} {{",
                  f"    label={_dot_str(label)}; style=\"solid\"; color=\"#444444\";"]
        # Graphviz (2.43 at least) lays unconnected sibling clusters out right to left in
        # definition order: defining stitched first puts the baseline on the left.
        for side in reversed(SIDES):
            lines += _dot_side(result, gi, side)
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------- HTML

_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 2em; } h3 { font-size: 1em; }
table.summary { border-collapse: collapse; margin: 1em 0; }
table.summary td, table.summary th { border: 1px solid #ccc; padding: .25em .7em; }
table.summary td.n { text-align: right; font-variant-numeric: tabular-nums; }
.meta { color: #555; }
.sides { display: grid; grid-template-columns: 1fr 1fr; gap: 1.5em; align-items: start; }
.kernel { border: 2px solid; border-radius: 6px; margin: .45em 0; padding: .3em .5em; }
.khead { font-size: .9em; }
.khead .kn { font-weight: bold; }
.kstats { font-size: .8em; color: #444; }
ol.ops { font-family: ui-monospace, monospace; font-size: .75em; margin: .2em 0 0 0;
         padding-left: 2.5em; max-height: 16em; overflow-y: auto; }
ol.ops .opc { color: #666; }
ol.ops .free { color: #999; }
ol.ops .bnd { font-weight: bold; }
a.x { color: #777; font-size: .9em; text-decoration: none; margin-left: .4em; }
a.x:hover { text-decoration: underline; }
"""

_SUMMARY_ROWS = (
    ("kernels", "kernels", str),
    ("memory-intensive kernels", "mem_kernels", str),
    ("launches per run", "launches", str),
    ("HBM bytes", "hbm_bytes", human_bytes),
    ("memory-intensive HBM bytes", "mem_hbm_bytes", human_bytes),
    ("modeled µs", "modeled_us", lambda x: f"{x:.2f}"),
    ("memory-intensive modeled µs", "mem_modeled_us", lambda x: f"{x:.2f}"),
)


def ratio(stitched: float, baseline: float) -> str:
    return f"{stitched / baseline:.2f}x" if baseline else "-"


def summary_rows(summary: dict) -> Iterable[tuple[str, str, str, str]]:
    """(label, baseline, stitched, stitched/baseline) per summary figure."""
    base, stitched = summary["baseline"], summary["stitched"]
    for label, key, fmt in _SUMMARY_ROWS:
        yield label, fmt(base[key]), fmt(stitched[key]), ratio(stitched[key], base[key])


def report_line(result: GraphResult) -> str:
    """The planner's outcome on one graph, in one line."""
    report = result.report
    parts = [f"{report.planner}: status {report.status}"]
    if report.gap is not None:
        parts.append(f"gap {report.gap:.2%}")
    parts.append(f"{report.seconds:.2f} s")
    detail = report.detail
    if "choice" in detail:
        parts.append(f"chose {detail['choice']}")
    if "candidates" in detail:
        parts.append(f"{detail['candidates']} candidate patterns")
    if "variables" in detail:
        parts.append(f"{detail['variables']} variables, {detail.get('constraints', '?')} "
                     f"constraints, {detail.get('cycle_cuts', 0)} cycle cuts")
    parts.append(f"objective {report.objective_s * 1e6:.2f} µs")
    return ", ".join(parts)


def _html_kernel(result: GraphResult, gi: int, side: str, ki: int, kernel: PlannedKernel,
                 other: dict[int, list[int]]) -> str:
    graph = result.graph
    gplan = _side(result, side)
    other_side = "s" if side == "baseline" else "b"
    anchor = f"g{gi}{side[0]}k{ki}"
    ops = []
    for v in kernel.members:
        node = graph.nodes[v]
        cls = "bnd" if _is_boundary_op(graph, v) else ("free" if graph.is_free(v) else "")
        # Cross-links to the kernel(s) holding the same op on the other side.
        links = "".join(f'<a class="x" href="#g{gi}{other_side}k{k}">{other_side}{k}</a>'
                        for k in other.get(v, []))
        ops.append(f'<li class="{cls}">{html.escape(node.name)} '
                   f'<span class="opc">{html.escape(node.opcode)}</span>{links}</li>')
    stats = (f"{kernel.kind} · {html.escape(kernel.origin)} · {len(kernel.members)} ops · "
             f"{human_bytes(kernel.cost.hbm_bytes)} · {kernel_us(kernel):.2f} µs")
    if kernel.cost.launches == 0:
        stats += " · no launch"
    return (f'<div class="kernel {kernel.kind}" id="{anchor}" style="background:'
            f'{kernel_fill(kernel, ki)};border-color:{_KIND_BORDER.get(kernel.kind, "#333")}">'
            f'<div class="khead"><span class="kn">{side[0]}{ki} {html.escape(kernel.name)}'
            f'</span></div><div class="kstats">{stats}</div>'
            f'<ol class="ops">{"".join(ops)}</ol></div>')


def _html_graph(result: GraphResult, gi: int) -> list[str]:
    graph = result.graph
    where = {side: _kernels_of(_side(result, side)) for side in SIDES}
    out = [f'<section class="graph" id="g{gi}"><h2>{html.escape(graph.name)} '
           f'<span class="meta">({graph.kind}, {len(graph.nodes)} ops, runs '
           f'x{result.stitched.weight})</span></h2>',
           f'<p class="meta">{html.escape(report_line(result))}</p>', '<div class="sides">']
    for side in SIDES:
        gplan = _side(result, side)
        other = where["stitched" if side == "baseline" else "baseline"]
        memory = sum(1 for k in gplan.kernels if k.is_memory)
        nbytes = sum(k.cost.hbm_bytes for k in gplan.kernels)
        out.append(f'<div class="side"><h3>{side}: {len(gplan.kernels)} kernels '
                   f'({memory} memory-intensive), {human_bytes(nbytes)}, '
                   f'{gplan.objective_s * 1e6:.2f} µs per run of the graph</h3>')
        out += [_html_kernel(result, gi, side, ki, k, other)
                for ki, k in enumerate(gplan.kernels)]
        out.append("</div>")
    out.append("</div></section>")
    return out


def to_html(plan: FusionPlan) -> str:
    """A self-contained HTML page (inline CSS, no scripts): the summary table, then per
    graph the baseline and stitched kernels side by side in launch order."""
    summary = plan.summary()
    title = f"stitch plan: {plan.module_name} on {plan.target}"
    rows = "".join(f'<tr><th>{html.escape(label)}</th><td class="n">{b}</td>'
                   f'<td class="n">{s}</td><td class="n">{r}</td></tr>'
                   for label, b, s, r in summary_rows(summary))
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
           f"<h1>{html.escape(title)}</h1>",
           f'<p class="meta">planner {html.escape(plan.planner)} · baseline from '
           f'{html.escape(plan.baseline_source)} · planned in {plan.seconds:.2f} s · '
           f'{len(plan.graphs)} op graph(s). Each op links to the kernel holding it on the '
           f'other side (b = baseline, s = stitched).</p>',
           '<table class="summary"><tr><th></th><th>baseline</th><th>stitched</th>'
           f'<th>stitched / baseline</th></tr>{rows}</table>']
    for gi, result in enumerate(plan.graphs):
        out += _html_graph(result, gi)
    out.append("</body></html>")
    log.debug("rendered HTML for %s: %d graphs", plan.module_name, len(plan.graphs))
    return "\n".join(out) + "\n"
