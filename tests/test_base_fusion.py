"""Base fusion (XLA-GPU-like kernels of pre-optimization HLO): hand-made graphs for each
rule, and structural properties of the result on every zoo fixture."""
from __future__ import annotations

import pytest

from stitch.hlo import parse_hlo
from stitch.hlo.base_fusion import base_fusion
from stitch.hlo.graph import OpGraph, build_op_graphs
from stitch.hlo.kernels import count_kernels
from stitch.hlo.op_classes import OpClass, is_kernel_boundary
from tests.fixtures import DATA, fixture_id, tf_fixture_files, zoo_fixture_files

ADD = """add_f32 {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT s = f32[] add(x, y)
}
"""


def _graph(entry: str, wrap: bool = True) -> OpGraph:
    body = "ENTRY main {\n" + entry if wrap else entry
    (g,) = build_op_graphs(parse_hlo("HloModule m\n" + ADD + body + "}\n"))
    return g


def _named(g: OpGraph, groups: list[list[int]]) -> list[set[str]]:
    """Groups by the names of their non-free ops."""
    return [{g.nodes[i].name for i in grp if not g.is_free(i)} for grp in groups]


def _holding(g: OpGraph, groups: list[list[int]], name: str) -> list[int]:
    nid = g.node(name).id
    return [k for k, grp in enumerate(groups) if nid in grp]


# --- the rules on hand-made graphs -------------------------------------------------------

def test_elementwise_chain_is_one_group():
    g = _graph("""
  p = f32[64,32] parameter(0)
  e = f32[64,32] exponential(p)
  n = f32[64,32] negate(e)
  r = f32[32,64] transpose(n), dimensions={1,0}
  b = f32[2048] reshape(r)
  ROOT a = f32[2048] abs(b)
""")
    groups = base_fusion(g)
    assert len(groups) == 1 and len(groups[0]) == 5      # the reshape is a bitcast: free
    assert _named(g, groups) == [{"e", "n", "r", "a"}]


def test_reduction_is_a_root_and_its_consumer_another_kernel():
    g = _graph("""
  p = f32[64,32] parameter(0)
  z = f32[] constant(0)
  m = f32[64,32] multiply(p, p)
  r = f32[64] reduce(m, z), dimensions={1}, to_apply=add_f32
  ROOT s = f32[64] sqrt(r)
""")
    groups = base_fusion(g)
    assert _named(g, groups) == [{"m", "r"}, {"s"}]     # the producer fuses into the input


def test_cheap_producer_is_duplicated_into_both_reductions():
    g = _graph("""
  p = f32[64,32] parameter(0)
  z = f32[] constant(0)
  c = f32[] constant(2)
  cb = f32[64,32] broadcast(c), dimensions={}
  m = f32[64,32] multiply(p, cb)
  rows = f32[64] reduce(m, z), dimensions={1}, to_apply=add_f32
  cols = f32[32] reduce(m, z), dimensions={0}, to_apply=add_f32
  ROOT t = (f32[64], f32[32]) tuple(rows, cols)
""")
    groups = base_fusion(g)
    assert sorted(map(sorted, _named(g, groups))) == [["cb", "cols", "m"], ["cb", "m", "rows"]]
    assert len(_holding(g, groups, "m")) == 2


def test_binary_producer_of_two_arrays_is_not_duplicated():
    # Recomputing it in both reductions would read p and q twice: XLA keeps one copy.
    g = _graph("""
  p = f32[64,32] parameter(0)
  q = f32[64,32] parameter(1)
  z = f32[] constant(0)
  m = f32[64,32] multiply(p, q)
  rows = f32[64] reduce(m, z), dimensions={1}, to_apply=add_f32
  cols = f32[32] reduce(m, z), dimensions={0}, to_apply=add_f32
  ROOT t = (f32[64], f32[32]) tuple(rows, cols)
""")
    groups = base_fusion(g)
    assert len(_holding(g, groups, "m")) == 1
    assert len(groups) == 2          # m is written by one reduction kernel (multi-output)


