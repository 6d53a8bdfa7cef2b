"""Kernel IR lowered once per distinct kernel (stitch.codegen.lowering_reuse): two kernels
that differ only by their names share one lowering, bound to each site; a kernel that
computes something else (another constant, another shape) gets its own."""
from __future__ import annotations

import re

import numpy as np
import pytest

from stitch.codegen import lowering_reuse
from stitch.codegen.gpu_cache import canonical_kernel, kernel_ir_text
from stitch.codegen.lower import kernel_identifier, lower_kernel, reference_values, run_on_host
from stitch.codegen.lowering_reuse import LoweringReuse, site_key
from stitch.cost.gpu_specs import get_spec
from stitch.hlo import parse_hlo
from stitch.hlo.evaluator.interpreter import Evaluator
from stitch.hlo.graph import build_op_graphs
from stitch.schedule.tuner import schedule_kernel

# Two layers' softmax-like blocks: the same computation under other names (the second
# block's instructions and reducer are named differently), then a third whose scale
# constant differs.
HLO = """
HloModule two_layers

%max_a (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %m = f32[] maximum(%x, %y)
}

%max_b (p: f32[], q: f32[]) -> f32[] {
  %p = f32[] parameter(0)
  %q = f32[] parameter(1)
  ROOT %mm = f32[] maximum(%p, %q)
}

ENTRY %main (a: f32[64,128], b: f32[64,128]) -> (f32[64,128], f32[64,128], f32[64,128]) {
  %a = f32[64,128]{1,0} parameter(0)
  %b = f32[64,128]{1,0} parameter(1)
  %s1 = f32[] constant(0.5)
  %s1b = f32[64,128]{1,0} broadcast(%s1), dimensions={}
  %l1.scaled = f32[64,128]{1,0} multiply(%a, %s1b)
  %l1.ninf = f32[] constant(-inf)
  %l1.max = f32[64]{0} reduce(%l1.scaled, %l1.ninf), dimensions={1}, to_apply=%max_a
  %l1.maxb = f32[64,128]{1,0} broadcast(%l1.max), dimensions={0}
  %l1.out = f32[64,128]{1,0} subtract(%l1.scaled, %l1.maxb), metadata={op_name="layer_1"}
  %s2 = f32[] constant(0.5)
  %s2b = f32[64,128]{1,0} broadcast(%s2), dimensions={}
  %l2.scaled = f32[64,128]{1,0} multiply(%b, %s2b)
  %l2.ninf = f32[] constant(-inf)
  %l2.max = f32[64]{0} reduce(%l2.scaled, %l2.ninf), dimensions={1}, to_apply=%max_b
  %l2.maxb = f32[64,128]{1,0} broadcast(%l2.max), dimensions={0}
  %l2.out = f32[64,128]{1,0} subtract(%l2.scaled, %l2.maxb), metadata={op_name="layer_2"}
  %s3 = f32[] constant(0.25)
  %s3b = f32[64,128]{1,0} broadcast(%s3), dimensions={}
  %l3.scaled = f32[64,128]{1,0} multiply(%a, %s3b)
  %l3.ninf = f32[] constant(-inf)
  %l3.max = f32[64]{0} reduce(%l3.scaled, %l3.ninf), dimensions={1}, to_apply=%max_a
  %l3.maxb = f32[64,128]{1,0} broadcast(%l3.max), dimensions={0}
  %l3.out = f32[64,128]{1,0} subtract(%l3.scaled, %l3.maxb)
  ROOT %t = (f32[64,128]{1,0}, f32[64,128]{1,0}, f32[64,128]{1,0}) tuple(%l1.out, %l2.out, %l3.out)
}
"""


def _normalized(kernel) -> str:
    """The Kernel IR's text with every buffer name replaced by its position."""
    canonical = canonical_kernel(kernel)
    text = kernel_ir_text(canonical)
    buffers = [b.name for b in (*canonical.params, *canonical.shared, *canonical.scratch)]
    position = {repr(n): f"'#{i}'" for i, n in enumerate(buffers)}
    return re.sub("|".join(re.escape(q) for q in position), lambda m: position[m.group(0)],
                  text)


