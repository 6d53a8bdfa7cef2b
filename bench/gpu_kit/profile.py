"""The kit's ``profile`` step: where a whole step's time goes, stitched against stock.

Per model: the step under ``jax.jit`` and under ``stitch.jit`` (compiled before the trace),
``CALLS`` calls of each inside one ``jax.profiler.trace`` (a perfetto trace, no extra
package), then per side: device time per call summed over the device's kernel events,
kernels per call, the busiest kernels (µs per call), and the host's own events per call
(dispatch, execute). Answers what whole-step timings cannot: whether a stitched step loses
its time in its own kernels, in XLA's kernels around them, or on the host. Writes
``<out>/profile.json``; on a CPU (the rehearsal) there are host events only.
"""
from __future__ import annotations

import collections
import gzip
import json
import sys
import tempfile
from pathlib import Path

from .step_cli import chosen_models, step_arguments

MODELS = (("transformer_train", "tiny"), ("bert_layer_infer", "full"),
          ("embedding_bag", "full"))
REHEARSAL_MODELS = (("log_softmax_xent_train", "tiny"),)
CALLS = 5
TOP = 12
# Host events worth a line of their own: jax's dispatch and PJRT's execute.
HOST_EVENTS = ("PjitFunction", "ExecuteHelper", "Execute", "ParseArguments")


def summarize(trace: dict, calls: int, marker: str) -> dict:
    """Device and host time per call of the events between the ``marker`` annotations.

    Device events: every complete event of a process whose name says GPU ("/device:GPU:0":
    CUPTI's kernels and memcpys); host: complete events of the other processes whose names start with
    one of ``HOST_EVENTS``."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    processes = {e["pid"]: str(e.get("args", {}).get("name", ""))
                 for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    window = [e for e in events if e.get("ph") == "X" and e.get("name") == marker]
    if window:
        start = min(e["ts"] for e in window)
        end = max(e["ts"] + e.get("dur", 0) for e in window)
    else:
        start, end = float("-inf"), float("inf")
    device_us: collections.Counter = collections.Counter()
    device_n: collections.Counter = collections.Counter()
    host_us: collections.Counter = collections.Counter()
    for e in events:
        if e.get("ph") != "X" or not start <= e.get("ts", 0) <= end:
            continue
        where = processes.get(e.get("pid"), "")
        if "GPU" in where:
            device_us[e["name"]] += e.get("dur", 0)
            device_n[e["name"]] += 1
        elif any(str(e.get("name", "")).startswith(h) for h in HOST_EVENTS):
            host_us[e["name"]] += e.get("dur", 0)
    per_call = max(calls, 1)
    return {"device_us_per_call": round(sum(device_us.values()) / per_call, 2),
            "device_events_per_call": round(sum(device_n.values()) / per_call, 1),
            "top_device": [{"name": name[:120], "us_per_call": round(us / per_call, 2),
                            "count_per_call": round(device_n[name] / per_call, 1)}
                           for name, us in device_us.most_common(TOP)],
            "host_us_per_call": {name[:80]: round(us / per_call, 2)
                                 for name, us in host_us.most_common(8)},
            "processes": sorted(set(processes.values()))}


def _trace(fn, args: list, marker: str, calls: int) -> dict:
    import jax
    with tempfile.TemporaryDirectory(prefix="stitch_profile_") as folder:
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            for _ in range(calls):
                with jax.profiler.TraceAnnotation(marker):
                    jax.block_until_ready(fn(*args))
        found = sorted(Path(folder).rglob("perfetto_trace.json.gz"))
        if not found:
            raise FileNotFoundError(f"jax.profiler wrote no perfetto trace under {folder}")
        with gzip.open(found[-1], "rt") as f:
            return json.load(f)


def profile_model(model: str, config: str, device: str, calls: int = CALLS) -> dict:
    import jax

    import stitch
    from stitch.models import build

    inst = build(model, config)
    args = [jax.numpy.asarray(a) for a in inst.random_args(5)]
    stitched = stitch.jit(inst.fn, async_compile=False, guard=False, device=device)
    stock = jax.jit(inst.fn)
    for fn in (stock, stitched, stock, stitched):            # compiled and warm
        jax.block_until_ready(fn(*args))
    row: dict = {"model": model, "config": config, "device": device,
                 "stitched_calls": stitched.stats.stitched_calls,
                 "fallbacks": [str(f) for f in stitched.stats.fallbacks]}
    for side, fn in (("stock", stock), ("stitched", stitched)):
        marker = f"stitch_profile_{side}"
        row[side] = summarize(_trace(fn, args, marker, calls), calls, marker)
    return row


def main(argv: list[str] | None = None) -> int:
    args = step_arguments("python -m bench.gpu_kit.profile", argv)
    import jax
    device = "gpu" if jax.default_backend() == "gpu" else "cpu"
    models = chosen_models(args, MODELS, REHEARSAL_MODELS)
    rows = []
    for model, config in models:
        try:
            row = profile_model(model, config, device)
        except Exception as exc:  # noqa: BLE001 - one model's failure is a row
            row = {"model": model, "config": config, "error": f"{type(exc).__name__}: {exc}"}
        rows.append(row)
        brief = {k: row[k]["device_us_per_call"] for k in ("stock", "stitched") if k in row}
        print(f"profile: {model} ({config}): device µs per call {brief or row.get('error')}",
              flush=True)
        (args.out / "profile.json").write_text(json.dumps({"device": device, "models": rows},
                                                          indent=1))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
