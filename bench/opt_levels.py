"""LLVM's optimisation pipeline for stitch's GPU kernels: what each costs to build (counted and
measured here) and how fast its kernels run (measured on a GPU).

Why: on the GPU path a kernel's build is LLVM (O3), NVPTX codegen and ptxas, and O3's loop
unrolling is about a third of it (the cold compile overhead). Whether the
unrolled code is faster on an H100 decides whether the build may skip it; only a GPU can
say. The same holds for `noalias` inputs (``LlvmPipeline.noalias_inputs``: `ld.global.nc`
loads and less LLVM time, but ptxas then spills some kernels for occupancy). So the work is
split in two steps on two machines, with files between them:

``python -m bench.opt_levels prepare [--models transformer_train:tiny,...] [--dir D]``
    Here, no GPU: each function is compiled with stitch's pass for a deviceless H100 (one
    child per function in scripts/deviceless_check.sh's venv, STITCH_CUDA_VENV); the pass's
    distinct kernels are built under every pipeline of ``VARIANTS`` (stitch.codegen.pipelines'
    ``PIPELINES``, the ones ``STITCH_LLVM_PIPELINE`` may name: PTX, then ptxas for sm_90).
    D/manifest.json gets each build's CPU seconds, PTX lines, registers and spills; the
    cubins go to D.
``python -m bench.opt_levels time --dir D --json T.json``
    On a machine with an NVIDIA GPU (numpy and libcuda through ctypes, bench.cuda_driver:
    none of stitch's dependencies, no cupy; of stitch only the plain-Python pipeline table,
    stitch.codegen.pipelines). ``--check-only``: one launch each, untimed (under compute-sanitizer). Each cubin is loaded and its kernel run on fresh random inputs
    (outputs poisoned first); each variant's outputs are checked against the default's.
    Each kernel is then timed as CUDA graph replays of ``REPLAYS`` launches, the median of
    ``REPEATS``, rotating over ``INPUT_SETS`` input sets so no launch reuses the one before.
``python -m bench.opt_levels device --dir D --scratch S [--models ...] --json T.json``
    On the GPU machine (the GPU kit's ``opt_levels`` step): ``time`` over D where a
    prepared D was carried there, else ``prepare`` first into S with this Python (the
    machine's jax has the CUDA plugin, so the deviceless compile runs there too; a few small
    models fit the step's budget).
``python -m bench.opt_levels report --dir D [--timings T.json] [--out docs/benchmarks.md]``
    The table: per function and variant, build seconds and code size, and with timings
    the kernels' summed GPU time against the default's.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from stitch.codegen.pipelines import PIPELINES

SECTION = "bench-opt-levels"
DEFAULT_MODELS = ("transformer_train:tiny", "bert_layer_train:tiny", "transformer_train:full")
DEFAULT_DIR = Path(".gpu_bench")
ARCH = "sm_90"
REPLAYS = 20          # launches per captured graph
REPEATS = 15          # timed graph replays; the median is kept
INPUT_SETS = 4        # rotating input sets (tiny kernels' inputs fit in L2)


@dataclass(frozen=True)
class Variant:
    name: str
    speed_level: int
    loop_unrolling: bool
    noalias_inputs: bool = False
    gvn_memdep: bool = True


# One variant per pipeline STITCH_LLVM_PIPELINE may name (stitch.codegen.pipelines: plain Python,
# so the GPU machine's `time` step needs none of stitch's dependencies); the first is what
# stitch builds with, the reference.
VARIANTS = tuple(Variant(name, **asdict(pipeline)) for name, pipeline in PIPELINES.items())


# ---------------------------------------------------------------- prepare (here)

def prepare_one(model: str, config: str, directory: Path) -> list[dict]:
    """The manifest entries of one function's kernels, their cubins written to
    ``directory`` (run inside the deviceless venv)."""
    import jax
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    from bench.compile.in_xla import keras_hub_llama_step, zoo_step
    from stitch.codegen import kir
    from stitch.codegen.gpu_cache import structure_key
    from stitch.codegen.llvm_emit import STORAGE_BYTES
    from stitch.codegen.nvptx import LlvmPipeline, emit_ptx
    from stitch.codegen.objcheck import cubin_code
    from stitch.codegen.toolchain import assemble_cubin
    from stitch.xla_pass import deviceless

    deviceless.check_environment()
    fn, args = keras_hub_llama_step() if model == "keras_hub_llama" else zoo_step(model, config)
    mesh = topologies.make_mesh(deviceless.topology("h100", "1x1x1"), (1,), ("d",))
    replicated = NamedSharding(mesh, PartitionSpec())
    specs = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), args)
    deviceless.ensure_pass_registered()
    report = deviceless.compile_with_pass(jax.jit(fn).lower(*specs), model, "h100").report
    entries, seen = [], set()
    for built in report.kernels:
        kernel = built.lowered.kernel
        key = structure_key(kernel)
        if key in seen:                   # built once by the pass too
            continue
        seen.add(key)
        entry = {"model": model, "config": config, "entry": kernel.name,
                 "grid": kernel.grid, "block": kernel.block, "launches": kir.launches(kernel),
                 "cooperative": kir.has_grid_barrier(kernel) and kernel.grid_sync == "barrier",
                 "params": [{"name": p.name, "dtype": p.dtype, "size": p.size,
                             "bytes": STORAGE_BYTES[p.dtype], "output": p.is_output}
                            for p in kernel.params],
                 "variants": {}}
        for variant in VARIANTS:
            pipeline = LlvmPipeline(variant.speed_level, variant.loop_unrolling,
                                    variant.noalias_inputs, variant.gvn_memdep)
            emit_start = time.thread_time()
            ptx = emit_ptx(kernel, ARCH, pipeline=pipeline)
            emit_s = time.thread_time() - emit_start
            before = os.times()
            cubin, reports = assemble_cubin(ptx, ARCH, kernel_name=kernel.name)
            after = os.times()
            ptxas_s = (after.children_user + after.children_system
                       - before.children_user - before.children_system)
            name = f"{model}-{config}-{len(entries)}-{variant.name}.cubin"
            (directory / name).write_bytes(cubin)
            ptxas = reports[kernel.name]
            code = cubin_code(cubin, kernel.name)
            entry["variants"][variant.name] = {
                "cubin": name, "emit_s": round(emit_s, 4), "ptxas_s": round(ptxas_s, 4),
                "ptx_lines": ptx.count("\n"), "registers": ptxas.registers,
                "spill_bytes": ptxas.spill_store_bytes + ptxas.spill_load_bytes,
                # Equal digests: the same machine code, so the same speed (no GPU needed).
                "code_sha256": hashlib.sha256(code).hexdigest() if code is not None else None}
        entries.append(entry)
    return entries


def prepare(models: list[str], directory: Path, python: str, timeout: float = 1800) -> None:
    """Every function's entries (one venv child each) into ``directory``/manifest.json."""
    directory.mkdir(parents=True, exist_ok=True)
    kernels, errors = [], []
    for spec in models:
        model, _, config = spec.partition(":")
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]),
               "CUDA_VISIBLE_DEVICES": "-1", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}
        run = subprocess.run([python, "-m", "bench.opt_levels", "prepare-one",
                              f"{model}:{config or 'tiny'}", "--dir", str(directory)],
                             capture_output=True, text=True, timeout=timeout, env=env)
        lines = [line for line in run.stdout.splitlines() if line.startswith("[")]
        if run.returncode != 0 or not lines:
            tail = (run.stderr.strip().splitlines() or ["no output"])[-1]
            errors.append({"model": model, "config": config or "tiny", "error": tail[:300]})
            print(f"[opt_levels] {spec}: {tail[:300]}", file=sys.stderr, flush=True)
            continue
        got = json.loads(lines[-1])
        kernels.extend(got)
        print(f"[opt_levels] {spec}: {len(got)} distinct kernels", file=sys.stderr, flush=True)
    manifest = {"arch": ARCH, "variants": [asdict(v) for v in VARIANTS],
                "kernels": kernels, "errors": errors}
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=1))


