"""Planning repeated layers: kernel costs and feasibility verdicts are shared between member
sets of the same structure (stitch.pricing.structure). The plan must be the one planning
every copy on its own gives, and the scoring work must follow the distinct structure, not
the number of layers."""
from __future__ import annotations

import re

import numpy as np
import pytest

from stitch.hlo import parse_hlo
from stitch.hlo.graph import build_op_graphs
from stitch.pricing.delta import CostModel
from stitch.cost.gpu_specs import get_spec
from stitch.explorer.planner import ExplorerOptions, plan
from stitch.pricing.structure import StructureKeys, rename
from tests.fixtures import REDUCERS

ROWS, WIDTH, HIDDEN = 64, 128, 256

HEADER = "HloModule layers\n\n" + REDUCERS + """
add_copy {
  p = f32[] parameter(0)
  q = f32[] parameter(1)
  ROOT r = f32[] add(p, q)
}
"""


def _layer(i: int, x: str, reducer: str) -> tuple[list[str], str]:
    """A pre-norm MLP block with a residual: layer norm, dot, tanh-gated activation with a
    softmax-like row max, dot, residual add. Only the dots end its regions, so with the
    residual every layer's memory-intensive ops form one connected region."""
    r, w, h, s = ROWS, WIDTH, HIDDEN, f"_L{i}"
    lines = [
        f"  w1{s} = f32[{w},{h}] parameter({2 * i + 1})",
        f"  w2{s} = f32[{h},{w}] parameter({2 * i + 2})",
        f"  sum{s} = f32[{r}] reduce({x}, zero), dimensions={{1}}, to_apply={reducer}",
        f"  mean{s} = f32[{r}] multiply(sum{s}, inv_w)",
        f"  meanb{s} = f32[{r},{w}] broadcast(mean{s}), dimensions={{0}}",
        f"  c{s} = f32[{r},{w}] subtract({x}, meanb{s})",
        f"  sq{s} = f32[{r},{w}] multiply(c{s}, c{s})",
        f"  vsum{s} = f32[{r}] reduce(sq{s}, zero), dimensions={{1}}, to_apply={reducer}",
        f"  var{s} = f32[{r}] multiply(vsum{s}, inv_w)",
        f"  ve{s} = f32[{r}] add(var{s}, eps)",
        f"  rs{s} = f32[{r}] rsqrt(ve{s})",
        f"  rsb{s} = f32[{r},{w}] broadcast(rs{s}), dimensions={{0}}",
        f"  ln{s} = f32[{r},{w}] multiply(c{s}, rsb{s})",
        f"  h{s} = f32[{r},{h}] dot(ln{s}, w1{s}), lhs_contracting_dims={{1}}, "
        f"rhs_contracting_dims={{0}}",
        f"  hm{s} = f32[{r}] reduce(h{s}, ninf), dimensions={{1}}, to_apply=max",
        f"  hmb{s} = f32[{r},{h}] broadcast(hm{s}), dimensions={{0}}",
        f"  hc{s} = f32[{r},{h}] subtract(h{s}, hmb{s})",
        f"  t{s} = f32[{r},{h}] tanh(hc{s})",
        f"  g{s} = f32[{r},{h}] multiply(t{s}, h{s})",
        f"  o{s} = f32[{r},{w}] dot(g{s}, w2{s}), lhs_contracting_dims={{1}}, "
        f"rhs_contracting_dims={{0}}",
        f"  x{s} = f32[{r},{w}] add({x}, o{s})",
    ]
    return lines, f"x{s}"


def layers_hlo(n: int, reducers: list[str] | None = None) -> str:
    """``n`` identical layers (``reducers[i]``: the i-th layer's reduction computation,
    ``add`` or a copy of it under another name)."""
    reducers = reducers or ["add"] * n
    body = [f"  x0 = f32[{ROWS},{WIDTH}] parameter(0)",
            "  zero = f32[] constant(0)", "  ninf = f32[] constant(-inf)",
            f"  inv_w = f32[{ROWS}] constant({{{', '.join(['0.0078125'] * ROWS)}}})",
            f"  eps = f32[{ROWS}] constant({{{', '.join(['1e-05'] * ROWS)}}})"]
    x = "x0"
    for i in range(n):
        lines, x = _layer(i, x, reducers[i])
        body += lines
    body.append(f"  ROOT out = f32[{ROWS},{WIDTH}] tanh({x})")
    return HEADER + "\nENTRY main {\n" + "\n".join(body) + "\n}\n"


def _kernels(fusion_plan) -> list[tuple]:
    return [(k.ops, k.kind, k.origin, k.schedule, k.chain_schedule)
            for k in fusion_plan.kernels]


