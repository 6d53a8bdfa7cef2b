"""The stitched TF step's data path (stitch/frontends/tf/tf_bridge.py): inputs, variables and outputs
cross between TF and the stitched executable through DLPack — no ``.numpy()``, no
``np.asarray`` of a TF or jax value on a stitched step — on the CPU and along the GPU code
path (TF's waits recorded, not run); the stitched side runs where TF's values live unless
STITCH_DEVICE says otherwise; the guard times both sides to the end of their device work.
Skipped without TF."""
from __future__ import annotations

import logging

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
jax = pytest.importorskip("jax")

from stitch.frontends.tf import gpu_sharing, tf_bridge, tf_frontend  # noqa: E402
from stitch.frontends.tf.host_conversions import HostConversions  # noqa: E402


def _model():
    rng = np.random.default_rng(0)
    v = {"w": tf.Variable(rng.standard_normal((8, 16)).astype(np.float32), name="w"),
         "b": tf.Variable(np.zeros(16, np.float32), name="b"),
         "count": tf.Variable(0, dtype=tf.int64, name="count")}
    shift = tf.constant(np.linspace(-1, 1, 16).astype(np.float32))

    def step(x, y):
        with tf.GradientTape() as tape:
            h = tf.tanh(x @ v["w"] + v["b"]) + shift
            h = h - tf.reduce_mean(h, axis=-1, keepdims=True)
            loss = tf.reduce_mean((h - y) ** 2)
        gw, gb = tape.gradient(loss, [v["w"], v["b"]])
        v["w"].assign_sub(0.1 * gw)
        v["b"].assign_sub(0.1 * gb)
        v["count"].assign_add(1)
        return {"loss": loss, "h_max": tf.reduce_max(h)}
    return v, step


def _batches(n):
    rng = np.random.default_rng(1)
    return [(tf.constant(rng.standard_normal((32, 8)).astype(np.float32)),
             tf.constant(rng.standard_normal((32, 16)).astype(np.float32))) for _ in range(n)]


class RecordingBridge(tf_bridge.Bridge):
    """The real bridge, recording TF's waits (not run: they are what a GPU needs), jax's
    block and each conversion, in order."""
    events: list[str] = []

    def __init__(self, gpu=False, **kw):
        events = RecordingBridge.events
        real_from_tf, real_to_tf, real_block = (tf_bridge._jax_from_tf, tf_bridge._tf_from_jax,
                                                tf_bridge._block)

        def from_tf(v):
            events.append("from_tf")
            return real_from_tf(v)

        def to_tf(a):
            events.append("to_tf")
            return real_to_tf(a)

        def block(arrays):
            events.append("block")
            real_block(arrays)
        super().__init__(gpu=gpu, sync_tf=lambda: events.append("sync_tf"),
                         jax_from_tf=from_tf, tf_from_jax=to_tf, block=block, **kw)


def _stitched(monkeypatch, tf_device="cpu", **options):
    RecordingBridge.events = []
    monkeypatch.setattr(tf_frontend, "Bridge", RecordingBridge)
    monkeypatch.setattr(tf_frontend, "tf_runs_on", lambda values: tf_device)
    v, step = _model()
    fn = tf_frontend.stitch_function(step, async_compile=False, **options)
    return v, step, fn


