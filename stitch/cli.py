"""The ``stitch`` command line.

  stitch models                          list the model zoo (needs jax)
  stitch hlo MODEL [--config] [--stage]  print a zoo model's HLO (pre-optimization or XLA CPU)
  stitch explain MODEL|FILE [--gpu]      parse HLO and report its structure and XLA's kernels

This module is the user interface, so it writes to stdout; library code logs instead.
"""
from __future__ import annotations

import argparse
import logging
import pathlib
import sys
import time
from collections import Counter

from hlo_passes import HloModule, StitchError, parse_hlo
from hlo_passes.kernels import count_kernels

log = logging.getLogger("stitch")

# Committed fixtures, present when stitch runs from a source checkout.
_FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data"
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
    return parser


def main(argv: list[str] | None = None) -> int:
    import os

    args = build_parser().parse_args(argv)
    level = (args.log or os.environ.get("STITCH_LOG") or "warning").upper()
    logging.basicConfig(level=getattr(logging, level, logging.WARNING), stream=sys.stderr,
                        format="%(name)s %(levelname)s: %(message)s")
    try:
        return args.func(args)
    except (StitchError, KeyError, ValueError) as exc:
        print(f"stitch: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
