"""Op classes and canonicalization into op graphs: hand-made HLO for each rewrite, and
structural invariants on every zoo fixture (plus XLA's kernel count as the baseline check)."""
from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from stitch.hlo import Instruction, Shape, parse_hlo
from stitch.hlo.graph import OpGraph, build_op_graphs
from stitch.hlo.ir import Computation, HloModule
from stitch.hlo.kernels import FREE_OPS, count_kernels
from stitch.hlo.op_classes import OpClass, classify, classify_with, is_kernel_boundary
from tests.fixtures import fixture_id, tf_fixture_files, zoo_fixture_files


def _graphs(text: str) -> list[OpGraph]:
    return build_op_graphs(parse_hlo(text))


def _names(graph: OpGraph, ids) -> list[str]:
    return [graph.nodes[i].name for i in ids]


# --- op classes --------------------------------------------------------------------------

def _inst(opcode: str, **attrs: str) -> Instruction:
    return Instruction("x", Shape("f32", (4,)), opcode, attrs=dict(attrs))


@pytest.mark.parametrize("opcode, expected", [
    ("add", OpClass.LIGHT), ("select", OpClass.LIGHT), ("convert", OpClass.LIGHT),
    ("shift-left", OpClass.LIGHT), ("round-nearest-even", OpClass.LIGHT),
    ("divide", OpClass.EXPENSIVE), ("rsqrt", OpClass.EXPENSIVE), ("tanh", OpClass.EXPENSIVE),
    ("exponential-minus-one", OpClass.EXPENSIVE), ("atan2", OpClass.EXPENSIVE),
    ("reduce", OpClass.REDUCTION), ("reduce-window", OpClass.REDUCTION),
    ("broadcast", OpClass.LAYOUT), ("bitcast", OpClass.LAYOUT), ("gather", OpClass.LAYOUT),
    ("dynamic-update-slice", OpClass.LAYOUT), ("iota", OpClass.LAYOUT),
    ("dot", OpClass.COMPUTE), ("convolution", OpClass.COMPUTE),
    ("sort", OpClass.OPAQUE), ("scatter", OpClass.LAYOUT), ("rng-bit-generator", OpClass.OPAQUE),
    ("while", OpClass.OPAQUE), ("conditional", OpClass.OPAQUE), ("all-reduce", OpClass.OPAQUE),
    ("select-and-scatter", OpClass.OPAQUE), ("fft", OpClass.OPAQUE),
    ("some-future-op", OpClass.OPAQUE),
    ("parameter", OpClass.SOURCE), ("constant", OpClass.SOURCE),
])
def test_classify_opcodes(opcode, expected):
    assert classify(_inst(opcode)) is expected
    assert is_kernel_boundary(expected) == (expected in (OpClass.COMPUTE, OpClass.OPAQUE))


def test_classify_custom_calls_and_fusions():
    for target, expected in (("__cublas$lt$matmul", OpClass.COMPUTE),
                             ("__cudnn$convForward", OpClass.COMPUTE),
                             ("my_kernel", OpClass.OPAQUE)):
        assert classify(_inst("custom-call", custom_call_target=f'"{target}"')) is expected
    for kind in ("__triton_gemm", "__triton_nested_gemm_fusion", "__cublas", "__cudnn$fmha"):
        cfg = '{"fusion_backend_config":{"kind":"%s"}}' % kind
        assert classify(_inst("fusion", kind="kCustom", backend_config=cfg)) is OpClass.COMPUTE
    module = parse_hlo(FUSIONS_BY_CONTENT)
    entry = module.entry.by_name()
    assert classify(entry["wrapped"], module) is OpClass.COMPUTE      # kLoop around a dot
    assert classify(entry["norm"], module) is OpClass.REDUCTION       # strongest op inside
    assert classify(entry["act"], module) is OpClass.EXPENSIVE


