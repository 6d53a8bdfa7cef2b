"""Measure ``headline``: the report's first table, stitch against XLA per target, from the
numbers the other measures kept (docs/data/*.json: ``plans``, ``delivered``, ``segments``,
``compile``).
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
        bound = [plans.get(t, {}) for t in ("v100", "a100", "h100")]
        lines.append("| zoo training graphs: one-kernel bytes bound / XLA | counted | "
                     + " | ".join(_x(b["bytes_bound"], b["mem_bytes"][0])
                                  if "bytes_bound" in b else "–" for b in bound) + " |")
        lines.append(f"| all {plans.get('models', '?')} zoo models: mem-intensive kernels, "
                     "stitch / XLA | counted | "
                     + " | ".join(_x(b["all_mem_kernels"][1], b["all_mem_kernels"][0])
                                  if "all_mem_kernels" in b else "–" for b in bound) + " |")
        if "pairs" in plans:
            lines.append("| zoo model × target pairs worse than XLA on any column | counted | "
                         f"{plans['worse']} of {plans['pairs']} ||| ")
    delivered = ctx.load("delivered") or []
    if delivered:
        xla = sum(r["xla_mem_us"] for r in delivered)
        planned = sum(r["planned_mem_us"] for r in delivered)
        got = sum(r["delivered_mem_us"] for r in delivered)
        share = (xla - got) / (xla - planned) if xla > planned else 1.0
        lines.append(f"| {len(delivered)} third-party training steps (deviceless H100, the XLA "
                     "pass): mem µs, XLA → planned → delivered | modeled | – | – | "
                     f"{xla:.0f} → {planned:.0f} → {got:.0f} ({_x(xla, got)} faster delivered; "
                     f"{share:.0%} of the planned saving) |")
        if all("xla_mem_bytes" in r for r in delivered):
            moved = sum(r["delivered_mem_bytes"] for r in delivered)
            base = sum(r["xla_mem_bytes"] for r in delivered)
            lines.append(f"| {len(delivered)} third-party training steps: mem bytes, delivered "
                         f"/ XLA | counted | – | – | {_x(moved, base)} |")
    segments = {r["case"]: r for r in ctx.load("segments") or []}
    shown = [segments[c] for c in ("10000x64 f32 fwd+grad", "50000x128 f32 fwd+grad")
             if c in segments]
    if shown:
        lines.append("| segmented softmax fwd+grad, " + " / ".join(
            r["case"].split()[0].replace("x", "×") for r in shown)
            + " (deviceless H100, the XLA pass): mem µs and kernels, XLA → delivered | "
            "modeled | – | – | " + "; ".join(
                f"{r['xla_mem_us']:.0f} → {r['delivered_mem_us']:.1f} µs, "
                f"{r['kernels_before']} → {r['kernels_after']} kernels" for r in shown) + " |")
    compiled = ctx.load("compile")
    if compiled:
        lines.append(f"| compile, {compiled['models']} zoo models: stitch / jax.jit "
                     f"| measured (CPU) | {_x(compiled['stitch_s'], compiled['jax_s'])} "
                     "||| ")
    else:
        lines.append("| compile overhead | measured | see [Compile cost](#compile-cost-measured) "
                     "(`python -m bench compile`) ||| ")
    links = [ctx.image_link(name) for name in ("delivered_steps", "plans_bytes_bound")]
    return lines + ["", NONE_YET] + [x for link in links if link for x in ("", link)]


MEASURE = Measure(
    name="headline",
    title="Headline: stitch against XLA",
    summary="Counted: from the modules themselves. Modeled: stitch's latency-evaluator or "
            "XLA's own GpuPerformanceModel formulas. Measured: wall time on the named machine.",
    parts=(Part("table", "Per target", run_table),),
)
