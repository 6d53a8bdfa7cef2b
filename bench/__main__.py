"""The benchmark report, one measure per section of docs/benchmarks.md:

    python -m bench all --out docs/benchmarks.md        # every measure, then the headline
    python -m bench plans codegen --out docs/benchmarks.md
    python -m bench plans --part zoo --quick            # one part, a short run, printed
    python -m bench --list                              # measures and their parts

With ``--out`` each measure replaces its own marked blocks of the file (re-read right before
each write; other blocks untouched) and its plots go to docs/img/ (``--img-dir``).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path

from bench.measure import Context, Measure, run_measure

# Report order; ``all`` runs every one, the headline last (it reads what the others kept).
MEASURES = ("headline", "plans", "planner", "codegen", "compile", "delivered", "runtime",
            "corpus", "tf", "gpu")


def load(name: str) -> Measure:
    return importlib.import_module(f"bench.{name}").MEASURE


def parser(measures: dict[str, Measure]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__.split("\n")[0],
        epilog="measures: " + "; ".join(f"{m.name} ({', '.join(x.name for x in m.parts)})"
                                        for m in measures.values()))
    p.add_argument("measures", nargs="*", metavar="MEASURE",
                   help="all, or any of: " + ", ".join(MEASURES))
    p.add_argument("--list", action="store_true", help="list the measures and their parts")
    p.add_argument("--part", action="append", help="only these parts (repeatable)")
    p.add_argument("--quick", action="store_true",
                   help="a short run: fewer models and sizes; slow parts skipped")
    p.add_argument("--out", type=Path, help="markdown file whose blocks to replace")
    p.add_argument("--img-dir", type=Path, help="plots (default: img/ next to --out)")
    seen: set[int] = set()
    for m in measures.values():
        if m.arguments and id(m.arguments) not in seen:
            seen.add(id(m.arguments))
            m.arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="[bench %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    measures = {name: load(name) for name in MEASURES}
    cli = parser(measures)
    args = cli.parse_args(argv)
    unknown = [n for n in args.measures if n not in ("all", *MEASURES)]
    if unknown:
        cli.error(f"unknown measure {', '.join(unknown)}; choose from all, "
                  + ", ".join(MEASURES))
    if args.list or not args.measures:
        for m in measures.values():
            print(f"{m.name:10} {m.title}")
            for part in m.parts:
                print(f"    {part.name:22} {part.title}{'' if part.quick else '  (slow)'}")
        return 0
    names = list(MEASURES) if "all" in args.measures else list(dict.fromkeys(args.measures))
    if "all" in args.measures:          # the headline reads what the others kept
        names = [n for n in names if n != "headline"] + ["headline"]
    ctx = Context(args)
    for name in names:
        at = MEASURES.index(name)
        after = None if at == 0 else ctx.shared.get("last_block", {}).get(
            MEASURES[at - 1], f"bench-{MEASURES[at - 1]}")
        run_measure(measures[name], ctx, args.part, after)
    return 0


if __name__ == "__main__":
    sys.exit(main())
