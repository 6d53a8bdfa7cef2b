"""The chain spill checks started as planning begins (stitch.pricing.chain_pricing
.start_spill_checks): the price the planner gets is the one chain_price computes itself
(schedules ptxas spills struck, errors raised where it asks), each check runs once, and the
worker that emits the PTX is not part of the plan's identity."""
from __future__ import annotations

import random
import threading

import pytest

from stitch.cost.gpu_specs import get_spec
from stitch.explorer.options import ExplorerOptions
from stitch.explorer.plan_cache import plan_key
from stitch.hlo.gemm_chains import find_gemm_chains
from stitch.hlo.graph import build_op_graphs
from stitch.hlo.parser import parse_hlo
from stitch.pricing import chain_pricing
from stitch.pricing.chain_pricing import chain_price, start_spill_checks
from stitch.schedule.chain_tiling import tiling_for
from tests.fixtures import DATA

CHAINS = [("attention_mlp_mixer_b", "h100"), ("attention_bert_base", "a100")]


def _chain(model: str, target: str):
    graph = build_op_graphs(parse_hlo((DATA / model / f"full.gpu-{target}.hlo").read_text()))[0]
    (chain,) = find_gemm_chains(graph)
    return graph, chain


@pytest.fixture(autouse=True)
def _fresh_prices():
    chain_pricing._PRICES.clear()
    yield
    chain_pricing._PRICES.clear()
    assert not chain_pricing._PENDING


class _RandomSpills:
    """A stand-in for ptxas: a random half of the tilings spill (fixed per instance)."""

    def __init__(self, chain) -> None:
        self.chain = chain
        self.rng = random.Random()
        self.verdicts: dict = {}
        self.built: list = []
        self.workers: list = []
        self.lock = threading.Lock()

    def __call__(self, graph, chain, schedule, spec, worker=None):
        tiling = tiling_for(schedule, chain.h)
        with self.lock:
            self.built.append(schedule)
            self.workers.append(worker)
            if tiling not in self.verdicts:
                self.verdicts[tiling] = self.rng.choice((0, 0, 32, 96))
            return self.verdicts[tiling]


@pytest.mark.parametrize("model,target", CHAINS)
def test_prefetched_price_equals_the_one_chain_price_computes(monkeypatch, model, target):
    graph, chain = _chain(model, target)
    spec = get_spec(target)
    spills = _RandomSpills(chain)
    monkeypatch.setattr(chain_pricing, "spill_bytes", spills)
    reference = chain_price(graph, chain, spec, tf32=True, check_spills=True, grid_sync=True)
    reference_builds = list(spills.built)
    chain_pricing._PRICES.clear()
    spills.built.clear()
    worker = object()
    assert start_spill_checks(graph, spec, tf32=True, grid_sync=True, worker=worker) == 1
    got = chain_price(graph, chain, spec, tf32=True, check_spills=True, grid_sync=True)
    assert (got.schedule, got.cost, got.dims) == \
        (reference.schedule, reference.cost, reference.dims)
    assert spills.built == reference_builds          # each schedule built once, same order
    assert set(spills.workers) == {None, worker}     # the reference had no worker
    # Priced now: a second start begins nothing.
    assert start_spill_checks(graph, spec, tf32=True, grid_sync=True, worker=worker) == 0


def test_chain_price_waits_for_the_check_in_flight(monkeypatch):
    graph, chain = _chain(*CHAINS[0])
    spec = get_spec(CHAINS[0][1])
    release = threading.Event()
    calls: list = []

    def slow_spills(graph_, chain_, schedule, spec_, worker=None):
        calls.append(schedule)
        assert release.wait(30)
        return 0

    monkeypatch.setattr(chain_pricing, "spill_bytes", slow_spills)
    start_spill_checks(graph, spec, tf32=True)
    timer = threading.Timer(0.2, release.set)
    timer.start()
    got = chain_price(graph, chain, spec, tf32=True, check_spills=True)
    timer.join()
    assert len(calls) == 1                 # not built again by the asking thread
    unchecked = chain_price(graph, chain, spec, tf32=True, check_spills=False)
    assert got.schedule == unchecked.schedule


