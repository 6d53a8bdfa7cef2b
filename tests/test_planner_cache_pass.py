"""The plan cache under the XLA pass: a cached plan that is valid but useless (it fuses
nothing, its kernels do not build, they lose to XLA) is dropped and the module planned
again, once; a fresh plan that still stitches nothing is remembered in its entry with the
reason, so later compiles do not plan it again."""
from __future__ import annotations

import json

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from stitch.explorer import plan_cache  # noqa: E402
from stitch.explorer.plan_cache import PlanCache  # noqa: E402
from tests.fixtures import compile_with_cpu_pass  # noqa: E402


def _softmax_ln(x, w):
    """softmax then layer norm over rows: XLA CPU splits it over several fusions."""
    y = jax.nn.softmax(jnp.tanh(x) * w, axis=-1)
    m = y.mean(-1, keepdims=True)
    v = ((y - m) ** 2).mean(-1, keepdims=True)
    return (y - m) * jax.lax.rsqrt(v + 1e-5)


def _one_fusion(x):
    """One elementwise XLA fusion: nothing for stitch to fuse beyond it."""
    return jnp.tanh(x) * 2.0 + 1.0


def _rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


X, W = _rand(32, 64, seed=1), _rand(32, 64, seed=2)


def _process(monkeypatch, directory) -> PlanCache:
    """A fresh process-wide plan cache on ``directory`` (as a new process would have)."""
    store = PlanCache(directory)
    monkeypatch.setattr(plan_cache, "_DEFAULT", store)
    return store


def _entry(directory):
    [path] = list(directory.glob("*.json"))
    return path, json.loads(path.read_text())


def _rewrite(directory, data: dict) -> None:
    """``data`` stored as its entry, with the digest of its new content (as the cache
    writes it: an entry edited without it is dropped as corrupt)."""
    PlanCache(directory).write(data["key"], data)


def _every_op_alone(data: dict) -> dict:
    """The entry with each graph's kernels replaced by every member op alone: well formed,
    covering the same ops, fusing nothing (member sets only, no priced data: rebuilt by
    pricing them)."""
    for g in data["graphs"]:
        ops = sorted({v for members in g["kernels"] for v in members})
        g["kernels"] = [[v] for v in ops]
        g["origins"] = ["alone"] * len(ops)
        g.pop("priced", None)
    return data


def test_a_cached_plan_that_fuses_nothing_is_planned_again_and_stitches(tmp_path,
                                                                        monkeypatch):
    directory = tmp_path / "plans"
    _process(monkeypatch, directory)
    report, _ = compile_with_cpu_pass(_softmax_ln, X, W)
    assert report.kernels_stitched >= 1
    _, data = _entry(directory)
    good = [g["kernels"] for g in data["graphs"]]
    _rewrite(directory, _every_op_alone(data))

    store = _process(monkeypatch, directory)
    report, compiled = compile_with_cpu_pass(_softmax_ln, X, W)
    assert store.disk_hits == 1 and store.dropped == 1 and store.misses == 1
    assert report.kernels_stitched >= 1, report.reason_nothing_stitched()
    np.testing.assert_allclose(np.asarray(compiled(X, W)),
                               np.asarray(jax.jit(_softmax_ln)(X, W)), rtol=1e-4, atol=1e-5)
    _, data = _entry(directory)
    assert [g["kernels"] for g in data["graphs"]] == good      # the fresh plan, stored
    assert "nothing_stitched" not in data

    store = _process(monkeypatch, directory)                    # and used from now on
    report, _ = compile_with_cpu_pass(_softmax_ln, X, W)
    assert store.disk_hits == 1 and store.dropped == 0 and store.misses == 0
    assert report.kernels_stitched >= 1


def test_a_fresh_plan_that_stitches_nothing_is_remembered_not_planned_again(tmp_path,
                                                                          monkeypatch):
    directory = tmp_path / "plans"
    x = _rand(64, 128, seed=3)
    store = _process(monkeypatch, directory)
    report, _ = compile_with_cpu_pass(_one_fusion, x)
    assert report.kernels_stitched == 0
    reason = report.reason_nothing_stitched()
    assert store.misses == 1 and store.dropped == 0
    _, data = _entry(directory)
    assert data["nothing_stitched"] == reason                  # remembered, with its reason

    report, _ = compile_with_cpu_pass(_one_fusion, x)          # same process: memory
    assert store.hits == 1 and store.misses == 1 and store.dropped == 0
    assert report.kernels_stitched == 0

    store = _process(monkeypatch, directory)                    # another process: disk
    report, _ = compile_with_cpu_pass(_one_fusion, x)
    assert store.disk_hits == 1 and store.misses == 0 and store.dropped == 0
    assert report.kernels_stitched == 0

    # An entry that stitched nothing without saying so (written before its failure was
    # noted) is planned again once; the fresh plan's failure is then noted.
    del data["nothing_stitched"]
    _rewrite(directory, data)
    store = _process(monkeypatch, directory)
    compile_with_cpu_pass(_one_fusion, x)
    assert store.disk_hits == 1 and store.dropped == 1 and store.misses == 1
    assert _entry(directory)[1]["nothing_stitched"] == reason
    store = _process(monkeypatch, directory)
    compile_with_cpu_pass(_one_fusion, x)
    assert store.disk_hits == 1 and store.misses == 0 and store.dropped == 0


def test_an_entry_from_before_the_note_still_loads(tmp_path):
    """The note is optional: an entry without it loads, and a note is read back."""
    import stitch
    from tests.test_planner_cache import SOFTMAX
    directory = tmp_path / "plans"
    first = stitch.plan(SOFTMAX, "h100", cache=PlanCache(directory))
    path, data = _entry(directory)
    assert "nothing_stitched" not in data
    fresh = PlanCache(directory)
    again = stitch.plan(SOFTMAX, "h100", cache=fresh)
    assert fresh.disk_hits == 1 and fresh.failure(again.cache_key) is None
    assert [k.members for k in again.kernels] == [k.members for k in first.kernels]
    fresh.note_failure(again.cache_key, "why not")
    later = PlanCache(directory)
    stitch.plan(SOFTMAX, "h100", cache=later)
    assert later.disk_hits == 1 and later.failure(again.cache_key) == "why not"
