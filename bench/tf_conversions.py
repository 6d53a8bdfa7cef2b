"""Host conversions per Keras training step on the TF backend, stock against stitched.

One keras_hub backbone (``examples/thirdparty/keras_hub_train.py``'s GPT2 or
Llama: 2 layers, hidden 64, vocabulary 128, random init, AdamW, batch 4 x 16 tokens) is
trained ``steps`` steps by ``model.fit`` on fresh random batches (one step per epoch, so each
epoch's loss is that step's), twice from the same seed:

- stock: Keras' own train function (``jit_compile=True``: XLA, as on a GPU machine, so both
  runs draw the same dropout masks);
- stitched: ``tf_frontend.KerasTrainFunction`` with the compile before the first call and
  the guard off: call 1 traces, compiles and is the verified call (the stitched program
  and the stock step both run, the stock result is kept); every later call runs the
  stitched program.

Every host conversion of a TF or jax value over the whole ``fit`` is counted
(``stitch.frontends.tf.host_conversions``), per step. ``extra_per_stitched_step``: the
stitched run's conversions beyond the stock run's over the whole run — compile, verified
call and guard included — per stitched step; ``steady_extra_per_step``: the same over the
steps after the switch only. ``loss_mismatch``: the per-step losses against stock at
``LOSS_RTOL``.
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("bench")

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "thirdparty" / "keras_hub_train.py"
MODELS = ("gpt2", "llama")
STEPS = 15
LOSS_RTOL = 1e-4               # the third-party scripts' stock-vs-stitched loss bound


def keras_hub_script() -> Any:
    """The third-party training script as a module (its model builders and sizes)."""
    spec = importlib.util.spec_from_file_location("keras_hub_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class RunCount:
    """One ``fit``: its conversions (all, and per step: epoch), the losses, the stitched
    steps."""
    total: int
    per_step: list[int]
    losses: list[float]
    stitched_steps: int = 0
    fallbacks: list[str] = field(default_factory=list)
    sites: collections.Counter = field(default_factory=collections.Counter)


@dataclass
class StepConversions:
    model: str
    steps: int
    stock: RunCount
    stitched: RunCount

    def as_dict(self) -> dict:
        run = lambda r: {**r.__dict__, "sites": dict(r.sites)}   # noqa: E731
        return {"model": self.model, "steps": self.steps, "stock": run(self.stock),
                "stitched": run(self.stitched)}

    @classmethod
    def from_dict(cls, d: dict) -> "StepConversions":
        runs = {k: RunCount(**{**d[k], "sites": collections.Counter(d[k]["sites"])})
                for k in ("stock", "stitched")}
        return cls(d["model"], d["steps"], runs["stock"], runs["stitched"])

    @property
    def extra_per_stitched_step(self) -> float:
        return (self.stitched.total - self.stock.total) / max(self.stitched.stitched_steps, 1)

    @property
    def steady_extra_per_step(self) -> float:
        n = self.stitched.stitched_steps
        if n == 0:
            return 0.0
        extra = sum(self.stitched.per_step[-n:]) - sum(self.stock.per_step[-n:])
        return extra / n

    def loss_mismatch(self, rtol: float = LOSS_RTOL) -> str | None:
        """None when every step's loss agrees with stock within ``rtol`` relative."""
        if len(self.stock.losses) != len(self.stitched.losses):
            return f"{len(self.stitched.losses)} stitched losses vs {len(self.stock.losses)}"
        for step, (a, b) in enumerate(zip(self.stock.losses, self.stitched.losses)):
            if not abs(a - b) <= rtol * max(abs(a), 1e-30):
                return f"step {step}: stitched loss {b!r} vs stock {a!r}"
        return None

    def extra_sites(self) -> list[tuple[str, int]]:
        """Call sites the stitched run converted at more often than stock (``where=True``)."""
        extra = self.stitched.sites - self.stock.sites
        return extra.most_common()

    def row(self) -> str:
        worst = max(abs(a - b) / max(abs(a), 1e-30)
                    for a, b in zip(self.stock.losses, self.stitched.losses))
        return (f"| {self.model} | {self.steps} | {self.stitched.stitched_steps} | "
                f"{self.stock.total / self.steps:.1f} | {self.stitched.total / self.steps:.1f} | "
                f"{self.extra_per_stitched_step:.2f} | {self.steady_extra_per_step:.2f} | "
                f"{worst:.1e} |")


