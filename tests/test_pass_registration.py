"""Registration of stitch's pass through jax's real API, in a fresh child process each (a
registration lasts for the process).

jax 0.10.2 registers through a hook on clients as they start, keyed on ``client.platform``
(CUDA clients say "gpu"); jax 0.11 looks each name up among the loaded PJRT plugins at
once (CUDA's is "cuda"; "gpu" is NOT_FOUND). The suite runs on both stacks (the main one and
the GPU machine's, ``scripts/device_stack_check.sh``), so each test states what its jax
must do."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from stitch.xla_pass import pass_registration, entry as xla_pass

jax = pytest.importorskip("jax")
REPO = Path(__file__).resolve().parents[1]

CHILD = """
import json, logging, sys
from stitch.xla_pass import pass_registration as p
results = []
for _ in range(2):
    try:
        p.ensure_registered(sys.argv[1])
        results.append({"ok": p.registered_platforms()})
    except p.PassRegistrationError as exc:
        results.append({"error": str(exc), "id": id(exc)})
print(json.dumps({"results": results, "hooks": p.registers_on_client_start()}))
"""


def _register_in_child(platform: str, **env: str) -> dict:
    run = subprocess.run([sys.executable, "-c", CHILD, platform], capture_output=True,
                         text=True, timeout=300, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO), **env})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _cuda_plugin_loads() -> bool:
    from stitch.xla_pass import deviceless
    return deviceless.plugin_available() is None


def test_cpu_registers_through_jax() -> None:
    got = _register_in_child("cpu", JAX_PLATFORMS="cpu")
    assert got["results"] == [{"ok": ["cpu"]}] * 2


def test_cuda_registration_follows_this_jaxs_platform_names() -> None:
    """Without a usable CUDA plugin: jax 0.10.2 takes both names (its hook waits for a
    client); jax 0.11 refuses both, which is one PassRegistrationError naming each name,
    kept for the process (the second call gets the same error, not a new attempt)."""
    if _cuda_plugin_loads():
        pytest.skip("a CUDA plugin is installed here: see the deviceless test below")
    got = _register_in_child("cuda")
    if got["hooks"]:
        assert got["results"] == [{"ok": ["cuda"]}] * 2
        return
    first, second = got["results"]
    assert "'cuda'" in first["error"] and "'gpu'" in first["error"], first
    assert "nothing is stitched on cuda" in first["error"]
    assert second == first                         # the same error object, said once


def test_cuda_registers_on_a_deviceless_cuda_plugin_under_its_own_name() -> None:
    """With jax's CUDA plugin loaded and no GPU (the deviceless environment), jax 0.11
    takes "cuda" and refuses "gpu"; registration succeeds."""
    from stitch.xla_pass import deviceless
    if not _cuda_plugin_loads():
        pytest.skip("no CUDA plugin installed (scripts/deviceless_check.sh makes one)")
    got = _register_in_child("cuda", **deviceless.DEVICELESS_ENV)
    assert got["results"] == [{"ok": ["cuda"]}] * 2


@pytest.mark.skipif(not pass_registration.registers_on_client_start(),
                    reason="jax 0.11 registers on the plugin, which covers started clients")
def test_an_already_started_cuda_client_gets_the_pass_once(monkeypatch) -> None:
    """jax 0.10.2's hook also runs on clients started before the registration: a started
    CUDA client (a stand-in: no GPU here; jax's public call and hook are the real ones)
    gets the pass exactly once, under the name it reports ("gpu")."""
    monkeypatch.setattr(pass_registration, "_REGISTERED", set())
    direct: list = []
    from jax._src.lib import _xla
    monkeypatch.setattr(_xla, "register_xla_transform_c_api",
                        lambda client, name, stage, cb: direct.append(client), raising=False)
    from jax._src import xla_bridge
    started = types.SimpleNamespace(platform="gpu")
    monkeypatch.setattr(xla_bridge, "_backends", {"cuda": started,
                                                  "cpu": types.SimpleNamespace(platform="cpu")})
    hooks = list(xla_bridge._backend_initialization_hooks)
    try:
        xla_pass.ensure_registered("cuda")
        xla_pass.ensure_registered("cuda")                   # once per process
    finally:
        xla_bridge._backend_initialization_hooks[:] = hooks  # no stand-in hooks left behind
    assert direct == [started]


def test_a_failed_registration_is_said_at_the_first_stitched_compile(monkeypatch, caplog) -> None:
    """stitch.jit on a platform whose registration jax refused: the function runs on stock
    XLA with the right result, and the fallback names the registration and its reason."""
    import logging

    import jax.numpy as jnp
    import numpy as np

    import stitch
    refusal = pass_registration.PassRegistrationError(
        "stitch's pass could not be registered with jax for cpu: every platform name was "
        "refused ('cpu': JaxRuntimeError: NOT_FOUND)")
    monkeypatch.setitem(pass_registration._FAILED, "cpu", refusal)
    monkeypatch.setattr(pass_registration, "_REGISTERED", set())

    def f(x):
        return jnp.tanh(x) * 2.0 + jnp.sum(x, axis=-1, keepdims=True)
    fn = stitch.jit(f, async_compile=False, guard=False, device="cpu")
    x = np.random.default_rng(3).standard_normal((64, 256)).astype(np.float32)
    with caplog.at_level(logging.WARNING, logger="stitch"):
        got = fn(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(f)(x)), rtol=1e-6)
    assert fn.stats.stitched_calls == 0
    assert any("PassRegistrationError" in r and "every platform name was refused" in r
               for r in map(str, fn.stats.fallbacks)), fn.stats.fallbacks
    assert "could not be registered" in caplog.text
