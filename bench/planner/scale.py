"""Planning time at scale: ms per instruction over the zoo fixtures, the XLA corpus's large
modules and synthetic graphs, with the fitted growth exponent (``python -m bench
planner-scale``; ``python -m bench.planner.scale`` prints the section).

Times are measured (wall clock of ``stitch.plan``, beam planner, H100 target, one process,
modules planned one after another) on whatever machine runs it; a per-module limit stops a
plan that runs too long (reported as such, never hidden).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import stitch
from bench.report import fit_exponent
from bench.synthetic import synthetic_hlo
from stitch.hlo.graph import build_op_graphs
from stitch.hlo.parser import parse_hlo
from hlo_fixtures import DATA

# Where xla_hlo_corpus.tar.xz was extracted ($STITCH_XLA_CORPUS, else /tmp/xla_hlo_corpus).
CORPUS = Path(os.environ.get("STITCH_XLA_CORPUS", "/tmp/xla_hlo_corpus"))
# The corpus's real models (gemma, dlrm, resnet, llama...) that parse: matched on the
# source path in its index.json.
CORPUS_MODELS = ("dlrm", "gemma", "resnet", "diffrax", "llama", "mobilenet", "maxtext",
                 "mixtral")
CHAIN_OPS = (1000, 2000, 4000, 8000, 16000, 32000)
Progress = Callable[[str], None]


def elementwise_chain_hlo(ops: int, rows: int = 256, width: int = 512) -> str:
    """A chain of ``ops`` elementwise ops (add, multiply, subtract, maximum, every fifth a
    tanh), each reading the previous one and a second parameter."""
    t = f"f32[{rows},{width}]"
    lines = [f"x = {t} parameter(0)", f"y = {t} parameter(1)"]
    prev = "x"
    binary = ("add", "multiply", "subtract", "maximum")
    for i in range(ops):
        if i % 5 == 4:
            lines.append(f"c{i} = {t} tanh({prev})")
        else:
            lines.append(f"c{i} = {t} {binary[i % 4]}({prev}, y)")
        prev = f"c{i}"
    lines[-1] = "ROOT " + lines[-1]
    return "HloModule chain\n\nENTRY main {\n  " + "\n  ".join(lines) + "\n}\n"


@dataclass
class Timing:
    name: str
    kind: str            # "zoo" | "corpus" | "chain" | "synthetic"
    ops: int
    seconds: float | None   # None: over the limit or failed
    note: str = ""
    cpu_seconds: float | None = None   # the process's CPU time over the same plan

    @property
    def ms_per_op(self) -> float | None:
        return None if self.seconds is None else 1000.0 * self.seconds / max(self.ops, 1)

    @property
    def cpu_ms_per_op(self) -> float | None:
        return None if self.cpu_seconds is None else \
            1000.0 * self.cpu_seconds / max(self.ops, 1)


class _Timeout(BaseException):
    """The per-module limit (a BaseException: stitch.plan turns every Exception from a
    bug into PlanError, and this must pass through)."""


def _alarm(*_):
    raise _Timeout()


def time_plan(name: str, kind: str, text: str, limit_s: float) -> Timing:
    module = parse_hlo(text)
    ops = sum(len(g.nodes) for g in build_op_graphs(module))
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    start, cpu = time.perf_counter(), time.process_time()
    try:
        stitch.plan(module, "h100", "beam")
    except _Timeout:
        return Timing(name, kind, ops, None, f"over {limit_s:.0f} s")
    except stitch.StitchError as exc:
        return Timing(name, kind, ops, None, f"{type(exc).__name__}: {exc}"[:80])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    return Timing(name, kind, ops, time.perf_counter() - start,
                  cpu_seconds=time.process_time() - cpu)


def zoo_modules() -> list[tuple[str, str]]:
    found = []
    for d in sorted(p for p in DATA.iterdir() if p.is_dir()):
        for suffix in ("full.gpu-h100.hlo",):
            path = d / suffix
            if path.exists():
                found.append((f"{d.name}/{suffix}", path.read_text()))
    return found


def corpus_modules(root: Path = CORPUS, max_chars: int = 1_000_000) -> list[tuple[str, str]]:
    """The corpus's real-model modules (extract xla_hlo_corpus.tar.xz under /tmp first)."""
    index = root / "index.json"
    if not index.exists():
        return []
    found = []
    for entry in json.loads(index.read_text())["modules"]:
        source = entry["source"].lower()
        if entry["chars"] <= max_chars and any(k in source for k in CORPUS_MODELS):
            found.append((f"{entry['file']} ({Path(entry['source']).stem})",
                          (root / entry["file"]).read_text()))
    return found


def collect(limit_s: float = 60.0, chain_ops: tuple[int, ...] = CHAIN_OPS,
            progress: Progress = lambda _: None, budget_s: float = 600.0,
            corpus: Path | None = None) -> list[Timing]:
    """Plan times of the zoo, the corpus's real models and the synthetic graphs; synthetic
    sizes stop once ``budget_s`` has passed (the 32k-op graphs only when there is time)."""
    rows: list[Timing] = []
    start = time.perf_counter()
    sources = [("zoo", zoo_modules()), ("corpus", corpus_modules(corpus or CORPUS))]
    for kind, modules in sources:
        for name, text in modules:
            try:
                rows.append(time_plan(name, kind, text, limit_s))
            except stitch.StitchError as exc:       # does not parse
                progress(f"{name}: skipped ({exc})"[:100])
                continue
            progress(f"{name}: {rows[-1].seconds}")
    synthetic_start = time.perf_counter()
    for ops in chain_ops:
        if time.perf_counter() - synthetic_start > budget_s:
            break
        for kind, text in (("chain", elementwise_chain_hlo(ops)),
                           ("synthetic", synthetic_hlo(ops))):
            rows.append(time_plan(f"{kind} {ops}", kind, text, limit_s))
            progress(f"{kind} {ops}: {rows[-1].seconds}")
    return rows