FUSIONS_BY_CONTENT = """HloModule m
wrapped_dot {
  a = f32[4,8] parameter(0)
  b = f32[8,8] parameter(1)
  ROOT d = f32[4,8] dot(a, b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
add_f32 {
  x = f32[] parameter(0)
  y = f32[] parameter(1)
  ROOT s = f32[] add(x, y)
}
row_sum {
  a = f32[4,8] parameter(0)
  z = f32[] constant(0)
  e = f32[4,8] exponential(a)
  ROOT r = f32[4] reduce(e, z), dimensions={1}, to_apply=add_f32
}
act {
  a = f32[4,8] parameter(0)
  ROOT t = f32[4,8] tanh(a)
}
ENTRY main {
  p = f32[4,8] parameter(0)
  w = f32[8,8] parameter(1)
  wrapped = f32[4,8] fusion(p, w), kind=kLoop, calls=wrapped_dot
  norm = f32[4] fusion(wrapped), kind=kInput, calls=row_sum
  act = f32[4,8] fusion(wrapped), kind=kLoop, calls=act
  ROOT out = (f32[4], f32[4,8]) tuple(norm, act)
}
"""


def test_compute_fusions_stay_one_node():
    (g,) = _graphs(FUSIONS_BY_CONTENT)
    wrapped = g.node("wrapped")
    assert (wrapped.opcode, wrapped.op_class) == ("fusion", OpClass.COMPUTE)
    norm = [n.opcode for n in g.nodes if n.xla_group == "norm"]
    assert norm == ["constant", "exponential", "reduce"]
    assert g.node("e").operands == [wrapped.id]
    assert _names(g, g.outputs) == ["r", "t"]
    groups = g.baseline_groups()
    assert {k: _names(g, v) for k, v in groups.items()} == {
        "wrapped": ["wrapped"], "norm": ["e", "r"], "act": ["t"]}


# --- canonicalization on hand-made HLO ---------------------------------------------------

CALL = """HloModule m
callee {
  a = f32[4] parameter(0)
  b = f32[4] parameter(1)
  add.1 = f32[4] add(a, b)
  ROOT exp.1 = f32[4] exponential(add.1)
}
ENTRY main {
  p0 = f32[4] parameter(0)
  p1 = f32[4] parameter(1)
  add.1 = f32[4] multiply(p0, p1)
  c = f32[4] call(add.1, p1), to_apply=callee
  c2 = f32[4] call(c, c), to_apply=callee
  ROOT neg = f32[4] negate(c2)
}
"""


def test_call_is_inlined():
    (g,) = _graphs(CALL)
    assert [n.opcode for n in g.nodes] == ["parameter", "parameter", "multiply", "add",
                                           "exponential", "add", "exponential", "negate"]
    # Inner names yield to the graph's own names, then to earlier inlined copies.
    inner_add = g.node("c/add.1")
    assert g.nodes[inner_add.operands[0]].name == "add.1"        # the multiply
    assert _names(g, inner_add.operands) == ["add.1", "p1"]
    assert g.node("c2/add.1").operands == [g.node("exp.1").id] * 2
    assert g.node("c2/exp.1").users == [g.node("neg").id]
    assert g.node("exp.1").users == [g.node("c2/add.1").id]       # distinct users
    assert _names(g, g.inputs) == ["p0", "p1"] and _names(g, g.outputs) == ["neg"]
    assert all(n.xla_group is None for n in g.nodes)
    assert g.node("c/add.1").computation == "callee"


MULTI_OUTPUT = """HloModule m
fused {
  p = f32[8] parameter(0)
  q = f32[8] parameter(1)
  e = f32[8] exponential(p)
  n = f32[8] negate(e)
  ROOT t = (f32[8], f32[8], f32[8]) tuple(e, n, q)
}
ENTRY main {
  x = f32[8] parameter(0)
  y = f32[8] parameter(1)
  f = (f32[8], f32[8], f32[8]) fusion(x, y), kind=kLoop, calls=fused
  g0 = f32[8] get-tuple-element(f), index=0
  g1 = f32[8] get-tuple-element(f), index=1
  g2 = f32[8] get-tuple-element(f), index=2
  r = f32[8] add(g0, g1)
  s = f32[8] multiply(r, g2)
  ROOT out = (f32[8], f32[8]) tuple(s, g1)
}
"""


