"""One rule for shared memory: kernels declare it statically, so the tuner admits no schedule
past what emission builds (the 48 KB per-block limit without the opt-in); a schedule the
tuner took used to be refused by the PTX emitter and thrown away after planning."""
from __future__ import annotations

import pytest

import stitch
from stitch.codegen.nvptx import STATIC_SHARED_LIMIT
from stitch.cost.gpu_specs import get_spec

TARGETS = ("v100", "a100", "h100", "h200")

# A row softmax whose rows are wide enough that caching a block's rows in shared memory
# would need more than 48 KB.
WIDE_SOFTMAX = """HloModule wide_softmax
add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}
mx {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] maximum(a, b)
}
ENTRY main {
  x = f32[64,32768] parameter(0)
  ninf = f32[] constant(-inf)
  m = f32[64] reduce(x, ninf), dimensions={1}, to_apply=mx
  mb = f32[64,32768] broadcast(m), dimensions={0}
  d = f32[64,32768] subtract(x, mb)
  e = f32[64,32768] exponential(d)
  zero = f32[] constant(0)
  s = f32[64] reduce(e, zero), dimensions={1}, to_apply=add
  sb = f32[64,32768] broadcast(s), dimensions={0}
  ROOT r = f32[64,32768] divide(e, sb)
}
"""


@pytest.mark.parametrize("target", TARGETS)
def test_the_tuner_and_the_emitter_share_the_limit(target):
    assert get_spec(target).shared_memory_per_block == STATIC_SHARED_LIMIT


@pytest.mark.parametrize("target", TARGETS)
def test_no_planned_kernel_needs_more_than_emission_builds(target):
    plan = stitch.plan(WIDE_SOFTMAX, target)
    scheduled = [k for k in plan.kernels if k.schedule is not None]
    assert scheduled
    for k in scheduled:
        assert k.smem_bytes <= STATIC_SHARED_LIMIT, (k.name, k.smem_bytes)


def test_the_tuner_refuses_schedules_past_the_static_limit():
    """On a spec whose static limit is tiny (the opt-in's left large), a block-scope schedule
    needing more shared memory than the static limit is refused, whatever the opt-in says."""
    import dataclasses

    from stitch.hlo import parse_hlo
    from stitch.hlo.graph import build_op_graphs
    from stitch.schedule.tuner import ScheduleError, schedule_kernel

    graph = build_op_graphs(parse_hlo(WIDE_SOFTMAX))[0]
    members = [n.id for n in graph.nodes if n.opcode not in ("parameter", "constant")]
    roomy = get_spec("h100")
    block = schedule_kernel(graph, members, roomy, force={"unit": "block"})
    assert block.smem_bytes > 0
    tight = dataclasses.replace(roomy, shared_memory_per_block=block.smem_bytes - 1)
    try:
        smaller = schedule_kernel(graph, members, tight, force={"unit": "block"})
    except ScheduleError as exc:
        assert "static limit" in str(exc)
    else:
        assert smaller.smem_bytes <= tight.shared_memory_per_block
