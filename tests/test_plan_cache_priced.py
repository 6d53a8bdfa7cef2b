"""A plan read back from the disk plan cache is the fresh plan, rebuilt from its stored
priced data (costs, schedules, the baseline) without pricing or tuning anything; an entry
with a changed field, or with priced data that is not plan data, is dropped and the module
planned again; an entry without priced data is still rebuilt, by pricing, to the same plan."""
from __future__ import annotations

import json

import pytest

import stitch
from hlo_fixtures import DATA
from stitch.explorer import plan_cache, planner
from stitch.explorer.options import ExplorerOptions
from stitch.explorer.plan_cache import PlanCache
from stitch.explorer.plan_data import DataError, from_data, to_data
from stitch.xla_pass.pass_planning import XLA_UNITS

# A zoo model before XLA (base fusion; a loop: five graphs) and one as XLA GPU optimized it,
# planned as the XLA pass plans (XLA units, chain settings): stitched kernels with block and
# global scope schedules, a GEMM chain with its schedule, kernels left to XLA with notes.
ZOO = (DATA / "crnn_infer" / "tiny.pre.hlo", ExplorerOptions())
XLA = (DATA / "bert_layer_train" / "tiny.gpu-h100.hlo",
       ExplorerOptions(xla_units=XLA_UNITS, chain_tf32=True, chain_spill_check=True))


def _signature(fusion_plan) -> list:
    """Everything that makes the plan: per graph, the stitched and baseline kernels in launch
    order (name, members, ops, kind, origin, cost, schedule, chain schedule, schedule note)
    and the objective."""
    def kernels(graph_plan):
        return [(k.name, k.members, k.ops, k.kind, k.origin, k.cost, repr(k.schedule),
                 repr(k.chain_schedule), k.schedule_note) for k in graph_plan.kernels]
    return [(g.graph.name, g.stitched.weight, g.stitched.objective_s, g.report.objective_s,
             kernels(g.stitched), kernels(g.baseline)) for g in fusion_plan.graphs]


def _plan(case, cache):
    path, options = case
    return stitch.plan(path.read_text(), "h100", options=options, cache=cache)


def _entry(directory) -> dict:
    [path] = list(directory.glob("*.json"))
    return json.loads(path.read_text())