def test_expensive_producer_with_two_users_is_not_duplicated():
    g = _graph("""
  p = f32[64,32] parameter(0)
  z = f32[] constant(0)
  e = f32[64,32] exponential(p)
  r = f32[64] reduce(e, z), dimensions={1}, to_apply=add_f32
  rb = f32[64,32] broadcast(r), dimensions={0}
  ROOT d = f32[64,32] divide(e, rb)
""")
    groups = base_fusion(g)
    assert len(_holding(g, groups, "e")) == 1
    # exp is written once by the reduction kernel (producer-consumer multi-output fusion)
    # and read back by the normalization: softmax's 2 kernels after its max.
    assert _named(g, groups) == [{"e", "r"}, {"rb", "d"}]


def test_expensive_producer_is_not_fused_through_a_broadcast():
    g = _graph("""
  p = f32[64] parameter(0)
  q = f32[64,32] parameter(1)
  s = f32[64] rsqrt(p)
  b = f32[64,32] broadcast(s), dimensions={0}
  ROOT m = f32[64,32] multiply(q, b)
""")
    assert _named(g, base_fusion(g)) == [{"s"}, {"b", "m"}]


def test_dot_is_a_singleton_boundary():
    g = _graph("""
  p = f32[64,32] parameter(0)
  w = f32[32,16] parameter(1)
  n = f32[64,32] negate(p)
  d = f32[64,16] dot(n, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT e = f32[64,16] exponential(d)
""")
    groups = base_fusion(g)
    assert _named(g, groups) == [{"n"}, {"d"}, {"e"}]
    assert groups[1] == [g.node("d").id]


def test_sibling_loop_fusions_reading_one_parameter_merge():
    g = _graph("""
  p = f32[64,32] parameter(0)
  n = f32[64,32] negate(p)
  e = f32[64,32] exponential(p)
  q = f32[2048] parameter(1)
  a = f32[2048] abs(q)
  ROOT t = (f32[64,32], f32[64,32], f32[2048]) tuple(n, e, a)
""")
    groups = base_fusion(g)
    assert sorted(map(sorted, _named(g, groups))) == [["a"], ["e", "n"]]


def test_siblings_of_different_sizes_do_not_merge():
    g = _graph("""
  p = f32[64,32] parameter(0)
  n = f32[64,32] negate(p)
  s = f32[64,16] slice(p), slice={[0:64], [0:16]}
  ROOT t = (f32[64,32], f32[64,16]) tuple(n, s)
""")
    assert len(base_fusion(g)) == 2


def test_sibling_merge_that_would_close_a_cycle_is_rejected():
    # a and b both read p, but b also reads a through the GEMM: one kernel for a and b
    # would have to wait for the GEMM that waits for it.
    g = _graph("""
  p = f32[64,64] parameter(0)
  w = f32[64,64] parameter(1)
  a = f32[64,64] negate(p)
  d = f32[64,64] dot(a, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  b = f32[64,64] add(p, d)
  ROOT t = (f32[64,64], f32[64,64]) tuple(a, b)
""")
    for strict in (False, True):
        assert _named(g, base_fusion(g, strict_convex=strict)) == [{"a"}, {"d"}, {"b"}]


def test_reduction_result_is_not_consumed_in_its_own_kernel():
    # The loop reads p (as the reduction does) and the reduction's result: no merge.
    g = _graph("""
  p = f32[64,32] parameter(0)
  z = f32[] constant(0)
  r = f32[64] reduce(p, z), dimensions={1}, to_apply=add_f32
  rb = f32[64,32] broadcast(r), dimensions={0}
  ROOT s = f32[64,32] subtract(p, rb)
""")
    assert _named(g, base_fusion(g)) == [{"r"}, {"rb", "s"}]


