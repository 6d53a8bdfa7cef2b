"""Compile cost of stitch inside XLA, side by side with jax.jit's own compile (measured).

``python -m bench.compile.in_xla [--models bert_layer_train:tiny,...] [--out docs/benchmarks.md]``

Per function, in a fresh subprocess with an empty ``STITCH_CACHE_DIR`` (cold) and then again
with the same directory (warm), after an untimed compile of a small function
(``warm_up_backend``: the process's one-time XLA set-up is then on neither side):
- ``jax.jit``: ``jax.jit(fn).lower(*args).compile()``'s compile — XLA's;
- ``stitched``: the same lowering compiled with stitch's pass on
  (``stitch.xla_pass.entry.compile_with_pass``): XLA's pipeline plus, inside it, stitch's
  parse, plan, snapping, Kernel IR lowering and the host build of each kernel, and the
  rewrite; ``plan``/``build``: the pass's own timings.
Both sides are traced and lowered before their timers: jax serves a function's second
lowering from its caches, so a timed lowering would be charged to jax.jit's side alone
(~0.2 s of transformer_train tiny's). Each side's CPU seconds (this process's threads and
the child processes that ended meanwhile: ptxas, stitch's PTX children) are recorded too.
The overhead is stitched − jax.jit; the goal is at most half of XLA's own compile.
Kernels: what XLA launched for the module and what is left once stitch's calls are in.
``keras_hub_llama`` (a keras_hub Llama backbone step, tiny config) runs when keras_hub is
installed. ``--gpu``: the same against XLA GPU's compile for an H100, deviceless (jax's CUDA
plugin in the venv scripts/deviceless_check.sh makes); stitch builds PTX + cubins, no host code.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from bench.report import REPO

DEFAULT_MODELS = ("bert_layer_train:tiny", "bert_layer_train:full", "transformer_train:tiny",
                  "keras_hub_llama:tiny")
SECTION = "bench-pass-compile"


def zoo_step(name: str, config: str):
    from stitch.models import build
    inst = build(name, config)
    return inst.fn, inst.random_args(0)


def keras_hub_llama_step():
    """A keras_hub Llama backbone's training step as a pure jax function (random init)."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import jax
    import jax.numpy as jnp
    import keras
    import keras_hub
    import numpy as np

    model = keras_hub.models.LlamaBackbone(vocabulary_size=512, num_layers=2, num_query_heads=4,
                                           num_key_value_heads=2, hidden_dim=64,
                                           intermediate_dim=128, max_sequence_length=64)
    trainable = [v.value for v in model.trainable_variables]
    rest = [v.value for v in model.non_trainable_variables]
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 512, (4, 32)).astype("int32")
    batch = {"token_ids": tokens, "padding_mask": np.ones((4, 32), "int32")}

    def step(trainable, rest, batch):
        def loss(trainable):
            hidden, _ = model.stateless_call(trainable, rest, batch)
            return jnp.mean(jnp.square(hidden))
        value, grads = jax.value_and_grad(loss)(trainable)
        return [w - 1e-3 * g for w, g in zip(trainable, grads)], value
    keras.utils.set_random_seed(0)
    return step, (trainable, rest, batch)


def warm_up_backend(sharding=None) -> float:
    """Compile a small function first (untimed; its seconds returned): the process's first
    XLA compile also pays one-time set-up (the backend's compiler, LLVM's targets), which
    would otherwise fall on the jax.jit side alone and flatter the stitched compile that
    follows it."""
    import jax
    import jax.numpy as jnp

    spec = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=sharding)
    start = time.perf_counter()
    jax.jit(lambda x: jnp.tanh(x @ x).sum(axis=0)).lower(spec).compile()
    return time.perf_counter() - start


def _row(model: str, config: str, jax_s: float, stitched_s: float, report) -> dict:
    return {"model": model, "config": config, "jax_s": jax_s, "stitched_s": stitched_s,
            "plan_s": report.timings.get("plan_s", 0.0),
            "build_s": report.timings.get("build_s", 0.0),
            "pass_s": report.timings.get("pass_s", 0.0),
            **{k: round(report.timings[k], 3) for k in ("lower_s", "ptx_s", "targets_s",
                                                        "plan_cpu_s")
               if k in report.timings},
            "kernels_xla": report.kernels_xla, "kernels_after": report.kernels_after,
            "stitched": report.kernels_stitched,
            "narrowed": len(getattr(report, "narrowed", ())),
            "unpaid": len(getattr(report, "unpaid", ()))}


