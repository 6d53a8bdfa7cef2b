"""XLA's C++ log lines written during stitch's own compile are caught and said in one stitch
line; the program's other stderr output passes through; fd 2 is restored."""
from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from stitch.xla_pass.xla_stderr import xla_stderr_captured

XLA_LINE = (b"E1128 12:00:00.123456    4242 execution_engine.cc:54] LLVM compilation error: "
            b"Symbols not found: [ __xla_cpu_runtime_HandleFfiCall ]\n")


def test_xla_lines_are_caught_and_the_rest_passes(capfd) -> None:
    token = os.urandom(6).hex()
    with xla_stderr_captured() as said:
        os.write(2, XLA_LINE)
        os.write(2, f"user line {token}\n".encode())
    os.write(2, f"after {token}\n".encode())
    err = capfd.readouterr().err
    assert said.active
    assert "execution_engine.cc" not in err
    assert f"user line {token}" in err and f"after {token}" in err
    assert said.gist().startswith("LLVM compilation error: Symbols not found")


def test_a_second_capture_at_once_leaves_fd2_alone(capfd) -> None:
    with xla_stderr_captured() as outer, xla_stderr_captured() as inner:
        os.write(2, XLA_LINE)
    assert outer.active and not inner.active and len(outer.lines) == 1
    assert "execution_engine.cc" not in capfd.readouterr().err


def _xla_says_then(monkeypatch, fails: bool) -> None:
    """compile_with_pass writes XLA's line to fd 2 first (as XLA does before a retry)."""
    from stitch.errors import StitchError
    from stitch.xla_pass import entry as xla_pass
    real = xla_pass.compile_with_pass

    def noisy(lowered, request):
        os.write(2, XLA_LINE)
        if fails:
            raise StitchError("XLA rejected the stitched module")
        return real(lowered, request)
    monkeypatch.setattr(xla_pass, "compile_with_pass", noisy)


@pytest.mark.parametrize("fails", [False, True])
def test_stitch_jit_says_xla_s_gist_in_one_line(monkeypatch, capfd, caplog, fails) -> None:
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import stitch
    _xla_says_then(monkeypatch, fails)

    def norm_tanh(x):
        m = jnp.mean(x, axis=-1, keepdims=True)
        return jnp.tanh((x - m) * jax.lax.rsqrt(jnp.mean((x - m) ** 2, -1, keepdims=True)
                                                + 1e-5))

    x = np.random.default_rng().standard_normal((8, 32)).astype(np.float32)
    f = stitch.jit(norm_tanh, async_compile=False, guard=False, device="cpu")
    with caplog.at_level(logging.INFO, logger="stitch"):
        for _ in range(2):
            np.testing.assert_allclose(np.asarray(f(x)), np.asarray(jax.jit(norm_tanh)(x)),
                                       rtol=1e-4, atol=1e-5)
    assert "execution_engine.cc" not in capfd.readouterr().err
    said = [r.getMessage() for r in caplog.records if "Symbols not found" in r.getMessage()]
    assert len(said) == 1, said
    assert ("falls back" in said[0]) is fails, said
    assert (f.stats.stitched_calls >= 1) is not fails