def test_recomputation_across_a_reduction_needs_relaxed_convexity():
    # layer norm's centering: x - mean feeds the variance and the output. XLA recomputes
    # it in both kernels; the copy in the output kernel has a path out (through the
    # variance) and back in, which OpGraph.is_convex (the default) refuses.
    g = _graph("""
  x = f32[64,32] parameter(0)
  z = f32[] constant(0)
  s = f32[64] reduce(x, z), dimensions={1}, to_apply=add_f32
  sb = f32[64,32] broadcast(s), dimensions={0}
  c = f32[64,32] subtract(x, sb)
  sq = f32[64,32] multiply(c, c)
  v = f32[64] reduce(sq, z), dimensions={1}, to_apply=add_f32
  vb = f32[64,32] broadcast(v), dimensions={0}
  ROOT o = f32[64,32] multiply(c, vb)
""")
    relaxed = base_fusion(g, strict_convex=False)
    assert _named(g, relaxed) == [{"s"}, {"sb", "c", "sq", "v"}, {"sb", "c", "vb", "o"}]
    assert not g.is_convex(relaxed[2]) and _recompute_convex(g, relaxed)
    strict = base_fusion(g)
    assert all(g.is_convex(grp) for grp in strict)
    # c is computed once, by the variance kernel, which also writes it for the output.
    assert _named(g, strict) == [{"s"}, {"sb", "c", "sq", "v"}, {"vb", "o"}]


SOFTMAX = """
  x = f32[64,128] parameter(0)
  ninf = f32[] constant(-inf)
  z = f32[] constant(0)
  m = f32[64] reduce(x, ninf), dimensions={1}, to_apply=max_f32
  mb = f32[64,128] broadcast(m), dimensions={0}
  c = f32[64,128] subtract(x, mb)
  e = f32[64,128] exponential(c)
  s = f32[64] reduce(e, z), dimensions={1}, to_apply=add_f32
  sb = f32[64,128] broadcast(s), dimensions={0}
  ROOT d = f32[64,128] divide(e, sb)
"""
MAX = """max_f32 {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT m = f32[] maximum(x, y)
}
"""


def test_softmax_is_three_kernels_or_one_row_kernel():
    g = _graph(MAX + "ENTRY softmax {" + SOFTMAX, wrap=False)
    classic = base_fusion(g)
    assert _named(g, classic) == [{"m"}, {"mb", "c", "e", "s"}, {"sb", "d"}]
    assert _named(g, base_fusion(g, row_fusion=True)) == [
        {"m", "mb", "c", "e", "s", "sb", "d"}]


def test_row_fusion_needs_a_minor_dimension_reduction():
    # The same softmax over columns (dimension 0 is not the minor one): no row kernel.
    text = (SOFTMAX.replace("f32[64]", "f32[128]").replace("dimensions={1}", "dimensions={0}")
            .replace("dimensions={0}\n", "dimensions={1}\n"))
    g = _graph(MAX + "ENTRY softmax {" + text, wrap=False)
    assert g.node("mb").instruction.ints("dimensions") == (1,)
    assert len(base_fusion(g, row_fusion=True)) == 3


def test_free_ops_join_groups_and_never_stand_alone():
    g = _graph("""
  p = f32[64,32] parameter(0)
  b = f32[2048] bitcast(p)
  n = f32[2048] negate(b)
  nb = f32[64,32] reshape(n)
  ROOT t = (f32[64,32], f32[2048]) tuple(nb, b)
""")
    # b joins the kernel reading it; nb, a view of the kernel's output, needs no kernel.
    groups = base_fusion(g)
    assert groups == [[g.node("b").id, g.node("n").id]]


# --- properties on every fixture ---------------------------------------------------------

def _external_producers(g: OpGraph, v: int) -> set[int]:
    """Non-free ops whose values reach v through free ops only (v itself if non-free)."""
    found, stack, seen = set(), [v], {v}
    while stack:
        x = stack.pop()
        if not g.is_free(x):
            found.add(x)
            continue
        for o in g.nodes[x].operands:
            if o not in seen:
                seen.add(o)
                stack.append(o)
    return found