# ---------------------------------------------------------------- time (on a GPU)

def random_input(rng, dtype: str, size: int):
    """Host bytes for a param of ``dtype``: normal floats (bf16 as its 16 bits), small
    non-negative integers (they may index: kept in every buffer's range), booleans."""
    import numpy as np
    if dtype in ("f32", "f64", "f16"):
        return rng.standard_normal(size).astype({"f32": np.float32, "f64": np.float64,
                                                 "f16": np.float16}[dtype])
    if dtype == "bf16":
        bits = rng.standard_normal(size).astype(np.float32).view(np.uint32)
        return (bits >> 16).astype(np.uint16)
    if dtype == "i1":
        return rng.integers(0, 2, size).astype(np.uint8)
    numpy_type = {"i8": np.int8, "u8": np.uint8, "i32": np.int32, "u32": np.uint32,
                  "i64": np.int64}[dtype]
    return rng.integers(0, 4, size).astype(numpy_type)


def as_float(dtype: str, host):
    """An output's values as float64, for comparing variants."""
    import numpy as np
    if dtype == "bf16":
        return (host.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return host.astype(np.float64)


POISON = 0xA5     # every byte of an output before a launch


def time_kernels(directory: Path, replays: int = REPLAYS, repeats: int = REPEATS,
                 input_sets: int = INPUT_SETS, *, driver=None,
                 check_only: bool = False) -> list[dict]:
    """Per kernel and variant: its GPU µs per call (median), whether each output was
    written, and its relative error against the default variant's outputs.

    Through ``bench.cuda_driver`` (ctypes on libcuda; ``driver`` stands in for it in
    tests). ``check_only``: one launch per kernel and variant, no timing (what the
    compute-sanitizer step runs)."""
    import numpy as np

    if driver is None:
        from bench.cuda_driver import Driver
        driver = Driver()
    driver.use(0)
    manifest = json.loads((directory / "manifest.json").read_text())
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    results = []
    sets_wanted = 1 if check_only else input_sets
    for entry in manifest["kernels"]:
        params = entry["params"]
        inputs = []
        for _ in range(sets_wanted):
            one = []
            for p in params:
                if p["output"]:
                    one.append(None)
                    continue
                host = random_input(rng, p["dtype"], p["size"])
                pointer = driver.alloc(host.nbytes)
                driver.to_device(pointer, host)
                one.append(pointer)
            inputs.append(one)
        reference = None
        default = next(iter(entry["variants"]))
        for name, variant in entry["variants"].items():
            row = {"model": entry["model"], "config": entry["config"], "entry": entry["entry"],
                   "variant": name}
            outputs: list[list] = []
            try:
                shared = int(entry.get("dynamic_shared_bytes", 0))
                function = driver.load((directory / variant["cubin"]).read_bytes(),
                                       entry["entry"], shared)
                for _ in inputs:
                    outs = []
                    for p in params:
                        if not p["output"]:
                            outs.append(None)
                            continue
                        pointer = driver.alloc(p["size"] * p["bytes"])
                        driver.fill(pointer, POISON, p["size"] * p["bytes"])
                        outs.append(pointer)
                    outputs.append(outs)
                arguments = [[o if o is not None else i for i, o in zip(one, outs)]
                             for one, outs in zip(inputs, outputs)]

                def launch(args, stream=None) -> None:
                    for _ in range(entry["launches"]):
                        driver.launch(function, entry["grid"], entry["block"], args, stream,
                                      cooperative=entry["cooperative"],
                                      dynamic_shared_bytes=shared)
                launch(arguments[0])
                driver.synchronize()
                got = []
                for j, p in enumerate(params):
                    if p["output"]:
                        raw = np.empty(p["size"] * p["bytes"], np.uint8)
                        driver.to_host(outputs[0][j], raw)
                        got.append((p, raw))
                row["unwritten_outputs"] = sum(
                    1 for _, raw in got if raw.size and bool((raw == POISON).all()))
                values = [as_float(p["dtype"], raw.view(_numpy_type(p["dtype"])))
                          for p, raw in got]
                if name == default:
                    reference = values
                    row["rel_error"] = 0.0
                else:           # None: the default failed, nothing to compare with
                    row["rel_error"] = (_relative_error(values, reference)
                                        if reference is not None else None)
                if not check_only:
                    row["us"] = graph_time_us(driver, launch, arguments, replays, repeats)
                    moved = sum(p["size"] * p["bytes"] for p in params)
                    row["bytes"] = moved
            except Exception as exc:  # noqa: BLE001 - one kernel's failure is a table cell
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            finally:
                for outs in outputs:
                    for pointer in outs:
                        if pointer is not None:
                            driver.free(pointer)
            results.append(row)
            print(f"[opt_levels] {row}", file=sys.stderr, flush=True)
        for one in inputs:
            for pointer in one:
                if pointer is not None:
                    driver.free(pointer)
    return results


def _numpy_type(dtype: str):
    """numpy's storage type for ``dtype`` (stitch.codegen.host.NUMPY_DTYPES, bf16 as its bits):
    written out, as the GPU step imports none of stitch's modules but stitch.codegen.pipelines."""
    import numpy as np
    return {"f32": np.float32, "f64": np.float64, "f16": np.float16, "bf16": np.uint16,
            "i1": np.uint8, "i8": np.int8, "u8": np.uint8, "i32": np.int32,
            "u32": np.uint32, "i64": np.int64}[dtype]


def _relative_error(values: list, reference: list) -> float:
    """max over outputs of ‖values − reference‖ / ‖reference‖ (inf where NaN appears)."""
    import numpy as np
    worst = 0.0
    for got, want in zip(values, reference):
        if np.isnan(got).any() != np.isnan(want).any():
            return float("inf")
        got, want = np.nan_to_num(got), np.nan_to_num(want)
        scale = float(np.linalg.norm(want)) or 1.0
        worst = max(worst, float(np.linalg.norm(got - want)) / scale)
    return worst


def graph_time_us(driver, launch, arguments: list, replays: int, repeats: int) -> float:
    """Median µs per call over graph replays of ``replays`` calls, rotating input sets."""
    import numpy as np
    stream = driver.stream()

    def body() -> None:
        for r in range(replays):
            launch(arguments[r % len(arguments)], stream)
    graph = driver.capture(stream, body)
    driver.graph_launch(graph, stream)        # warm-up: upload, caches
    times = []
    for _ in range(repeats):
        start, end = driver.event(), driver.event()
        driver.record(start, stream)
        driver.graph_launch(graph, stream)
        driver.record(end, stream)
        times.append(driver.elapsed_ms(start, end) * 1000.0 / replays)
    return float(np.median(times))


# ---------------------------------------------------------------- report

def markdown(manifest: dict, timings: list[dict] | None, command: str) -> str:
    from bench.report import stamp
    variants = [v["name"] for v in manifest["variants"]]
    reference = variants[0]
    by_kernel: dict[tuple, dict] = {}
    for row in timings or ():
        by_kernel[(row["model"], row["config"], row["entry"], row["variant"])] = row
    lines = [f"## LLVM pipeline of the GPU kernels: build cost against kernel speed "
             f"({'measured on a GPU' if timings else 'counted and measured here; no GPU'})",
             "", stamp(command, os.getloadavg()), "",
             f"Each function compiled with stitch's pass for a deviceless H100; its distinct "
             f"kernels built for {manifest['arch']} under each LLVM pipeline (*{reference}* is "
             "what stitch builds with). *build CPU s*: LLVM + NVPTX codegen (this process) "
             "plus ptxas (its child), summed over the kernels, on this machine. *GPU µs*: the "
             "kernels' summed median time per call on the GPU (CUDA graph replays, rotating "
             "input sets); *vs " + reference + "*: that sum over the default's; *worst*: the "
             "kernel that lost most against the default; *rel. error*: the largest "
             "‖out − default's‖ / ‖default's‖ over the kernels' outputs. *same code*: "
             "kernels whose machine code (ptxas's cubin, the kernel's .text section) is "
             "byte for byte the default's: those run as fast without a GPU to show it.",
             "",
             "| function | pipeline | kernels | build CPU s | PTX lines | registers (sum) | "
             "spilling kernels | same code | GPU µs | vs " + reference + " | worst kernel | "
             "rel. error |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    functions: dict[tuple, list] = {}
    for entry in manifest["kernels"]:
        functions.setdefault((entry["model"], entry["config"]), []).append(entry)
    for (model, config), entries in functions.items():
        base_us = None
        for name in variants:
            builds = [e["variants"][name] for e in entries if name in e["variants"]]
            build_s = sum(b["emit_s"] + b["ptxas_s"] for b in builds)
            timed = [by_kernel.get((model, config, e["entry"], name)) for e in entries]
            us = worst = error = None
            if timings and all(t is not None and "us" in t for t in timed):
                us = sum(t["us"] for t in timed)
                error = max(t.get("rel_error") or 0.0 for t in timed)
                if name == reference:
                    base_us = {e["entry"]: t["us"] for e, t in zip(entries, timed)}
                elif base_us:
                    slowest = max(zip(entries, timed),
                                  key=lambda et: et[1]["us"] / base_us[et[0]["entry"]])
                    worst = (f"{slowest[0]['entry']} "
                             f"{slowest[1]['us'] / base_us[slowest[0]['entry']]:.2f}×")
            reference_us = sum(base_us.values()) if base_us else None
            codes = [(e["variants"][name].get("code_sha256"),
                      e["variants"].get(reference, {}).get("code_sha256"))
                     for e in entries if name in e["variants"]]
            same_code = (f"{sum(c is not None and c == r for c, r in codes)}/{len(codes)}"
                         if any(c for c, _ in codes) else "–")
            lines.append(
                f"| {model} ({config}) | {name} | {len(builds)} | {build_s:.2f} | "
                f"{sum(b['ptx_lines'] for b in builds):,} | "
                f"{sum(b['registers'] for b in builds):,} | "
                f"{sum(1 for b in builds if b['spill_bytes'])} | {same_code} | "
                + (f"{us:.1f} | {us / reference_us:.3f}× | {worst or '–'} | {error:.1e} |"
                   if us is not None and reference_us else "– | – | – | – |"))
    for error in manifest.get("errors", ()):
        lines.append(f"| {error['model']} ({error['config']}) | – | – | – | – | – | – | – | – "
                     f"| – | {error['error']} | – |")
    failed = [r for r in timings or () if "error" in r]
    if failed:
        lines += ["", f"{len(failed)} kernel runs failed on the GPU; the first: "
                      f"{failed[0]['entry']} ({failed[0]['variant']}): {failed[0]['error']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.opt_levels",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("step", choices=("prepare", "prepare-one", "time", "report", "device"))
    parser.add_argument("spec", nargs="?", help=argparse.SUPPRESS)   # prepare-one's function
    parser.add_argument("--models", type=lambda s: s.split(","), default=list(DEFAULT_MODELS))
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--json", type=Path, help="time: where the timings go")
    parser.add_argument("--scratch", type=Path,
                        help="device: where to prepare when --dir holds no manifest")
    parser.add_argument("--timings", type=Path, help="report: the timings `time` wrote")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--check-only", action="store_true",
                        help="time: launch each kernel once and check it, no timing")
    args = parser.parse_args(argv)
    if args.step == "prepare-one":
        model, _, config = args.spec.partition(":")
        print(json.dumps(prepare_one(model, config, args.dir)))
        return
    if args.step == "prepare":
        venv = Path(os.environ.get("STITCH_CUDA_VENV", Path(__file__).parents[1] / ".venv-cuda"))
        python = venv / "bin" / "python"
        if not python.exists():
            raise SystemExit(f"{python} is missing: run scripts/deviceless_check.sh once")
        prepare(args.models, args.dir, str(python))
        args.step = "report"
    if args.step == "device":
        if not (args.dir / "manifest.json").exists():
            if args.scratch is None:
                raise SystemExit("device: no manifest in --dir and no --scratch to prepare in")
            print(f"[opt_levels] no {args.dir / 'manifest.json'}: preparing "
                  f"{','.join(args.models)} here", file=sys.stderr, flush=True)
            prepare(args.models, args.scratch, sys.executable)
            args.dir = args.scratch
        args.step = "time"
    if args.step == "time":
        results = time_kernels(args.dir, check_only=args.check_only)
        text = json.dumps(results, indent=1)
        if args.json:
            args.json.write_text(text)
        else:
            print(text)
        return
    manifest = json.loads((args.dir / "manifest.json").read_text())
    timings = json.loads(args.timings.read_text()) if args.timings else None
    command = "python -m bench.opt_levels " + " ".join(argv if argv is not None
                                                       else sys.argv[1:])
    from bench.report import publish
    publish(args.out, SECTION, markdown(manifest, timings, command.strip()))


if __name__ == "__main__":
    main()
