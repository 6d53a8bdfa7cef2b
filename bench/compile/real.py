"""Compile time at real sizes: XLA's own compile against the compile with stitch's pass, for
the real-size training steps of ``bench.real_steps`` (``REAL_STEPS``), compiled deviceless
for an H100 (jax's CUDA plugin in the venv scripts/deviceless_check.sh makes).

    python -m bench compile --part real [--quick]      # the block of docs/benchmarks.md
    python -m bench.compile.real [--quick]             # the table, printed

Per step, three fresh child processes in turn, all with the same ``STITCH_CACHE_DIR``, empty
before the first (cold: plans, PTX and ptxas results all built) and filled by it for the
second (warm: the pass's stored result, ``stitch.xla_pass.result_store``) and the third
(warm, whole pass: ``STITCH_PASS_RESULTS=0``, the plan cache and stored lowerings). Each
child lowers the step, compiles a small function untimed (the process's
one-time XLA set-up), then compiles the step with XLA alone and with the pass
(``deviceless.compile_with_pass``), timed. The pass's phases are its own timings: plan,
Kernel IR lowering (with snapping, payback and the as-built check), the wait for PTX and
ptxas left after lowering, and the rest (the rewrite, pricing the delivered module).
Kernels: placed / distinct structures among them (``gpu_cache.structure_key``: PTX built
once each) / lowered (Kernel IR lowered once per distinct kernel,
``stitch.codegen.lowering_reuse``; warm: read back from the compile cache).
``--quick``: GPT-2 at one layer.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from bench.report import REPO

MARK = "REAL_COMPILE_ROW "
TARGET = "h100"
CHILD_TIMEOUT_S = 1800.0


def _key(cfg) -> str:
    return f"{cfg.family}:{cfg.layers}:{cfg.dtype}"


def steps(quick: bool) -> list:
    from bench.real_steps import REAL_STEPS, config
    return [config("gpt2", 1)] if quick else list(REAL_STEPS)


def one(key: str) -> dict:
    """Child side: the step ``key`` compiled by XLA, then with the pass; the row."""
    from bench.compile.in_xla import warm_up_backend
    from bench.real_steps import config, lower_for
    from stitch.codegen.gpu_cache import structure_key
    from stitch.xla_pass import deviceless

    family, layers, dtype = key.split(":")
    cfg = config(family, int(layers), dtype)
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec
    mesh = topologies.make_mesh(deviceless.topology(TARGET, "1x1x1"), (1,), ("d",))
    warm_up_backend(NamedSharding(mesh, PartitionSpec()))
    lowered = lower_for(cfg, TARGET)
    start = time.perf_counter()
    lowered.compile()
    xla_s = time.perf_counter() - start
    start = time.perf_counter()
    result = deviceless.compile_with_pass(lowered, cfg.name.replace(" ", "_"), TARGET)
    stitched_s = time.perf_counter() - start
    report = result.report
    t = report.timings
    rest = t.get("pass_s", 0.0) - t.get("plan_s", 0.0) - t.get("build_s", 0.0)
    import jax
    return {"step": cfg.name, "jax": jax.__version__, "xla_s": xla_s, "stitched_s": stitched_s,
            "pass_s": t.get("pass_s", 0.0), "plan_s": t.get("plan_s", 0.0),
            "lower_s": t.get("lower_s", 0.0), "ptx_s": t.get("ptx_s", 0.0),
            "rest_s": max(rest, 0.0) + t.get("targets_s", 0.0),
            "from_store": report.from_store, "placed": len(report.kernels),
            "distinct": len({structure_key(b.lowered.kernel) for b in report.kernels}),
            "lowered": report.lowerings.get("kernels_lowered", 0),
            "reused": report.lowerings.get("lowerings_reused", 0)}


def _child(key: str, cache: str, **settings: str) -> dict:
    from bench.delivered.children import cuda_python
    python = cuda_python()
    if not python.exists():
        return {"error": f"{python} not found (scripts/deviceless_check.sh makes it)"}
    env = {**os.environ, "STITCH_CACHE_DIR": cache, "CUDA_VISIBLE_DEVICES": "-1",
           "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1", **settings,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                       os.environ.get("PYTHONPATH")]))}
    try:
        run = subprocess.run([str(python), "-m", "bench.compile.real", "--one", key], env=env,
                             capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                             cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {CHILD_TIMEOUT_S:.0f} s"}
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith(MARK)), None)
    if run.returncode != 0 or line is None:
        tail = (run.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": f"exit {run.returncode}: {tail[:200]}"}
    return json.loads(line[len(MARK):])


def collect(quick: bool, progress=print) -> list[dict]:
    rows = []
    for cfg in steps(quick):
        with tempfile.TemporaryDirectory(prefix="stitch-real-compile-") as cache:
            os.chmod(cache, 0o700)
            cold = _child(_key(cfg), cache, STITCH_PASS_RESULTS="1")
            warm = _child(_key(cfg), cache, STITCH_PASS_RESULTS="1") \
                if "error" not in cold else {}
            # The warm compile of a module that differs (no stored result to take): the
            # plan cache and the stored lowerings only.
            rerun = _child(_key(cfg), cache, STITCH_PASS_RESULTS="0") \
                if "error" not in cold else {}
        row = {"step": cfg.name, "cold": cold, "warm": warm, "rerun": rerun}
        progress(f"[real compile] {json.dumps(row)}")
        rows.append(row)
    return rows


def _phases(r: dict) -> str:
    return " / ".join(f"{r[k]:.1f}" for k in ("plan_s", "lower_s", "ptx_s", "rest_s"))


def _ratio(r: dict) -> str:
    return f"{r['stitched_s'] / r['xla_s']:.2f}"


def markdown(rows: list[dict]) -> list[str]:
    out = ["| step | XLA s | stitched s | ratio | pass: plan / lower / PTX wait / rest s "
           "| warm: XLA s | stitched s | ratio | pass s "
           "| warm, whole pass: ratio | pass: plan / lower / PTX wait / rest s "
           "| kernels placed / distinct / lowered cold / whole pass warm |",
           "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|---|"]
    for row in rows:
        cold, warm, rerun = row["cold"], row["warm"], row.get("rerun", {})
        if "error" in cold:
            out.append(f"| {row['step']} | not measured: {cold['error']} ||||||||||")
            continue
        cells = [row["step"], f"{cold['xla_s']:.1f}", f"{cold['stitched_s']:.1f}",
                 _ratio(cold), _phases(cold)]
        if warm and "error" not in warm:
            cells += [f"{warm['xla_s']:.1f}", f"{warm['stitched_s']:.1f}", _ratio(warm),
                      f"{warm['pass_s']:.1f}" + ("" if warm.get("from_store") else
                                                 " (whole pass)")]
        else:
            cells += ["", "", "", warm.get("error", "")]
        if rerun and "error" not in rerun:
            cells += [_ratio(rerun), _phases(rerun)]
        else:
            cells += ["", rerun.get("error", "")]
        cells.append(f"{cold['placed']} / {cold['distinct']} / {cold['lowered']} / "
                     f"{rerun.get('lowered', '')}")
        out.append("| " + " | ".join(cells) + " |")
    versions = sorted({r["cold"]["jax"] for r in rows if "jax" in r["cold"]})
    out += ["", (f"The children run jax {', '.join(versions)} (the deviceless venv, "
                 "STITCH_CUDA_VENV). " if versions else "")
            + "Ratio: stitched / XLA compile seconds of the same child. Cold: an empty "
            "compile and plan cache. Warm: the cache the cold child filled, a new process: "
            "the same module takes the pass's stored result (`STITCH_PASS_RESULTS`, the "
            "module, its kernels' Kernel IR and figures; the kernels' targets made again "
            "from the cached PTX and ptxas results). Warm, whole pass: a third process with "
            "`STITCH_PASS_RESULTS=0`, what a module that differs from the stored one costs "
            "(the plan from the plan cache, lowerings read back from the compile cache). "
            "Lower: Kernel IR lowering with snapping, payback and the as-built check; PTX "
            "wait: PTX and ptxas left to wait for after the last kernel was lowered; rest: "
            "the rewrite, FFI targets and the pricing of the delivered module. Kernels "
            "placed / distinct structures (PTX built once each) / Kernel IR lowerings, cold "
            "and in the whole-pass warm process (once per distinct kernel, the others bound; "
            "warm: read from the compile cache)."]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--one", help="child: compile this step (family:layers:dtype)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.one:
        print(MARK + json.dumps(one(args.one)), flush=True)
        return 0
    print("\n".join(markdown(collect(args.quick, progress=lambda s: print(
        s, file=sys.stderr, flush=True)))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
