"""Every zoo kernel with a reduction (tiny configuration, h100 plan) lowered with each scheme
forced in turn (thread / warp / block composition, wherever the schedule space has it),
run on the host target with poisoned outputs and the model's own intermediate values, against
the reference evaluator. Kernel packing is exercised by the plans themselves (36 of the
117 kernels checked in test_lowering.py have several parts); forced schedules of packed
kernels keep their parts, so packing is forced together with each unit here too.

transformer_train (and its bf16 variant) is left out for test time (its kernels are
bert_layer_train's blocks);
variants equal to the tuned schedule are skipped (test_lowering.py runs those), and the
host build uses LLVM speed level 0 (3x faster to build; this checks the lowering)."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import stitch
from stitch.codegen.errors import CodegenError
from stitch.codegen.lower import lower_kernel, reference_values, run_on_host
from stitch.hlo import parse_hlo
from stitch.codegen.values import leaf
from stitch.hlo.evaluator.dtypes import numpy_dtype
from stitch.hlo.evaluator.interpreter import Evaluator
from stitch.hlo.graph_exec import GraphRunner
from stitch.hlo.segments_as_rows import segments_as_rows
from stitch.cost.gpu_specs import get_spec
from stitch.schedule import ScheduleError, schedule_kernel
from tests.fixtures import BF16_TOLERANCE, zoo_fixture

models = pytest.importorskip("stitch.models")

MODELS = [m for m in models.list_models()
          if not m.startswith(("transformer_train", "gemm_chain"))]
UNITS = ("thread", "warp", "block")
# A kernel ending in a scatter whose updates collide (an embedding gradient) is lowered in
# place: its output buffer starts as the scatter's operand.
NEEDS_IN_PLACE = "needs its output buffer to start as the operand"


class _Recorder(GraphRunner):
    """The reference run of a module through its op graphs, keeping every node's value
    (the last one, in loop bodies) by (graph, node id)."""

    def __init__(self, module, graphs):
        super().__init__(module, graphs)
        self.seen: dict[tuple[int, int], object] = {}

    def _node(self, graph, node, values):
        out = super()._node(graph, node, values)
        self.seen[id(graph), node.id] = out
        return out


def _node_values(module, graphs, args) -> dict[tuple[int, int], object]:
    runner = _Recorder(module, graphs)
    runner.run(args)
    entry = graphs[0]
    for n in entry.nodes:
        if n.opcode == "parameter":
            runner.seen[id(entry), n.id] = args[n.instruction.parameter_number]
    return runner.seen


def _random(node, rng) -> np.ndarray:
    shape = leaf(node.shape)
    dtype = numpy_dtype(shape.element_type)
    if dtype.kind == "f":
        return rng.standard_normal(shape.dims).astype(dtype)
    if dtype == np.bool_:
        return rng.random(shape.dims) < 0.5
    return rng.integers(0, 8, shape.dims).astype(dtype)


def _units(schedule) -> tuple[str, ...]:
    return tuple(p.unit for p in schedule.parts)


@pytest.mark.parametrize("model", MODELS)
def test_forced_schemes_on_zoo_kernels(model):
    # The module stitch.plan plans (proved segment scatters as reductions): the plan's
    # graphs are its graphs.
    module = segments_as_rows(parse_hlo(zoo_fixture(model, "tiny", "pre").read_text()))
    evaluator = Evaluator(module)
    spec = get_spec("h100")
    plan = stitch.plan(module, "h100")
    args = models.build(model, "tiny").random_args(zlib.crc32(model.encode()))
    values = _node_values(module, [g.graph for g in plan.graphs], args)
    rng = np.random.default_rng(zlib.crc32(model.encode()))
    checked = 0
    for g in plan.graphs:
        reducing = [k for k in g.stitched.kernels if k.schedule is not None and any(
            g.graph.nodes[v].opcode == "reduce" for v in k.members)]
        for k in reducing:
            seen = {_units(k.schedule)}
            bf16 = any(leaf(g.graph.nodes[v].shape).element_type == "bf16" for v in k.members
                       if g.graph.nodes[v].shape.is_array)
            for unit in UNITS:
                try:
                    forced = schedule_kernel(g.graph, k.members, spec, force={"unit": unit})
                except ScheduleError:
                    continue
                if _units(forced) in seen:
                    continue
                seen.add(_units(forced))
                try:
                    lowered = lower_kernel(g.graph, evaluator, forced, f"{k.name}_{unit}")
                except CodegenError as exc:
                    if NEEDS_IN_PLACE not in str(exc):
                        raise
                    lowered = lower_kernel(g.graph, evaluator, forced, f"{k.name}_{unit}",
                                           in_place=True)
                row_units = {p.unit for p in forced.parts if p.kind == "row"}
                if unit != "thread" and unit in row_units:
                    # Lowered as scheduled, or a note says why not.
                    assert unit in lowered.schemes or lowered.notes, lowered.notes
                inputs = {v: values.get((id(g.graph), v)) for v in lowered.inputs}
                for v in inputs:
                    if inputs[v] is None:       # a loop body's parameter: random values
                        inputs[v] = _random(g.graph.nodes[v], rng)
                want = reference_values(g.graph, evaluator, sorted(k.members), inputs)
                got = run_on_host(lowered, g.graph, inputs, opt=0)
                for v, out in got.items():
                    ref = np.asarray(want[v], np.float64)
                    out = out.astype(np.float64)
                    name = f"{model} {k.name} forced {unit}: {g.graph.nodes[v].name}"
                    assert np.array_equal(np.isnan(out), np.isnan(ref)), name
                    ok = ~np.isnan(ref)
                    err = np.linalg.norm(out[ok] - ref[ok]) / max(np.linalg.norm(ref[ok]), 1e-5)
                    # A bf16 value summed in another order can round to a neighbour.
                    tol = BF16_TOLERANCE if bf16 else 1e-4
                    assert err <= tol, f"{name}: relative error {err:.2e}"
                checked += 1
    if checked == 0:
        pytest.skip(f"{model}: no kernel has a legal scheme other than its tuned one")
