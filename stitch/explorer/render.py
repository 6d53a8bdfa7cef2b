"""Render a FusionPlan for people: Graphviz DOT and a self-contained HTML page.

Both show, per op graph, the baseline plan (XLA's fusions or the base fusion pass) next to
the stitched plan, kernels in launch order. Rendering only reads the plan; it never plans.
"""
from __future__ import annotations

import html
import logging
from collections.abc import Callable, Iterable

from stitch.hlo.graph import OpGraph
from stitch.hlo.op_classes import OpClass

from .graph_plan import GraphPlan, PlannedKernel
from .module_plan import FusionPlan, GraphResult

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
.picture { overflow: auto; max-height: 40em; border: 1px solid #ddd; }
svg.dataflow .edge { stroke: #888; stroke-width: 1; }
svg.dataflow .kbox { fill-opacity: .75; stroke-width: 1.5; }
svg.dataflow .op circle, svg.dataflow .op rect { fill: #fff; stroke: #333; }
svg.dataflow .op.outside circle, svg.dataflow .op.outside rect { fill: #f4f4f4;
  stroke: #bbb; stroke-dasharray: 2 2; }
details.reasons { font-size: .85em; margin: .5em 0; }
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
           f'<p class="meta">{html.escape(report_line(result))}</p>',
           '<div class="sides pictures">']
    out += [f'<div class="picture"><h3>{side}: dataflow</h3>{plan_svg(result, gi, side)}'
            f'</div>' for side in SIDES]
    out += ['</div>', '<div class="sides">']
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


# ---------------------------------------------------------------------- dataflow SVG

_NODE_GAP_X = 34         # px between op centres in a layer
_NODE_GAP_Y = 46         # px between layers
_NODE_R = 9
_MARGIN = 24


def _depths(graph: OpGraph) -> list[int]:
    """Topological depth of every op: 0 for ops without operands, else one more than the
    deepest operand (node ids are a topological order)."""
    depth = [0] * len(graph.nodes)
    for node in graph.nodes:
        if node.operands:
            depth[node.id] = 1 + max(depth[o] for o in node.operands)
    return depth


def plan_svg(result: GraphResult, gi: int, side: str) -> str:
    """One plan of one graph as a dataflow picture laid out here (no dependency): ops are
    nodes placed by topological depth (one row per depth), each kernel a cluster
    (``<g class="kernel">`` holding exactly its ops, with a box around them), edges the
    values read. An op recomputed in several kernels is drawn once per kernel; ops in no
    kernel (parameters, constants, free plumbing) are drawn faint outside every cluster."""
    graph, gplan = result.graph, _side(result, side)
    where = _kernels_of(gplan)
    depth = _depths(graph)
    prefix = f"g{gi}{side[0]}"
    # Node instances: (op, kernel index or None), placed row by row; within a row ops of
    # one kernel sit together, kernels in launch order.
    instances = [(v, ki) for v in range(len(graph.nodes)) for ki in where.get(v, [None])]
    rows: dict[int, list[tuple[int, int | None]]] = {}
    for v, ki in instances:
        rows.setdefault(depth[v], []).append((v, ki))
    pos: dict[tuple[int, int | None], tuple[float, float]] = {}
    for d, row in rows.items():
        row.sort(key=lambda inst: (inst[1] if inst[1] is not None else len(gplan.kernels),
                                   inst[0]))
        for i, inst in enumerate(row):
            pos[inst] = (_MARGIN + i * _NODE_GAP_X, _MARGIN + d * _NODE_GAP_Y)
    width = _MARGIN * 2 + max((len(r) for r in rows.values()), default=1) * _NODE_GAP_X
    height = _MARGIN * 2 + (max(rows, default=0) + 1) * _NODE_GAP_Y

    def node_id(v: int, ki: int | None) -> str:
        return f"{prefix}n{v}" if ki is None else f"{prefix}k{ki}n{v}"

    def node_svg(v: int, ki: int | None) -> str:
        node = graph.nodes[v]
        x, y = pos[(v, ki)]
        cls = "op" if ki is not None else "op outside"
        shape = (f'<rect x="{x - _NODE_R:.0f}" y="{y - _NODE_R:.0f}" width="{2 * _NODE_R}" '
                 f'height="{2 * _NODE_R}"/>' if _is_boundary_op(graph, v)
                 else f'<circle cx="{x:.0f}" cy="{y:.0f}" r="{_NODE_R}"/>')
        return (f'<g class="{cls}" id="{node_id(v, ki)}" data-op="{html.escape(node.name)}">'
                f'{shape}<title>{html.escape(node.name)} = {html.escape(node.opcode)}</title>'
                f'</g>')

    # Edges first (drawn under the nodes): a copy reads its producer from its own kernel
    # when it is recomputed there, else from the first kernel (launch order) holding it.
    edges = []
    for v, ki in instances:
        members = set(gplan.kernels[ki].members) if ki is not None else set()
        for u in dict.fromkeys(graph.nodes[v].operands):
            src = (u, ki) if u in members else (u, where[u][0] if u in where else None)
            (x1, y1), (x2, y2) = pos[src], pos[(v, ki)]
            edges.append(f'<line class="edge" data-src="{node_id(*src)}" '
                         f'data-dst="{node_id(v, ki)}" x1="{x1:.0f}" y1="{y1:.0f}" '
                         f'x2="{x2:.0f}" y2="{y2:.0f}"/>')
    parts = [f'<svg class="dataflow" '
             f'data-side="{side}" viewBox="0 0 {width:.0f} {height:.0f}" '
             f'width="{width:.0f}" height="{height:.0f}">',
             '<g class="edges">', *edges, "</g>"]
    for ki, kernel in enumerate(gplan.kernels):
        xs = [pos[(v, ki)][0] for v in kernel.members]
        ys = [pos[(v, ki)][1] for v in kernel.members]
        pad = _NODE_R + 4
        box = (f'<rect class="kbox" x="{min(xs) - pad:.0f}" y="{min(ys) - pad:.0f}" '
               f'width="{max(xs) - min(xs) + 2 * pad:.0f}" '
               f'height="{max(ys) - min(ys) + 2 * pad:.0f}" rx="6" '
               f'fill="{kernel_fill(kernel, ki)}" '
               f'stroke="{_KIND_BORDER.get(kernel.kind, "#333333")}"/>')
        label = (f"{side[0]}{ki} {kernel.name}: {kernel.kind}, {len(kernel.members)} ops, "
                 f"{human_bytes(kernel.cost.hbm_bytes)}, {kernel_us(kernel):.2f} µs")
        parts.append(f'<g class="kernel" id="{prefix}k{ki}" data-kernel="{side[0]}{ki}">'
                     f'<title>{html.escape(label)}</title>{box}'
                     + "".join(node_svg(v, ki) for v in kernel.members) + "</g>")
    parts += [node_svg(v, None) for v in range(len(graph.nodes)) if v not in where]
    parts.append("</svg>")
    return "".join(parts)


def _html_reasons(all_reasons: list[str], result: GraphResult) -> list[str]:
    """The graph's lines of ``FusionPlan.reasons`` (why a producer and its consumer ended
    up in different stitched kernels)."""
    head = f"{result.graph.name}: "
    lines = [line[len(head):] for line in all_reasons if line.startswith(head)]
    out = [f'<details class="reasons"><summary>why producers were not fused with their '
           f'consumers ({len(lines)})</summary><ul>']
    out += [f"<li>{html.escape(line)}</li>" for line in lines]
    out.append("</ul></details>")
    return out


def to_html(plan: FusionPlan, reasons: bool = False,
            source: Callable[[OpGraph, int], str] | None = None) -> str:
    """A self-contained HTML page (inline CSS and SVG, no scripts): the summary table, then
    per graph the baseline and stitched plans side by side, each as a dataflow picture
    (``plan_svg``) and as its kernels in launch order; ``reasons`` adds, per graph, why
    producers were not fused with their consumers."""
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
    # source(graph, node): the producer's place in the user's code (FusionPlan.reasons)
    all_reasons = plan.reasons(source) if reasons else []
    for gi, result in enumerate(plan.graphs):
        out += _html_graph(result, gi)
        if reasons:
            out[-1:-1] = _html_reasons(all_reasons, result)
    out.append("</body></html>")
    log.debug("rendered HTML for %s: %d graphs", plan.module_name, len(plan.graphs))
    return "\n".join(out) + "\n"
