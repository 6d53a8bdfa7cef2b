"""The TF front end's data path per stitched step, on this CPU: what moving a keras_hub
model's inputs and variables into the stitched executable and its outputs and variable
updates back costs, without the program itself.

- before: the numpy round trip the front end used (``.numpy()`` of every input and
  variable, numpy into jax, ``np.asarray`` of every result, ``assign`` / ``convert_to_tensor``
  from numpy);
- after: ``stitch.frontends.tf.tf_bridge.Bridge`` (DLPack both ways, variables assigned from the
  TF tensor wrapping jax's result).

The models are the integration tests' keras_hub GPT2 and Llama configs
(``examples/thirdparty/keras_hub_train.py``: 2 layers, hidden 64, vocabulary 128,
batch 4 x 16 tokens, AdamW), trained one step by stock Keras (TF backend) so the optimizer's
variables exist; the mapping (which values the step reads and writes) is the front end's own.

``--conversions``: host conversions per training step, stock Keras against the stitched
step, over whole ``model.fit`` runs (``bench/tf_conversions.py``; section
``bench-tf-conversions``).

    KERAS_BACKEND=tensorflow python -m bench.tf --out docs/benchmarks.md
    KERAS_BACKEND=tensorflow python -m bench.tf --conversions --out docs/benchmarks.md
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from bench.report import publish, stamp
from bench.tf_conversions import MODELS, compiled_model

SECTION = "bench-tf-bridge"
CONVERSIONS_SECTION = "bench-tf-conversions"


@dataclass
class BridgeTiming:
    model: str
    inputs: int              # tensors handed to the program (arguments, variables, constants)
    updates: int             # variables written back
    outputs: int
    input_bytes: int
    before_us: float         # median µs per step, numpy round trip
    after_us: float          # median µs per step, DLPack

    @property
    def moved(self) -> int:
        return self.inputs + self.updates

    def row(self) -> str:
        per = lambda us: us / max(self.moved, 1)   # noqa: E731
        return (f"| {self.model} | {self.inputs} | {self.updates} | {self.outputs} | "
                f"{self.input_bytes / 2**20:.2f} | {self.before_us:,.0f} | "
                f"{per(self.before_us):.1f} | {self.after_us:,.0f} | {per(self.after_us):.1f} | "
                f"{self.before_us / self.after_us:.1f}× |")


def _step_and_data(name: str) -> tuple[Any, tuple]:
    """The model's train step as the front end wraps it, and one batch as Keras hands it."""
    import tensorflow as tf

    from stitch.frontends.tf.tf_frontend import KerasTrainFunction

    script, model, x, y = compiled_model(name)
    model.fit(x, y, batch_size=script.BATCH, epochs=1, verbose=0)   # optimizer variables
    stock = model.make_train_function()
    train = KerasTrainFunction(model, stock)
    batch = (tf.nest.map_structure(tf.constant, x), tf.constant(y))
    return train.step, (batch,)


