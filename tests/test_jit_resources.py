"""What stitch.jit holds: the compile queue is bounded (the oldest waiting signature is
dropped and queued again on its next call), and a deleted function frees its kernels' code
without ever leaving XLA a registered name that points at freed code."""
from __future__ import annotations

import gc
import importlib
import threading
import weakref

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import stitch  # noqa: E402
from stitch.codegen import ffi  # noqa: E402
from stitch.frontends.jax.jax_jit import _CompileThread  # noqa: E402
from stitch.frontends.verify import compare_trees  # noqa: E402

jit_module = importlib.import_module("stitch.frontends.jax.jax_jit")


def _layer_norm(x, g, b):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * g + b


def _args(seed: int, rows: int, cols: int):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, cols)).astype(np.float32),
            rng.standard_normal(cols).astype(np.float32),
            rng.standard_normal(cols).astype(np.float32))


def test_compile_thread_drops_the_oldest_waiting_job():
    thread = _CompileThread(max_waiting=2)
    release = threading.Event()
    started = threading.Event()
    ran: list[int] = []

    def blocker():
        started.set()
        release.wait(30)

    try:
        first = thread.submit(blocker)
        assert started.wait(30)
        waiting = [thread.submit(lambda n=n: ran.append(n) or n) for n in range(4)]
        assert [f.cancelled() for f in waiting] == [True, True, False, False]
        assert thread.waiting() == 2
        release.set()
        assert [f.result(30) for f in waiting[2:]] == [2, 3]
        assert first.result(30) is None and ran == [2, 3]
    finally:
        release.set()
        thread.shutdown(30)


def test_dropped_signature_runs_stock_then_compiles_on_its_next_call(monkeypatch):
    monkeypatch.setattr(jit_module.COMPILE_THREAD, "max_waiting", 1)
    release = threading.Event()
    started = threading.Event()

    def blocker():
        started.set()
        release.wait(60)
    busy = jit_module.COMPILE_THREAD.submit(blocker)       # holds the compile thread
    try:
        assert started.wait(30)
        f = stitch.jit(_layer_norm, async_compile=True, guard=False)
        shapes = [(8, 32), (4, 64), (16, 16)]
        args = [_args(n, *s) for n, s in enumerate(shapes)]
        for a in args:           # each new signature pushes the one before out of the queue
            assert compare_trees(f(*a), jax.jit(_layer_norm)(*a), 1e-5) is None
        states = [e.state for e in f._entries.values()]
        assert states == ["dropped", "dropped", "compiling"], states
        records = [e.counters.as_dict() for e in f._entries.values()]
        assert "dropped from the compile queue" in records[0]["fallback_reason"]
    finally:
        release.set()
    busy.result(60)
    assert f.wait(120) is False            # the dropped ones have not compiled
    assert compare_trees(f(*args[0]), jax.jit(_layer_norm)(*args[0]), 1e-5) is None
    assert f.wait(120) is False            # (the second one is still dropped)
    first = next(iter(f._entries.values()))
    assert first.state == "ready" and first.counters.fallback_reason == ""
    out = f(*args[0])
    assert first.counters.stitched_calls == 1
    assert compare_trees(out, jax.jit(_layer_norm)(*args[0]), 1e-4) is None


def test_deleted_function_frees_its_kernels_and_a_rebuild_gets_a_new_name():
    args = _args(7, 8, 48)
    want = jax.jit(_layer_norm)(*args)
    f = stitch.jit(_layer_norm, async_compile=False, guard=False)
    assert compare_trees(f(*args), want, 1e-4) is None
    kernels = f.programs()[0].kernels
    assert kernels and f.stats.stitched_calls == 1
    names = [k.target.name for k in kernels]
    assert all(n in ffi._REGISTERED for n in names)
    refs = [weakref.ref(k.target) for k in kernels]
    del f, kernels
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs), "a deleted function kept its kernels"

    # The same kernels again: XLA still holds the old names (pointing at freed code), so the
    # rebuilt targets must be registered under new ones, and the results stay right.
    g = stitch.jit(_layer_norm, async_compile=False, guard=False)
    assert compare_trees(g(*args), want, 1e-4) is None
    again = [k.target.name for k in g.programs()[0].kernels]
    assert g.stats.stitched_calls == 1 and again
    assert not set(again) & set(names)
    assert all(any(n.startswith(old + "_g") for old in names) for n in again), again
