"""Kernels read and write buffers in the layout XLA assigned them (a GEMM output laid out
{0,1}): the pass lowers with XLA's layouts (hlo_rewrite.xla_layouts) and the rewrite places
a kernel only where its layouts are XLA's."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jaxlib")

from stitch.codegen.lower import lower_kernel, run_on_host  # noqa: E402
from stitch.hlo import evaluate, parse_hlo, print_hlo  # noqa: E402
from stitch.hlo.evaluator.interpreter import Evaluator  # noqa: E402
from stitch.hlo.graph import build_op_graphs  # noqa: E402
from stitch.xla_pass.hlo_rewrite import (ComputationView, KernelSite, PlacedKernel,  # noqa: E402
                                            buffer_layout, replace_kernels, xla_layouts)
from stitch.cost.gpu_specs import get_spec  # noqa: E402
from stitch.schedule.tuner import schedule_kernel  # noqa: E402

# A GEMM result in layout {0,1} (column-major), as XLA GPU's layout assignment gives GEMM
# outputs, read by two fusions a stitched kernel replaces; its output laid out {0,1} too.
MODULE = """HloModule m
add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}
f_exp {
  p = f32[ROWS,COLS]{0,1} parameter(0)
  ROOT e = f32[ROWS,COLS]{1,0} exponential(p)
}
f_norm {
  q = f32[ROWS,COLS]{1,0} parameter(0)
  z = f32[] constant(0)
  s = f32[ROWS]{0} reduce(q, z), dimensions={1}, to_apply=add
  b = f32[ROWS,COLS]{0,1} broadcast(s), dimensions={0}
  qt = f32[ROWS,COLS]{0,1} copy(q)
  ROOT d = f32[ROWS,COLS]{0,1} divide(qt, b)
}
ENTRY e {
  x = f32[ROWS,K]{1,0} parameter(0)
  w = f32[K,COLS]{1,0} parameter(1)
  g = f32[ROWS,COLS]{0,1} dot(x, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  fe = f32[ROWS,COLS]{1,0} fusion(g), kind=kLoop, calls=f_exp
  ROOT fn = f32[ROWS,COLS]{0,1} fusion(fe), kind=kInput, calls=f_norm
}"""


def _module(rows, cols, k):
    return parse_hlo(MODULE.replace("ROWS", str(rows)).replace("COLS", str(cols))
                     .replace("K", str(k)).replace("f32[%d]" % rows, f"f32[{rows}]"))


def _setup():
    rng = np.random.default_rng()
    rows, cols, k = (int(rng.integers(3, 12)) * 4, int(rng.integers(3, 12)) * 8,
                     int(rng.integers(2, 9)))
    module = _module(rows, cols, k)
    graph = build_op_graphs(module)[0]
    node = {n.instruction.name: n.id for n in graph.nodes}
    members = frozenset(n.id for n in graph.nodes
                        if n.instruction.name in ("p", "e", "q", "z", "s", "b", "qt", "d"))
    members = frozenset(v for v in members
                        if graph.nodes[v].opcode not in ("parameter", "constant"))
    return rng, module, graph, node, members, (rows, cols, k)


def test_buffer_layout_reads_xlas_minor_to_major():
    module = _module(8, 16, 4)
    shapes = {i.name: i.shape for _, i in module.instructions()}
    assert buffer_layout(shapes["g"]) == (1, 0)
    assert buffer_layout(shapes["x"]) is None


def test_a_kernel_lowered_with_xlas_layouts_computes_the_evaluators_values():
    rng, module, graph, node, members, (rows, cols, k) = _setup()
    layouts = xla_layouts(graph, members)
    assert layouts.get(node["g"]) == (1, 0) and layouts.get(node["d"]) == (1, 0)
    schedule = schedule_kernel(graph, members, get_spec("h100"))
    lowered = lower_kernel(graph, Evaluator(module), schedule, "k_layouts", layouts=layouts)
    assert lowered.layouts.get(node["g"]) == (1, 0)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((k, cols)).astype(np.float32)
    (want,) = evaluate(module, [x, w])
    g = (x.astype(np.float64) @ w).astype(np.float32)
    got = run_on_host(lowered, graph, {node["g"]: g})
    np.testing.assert_allclose(got[node["d"]], want, rtol=1e-5, atol=1e-6)


def _placed(graph, node, members, layouts):
    return PlacedKernel(KernelSite("k", 0, members, ("fe", "fn")), [node["g"]], [node["d"]],
                        "stitch_test_layouts", {}, layouts)


def test_the_rewrite_places_a_kernel_in_xlas_layouts_and_refuses_a_row_major_one():
    _, module, graph, node, members, _ = _setup()
    refused = replace_kernels(module, [graph], [_placed(graph, node, members, {})],
                              {0: ComputationView(module, graph)})
    assert not refused.placed and "laid out" in refused.skipped[0][1], refused.skipped
    module = parse_hlo(print_hlo(module))
    graph = build_op_graphs(module)[0]
    report = replace_kernels(module, [graph],
                             [_placed(graph, node, members, xla_layouts(graph, members))],
                             {0: ComputationView(module, graph)})
    assert report.placed == ["k"], report.skipped
    call = next(i for i in module.entry.instructions if i.opcode == "custom-call")
    assert buffer_layout(call.shape.tuple_shapes[0]) == (1, 0)
