"""What a measure is, and how its section of docs/benchmarks.md is written.

A measure (``python -m bench <measure>``) owns one section: a header block
``bench-<measure>`` (title, what it measures, the command) followed by one block per part,
``bench-<measure>-<part>``, each with its own command, date and machine line. Running a
part replaces its block; nothing is appended twice.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from bench.report import as_part, block_body, cap_tables, stamp, write_section

log = logging.getLogger("bench")


class Context:
    """Where sections and plots go, the parsed options, and what earlier measures of the
    same run left for later ones (``shared``: the headline reads the plans' rows)."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out: Path | None = args.out
        self.img_dir: Path | None = args.img_dir or (args.out.parent / "img" if args.out
                                                     else None)
        self.quick: bool = args.quick
        self.shared: dict[str, object] = {}

    def image(self, name: str, draw: Callable[[Path], Path]) -> str | None:
        """Draw plot ``name`` (when matplotlib is installed and there is an --out) and
        return its markdown link."""
        if self.img_dir is None:
            return None
        if importlib.util.find_spec("matplotlib") is None:
            log.info("matplotlib missing: no plot %s", name)
            return None
        draw(self.img_dir / f"{name}.png")
        return self.image_link(name)

    def image_link(self, name: str) -> str | None:
        """The markdown link of plot ``name`` when it has been drawn."""
        if self.img_dir is None or not (self.img_dir / f"{name}.png").exists():
            return None
        where = os.path.relpath(self.img_dir / f"{name}.png",
                                self.out.parent if self.out else Path.cwd())
        return f"![{name}]({where})"

    def save(self, name: str, data: object) -> None:
        """Keep a measure's summary numbers next to the report (data/NAME.json), for the
        headline of a later run."""
        if self.out is not None:
            path = self.out.parent / "data" / f"{name}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        self.shared[name] = data

    def load(self, name: str) -> object | None:
        """What ``save`` kept, from this run or an earlier one."""
        if name in self.shared:
            return self.shared[name]
        path = (self.out.parent if self.out else Path("docs")) / "data" / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None


@dataclass(frozen=True)
class Part:
    """One part of a measure: ``run`` gives its markdown (without heading or stamp), or None
    when it cannot measure here (a missing tool or package): the block keeps what it has."""
    name: str
    title: str
    run: Callable[[Context], list[str] | None]
    quick: bool = True          # run by ``--quick``


@dataclass(frozen=True)
class Measure:
    name: str
    title: str
    summary: str                # what it measures, how each number is labelled
    parts: tuple[Part, ...]
    arguments: Callable[[argparse.ArgumentParser], None] | None = None
    notes: Sequence[str] = field(default_factory=tuple)


def script(module: str, argv: Sequence[str] = (), quick_argv: Sequence[str] | None = None,
           block: str | None = None, env: dict[str, str] | None = None
           ) -> Callable[[Context], list[str] | None]:
    """A part run as ``python -m module argv`` in a child process: its markdown is the block
    ``block`` it writes into a scratch ``--out`` file, or its standard output."""
    def run(ctx: Context) -> list[str]:
        args = list(quick_argv if ctx.quick and quick_argv is not None else argv)
        with tempfile.TemporaryDirectory(prefix="stitch-bench-") as tmp:
            scratch = Path(tmp) / "out.md"
            if block:
                args += ["--out", str(scratch)]
            done = subprocess.run([sys.executable, "-m", module, *args], text=True,
                                  stdout=subprocess.PIPE, env={**os.environ, **(env or {})})
            if done.returncode:
                log.warning("python -m %s exited with %d: its block keeps its numbers",
                            module, done.returncode)
                return None
            text = block_body(scratch, block) if block else done.stdout
        return as_part(text or "")
    return run


def run_measure(measure: Measure, ctx: Context, parts: Sequence[str] | None,
                after: str | None) -> None:
    """Run ``parts`` of ``measure`` (all, or the quick ones under --quick) and write or print
    their blocks."""
    chosen = [p for p in measure.parts if (p.name in parts if parts else
                                           (p.quick or not ctx.quick))]
    header = [f"## {measure.title}", "", measure.summary, "",
              f"Regenerate: `python -m bench {measure.name}` (parts: "
              + ", ".join(p.name for p in measure.parts)
              + f"; one of them: `python -m bench {measure.name} --part NAME`).", *measure.notes]
    emit(ctx, f"bench-{measure.name}", "\n".join(header), after)
    previous = f"bench-{measure.name}"
    for part in measure.parts:
        name = f"bench-{measure.name}-{part.name}"
        if part in chosen:
            log.info("%s: %s", measure.name, part.name)
            load = os.getloadavg()
            start = time.perf_counter()
            lines = part.run(ctx)
            seconds = time.perf_counter() - start
            if lines is None and ctx.out is not None and block_body(ctx.out, name):
                previous = name
                continue
            if lines is None:
                lines = [f"**Not measured here** (see the log of `python -m bench "
                         f"{measure.name} --part {part.name}`)."]
            command = f"python -m bench {measure.name} --part {part.name}" + (
                " --quick" if ctx.quick else "")
            head = [f"### {part.title}", "",
                    stamp(command, load) + f" Run time {seconds:.0f} s (measured).", ""]
            emit(ctx, name, "\n".join(head + lines), previous)
        if ctx.out is None or block_body(ctx.out, name) is not None:
            previous = name
    ctx.shared.setdefault("last_block", {})[measure.name] = previous  # type: ignore[index]


def emit(ctx: Context, name: str, body: str, after: str | None) -> None:
    if ctx.out is None:
        print(body + "\n")
    else:
        write_section(ctx.out, name, cap_tables(body), after=after)
        log.info("wrote %s of %s", name, ctx.out)
