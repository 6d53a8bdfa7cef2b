"""Gather lowered by index propagation against the reference evaluator's gather: embedding
lookups, index vectors not in the last dim, batching dims, start indices clamped from both
sides in every integer index type (dynamic slices share the clamp), and a gather feeding a
row reduction."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from stitch.codegen.lower import lower_kernel
from stitch.codegen.values import leaf
from stitch.hlo import parse_hlo
from stitch.hlo.evaluator.dtypes import numpy_dtype
from stitch.hlo.evaluator.interpreter import Evaluator
from stitch.hlo.graph import build_op_graphs
from stitch.cost.gpu_specs import get_spec
from stitch.schedule import ScheduleError, schedule_kernel
from tests.test_lowering import HEAD, _check

# Index ranges per index type: out of range below (signed types) and above the operand.
INDEX_RANGES = {"s8": (-100, 100), "u8": (0, 256), "s32": (-40, 60), "u32": (0, 2**32),
                "s64": (-2**40, 2**40)}


def _gather_modules(index_type: str) -> dict[str, str]:
    return {
        # ids -> rows of a table (jnp.take / nn.Embed): the row dim is collapsed.
        "embedding": f"""
  table = f32[50,16] parameter(0)
  ids = {index_type}[8,5] parameter(1)
  g = f32[8,5,16] gather(table, ids), offset_dims={{2}}, collapsed_slice_dims={{0}},
    start_index_map={{0}}, index_vector_dim=2, slice_sizes={{1,16}}
  two = f32[] constant(2)
  tb = f32[8,5,16] broadcast(two), dimensions={{}}
  ROOT o = f32[8,5,16] multiply(g, tb)""",
        # Index vectors along dim 0 of the indices, windows in two operand dims, offset
        # dims around the batch dim.
        "vector_dim_first": f"""
  x = f32[7,9,5] parameter(0)
  idx = {index_type}[2,6] parameter(1)
  ROOT g = f32[3,6,2] gather(x, idx), offset_dims={{0,2}}, collapsed_slice_dims={{0}},
    start_index_map={{0,2}}, index_vector_dim=0, slice_sizes={{1,3,2}}""",
        # take_along_axis: a full index vector per element, nothing collapsed.
        "take_along_axis": f"""
  x = f32[6,11] parameter(0)
  idx = {index_type}[6,2] parameter(1)
  g = f32[6,1,1] gather(x, idx), offset_dims={{1,2}}, collapsed_slice_dims={{}},
    start_index_map={{0,1}}, index_vector_dim=1, slice_sizes={{1,1}}
  ROOT n = f32[6,1,1] negate(g)""",
        # Batching dims: batch b reads only from operand batch b.
        "batched": f"""
  x = f32[4,10,6] parameter(0)
  idx = {index_type}[4,3,1] parameter(1)
  ROOT g = f32[4,3,6] gather(x, idx), offset_dims={{2}}, collapsed_slice_dims={{1}},
    operand_batching_dims={{0}}, start_indices_batching_dims={{0}}, start_index_map={{1}},
    index_vector_dim=2, slice_sizes={{1,1,6}}""",
    }


# Gathered rows feeding a softmax-like row part (reductions over the gathered dim).
GATHER_REDUCE = """
  table = f32[30,40] parameter(0)
  ids = s32[12] parameter(1)
  g = f32[12,40] gather(table, ids), offset_dims={1}, collapsed_slice_dims={0},
    start_index_map={0}, index_vector_dim=1, slice_sizes={1,40}
  ninf = f32[] constant(-inf)
  zero = f32[] constant(0)
  m = f32[12] reduce(g, ninf), dimensions={1}, to_apply=max
  mb = f32[12,40] broadcast(m), dimensions={0}
  d = f32[12,40] subtract(g, mb)
  e = f32[12,40] exponential(d)
  s = f32[12] reduce(e, zero), dimensions={1}, to_apply=add
  sb = f32[12,40] broadcast(s), dimensions={0}
  ROOT o = f32[12,40] divide(e, sb)"""


def _module(body: str):
    module = parse_hlo(f"{HEAD}ENTRY main {{\n{body}\n}}\n")
    graph = build_op_graphs(module)[0]
    members = [n.id for n in graph.nodes if n.opcode not in ("parameter", "constant")]
    return module, graph, members


def _inputs(graph, lowered, rng, index_range: tuple[int, int]) -> dict[int, np.ndarray]:
    out = {}
    for v in lowered.inputs:
        shape = leaf(graph.nodes[v].shape)
        dtype = numpy_dtype(shape.element_type)
        if dtype.kind == "f":
            out[v] = rng.standard_normal(shape.dims).astype(dtype)
        else:
            out[v] = rng.integers(*index_range, shape.dims, dtype=np.int64).astype(dtype)
    return out


def _lower(module, graph, members, name: str, unit: str | None = None):
    force = {"unit": unit} if unit else None
    schedule = schedule_kernel(graph, members, get_spec("h100"), force=force)
    return lower_kernel(graph, Evaluator(module), schedule, name)


@pytest.mark.parametrize("index_type", sorted(INDEX_RANGES))
@pytest.mark.parametrize("case", sorted(_gather_modules("s32")))
def test_gather_matches_the_reference_with_clamped_indices(case, index_type):
    module, graph, members = _module(_gather_modules(index_type)[case])
    lowered = _lower(module, graph, members, f"{case}_{index_type}")
    rng = np.random.default_rng(11)
    lo, hi = INDEX_RANGES[index_type]
    inputs = _inputs(graph, lowered, rng, (lo, hi))
    index_values = np.concatenate([a.ravel().astype(np.int64) for a in inputs.values()
                                   if a.dtype.kind in "iu"])
    # Both clamps are exercised: some starts below 0 (signed types), some past the end.
    gather = next(n for n in graph.nodes if n.opcode == "gather")
    largest = max(leaf(graph.nodes[gather.operands[0]].shape).dims)
    assert index_values.max() >= largest
    assert index_type.startswith("u") or index_values.min() < 0
    _check(graph, Evaluator(module), members, lowered, rng, inputs)


def test_in_range_embedding_lookup_reads_the_named_rows():
    # Clamping must leave in-range ids alone: every row of the table is read exactly.
    module, graph, members = _module(_gather_modules("s32")["embedding"])
    lowered = _lower(module, graph, members, "embedding_in_range")
    rng = np.random.default_rng(3)
    _check(graph, Evaluator(module), members, lowered, rng,
           _inputs(graph, lowered, rng, (0, 50)))


@pytest.mark.parametrize("unit", ["warp", "block", "thread"])
def test_gather_feeding_a_row_reduction(unit):
    module, graph, members = _module(GATHER_REDUCE)
    try:
        lowered = _lower(module, graph, members, f"gather_softmax_{unit}", unit)
    except ScheduleError:
        pytest.skip(f"{unit} composition is not legal")
    assert lowered.schemes == [unit], lowered.notes
    rng = np.random.default_rng(5)
    _check(graph, Evaluator(module), members, lowered, rng,
           _inputs(graph, lowered, rng, (-5, 35)))


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not found")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_gather_kernels_assemble_without_spills(arch):
    from stitch.codegen.isolation import run_isolated
    from stitch.codegen.nvptx import emit_ptx
    from stitch.codegen.toolchain import assemble

    cases = [(_gather_modules(t)["embedding"], None, f"embedding_{t}") for t in ("u32", "s64")]
    cases += [(GATHER_REDUCE, unit, f"gather_softmax_{unit}") for unit in ("warp", "block")]
    for body, unit, name in cases:
        module, graph, members = _module(body)
        lowered = _lower(module, graph, members, name, unit)
        # LLVM aborts kill their process: emission runs in a child.
        ptx = run_isolated(emit_ptx, lowered.kernel, arch)
        report = assemble(ptx, arch)[lowered.kernel.name]
        assert report.spill_store_bytes == 0 and report.spill_load_bytes == 0


@pytest.mark.parametrize("index_type", sorted(INDEX_RANGES))
def test_dynamic_slice_clamps_wide_and_narrow_start_types(index_type):
    module, graph, members = _module(f"""
  x = f32[9,40] parameter(0)
  i = {index_type}[] parameter(1)
  j = {index_type}[] parameter(2)
  ROOT d = f32[4,7] dynamic-slice(x, i, j), dynamic_slice_sizes={{4,7}}""")
    lowered = _lower(module, graph, members, f"dynamic_slice_{index_type}")
    rng = np.random.default_rng(9)
    lo, hi = INDEX_RANGES[index_type]
    for starts in ((lo, lo), (hi - 1, hi - 1), (lo, hi - 1), (3, 20)):
        inputs = _inputs(graph, lowered, rng, (0, 1))
        for v, s in zip(lowered.inputs[1:], starts):
            inputs[v] = np.asarray(s).astype(inputs[v].dtype)
        _check(graph, Evaluator(module), members, lowered, rng, inputs)
