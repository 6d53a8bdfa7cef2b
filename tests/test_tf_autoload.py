"""STITCH_ENABLE=1 stitches Keras' TF trainer whatever the order in which a script imports
tensorflow, keras, keras_hub and jax (one subprocess per order), and STITCH_LOG=info names
what was patched. Skipped without tensorflow, keras and keras_hub."""
from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FRAMEWORKS = ("tensorflow", "keras", "keras_hub", "jax")
MISSING = [m for m in FRAMEWORKS if importlib.util.find_spec(m) is None]

pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"{', '.join(MISSING)} not installed")

SCRIPT = """
import importlib, json, sys
for name in sys.argv[1].split(","):
    importlib.import_module(name)
import keras
import tensorflow as tf
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
model.compile(optimizer="sgd", loss="mse", jit_compile=True)
train = model.make_train_function()
print("RESULT " + json.dumps({"train_function": type(train).__name__,
                              "tf_function": hasattr(tf.function, "__stitch_original__"),
                              "backend": keras.backend.backend()}))
"""


def _run(order: tuple[str, ...]) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STITCH_")}
    env.update({"STITCH_ENABLE": "1", "STITCH_LOG": "info", "KERAS_BACKEND": "tensorflow",
                "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": "-1",
                # this checkout first: the autoload hook (.pth) and stitch come from here
                "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [
                    os.environ.get("PYTHONPATH")])])})
    run = subprocess.run([sys.executable, "-c", SCRIPT, ",".join(order)], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    line = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):]), run.stderr


@pytest.mark.parametrize("order", list(itertools.permutations(FRAMEWORKS)),
                         ids=lambda o: "-".join(o))
def test_keras_tf_trainer_is_stitched_in_any_import_order(order):
    result, log = _run(order)
    assert result["backend"] == "tensorflow"
    assert result["train_function"] == "KerasTrainFunction", (result, log[-2000:])
    assert result["tf_function"], log[-2000:]
    patched = [ln for ln in log.splitlines() if "patched so far:" in ln]
    assert patched, log[-2000:]
    last = patched[-1]
    for what in ("jax.jit", "tf.function(jit_compile=True)", "Keras' TensorFlow trainer"):
        assert what in last, last