@pytest.fixture()
def setting():
    lowering_reuse.forget_lowerings()
    module = parse_hlo(HLO)
    graph = build_op_graphs(module)[0]
    evaluator = Evaluator(module)
    spec = get_spec("h100")
    layers = {}
    for layer in ("l1", "l2", "l3"):
        broadcast = {"l1": "s1b", "l2": "s2b", "l3": "s3b"}[layer]
        members = frozenset(n.id for n in graph.nodes if n.opcode != "constant" and (
            n.name.startswith(layer + ".") or n.name == broadcast))
        layers[layer] = (members, schedule_kernel(graph, members, spec))
    yield graph, evaluator, layers
    lowering_reuse.forget_lowerings()


def _lower(reuse, graph, evaluator, members, schedule, name):
    return reuse.lower(graph, members, schedule, kernel_identifier(name),
                       lambda: lower_kernel(graph, evaluator, schedule, name))


def test_two_kernels_differing_only_in_names_share_one_lowering(setting) -> None:
    graph, evaluator, layers = setting
    reuse = LoweringReuse()
    (m1, s1), (m2, s2) = layers["l1"], layers["l2"]
    assert site_key(graph, m1, s1).key == site_key(graph, m2, s2).key
    first = _lower(reuse, graph, evaluator, m1, s1, "main.k1")
    second = _lower(reuse, graph, evaluator, m2, s2, "main.k2")
    assert (reuse.lowered, reuse.reused) == (1, 1)
    fresh = lower_kernel(graph, evaluator, s2, "main.k2")
    # Bound to its own site: its name, the values it reads and writes.
    assert second.kernel.name == fresh.kernel.name == "main_k2"
    assert second.inputs == fresh.inputs and second.outputs == fresh.outputs
    assert set(second.inputs).isdisjoint(first.inputs)
    assert second.initial == fresh.initial and second.layouts == fresh.layouts
    assert second.schemes == fresh.schemes
    assert _normalized(second.kernel) == _normalized(fresh.kernel)
    # And it computes the second layer's values from the second layer's inputs.
    rng = np.random.default_rng()
    inputs = {v: rng.standard_normal(graph.nodes[v].shape.dims).astype(np.float32)
              for v in second.inputs}
    got = run_on_host(second, graph, inputs, opt=0)
    want = reference_values(graph, evaluator, sorted(m2), inputs)
    for v in second.outputs:
        np.testing.assert_allclose(got[v], want[v], rtol=1e-6, atol=1e-6)


def test_another_constant_is_another_lowering(setting) -> None:
    graph, evaluator, layers = setting
    reuse = LoweringReuse()
    (m1, s1), (m3, s3) = layers["l1"], layers["l3"]
    assert site_key(graph, m1, s1).key != site_key(graph, m3, s3).key
    _lower(reuse, graph, evaluator, m1, s1, "main.k1")
    third = _lower(reuse, graph, evaluator, m3, s3, "main.k3")
    assert (reuse.lowered, reuse.reused) == (2, 0)
    assert _normalized(third.kernel) == _normalized(
        lower_kernel(graph, evaluator, s3, "main.k3").kernel)


def test_reuse_off_lowers_every_site(setting) -> None:
    graph, evaluator, layers = setting
    reuse = LoweringReuse(enabled=False)
    for name, (members, schedule) in layers.items():
        _lower(reuse, graph, evaluator, members, schedule, name)
    assert (reuse.lowered, reuse.reused) == (3, 0)


def test_a_gather_kernel_gets_no_key() -> None:
    module = parse_hlo("""
HloModule g
ENTRY %main (t: f32[16,8], i: s32[4,1]) -> f32[4,8] {
  %t = f32[16,8]{1,0} parameter(0)
  %i = s32[4,1]{1,0} parameter(1)
  %g = f32[4,8]{1,0} gather(%t, %i), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,8}
  ROOT %n = f32[4,8]{1,0} negate(%g)
}
""")
    graph = build_op_graphs(module)[0]
    members = frozenset(n.id for n in graph.nodes if n.name in ("g", "n"))
    assert site_key(graph, members, None) is None


def _without_notes(schedule):
    import dataclasses
    return dataclasses.replace(schedule, rejected=[])


def test_a_repeated_layer_gets_the_first_ones_schedule_renumbered(setting) -> None:
    from stitch.explorer.plan_schedules import SharedSchedules
    graph, _, layers = setting
    shared = SharedSchedules(graph)
    (m1, s1), (m2, s2), (m3, _) = layers["l1"], layers["l2"], layers["l3"]
    shared.put(m1, s1)
    got = shared.get(m2)
    assert got is not None and shared.shared == 1
    assert _without_notes(got) == _without_notes(s2)
    assert set(got.members) == set(m2)
    assert shared.get(m3) is None             # another constant: tuned on its own


