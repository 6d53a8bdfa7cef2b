"""The ``stitch`` command line.

  stitch models                          list the model zoo (needs jax)
  stitch hlo MODEL [--config] [--stage]  print a zoo model's HLO (pre-optimization or XLA CPU)
  stitch explain MODEL|FILE [--gpu]      parse HLO and report its structure and XLA's kernels
  stitch plan FILE | --model NAME        plan the fusion: baseline vs stitched kernels

This module is the user interface, so it writes to stdout; library code logs instead.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import pathlib
import sys
import time
from collections import Counter

from stitch.hlo import HloModule, StitchError, parse_hlo
from stitch.hlo.kernels import count_kernels

log = logging.getLogger("stitch")

# Committed fixtures, present when stitch runs from a source checkout.
_FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "hlo_fixtures" / "data"
GPU_TARGETS = ("v100", "a100", "h100")


def _zoo_hlo(model: str, config: str, stage: str) -> str:
    """HLO text of a zoo model, generated with jax ('pre' or 'cpu' stage)."""
    try:
        import jax
    except ImportError as exc:
        raise StitchError("generating HLO from the zoo needs jax: pip install 'stitch[jax]'") from exc
    from .models import build

    inst = build(model, config)
    lowered = jax.jit(inst.fn).lower(*inst.arg_specs)
    return lowered.as_text(dialect="hlo") if stage == "pre" else lowered.compile().as_text()


def _resolve(source: str, config: str, gpu: str | None) -> tuple[str, str]:
    """(HLO text, where it came from) for a file path or a zoo model name."""
    path = pathlib.Path(source)
    if path.is_file():
        return path.read_text(), str(path)
    fixture = _FIXTURES / source / f"{config}.{'gpu-' + gpu if gpu else 'pre'}.hlo"
    if fixture.is_file():
        return fixture.read_text(), f"fixture {fixture.relative_to(_FIXTURES.parent.parent)}"
    if gpu:
        raise StitchError(f"no XLA GPU fixture for {source!r} ({config}, {gpu}); XLA GPU HLO "
                          "comes from scripts/gen_fixtures.py in a source checkout")
    return _zoo_hlo(source, config, "pre"), f"jax lowering of zoo model {source!r} ({config})"


def _explain(module: HloModule, origin: str, parse_seconds: float, show_kernels: bool) -> str:
    insts = [i for _, i in module.instructions()]
    opcodes = Counter(i.opcode for i in insts)
    entry_params = module.entry.parameters
    kernels = count_kernels(module)
    lines = [
        f"module {module.name}  ({origin})",
        f"  parsed in {parse_seconds * 1e3:.1f} ms: {len(module.computations)} computations, "
        f"{len(insts)} instructions, {len(entry_params)} entry parameters",
        "  top opcodes: " + ", ".join(f"{op} {n}" for op, n in opcodes.most_common(8)),
    ]
    fused = any(i.opcode == "fusion" for i in insts)
    lines.append(f"  kernels ({'XLA fusion decisions' if fused else 'unfused: one per op'}): "
                 f"{kernels.count()} total, {kernels.count('memory')} memory-intensive, "
                 f"{kernels.count('gemm')} GEMM/conv, {kernels.count('opaque')} opaque; "
                 f"{kernels.count(dynamic=True)} launches counting loop trips")
    for detail, n in sorted(kernels.by_detail().items()):
        lines.append(f"    {n:4d}  {detail}")
    if module.unknown_opcodes:
        lines.append(f"  unknown opcodes: {module.unknown_opcodes[:10]}")
    if show_kernels:
        for k in kernels.kernels:
            lines.append(f"    {k.computation}/{k.instruction}: {k.category} {k.detail}"
                         + (f" x{k.launches}" if k.launches > 1 else ""))
    return "\n".join(lines)


def _cmd_models(args: argparse.Namespace) -> int:
    from .models import get_model, list_models

    for name in list_models():
        spec = get_model(name)
        print(f"{name:28s} {spec.kind:9s} {spec.description}")
    return 0


def _cmd_hlo(args: argparse.Namespace) -> int:
    sys.stdout.write(_zoo_hlo(args.model, args.config, args.stage))
    return 0


def _cmd_explain(args: argparse.Namespace) -> int:
    gpus = GPU_TARGETS if args.gpu == "all" else ((args.gpu,) if args.gpu else (None,))
    for gpu in gpus:
        text, origin = _resolve(args.source, args.config, gpu)
        start = time.perf_counter()
        module = parse_hlo(text)
        print(_explain(module, origin, time.perf_counter() - start, args.kernels))
    return 0


PLAN_TARGETS = ("v100", "a100", "h100", "h200")
PLAN_PLANNERS = ("beam", "blp")
_OPS_SHOWN = 4


def _plan_input(args: argparse.Namespace) -> tuple[str, str, list[str]]:
    """(HLO text, where it came from, notes) for ``stitch plan``'s FILE or --model."""
    notes: list[str] = []
    if (args.file is None) == (args.model is None):
        raise StitchError("plan needs exactly one input: an HLO file or --model NAME")
    if args.model is None:
        if args.pre:
            raise StitchError("--pre selects a zoo fixture: use it with --model NAME")
        path = pathlib.Path(args.file)
        if not path.is_file():
            hint = (f" (a zoo model? use --model {args.file})"
                    if (_FIXTURES / args.file).is_dir() else "")
            raise StitchError(f"no such HLO file: {args.file!r}{hint}")
        try:
            return path.read_text(), str(path), notes
        except (OSError, UnicodeDecodeError) as exc:
            raise StitchError(f"cannot read HLO file {args.file!r}: {exc}") from exc
    model_dir = _FIXTURES / args.model
    if not args.model or args.model == "tf" or not model_dir.is_dir():
        known = sorted(p.name for p in _FIXTURES.glob("*") if p.is_dir() and p.name != "tf")
        raise StitchError(f"unknown model {args.model!r} (no fixtures under hlo_fixtures/data); "
                          f"models with fixtures: {', '.join(known) or 'none'}")
    if args.pre:
        stage = "pre"
    else:
        gpu = args.target
        if gpu not in GPU_TARGETS:
            # XLA has no H200 target description; H200 is an H100 SM with faster HBM, so
            # XLA's H100 fusion decisions are the nearest baseline.
            notes.append(f"no XLA fixture for {gpu}: using the h100 XLA-optimized HLO, "
                         f"planned with the {gpu} cost model")
            gpu = "h100"
        stage = f"gpu-{gpu}"
    fixture = model_dir / f"{args.config}.{stage}.hlo"
    if not fixture.is_file():
        raise StitchError(f"model {args.model!r} has no fixture {fixture.name} "
                          f"(config {args.config})")
    return fixture.read_text(), f"fixture {fixture.relative_to(_FIXTURES.parent.parent)}", notes


