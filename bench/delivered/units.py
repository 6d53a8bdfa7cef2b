"""Planning XLA's own modules with ops vs with XLA's instructions as the explorer's units
(``ExplorerOptions.xla_units``, what the XLA pass does), on the modules the pass plans.

``python -m bench.delivered.units [--modules DIR | --zoo] [--out docs/benchmarks.md]``

Modules: the ``.hlo`` files in DIR (written by the pass with ``STITCH_DUMP_MODULES``), or by
default captured here: each model's tiny training step compiled deviceless for an H100 with
the pass on, in the venv scripts/deviceless_check.sh makes (``STITCH_CUDA_VENV``, default
.venv-cuda). ``--zoo``: the zoo's XLA GPU (H100) fixtures, hlo_fixtures/data/*/*.gpu-h100.hlo, in
a summary (section bench-xla-units-zoo). Per module and mode: planning CPU seconds (one thread, no cache), the modeled µs
of the plan as planned, of what snapping leaves (the plan's kernels snapped to whole XLA
instructions, stitch.xla_pass.snap, at least two XLA kernels each, plus XLA's kernels for the
rest: an upper bound, before lowering, building, payback and the rewrite), and — where the
pass's own ``<module>.summary.json`` lies beside the module (the pass writes it with
``STITCH_DUMP_MODULES``) — what the pass delivered (stitch/xla_pass/delivered.py: the final
module priced as XLA's), all by the delta cost model (counted and modeled, not measured).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from bench.report import REPO

SECTION = "bench-xla-units"
MODELS = ("bert_layer_train", "transformer_train", "keras_hub_llama")


def capture(folder: Path, models: tuple[str, ...] = MODELS) -> list[Path]:
    """The pass's modules for ``models`` (tiny), compiled deviceless, written to ``folder``."""
    venv = Path(os.environ.get("STITCH_CUDA_VENV", REPO / ".venv-cuda"))
    python = venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{python} not found: run scripts/deviceless_check.sh first, or "
                         "pass --modules DIR")
    for model in models:
        with tempfile.TemporaryDirectory() as cache:
            os.chmod(cache, 0o700)
            env = {**os.environ, "STITCH_DUMP_MODULES": str(folder), "STITCH_CACHE_DIR": cache,
                   "CUDA_VISIBLE_DEVICES": "-1", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1",
                   "PYTHONPATH": str(REPO)}
            run = subprocess.run([str(python), "-m", "bench.compile.in_xla", "--one-gpu",
                                  f"{model}:tiny"], env=env, capture_output=True, text=True,
                                 timeout=1800)
            if run.returncode != 0:
                print(f"[xla_units] {model}: capture failed: "
                      f"{(run.stderr.strip().splitlines() or ['?'])[-1]}", file=sys.stderr)
    return sorted(folder.glob("*.hlo"))


def placed_modeled_us(module, fusion_plan, spec) -> tuple[float, int]:
    """Modeled µs of what the pass can place from ``fusion_plan`` (snapped, placeable
    kernels, XLA's kernels for the rest) and how many kernels that is."""
    from stitch.xla_pass.hlo_rewrite import ComputationView, NotPlaceable, find_site
    from stitch.xla_pass.snap import snap_kernels
    from stitch.pricing.delta import CostModel

    total, placed = 0.0, 0
    for gi, gp in enumerate(fusion_plan.graphs):
        cost = CostModel(gp.graph, spec, gemm_chains=False)
        view = ComputationView(module, gp.graph)
        scheduled = [k for k in gp.stitched.kernels if k.schedule is not None]
        snapped, _ = snap_kernels(view, scheduled, spec)
        taken: set[int] = set()
        for k in snapped:
            try:
                find_site(view, gi, k.name, k.members)
            except NotPlaceable:
                continue
            total += cost.kernel(frozenset(k.members)).total_s * gp.stitched.weight
            taken |= set(k.members)
            placed += 1
        total += sum(b.cost.total_s for b in gp.baseline.kernels
                     if not taken & set(b.members)) * gp.stitched.weight
    return total * 1e6, placed


def delivered_us(path: Path) -> float | None:
    """Modeled µs of all kernels of the module the pass returned for ``path``, from the
    summary the pass wrote beside it (None where there is none)."""
    import json
    summary = path.with_suffix(".summary.json")
    if not summary.exists():
        return None
    got = json.loads(summary.read_text())
    if "delivered_mem_us" not in got:
        return None
    # The summary counts memory-intensive kernels; the rest (GEMMs...) are XLA's either way.
    return got["delivered_mem_us"]


