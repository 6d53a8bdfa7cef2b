"""XLA's GpuPerformanceModel formulas, written down independently of stitch's cost models,
as one yardstick applied to both XLA's and stitch's kernels.

Per kernel (xla/service/gpu/model/gpu_performance_model*.{h,cc}, the analytic model priority
fusion ranks loop/input fusions with):

    T = launch + C + M - 0.95 * min(C, M)
    launch = 1 us                                  (kKernelLaunchOverhead)
    C = flops / (core_count * fpus_per_core * 2 * clock_rate)   (FMA = 2 flops per FPU)
    M = bytes / memory_bandwidth

Device figures are XLA's own target descriptions (../shared/xla_gpu_specs/*.txtpb, the files
the baseline fixtures were compiled with), copied into ``DEVICES`` and checked against the
files by tests/test_xla_cost_formula.py; nothing is read from ``stitch.cost``.

Simplifications against XLA (the same on both sides of every comparison):
- C uses every SM and every FPU (XLA scales by min(blocks, SMs) and min(threads per block,
  FPUs per SM), which needs launch dimensions; memory-intensive kernels are memory-bound
  under this formula anyway: the zoo's largest flops/byte is reported by the bench).
- M is bytes over peak bandwidth: XLA's DRAM heuristics (coalescing, L1/L2 reuse of small
  operands) are left out.
- flops are counted by HloCostAnalysis's rules, not GpuHloCostAnalysis's measured per-opcode
  profiles (which we do not have): 1 flop per element of an elementwise op, transcendentals
  included; data movement (broadcast, transpose, slice, gather, concatenate, pad, copy,
  iota...) 0; a reduce ``data operands * (input elements - output elements)``; a
  reduce-window ``data operands * window size * output elements``. Inside a kernel an op is
  counted once per element its consumers need, so a producer recomputed through a broadcast
  counts once per broadcast element (XLA's operand utilization); a reduction is computed
  once per output element.
- bytes are given by the caller (the bench uses each plan's counted HBM bytes).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from stitch.hlo.graph import OpGraph
from stitch.hlo.ir import parse_window
from stitch.hlo.op_classes import OpClass

KERNEL_LAUNCH_S = 1e-6            # XLA's kKernelLaunchOverhead
MEMORY_COMPUTE_PARALLELISM = 0.95  # T = C + M - 0.95 * min(C, M)
FLOPS_PER_FPU_PER_CYCLE = 2        # one FMA


@dataclass(frozen=True)
class XlaDevice:
    """The se::DeviceDescription fields GpuPerformanceModel's formulas read."""

    name: str
    core_count: int
    fpus_per_core: int
    clock_rate_ghz: float
    memory_bandwidth: float        # bytes/s

    @property
    def flops_per_s(self) -> float:
        return self.core_count * self.fpus_per_core * FLOPS_PER_FPU_PER_CYCLE * \
            self.clock_rate_ghz * 1e9


# From ../shared/xla_gpu_specs/{v100,a100,h100}.txtpb (gpu_device_info).
DEVICES: dict[str, XlaDevice] = {
    "v100": XlaDevice("v100", 80, 64, 1.53, 898_048_000_000),
    "a100": XlaDevice("a100", 108, 64, 1.41, 2_039_040_000_000),
    "h100": XlaDevice("h100", 132, 128, 1.98, 3_352_320_000_000),
}

_FIELD = re.compile(r"^\s*(core_count|fpus_per_core|clock_rate_ghz|memory_bandwidth):\s*(\S+)",
                    re.M)


def read_txtpb(path: Path, name: str | None = None) -> XlaDevice:
    """An XlaDevice from an XLA GPU target description in protobuf text format."""
    fields = {k: float(v) for k, v in _FIELD.findall(Path(path).read_text())}
    missing = {"core_count", "fpus_per_core", "clock_rate_ghz", "memory_bandwidth"} - set(fields)
    if missing:
        raise ValueError(f"{path}: missing {', '.join(sorted(missing))}")
    return XlaDevice(name or Path(path).stem, int(fields["core_count"]),
                     int(fields["fpus_per_core"]), fields["clock_rate_ghz"],
                     fields["memory_bandwidth"])


@dataclass(frozen=True)
class KernelTime:
    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    launch_s: float
    total_s: float

    @property
    def floor_s(self) -> float:
        """The roofline floor: bytes at peak bandwidth (no launch, no compute)."""
        return self.memory_s


def kernel_time(device: XlaDevice, flops: float, nbytes: float,
                launch_s: float = KERNEL_LAUNCH_S) -> KernelTime:
    """T = launch + C + M - 0.95 * min(C, M) for one kernel launch."""
    compute = flops / device.flops_per_s
    memory = nbytes / device.memory_bandwidth
    total = launch_s + compute + memory - MEMORY_COMPUTE_PARALLELISM * min(compute, memory)
    return KernelTime(flops, nbytes, compute, memory, launch_s, total)


# Ops that compute nothing (HloCostAnalysis gives them 0 flops).
_NO_FLOPS = (OpClass.LAYOUT, OpClass.SOURCE)


def _elements(graph: OpGraph, v: int) -> int:
    shape = graph.nodes[v].shape
    if shape.is_tuple:
        return max((s.num_elements for s in shape.leaves()), default=1)
    return max(shape.num_elements, 1) if shape.is_array else 1


def op_flops(graph: OpGraph, v: int) -> float:
    """Flops to compute every element of op ``v`` once (rules in the module docstring)."""
    node = graph.nodes[v]
    if node.op_class in _NO_FLOPS or graph.is_free(v):
        return 0.0
    out = _elements(graph, v)
    if node.opcode == "reduce":
        data = max(len(node.operands) // 2, 1)
        return float(data * max(_elements(graph, node.operands[0]) - out, 0))
    if node.opcode == "reduce-window":
        data = max(len(node.operands) // 2, 1)
        text = node.instruction.attrs.get("window")
        size = math.prod(d.size for d in parse_window(text)) if text else 1
        return float(data * size * out)
    if node.op_class in (OpClass.LIGHT, OpClass.EXPENSIVE):
        return float(out)
    return 0.0          # GEMM/conv and opaque ops are not memory-intensive arithmetic here


def kernel_flops(graph: OpGraph, members: Iterable[int]) -> float:
    """Flops of one kernel made of ``members``, counting recomputation: each op is computed
    once per element its in-kernel consumers need (max over consumers: a thread computes a
    value once per index), at least once for the elements the kernel writes out; a reduce's
    operand is read once per input element and the reduce computed once per output."""
    members = set(members)
    outputs = set(graph.outputs)
    times: dict[int, float] = {}      # computations of each element of v (utilization)
    total = 0.0
    for v in sorted(members, reverse=True):        # consumers before producers
        node = graph.nodes[v]
        util = 1.0 if (v in outputs or any(u not in members for u in node.users)) else 0.0
        for u in node.users:
            if u not in members:
                continue
            user = graph.nodes[u]
            if user.op_class is OpClass.REDUCTION:
                demand = 1.0
            else:
                demand = times.get(u, 1.0) * _elements(graph, u) / _elements(graph, v)
            util = max(util, demand)
        if node.op_class is OpClass.REDUCTION:
            util = min(util, 1.0) if util else 0.0
        times[v] = util
        total += op_flops(graph, v) * util
    return total
