"""A keras_hub Llama training step as XLA GPU hands it to stitch's pass (deviceless H100,
POST_SCHEDULER): the refined plan, merged and packed again, closed a cycle between kernels
and `stitch.plan` raised PlanError for the whole module. A candidate whose kernels form a
cycle is now set aside (logged) and the module plans."""
from __future__ import annotations

import logging
from pathlib import Path

import stitch
from stitch.explorer.graph_plan import validate
from hlo_fixtures import DATA

FIXTURE = DATA / "regress" / "keras_hub_llama_xla_gpu_h100.hlo.txt"


def test_llama_step_from_xla_gpu_plans_valid(caplog):
    with caplog.at_level(logging.INFO, logger="stitch"):
        plan = stitch.plan(FIXTURE.read_text(), "h100")
    for graph_plan in plan.graphs:
        validate(graph_plan.graph, graph_plan.stitched.kernels)
    summary = plan.summary()
    assert summary["stitched"]["kernels"] < summary["baseline"]["kernels"]
