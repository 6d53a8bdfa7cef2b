"""Deviceless XLA GPU checks: skipped (with the reason) unless jax's CUDA plugin is
installed and this process hides every GPU from it. ``scripts/deviceless_check.sh`` makes a
separate virtual environment with the plugin and runs these tests in it; the main suite's
environment never gets the plugin (it would change jax's backends for every test)."""
from __future__ import annotations

import pytest

from stitch.xla_pass import deviceless

TARGET = "h100"          # stitch's GPU spec; the compile's target config is made from it
ARCH = "sm_90"


def _not_ready() -> str | None:
    why = deviceless.plugin_available()
    if why:
        return why
    try:
        deviceless.check_environment()
    except deviceless.DevicelessError as exc:
        # Never set these here: on a GPU machine they would hide its GPUs from every other
        # test of the session.
        return f"{exc}; run scripts/deviceless_check.sh"
    return None


@pytest.fixture(scope="session")
def deviceless_ready() -> None:
    why = _not_ready()
    if why:
        pytest.skip(why)
    deviceless.ensure_pass_registered()


@pytest.fixture(scope="session")
def h100_mesh(deviceless_ready):
    """One H100 (topology 1x1x1) as a jax mesh, no device opened."""
    from jax.experimental import topologies
    return topologies.make_mesh(deviceless.topology(TARGET, "1x1x1"), (1,), ("d",))


@pytest.fixture(scope="session")
def h100_mesh2(deviceless_ready):
    """Two H100s (topology 1x2x1) as a 1-D data-parallel mesh."""
    from jax.experimental import topologies
    return topologies.make_mesh(deviceless.topology(TARGET, "1x2x1"), (2,), ("d",))


def assert_no_spills(report) -> None:
    """Every kernel the pass placed assembles for the target (ptxas -v) without spills."""
    from stitch.codegen.nvptx import emit_ptx
    from stitch.codegen.toolchain import assemble_cubin
    assert report.kernels, report.summary()
    for built in report.kernels:
        _, entries = assemble_cubin(emit_ptx(built.lowered.kernel, ARCH), ARCH)
        for entry, got in entries.items():
            assert got.spill_store_bytes == 0 and got.spill_load_bytes == 0, (entry, got)