def _layer_of(name: str) -> str | None:
    got = re.search(r"_L(\d+)$", name)
    return got.group(1) if got else None


@pytest.mark.parametrize("planner", ["beam", "blp"])
def test_shared_structure_gives_the_plan_of_every_copy(planner):
    """Sharing on and off give the same kernels (members, kinds, origins, schedules) and
    the same modeled time, on three identical layers."""
    hlo = layers_hlo(3)
    off = plan(hlo, "h100", planner, ExplorerOptions(share_structure=False))
    on = plan(hlo, "h100", planner, ExplorerOptions(share_structure=True))
    assert _kernels(on) == _kernels(off)
    assert on.graphs[0].report.objective_s == off.graphs[0].report.objective_s
    assert on.graphs[0].report.detail["structure_hits"] > 0
    assert off.graphs[0].report.detail["structure_hits"] == 0


def test_middle_layers_plan_alike():
    """A layer between two others is planned like any other such layer: its kernels, with
    the layer's suffix taken off the op names, are the same."""
    fusion_plan = plan(layers_hlo(4), "h100", "beam")
    per_layer: dict[str, set] = {}
    for k in fusion_plan.kernels:
        layers = {_layer_of(n) for n in k.ops} - {None}
        if len(layers) == 1:
            (layer,) = layers
            per_layer.setdefault(layer, set()).add(
                (tuple(sorted(re.sub(r"_L\d+$", "", n) for n in k.ops)), k.kind))
    assert per_layer["1"] and per_layer["1"] == per_layer["2"]


def test_scoring_work_follows_distinct_structure():
    """Eight identical layers score about as many distinct patterns as one or two (the
    first and last layers differ from the middle ones); every further pattern is a repeat
    answered from its twin. Counts, not seconds."""
    def distinct(n: int) -> tuple[int, int]:
        detail = plan(layers_hlo(n), "h100", "beam").graphs[0].report.detail
        return detail["scored"] - detail["reused"], detail["scored"]
    one, _ = distinct(1)
    two, _ = distinct(2)
    eight, eight_scored = distinct(8)
    assert eight <= 1.5 * two, (one, two, eight)
    assert eight <= 2 * one, (one, two, eight)
    assert eight < 0.25 * eight_scored, (eight, eight_scored)


def _graph(hlo: str):
    return build_op_graphs(parse_hlo(hlo))[0]


def _layer_members(graph, layer: int) -> list[frozenset[int]]:
    """Sets of a layer's ops (by name stem) to compare across layers."""
    stems = [["sum", "mean", "meanb", "c", "sq", "vsum", "var", "ve", "rs", "rsb", "ln"],
             ["hm", "hmb", "hc", "t", "g"], ["c", "sq"], ["sum", "mean"]]
    return [frozenset(graph.node(f"{s}_L{layer}").id for s in group) for group in stems]


def test_keys_equal_for_copies_and_differ_for_changes():
    """Copies of a set in different layers share a key; a set whose reduction computes a
    maximum instead of a sum, or that lacks an op, does not. A renamed copy of the same
    reduction computation keeps the key (called computations count by content)."""
    graph = _graph(layers_hlo(5, ["add", "add", "add_copy", "max", "add"]))
    keys = StructureKeys(graph)
    for a, b, c in zip(*(_layer_members(graph, i) for i in (1, 2, 3))):
        assert keys.key(a) is not None and keys.key(a) == keys.key(b)
        # Layer 3's layer-norm sums reduce with max; the row max "hm" is max everywhere.
        sums = any(graph.nodes[v].name.startswith(("sum_", "vsum_")) for v in a)
        assert (keys.key(a) != keys.key(c)) == sums
    # Layer 0 reads the parameter, not a residual add: its sets differ.
    assert keys.key(_layer_members(graph, 0)[0]) != keys.key(_layer_members(graph, 1)[0])
    first = _layer_members(graph, 1)[0]
    assert keys.key(first) != keys.key(first - {min(first)})
    dot = graph.node("h_L1").id
    assert keys.key(first | {dot}) is None          # GEMMs get no key


def test_shared_costs_equal_fresh_costs():
    """Every kernel cost and verdict a twin answered equals the one computed from scratch,
    on random member sets of repeated layers (fresh seeds)."""
    graph = _graph(layers_hlo(4))
    spec = get_spec("h100")
    shared = CostModel(graph, spec)
    fresh = CostModel(graph, spec, share_structure=False)
    rng = np.random.default_rng()
    groups = [m for i in range(4) for m in _layer_members(graph, i)]
    checked = 0
    for _ in range(60):
        base = groups[rng.integers(len(groups))]
        drop = set(rng.choice(sorted(base), size=rng.integers(0, 3), replace=False).tolist())
        members = frozenset(base - drop)
        if not members:
            continue
        assert shared.verdict(members) == fresh.verdict(members)
        assert shared.kernel(members) == fresh.kernel(members)
        checked += 1
    assert checked > 30 and shared.structure_hits > 0