def test_plans_with_and_without_shared_schedules_are_equal(monkeypatch) -> None:
    from stitch.explorer import plan_schedules, planner
    plans = []
    for share in (False, True):
        monkeypatch.setattr(plan_schedules, "SHARE_SCHEDULES", share)
        plan = planner.plan(HLO, "h100")
        plans.append([(k.name, sorted(k.members),
                       _without_notes(k.schedule) if k.schedule else None)
                      for k in plan.kernels])
    assert plans[0] == plans[1]
    assert any(s is not None for _, _, s in plans[0])


def test_a_lowering_is_read_back_from_the_compile_cache_in_another_process(
        setting, tmp_path) -> None:
    from stitch.codegen.cache import CompileCache
    graph, evaluator, layers = setting
    (m1, s1), (m2, s2) = layers["l1"], layers["l2"]
    writer = LoweringReuse(cache=CompileCache(tmp_path))
    _lower(writer, graph, evaluator, m1, s1, "main.k1")
    lowering_reuse.forget_lowerings()          # what a new process starts with
    # Stored when the pass ends, not before.
    probe = LoweringReuse(cache=CompileCache(tmp_path))
    _lower(probe, graph, evaluator, m2, s2, "main.k2")
    assert (probe.lowered, probe.from_disk) == (1, 0)
    writer.flush()
    lowering_reuse.forget_lowerings()
    reader = LoweringReuse(cache=CompileCache(tmp_path))
    second = _lower(reader, graph, evaluator, m2, s2, "main.k2")
    assert (reader.lowered, reader.reused, reader.from_disk) == (0, 1, 1)
    fresh = lower_kernel(graph, evaluator, s2, "main.k2")
    assert _normalized(second.kernel) == _normalized(fresh.kernel)
    assert (second.inputs, second.outputs, second.schemes) == \
        (fresh.inputs, fresh.outputs, fresh.schemes)
    second.kernel.validate()


def test_what_is_derived_from_a_lowering_is_stored_with_it(setting, tmp_path,
                                                           monkeypatch) -> None:
    """The structure key, the busiest thread and the check's verdict come back with a stored
    lowering: a new process derives none of them again, and they equal a fresh derivation."""
    from stitch.codegen import gpu_cache, thread_work
    from stitch.codegen.cache import CompileCache
    from stitch.codegen.kir.check import KernelChecker
    graph, evaluator, layers = setting
    (m1, s1), (m2, s2) = layers["l1"], layers["l2"]
    writer = LoweringReuse(cache=CompileCache(tmp_path))
    first = _lower(writer, graph, evaluator, m1, s1, "main.k1")
    want = (writer.structure(first.kernel), writer.busiest(first.kernel))
    writer.checked(first.kernel)
    writer.flush()
    lowering_reuse.forget_lowerings()
    reader = LoweringReuse(cache=CompileCache(tmp_path))
    second = _lower(reader, graph, evaluator, m2, s2, "main.k2")
    assert reader.from_disk == 1

    def derived_again(*args, **kwargs):
        raise AssertionError("derived again")
    with monkeypatch.context() as patched:
        for owner, name in ((gpu_cache, "structure_key"), (thread_work, "busiest_thread"),
                            (KernelChecker, "run")):
            patched.setattr(owner, name, derived_again)
        assert (reader.structure(second.kernel), reader.busiest(second.kernel)) == want
        assert reader.checked(second.kernel) is second.kernel
        second.kernel.validate()                  # marked: not walked again
    assert gpu_cache.structure_key(second.kernel) == want[0]
    assert thread_work.busiest_thread(second.kernel) == want[1]
    assert want[1].loads > 0 and want[1].ops > 0


