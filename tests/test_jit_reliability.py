"""stitch.jit behaves as jax.jit where a real script would notice: result dtypes follow jax's
own typing of each argument (weak Python scalars vs strong numpy ones), settings stitch
cannot read leave the function stock instead of raising, the caller's own errors reach the
caller as jax.jit raises them without turning stitching off, arrays committed to another
device get their own executable, and negative static_argnums count as jax counts them."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import stitch  # noqa: E402
from stitch import config  # noqa: E402
from stitch.frontends.verify import compare_trees  # noqa: E402

RTOL = 2e-2          # bf16 results


def _scaled_norm(x, s):
    y = x * s
    mean = jnp.mean(y, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(y - mean), axis=-1, keepdims=True)
    return jnp.tanh((y - mean) * jax.lax.rsqrt(var + 1e-5)) + s


def _bf16(seed: int, rows: int = 16, cols: int = 64):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((rows, cols)), jnp.bfloat16)


def _check(got, want, rtol=RTOL):
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype)
    why = compare_trees(got.astype(np.float32), want.astype(np.float32), rtol)
    assert why is None, why


@pytest.mark.parametrize("strong", [np.float64(2.0), np.array(2.0), np.float32(2.0)],
                         ids=["np.float64", "0-d array", "np.float32"])
def test_weak_and_strong_scalars_give_jax_jits_dtypes(strong):
    """A Python 2.0 is a weak scalar (bf16 result), a numpy scalar a strong f32 one (f32
    result): the executable compiled for one must never serve the other."""
    f = stitch.jit(_scaled_norm, async_compile=False, guard=False, device="cpu")
    x = _bf16(0)
    for s in (2.0, strong, 2.0, strong):
        _check(f(x, s), jax.jit(_scaled_norm)(x, s))
    assert f.stats.stitched_calls >= 2       # the weak signature did run stitched
    assert f.stats.signatures == 2


def test_int8_array_times_a_numpy_int64():
    def fn(x, k):
        return jnp.sum(x * k, axis=-1) + jnp.max(x * k, axis=-1)
    f = stitch.jit(fn, async_compile=False, guard=False, device="cpu")
    x = jnp.asarray(np.random.default_rng(1).integers(-5, 5, (8, 32)), jnp.int8)
    for k in (3, np.int64(3), 3, np.int64(3)):
        got, want = f(x, k), jax.jit(fn)(x, k)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert f.stats.signatures == 2


def test_negative_static_argnums_count_from_the_end_of_the_call():
    def fn(x, s, n):
        return _scaled_norm(x, s) * n
    f = stitch.jit(fn, async_compile=False, guard=False, device="cpu", static_argnums=-1)
    x = _bf16(2)
    for n in (2, 2, 3):
        _check(f(x, 1.5, n), jax.jit(fn, static_argnums=-1)(x, 1.5, n))
    assert f.stats.stitched_calls == 3 and not f.stats.fallbacks, f.stats.fallbacks
    assert f.stats.signatures == 2


BAD_SETTINGS = {"STITCH_VERIFY": "maybe", "STITCH_ASYNC": "later", "STITCH_GUARD": "2",
                "STITCH_TARGET": "tpu", "STITCH_DEVICE": "fpga", "STITCH_LOG": "loud",
                "STITCH_VERIFY ": "every:0"}


@pytest.mark.parametrize("name", sorted(BAD_SETTINGS))
def test_an_unreadable_setting_keeps_the_function_stock(monkeypatch, caplog, name):
    monkeypatch.setattr(config, "_REPORTED", set())
    monkeypatch.setenv(name.strip(), BAD_SETTINGS[name])
    x = _bf16(3)
    with caplog.at_level(logging.WARNING, logger="stitch"):
        f = stitch.jit(_scaled_norm, async_compile=False, guard=False, device="cpu")
        g = stitch.jit(_scaled_norm, async_compile=False, guard=False, device="cpu")
        for fn in (f, g):
            _check(fn(x, 2.0), jax.jit(_scaled_norm)(x, 2.0))
    assert f.stats.stitched_calls == 0 and f.stats.signatures == 0
    assert any(name.strip() in r for r in f.stats.fallbacks)
    said = [r.getMessage() for r in caplog.records if name.strip() in r.getMessage()]
    assert len(said) == 1, said              # once per process, not once per function


def test_stitch_enable_is_not_read_by_stitch_jit(monkeypatch):
    monkeypatch.setenv("STITCH_ENABLE", "perhaps")
    f = stitch.jit(_scaled_norm, async_compile=False, guard=False, device="cpu")
    x = _bf16(4)
    _check(f(x, 2.0), jax.jit(_scaled_norm)(x, 2.0))
    assert f.stats.stitched_calls == 1


def test_stitch_device_is_honoured(monkeypatch):
    monkeypatch.setenv("STITCH_DEVICE", "cpu")
    assert stitch.jit(_scaled_norm).device == "cpu"
    monkeypatch.setenv("STITCH_DEVICE", "gpu")
    assert stitch.jit(_scaled_norm).device == "gpu"
    assert stitch.jit(_scaled_norm, device="cpu").device == "cpu"


def test_settings_from_env_still_raises_for_the_cli(monkeypatch):
    monkeypatch.setattr(config, "_REPORTED", set())
    monkeypatch.setenv("STITCH_TARGET", "tpu")
    with pytest.raises(config.ConfigError, match="STITCH_TARGET='tpu'"):
        config.Settings.from_env()


def _donating_step(w, x):
    return w - 0.1 * _scaled_norm(x, 2.0), jnp.sum(x)


def _donating_step_second(x, w):
    return _donating_step(w, x)


def _reused_donated_error(fn, w, x, donated: int):
    """Call ``fn`` once (donating ``w``), then again with the donated ``w``: the error."""
    args = (w, x) if donated == 0 else (x, w)
    fn(*args)
    assert w.is_deleted()
    with pytest.raises(Exception) as caught:
        fn(*args)
    return caught.value


@pytest.mark.parametrize("state", ["stitched", "compiling", "failed"])
@pytest.mark.parametrize("donated", [0, 1], ids=["first-arg", "second-arg"])
def test_a_donated_array_used_again_raises_what_jax_jit_raises(monkeypatch, state, donated):
    """jax.jit, called again with the array its previous call donated, raises a ValueError
    from Execute ("Buffer has been deleted or donated"); stitch.jit raises the same, with
    the same message and no stitch exception chained, whether that signature runs stitched
    (whose executable lost XLA's aliasing: stitch deletes the donated buffers itself), is
    still compiling or has fallen back. A RuntimeError ("Array has been deleted") came
    instead where the stitched call had deleted the array."""
    step = _donating_step if donated == 0 else _donating_step_second
    reference = jax.jit(step, donate_argnums=donated)
    want = _reused_donated_error(reference, _bf16(6), _bf16(5), donated)
    if state == "compiling":        # the compile never finishes: stock all along
        from stitch.frontends.jax.jax_jit import StitchedFunction
        monkeypatch.setattr(StitchedFunction, "_start_compile",
                            lambda *a, **k: None)
    if state == "failed":
        monkeypatch.setenv("STITCH_INJECT_FAILURE", "compile")
    f = stitch.jit(step, async_compile=False, guard=False, device="cpu",
                   donate_argnums=donated)
    got = _reused_donated_error(f, _bf16(6), _bf16(5), donated)
    assert f.stats.stitched_calls == (state == "stitched"), f.stats
    assert type(got) is type(want), (got, want)
    assert str(got) == str(want)
    assert not isinstance(got, stitch.StitchError)
    assert got.__cause__ is None and got.__context__ is None
    assert isinstance(want, ValueError)          # what this test is about: not RuntimeError


def test_a_donated_array_used_again_leaves_stitching_on():
    f = stitch.jit(_donating_step, async_compile=False, guard=False, device="cpu",
                   donate_argnums=0)
    x = _bf16(5)
    w = _bf16(6)
    w2, _ = f(w, x)                        # stitched; w is donated
    assert f.stats.stitched_calls == 1 and w.is_deleted()
    with pytest.raises(ValueError, match="deleted or donated"):
        f(w, x)
    # An array the caller deleted is not a donated one: jax.jit's RuntimeError, as jax says.
    gone = _bf16(7)
    gone.delete()
    with pytest.raises(RuntimeError, match="Array has been deleted") as ours:
        f(gone, x)
    with pytest.raises(RuntimeError) as stock:
        jax.jit(_donating_step, donate_argnums=0)(gone, x)
    assert str(ours.value) == str(stock.value)
    assert not f.stats.fallbacks, f.stats.fallbacks
    out, _ = f(w2, x)                      # the signature still runs stitched
    assert f.stats.stitched_calls == 2
    assert out.dtype == jnp.bfloat16


def test_arrays_committed_to_another_device_get_their_own_executable(tmp_path):
    """Two host devices: a call on device 1 after calls on device 0 must neither run device
    0's executable nor turn stitching off for device 0."""
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        import stitch
        from tests.test_jit_reliability import _scaled_norm, _bf16
        d0, d1 = jax.devices()[:2]
        f = stitch.jit(_scaled_norm, async_compile=False, guard=False, device="cpu")
        x0 = jax.device_put(_bf16(7), d0)
        x1 = jax.device_put(_bf16(8), d1)
        for x in (x0, x1, x0, x1):
            got, want = f(x, 2.0), jax.jit(_scaled_norm)(x, 2.0)
            assert got.devices() == want.devices() == x.devices(), (got.devices(), x.devices())
            np.testing.assert_allclose(np.asarray(got, np.float32),
                                       np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)
        assert not f.stats.fallbacks, f.stats.fallbacks
        assert f.stats.signatures == 2 and f.stats.stitched_calls == 4, f.stats
        print("ok")
    """)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=env, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def test_wait_called_while_the_compile_is_being_submitted_waits_for_it(monkeypatch):
    """wait() between a signature's first call and its compile's submission used to return
    False at once (the entry had no future yet)."""
    import threading
    import time
    from stitch.frontends.jax.jax_jit import StitchedFunction
    real = StitchedFunction._start_compile
    entered = threading.Event()

    def slow_start(self, *a, **k):
        entered.set()
        time.sleep(1.0)                  # as a slow trace / lowering would
        return real(self, *a, **k)
    monkeypatch.setattr(StitchedFunction, "_start_compile", slow_start)
    f = stitch.jit(_scaled_norm, guard=False, device="cpu")
    x = _bf16(9)
    caller = threading.Thread(target=f, args=(x, 2.0))
    caller.start()
    assert entered.wait(30)
    assert f.wait(120) is True
    caller.join(60)
    _check(f(x, 2.0), jax.jit(_scaled_norm)(x, 2.0))
    assert f.stats.stitched_calls == 1


def test_stats_write_failure_leaves_no_temporary_file(tmp_path, monkeypatch):
    from stitch.frontends import switching
    target = tmp_path / "stats.json"
    target.mkdir()                       # os.replace onto a directory fails
    assert switching.write_stats(str(target)) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stats.json"]


def test_stats_records_carry_planned_and_delivered(tmp_path, monkeypatch):
    from stitch.frontends import switching
    f = stitch.jit(_scaled_norm, async_compile=False, guard=False, device="cpu")
    x = _bf16(10, 64, 256)
    f(x, 2.0)
    path = tmp_path / "stats.json"
    switching.write_stats(str(path))
    import json
    # The newest record of this name is f's (earlier tests' functions share the name).
    record = [r for r in json.loads(path.read_text()) if r["function"] == f.__qualname__][-1]
    assert record["stitched_calls"] == 1
    summary = f.programs()[0].summary()
    for key in ("xla_mem_us", "planned_mem_us", "delivered_mem_us", "delivered_mem_bytes"):
        assert record[key] == summary[key]
    assert record["delivered_mem_us"] <= record["xla_mem_us"]


def test_the_first_stitched_call_on_a_gpu_is_verified_by_default(monkeypatch):
    from stitch.frontends.jax.jax_jit import _Entry
    monkeypatch.delenv("STITCH_VERIFY", raising=False)
    f = stitch.jit(_scaled_norm)
    gpu, host = _Entry(device="gpu"), _Entry(device="cpu")
    assert f._verify_this_call(gpu) and not f._verify_this_call(host)
    gpu.verified = True
    assert not f._verify_this_call(gpu)
    monkeypatch.setenv("STITCH_VERIFY", "0")          # said explicitly: off everywhere
    assert not stitch.jit(_scaled_norm)._verify_this_call(_Entry(device="gpu"))
    assert stitch.jit(_scaled_norm, verify=True)._verify_this_call(_Entry(device="cpu"))


def test_verify_allows_bf16_rounding_not_more():
    from stitch.frontends.verify import poison_check
    rng = np.random.default_rng(11)
    exact = rng.standard_normal(4096)
    one_way = exact.astype(jnp.bfloat16)
    # Another correct program: computed with an error far below a bf16 ulp, then rounded.
    other_way = (exact * (1 + 1e-4 * rng.standard_normal(4096))).astype(jnp.bfloat16)
    assert not np.array_equal(np.asarray(one_way), np.asarray(other_way))
    assert poison_check(np.asarray(one_way), np.asarray(other_way), 1e-4) is None
    wrong = (exact * 1.05).astype(jnp.bfloat16)
    assert poison_check(np.asarray(wrong), np.asarray(one_way), 1e-4) is not None
    # f32 keeps the tolerance asked for.
    assert poison_check(exact.astype(np.float32) * (1 + 1e-3), exact.astype(np.float32),
                        1e-4) is not None


def test_a_function_jax_cannot_trace_raises_jaxs_error_alone(caplog) -> None:
    """An untraceable function: the caller gets jax.jit's own error, and stitch adds no
    second warning repeating it (the signature is recorded as failed, quietly)."""
    def branchy(x):
        if x.sum() > 0:                  # a traced value in Python control flow
            return x * 2
        return x
    x = np.ones((64, 64), np.float32)
    with pytest.raises(Exception) as want:
        jax.jit(branchy)(x)
    fn = stitch.jit(branchy, async_compile=False, device="cpu")
    with caplog.at_level(logging.WARNING, logger="stitch"):
        with pytest.raises(type(want.value)):
            fn(x)
    assert "falls back" not in caplog.text, caplog.text
    assert fn.stats.stitched_calls == 0