def _random_sets(graph, rng, count: int) -> list[frozenset[int]]:
    """Layer sets with a few ops dropped or a GEMM added (no key), and random op sets."""
    groups = [m for i in range(4) for m in _layer_members(graph, i)]
    dots = [n.id for n in graph.nodes if n.opcode == "dot"]
    sets = []
    for _ in range(count):
        base = set(groups[rng.integers(len(groups))])
        drop = rng.choice(sorted(base), size=rng.integers(0, 3), replace=False).tolist()
        base -= set(drop)
        if rng.random() < 0.15:
            base.add(int(rng.choice(dots)))
        if rng.random() < 0.2:
            base = set(rng.choice(len(graph.nodes), size=rng.integers(1, 12),
                                  replace=False).tolist())
        if base:
            sets.append(frozenset(base))
    return sets


def test_fingerprint_is_the_sum_of_its_members_fingerprints():
    """A set's fingerprint, asked cold (member hashes computed on the way) or warm (all
    known), is its size and the sum of its members' own fingerprints; None with a member
    that gets no key. Random sets in a random order, fresh seeds."""
    graph = _graph(layers_hlo(4))
    keys = StructureKeys(graph)
    rng = np.random.default_rng()
    sets = _random_sets(graph, rng, 200)
    cold = [keys.fingerprint(s) for s in sets]
    warm = [keys.fingerprint(s) for s in sets]
    singles = {v: keys.fingerprint((v,)) for s in sets for v in s}
    mask = (1 << 64) - 1
    want = [None if any(singles[v] is None for v in s)
            else (len(s), sum(singles[v][1] for v in s) & mask) for s in sets]
    assert cold == want and warm == want
    assert any(f is None for f in want) and sum(f is not None for f in want) > 100


def test_union_key_is_the_key_of_the_union():
    """``union_key`` (a union's key found from its parts' keys and how the later part meets
    the earlier one, computed once per combination) is the union's own key: random unions
    of two disjoint runs of ops, one before the other or interleaved, each also in the
    next layer (where it is found, not computed), and in a zoo training step (fresh
    seeds)."""
    from tests.fixtures import DATA
    rng = np.random.default_rng()
    layered = _graph(layers_hlo(5))
    stride = layered.node("sum_L2").id - layered.node("sum_L1").id
    first = [v for v in range(len(layered.nodes))
             if layered.node("sum_L1").id <= v < layered.node("sum_L2").id]
    zoo = _graph((DATA / "transformer_train" / "tiny.gpu-h100.hlo").read_text())
    found = 0
    # Parts reading one outside value (the residual) in one union and different ones in
    # its copy with the later part a layer on.
    shared = StructureKeys(layered)
    for stems_a, stems_b in ((["sum"], ["c", "sq"]), (["sum", "mean"], ["c"]),
                             (["sum"], ["c"])):
        part_a = frozenset(layered.node(f"{n}_L1").id for n in stems_a)
        for layer in (1, 2, 3):
            part_b = frozenset(layered.node(f"{n}_L{layer}").id for n in stems_b)
            union = part_a | part_b
            assert shared.union_key(union, part_a, part_b, shared.key(part_a),
                                    shared.key(part_b)) == shared.key(union)
    for graph, copies in ((layered, (0, stride, 2 * stride)), (zoo, (0,))):
        keys = StructureKeys(graph)
        ops = first if graph is layered else list(range(len(graph.nodes)))
        ops = [v for v in ops if keys.plannable[v]]
        for _ in range(150):
            start = int(rng.integers(len(ops) - 3))
            window = ops[start:start + int(rng.integers(2, 16))]
            if len(window) < 2:
                continue
            if rng.random() < 0.3:          # interleaved: every other op
                a, b = window[0::2], window[1::2]
            else:
                cut = int(rng.integers(1, len(window)))
                a, b = window[:cut], window[cut:]
            # Each layer's copy, and the earlier part with the later one's copies further
            # on (parts of the same keys that meet differently, or not at all).
            pairs = [(shift, shift) for shift in copies] + [(0, s) for s in copies[1:]]
            for shift_a, shift_b in pairs:
                part_a = frozenset(v + shift_a for v in a)
                part_b = frozenset(v + shift_b for v in b)
                if part_a & part_b:
                    continue
                union = part_a | part_b
                got = keys.union_key(union, part_a, part_b, keys.key(part_a),
                                     keys.key(part_b))
                found += union not in keys.layouts      # its key was not computed
                assert got == keys.key(union)
    assert found > 30


