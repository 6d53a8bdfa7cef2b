"""Measure ``headline``: the report's first table, stitch against XLA per target, from the
numbers the other measures kept (docs/data/*.json: ``plans``, ``delivered``, ``compile``).
Run it after them (``python -m bench all`` does)."""
from __future__ import annotations

from bench.gpu import NONE_YET
from bench.measure import Context, Measure, Part


def _x(a: float, b: float) -> str:
    return f"{a / b:.2f}×" if b else "–"


def run_table(ctx: Context) -> list[str]:
    lines = ["| measure | label | " + " | ".join(t.upper() for t in ("v100", "a100", "h100"))
             + " |", "|---|---|---:|---:|---:|"]
    plans = ctx.load("plans") or {}
    if plans:
        rows = (("zoo training graphs: mem-intensive kernels, stitch / XLA", "counted",
                 "mem_kernels", False),
                ("zoo training graphs: mem-intensive bytes, stitch / XLA", "counted",
                 "mem_bytes", False),
                ("zoo training graphs: mem time, XLA / stitch (latency-evaluator)", "modeled",
                 "latency_us", True),
                ("zoo training graphs: mem time, XLA / stitch (XLA's formulas)", "modeled",
                 "formula_us", True))
        for label, kind, key, invert in rows:
            cells = []
            for target in ("v100", "a100", "h100"):
                pair = plans.get(target, {}).get(key)
                cells.append("–" if not pair else
                             _x(pair[0], pair[1]) if invert else _x(pair[1], pair[0]))
            lines.append(f"| {label} | {kind} | " + " | ".join(cells) + " |")
    delivered = ctx.load("delivered") or []
    if delivered:
        xla = sum(r["xla_mem_us"] for r in delivered)
        planned = sum(r["planned_mem_us"] for r in delivered)
        got = sum(r["delivered_mem_us"] for r in delivered)
        lines.append(f"| {len(delivered)} third-party steps: mem µs XLA / planned / delivered "
                     f"| modeled | – | – | {xla:.0f} / {planned:.0f} / {got:.0f} |")
    compiled = ctx.load("compile")
    if compiled:
        lines.append(f"| compile, {compiled['models']} zoo models: stitch / jax.jit "
                     f"| measured (CPU) | {_x(compiled['stitch_s'], compiled['jax_s'])} "
                     "||| ")
    links = [ctx.image_link(name) for name in ("delivered_steps", "plans_bytes_bound")]
    return lines + ["", NONE_YET] + [x for link in links if link for x in ("", link)]


MEASURE = Measure(
    name="headline",
    title="Headline: stitch against XLA",
    summary="Counted: from the modules themselves. Modeled: stitch's latency-evaluator or "
            "XLA's own GpuPerformanceModel formulas. Measured: wall time on the named machine.",
    parts=(Part("table", "Per target", run_table),),
)
