"""stitch.xla_pass.hlo_rewrite on hand-placed kernels: a kernel that reads an element of XLA's
multi-output fusion while another kernel replaces that fusion (XLA GPU's transformer_train
step: the rewritten module read an instruction it had removed, and XLA's parser refused it)."""
from __future__ import annotations

import pytest

pytest.importorskip("jaxlib")

from stitch.hlo import parse_hlo, print_hlo  # noqa: E402
from stitch.hlo.graph import build_op_graphs  # noqa: E402
from stitch.xla_pass.hlo_rewrite import (ComputationView, KernelSite, PlacedKernel,  # noqa: E402
                                            replace_kernels)
from stitch.xla_pass.pass_registration import to_proto  # noqa: E402

MODULE = """HloModule m
fused_two {
  p = f32[8,16] parameter(0)
  a = f32[8,16] exponential(p)
  b = f32[8,16] negate(p)
  ROOT t = (f32[8,16], f32[8,16]) tuple(a, b)
}
fused_use {
  q0 = f32[8,16] parameter(0)
  q1 = f32[8,16] parameter(1)
  ROOT u = f32[8,16] add(q0, q1)
}
ENTRY e {
  x = f32[8,16] parameter(0)
  two = (f32[8,16], f32[8,16]) fusion(x), kind=kLoop, calls=fused_two
  g0 = f32[8,16] get-tuple-element(two), index=0
  g1 = f32[8,16] get-tuple-element(two), index=1
  use = f32[8,16] fusion(g0, g1), kind=kLoop, calls=fused_use
  v = f32[8,16] multiply(g1, g1)
  ROOT r = (f32[8,16], f32[8,16]) tuple(use, v)
}"""


def _kernels(module):
    graph = build_op_graphs(module)[0]
    view = ComputationView(module, graph)
    node = {n.instruction.name: n.id for n in graph.nodes}
    reader = PlacedKernel(KernelSite("reader", 0, frozenset({node["u"]}), ("use",)),
                          [node["a"], node["b"]], [node["u"]], "stitch_test_reader")
    fusion = PlacedKernel(KernelSite("fusion", 0, frozenset({node["a"], node["b"]}), ("two",)),
                          [node["x"]], [node["a"], node["b"]], "stitch_test_fusion")
    return graph, view, reader, fusion


def _call(module, target: str):
    return next(i for i in module.entry.instructions
                if i.opcode == "custom-call" and target in i.attrs["custom_call_target"])


def _defined_operands(module) -> None:
    names = {i.name for i in module.entry.instructions}
    for inst in module.entry.instructions:
        missing = [o for o in inst.operands if o not in names]
        assert not missing, f"{inst.name} reads {missing}, which the module no longer has"


@pytest.mark.parametrize("order", ["reader first", "fusion first"])
def test_a_kernel_reading_a_fusion_another_kernel_replaces(order):
    module = parse_hlo(MODULE)
    graph, view, reader, fusion = _kernels(module)
    kernels = [reader, fusion] if order == "reader first" else [fusion, reader]
    report = replace_kernels(module, [graph], kernels, {0: view})
    _defined_operands(module)
    to_proto(print_hlo(module, operand_shapes=True))      # XLA's parser takes it
    assert sorted(report.placed) == ["fusion", "reader"], report.skipped
    # Either way the reader takes `two`'s elements from the fusion kernel's call: placed
    # second, its gtes are readers the fusion kernel retargets; placed first, nothing named
    # `two` is left, and it reads the call's elements (before, it stayed with XLA).
    assert report.placed == (["reader", "fusion"] if order == "reader first"
                             else ["fusion", "reader"])
    call, reader = _call(module, "stitch_test_fusion"), _call(module, "stitch_test_reader")
    by_name = {i.name: i for i in module.entry.instructions}
    assert [by_name[o].operands for o in reader.operands] == [[call.name], [call.name]]
    assert [by_name[o].int("index") for o in reader.operands] == [0, 1]



IN_PLACE_MODULE = """HloModule m
fused_a {
  p = f32[8,16] parameter(0)
  ROOT e = f32[8,16] exponential(p)
}
fused_b {
  q = f32[8,16] parameter(0)
  ROOT n = f32[8,16] negate(q)
}
fused_c {
  s = f32[8,16] parameter(0)
  ROOT t = f32[8,16] tanh(s)
}
ENTRY e {
  x = f32[8,16] parameter(0)
  a = f32[8,16] fusion(x), kind=kLoop, calls=fused_a
  b = f32[8,16] fusion(a), kind=kLoop, calls=fused_b
  c = f32[8,16] fusion(b), kind=kLoop, calls=fused_c
  ROOT r = (f32[8,16], f32[8,16]) tuple(c, OTHER)
}"""


def _in_place_call(other: str, source: str):
    """Place a kernel over b and c whose output t starts as a copy of ``source``."""
    module = parse_hlo(IN_PLACE_MODULE.replace("OTHER", other))
    graph = build_op_graphs(module)[0]
    view = ComputationView(module, graph)
    node = {n.instruction.name: n.id for n in graph.nodes}
    kernel = PlacedKernel(KernelSite("k", 0, frozenset({node["n"], node["t"]}), ("b", "c")),
                          [node[source]], [node["t"]], "stitch_test_k", {node["t"]: node[source]})
    report = replace_kernels(module, [graph], [kernel], {0: view})
    assert report.placed == ["k"], report.skipped
    _defined_operands(module)
    to_proto(print_hlo(module, operand_shapes=True))      # XLA's parser takes it
    by_name = {i.name: i for i in module.entry.instructions}
    call = next(i for i in module.entry.instructions if i.opcode == "custom-call")
    assert call.attrs["output_to_operand_aliasing"] == "{{0}: (0, {})}"
    return by_name[call.operands[0]]


def test_an_in_place_output_aliases_a_fusion_result_only_it_reads():
    # `a` is read only by the instructions the kernel replaces: its buffer is the kernel's
    # to write (as XLA's in-place scatter fusion wrote its operand's).
    operand = _in_place_call("x", "e")
    assert operand.name == "a"


@pytest.mark.parametrize("other, source", [("a", "e"), ("x", "x")])
def test_an_in_place_output_aliases_a_copy_of_a_buffer_others_see(other, source):
    # `a` also goes to the root, or the input is the entry parameter: the kernel writes a copy.
    operand = _in_place_call(other, source)
    assert operand.opcode == "copy" and operand.name.endswith(".inplace")


def test_gtes_read_only_inside_the_kernel_go_with_the_fusion_they_read():
    # One kernel replaces `two`, `use` and `v`: `two`'s gtes are read only by instructions
    # it replaces, so it writes neither element (the op graph has no gte nodes). Before,
    # the gtes counted as readers outside: "element 0 of two is read but not written".
    module = parse_hlo(MODULE)
    graph = build_op_graphs(module)[0]
    view = ComputationView(module, graph)
    node = {n.instruction.name: n.id for n in graph.nodes}
    whole = PlacedKernel(KernelSite("whole", 0, frozenset({node[n] for n in "abuv"}),
                                    ("two", "use", "v")),
                         [node["x"]], [node["u"], node["v"]], "stitch_test_whole")
    report = replace_kernels(module, [graph], [whole], {0: view})
    assert report.placed == ["whole"], report.skipped
    _defined_operands(module)
    to_proto(print_hlo(module, operand_shapes=True))
    names = {i.name for i in module.entry.instructions}
    assert not names & {"two", "g0", "g1"}
