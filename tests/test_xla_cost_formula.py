"""XLA's GpuPerformanceModel formulas (bench/xla_formula.py) on hand-computed cases."""
from __future__ import annotations

import pathlib

import pytest

from bench.xla_formula import (DEVICES, KERNEL_LAUNCH_S, XlaDevice, kernel_flops,
                                    kernel_time, op_flops, read_txtpb)
from stitch.hlo import parse_hlo
from stitch.hlo.graph import build_op_graphs
from tests.fixtures import REDUCERS

SPECS = pathlib.Path(__file__).resolve().parents[2] / "shared" / "xla_gpu_specs"


def graph_of(body: str):
    return build_op_graphs(parse_hlo("HloModule m\n" + REDUCERS + "ENTRY e {\n" + body + "\n}\n"))[0]


def ids(graph, *names: str) -> set[int]:
    return {graph.node(n).id for n in names}


def test_device_flop_rate_is_fma_per_fpu_per_clock():
    # V100: 80 SMs x 64 FPUs x 2 flops x 1.53 GHz = 15.6672 TFLOP/s.
    assert DEVICES["v100"].flops_per_s == pytest.approx(15.6672e12)
    # H100: 132 x 128 x 2 x 1.98 GHz = 66.90816 TFLOP/s.
    assert DEVICES["h100"].flops_per_s == pytest.approx(66.90816e12)


def test_memory_bound_kernel_is_launch_plus_bytes_over_bandwidth():
    t = kernel_time(DEVICES["v100"], flops=0, nbytes=898_048)    # exactly 1 us of traffic
    assert t.memory_s == pytest.approx(1e-6)
    assert t.compute_s == 0
    assert t.total_s == pytest.approx(2e-6)
    assert t.floor_s == pytest.approx(1e-6)


def test_equal_compute_and_memory_overlap_95_percent():
    # C = M = 1 us on V100: T = 1 + 1 + 1 - 0.95 = 2.05 us.
    t = kernel_time(DEVICES["v100"], flops=15.6672e6, nbytes=898_048)
    assert t.compute_s == pytest.approx(1e-6)
    assert t.total_s == pytest.approx(2.05e-6)


def test_compute_bound_kernel_hides_most_memory():
    # H100: C = 1 us, M = 0.5 us: T = 1 + 1 + 0.5 - 0.95 * 0.5 = 2.025 us.
    t = kernel_time(DEVICES["h100"], flops=66.90816e6, nbytes=1_676_160)
    assert t.total_s == pytest.approx(2.025e-6)


def test_launch_overhead_is_a_parameter():
    t = kernel_time(DEVICES["a100"], 0, 0, launch_s=0.0)
    assert t.total_s == 0
    assert KERNEL_LAUNCH_S == 1e-6


BODY = """  p0 = f32[8,16] parameter(0)
  p1 = f32[8] parameter(1)
  z = f32[] constant(0)
  r = f32[8] reduce(p0, z), dimensions={1}, to_apply=add
  a = f32[8] add(r, p1)
  b = f32[8,16] broadcast(a), dimensions={0}
  ROOT m = f32[8,16] multiply(p0, b)"""


def test_op_flops_follow_hlo_cost_analysis_rules():
    g = graph_of(BODY)
    assert op_flops(g, g.node("r").id) == 8 * 16 - 8      # input - output elements
    assert op_flops(g, g.node("a").id) == 8
    assert op_flops(g, g.node("b").id) == 0                # data movement
    assert op_flops(g, g.node("m").id) == 128


def test_broadcast_recomputes_its_producers_but_not_a_reduction():
    g = graph_of(BODY)
    # Separate kernels: every op once.
    assert kernel_flops(g, ids(g, "r")) == 120
    assert kernel_flops(g, ids(g, "a")) == 8
    assert kernel_flops(g, ids(g, "b", "m")) == 128
    # One kernel: a is computed for each of the 16 broadcast elements of its row
    # (8 * 16 = 128), the reduction once per output (120), m once (128).
    assert kernel_flops(g, ids(g, "r", "a", "b", "m")) == 120 + 128 + 128


def test_a_sliced_value_is_computed_only_where_needed():
    g = graph_of("""  x = f32[100] parameter(0)
  n = f32[100] negate(x)
  ROOT s = f32[10] slice(n), slice={[0:10]}""")
    assert kernel_flops(g, ids(g, "n", "s")) == pytest.approx(10)
    assert kernel_flops(g, ids(g, "n")) == 100


def test_reduce_window_counts_window_times_outputs():
    g = graph_of("""  x = f32[10] parameter(0)
  z = f32[] constant(0)
  ROOT w = f32[8] reduce-window(x, z), window={size=3}, to_apply=add""")
    assert op_flops(g, g.node("w").id) == 3 * 8


@pytest.mark.skipif(not SPECS.is_dir(), reason="../shared/xla_gpu_specs not present")
@pytest.mark.parametrize("name", sorted(DEVICES))
def test_devices_equal_xla_target_descriptions(name):
    assert read_txtpb(SPECS / f"{name}.txtpb", name) == DEVICES[name]


def test_read_txtpb_refuses_incomplete_descriptions(tmp_path):
    path = tmp_path / "x.txtpb"
    path.write_text("gpu_device_info {\n  core_count: 4\n  fpus_per_core: 8\n}\n")
    with pytest.raises(ValueError, match="clock_rate_ghz"):
        read_txtpb(path)
    path.write_text("gpu_device_info {\n  core_count: 4\n  fpus_per_core: 8\n"
                    "  clock_rate_ghz: 1.0\n  memory_bandwidth: 1e9\n}\n")
    assert read_txtpb(path) == XlaDevice("x", 4, 8, 1.0, 1e9)
