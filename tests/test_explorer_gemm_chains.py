"""The planner with GEMM-chain candidates: every MCFuser zoo chain and attention (full size)
plans one gemm_chain kernel on A100 and H100, beam and BLP alike; the option turns them
off (and is part of the plan-cache key); graphs without chains plan as before."""
from __future__ import annotations

import dataclasses

import pytest

import stitch
from bench.plans.gemm_chains import chain_models, compare
from stitch.pricing.chain_pricing import graph_chains
from stitch.cost.gemm_tile import GemmChainSchedule
from stitch.explorer.graph_plan import validate
from stitch.explorer.plan_cache import options_key, plan_key
from stitch.explorer.planner import ExplorerOptions
from tests.fixtures import DATA

MODELS = chain_models()


def _fixture(model: str, stage: str) -> str:
    return (DATA / model / f"full.{stage}.hlo").read_text()


@pytest.mark.parametrize("target", ["a100", "h100"])
@pytest.mark.parametrize("model", MODELS)
def test_zoo_chain_is_planned_when_its_kernel_is_modeled_faster(model, target):
    """Every zoo chain is recognized and priced at a schedule codegen builds; the plan holds
    its gemm_chain kernel when that kernel is clearly faster than XLA's for the same ops
    (>= 1.1x under the latency-evaluator), and not when it is clearly slower (< 0.95x), as
    the GPU pass plans (TF32 tensor cores for f32 dots of DEFAULT precision, as XLA's own
    GEMMs): docs/benchmarks.md records the ratios."""
    from stitch.xla_pass.entry import GPU_CHAIN_TF32
    from stitch.pricing.chain_pricing import chain_dims
    from stitch.schedule.chain_tiling import buildable
    # As the GPU pass plans: f32 chains may use TF32 where the dots allow it.
    plan = stitch.plan(_fixture(model, f"gpu-{target}"), target,
                       options=ExplorerOptions(chain_tf32=GPU_CHAIN_TF32))
    graph = plan.graphs[0].graph
    chains = graph_chains(graph).chains
    assert len(chains) == 1
    validate(graph, plan.graphs[0].stitched.kernels)
    row = compare(model, target)
    kernels = [k for k in plan.kernels if k.kind == "gemm_chain"]
    assert len(kernels) == int(row.planned) <= 1
    if row.latency_ratio >= 1.1:
        assert row.planned, row.latency_ratio
    if row.latency_ratio < 0.95:
        assert not row.planned, row.latency_ratio
    if kernels:
        k = kernels[0]
        assert set(k.members) == set(chains[0].members)
        assert isinstance(k.chain_schedule, GemmChainSchedule)
        assert buildable(chain_dims(graph, chains[0], GPU_CHAIN_TF32), k.chain_schedule)
        assert k.schedule is None and k.modeled_us == pytest.approx(k.cost.total_s * 1e6)
        assert plan.graphs[0].stitched.objective_s < plan.graphs[0].baseline.objective_s


def test_attention_on_h100_is_modeled_faster_as_one_chain_kernel():
    """BERT and ViT attention on H100: the FMA chain kernel beats XLA's GEMM, softmax, GEMM
    (fixture kernels) under the latency-evaluator."""
    for model in ("attention_bert_small", "attention_bert_large", "attention_vit_large"):
        row = compare(model, "h100")
        assert row.planned and row.latency_ratio > 1.5, (model, row.latency_ratio)


def test_option_off_keeps_gemms_apart_and_changes_the_cache_key():
    text = _fixture("attention_bert_base", "gpu-h100")
    off = ExplorerOptions(gemm_chains=False)
    plan = stitch.plan(text, "h100", options=off)
    assert not [k for k in plan.kernels if k.kind == "gemm_chain"]
    assert [k.kind for k in plan.kernels].count("gemm") == 2
    assert options_key(off) != options_key(ExplorerOptions())
    assert plan_key("m", "v", "h100", "beam", off) != plan_key("m", "v", "h100", "beam",
                                                               ExplorerOptions())


