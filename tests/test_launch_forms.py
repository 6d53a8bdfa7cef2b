"""One rule for global-scope launch forms (stitch.cost.launch_forms): the planner prices a
global-scope pattern only in the form the pass builds under the setting, and none under
"off"."""
from __future__ import annotations

import numpy as np
import pytest

from stitch.hlo import parse_hlo
from stitch.hlo.graph import build_op_graphs
from stitch.pricing.delta import CostModel
from stitch.cost.gpu_specs import get_spec
from stitch.cost.launch_forms import GRID_SYNC_SETTINGS, allows_global, form_for, form_seconds
from stitch.explorer.planner import ExplorerOptions, PlanOptionsError, plan
from stitch.schedule.global_scope import launch_form


def _normalize(rows: int, cols: int) -> str:
    return f"""HloModule m
add {{
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}}
ENTRY e {{
  x = f32[{rows},{cols}] parameter(0)
  z = f32[] constant(0)
  s = f32[] reduce(x, z), dimensions={{0,1}}, to_apply=add
  b = f32[{rows},{cols}] broadcast(s), dimensions={{}}
  ROOT d = f32[{rows},{cols}] divide(x, b)
}}"""


def test_form_rules():
    rng = np.random.default_rng()
    p, c = rng.uniform(1e-6, 1e-4, 2)
    assert form_for("off", p, c) is None and not allows_global("off")
    assert form_for("relaunch", p, c) == "relaunch" and form_seconds("relaunch", p, c) == c
    assert form_for("barrier", p, c) == "barrier" and form_seconds("barrier", p, c) == p
    assert form_for("auto", p, c) == ("relaunch" if c < p else "barrier")
    assert form_seconds("auto", p, c) == min(p, c)
    assert set(GRID_SYNC_SETTINGS) == {"off", "relaunch", "barrier", "auto"}
    with pytest.raises(ValueError):
        form_for("sometimes", p, c)


def _global_members(graph):
    return frozenset(n.id for n in graph.nodes if n.opcode not in ("parameter", "constant"))


@pytest.mark.parametrize("setting", ["off", "relaunch", "barrier", "auto"])
def test_cost_model_prices_a_global_only_pattern_in_the_settings_form(setting):
    rows = int(np.random.default_rng().integers(512, 2048))
    graph = build_op_graphs(parse_hlo(_normalize(rows, 1024)))[0]
    members = _global_members(graph)
    spec = get_spec("h100")
    cost = CostModel(graph, spec, grid_sync=setting)
    if setting == "off":
        assert not cost.stitchable(members)
        return
    analysis = cost.analysis(members)
    assert analysis is not None and analysis.scope == "global"
    from stitch.schedule.global_scope import schedule_global
    got = schedule_global(graph, members, spec, analysis.global_phases, (512,))
    scope = got.parts[0].scope
    want = form_seconds(setting, got.modeled_us * 1e-6, scope.chain_us * 1e-6)
    assert cost.kernel(members).total_s == pytest.approx(want)
    assert launch_form(got, setting) == form_for(setting, got.modeled_us, scope.chain_us)


def test_planner_under_off_offers_no_global_scope_kernel():
    module = parse_hlo(_normalize(2048, 1024))
    off = plan(module, "h100", options=ExplorerOptions(grid_sync="off"))
    for g in off.graphs:
        for k in g.stitched.kernels:
            if k.schedule is not None:
                assert all(p.kind != "global" for p in k.schedule.parts), k.name
    on = plan(module, "h100", options=ExplorerOptions(grid_sync="relaunch"))
    assert any(k.schedule is not None and any(p.kind == "global" for p in k.schedule.parts)
               for g in on.graphs for k in g.stitched.kernels)
    with pytest.raises(PlanOptionsError):
        plan(module, "h100", options=ExplorerOptions(grid_sync="maybe"))
