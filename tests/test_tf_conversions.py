"""Host conversions of the TF front end: the first stitched call's check against TF runs on
the values' device with the numpy checks' rules (stitch/frontends/device_compare.py), the
counter that finds host reads (stitch/frontends/tf/host_conversions.py), and — marked
``thirdparty``, run with ``-m thirdparty`` — keras_hub GPT2 and Llama training on the TF
backend: a stitched ``fit`` makes at most 2 host conversions per stitched step more than
stock Keras, with the same per-step losses (bench/tf_conversions.py)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from bench import tf_conversions  # noqa: E402
from stitch.frontends.device_compare import differences, first_mismatch  # noqa: E402
from stitch.frontends.tf.host_conversions import HostConversions  # noqa: E402
from stitch.frontends.verify import measure, poison_check, spread_check  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MAX_EXTRA_PER_STEP = 2
RTOL = 1e-4


def _cases() -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(name, result, reference) pairs on both sides of every rule."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 8)).astype(np.float32)
    noise = rng.standard_normal(x.shape).astype(np.float32)
    nan = x.copy()
    nan[3, 4] = np.nan
    nan_elsewhere = x.copy()
    nan_elsewhere[5, 1] = np.nan
    inf = x.copy()
    inf[0, 0] = np.inf
    ints = rng.integers(-5, 5, size=(7, 3)).astype(np.int64)
    ints_off = ints.copy()
    ints_off[2, 1] += 1
    mask = rng.random(12) > 0.5
    bf16 = jnp.bfloat16
    xb = np.asarray(x, dtype=bf16)
    return [
        ("equal", x, x.copy()),
        ("within", x * (1 + 3e-5), x),
        ("outside", x + 1e-3 * noise, x),
        ("nan same place", nan, nan.copy()),
        ("nan elsewhere", nan_elsewhere, nan),
        ("inf", inf * 1.00001, inf),
        ("zero reference", np.full(4, 1e-6, np.float32), np.zeros(4, np.float32)),
        ("scalar", np.float32(2.0), np.float32(2.0001)),
        ("empty", np.zeros((0, 3), np.float32), np.zeros((0, 3), np.float32)),
        ("ints equal", ints, ints.copy()),
        ("ints differ", ints_off, ints),
        ("bool", ~mask, mask),
        ("bf16 within one ulp", np.asarray(x * 1.004, dtype=bf16), xb),
        ("bf16 outside", np.asarray(x * 1.05, dtype=bf16), xb),
        ("f64", x.astype(np.float64) * (1 + 2e-4), x.astype(np.float64)),
    ]


@pytest.mark.parametrize("name,got,want", _cases(), ids=[c[0] for c in _cases()])
def test_the_device_check_judges_as_the_numpy_check(name, got, want):
    with jax.enable_x64(True):
        a, b = jnp.asarray(got), jnp.asarray(want)
        on_device = first_mismatch([("v", a, b, None)], RTOL)
        (d,) = differences([(a, b)])
    on_host = poison_check(np.asarray(got), np.asarray(want), RTOL)
    assert (on_device is None) == (on_host is None), (on_device, on_host)
    if on_host is not None:
        assert on_device == f"v: {on_host}"
    h = measure(np.asarray(got), np.asarray(want))
    assert (d.bad, d.finite_match, d.size) == (h.bad, h.finite_match, h.size)
    assert math.isclose(d.diff, h.diff, rel_tol=1e-12, abs_tol=1e-300)
    assert math.isclose(d.ref, h.ref, rel_tol=1e-12, abs_tol=1e-300)


def test_the_device_check_allows_the_spread_of_xla_against_tf_and_nothing_more():
    """The verify rule for dropout-like differences (``spread_check``), on the device."""
    rng = np.random.default_rng(5)
    plain = rng.standard_normal(64).astype(np.float32)
    tf_out = plain * (1 + 1e-3)
    cases = [(plain * (1 + 5e-4), plain, tf_out),        # inside the spread
             (plain * 1.1, plain, tf_out),               # far outside it
             (plain * 1.01, plain, plain.copy())]        # compilers agree: rtol applies
    for stitched, xla, stock in cases:
        want = poison_check(stitched, stock, RTOL)
        if want is not None:
            want = spread_check(stitched, xla, stock, RTOL)
        got = first_mismatch([("v", jnp.asarray(stitched), jnp.asarray(stock),
                               jnp.asarray(xla))], RTOL)
        assert (got is None) == (want is None), (got, want)
        if want is not None:
            assert got == f"v: {want}"


def test_the_device_check_reads_the_host_once_for_all_values():
    rng = np.random.default_rng(1)
    values = [jnp.asarray(rng.standard_normal((n, 4)).astype(np.float32)) for n in range(1, 40)]
    values.append(jnp.asarray(np.arange(5, dtype=np.int32)))
    checks = [(f"v{i}", v, v + 0, None) for i, v in enumerate(values)]
    with HostConversions(where=True) as reads:
        assert first_mismatch(checks, RTOL) is None
    assert reads.total == 1, reads.sites
    # one value off, with XLA's own result to weigh it against: a second read
    checks[3] = ("v3", values[3] * 1.1, values[3], values[3])
    with HostConversions() as reads:
        why = first_mismatch(checks, RTOL)
    assert why is not None and why.startswith("v3: relative error")
    assert reads.total == 2, reads.kinds


def test_host_conversions_counts_each_read_once_and_puts_numpy_back():
    real_asarray = np.asarray
    a = jnp.arange(4.0)
    real_array_method = type(a).__array__
    with HostConversions(where=True) as reads:
        np.asarray(a)               # a jax array: counted (its __array__ inside is not)
        np.array(a[1:])
        float(a[0])
        np.asarray([1.0, 2.0])      # not a framework value: not counted
        with reads.paused():
            np.asarray(a)
    assert reads.total == 3, reads.kinds
    assert sum(n for site, n in reads.sites.items() if __file__ in site) == 3, reads.sites
    assert np.asarray is real_asarray
    assert type(a).__array__ is real_array_method
    with HostConversions() as reads:
        pass
    np.asarray(a)
    assert reads.total == 0


def test_host_conversions_counts_tf_tensors_and_variables():
    tf = pytest.importorskip("tensorflow")
    t, v = tf.constant([1.0, 2.0]), tf.Variable([3.0, 4.0])
    numpy_method = type(t).numpy
    with HostConversions() as reads:
        t.numpy()
        v.numpy()                   # reads its value's numpy() inside: one read
        np.asarray(t)
        bool(t[0] > 0)
        tf.reduce_sum(t)            # stays in TF: not a read
    assert reads.total == 4, reads.kinds
    assert type(t).numpy is numpy_method


def test_extra_conversions_per_stitched_step_count_the_whole_run():
    run = tf_conversions.RunCount
    stock = run(46, [6] + [5] * 7, [4.0 + i for i in range(8)])
    stitched = run(60, [20] + [5] * 7, [4.0 + i for i in range(8)], stitched_steps=7)
    counts = tf_conversions.StepConversions("m", 8, stock, stitched)
    assert counts.extra_per_stitched_step == 2.0
    assert counts.steady_extra_per_step == 0.0
    assert counts.loss_mismatch() is None
    stitched.losses[5] *= 1 + 2e-4
    assert counts.loss_mismatch().startswith("step 5")
    again = tf_conversions.StepConversions.from_dict(json.loads(json.dumps(counts.as_dict())))
    assert again.extra_per_stitched_step == 2.0 and again.stitched.losses == stitched.losses


# ----------------------------------------------------------------- keras_hub (thirdparty)
def _require_keras_hub(request) -> None:
    for module in ("tensorflow", "keras", "keras_hub"):
        pytest.importorskip(module)
    selected = request.config.getoption("markexpr", "") or os.environ.get("STITCH_THIRDPARTY")
    if not selected:
        pytest.skip("keras_hub on TF with stitched compiles (about a minute per model): run "
                    "with -m thirdparty (or STITCH_THIRDPARTY=1)")


STEPS = 8         # call 1 compiles and is verified, calls 2..8 stitched


@pytest.mark.thirdparty
@pytest.mark.parametrize("model", tf_conversions.MODELS)
def test_stitched_keras_hub_steps_convert_at_most_two_more_than_stock(model, request, tmp_path):
    """Stock Keras (XLA) and the stitched step from the same seed on the same fresh random
    batches, in a child process (Keras' backend is chosen at import): the stitched run's
    host conversions beyond stock, over the whole fit (compile and verified call
    included), stay within 2 per stitched step, and every step's loss matches stock."""
    _require_keras_hub(request)
    out = tmp_path / "counts.json"
    env = {**os.environ, "KERAS_BACKEND": "tensorflow",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("STITCH_ENABLE", None)
    done = subprocess.run([sys.executable, "-m", "bench.tf_conversions", "--models", model,
                           "--steps", str(STEPS), "--json", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = tf_conversions.StepConversions.from_dict(json.loads(out.read_text())[0])
    assert counts.stitched.fallbacks == [], counts.stitched.fallbacks
    assert counts.stitched.stitched_steps == STEPS - 1
    assert counts.loss_mismatch() is None, counts.loss_mismatch()
    assert counts.extra_per_stitched_step <= MAX_EXTRA_PER_STEP, counts.extra_sites()
    assert counts.steady_extra_per_step <= MAX_EXTRA_PER_STEP, counts.extra_sites()
