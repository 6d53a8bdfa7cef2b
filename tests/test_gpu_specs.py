"""The GPU spec table: agrees with XLA's target descriptions, derived figures are consistent."""
from __future__ import annotations

import pathlib
import re

import pytest

from stitch.hlo.errors import StitchError
from stitch.cost import SPECS, GpuSpec, UnknownTargetError, get_spec
from stitch.cost.gpu_specs import KIB

XLA_SPECS = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "xla_gpu_specs"

# txtpb field -> GpuSpec attribute
FIELDS = {
    "core_count": "sm_count", "memory_bandwidth": "hbm_bandwidth", "l2_cache_size": "l2_bytes",
    "clock_rate_ghz": "clock_ghz", "shared_memory_per_block": "shared_memory_per_block",
    "shared_memory_per_block_optin": "shared_memory_per_block_optin",
    "shared_memory_per_core": "shared_memory_per_sm",
    "registers_per_core_limit": "registers_per_sm",
    "registers_per_block_limit": "registers_per_block",
    "threads_per_core_limit": "max_threads_per_sm",
    "threads_per_block_limit": "max_threads_per_block", "threads_per_warp": "warp_size",
    "fpus_per_core": "fp32_cores_per_sm", "device_memory_size": "memory_bytes",
}


def _read_txtpb(path: pathlib.Path) -> dict[str, float]:
    """The scalar fields of a target_config (flat: nested blocks only hold major/minor)."""
    values: dict[str, float] = {}
    text = re.sub(r"#.*", "", path.read_text())
    for key, value in re.findall(r"^\s*(\w+)\s*:\s*([-\d.eE+]+)\s*$", text, re.M):
        values.setdefault(key, float(value))
    cc = re.search(r"cuda_compute_capability\s*\{\s*major:\s*(\d+)\s*minor:\s*(\d+)", text)
    if cc:
        values["cc"] = (int(cc.group(1)), int(cc.group(2)))
    return values


@pytest.mark.parametrize("target", ["v100", "a100", "h100"])
def test_values_match_xla_target_descriptions(target):
    path = XLA_SPECS / f"{target}.txtpb"
    if not path.exists():
        pytest.skip(f"{path} not found (XLA's target descriptions live in ../shared, "
                    "outside the repository)")
    xla = _read_txtpb(path)
    spec = get_spec(target)
    for field, attr in FIELDS.items():
        assert field in xla, f"{path.name} lacks {field}"
        assert getattr(spec, attr) == pytest.approx(xla[field], rel=0, abs=1e-9), (target, attr)
    assert spec.compute_capability == xla["cc"]


@pytest.mark.parametrize("spec", SPECS.values(), ids=lambda s: s.name)
def test_derived_quantities_are_consistent(spec: GpuSpec):
    cores = spec.sm_count * spec.fp32_cores_per_sm
    assert spec.fp32_flops == pytest.approx(cores * 2 * spec.clock_ghz * 1e9)
    assert spec.hbm_bytes_per_cycle * spec.clock_hz == pytest.approx(spec.hbm_bandwidth)
    per_sm = spec.hbm_bytes_per_cycle_per_sm
    assert per_sm * spec.sm_count == pytest.approx(spec.hbm_bytes_per_cycle)
    assert spec.shared_memory_bandwidth == pytest.approx(128 * spec.sm_count * spec.clock_hz)
    assert spec.l2_bandwidth > spec.hbm_bandwidth
    assert spec.ridge_flops_per_byte == pytest.approx(spec.fp32_flops / spec.hbm_bandwidth)
    # Occupancy limits agree with each other.
    assert spec.max_warps_per_sm * spec.warp_size == spec.max_threads_per_sm
    assert spec.max_warps_per_block == 32
    assert spec.registers_per_sm % spec.register_allocation_unit == 0
    # The largest carve-out is the SM's shared memory; opt-in = that minus the reservation.
    carve = spec.shared_memory_carveouts
    assert list(carve) == sorted(carve) and carve[0] == 0
    assert carve[-1] == spec.shared_memory_per_sm
    reserved = spec.reserved_shared_memory_per_block
    assert spec.shared_memory_per_block_optin == spec.shared_memory_per_sm - reserved
    assert spec.shared_memory_per_block == 48 * KIB <= spec.shared_memory_per_block_optin
    assert spec.carveout_for(1) == 8 * KIB
    assert spec.carveout_for(spec.shared_memory_per_sm + 1) is None
    assert spec.kernel_launch_overhead_s == 1e-6


def test_figures_against_datasheets():
    """Peak FP32 and bandwidth agree with NVIDIA's published figures (TFLOPS, TB/s)."""
    published = {"v100": (15.7, 0.9), "a100": (19.5, 2.039), "h100": (67.0, 3.35),
                 "h200": (67.0, 4.8)}
    for name, (tflops, tbs) in published.items():
        spec = get_spec(name)
        assert spec.fp32_flops / 1e12 == pytest.approx(tflops, rel=0.01), name
        assert spec.hbm_bandwidth / 1e12 == pytest.approx(tbs, rel=0.01), name
    largest = [get_spec(n).shared_memory_carveouts[-1] // KIB for n in ("v100", "a100", "h100")]
    assert largest == [96, 164, 228]
    assert get_spec("h200").compute_capability == get_spec("h100").compute_capability == (9, 0)


def test_get_spec_names():
    assert get_spec("H100") is SPECS["h100"] and get_spec(" a100 ") is SPECS["a100"]
    assert set(SPECS) == {"v100", "a100", "h100", "h200"}
    with pytest.raises(UnknownTargetError) as err:
        get_spec("p100")
    assert isinstance(err.value, StitchError)
    assert "'p100'" in str(err.value) and all(n in str(err.value) for n in SPECS)


def test_specs_are_frozen():
    with pytest.raises(AttributeError):
        get_spec("v100").sm_count = 1  # type: ignore[misc]