def _no_pricing_or_tuning(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a cached plan with priced data was priced or tuned again")
    for name in ("make_kernel", "schedule_plan", "planning_cost_model", "launch_order"):
        monkeypatch.setattr(planner, name, refuse)


@pytest.mark.parametrize("case", [ZOO, XLA], ids=["zoo", "xla_units"])
def test_a_plan_read_back_from_disk_is_the_fresh_plan(tmp_path, monkeypatch, case):
    directory = tmp_path / "plans"
    fresh = _plan(case, PlanCache(directory))
    kernels = [k for k in fresh.kernels if k.schedule is not None]
    assert kernels, "the fixture needs scheduled kernels"
    if case is XLA:
        assert any(k.chain_schedule is not None for k in fresh.kernels)
        assert any(p.scope is not None for k in kernels for p in k.schedule.parts)
        assert any(k.schedule_note for k in fresh.kernels)
    else:
        assert len(fresh.graphs) > 1
    store = PlanCache(directory)                            # as a new process would
    _no_pricing_or_tuning(monkeypatch)
    again = _plan(case, store)
    assert store.disk_hits == 1 and store.misses == 0 and store.dropped == 0
    assert again.from_cache
    assert _signature(again) == _signature(fresh)
    assert again.summary()["stitched"] == fresh.summary()["stitched"]
    assert again.summary()["baseline"] == fresh.summary()["baseline"]


def _first_scheduled(data: dict) -> dict:
    return next(k["schedule"] for g in data["graphs"] for k in g["priced"]["kernels"]
                if k["schedule"] is not None)


# Edits of one field each (the entry's digest left as it was).
def _cost(data):
    data["graphs"][0]["priced"]["kernels"][0]["cost"]["f"]["total_s"] *= 1.5


def _schedule(data):
    _first_scheduled(data)["f"]["grid"] += 1


def _baseline(data):
    data["graphs"][0]["priced"]["baseline"][0]["origin"] = "packing"


def _origin(data):
    data["graphs"][0]["origins"][0] = "blp"


@pytest.mark.parametrize("edit", [_cost, _schedule, _baseline, _origin],
                         ids=["cost", "schedule", "baseline", "origin"])
def test_an_entry_with_a_changed_field_is_dropped_and_planned_again(tmp_path, edit):
    directory = tmp_path / "plans"
    fresh = _plan(ZOO, PlanCache(directory))
    stored = _entry(directory)
    data = json.loads(json.dumps(stored))
    edit(data)
    assert data != stored
    [path] = list(directory.glob("*.json"))
    path.write_text(json.dumps(data))
    store = PlanCache(directory)
    again = _plan(ZOO, store)
    assert store.dropped == 1 and store.misses == 1 and store.disk_hits == 0
    assert _signature(again) == _signature(fresh)
    assert _entry(directory) == stored                       # the fresh plan, stored again


# Sealed edits (a correct digest): priced data that is not plan data, or does not fit.
def _kind(data):
    data["graphs"][0]["priced"]["kernels"][0]["kind"] = "bogus"


def _foreign_class(data):
    data["graphs"][0]["priced"]["kernels"][0]["cost"]["c"] = "PlannedKernel"


def _extra_field(data):
    _first_scheduled(data)["f"]["command"] = "rm -rf /"


def _wrong_scalar(data):
    _first_scheduled(data)["f"]["grid"] = "1024"


def _other_members(data):
    schedule = _first_scheduled(data)
    schedule["f"]["members"]["t"] = schedule["f"]["members"]["t"][:-1]


def _unsorted(data):
    baseline = data["graphs"][0]["priced"]["baseline"]
    kernel = next(k for k in baseline if len(k["members"]) > 1)
    kernel["members"].reverse()


def _fewer_priced(data):
    data["graphs"][0]["priced"]["kernels"].pop()


@pytest.mark.parametrize("edit", [_kind, _foreign_class, _extra_field, _wrong_scalar,
                                  _other_members, _unsorted, _fewer_priced],
                         ids=["kind", "foreign_class", "extra_field", "wrong_scalar",
                              "other_members", "unsorted", "fewer_priced"])
def test_sealed_priced_data_that_is_not_plan_data_is_dropped(tmp_path, edit):
    directory = tmp_path / "plans"
    fresh = _plan(ZOO, PlanCache(directory))
    data = _entry(directory)
    edit(data)
    PlanCache(directory).write(data["key"], data)
    store = PlanCache(directory)
    again = _plan(ZOO, store)
    assert store.dropped == 1 and store.misses == 1 and store.disk_hits == 0
    assert _signature(again) == _signature(fresh)


@pytest.mark.parametrize("case", [ZOO, XLA], ids=["zoo", "xla_units"])
def test_an_entry_without_priced_data_is_priced_again_to_the_same_plan(tmp_path,
                                                                      monkeypatch, case):
    """A graph whose priced data has no data form is stored as member sets only; the
    rebuild prices, orders and tunes them as planning does."""
    def no_data_form(result):
        raise DataError("no data form for this test")
    directory = tmp_path / "plans"
    with monkeypatch.context() as patched:
        patched.setattr(plan_cache, "priced_data", no_data_form)
        fresh = _plan(case, PlanCache(directory))
    assert all("priced" not in g for g in _entry(directory)["graphs"])
    store = PlanCache(directory)
    again = _plan(case, store)
    assert store.disk_hits == 1 and store.dropped == 0
    assert _signature(again) == _signature(fresh)


def test_plan_data_refuses_what_is_not_plan_data():
    cost = _plan(ZOO, None).kernels[0].cost
    assert from_data(json.loads(json.dumps(to_data(cost)))) == cost
    with pytest.raises(DataError):
        to_data(object())
    with pytest.raises(DataError):
        to_data({1: 2})
    for data in ({"c": "Path", "f": {}}, {"x": 1}, {"t": [1], "d": {}},
                 {"c": "KernelCost", "f": {"hbm_bytes": 1}}):
        with pytest.raises(DataError):
            from_data(data)
