"""The XLA GPU target config the deviceless check compiles for is made from stitch's GPU spec;
where XLA's own target descriptions are at hand (../shared, outside the repository), it
says the same. Runs in the main suite (no plugin needed)."""
from __future__ import annotations

import pathlib
import re

import pytest

from stitch.xla_pass.deviceless import target_config

XLA_SPECS = pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "xla_gpu_specs"


def _fields(text: str) -> dict[str, str]:
    """Every `key: value` of a text proto, nested blocks flattened with their names."""
    text = re.sub(r"#.*", "", text)
    out: dict[str, str] = {}
    stack: list[str] = []
    for token in re.findall(r'(\w+)\s*\{|\}|(\w+)\s*:\s*("[^"]*"|[-\w.+]+)', text):
        block, key, value = token
        if block:
            stack.append(block)
        elif key:
            out[".".join([*stack, key])] = value
        else:
            stack.pop()
    return out


@pytest.mark.parametrize("target", ["v100", "a100", "h100"])
def test_target_config_matches_xlas_description(target):
    ours = _fields(target_config(target))
    assert ours["gpu_device_info.cuda_compute_capability.major"].isdigit()
    path = XLA_SPECS / f"{target}.txtpb"
    if not path.exists():
        pytest.skip(f"{path} not found (XLA's target descriptions live outside the repository)")
    xla = _fields(path.read_text())
    device = {k: v for k, v in xla.items() if k.startswith("gpu_device_info.")}
    assert device, path
    for key, value in device.items():
        assert key in ours, key
        assert float(ours[key]) == pytest.approx(float(value), rel=1e-12), key
    assert ours["platform_name"] == xla["platform_name"]