def _recompute_convex(g: OpGraph, groups: list[list[int]]) -> bool:
    """No path from a value a group writes comes back into it. A group writes a member
    when some reader of it sits in no group that recomputes the member itself; a free
    member (a bitcast) passes on the value of its producer, written only if computed here."""
    holders: dict[int, set[int]] = {}
    for k, grp in enumerate(groups):
        for m in grp:
            holders.setdefault(m, set()).add(k)

    def written(m: int, u: int, members: set[int]) -> bool:
        sources = _external_producers(g, m) & members if g.is_free(m) else {m}
        return any(not holders.get(u, set()) & holders[p] for p in sources)

    for k, grp in enumerate(groups):
        members = set(grp)
        last = max(members)
        stack = [u for m in members for u in g.nodes[m].users
                 if u not in members and written(m, u, members)]
        seen = set(stack)
        while stack:
            x = stack.pop()
            if x in members:
                return False
            for u in g.nodes[x].users:
                if u <= last and u not in seen:
                    seen.add(u)
                    stack.append(u)
    return True


def _check_groups(g: OpGraph, groups: list[list[int]], strict: bool) -> None:
    where = g.name
    position: dict[int, list[int]] = {}
    for k, grp in enumerate(groups):
        assert grp and len(set(grp)) == len(grp), where
        assert not all(g.is_free(i) for i in grp), f"{where}: group of free ops only"
        classes = {g.nodes[i].op_class for i in grp}
        if any(is_kernel_boundary(c) for c in classes):
            assert len(grp) == 1, f"{where}: GEMM/opaque op grouped with others"
        assert all(g.nodes[i].op_class is not OpClass.SOURCE for i in grp), where
        for i in grp:
            position.setdefault(i, []).append(k)
    non_free = {n.id for n in g.nodes if not g.is_free(n.id)}
    assert non_free <= set(position), f"{where}: ops in no group"
    for k, grp in enumerate(groups):
        members = set(grp)
        for m in grp:
            for o in g.nodes[m].operands:
                if o in members:
                    continue
                for p in _external_producers(g, o):
                    assert p not in members or g.is_free(o), where
                    assert all(j < k for j in position[p]), \
                        f"{where}: group {k} launched before a producer of {g.nodes[p].name}"
    if strict:
        assert all(g.is_convex(grp) for grp in groups), where
    else:
        assert _recompute_convex(g, groups), where


PRE = [p for p in zoo_fixture_files() if p.name.endswith(".pre.hlo")]


@pytest.mark.parametrize("path", PRE + [p for p in tf_fixture_files() if p.suffix == ".hlo"],
                         ids=fixture_id)
def test_groups_are_valid_kernels_on_fixtures(path):
    graphs = build_op_graphs(parse_hlo(path.read_text()))
    for g in graphs:
        for strict in (False, True):
            for rows in (False, True):
                groups = base_fusion(g, strict_convex=strict, row_fusion=rows)
                _check_groups(g, groups, strict)


@pytest.mark.parametrize("model, target", [
    (m, "v100") for m in ("softmax", "layer_norm", "layer_norm_nonminor", "bias_gelu",
                          "column_reduce_broadcast", "attention_bert_base")] + [
    (m, "h100") for m in ("softmax", "layer_norm", "bias_gelu", "attention_bert_base")])
def test_small_models_match_xla(model, target):
    """Where XLA only fuses (no layout or GEMM rewrites), the memory-intensive kernels
    match XLA's: the classic pipeline on V100, with row kernels (Triton) on H100."""
    graphs = build_op_graphs(parse_hlo((DATA / model / "full.pre.hlo").read_text()))
    ours = sum(1 for g in graphs for grp in base_fusion(g, row_fusion=target == "h100")
               if not any(is_kernel_boundary(g.nodes[i].op_class) for i in grp))
    xla = count_kernels(parse_hlo((DATA / model / f"full.gpu-{target}.hlo").read_text()))
    assert ours == xla.count("memory")