@pytest.mark.parametrize("tf_device", ["cpu", "gpu"])
def test_no_host_copy_of_inputs_variables_or_outputs_on_a_stitched_step(monkeypatch, tf_device):
    """TF "on the GPU" (the GPU code path's waits, recorded) with the stitched program on
    this CPU: the same conversions, plus one TF wait per step before the exports."""
    device = "cpu" if tf_device == "gpu" else None
    v_ref, step_ref = _model()
    v, _, fn = _stitched(monkeypatch, tf_device, guard=False, device=device)
    batches = _batches(5)
    want = [float(tf.function(step_ref, jit_compile=True)(x, y)["loss"]) for x, y in batches]
    fn.xla_fn.get_concrete_function(*batches[0])    # TF's trace reads constants: not ours
    with HostConversions(where=True) as verified:
        got = [float(fn(*batches[0])["loss"])]      # compiled, then verified on device
    RecordingBridge.events.clear()
    with HostConversions(where=True) as copies:
        results = [fn(x, y) for x, y in batches[1:]]
    got += [float(r["loss"]) for r in results]
    assert fn.stats.fallbacks == [] and fn.stats.stitched_calls == 4
    assert copies.total == 0, copies.sites
    # the check of the first stitched call reads one array of figures, not every value;
    # the caller's float() of the loss is the other
    assert verified.total == 2, (verified.sites, verified.kinds)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for k in ("w", "b"):
        np.testing.assert_allclose(v[k].numpy(), v_ref[k].numpy(), rtol=1e-5, atol=1e-6)
    assert int(v["count"].numpy()) == 5
    step_events = RecordingBridge.events[:len(RecordingBridge.events) // 4]
    assert RecordingBridge.events == step_events * 4
    # per step: TF's wait on a GPU, every input wrapped (the constant only once, before),
    # jax waited for, then every output and update handed back
    first_to_tf = step_events.index("to_tf")
    assert step_events[first_to_tf - 1] == "block"
    assert step_events.count("to_tf") == 2 + 3           # loss, h_max; w, b, count
    assert step_events.count("from_tf") == 2 + 3         # x, y; w, b, count
    assert step_events.count("sync_tf") == (1 if tf_device == "gpu" else 0)
    if tf_device == "gpu":
        assert step_events[0] == "sync_tf"


def test_outputs_and_updates_stay_tf_tensors_on_the_values_device(monkeypatch):
    v, _, fn = _stitched(monkeypatch, guard=False)
    for x, y in _batches(3):
        out = fn(x, y)
    assert isinstance(out["loss"], tf.Tensor) and out["loss"].dtype == tf.float32
    assert v["count"].dtype == tf.int64 and int(v["count"].numpy()) == 3
    assert tf_bridge.device_of(out["loss"].device) == ("cpu", 0)


def test_the_device_tf_runs_on_is_read_from_its_values():
    class Value:
        def __init__(self, device):
            self.device = device
    assert tf_bridge.device_of("/job:localhost/replica:0/task:0/device:GPU:1") == ("gpu", 1)
    assert tf_bridge.device_of("/job:localhost/replica:0/task:0/device:CPU:0") == ("cpu", 0)
    assert tf_bridge.device_of("") == ("cpu", 0)
    assert tf_bridge.tf_runs_on([Value("/device:CPU:0"), Value("/device:GPU:0")]) == "gpu"
    assert tf_bridge.tf_runs_on([Value("/device:CPU:0"), object()]) == "cpu"
    assert tf_bridge.tf_runs_on([tf.Variable(1.0)]) == "cpu"


def test_the_stitched_side_follows_tf_onto_the_gpu_unless_stitch_device_says(monkeypatch):
    """TF's values on a GPU: the stitched side is planned for the GPU (here refused, as a
    process that could not share the GPU refuses it); STITCH_DEVICE=cpu keeps it here."""
    monkeypatch.delenv("STITCH_DEVICE", raising=False)
    monkeypatch.setattr(gpu_sharing, "refusal", lambda: "test: the GPU is not shared")
    _, _, fn = _stitched(monkeypatch, "gpu", guard=False)
    for x, y in _batches(2):
        fn(x, y)
    assert fn.stats.stitched_calls == 0
    assert any("the GPU is not shared" in f for f in fn.stats.fallbacks), fn.stats.fallbacks
    monkeypatch.setenv("STITCH_DEVICE", "cpu")
    _, _, fn = _stitched(monkeypatch, "gpu", guard=False)
    for x, y in _batches(3):
        fn(x, y)
    assert fn.stats.fallbacks == [] and fn.stats.stitched_calls == 2


def test_the_guard_times_both_sides_to_the_end_of_their_device_work(monkeypatch, caplog):
    """Each timed trial ends with TF's device work waited for — the stock step's variable
    updates and the stitched side's assigns alike — and the decision names both medians."""
    from stitch.frontends import switching

    _, _, fn = _stitched(monkeypatch, "gpu", guard=True, device="cpu")
    batches = _batches(2 + 2 * switching.GUARD_CALLS)
    fn(*batches[0])                                       # verified call
    marks = []
    real_record = fn._guard_record

    def record(entry, stitched_turn, elapsed):
        marks.append((stitched_turn, list(RecordingBridge.events)))
        RecordingBridge.events.clear()
        real_record(entry, stitched_turn, elapsed)
    fn._guard_record = record
    RecordingBridge.events.clear()
    with caplog.at_level(logging.INFO, logger="stitch"):
        for x, y in batches[1:1 + 2 * switching.GUARD_CALLS]:
            fn(x, y)
    assert len(marks) == 2 * switching.GUARD_CALLS
    for stitched_turn, events in marks:
        assert events[-1] == "sync_tf", (stitched_turn, events)       # waited, then timed
        if stitched_turn:
            assert events.index("block") < events.index("to_tf")
    decision = [r.getMessage() for r in caplog.records if "ms vs TF" in r.getMessage()]
    assert len(decision) == 1 and decision[0].count(" ms") == 2, decision
    assert set(fn.stats.guard) >= {"stitched_ms", "stock_ms", "kept"}
