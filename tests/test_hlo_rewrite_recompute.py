"""stitch.xla_pass.hlo_rewrite: a kernel that recomputes a value instead of reading it
(the attention backward recomputing S from Q and K) replaces that value's last outside
reader; a kernel placed after it that produced the value need not write it any more."""
from __future__ import annotations

import pytest

pytest.importorskip("jaxlib")

from stitch.hlo import parse_hlo, print_hlo  # noqa: E402
from stitch.hlo.graph import build_op_graphs  # noqa: E402
from stitch.xla_pass.hlo_rewrite import (ComputationView, KernelSite, PlacedKernel,  # noqa: E402
                                            replace_kernels)
from stitch.xla_pass.pass_registration import to_proto  # noqa: E402

MODULE = """HloModule m
ENTRY e {
  x = f32[8,16] parameter(0)
  y = f32[8,16] parameter(1)
  s = f32[8,16] exponential(x)
  o = f32[8,16] negate(s)
  d = f32[8,16] multiply(s, y)
  ROOT r = (f32[8,16], f32[8,16]) tuple(o, d)
}"""


@pytest.mark.parametrize("order", ["recomputing first", "producer first"])
def test_a_value_whose_reader_recomputes_it_is_not_written(order: str) -> None:
    module = parse_hlo(MODULE)
    graph = build_op_graphs(module)[0]
    view = ComputationView(module, graph)
    node = {n.instruction.name: n.id for n in graph.nodes}
    # Reads x and y, computes exp(x) * y itself: s is not among its inputs.
    recompute = PlacedKernel(KernelSite("recompute", 0, frozenset({node["d"]}), ("d",)),
                             [node["x"], node["y"]], [node["d"]], "stitch_test_recompute")
    # Computes s and o, writes o alone.
    producer = PlacedKernel(KernelSite("producer", 0, frozenset({node["s"], node["o"]}),
                                       ("s", "o")), [node["x"]], [node["o"]],
                            "stitch_test_producer")
    kernels = [recompute, producer] if order == "recomputing first" else [producer, recompute]
    report = replace_kernels(module, [graph], kernels, {0: view})
    names = {i.name for i in module.entry.instructions}
    for inst in module.entry.instructions:
        assert set(inst.operands) <= names, inst
    to_proto(print_hlo(module, operand_shapes=True))      # XLA's parser takes it
    if order == "recomputing first":
        assert report.placed == ["recompute", "producer"], report.skipped
        assert "s" not in names
    else:
        # Placed first, the producer would drop s while d still reads it.
        assert report.placed == ["recompute"]
        assert [name for name, _ in report.skipped] == ["producer"]
