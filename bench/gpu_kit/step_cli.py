"""The command line the kit's model steps share (``timings``, ``profile``): where results
go, whether this is the rehearsal, and which zoo models to run."""
from __future__ import annotations

import argparse
from pathlib import Path


def step_arguments(prog: str, argv: list[str] | None = None) -> argparse.Namespace:
    """``--out`` (required), ``--rehearse``, ``--models model:config,...``."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rehearse", action="store_true")
    parser.add_argument("--models", help="model:config,... (default: the kit's list)")
    return parser.parse_args(argv)


def chosen_models(args: argparse.Namespace, models: tuple, rehearsal_models: tuple) -> list:
    """(model, config) pairs: ``--models`` when given, else the step's list for this run."""
    if args.models:
        return [tuple(s.split(":")) for s in args.models.split(",")]
    return list(rehearsal_models if args.rehearse else models)