def test_multi_output_fusion_gtes_resolve_to_producers():
    (g,) = _graphs(MULTI_OUTPUT)
    assert not any(n.opcode in ("tuple", "get-tuple-element") for n in g.nodes)
    assert _names(g, g.node("r").operands) == ["e", "n"]
    assert _names(g, g.node("s").operands) == ["r", "y"]      # forwarded fusion parameter
    assert _names(g, g.outputs) == ["s", "n"]
    assert g.node("e").xla_group == g.node("n").xla_group == "f"
    groups = {k: _names(g, v) for k, v in g.baseline_groups().items()}
    assert groups == {"f": ["e", "n"], "r": ["r"], "s": ["s"]}


NESTED = """HloModule m
inner {
  a = f32[8] parameter(0)
  ROOT m = f32[8] multiply(a, a)
}
outer {
  p = f32[8] parameter(0)
  q = f32[8] parameter(1)
  nf = f32[8] fusion(p), kind=kLoop, calls=inner
  ROOT s = f32[8] subtract(nf, q)
}
ENTRY main {
  x = f32[8] parameter(0)
  y = f32[8] parameter(1)
  m = f32[8] fusion(x, y), kind=kLoop, calls=outer
  ROOT r = f32[8] sqrt(m)
}
"""


def test_nested_fusion_flattens_into_the_outer_group():
    (g,) = _graphs(NESTED)
    assert [(n.name, n.opcode, n.xla_group) for n in g.nodes] == [
        ("x", "parameter", None), ("y", "parameter", None), ("m/nf/m", "multiply", "m"),
        ("s", "subtract", "m"), ("r", "sqrt", None)]
    assert g.nodes[2].operands == [0, 0] and g.nodes[0].users == [2]
    assert g.nodes[2].computation == "inner"
    assert _names(g, g.baseline_groups()["m"]) == ["m/nf/m", "s"]


WHILE = """HloModule m
body {
  st = (s32[], f32[4]) parameter(0)
  i = s32[] get-tuple-element(st), index=0
  v = f32[4] get-tuple-element(st), index=1
  one = s32[] constant(1)
  i2 = s32[] add(i, one)
  v2 = f32[4] exponential(v)
  ROOT t = (s32[], f32[4]) tuple(i2, v2)
}
cond {
  st = (s32[], f32[4]) parameter(0)
  i = s32[] get-tuple-element(st), index=0
  n = s32[] constant(5)
  ROOT lt = pred[] compare(i, n), direction=LT
}
ENTRY main {
  x = f32[4] parameter(0)
  z = s32[] constant(0)
  init = (s32[], f32[4]) tuple(z, x)
  w = (s32[], f32[4]) while(init), condition=cond, body=body,
    backend_config={"known_trip_count":{"n":"5"}}
  r = f32[4] get-tuple-element(w), index=1
  ROOT out = f32[4] negate(r)
}
"""


def test_while_loop_gets_body_and_condition_graphs():
    entry, body, cond = _graphs(WHILE)
    assert (entry.kind, body.kind, cond.kind) == ("entry", "while-body", "while-cond")
    w = entry.node("w")
    assert (w.op_class, w.subgraphs) == (OpClass.OPAQUE, [1, 2])
    assert _names(entry, w.operands) == ["z", "x"]
    r = entry.node("r")                                        # gte of a while stays
    assert (r.opcode, r.operands, r.op_class) == ("get-tuple-element", [w.id], OpClass.LAYOUT)
    assert entry.trip_count is None
    assert body.name == "body" and body.trip_count == 5 and cond.trip_count == 5
    assert _names(body, body.inputs) == ["st{0}", "st{1}"]
    assert [body.nodes[i].index for i in body.inputs] == [(0,), (1,)]
    assert _names(body, body.outputs) == ["i2", "v2"]
    assert _names(body, body.node("i2").operands) == ["st{0}", "one"]
    assert _names(cond, cond.outputs) == ["lt"]
    assert not any(n.opcode in ("tuple", "get-tuple-element") for n in body.nodes + cond.nodes)


CONDITIONAL = """HloModule m
br0 {
  a = f32[4] parameter(0)
  ROOT n = f32[4] negate(a)
}
br1 {
  a = f32[4] parameter(0)
  ROOT e = f32[4] exponential(a)
}
ENTRY main {
  k = s32[] parameter(0)
  x = f32[4] parameter(1)
  ROOT c = f32[4] conditional(k, x, x), branch_computations={br0, br1}
}
"""


