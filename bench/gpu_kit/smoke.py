"""The kit's ``smoke`` step: is stitch's pass called by XLA here? Fails (exit 2) loudly if not.

1. ``stitch.jit`` of a zoo model (synchronous compile, guard off) on jax's default device:
   the pass must have run (a ``PassReport``), placed at least one kernel, and the stitched
   call must match ``jax.jit`` on fresh inputs.
2. ``STITCH_ENABLE=1`` from this checkout on PYTHONPATH (the ``scripts/pythonpath``
   sitecustomize, nothing installed): in a child, ``jax.jit`` must be stitch's.

``--quick``: only 1., with the smallest model (what compute-sanitizer runs under jax).
Writes ``<out>/smoke.json`` (``smoke_quick.json`` with --quick).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Models whose plan on every GPU target stitches something (a layer norm alone is one XLA
# kernel already on an H200, and a plan that fuses nothing is no test of the pass).
MODELS = ("log_softmax_xent_train", "bert_layer_train")
CHILD = ("import jax, sys\n"
         "original = getattr(jax.jit, '__stitch_original__', None)\n"
         "print('patched' if original is not None else 'stock')\n")


def run_model(name: str, config: str = "tiny") -> dict:
    import jax
    import numpy as np

    import stitch
    from stitch.frontends.verify import compare_trees
    from stitch.models import build

    inst = build(name, config)
    device = "gpu" if jax.default_backend() == "gpu" else "cpu"
    start = time.perf_counter()
    fn = stitch.jit(inst.fn, async_compile=False, guard=False, device=device)
    args = [jax.numpy.asarray(a) for a in inst.random_args(1)]
    got = fn(*args)
    jax.block_until_ready(got)
    compile_s = time.perf_counter() - start
    programs = fn.programs()
    record: dict = {"model": name, "config": config, "device": device,
                    "compile_and_first_call_s": round(compile_s, 2),
                    "pass_called": bool(programs), "stats": {
                        "calls": fn.stats.calls, "stitched_calls": fn.stats.stitched_calls,
                        "fallbacks": [str(f) for f in fn.stats.fallbacks]}}
    if programs:
        record["report"] = programs[0].summary()
        record["placed"] = list(programs[0].placed)
    fresh = [jax.numpy.asarray(a) for a in inst.random_args(2)]
    want = jax.jit(inst.fn)(*fresh)
    got = fn(*fresh)
    rtol = 2e-2 if "bf16" in name else 1e-4
    mismatch = compare_trees(jax.tree_util.tree_map(np.asarray, got),
                             jax.tree_util.tree_map(np.asarray, want), rtol)
    record["matches_jax_jit"] = mismatch is None
    record["mismatch"] = mismatch
    return record


def autoload_child() -> dict:
    env = dict(os.environ)
    env["STITCH_ENABLE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "scripts" / "pythonpath")])
    run = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         env=env, cwd="/", timeout=120)
    return {"stdout": run.stdout.strip(), "stderr_tail": run.stderr.strip()[-500:],
            "patched": run.stdout.strip().endswith("patched")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_kit.smoke")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rehearse", action="store_true")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    problems: list[str] = []
    record: dict = {"models": []}
    for name in MODELS[:1] if args.quick else MODELS:
        try:
            result = run_model(name)
        except Exception as exc:  # noqa: BLE001 - the step's verdict
            result = {"model": name, "error": f"{type(exc).__name__}: {exc}"}
        record["models"].append(result)
        print(f"smoke: {json.dumps(result, default=str)}", flush=True)
        if "error" in result:
            problems.append(f"{name}: {result['error']}")
        elif not result["pass_called"]:
            problems.append(f"{name}: no stitched program ({result['stats']['fallbacks']})")
        elif not result["stats"]["stitched_calls"]:
            problems.append(f"{name}: no call ran stitched ({result['stats']['fallbacks']})")
        elif not result["matches_jax_jit"]:
            problems.append(f"{name}: differs from jax.jit: {result['mismatch']}")
    if not args.quick:
        try:
            record["autoload"] = autoload_child()
        except (OSError, subprocess.TimeoutExpired) as exc:
            record["autoload"] = {"patched": False, "error": str(exc)}
        print(f"smoke: STITCH_ENABLE=1 from PYTHONPATH: {record['autoload']}", flush=True)
        if not record["autoload"]["patched"]:
            problems.append("STITCH_ENABLE=1 with the checkout on PYTHONPATH left jax.jit "
                            "stock")
    record["problems"] = problems
    name = "smoke_quick.json" if args.quick else "smoke.json"
    (args.out / name).write_text(json.dumps(record, indent=1, default=str))
    if problems:
        print("SMOKE FAILED:\n  " + "\n  ".join(problems), flush=True)
        return 2
    print("smoke: stitch's pass ran and its results match jax.jit", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