def measure_one(model: str, config: str) -> dict:
    """One function's compile times (this process; the caller sets STITCH_CACHE_DIR)."""
    import jax

    from stitch.xla_pass.entry import PassRequest, compile_with_pass, ensure_registered

    fn, args = keras_hub_llama_step() if model == "keras_hub_llama" else zoo_step(model, config)
    warm_up_s = warm_up_backend()
    # Traced and lowered before either timer: a second lowering of the same function is
    # served from jax's caches, so timing it would charge only jax.jit's side with it.
    lowered = jax.jit(fn).lower(*args)
    jax_s, jax_cpu = _timed(lowered.compile)
    ensure_registered("cpu")
    request = PassRequest(model, "h100", "cpu")
    lowered = jax.jit(fn).lower(*args)
    (_, report), stitched_s, stitched_cpu = _timed_result(
        lambda: compile_with_pass(lowered, request))
    return {**_row(model, config, jax_s, stitched_s, report), "warm_up_s": round(warm_up_s, 3),
            "jax_cpu_s": round(jax_cpu, 3), "stitched_cpu_s": round(stitched_cpu, 3),
            "cores": os.cpu_count() or 1}


def _timed(work) -> tuple[float, float]:
    """Wall seconds of ``work()`` and the CPU seconds it took: this process's threads and
    the child processes that ended meanwhile (ptxas, stitch's PTX children)."""
    _, wall, cpu = _timed_result(work)
    return wall, cpu


def _timed_result(work):
    def cpu() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system
    start, cpu0 = time.perf_counter(), cpu()
    result = work()
    return result, time.perf_counter() - start, cpu() - cpu0


def measure_one_gpu(model: str, config: str, target: str = "h100") -> dict:
    """The same, for XLA GPU (deviceless, one ``target`` device from jax's CUDA plugin; run
    inside scripts/deviceless_check.sh's venv): jax.jit's XLA GPU compile against the compile
    with the pass, whose kernels are emitted as PTX and assembled by ptxas (no host build)."""
    import jax
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    from stitch.xla_pass import deviceless

    deviceless.check_environment()
    fn, args = keras_hub_llama_step() if model == "keras_hub_llama" else zoo_step(model, config)
    mesh = topologies.make_mesh(deviceless.topology(target, "1x1x1"), (1,), ("d",))
    replicated = NamedSharding(mesh, PartitionSpec())
    specs = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), args)
    warm_up_s = warm_up_backend(replicated)
    lowered = jax.jit(fn).lower(*specs)         # before either timer (measure_one)
    jax_s, jax_cpu = _timed(lowered.compile)
    deviceless.ensure_pass_registered()
    lowered = jax.jit(fn).lower(*specs)
    compiled, stitched_s, stitched_cpu = _timed_result(
        lambda: deviceless.compile_with_pass(lowered, model, target))
    report = compiled.report
    return {**_row(model, config, jax_s, stitched_s, report), "warm_up_s": round(warm_up_s, 3),
            "jax_cpu_s": round(jax_cpu, 3), "stitched_cpu_s": round(stitched_cpu, 3),
            "cores": os.cpu_count() or 1,
            "device_handlers_s": round(device_handlers_s(report), 3)}


def device_handlers_s(report) -> float:
    """Seconds to build, on this host, the CUDA FFI handlers a compile on a real device
    makes for ``report``'s kernels besides what the deviceless compile does (host code:
    ``stitch.codegen.ffi_cuda.build_cuda_handler``, as cuda_ffi_target builds them, here against
    placeholder driver addresses; never run), under the pass's collector settings."""
    from stitch.codegen.ffi_cuda import DriverSymbols, LoadedFunction, build_cuda_handler
    from stitch.xla_pass.collector import fewer_collections

    placeholder = DriverSymbols(*(0x1000 * (i + 1) for i in range(6)))
    functions = [LoadedFunction(0, 0x10000, 0x20000, 0x30000)]
    engines = []
    with fewer_collections():
        start = time.perf_counter()
        for i, built in enumerate(report.kernels):
            engines.append(build_cuda_handler(built.lowered.kernel, f"stitch_bench_handler_{i}",
                                              functions, placeholder))
        return time.perf_counter() - start


