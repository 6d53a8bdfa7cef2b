"""The chain register model against ptxas (stitch.cost.gemm_tile.chain_registers), and the
chain pricing's ptxas spill check (stitch.pricing.chain_pricing.chain_price): a schedule ptxas
spills is struck, with every schedule codegen builds the same way, and the search settles
on another one."""
from __future__ import annotations

import pytest

from stitch.codegen import toolchain
from stitch.codegen.errors import ToolchainError
from stitch.codegen.gemm_chain import lower_gemm_chain
from stitch.codegen.nvptx import emit_ptx
from stitch.hlo.gemm_chains import find_gemm_chains
from stitch.hlo.graph import build_op_graphs
from stitch.hlo.parser import parse_hlo
from stitch.pricing import chain_pricing
from stitch.pricing.chain_pricing import chain_dims, chain_price
from stitch.cost.gemm_tile import GemmChainSchedule, chain_registers
from stitch.cost.gpu_specs import get_spec
from stitch.schedule.chain_tiling import tiling_for
from tests.fixtures import DATA


def _have_ptxas() -> bool:
    try:
        toolchain.find_ptxas("sm_90", refresh=True)
        return True
    except ToolchainError:
        return False


needs_ptxas = pytest.mark.skipif(not _have_ptxas(), reason="no ptxas on this machine")


def _chain(model: str, target: str):
    graph = build_op_graphs(parse_hlo((DATA / model / f"full.gpu-{target}.hlo").read_text()))[0]
    (chain,) = find_gemm_chains(graph)
    return graph, chain


# Schedules of both kinds, flat and deep, softmax or not: (model, target, arch, schedule).
CASES = [
    ("attention_bert_base", "a100", "sm_80",
     GemmChainSchedule("n(k,h)", 64, 64, 64, 16, 128, 1, 1, True, 1, True)),
    ("gemm_chain_g9", "h100", "sm_90",
     GemmChainSchedule("nk", 64, 128, 16, 32, 128, 1, 1, True, 2, False)),
    ("gemm_chain_g12", "a100", "sm_80",
     GemmChainSchedule("n(k,h)", 128, 64, 16, 128, 256, 1, 1, True, 1, False)),
    ("attention_vit_large", "h100", "sm_90",
     GemmChainSchedule("nk", 64, 64, 64, 32, 128, 1, 1, True, 1, True)),
    ("gemm_chain_g4", "a100", "sm_80",
     GemmChainSchedule("nk", 64, 64, 16, 32, 256, 4, 4, False, 1, False)),
]


@needs_ptxas
@pytest.mark.parametrize("model,target,arch,schedule", CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_register_estimate_within_20_percent_of_ptxas(model, target, arch, schedule):
    graph, chain = _chain(model, target)
    dims = chain_dims(graph, chain, tf32=True)
    kernel = lower_gemm_chain(graph, chain, tiling_for(schedule, chain.h), "chain", arch).kernel
    report = toolchain.assemble(emit_ptx(kernel, arch), arch, kernel_name="chain")["chain"]
    estimate = chain_registers(dims, schedule)
    assert abs(estimate / report.registers - 1) <= 0.20, (estimate, report.registers)


def test_register_estimate_grows_with_the_accumulators_and_fewer_threads():
    graph, chain = _chain("gemm_chain_g4", "h100")
    dims = chain_dims(graph, chain, tf32=True)
    base = GemmChainSchedule("nk", 64, 64, 16, 32, 128, 1, 1, True, 1, False)
    wider = GemmChainSchedule("nk", 64, 128, 16, 32, 128, 1, 1, True, 1, False)
    thinner = GemmChainSchedule("nk", 32, 64, 16, 32, 64, 1, 1, True, 1, False)
    assert chain_registers(dims, wider) > chain_registers(dims, base)
    assert chain_registers(dims, thinner) > chain_registers(dims, base)


def test_spilling_schedule_is_struck_and_the_search_settles_again(monkeypatch):
    graph, chain = _chain("attention_mlp_mixer_b", "h100")
    spec = get_spec("h100")
    chain_pricing._PRICES.clear()
    unchecked = chain_price(graph, chain, spec, tf32=True, check_spills=False)
    bad = tiling_for(unchecked.schedule, chain.h)
    built: list = []

    def fake_spills(graph_, chain_, schedule, spec_, worker=None):
        built.append(schedule)
        return 64 if tiling_for(schedule, chain_.h) == bad else 0

    monkeypatch.setattr(chain_pricing, "spill_bytes", fake_spills)
    checked = chain_price(graph, chain, spec, tf32=True, check_spills=True)
    chain_pricing._PRICES.clear()
    assert built[0] == unchecked.schedule
    assert tiling_for(checked.schedule, chain.h) != bad
    assert len(built) == 2                  # the struck tiling is never built again
    assert checked.cost.seconds >= unchecked.cost.seconds


def test_spill_check_keeps_a_clean_schedule(monkeypatch):
    graph, chain = _chain("attention_bert_base", "a100")
    spec = get_spec("a100")
    chain_pricing._PRICES.clear()
    unchecked = chain_price(graph, chain, spec, tf32=True, check_spills=False)
    monkeypatch.setattr(chain_pricing, "spill_bytes", lambda *args, **kwargs: 0)
    checked = chain_price(graph, chain, spec, tf32=True, check_spills=True)
    chain_pricing._PRICES.clear()
    assert checked.schedule == unchecked.schedule


@needs_ptxas
def test_spill_bytes_builds_through_the_compile_cache(monkeypatch, tmp_path):
    """The real check: ptxas's spill count of the kernel codegen builds for the schedule,
    emitted and assembled once; a second process (here: a fresh cache object on the same
    directory) reads both from the on-disk cache."""
    from stitch.codegen.cache import CompileCache
    graph, chain = _chain("attention_bert_base", "h100")
    spec = get_spec("h100")
    schedule = chain_price(graph, chain, spec, tf32=True, check_spills=False).schedule
    chain_pricing._PRICES.clear()
    monkeypatch.setattr(chain_pricing, "_CACHE", [CompileCache(tmp_path)])
    assert chain_pricing.spill_bytes(graph, chain, schedule, spec) == 0
    stored = {p.name for p in tmp_path.rglob("*") if p.is_file()}
    assert len(stored) >= 2                 # the PTX and the cubin
    monkeypatch.setattr(chain_pricing, "_CACHE", [CompileCache(tmp_path)])
    emitted = []
    import stitch.codegen.gpu_cache as gpu_cache
    monkeypatch.setattr(gpu_cache, "run_isolated",
                        lambda *a, **k: emitted.append(a) or pytest.fail("emitted again"))
    assert chain_pricing.spill_bytes(graph, chain, schedule, spec) == 0
    assert not emitted
