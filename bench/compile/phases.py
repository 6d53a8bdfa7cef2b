"""Compile time of the BERT training step through ``stitch.compiler.compile`` (h100 plan),
cold (an empty compile cache) and warm (a second compile with the same cache directory).

    python -m bench.compile.phases [--out docs/benchmarks.md] [--configs tiny,full]
                                 [--full-budget-s 120]

Per configuration: plan time, lowering and host build time per kernel (median / max) and
total, PTX emission and ptxas time per kernel, and the cache hits of the warm compile. The
``full`` configuration runs in a child process and is dropped from the report when it takes
longer than ``--full-budget-s`` (it is then named with the time it was given). With ``--out``
the report replaces the ``compile-time`` section of that markdown file (re-read right before
writing; appended when missing). Everything is measured wall time on this machine; nothing
runs on a GPU.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from bench.report import REPO

log = logging.getLogger(__name__)

MODEL = "bert_layer_train"
TARGET = "h100"
SECTION = "compile-time"
COMMAND = "python -m bench.compile.phases --out docs/benchmarks.md"
DATA = REPO / "hlo_fixtures" / "data"


@dataclass
class Phase:
    """One compile (cold or warm) of one configuration; seconds are wall time."""
    kernels: int = 0
    fallbacks: int = 0
    plan_s: float = 0.0
    lower_s: list[float] = field(default_factory=list)      # per kernel
    build_s: list[float] = field(default_factory=list)
    ptx_s: list[float] = field(default_factory=list)
    ptxas_s: list[float] = field(default_factory=list)
    compile_s: float = 0.0        # stitch.compiler.compile, end to end
    ptx_total_s: float = 0.0      # Executable.ptxas(): PTX emission (isolated child) + ptxas
    host_cache_hits: int = 0
    ptx_cache_hits: int = 0
    max_registers: int = 0
    spills: int = 0


@dataclass
class Result:
    config: str
    arch: str = ""
    cold: Phase = field(default_factory=Phase)
    warm: Phase = field(default_factory=Phase)
    error: str = ""


def _phase(text: str, cache_dir: pathlib.Path) -> tuple[Phase, str]:
    from stitch.codegen.cache import CompileCache
    from stitch import compiler

    start = time.perf_counter()
    exe = compiler.compile(text, TARGET, cache=CompileCache(cache_dir))
    compiled = time.perf_counter()
    reports = exe.ptxas()
    done = time.perf_counter()
    arch = exe.arch
    return Phase(
        kernels=len(exe.kernels), fallbacks=len(exe.fallbacks), plan_s=exe.stats.plan_s,
        lower_s=[k.lower_s for k in exe.kernels], build_s=[k.build_s for k in exe.kernels],
        ptx_s=[k.ptx_s[arch] for k in exe.kernels],
        ptxas_s=[k.ptxas_s[arch] for k in exe.kernels],
        compile_s=compiled - start, ptx_total_s=done - compiled,
        host_cache_hits=exe.stats.host_cache_hits, ptx_cache_hits=exe.stats.ptx_cache_hits,
        max_registers=max((r.registers for r in reports.values()), default=0),
        spills=sum(r.spill_store_bytes + r.spill_load_bytes for r in reports.values())), arch


def measure(config: str) -> Result:
    """Cold then warm compile of MODEL/config in a fresh temporary cache directory."""
    text = (DATA / MODEL / f"{config}.pre.hlo").read_text()
    result = Result(config)
    with tempfile.TemporaryDirectory(prefix="stitch-bench-cache-") as tmp:
        # The default cache is $STITCH_CACHE_DIR: point it at the temp dir too, so nothing
        # from an earlier run can serve the cold compile.
        os.environ["STITCH_CACHE_DIR"] = tmp
        result.cold, result.arch = _phase(text, pathlib.Path(tmp))
        result.warm, _ = _phase(text, pathlib.Path(tmp))
    return result


def measure_in_child(config: str, budget_s: float) -> Result:
    """``measure`` in a child process (a fresh LLVM, no warm caches of this process), or a
    Result naming why there is none."""
    cmd = [sys.executable, "-m", "bench.compile.phases", "--child", config]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=budget_s,
                              cwd=REPO)
    except subprocess.TimeoutExpired:
        return Result(config, error=f"not measured: over the {budget_s:.0f} s budget")
    if proc.returncode != 0:
        return Result(config, error=f"failed: {proc.stderr.strip().splitlines()[-1:]}")
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    return Result(data["config"], data["arch"], Phase(**data["cold"]), Phase(**data["warm"]),
                  data["error"])


# ------------------------------------------------------------------------------- report

def _stat(values: list[float]) -> str:
    if not values:
        return "–"
    return (f"{sum(values):.2f} ({statistics.median(values) * 1e3:.0f} / "
            f"{max(values) * 1e3:.0f} ms)")


def render(results: list[Result]) -> str:
    from bench.report import stamp
    from stitch.codegen.toolchain import find_ptxas, ptxas_version
    import llvmlite

    ok = [r for r in results if not r.error]
    arch = ok[0].arch if ok else "sm_90"
    try:
        ptxas = f"ptxas {ptxas_version(find_ptxas(arch))}"
    except Exception:  # noqa: BLE001 - the report says what it could not find
        ptxas = "no ptxas"
    lines = [
        f"## Compile time: {MODEL} through stitch.compiler.compile ({TARGET}, measured)",
        "",
        f"Measured with {stamp(COMMAND)} llvmlite {llvmlite.__version__}, {ptxas}. "
        "Wall seconds in one process per configuration; *cold*: an empty temporary "
        "`STITCH_CACHE_DIR`, *warm*: a second compile with the same directory. Per-kernel "
        "columns give the total, then (median / max per kernel). PTX emission runs in an "
        "isolated child (LLVM NVPTX, libdevice linked); ptxas assembles each kernel for the "
        "target's arch (its result is cached too, keyed by the PTX, arch and ptxas version).",
        "",
        "| config | compile | kernels | plan s | lower s | host build s | host cache hits | "
        "compile total s | PTX emission s | PTX cache hits | ptxas s | max regs / spills |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if r.error:
            lines.append(f"| {r.config} | – | {r.error} |" + " |" * 10)
            continue
        for label, p in (("cold", r.cold), ("warm", r.warm)):
            lines.append(
                f"| {r.config} | {label} | {p.kernels} | {p.plan_s:.2f} | {_stat(p.lower_s)} | "
                f"{_stat(p.build_s)} | {p.host_cache_hits}/{p.kernels} | {p.compile_s:.2f} | "
                f"{_stat(p.ptx_s)} | {p.ptx_cache_hits}/{p.kernels} | {_stat(p.ptxas_s)} | "
                f"{p.max_registers} / {p.spills} B |")
    for r in ok:
        c, w = r.cold, r.warm
        lines.append("")
        lines.append(
            f"- {r.config}: warm compile {c.compile_s / max(w.compile_s, 1e-9):.1f}x faster "
            f"than cold ({c.compile_s:.2f} s -> {w.compile_s:.2f} s; host build "
            f"{sum(c.build_s):.2f} s -> {sum(w.build_s):.2f} s with "
            f"{w.host_cache_hits}/{w.kernels} objects from the cache; PTX "
            f"{sum(c.ptx_s):.2f} s -> {sum(w.ptx_s):.2f} s). What stays in a warm compile: "
            f"planning ({w.plan_s:.2f} s), lowering and the host IR emission + MCJIT load "
            f"of every kernel.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, help="markdown file to write the section to")
    ap.add_argument("--configs", default="tiny,full")
    ap.add_argument("--full-budget-s", type=float, default=120.0,
                    help="the full configuration is reported only if it takes less")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.child:
        result = measure(args.child)
        print(json.dumps(asdict(result)))
        return 0
    results = []
    for config in args.configs.split(","):
        budget = args.full_budget_s if config == "full" else 3600.0
        results.append(measure_in_child(config, budget))
    body = render(results)
    if args.out:
        from bench.report import write_section
        write_section(args.out, SECTION, body, after="bench-compile")
    else:
        print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