def test_conditional_branches_are_graphs():
    entry, b0, b1 = _graphs(CONDITIONAL)
    assert entry.node("c").subgraphs == [1, 2]
    assert (b0.kind, b0.name, b1.name) == ("branch", "br0", "br1")
    assert _names(b1, b1.outputs) == ["e"]


DIAMOND = """HloModule m
ENTRY main {
  p = f32[4] parameter(0)
  a = f32[4] exponential(p)
  b = f32[4] negate(a)
  c = f32[4] abs(a)
  ROOT d = f32[4] add(b, c)
}
"""


def test_convexity_of_a_diamond():
    (g,) = _graphs(DIAMOND)
    a, b, c, d = (g.node(n).id for n in "abcd")
    assert not g.is_convex({a, d})
    assert not g.is_convex({a, b, d})
    assert g.is_convex({a, b, c, d}) and g.is_convex({a, b}) and g.is_convex({b, c, d})
    assert g.is_convex(set()) and g.is_convex({c})


def test_convexity_matches_brute_force_on_random_dags():
    rng = random.Random(7)
    for trial in range(6):
        n = 10
        lines = ["p0 = f32[2] parameter(0)"]
        for i in range(1, n):
            j, k = rng.randrange(i), rng.randrange(i)
            lines.append(f"n{i} = f32[2] add({'p0' if j == 0 else f'n{j}'}, "
                         f"{'p0' if k == 0 else f'n{k}'})")
        lines[-1] = "ROOT " + lines[-1]
        (g,) = _graphs("HloModule r\nENTRY main {\n" + "\n".join(lines) + "\n}\n")
        reach = [set() for _ in g.nodes]          # reach[i]: nodes reachable from i
        for node in reversed(g.nodes):
            for u in node.users:
                reach[node.id] |= {u} | reach[u]
        ids = range(len(g.nodes))
        for size in (2, 3, 4):
            for subset in rng.sample(list(itertools.combinations(ids, size)), 25):
                s = set(subset)
                brute = not any(x not in s and any(x in reach[m] for m in s) and reach[x] & s
                                for x in ids)
                assert g.is_convex(s) == brute, (trial, subset)



def test_searched_convexity_matches_brute_force_on_random_dags(monkeypatch):
    """Without bitmasks ``is_convex`` searches from both ends of the set; on random DAGs
    with far edges (a forward value read by a backward) its answer is the brute force's."""
    import stitch.hlo.graph as graph_module
    monkeypatch.setattr(graph_module, "REACHABILITY_MAX_NODES", -1)
    rng = random.Random(11)
    for trial in range(4):
        n = 40
        lines = ["p0 = f32[2] parameter(0)"]
        for i in range(1, n):
            picks = [max(0, i - rng.randint(1, 3)) if rng.random() < 0.8 else rng.randrange(i)
                     for _ in range(2)]
            args = ", ".join("p0" if j == 0 else f"n{j}" for j in picks)
            lines.append(f"n{i} = f32[2] add({args})")
        lines[-1] = "ROOT " + lines[-1]
        (g,) = _graphs("HloModule r\nENTRY main {\n" + "\n".join(lines) + "\n}\n")
        reach = [set() for _ in g.nodes]
        for node in reversed(g.nodes):
            for u in node.users:
                reach[node.id] |= {u} | reach[u]
        answers = []
        for _ in range(150):
            start = rng.randrange(n)
            s = {min(n - 1, start + rng.randint(0, 8)) for _ in range(rng.randint(2, 5))}
            if rng.random() < 0.3:
                s.add(rng.randrange(n))
            brute = not any(x not in s and any(x in reach[m] for m in s) and reach[x] & s
                            for x in range(n))
            assert g.is_convex(s) == brute, (trial, sorted(s))
            answers.append(brute)
        assert g.unit_reachability() is None
        assert any(answers) and not all(answers)


CHAIN = """HloModule m
ENTRY main {
  p = f32[4] parameter(0)
  e = f32[4] exponential(p)
  n = f32[4] negate(e)
  a = f32[4] abs(n)
  h = f16[4] convert(a)
  ROOT out = (f16[4], f32[4]) tuple(h, e)
}
"""