def random_batches(steps: int, seed: int) -> tuple[dict, Any]:
    """``steps`` fresh batches of random tokens, as the script's data (inputs, targets)."""
    import numpy as np

    script = keras_hub_script()
    rng = np.random.default_rng(seed)
    rows = steps * script.BATCH
    tokens = rng.integers(1, script.VOCAB, size=(rows, script.SEQ + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((rows, script.SEQ), "int32")}
    return x, tokens[:, 1:]


def compiled_model(name: str) -> tuple[Any, Any, Any, Any]:
    """(script, model, x, y): the third-party script's keras_hub backbone ``name``, seeded,
    compiled as its training step is (AdamW, sparse cross-entropy on logits, XLA)."""
    import keras

    script = keras_hub_script()
    keras.utils.set_random_seed(0)
    model, x, y = getattr(script, name)()
    model.compile(optimizer=keras.optimizers.AdamW(learning_rate=1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=True)
    return script, model, x, y


def run(name: str, data: tuple[dict, Any], steps: int, stitched: bool,
        where: bool = False) -> RunCount:
    """One ``fit`` of model ``name`` over ``steps`` batches of ``data``, counted."""
    import tensorflow as tf

    from stitch.frontends.tf.host_conversions import HostConversions
    from stitch.frontends.tf.tf_frontend import KerasTrainFunction

    script, model, _, _ = compiled_model(name)
    stock = model.make_train_function()
    if stitched:
        model.train_function = KerasTrainFunction(model, stock, async_compile=False,
                                                  guard=False)
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(script.BATCH)
    counter = HostConversions(where=where)
    record = _per_epoch(counter)
    with counter:
        model.fit(dataset, epochs=steps, steps_per_epoch=1, verbose=0, shuffle=False,
                  callbacks=[record])
    out = RunCount(counter.total, record.per_step, record.losses, sites=counter.sites)
    if stitched:
        stats = model.train_function.step.stats
        out.stitched_steps, out.fallbacks = stats.stitched_calls, list(stats.fallbacks)
    return out


def count(name: str, steps: int = STEPS, seed: int = 1, where: bool = False
          ) -> StepConversions:
    """Stock and stitched ``fit`` of model ``name`` on the same fresh batches, counted."""
    data = random_batches(steps, seed)
    stock = run(name, data, steps, stitched=False, where=where)
    stitched = run(name, data, steps, stitched=True, where=where)
    result = StepConversions(name, steps, stock, stitched)
    log.info("%s: %d conversions stock, %d stitched over %d steps (%d stitched): %.2f extra "
             "per stitched step, %.2f per step after the switch", name, stock.total,
             stitched.total, steps, stitched.stitched_steps, result.extra_per_stitched_step,
             result.steady_extra_per_step)
    return result


def _per_epoch(counter: Any) -> Any:
    """A Keras callback recording the conversions counted in each epoch (one step) and the
    epoch's loss."""
    import keras

    class PerEpoch(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.per_step: list[int] = []
            self.losses: list[float] = []
            self.start = 0

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self.start = counter.total

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self.per_step.append(counter.total - self.start)
            with counter.paused():
                self.losses.append(float(logs["loss"]))
    return PerEpoch()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=str, help="write the counts here (else print them)")
    args = parser.parse_args(argv)
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    results = [count(m, args.steps, args.seed, where=True).as_dict() for m in args.models]
    text = json.dumps(results, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
