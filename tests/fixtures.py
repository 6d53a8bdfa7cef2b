"""Test helpers: the committed HLO fixtures (``hlo_fixtures``, re-exported) and small
modules and compiles the tests share."""
from __future__ import annotations

from hlo_fixtures import (BF16_TOLERANCE, DATA, GPU_TARGETS, all_fixture_files, fixture_id,
                          tf_fixture_files, uses_bf16, zoo_fixture, zoo_fixture_files)

__all__ = ["BF16_TOLERANCE", "DATA", "GPU_TARGETS", "REDUCERS", "all_fixture_files",
           "compile_with_cpu_pass", "fixture_id", "forced_reduction_schedules",
           "tf_fixture_files", "uses_bf16", "zoo_fixture", "zoo_fixture_files"]


# add/max reducer computations for hand-written test modules: "HloModule m" + REDUCERS.
REDUCERS = """add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}
max {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] maximum(a, b)
}
"""


def compile_with_cpu_pass(fn, *args, name: str | None = None, **jit_kwargs):
    """``jax.jit(fn, **jit_kwargs)`` compiled by XLA CPU with stitch's pass on for it (the
    pass plans for an H100): (the pass's report, the compiled executable)."""
    import jax

    from stitch.xla_pass import entry as xla_pass
    xla_pass.ensure_registered("cpu")
    request = xla_pass.PassRequest(name or fn.__name__, "h100", "cpu")
    lowered = request.prepare(jax.jit(fn, **jit_kwargs).lower(*args))
    with request:
        compiled = lowered.compile()
    return request.result(), compiled


def forced_reduction_schedules(module):
    """Each kernel of ``module``'s plan (h100) that holds a reduce, scheduled with each unit
    the tuner can force on it ("block", "warp"): (graph, kernel members, schedule)."""
    import stitch
    from stitch.cost.gpu_specs import get_spec
    from stitch.schedule import ScheduleError, schedule_kernel
    for g in stitch.plan(module, "h100").graphs:
        for k in g.stitched.kernels:
            if k.schedule is None or not any(g.graph.nodes[v].opcode == "reduce"
                                             for v in k.members):
                continue
            for unit in ("block", "warp"):
                try:
                    forced = schedule_kernel(g.graph, k.members, get_spec("h100"),
                                             force={"unit": unit})
                except ScheduleError:
                    continue
                yield g.graph, k.members, forced