def _run_child(model: str, config: str, cache_dir: str, timeout: float,
               python: str = sys.executable, gpu: bool = False) -> dict:
    env = {**os.environ, "STITCH_CACHE_DIR": cache_dir, "PYTHONPATH": str(REPO)}
    if gpu:
        env.update(CUDA_VISIBLE_DEVICES="-1", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1")
    run = subprocess.run([python, "-m", "bench.compile.in_xla", "--one-gpu" if gpu else "--one",
                          f"{model}:{config}"],
                         capture_output=True, text=True, timeout=timeout, env=env)
    lines = [l for l in run.stdout.splitlines() if l.startswith("{")]
    if run.returncode != 0 or not lines:
        tail = (run.stderr.strip().splitlines() or ["no output"])[-1]
        return {"model": model, "config": config, "error": tail[:200]}
    return json.loads(lines[-1])


def _median_run(runs: list[dict]) -> dict:
    """Of repeated runs of one function, the one with the median overhead (the run's own
    numbers stay together); ``overheads`` keeps every run's, in run order."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return runs[0]
    ranked = sorted(good, key=lambda r: (r["stitched_s"] - r["jax_s"]) / r["jax_s"])
    chosen = dict(ranked[(len(ranked) - 1) // 2])
    chosen["overheads"] = [round((r["stitched_s"] - r["jax_s"]) / r["jax_s"], 3) for r in good]
    return chosen


def collect(models: list[str], timeout: float = 1200.0, python: str = sys.executable,
            gpu: bool = False, repeat: int = 1) -> list[dict]:
    rows = []
    for spec in models:
        model, _, config = spec.partition(":")
        if model == "keras_hub_llama":
            import importlib.util
            if importlib.util.find_spec("keras_hub") is None:
                rows.append({"model": model, "config": config or "tiny",
                             "error": "keras_hub is not installed"})
                continue
        colds, warms = [], []
        for _ in range(repeat):
            with tempfile.TemporaryDirectory() as cache_dir:
                os.chmod(cache_dir, 0o700)
                colds.append(_run_child(model, config or "tiny", cache_dir, timeout, python,
                                        gpu))
                warms.append(_run_child(model, config or "tiny", cache_dir, timeout, python,
                                        gpu))
        cold, warm = _median_run(colds), _median_run(warms)
        cold["warm_stitched_s"] = warm.get("stitched_s")
        cold["warm_jax_s"] = warm.get("jax_s")
        rows.append(cold)
        print(f"[pass_compile] {spec}: {cold}", file=sys.stderr, flush=True)
    return rows


def cpu_floor(row: dict) -> float:
    """The least overhead a run's CPU seconds allow: the stitched compile cannot take less
    wall time than its CPU seconds spread over every core."""
    return row["stitched_cpu_s"] / row["cores"] / row["jax_s"] - 1


def markdown(rows: list[dict], command: str, gpu: bool = False) -> str:
    from bench.report import stamp
    if gpu:
        title = "## Compile cost on the GPU path: stitch inside XLA GPU vs jax.jit (measured, deviceless H100)"
        what = ("*jax.jit*: XLA GPU's compile for one H100 (deviceless: jax's CUDA "
                "plugin in scripts/deviceless_check.sh's venv, no GPU; XLA's own autotuning "
                "is off without a device). *stitched*: the same lowering compiled with stitch's "
                "pass on at POST_SCHEDULER (plan, snapping, Kernel IR lowering, PTX emission in "
                "an isolated child and ptxas for sm_90 of every kernel — no host build), cold "
                "(empty compile cache) and warm (the cold run's PTX, cubin and plan caches). "
                "Kernels are counted in XLA GPU's module. *left unpaid*: kernels the pass "
                "left to XLA because their modeled saving would not repay their build within "
                "STITCH_PAYBACK_STEPS (default 100,000) steps (stitch/xla_pass/payback.py). "
                "*device handlers*: not in the times — what a compile on a real device adds "
                "on the pass's thread: the host-side CUDA FFI handler of each stitched kernel, "
                "built here as on a device (placeholder driver addresses, never run).")
    else:
        title = "## Compile cost: stitch inside XLA vs jax.jit (measured)"
        what = ("*jax.jit*: XLA's compile. *stitched*: the same lowering compiled with "
                "stitch's pass on (XLA's pipeline plus stitch's plan, snapping, Kernel IR "
                "lowering and host build of every kernel, and the rewrite), cold (empty compile "
                "cache) and warm (the cold run's compile and plan caches). Kernels are counted "
                "in XLA's CPU module.")
    lines = [title, "", stamp(command, os.getloadavg()), "",
             "Wall seconds, each function in a fresh process, both compiles after an untimed "
             "compile of a small function (the process's one-time XLA set-up) and after the "
             "function is traced and lowered (untimed on both sides: jax serves the second "
             "lowering from its caches). " + what +
             " Overhead = stitched − jax.jit, as a fraction of jax.jit (the goal: ≤ 0.5)."
             " *CPU s*: the cold run's CPU seconds on each side (this process's threads and the "
             "child processes that ended during the compile: ptxas, stitch's PTX children); "
             "*CPU floor*: the least overhead that CPU allows on the machine's cores "
             "(stitched CPU s / cores against jax.jit's wall seconds)."
             " With --repeat, each row is the run of median overhead, and *all cold overheads* "
             "lists every run's.",
             "",
             "| function | jax.jit s | stitched s (cold) | plan s | build s | overhead | "
             "stitched s (warm) | overhead warm | kernels XLA → stitched | stitched kernels | "
             "left unpaid | CPU s jax.jit → stitched | CPU floor | all cold overheads |"
             + (" device handlers s |" if gpu else ""),
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---|"
             + ("---:|" if gpu else "")]
    for r in rows:
        name = f"{r['model']} ({r['config']})"
        extra = f" {r['device_handlers_s']:.2f} |" if gpu and "device_handlers_s" in r else \
            (" – |" if gpu else "")
        if "error" in r:
            lines.append(f"| {name} | – | – | – | – | – | – | – | {r['error']} | – | – | – | – "
                         "| – |" + extra)
            continue
        over = (r["stitched_s"] - r["jax_s"]) / r["jax_s"]
        runs = ", ".join(f"{o:.2f}×" for o in r.get("overheads", [over]))
        warm = r.get("warm_stitched_s")
        warm_over = (warm - r["warm_jax_s"]) / r["warm_jax_s"] if warm and r.get("warm_jax_s") \
            else None
        warm_cells = f"{warm:.2f} | {warm_over:.1f}×" if warm is not None else "– | –"
        if "stitched_cpu_s" in r:
            cpu = f"{r['jax_cpu_s']:.1f} → {r['stitched_cpu_s']:.1f}"
            floor = f"{max(0.0, cpu_floor(r)):.2f}× ({r['cores']} cores)"
        else:
            cpu = floor = "–"
        lines.append(
            f"| {name} | {r['jax_s']:.2f} | {r['stitched_s']:.2f} | {r['plan_s']:.2f} | "
            f"{r['build_s']:.2f} | {over:.1f}× | {warm_cells} | {r['kernels_xla']} → "
            f"{r['kernels_after']} | {r['stitched']} | {r.get('unpaid', 0)} | {cpu} | {floor} | "
            f"{runs} |" + extra)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.compile.in_xla",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=lambda s: s.split(","), default=list(DEFAULT_MODELS))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--gpu", action="store_true",
                        help="XLA GPU, deviceless H100, in the venv of "
                             "scripts/deviceless_check.sh (STITCH_CUDA_VENV, default .venv-cuda)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs per function, cold and warm; the run of median overhead "
                             "is shown (this machine's speed moves between runs)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--one-gpu", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one or args.one_gpu:
        model, _, config = (args.one or args.one_gpu).partition(":")
        one = measure_one_gpu if args.one_gpu else measure_one
        print(json.dumps(one(model, config)))
        return
    python = sys.executable
    if args.gpu:
        venv = Path(os.environ.get("STITCH_CUDA_VENV", REPO / ".venv-cuda"))
        python = str(venv / "bin" / "python")
        if not Path(python).exists():
            raise SystemExit(f"{python} is missing: run scripts/deviceless_check.sh once")
    rows = collect(args.models, python=python, gpu=args.gpu, repeat=max(1, args.repeat))
    command = "python -m bench.compile.in_xla " + " ".join(argv if argv is not None else sys.argv[1:])
    body = markdown(rows, command.strip(), gpu=args.gpu)
    if args.out:
        from bench.report import write_section
        write_section(args.out, SECTION + ("-gpu" if args.gpu else ""), body)
    else:
        print(body)


if __name__ == "__main__":
    main()