def _json_safe(value):
    """Plain JSON: non-finite floats (an unbounded MIP gap) become null, tuples lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    return str(value)


def _kernel_json(gplan, kernel) -> dict:
    out = {"name": kernel.name, "kind": kernel.kind, "origin": kernel.origin,
           "ops": gplan.ops(kernel), "hbm_bytes": kernel.cost.hbm_bytes,
           "launches": kernel.cost.launches,
           "cost_model_us": round(kernel.cost.total_s * 1e6, 3),
           "modeled_us": round(kernel.modeled_us, 3)}
    if kernel.schedule is not None:
        occ = kernel.occupancy
        out.update({"schemes": kernel.schemes, "grid": kernel.grid, "block": kernel.block,
                    "smem_bytes": kernel.smem_bytes, "regs_estimate": kernel.regs_estimate,
                    "occupancy": round(occ.occupancy, 3), "occupancy_limiter": occ.limiter,
                    "bound": kernel.schedule.bound})
    elif kernel.schedule_note:
        out["schedule_note"] = kernel.schedule_note
    if kernel.chain_schedule is not None:
        out["chain_schedule"] = dataclasses.asdict(kernel.chain_schedule)
    return out


def _schedule_cell(kernel) -> str:
    """schemes, launch and resources of a scheduled kernel in a few characters."""
    if kernel.schedule is None:
        return ""
    schemes = "+".join(dict.fromkeys(kernel.schemes))
    return (f"{schemes} <<<{kernel.grid},{kernel.block}>>> smem {kernel.smem_bytes} "
            f"regs {kernel.regs_estimate} occ {kernel.occupancy.occupancy:.2f} "
            f"L {kernel.modeled_us:.2f} µs")


def _plan_json(fusion_plan, origin: str, notes: list[str], with_reasons: bool,
               kernel_where: dict[str, str] | None = None, node_where=None) -> dict:
    graphs = []
    for result in fusion_plan.graphs:
        report = result.report
        graphs.append({
            "name": result.graph.name, "kind": result.graph.kind,
            "ops": len(result.graph.nodes), "weight": result.stitched.weight,
            "report": {"planner": report.planner, "status": report.status, "gap": report.gap,
                       "seconds": round(report.seconds, 3),
                       "objective_us": round(report.objective_s * 1e6, 3),
                       "detail": report.detail},
            "baseline": [_kernel_json(result.baseline, k) for k in result.baseline.kernels],
            "stitched": [_kernel_json(result.stitched, k) for k in result.stitched.kernels],
        })
    out = {"module": fusion_plan.module_name, "input": origin, "notes": notes,
           "summary": fusion_plan.summary(), "graphs": graphs}
    if kernel_where:
        out["where"] = {k: w for k, w in kernel_where.items() if w}
    if with_reasons:
        out["reasons"] = fusion_plan.reasons(node_where)
    return _json_safe(out)


def _plan_table(fusion_plan, origin: str, notes: list[str],
                kernel_where: dict[str, str] | None = None) -> str:
    from .explorer.render import human_bytes, kernel_us, report_line, summary_rows

    summary = fusion_plan.summary()
    source = ("XLA's fusions in the input" if fusion_plan.baseline_source == "xla"
              else "the base fusion pass on unfused HLO")
    lines = [f"plan {fusion_plan.module_name}  ({origin})"]
    lines += [f"  note: {n}" for n in notes]
    lines += [f"  target {fusion_plan.target}, planner {fusion_plan.planner}, "
              f"baseline: {source} ({fusion_plan.baseline_source}), "
              f"planned in {fusion_plan.seconds:.2f} s"]
    if fusion_plan.baseline_source != "xla":
        lines.append("  note: pre-optimization input: the baseline is stitch's base fusion, "
                     "weaker than XLA's own; plan XLA's optimized module "
                     "(jax.jit(f).lower(...).compile().as_text()) to compare with XLA")
    # The header names the baseline: XLA's own fusion, or stitch's base fusion.
    compared = ("baseline = XLA's fusion" if fusion_plan.baseline_source == "xla"
                else "baseline = base fusion")
    lines += ["", f"  {compared:28s} {'baseline':>12s} {'stitched':>12s} {'ratio':>7s}"]
    for label, base, stitched, ratio in summary_rows(summary):
        lines.append(f"  {label:28s} {base:>12s} {stitched:>12s} {ratio:>7s}")
    lines += ["", "  planner status per graph:"]
    for result in fusion_plan.graphs:
        lines.append(f"    {result.graph.name}: {report_line(result)}")
    for result in fusion_plan.graphs:
        graph, stitched = result.graph, result.stitched
        lines += ["", f"graph {graph.name} ({graph.kind}, {len(graph.nodes)} ops, runs "
                      f"x{stitched.weight}): {len(stitched.kernels)} stitched kernels "
                      f"(baseline {len(result.baseline.kernels)}), launch order",
                  f"  {'#':>4s}  {'name':24s} {'kind':7s} {'origin':9s} {'ops':>4s} "
                  f"{'bytes':>10s} {'µs':>9s}  schedule / ops"]
        for ki, kernel in enumerate(stitched.kernels):
            # Free ops (bitcasts, tuple plumbing) say little: list the computing ops first.
            names = sorted(kernel.members, key=lambda v: (graph.is_free(v), v))
            shown = ", ".join(graph.nodes[v].name for v in names[:_OPS_SHOWN])
            if len(names) > _OPS_SHOWN:
                shown += f", ... (+{len(names) - _OPS_SHOWN})"
            lines.append(f"  {ki:4d}  {kernel.name:24s} {kernel.kind:7s} {kernel.origin:9s} "
                         f"{len(kernel.members):4d} {human_bytes(kernel.cost.hbm_bytes):>10s} "
                         f"{kernel_us(kernel):9.2f}  {_schedule_cell(kernel)}")
            lines.append(f"  {'':4s}  {'':24s} ops: {shown}")
            if (kernel_where or {}).get(kernel.name):
                lines.append(f"  {'':4s}  {'':24s} from: {kernel_where[kernel.name]}")
    return "\n".join(lines)


def _cmd_plan(args: argparse.Namespace) -> int:
    from .cost.gpu_specs import get_spec
    from .explorer.planner import ExplorerOptions, plan

    # Target and planner are checked before any file is read, with the library's messages.
    args.target = get_spec(args.target).name     # canonical spelling: "H100" -> "h100"
    if args.planner not in PLAN_PLANNERS:
        raise StitchError(f"unknown planner {args.planner!r}: choose one of "
                          f"{', '.join(PLAN_PLANNERS)}")
    text, origin, notes = _plan_input(args)
    try:
        module = parse_hlo(text)
    except StitchError as exc:
        raise StitchError(f"cannot parse {origin}: {exc}") from exc
    try:
        fusion_plan = plan(module, target=args.target, planner=args.planner,
                           options=ExplorerOptions(xla_units=args.xla_units))
    except ImportError as exc:
        # Unfused input needs the base fusion pass for its baseline; it may be missing.
        raise StitchError(f"planning {origin} needs the base fusion pass "
                          f"(stitch.hlo.base_fusion), which cannot be imported: {exc}") from exc
    except StitchError as exc:
        raise StitchError(f"planning {origin} failed: {exc}") from exc
    from .hlo.source_lines import SourceLines, plan_sources
    sources = SourceLines(module)
    kernel_where = plan_sources(module, fusion_plan)

    def node_where(graph, nid: int) -> str:
        return sources.where([graph.nodes[nid].instruction])

    # Files first, so a reader closing stdout early (| head) cannot lose them.
    written = []
    if args.html or args.dot:
        from .explorer.render import to_dot, to_html

        def html_page(fusion_plan) -> str:
            return to_html(fusion_plan, reasons=args.reasons, source=node_where)

        for out, render, what in ((args.html, html_page, "HTML"), (args.dot, to_dot, "DOT")):
            if not out:
                continue
            try:
                pathlib.Path(out).write_text(render(fusion_plan), encoding="utf-8")
            except OSError as exc:
                raise StitchError(f"cannot write {what} to {out!r}: {exc}") from exc
            written.append(f"wrote {what} to {out}")
    if args.json:
        print(json.dumps(_plan_json(fusion_plan, origin, notes, args.reasons, kernel_where,
                                    node_where), indent=1))
    else:
        print(_plan_table(fusion_plan, origin, notes, kernel_where))
        if args.reasons:
            reasons = fusion_plan.reasons(node_where)
            print(f"\nwhy producers were not fused with their consumers ({len(reasons)}):")
            for line in reasons:
                print(f"  {line}")
    # With --json, stdout carries the JSON document only: notices go to stderr.
    for line in written:
        print(line, file=sys.stderr if args.json else sys.stdout)
    return 0


def _cmd_settings(args: argparse.Namespace) -> int:
    from stitch.config import settings_markdown
    print(settings_markdown())
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from stitch.frontends.jax.demo import run_demo

    if args.target not in PLAN_TARGETS:
        raise StitchError(f"unknown target {args.target!r} (one of {', '.join(PLAN_TARGETS)})")
    report = run_demo(args.model, args.config, args.target, steps=args.steps,
                      ptxas=not args.no_ptxas, out=lambda line: print(line, flush=True))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    ok = report["switched_at_call"] is not None and report["max_loss_rel_diff"] <= 1e-4
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stitch", description="FusionStitching for XLA.")
    parser.add_argument("--log", default=None, help="logging level (default: STITCH_LOG or warning)")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("models", help="list the model zoo").set_defaults(func=_cmd_models)

    hlo = sub.add_parser("hlo", help="print a zoo model's HLO")
    hlo.add_argument("model")
    hlo.add_argument("--config", default="tiny", choices=("tiny", "full"))
    hlo.add_argument("--stage", default="pre", choices=("pre", "cpu"))
    hlo.set_defaults(func=_cmd_hlo)

    explain = sub.add_parser("explain", help="parse HLO and report its structure and kernels")
    explain.add_argument("source", help="an HLO file or a zoo model name")
    explain.add_argument("--config", default="full", choices=("tiny", "full"))
    explain.add_argument("--gpu", choices=(*GPU_TARGETS, "all"),
                         help="use the committed XLA GPU fixture for this target")
    explain.add_argument("--kernels", action="store_true", help="list every kernel")
    explain.set_defaults(func=_cmd_explain)

    plan = sub.add_parser("plan", help="plan the fusion of HLO: baseline vs stitched kernels")
    plan.add_argument("file", nargs="?", help="an HLO file (or use --model)")
    plan.add_argument("--model", help="a zoo model: plan its committed fixture")
    plan.add_argument("--config", default="full", choices=("tiny", "full"))
    plan.add_argument("--pre", action="store_true",
                      help="with --model: plan the pre-optimization HLO (baseline from the "
                           "base fusion pass) instead of XLA's optimized HLO")
    # Target and planner are validated by the command, so errors name the bad value the
    # same way the library does.
    plan.add_argument("--target", default="h100", help=f"one of {', '.join(PLAN_TARGETS)}")
    plan.add_argument("--planner", default="beam", help=f"one of {', '.join(PLAN_PLANNERS)}")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--html", metavar="OUT", help="write a self-contained HTML view")
    plan.add_argument("--dot", metavar="OUT", help="write a Graphviz DOT view")
    plan.add_argument("--reasons", action="store_true",
                      help="say why producers were not fused with their consumers")
    plan.add_argument("--xla-units", action="store_true",
                      help="plan XLA's optimized HLO with its instructions as units (a fusion "
                           "is never cut), as stitch's XLA pass does")
    plan.set_defaults(func=_cmd_plan)

    demo = sub.add_parser("demo", help="train a zoo model under stitch.jit (the main job)")
    demo.add_argument("--model", default="bert_layer_train")
    demo.add_argument("--config", default="tiny", choices=("tiny", "full"))
    demo.add_argument("--target", default="h100", help=f"one of {', '.join(PLAN_TARGETS)}")
    demo.add_argument("--steps", type=int, default=40,
                      help="steps at least, and steps after the switch")
    demo.add_argument("--no-ptxas", action="store_true", help="skip the ptxas check")
    demo.add_argument("--json", metavar="OUT", help="also write the report as JSON")
    demo.set_defaults(func=_cmd_demo)
    sub.add_parser("settings", help="the STITCH_* settings: accepted values, defaults, "
                   "meaning (markdown)").set_defaults(func=_cmd_settings)
    return parser


def main(argv: list[str] | None = None) -> int:
    import os

    args = build_parser().parse_args(argv)
    from stitch.config import setting_raw
    level = (args.log or setting_raw("STITCH_LOG") or "warning").upper()
    level = "INFO" if level == "KERNELS" else level
    logging.basicConfig(level=getattr(logging, level, logging.WARNING), stream=sys.stderr,
                        format="%(name)s %(levelname)s: %(message)s")
    try:
        return args.func(args)
    except (StitchError, KeyError, ValueError) as exc:
        print(f"stitch: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader (| head) stopped early: not an error. Point stdout at /dev/null so the
        # interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
