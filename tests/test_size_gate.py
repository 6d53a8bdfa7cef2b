"""STITCH_ENABLE leaves tiny jits alone: calls whose arguments total under STITCH_MIN_BYTES
run on stock jax.jit and never create a stitch.jit function (no background compile)."""
from __future__ import annotations

import types

import numpy as np
import pytest

from stitch import autoload
from stitch.frontends.size_gate import SizeSettingError, min_bytes_setting

jax = pytest.importorskip("jax")


def _patched_jax():
    fake = types.SimpleNamespace(jit=jax.jit)
    autoload.patch_jax(fake)
    return fake


def test_tiny_jits_stay_stock_and_large_ones_are_stitched(monkeypatch) -> None:
    monkeypatch.setenv("STITCH_MIN_BYTES", "4096")
    made = []
    import stitch.frontends.jax.jax_jit as jax_jit
    real = jax_jit.jit
    monkeypatch.setattr(jax_jit, "jit", lambda f, **kw: made.append(f) or real(
        f, async_compile=False, guard=False, device="cpu"))
    fake = _patched_jax()
    fn = fake.jit(lambda x: x * 2 + 1)
    small = np.ones(16, np.float32)                      # 64 bytes
    np.testing.assert_allclose(np.asarray(fn(small)), small * 2 + 1)
    assert made == []                                    # no stitch.jit, no compile
    large = np.ones(4096, np.float32)                    # 16 KiB
    np.testing.assert_allclose(np.asarray(fn(large)), large * 2 + 1)
    assert len(made) == 1


def test_min_bytes_setting(monkeypatch) -> None:
    monkeypatch.delenv("STITCH_MIN_BYTES", raising=False)
    assert min_bytes_setting() == 1 << 20
    monkeypatch.setenv("STITCH_MIN_BYTES", "off")
    assert min_bytes_setting() == 0
    monkeypatch.setenv("STITCH_MIN_BYTES", "lots")
    with pytest.raises(SizeSettingError):
        min_bytes_setting()


def test_a_skip_below_the_gate_is_said_once_and_recorded(monkeypatch, caplog) -> None:
    """The function's name and its bytes against the gate, once; STITCH_STATS holds a
    ``below-size-gate`` record with every call counted."""
    import logging

    from stitch.frontends.switching import stats_records
    rng = np.random.default_rng()
    monkeypatch.setenv("STITCH_MIN_BYTES", "1000000")
    fake = _patched_jax()

    def tiny_update(x):
        return x * 3.0 - 1.0

    fn = fake.jit(tiny_update)
    calls = int(rng.integers(3, 9))
    n = int(rng.integers(4, 64))
    with caplog.at_level(logging.INFO, logger="stitch.autoload"):
        for _ in range(calls):
            x = rng.standard_normal(n).astype(np.float32)
            np.testing.assert_allclose(np.asarray(fn(x)), x * 3.0 - 1.0, rtol=1e-6, atol=1e-6)
    said = [r.getMessage() for r in caplog.records if "STITCH_MIN_BYTES" in r.getMessage()]
    assert len(said) == 1, said
    assert "tiny_update" in said[0] and f"{4 * n} bytes" in said[0] and "1000000" in said[0]
    mine = [r for r in stats_records() if r["function"].endswith("tiny_update")
            and r["state"] == "below-size-gate"]
    assert len(mine) == 1 and mine[0]["calls"] == calls, mine
