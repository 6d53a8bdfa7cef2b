"""stitch.xla_pass.snap: planned kernels cut to XLA's fusions before the rewrite. A kernel that
holds part of an XLA fusion is widened to the whole fusion; where that is not convex it is
narrowed to the fusions it holds whole (before, it was left to XLA)."""
from __future__ import annotations

from dataclasses import dataclass

from stitch.hlo import parse_hlo
from stitch.hlo.graph import build_op_graphs
from stitch.xla_pass.hlo_rewrite import ComputationView, find_site
from stitch.xla_pass.snap import snap_kernels
from stitch.cost.gpu_specs import get_spec

# K = {A, B, c1}: widening to all of C adds c2, which reads D, which reads A: not convex.
MODULE = """HloModule m
fa {
  p = f32[64,128] parameter(0)
  ROOT a = f32[64,128] exponential(p)
}
fb {
  q = f32[64,128] parameter(0)
  ROOT b = f32[64,128] negate(q)
}
fd {
  r = f32[64,128] parameter(0)
  ROOT d = f32[64,128] sqrt(r)
}
fc {
  s0 = f32[64,128] parameter(0)
  s1 = f32[64,128] parameter(1)
  c1 = f32[64,128] tanh(s0)
  ROOT c2 = f32[64,128] add(c1, s1)
}
ENTRY e {
  x = f32[64,128] parameter(0)
  A = f32[64,128] fusion(x), kind=kLoop, calls=fa
  B = f32[64,128] fusion(A), kind=kLoop, calls=fb
  D = f32[64,128] fusion(A), kind=kLoop, calls=fd
  ROOT C = f32[64,128] fusion(B, D), kind=kLoop, calls=fc
}"""


@dataclass
class _Planned:
    name: str
    members: frozenset
    schedule: object = None


def test_a_kernel_whose_widening_is_not_convex_is_narrowed_to_its_whole_fusions():
    module = parse_hlo(MODULE)
    graph = build_op_graphs(module)[0]
    view = ComputationView(module, graph)
    node = {n.instruction.name: n.id for n in graph.nodes}
    planned = _Planned("k", frozenset({node["a"], node["b"], node["c1"]}))
    snapped, skipped = snap_kernels(view, [planned], get_spec("h100"))
    assert not skipped, skipped
    (kernel,) = snapped
    ops = {graph.nodes[m].name for m in kernel.members}
    assert {"a", "b"} <= ops and not ops & {"c1", "c2", "d"}
    assert kernel.schedule is not None
    site = find_site(view, 0, kernel.name, kernel.members)
    assert site.tops == ("A", "B")


def test_a_kernel_holding_no_two_fusions_whole_is_still_left_to_xla():
    module = parse_hlo(MODULE)
    graph = build_op_graphs(module)[0]
    view = ComputationView(module, graph)
    node = {n.instruction.name: n.id for n in graph.nodes}
    planned = _Planned("k", frozenset({node["a"], node["c1"]}))
    snapped, skipped = snap_kernels(view, [planned], get_spec("h100"))
    assert not snapped
    assert skipped and "not convex" in skipped[0][1]