def test_full_structure_key_groups_sets_as_fresh_keys_do():
    """``CostModel.full_structure_key`` (a key scoring kept, or one computed) puts two sets
    under one key exactly when a fresh ``StructureKeys`` does, whether the sets were scored
    before or not (fresh seeds)."""
    graph = _graph(layers_hlo(4))
    cost = CostModel(graph, get_spec("h100"))
    rng = np.random.default_rng()
    sets = _random_sets(graph, rng, 120)
    for s in sets[: len(sets) // 2]:
        cost.verdict(s)
        cost.kernel(s)
    fresh = StructureKeys(graph)
    got = [cost.full_structure_key(s) for s in sets]
    want = [fresh.key(s) for s in sets]
    assert [g is None for g in got] == [w is None for w in want]
    pairs = [(i, j) for i in range(len(sets)) for j in range(i)]
    assert all((got[i] == got[j]) == (want[i] == want[j]) for i, j in pairs)
    assert sum(got[i] == got[j] and got[i] is not None for i, j in pairs) > 10


def _renumbered_reference(value, ids, is_id=False):
    """A schedule with node ids mapped, walked field by field with ``dataclasses.replace``."""
    import dataclasses
    id_fields = {"members", "root", "node", "cached"}
    if is_id:
        if isinstance(value, int) and not isinstance(value, bool):
            return ids[value]
        if isinstance(value, (tuple, list, frozenset, set)):
            return type(value)(ids[v] for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{
            f.name: _renumbered_reference(getattr(value, f.name), ids, f.name in id_fields)
            for f in dataclasses.fields(value) if f.init})
    if isinstance(value, list):
        return [_renumbered_reference(v, ids) for v in value]
    if isinstance(value, tuple):
        return tuple(_renumbered_reference(v, ids) for v in value)
    return value


def test_a_shared_schedule_is_the_first_one_renumbered_field_by_field():
    """``SharedSchedules``: a later layer's set gets the schedule tuned for an earlier one
    with every node id mapped, equal to a field-by-field walk, for each layer-set shape."""
    from stitch.explorer.plan_schedules import SharedSchedules
    from stitch.schedule.tuner import schedule_kernel
    graph = _graph(layers_hlo(3))
    spec = get_spec("h100")
    shared = SharedSchedules(graph)
    checked = 0
    for first, later in zip(_layer_members(graph, 1), _layer_members(graph, 2)):
        tuned = schedule_kernel(graph, first, spec)
        shared.put(first, tuned)
        got = shared.get(later)
        assert got is not None
        assert got == _renumbered_reference(tuned, dict(zip(sorted(first), sorted(later))))
        assert set(got.members) == set(later)
        checked += 1
    assert checked == 4 and shared.shared == 4


def test_rename_carries_reasons():
    assert rename("mul.3 (rsqrt) feeds mul.30", ("mul.3", "mul.30"), ("mul.7", "mul.70")) \
        == "mul.7 (rsqrt) feeds mul.70"
    assert rename("ends at mul.3.", ("mul.3",), ("mul.9",)) == "ends at mul.9."
    assert rename("mul.30 stays", ("mul.3",), ("mul.9",)) == "mul.30 stays"


def _rounds_reference(graph, groups):
    """The launch order as first written: rescan every pending kernel each round."""
    from stitch.explorer.graph_plan import kernel_writes, producers_needed
    written = [kernel_writes(graph, set(g)) for g in groups]
    needs = [producers_needed(graph, set(g)) for g in groups]
    available, order, pending = set(), [], list(range(len(groups)))
    while pending:
        ready = [i for i in pending if needs[i] <= available]
        if not ready:
            return None
        for i in ready:
            order.append(i)
            available |= written[i]
        pending = [i for i in pending if i not in set(ready)]
    return order


def test_linear_launch_order_matches_the_round_by_round_order():
    """launch_indices (Kahn's algorithm in rounds) orders shuffled plans exactly as the
    round-by-round rescan did, and refuses a plan whose kernels form a cycle."""
    from stitch.explorer.graph_plan import PlanValidationError, launch_indices
    fusion_plan = plan(layers_hlo(3), "h100", "beam")
    graph = fusion_plan.graphs[0].graph
    rng = np.random.default_rng()
    singles = [[frozenset((v,)) for k in fusion_plan.graphs[0].baseline.kernels
                for v in k.members]]
    # A wide graph too: a zoo training step's ops as kernels of their own.
    from tests.fixtures import DATA
    from stitch.explorer.planner import baseline_groups
    wide_graph = _graph((DATA / "transformer_train" / "tiny.gpu-h100.hlo").read_text())
    wide_groups = baseline_groups(wide_graph, "xla")
    for _ in range(5):
        shuffled = [wide_groups[i] for i in rng.permutation(len(wide_groups))]
        assert launch_indices(wide_graph, shuffled) == _rounds_reference(wide_graph, shuffled)
    for groups in [[frozenset(k.members) for k in side.kernels]
                   for side in (fusion_plan.graphs[0].baseline,
                                fusion_plan.graphs[0].stitched)] + singles:
        for _ in range(10):
            shuffled = [groups[i] for i in rng.permutation(len(groups))]
            assert launch_indices(graph, shuffled) == _rounds_reference(graph, shuffled)
    # Two kernels each reading what the other writes: ln_L1 with the residual add after
    # it, against the ops in between.
    names = {n.name: n.id for n in graph.nodes}
    first = frozenset(names[n] for n in ("rs_L1", "rsb_L1", "ln_L1", "x_L1"))
    rest = [g for g in singles[0] if not g & first]
    cyclic = [first] + rest
    assert _rounds_reference(graph, cyclic) is None
    with pytest.raises(PlanValidationError, match="cycle"):
        launch_indices(graph, cyclic)


def test_node_facts_answer_as_the_per_op_queries():
    """``node_facts``: its per-op lists are ``needs_kernel``, ``kernel_kind`` of the op
    alone and ``is_plannable``, and the written / needed values it keeps across plans
    (random unions of XLA's kernels, fresh seeds) are those found from scratch."""
    from stitch.explorer.graph_plan import (PlanValidationError, kernel_kind, kernel_writes,
                                            launch_indices, needs_kernel, node_facts,
                                            producers_needed)
    from stitch.explorer.patterns import is_plannable
    from stitch.explorer.planner import baseline_groups
    from tests.fixtures import DATA
    rng = np.random.default_rng()
    for graph in (_graph((DATA / "transformer_train" / "tiny.gpu-h100.hlo").read_text()),
                  _graph(layers_hlo(3))):
        facts = node_facts(graph)
        assert node_facts(graph) is facts
        ids = range(len(graph.nodes))
        assert facts.needs == [needs_kernel(graph, v) for v in ids]
        assert facts.boundary == [kernel_kind(graph, (v,)) != "fused" for v in ids]
        assert facts.plannable == [is_plannable(graph, v) for v in ids]
        assert any(facts.boundary) and not all(facts.needs)
        groups = baseline_groups(graph, "xla")
        # XLA's partition as the graph gives it now (the planner keeps it per graph).
        want = [frozenset(ids) for ids in graph.baseline_groups().values()
                if any(needs_kernel(graph, v) for v in ids)]
        assert groups[:len(want)] == want and baseline_groups(graph, "xla") == groups
        for _ in range(5):
            picked = rng.choice(len(groups), size=min(6, len(groups)), replace=False)
            union = frozenset().union(*(groups[i] for i in picked))
            trial = [union] + [g for i, g in enumerate(groups) if i not in set(picked)]
            try:
                launch_indices(graph, trial, facts.io)
            except PlanValidationError:     # a union closing a cycle: its values were found
                pass
        assert len(facts.io) > len(groups)
        for members, (writes, needs) in facts.io.items():
            assert writes == kernel_writes(graph, set(members))
            assert needs == producers_needed(graph, set(members))


def test_dump_modules_writes_what_the_pass_plans(tmp_path, monkeypatch):
    """STITCH_DUMP_MODULES: each module the XLA pass is handed lands in the folder, one
    file per call, so planning can be profiled without XLA."""
    from stitch.xla_pass.pass_registration import DUMP_ENV, PassRequest, _dump_module
    request = PassRequest("my fn", "h100", "cpu")
    text = layers_hlo(1)
    monkeypatch.delenv(DUMP_ENV, raising=False)
    _dump_module(text, request)                     # unset: nothing written
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv(DUMP_ENV, str(tmp_path / "mods"))
    _dump_module(text, request)
    _dump_module(text + "\n", request)
    files = sorted(p.name for p in (tmp_path / "mods").iterdir())
    assert files == ["my_fn.0.hlo", "my_fn.1.hlo"]
    assert (tmp_path / "mods" / "my_fn.0.hlo").read_text() == text