def test_an_error_in_the_background_check_reaches_the_asking_planner(monkeypatch):
    graph, chain = _chain(*CHAINS[1])
    spec = get_spec(CHAINS[1][1])
    marker = f"ptxas stand-in failed {random.random()}"

    def broken(*args, **kwargs):
        raise RuntimeError(marker)

    monkeypatch.setattr(chain_pricing, "spill_bytes", broken)
    with pytest.raises(RuntimeError, match="stand-in") as synchronous:
        chain_price(graph, chain, spec, tf32=True, check_spills=True)
    start_spill_checks(graph, spec, tf32=True)
    with pytest.raises(RuntimeError, match="stand-in") as background:
        chain_price(graph, chain, spec, tf32=True, check_spills=True)
    assert str(background.value) == str(synchronous.value) == marker


def test_the_spill_worker_is_not_part_of_the_plan_key():
    options = ExplorerOptions(chain_tf32=True, chain_spill_check=True)
    with_worker = ExplorerOptions(chain_tf32=True, chain_spill_check=True,
                                  spill_worker=object())
    assert plan_key("m", "v", "h100", "beam", options) == \
        plan_key("m", "v", "h100", "beam", with_worker)
    assert plan_key("m", "v", "h100", "beam", options) != \
        plan_key("m", "v", "h100", "beam", ExplorerOptions(chain_tf32=True))


def _signature(plan) -> list:
    return [[(k.name, k.kind, sorted(k.members), repr(k.cost), repr(k.chain_schedule),
              repr(k.schedule)) for k in g.stitched.kernels] for g in plan.graphs]


def _plan_with_checks(monkeypatch, hlo: str, target: str, verdict, background: bool):
    """The module planned with the ptxas check ``verdict(schedule)`` (spill bytes):
    synchronously where the planner asks (the reference), or in the background with the
    planner guessing until it is done (the check held back until the guessed plan is made,
    so the guesses are always taken)."""
    import stitch
    from stitch.explorer import planner
    guessed = threading.Event()
    asked: list = []

    def spills(graph_, chain_, schedule, spec_, worker=None):
        asked.append(schedule)
        if background:
            assert guessed.wait(60)
        return verdict(tiling_for(schedule, chain_.h))

    def held(guesses):
        asked.append(len(guesses))
        guessed.set()
        return real_held(guesses)

    real_held = planner.guesses_held
    with monkeypatch.context() as patched:
        patched.setattr(chain_pricing, "spill_bytes", spills)
        patched.setattr(planner, "guesses_held", held)
        if not background:
            patched.setattr(planner, "start_spill_checks", lambda *a, **k: 0)
        chain_pricing._PRICES.clear()
        plan = stitch.plan(hlo, target, options=ExplorerOptions(chain_tf32=True,
                                                                chain_spill_check=True))
        chain_pricing._PRICES.clear()
    return plan, asked


@pytest.mark.parametrize("strike", [False, True])
def test_a_plan_made_beside_the_checks_is_the_checked_plan(monkeypatch, strike):
    """Planned while the checks run, the plan equals the one planned waiting for them: with
    the guess right (no spill), and with ptxas striking the guessed schedule (the graph is
    planned again)."""
    model, target = CHAINS[0]
    hlo = (DATA / model / f"full.gpu-{target}.hlo").read_text()
    graph, chain = _chain(model, target)
    spec = get_spec(target)
    searched = chain_price(graph, chain, spec, tf32=True, check_spills=False)
    struck = tiling_for(searched.schedule, chain.h)
    rng = random.Random()
    spilled = rng.choice([16, 64, 96])

    def verdict(tiling):
        return spilled if strike and tiling == struck else 0

    reference, asked_ref = _plan_with_checks(monkeypatch, hlo, target, verdict, False)
    got, asked = _plan_with_checks(monkeypatch, hlo, target, verdict, True)
    assert _signature(got) == _signature(reference)
    kernels = [k for g in got.graphs for k in g.stitched.kernels if k.kind == "gemm_chain"]
    assert (tiling_for(kernels[0].chain_schedule, chain.h) != struck) is strike if kernels \
        else True
    # The planner guessed (the check was held back) and the schedules built are the
    # reference's.
    assert [a for a in asked if isinstance(a, int)][0] >= 1
    assert [a for a in asked if not isinstance(a, int)] == \
        [a for a in asked_ref if not isinstance(a, int)]