def _median_us(run: Callable[[], None], repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def measure(name: str, repeats: int) -> BridgeTiming:
    import jax
    import numpy as np
    import tensorflow as tf

    from stitch.frontends.tf.tf_bridge import Bridge

    step, args = _step_and_data(name)
    mapping = step.mapping_for(*args)
    values = step.read_values(mapping, *args)
    keep = frozenset(i for i, (kind, _) in enumerate(mapping.sources) if kind == "const")
    updates = [(o, mapping.sources[p][1]) for o, p in mapping.updates]
    targets = [v for _, v in updates]
    with jax.enable_x64(True):
        # stand-ins for the program's results: arrays of the results' shapes on jax's device
        results = [jax.device_put(np.asarray(v.numpy())) for v in targets]
        outputs = [jax.device_put(np.zeros(1, np.float32)) for _ in range(mapping.n_outputs)]
    bridge = Bridge(gpu=False)

    def before() -> None:
        with jax.enable_x64(True):
            inputs = [jax.device_put(v.numpy() if hasattr(v, "numpy") else np.asarray(v))
                      for v in step.read_values(mapping, *args)]
            jax.block_until_ready(inputs)
            for var, r in zip(targets, results):
                var.assign(np.asarray(r))
            [tf.convert_to_tensor(np.asarray(o)) for o in outputs]

    def after() -> None:
        with jax.enable_x64(True):
            bridge.to_jax(step.read_values(mapping, *args), keep)
            back = bridge.to_tf(outputs + results)
            for var, t in zip(targets, back[len(outputs):]):
                var.assign(t)

    nbytes = sum(int(np.prod(v.shape)) * v.dtype.size for v in values)
    return BridgeTiming(name, len(values), len(targets), mapping.n_outputs, nbytes,
                        _median_us(before, repeats), _median_us(after, repeats))


def report(timings: list[BridgeTiming], command: str, load: tuple[float, ...]) -> str:
    lines = [
        "## The TF front end's data path per stitched step (CPU)",
        "",
        stamp(command, load),
        "",
        "What a stitched Keras-on-TF step spends moving its values between TF and the "
        "stitched executable, the program itself left out: every input (the batch, each "
        "variable's value, captured constants) in, every output and variable update back "
        "(median of the repeats). *before*: the numpy round trip (`.numpy()` → jax, "
        "`np.asarray` → `assign`); *after*: DLPack both ways (`stitch/frontends/tf/tf_bridge.py`). "
        "Per variable: the step's µs over the values moved (inputs + updates). On this CPU "
        "both stay in host memory, so *before* pays memcpys where *after* wraps buffers; "
        "on a GPU *before* crossed PCIe twice per value and *after* stays on the device.",
        "",
        "| model | inputs | updates | outputs | input MiB | before µs/step | before µs/value | "
        "after µs/step | after µs/value | before/after |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [t.row() for t in timings]
    return "\n".join(lines)


def conversions_report(results: list, command: str, load: tuple[float, ...]) -> str:
    """The host-conversion counts (``tf_conversions.StepConversions``) as markdown."""
    lines = [
        "Every host conversion of a TF or jax value (`np.asarray`/`np.array`, `.numpy()`, "
        "`__array__`, `float()`/`int()`/`bool()` of a tensor or jax array; "
        "`stitch/frontends/tf/host_conversions.py`) over one `model.fit` of the keras_hub "
        "model on fresh random batches, one step per epoch, stock (`jit_compile=True`) and "
        "stitched (`KerasTrainFunction`, compiled before the first call, guard off: call 1 "
        "compiles and is the verified call, every later call runs the stitched program). "
        "*extra / stitched step*: the stitched run's conversions beyond stock over the whole "
        "run (tracing, compile and verified call included) per stitched step; *after the "
        "switch*: the same over the stitched steps only; *loss*: the largest relative "
        "difference of a step's loss from stock. Keras itself reads each step's logs "
        "(`pythonify_logs`) and `has_value()` of the next batch, on both sides. Before the "
        "first call's check against TF ran on the device (`stitch/frontends/"
        "device_compare.py`), it copied every output and updated variable to numpy: "
        "17.9 (GPT2) and 10.0 (Llama) extra conversions per stitched step over 15 steps.",
        "",
        "| model | steps | stitched steps | stock / step | stitched / step | "
        "extra / stitched step | extra / step after the switch | loss rel. diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [r.row() for r in results]
    lines += ["", stamp(command, load)]
    return "\n".join(lines)


def _run_part(ctx) -> list[str]:
    from bench.measure import script
    return script("bench.tf", [], ["--repeats", "5", "--models", "gpt2"], block=SECTION,
                  env={"KERAS_BACKEND": "tensorflow"})(ctx)


def _run_conversions(ctx) -> list[str]:
    from bench.measure import script
    return script("bench.tf", ["--conversions"], ["--conversions", "--models", "gpt2"],
                  block=CONVERSIONS_SECTION, env={"KERAS_BACKEND": "tensorflow"})(ctx)


def _measure():
    from bench.measure import Measure, Part
    return Measure(
        name="tf",
        title="The TF front end's data path per stitched step (measured, CPU)",
        summary="What the TensorFlow front end adds around a stitched step: tensors in and "
                "out of the stitched program, and host conversions per step against stock "
                "Keras (needs tensorflow and keras_hub).",
        parts=(Part("bridge", "Per-step data path", _run_part),
               Part("conversions", "Host conversions per step", _run_conversions)))


MEASURE = _measure()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--conversions", action="store_true",
                        help="count host conversions per step, stock vs stitched")
    parser.add_argument("--steps", type=int, default=None,
                        help="--conversions: fit steps per run (default: tf_conversions.STEPS)")
    args = parser.parse_args()
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    load = os.getloadavg()
    if args.conversions:
        from bench import tf_conversions
        steps = args.steps or tf_conversions.STEPS
        results = [tf_conversions.count(m, steps) for m in args.models]
        publish(args.out, CONVERSIONS_SECTION, conversions_report(
            results, "KERAS_BACKEND=tensorflow python -m bench.tf --conversions --out "
                     "docs/benchmarks.md", load))
        return
    timings = [measure(m, args.repeats) for m in args.models]
    publish(args.out, SECTION, report(timings, "KERAS_BACKEND=tensorflow python -m "
                                               "bench.tf --out docs/benchmarks.md",
                                      load))


if __name__ == "__main__":
    main()