def measure(path: Path) -> list[dict]:
    from stitch.hlo import parse_hlo
    from stitch.cost.gpu_specs import get_spec
    from stitch.explorer.planner import ExplorerOptions, plan

    spec = get_spec("h100")
    module = parse_hlo(path.read_text())
    rows = []
    # Units first: whatever the first plan warms (process-wide chain-pricing caches) then
    # favours the op-level plan, not the one this compares it with.
    for units in (True, False):
        start = time.thread_time()
        fusion_plan = plan(module, "h100", options=ExplorerOptions(xla_units=units))
        seconds = time.thread_time() - start
        summary = fusion_plan.summary()
        modeled, placed = placed_modeled_us(module, fusion_plan, spec)
        rows.append({"module": path.stem, "mode": "XLA units" if units else "ops",
                     "ops": sum(len(g.graph.nodes) for g in fusion_plan.graphs),
                     "plan_cpu_s": seconds, "baseline_us": summary["baseline"]["modeled_us"],
                     "planned_us": summary["stitched"]["modeled_us"],
                     "placed_us": modeled, "placed": placed,
                     "baseline_mem_us": summary["baseline"]["mem_modeled_us"],
                     "delivered_mem_us": delivered_us(path) if units else None})
        print(f"[xla_units] {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def _warm_up() -> None:
    """One small plan first, so no measured plan pays the planner's imports."""
    from stitch.explorer.planner import plan
    plan("HloModule w\nENTRY e {\n  p = f32[64,64] parameter(0)\n  a = f32[64,64] exponential(p)\n"
         "  ROOT b = f32[64,64] negate(a)\n}", "h100")


def markdown(rows: list[dict], command: str) -> str:
    from bench.report import stamp
    lines = ["## Planning the pass's modules: ops vs XLA units (counted and modeled)", "",
             stamp(command, os.getloadavg()), "",
             "The modules XLA GPU hands stitch's pass (tiny training steps, deviceless H100). "
             "*plan s*: planning CPU seconds, no cache. *XLA's kernels*: the module as XLA "
             "made it. *planned*: the plan as the planner models it. *snapped*: the plan snapped "
             "to whole XLA instructions, kernels of at least two of them, with XLA's kernels "
             "for the rest — an upper bound on what the pass places (before lowering, "
             "building, payback and the rewrite). *delivered mem*: memory-intensive µs of the "
             "module the pass returned (its own pricing, stitch/xla_pass/delivered.py; against "
             "*XLA mem*), where the capture left the pass's summary. Modeled µs, delta cost "
             "model, H100.", "",
             "| module | ops | vertices | plan s | XLA's kernels µs | planned µs | snapped µs "
             "| kernels snapped | XLA mem µs | delivered mem µs |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        delivered = "–" if r.get("delivered_mem_us") is None else f"{r['delivered_mem_us']:.1f}"
        lines.append(f"| {r['module']} | {r['ops']} | {r['mode']} | {r['plan_cpu_s']:.2f} | "
                     f"{r['baseline_us']:.1f} | {r['planned_us']:.1f} | {r['placed_us']:.1f} | "
                     f"{r['placed']} | {r['baseline_mem_us']:.1f} | {delivered} |")
    return "\n".join(lines)


def zoo_markdown(rows: list[dict], command: str) -> str:
    """Totals over the zoo's fixtures and the modules whose placed µs differ by over 0.1%."""
    from bench.report import stamp
    pairs: dict[str, dict[str, dict]] = {}
    for r in rows:
        pairs.setdefault(r["module"], {})[r["mode"]] = r
    units = [p["XLA units"] for p in pairs.values()]
    ops = [p["ops"] for p in pairs.values()]
    better = [m for m, p in pairs.items()
              if p["XLA units"]["placed_us"] < p["ops"]["placed_us"] * 0.999]
    worse = [m for m, p in pairs.items()
             if p["XLA units"]["placed_us"] > p["ops"]["placed_us"] * 1.001]
    lines = ["## Planning the zoo's XLA GPU modules: ops vs XLA units (counted and modeled)", "",
             stamp(command, os.getloadavg()), "",
             f"The {len(pairs)} XLA GPU (H100) fixtures of hlo_fixtures/data, each planned both ways "
             "(columns as in the section above). Totals: planning CPU "
             f"{sum(r['plan_cpu_s'] for r in units):.1f} s with XLA units against "
             f"{sum(r['plan_cpu_s'] for r in ops):.1f} s with ops; placed "
             f"{sum(r['placed_us'] for r in units):,.0f} µs against "
             f"{sum(r['placed_us'] for r in ops):,.0f} µs. Units place a faster plan on "
             f"{len(better)} modules, a slower one on {len(worse)}, the same on "
             f"{len(pairs) - len(better) - len(worse)}. The modules that differ:", "",
             "| module | plan s units / ops | placed µs units | placed µs ops | units / ops |",
             "|---|---:|---:|---:|---:|"]
    for m in sorted(better + worse):
        u, o = pairs[m]["XLA units"], pairs[m]["ops"]
        lines.append(f"| {m} | {u['plan_cpu_s']:.2f} / {o['plan_cpu_s']:.2f} | "
                     f"{u['placed_us']:.1f} | {o['placed_us']:.1f} | "
                     f"{u['placed_us'] / o['placed_us']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.delivered.units",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--modules", type=Path, help="a folder of .hlo files the pass wrote")
    parser.add_argument("--zoo", action="store_true",
                        help="the zoo's XLA GPU fixtures (hlo_fixtures/data/*/*.gpu-h100.hlo)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    _warm_up()
    if args.zoo:
        data = REPO / "hlo_fixtures" / "data"
        rows = []
        for path in sorted(data.glob("*/*.gpu-h100.hlo")):
            for r in measure(path):
                r["module"] = f"{path.parent.name} ({path.name.split('.')[0]})"
                rows.append(r)
        text = zoo_markdown(rows, "python -m bench.delivered.units --zoo")
        if args.out:
            from bench.report import write_section
            write_section(args.out, SECTION + "-zoo", text, after=SECTION)
        else:
            print(text)
        return
    with tempfile.TemporaryDirectory() as tmp:
        paths = sorted(args.modules.glob("*.hlo")) if args.modules else capture(Path(tmp))
        rows = [r for p in paths for r in measure(p)]
    command = "python -m bench.delivered.units" + (f" --modules {args.modules}" if args.modules
                                               else "")
    text = markdown(rows, command)
    if args.out:
        from bench.report import write_section
        write_section(args.out, SECTION, text, after="bench-pass-compile-gpu")
    else:
        print(text)


if __name__ == "__main__":
    main()