def test_hbm_bytes_of_a_chain():
    (g,) = _graphs(CHAIN)
    p, e, n, a, h = (g.node(x).id for x in "penah")
    assert g.hbm_bytes({e}) == 16 + 16                 # read p, write e (output)
    assert g.hbm_bytes({n, a}) == 16 + 16              # read e, write a (used by h)
    assert g.hbm_bytes({e, n, a, h}) == 16 + 16 + 8    # read p; write e (output) and h
    assert g.hbm_bytes({a, h}) == 16 + 8
    assert g.hbm_bytes({p, e}) == 16 + 16              # a SOURCE member is still read
    assert g.hbm_bytes(set()) == 0


def test_hbm_bytes_gte_reads_only_its_element():
    entry = _graphs(WHILE)[0]
    r, out = entry.node("r").id, entry.node("out").id
    assert entry.hbm_bytes({r, out}) == 16 + 16


# --- invariants on every fixture ---------------------------------------------------------

FORWARDING = ("parameter", "tuple", "get-tuple-element")


def _expected_nodes(comp: Computation, comps: dict[str, Computation], cache: dict,
                    out: Counter) -> None:
    """Every instruction that must be a node of the graph of ``comp`` (by identity, with
    multiplicity): calls and non-GEMM fusions (nested too) are expanded."""
    for inst in comp.instructions:
        if inst.opcode in FORWARDING:
            continue
        if inst.opcode == "call" or (inst.opcode == "fusion" and classify_with(
                inst, comps.__getitem__, cache) is not OpClass.COMPUTE):
            _expected_nodes(comps[inst.called_computations[0]], comps, cache, out)
        else:
            out[id(inst)] += 1


def _launching_groups(g: OpGraph) -> list[list[int]]:
    """Baseline groups that launch a kernel (not bitcasts, gtes of loops, loops themselves)."""
    return [ids for key, ids in g.baseline_groups().items()
            if g.nodes[ids[0]].xla_group is not None
            or g.nodes[ids[0]].opcode not in FREE_OPS | {"while", "conditional"}]


def _check_structure(module: HloModule, graphs: list[OpGraph]) -> None:
    comps = {c.name: c for c in module.computations}
    cache: dict = {}
    assert graphs[0].kind == "entry" and graphs[0].name == module.entry.name
    for g in graphs:
        where = f"{module.name}/{g.name}"
        assert [n.id for n in g.nodes] == list(range(len(g.nodes))), where
        assert len({n.name for n in g.nodes}) == len(g.nodes), f"{where}: duplicate names"
        for n in g.nodes:
            assert all(o < n.id for o in n.operands), f"{where}: {n.name} not topological"
            assert n.users == sorted(set(n.users)), where
            for o in n.operands:
                assert n.id in g.nodes[o].users, f"{where}: {n.name} missing from users"
            for u in n.users:
                assert n.id in g.nodes[u].operands, f"{where}: stray user of {n.name}"
            if n.opcode == "get-tuple-element":
                assert g.nodes[n.operands[0]].shape.is_tuple, f"{where}: {n.name} not resolved"
            if n.opcode in ("while", "conditional"):
                assert n.subgraphs and all(0 < s < len(graphs) for s in n.subgraphs), where
        assert g.outputs and all(0 <= o < len(g.nodes) for o in g.outputs), where
        assert all(g.nodes[i].opcode == "parameter" for i in g.inputs), where
        comp = comps[g.name]
        params = [leaf for p in comp.parameters for leaf in p.shape.leaves()]
        assert len(g.inputs) == len(params), where
        expected: Counter = Counter()
        _expected_nodes(comp, comps, cache, expected)
        actual = Counter(id(n.instruction) for n in g.nodes if n.opcode not in FORWARDING)
        assert actual == expected, f"{where}: nodes differ from the instructions"


def _inlined(comp: Computation, comps: dict[str, Computation]) -> Counter:
    """Computations whose ops land in ``comp``'s graph (calls inlined), with multiplicity."""
    found = Counter({comp.name: 1})
    for inst in comp.instructions:
        if inst.opcode == "call":
            found += _inlined(comps[inst.called_computations[0]], comps)
    return found