def _median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def markdown(rows: list[Timing], limit_s: float) -> list[str]:
    lines = ["| module | kind | instructions | plan s | ms / instruction | CPU s | "
             "CPU ms / instruction |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        secs = f"{r.seconds:.2f}" if r.seconds is not None else r.note
        per = f"{r.ms_per_op:.2f}" if r.ms_per_op is not None else "—"
        cpu = f"{r.cpu_seconds:.2f}" if r.cpu_seconds is not None else "—"
        cpu_per = f"{r.cpu_ms_per_op:.2f}" if r.cpu_ms_per_op is not None else "—"
        lines.append(f"| {r.name} | {r.kind} | {r.ops} | {secs} | {per} | {cpu} | {cpu_per} |")
    real_rows = [r for r in rows if r.kind in ("zoo", "corpus")]
    real = [r.ms_per_op for r in real_rows if r.ms_per_op is not None]
    lines.append("")
    if real:
        over = sum(1 for r in real_rows if r.seconds is None)
        cpu = [r.cpu_ms_per_op for r in real_rows if r.cpu_ms_per_op is not None]
        lines.append(f"Median over zoo and corpus modules: {_median(real):.2f} ms per "
                     f"instruction wall clock, {_median(cpu):.2f} ms CPU ({len(real)} modules; "
                     f"{over} over the {limit_s:.0f} s limit). Slowest real module: "
                     f"{max(r.seconds for r in real_rows if r.seconds is not None):.2f} s wall.")
    for kind in ("chain", "synthetic"):
        points = [(r.ops, r.seconds) for r in rows if r.kind == kind and r.seconds]
        if len(points) >= 2:
            lines.append(f"Growth exponent ({kind}, time ~ ops^k, least squares on logs): "
                         f"k = {fit_exponent(points):.2f}.")
    return lines


def _plan_cpu(module, options) -> tuple:
    """(CPU s, modeled objective s, distinct patterns scored, patterns scored, kernels as
    sorted op names) of one plan."""
    start = time.process_time()
    fusion_plan = stitch.plan(module, "h100", "beam", options)
    cpu = time.process_time() - start
    details = [g.report.detail for g in fusion_plan.graphs]
    scored = sum(d.get("scored", 0) for d in details)
    distinct = scored - sum(d.get("reused", 0) for d in details)
    objective = sum(g.stitched.objective_s for g in fusion_plan.graphs)
    return cpu, objective, distinct, scored, sorted(k.ops for k in fusion_plan.kernels)


def compare_sharing(modules: list[tuple[str, str]], gpu_pass_options: bool = False
                    ) -> list[str]:
    """Per module: planning CPU seconds and the modeled plan time with structure sharing
    off and on (stitch.pricing.structure), and whether the two plans are the same kernels.
    ``gpu_pass_options``: the options the XLA GPU pass plans with (TF32 chains, ptxas spill
    check)."""
    import dataclasses
    from stitch.explorer.planner import ExplorerOptions
    base = ExplorerOptions(chain_tf32=True, chain_spill_check=True) if gpu_pass_options \
        else ExplorerOptions()
    lines = ["| module | instructions | CPU s, sharing off | CPU s, on | speed-up | "
             "objective µs off → on | same kernels | patterns scored (distinct) off → on |",
             "|---|---:|---:|---:|---:|---|---|---|"]
    for name, text in modules:
        module = parse_hlo(text)
        ops = sum(len(g.nodes) for g in build_op_graphs(module))
        got = {}
        for share in (False, True):
            options = dataclasses.replace(base, share_structure=share)
            got[share] = _plan_cpu(parse_hlo(text), options)
        (c0, o0, d0, s0, k0), (c1, o1, d1, s1, k1) = got[False], got[True]
        lines.append(f"| {name} | {ops} | {c0:.2f} | {c1:.2f} | {c0 / c1:.2f}× | "
                     f"{o0 * 1e6:.2f} → {o1 * 1e6:.2f} | {'yes' if k0 == k1 else 'NO'} | "
                     f"{s0} ({d0}) → {s1} ({d1}) |")
    return lines


def main() -> None:
    import argparse
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--limit", type=float, default=60.0, help="seconds per module")
    parser.add_argument("--chains", default=",".join(map(str, CHAIN_OPS)))
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--compare-sharing", nargs="+", metavar="MODULE",
                        help="HLO files or zoo names (e.g. transformer_train): CPU seconds "
                             "and plans with structure sharing off and on")
    parser.add_argument("--gpu-pass-options", action="store_true",
                        help="with --compare-sharing: plan as the XLA GPU pass does")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    if args.compare_sharing:
        modules = []
        for item in args.compare_sharing:
            path = Path(item)
            if not path.exists():
                path = DATA / item / "full.gpu-h100.hlo"
            modules.append((item, path.read_text()))
        print("\n".join(compare_sharing(modules, args.gpu_pass_options)))
        return
    rows = collect(args.limit, tuple(int(x) for x in args.chains.split(",") if x),
                   progress=lambda m: print(m, flush=True), corpus=args.corpus)
    print("\n".join(markdown(rows, args.limit)))


if __name__ == "__main__":
    main()