def test_the_gpu_pass_hands_one_of_its_ptx_children_to_the_spill_checks(monkeypatch):
    from stitch.codegen.isolation import IsolatedWorker
    from stitch.explorer import planner
    from stitch.xla_pass import pass_planning
    from stitch.xla_pass.pass_request import PassRequest
    seen: list = []

    def planned(module, target, options=None, **kwargs):
        seen.append(options)
        raise RuntimeError("stop after planning was asked")

    monkeypatch.setattr(planner, "plan", planned)
    # One child: the process keeps the children it started for later compiles, and other
    # tests count on the one they find.
    monkeypatch.setenv("STITCH_BUILD_THREADS", "1")
    module = parse_hlo((DATA / CHAINS[0][0] / f"full.gpu-{CHAINS[0][1]}.hlo").read_text())
    with PassRequest("f", "h100", "gpu", compile_only=True) as request:
        with pytest.raises(RuntimeError, match="stop after"):
            pass_planning.stitch_module(module, request)
    (options,) = seen
    if pass_planning.GPU_CHAIN_TF32:
        assert options.chain_spill_check
        assert isinstance(options.spill_worker, IsolatedWorker)


@pytest.mark.parametrize("strike", [False, True])
def test_a_plan_that_did_not_wait_is_kept_only_once_its_guesses_held(monkeypatch, tmp_path,
                                                                     strike):
    """defer_spill_checks (the GPU pass): planning returns before the checks end; the plan
    cache keeps the plan only once ``checks_held`` found every guess right, and where ptxas
    struck one, planning again gives the plan the checked prices make."""
    import os

    import stitch
    from stitch.explorer.plan_cache import PlanCache
    model, target = CHAINS[0]
    hlo = (DATA / model / f"full.gpu-{target}.hlo").read_text()
    graph, chain = _chain(model, target)
    searched = chain_price(graph, chain, get_spec(target), tf32=True, check_spills=False)
    struck = tiling_for(searched.schedule, chain.h)
    spilled = random.choice([16, 64, 96])

    def verdict(tiling):
        return spilled if strike and tiling == struck else 0

    reference, _ = _plan_with_checks(monkeypatch, hlo, target, verdict, False)
    release = threading.Event()

    def held_back(graph_, chain_, schedule, spec_, worker=None):
        assert release.wait(60)
        return verdict(tiling_for(schedule, chain_.h))

    os.chmod(tmp_path, 0o700)
    store = PlanCache(tmp_path)
    options = ExplorerOptions(chain_tf32=True, chain_spill_check=True, defer_spill_checks=True)
    chain_pricing._PRICES.clear()
    with monkeypatch.context() as patched:
        patched.setattr(chain_pricing, "spill_bytes", held_back)
        got = stitch.plan(hlo, target, options=options, cache=store)
        assert got.pending_checks is not None        # returned with the check held back
        assert not store.memory and not list(tmp_path.glob("*.json"))
        release.set()
        assert got.checks_held() is (not strike)
        assert got.checks_held() is (not strike)     # asked again: the same answer
    if strike:
        assert not store.memory and not list(tmp_path.glob("*.json"))
        assert _signature(got) != _signature(reference)
        again = stitch.plan(hlo, target, options=options, cache=store)
        assert again.pending_checks is None and again.checks_held()
        assert _signature(again) == _signature(reference)
    else:
        assert list(store.memory) == [got.cache_key] and list(tmp_path.glob("*.json"))
        assert _signature(got) == _signature(reference)
    chain_pricing._PRICES.clear()