def _group_category(g: OpGraph, ids: list[int]) -> str:
    classes = {g.nodes[i].op_class for i in ids}
    return ("gemm" if OpClass.COMPUTE in classes else
            "opaque" if OpClass.OPAQUE in classes else "memory")


def _check_xla_kernels(module: HloModule, graphs: list[OpGraph]) -> None:
    """Each graph's baseline groups are exactly the kernels XLA launches for the
    computations inlined into it, category by category (memory / gemm / opaque)."""
    comps = {c.name: c for c in module.computations}
    per_comp: dict[str, Counter] = {}
    for k in count_kernels(module).kernels:
        per_comp.setdefault(k.computation, Counter())[k.category] += 1
    for g in graphs:
        expected: Counter = Counter()
        for c, times in _inlined(comps[g.name], comps).items():
            for category, n in per_comp.get(c, Counter()).items():
                expected[category] += n * times
        found = Counter(_group_category(g, ids) for ids in _launching_groups(g))
        assert found == expected, f"{module.name}/{g.name}"


ZOO = zoo_fixture_files()


@pytest.mark.parametrize("path", ZOO + tf_fixture_files(), ids=fixture_id)
def test_fixture_graph_invariants(path):
    module = parse_hlo(path.read_text())
    graphs = build_op_graphs(module)
    _check_structure(module, graphs)
    if ".gpu-" in path.name:
        _check_xla_kernels(module, graphs)
    if path.name.endswith(".pre.hlo") or path.suffix == ".hlo" and path.parent.name == "tf":
        assert all(n.xla_group is None for g in graphs for n in g.nodes)


def test_entry_baseline_of_bert_training_is_xlas_partition():
    """The brief's headline check on one real fixture: H100 BERT training step."""
    path = next(p for p in ZOO
                if p.parent.name == "bert_layer_train" and p.name == "full.gpu-h100.hlo")
    module = parse_hlo(path.read_text())
    entry = build_op_graphs(module)[0]
    kernels = [k for k in count_kernels(module).kernels if k.computation == module.entry.name]
    found = Counter(_group_category(entry, ids) for ids in _launching_groups(entry))
    assert found == Counter(k.category for k in kernels) and found["memory"] > 20
    assert any(n.xla_group and n.op_class is OpClass.REDUCTION for n in entry.nodes)


def test_unit_bitmasks_of_a_large_graph_agree_with_the_search(monkeypatch):
    """Above REACHABILITY_MAX_NODES, ``is_convex`` proves convexity between units (XLA
    fusions, every other op alone) and searches otherwise: on random unions of nearby
    units and random op sets of a real XLA GPU module its answers equal the search's."""
    import stitch.hlo.graph as graph_module
    from tests.fixtures import DATA

    text = (DATA / "bert_layer_train" / "full.gpu-h100.hlo").read_text()
    graph = _graphs(text)[0]
    units: dict[object, list[int]] = {}
    for node in graph.nodes:
        grouped = node.xla_group is not None and node.op_class is not OpClass.SOURCE
        units.setdefault(node.xla_group if grouped else node.id, []).append(node.id)
    assert len(units) < len(graph.nodes)
    rng = random.Random(23)
    by_first = sorted(units.values())
    sets = []
    for _ in range(300):
        start = rng.randrange(len(by_first))
        picked = {min(len(by_first) - 1, start + rng.randint(0, 12))
                  for _ in range(rng.randint(1, 6))}
        sets.append({v for i in picked for v in by_first[i]})
    for _ in range(100):
        start = rng.randrange(len(graph.nodes))
        sets.append({min(len(graph.nodes) - 1, start + rng.randint(0, 24))
                     for _ in range(rng.randint(1, 12))})
    monkeypatch.setattr(graph_module, "REACHABILITY_MAX_NODES", len(units))
    by_units = [graph.is_convex(s) for s in sets]
    assert graph.unit_reachability() is not None
    monkeypatch.setattr(graph_module, "REACHABILITY_MAX_NODES", -1)
    searched = [graph.is_convex(s) for s in sets]
    assert graph.unit_reachability() is None
    assert by_units == searched
    assert any(searched[:300]) and not all(searched[:300])
