"""Shared pieces of the benchmark report: the machine line, marked sections of
docs/benchmarks.md, ratios and geometric means."""
from __future__ import annotations

import datetime
import math
import os
import platform
import re
from pathlib import Path
from typing import Iterable

REPO = Path(__file__).resolve().parent.parent


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    """One line naming the machine the numbers were taken on."""
    try:
        import jax
        jax_version = f", jax {jax.__version__}"
    except ImportError:
        jax_version = ""
    return (f"{os.cpu_count()}-core {cpu_name()}, {platform.system()} {platform.machine()}, "
            f"Python {platform.python_version()}{jax_version}; no GPU")


def stamp(command: str, load: tuple[float, ...] | None = None) -> str:
    """The command, date and machine; ``load``: the 1/5/15-minute load average when the
    section started (other processes share this machine: it says how much to trust
    measured times)."""
    where = f"`{command}` — {datetime.date.today()}, {machine()}"
    if load:
        where += "; load average " + " / ".join(f"{x:.1f}" for x in load) + " at its start"
    return where + "."


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def publish(out: Path | None, name: str, body: str) -> None:
    """A benchmark's markdown: into section ``name`` of ``out``, or printed without one."""
    if out:
        write_section(out, name, body)
    else:
        print(body)


def write_section(path: Path, name: str, body: str, after: str | None = None,
                  remove: Iterable[tuple[str, str]] = ()) -> None:
    """Put ``body`` between the ``name`` markers of ``path``, touching nothing else.

    The file is re-read right before writing (other tools write other sections of it).
    A missing section goes after the section ``after`` when that exists, else at the end.
    ``remove``: (begin, end) marker pairs of superseded sections to delete."""
    begin, end = markers(name)
    section = f"{begin}\n{body.strip()}\n{end}\n"
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    new = old
    for b, e in remove:
        new = re.sub(r"\n*" + re.escape(b) + r".*?" + re.escape(e) + r"\n?", "\n", new,
                     flags=re.S)
    if begin in new and end in new:
        new = re.sub(re.escape(begin) + r".*?" + re.escape(end) + r"\n?",
                     lambda _: section, new, count=1, flags=re.S)
    else:
        anchor = markers(after)[1] if after else None
        if anchor and anchor in new:
            at = new.index(anchor) + len(anchor)
            new = new[:at] + "\n\n" + section + new[at:].lstrip("\n")
            if not new.endswith("\n"):
                new += "\n"
        else:
            new = new.rstrip("\n") + "\n\n" + section
    path.write_text(new)


def ratio(a: float, b: float, digits: int = 2) -> str:
    """a / b formatted, '–' when b is 0."""
    return f"{a / b:.{digits}f}" if b else "–"


def geomean(values: Iterable[float]) -> float:
    values = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else math.nan


def fit_exponent(points: list[tuple[float, float]]) -> float:
    """k of y ∝ x^k by least squares on log-log."""
    xs = [math.log(x) for x, _ in points]
    ys = [math.log(y) for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def block_body(path: Path, name: str) -> str | None:
    """The text between the ``name`` markers of ``path`` (None when absent)."""
    if not path.exists():
        return None
    begin, end = markers(name)
    text = path.read_text()
    if begin not in text or end not in text:
        return None
    return text[text.index(begin) + len(begin):text.index(end)].strip()


_STAMP = re.compile(r"^`[^`]*` — \d{4}-\d\d-\d\d.*$")


def as_part(markdown: str) -> list[str]:
    """A stand-alone benchmark's markdown as a part of a measure's section: headings one
    level deeper, its own command/date/machine line dropped (the part's stamp replaces it)."""
    lines = []
    for line in markdown.strip().splitlines():
        if _STAMP.match(line):
            continue
        lines.append("#" + line if line.startswith("#") else line)
    return lines


# Data rows a table keeps in the written report (the report stays readable; a measure run
# without --out prints every row).
MAX_TABLE_ROWS = 12


def cap_tables(markdown: str, most: int = MAX_TABLE_ROWS) -> str:
    """``markdown`` with every table of more than ``most`` data rows cut to its first
    ``most``, followed by a line that says how many rows it had."""
    out: list[str] = []
    table: list[str] = []

    def flush() -> None:
        rows = table[2:]
        if len(rows) > most:
            out.extend(table[:2 + most])
            out.append(f"_(first {most} of {len(rows)} rows; the command without --out "
                       "prints them all)_")
        else:
            out.extend(table)
        table.clear()

    for line in markdown.split("\n"):
        if line.startswith("|"):
            table.append(line)
            continue
        if table:
            flush()
        out.append(line)
    if table:
        flush()
    return "\n".join(out)