def test_blp_weighs_the_chain_like_any_kernel():
    plan = stitch.plan(_fixture("attention_vit_base", "gpu-a100"), "a100", planner="blp")
    assert [k.kind for k in plan.kernels].count("gemm_chain") == 1


def test_pre_optimization_hlo_plans_the_chain_too():
    plan = stitch.plan(_fixture("attention_vit_base", "pre"), "h100")
    assert [k.kind for k in plan.kernels].count("gemm_chain") == 1


def test_graphs_without_chains_plan_as_before():
    text = (DATA / "softmax" / "full.gpu-h100.hlo").read_text()
    on = stitch.plan(text, "h100")
    off = stitch.plan(text, "h100", options=ExplorerOptions(gemm_chains=False))
    assert [k.members for k in on.kernels] == [k.members for k in off.kernels]
    assert on.summary()["stitched"] == off.summary()["stitched"]


def test_compile_builds_the_planned_chain_kernel_and_it_matches():
    """stitch.compile lowers a gemm_chain kernel as planned (stitch.codegen.gemm_chain) and the host
    run matches the evaluator with poisoned outputs."""
    import stitch.hlo
    from stitch import models
    from tests.test_compile import assert_close
    text = (DATA / "gemm_chain_g2" / "tiny.gpu-h100.hlo").read_text()
    exe = stitch.compile(text, "h100", poison_outputs=True, cache=False)
    chains = [k for k in exe.plan.kernels if k.kind == "gemm_chain"]
    assert len(chains) == 1 and exe.fallbacks == []
    assert chains[0].name in {k.name for k in exe.kernels} or \
        any(k.members == tuple(chains[0].members) for k in exe.kernels)
    args = models.build("gemm_chain_g2", "tiny").random_args(7)
    assert_close(exe(*args), stitch.hlo.evaluate(exe.module, args), 1e-4, "g2 tiny")


def test_render_and_summary_accept_the_new_kind():
    from stitch.explorer.render import to_dot, to_html
    plan = stitch.plan(_fixture("gemm_chain_g12", "gpu-h100"), "h100")
    assert plan.summary()["stitched"]["kernels"] == 1
    assert "gemm_chain" in to_html(plan, reasons=True)
    assert "gemm_chain" in to_dot(plan)


def test_cli_json_carries_the_chain_schedule(capsys):
    from stitch.cli import main
    rc = main(["plan", "--model", "attention_bert_base", "--config", "full", "--target",
               "h100", "--json"])
    doc = __import__("json").loads(capsys.readouterr().out)
    assert rc in (0, None)
    chains = [k for g in doc["graphs"] for k in g["stitched"] if k["kind"] == "gemm_chain"]
    assert len(chains) == 1 and chains[0]["chain_schedule"]["block_m"] >= 16


def test_one_model_prices_the_chain_and_the_gemms_it_replaces():
    from stitch.hlo.graph import build_op_graphs
    from stitch.hlo.parser import parse_hlo
    from stitch.pricing.chain_pricing import chain_price, xla_gemm_cost
    from stitch.pricing.delta import CostModel
    from stitch.cost.gpu_specs import get_spec
    spec = get_spec("h100")
    graph = build_op_graphs(parse_hlo(_fixture("attention_bert_base", "gpu-h100")))[0]
    cost = CostModel(graph, spec)
    chain = graph_chains(graph).chains[0]
    for g in (chain.first, chain.second):
        assert cost.singleton(g).total_s == pytest.approx(xla_gemm_cost(graph, g, spec).seconds)
    fused = cost.kernel(chain.members)
    assert fused.total_s == pytest.approx(chain_price(graph, chain, spec).cost.seconds)
    assert cost.gain(frozenset(chain.members)) > 0
    # A GEMM in no chain keeps the FP32 roofline.
    other = build_op_graphs(parse_hlo((DATA / "bert_layer_train" / "full.gpu-h100.hlo")
                                      .read_text()))[0]
    gemms = [n.id for n in other.nodes if n.op_class.name == "COMPUTE"
             and n.id not in graph_chains(other).by_gemm]
    assert gemms and xla_gemm_cost(other, gemms[0], spec) is None
