"""What the device tests share: the first CUDA device jax sees, or a skip."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def gpu():
    jax = pytest.importorskip("jax")
    try:
        devices = jax.devices("gpu")
    except RuntimeError as exc:
        pytest.skip(f"no CUDA device visible to jax ({exc})")
    if not devices:
        pytest.skip("no CUDA device visible to jax")
    return devices[0]