def test_a_failed_check_is_not_remembered_as_passed(setting, monkeypatch) -> None:
    """A lowering whose kernel fails the check fails it at every site bound to it."""
    from stitch.codegen.errors import CodegenError
    from stitch.codegen.kir.check import KernelChecker
    graph, evaluator, layers = setting
    (m1, s1), (m2, s2) = layers["l1"], layers["l2"]
    reuse = LoweringReuse()
    lower = lambda m, s, n: reuse.lower(graph, m, s, kernel_identifier(n),  # noqa: E731
                                        lambda: lower_kernel(graph, evaluator, s, n,
                                                             validate=False))
    first, second = lower(m1, s1, "main.k1"), lower(m2, s2, "main.k2")
    calls = []

    def refuse(checker):
        calls.append(checker)
        raise CodegenError("refused")
    monkeypatch.setattr(KernelChecker, "run", refuse)
    for lowered in (first, second):
        with pytest.raises(CodegenError, match="refused"):
            reuse.checked(lowered.kernel)
    assert len(calls) == 2


def test_kernel_ir_data_round_trips_and_refuses_other_types(setting) -> None:
    import json

    from stitch.codegen.kir_data import KirDataError, kernel_from_data, kernel_to_data
    graph, evaluator, layers = setting
    members, schedule = layers["l3"]
    kernel = lower_kernel(graph, evaluator, schedule, "main.k3").kernel
    data = json.loads(json.dumps(kernel_to_data(kernel)))
    assert kernel_from_data(data) == kernel
    data["nodes"][0][0] = "Popen"
    with pytest.raises(KirDataError):
        kernel_from_data(data)


def test_row_layout_proofs_are_reused_and_lower_the_same_kernels(setting, monkeypatch) -> None:
    """A row part's layout proof is made once per key and renumbered for the parts equal
    but for names (l1, l2); another constant (l3) is proved afresh; each kernel lowers to
    the Kernel IR and notes it lowers to with every proof made anew."""
    from stitch.codegen import row_layout

    graph, evaluator, layers = setting
    proved: list[frozenset[int]] = []
    original = row_layout.RowLayoutProof.prove

    def counted(self, part):
        proved.append(frozenset(part.members))
        return original(self, part)

    monkeypatch.setattr(row_layout.RowLayoutProof, "prove", counted)
    results = {}
    for reuse in (False, True):
        lowering_reuse.forget_lowerings()
        monkeypatch.setattr(row_layout, "REUSE_ROW_LAYOUTS", reuse)
        proved.clear()
        results[reuse] = [lower_kernel(graph, evaluator, schedule, f"k_{layer}")
                          for layer, (_, schedule) in sorted(layers.items())]
        results[reuse, "proved"] = len(proved)
    assert results[False, "proved"] == 3
    assert results[True, "proved"] == 2
    for fresh, reused in zip(results[False], results[True]):
        assert kernel_ir_text(fresh.kernel) == kernel_ir_text(reused.kernel)
        assert (fresh.notes, fresh.schemes, fresh.split_rows) == \
            (reused.notes, reused.schemes, reused.split_rows)
    assert all(scheme in ("warp", "block") for k in results[True] for scheme in k.schemes)


def test_lowering_choices_key_their_bound_nodes_by_position(setting) -> None:
    """Kernels lowered outside the tuner's schedules (GEMM chains, attention backwards) are
    keyed by ``LoweringChoices``: the same choices and bound nodes in the same positions
    share a key across layers; other bound nodes, other switches or a node outside the
    site do not."""
    from stitch.codegen.site_keys import LoweringChoices
    graph, _, layers = setting
    (m1, _), (m2, _) = layers["l1"], layers["l2"]
    by_name = {n.name: n.id for n in graph.nodes}

    def key(members, choices):
        found = site_key(graph, members, choices)
        return None if found is None else found.key

    one = LoweringChoices("gemm_chain", None, ("sm_90", False), (by_name["l1.max"],))
    two = LoweringChoices("gemm_chain", None, ("sm_90", False), (by_name["l2.max"],))
    assert key(m1, one) is not None and key(m1, one) == key(m2, two)
    assert key(m1, one) != key(m1, LoweringChoices("gemm_chain", None, ("sm_90", False),
                                                   (by_name["l1.out"],)))
    assert key(m1, one) != key(m1, LoweringChoices("gemm_chain", None, ("sm_90", True),
                                                   (by_name["l1.max"],)))
    assert key(m1, one) != key(m1, LoweringChoices("gemm_chain", None, ("sm_90", False)))
    # A node of another layer is outside the site: no key, lowered as ever.
    assert key(m1, LoweringChoices("gemm_chain", None, (), (by_name["l2.max"],))) is None
