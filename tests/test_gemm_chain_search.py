"""MCFuser's chain space and its search: pruning rules, exhaustive enumeration, Gensor's
Markov-guided construction (reproducible, near the optimum, fast)."""
from __future__ import annotations

import math
import random

import pytest

from stitch.cost.gemm_tile import ChainDims, chain_cost, chain_smem_bytes
from stitch.cost.gpu_specs import get_spec
from stitch.models.mcfuser import ATTENTIONS, GEMM_CHAINS
from stitch.schedule.gemm_chain_space import (EQUIVALENT_WITHIN, SHARED_MEMORY_SLACK, TILING_EXPRESSIONS,
                                              ChainSearchSpace, block_expression,
                                              enumerate_schedules, exhaustive, markov_search,
                                              objective, pruned_expressions)
from stitch.schedule.markov import annealed_cache_factor, construct


def test_expressions_and_rules_1_and_2():
    assert len(TILING_EXPRESSIONS) == 26
    assert block_expression("mhnk") == block_expression("mnkh") == "nk"
    assert block_expression("mkhn") == "kn"
    assert block_expression("nm(k,h)") == "n(k,h)"
    classes = pruned_expressions()
    assert set(classes) == {"nk", "n(k,h)"}          # "kn" pruned by Rule 2
    assert sum(map(len, classes.values())) == 14


@pytest.mark.parametrize("target", ["a100", "h100"])
def test_enumeration_respects_the_limits(target):
    spec = get_spec(target)
    dims = ChainDims(4, 1024, 1024, 128, 128)
    seen = set()
    for s in enumerate_schedules(spec, dims):
        assert s not in seen
        seen.add(s)
        assert chain_smem_bytes(dims, s) <= SHARED_MEMORY_SLACK * spec.shared_memory_per_block_optin
        assert s.threads >= spec.fp32_cores_per_sm
        if s.hoist_a:
            assert s.block_k == dims.k
        if s.expression == "nk":
            assert s.block_h < dims.h                # Rule 1's dedup with the flat kernel
        # Rule 3: tiles divide the power-of-two dims.
        assert dims.m % s.block_m == 0 and dims.n % s.block_n == 0
    assert len(seen) > 100


def test_padding_rule_for_other_dims():
    spec = get_spec("a100")
    dims = ChainDims(16, 256, 256, 80, 80, softmax=True)       # ViT-Huge's head dim
    for s in enumerate_schedules(spec, dims):
        padded = math.ceil(dims.k / s.block_k) * s.block_k
        assert s.block_k == dims.k or (padded - dims.k) / dims.k <= 0.05


SHAPES = [(g, s, False) for g, s in GEMM_CHAINS.items()] + \
    [(sid, s, True) for sid, _, s in ATTENTIONS.values()]


@pytest.mark.parametrize("name,shape,softmax", SHAPES[::4])
def test_markov_finds_near_the_exhaustive_optimum_fast(name, shape, softmax):
    spec = get_spec("h100")
    dims = ChainDims(shape.batch, shape.m, shape.n, shape.k, shape.h, softmax=softmax)
    ex = exhaustive(spec, dims)
    mk = markov_search(spec, dims)
    assert mk.fastest_s >= ex.fastest_s * (1 - 1e-12)      # exhaustive holds the optimum
    assert mk.fastest_s <= 1.25 * ex.fastest_s
    # Each returns a schedule within EQUIVALENT_WITHIN of the fastest it costed.
    assert ex.cost.seconds <= (1 + EQUIVALENT_WITHIN) * ex.fastest_s * (1 + 1e-12)
    assert mk.cost.seconds <= (1 + EQUIVALENT_WITHIN) * mk.fastest_s * (1 + 1e-12)
    assert mk.evaluated < ex.space
    assert mk.seconds < 1.0


def test_markov_is_reproducible_and_seeded():
    spec = get_spec("a100")
    dims = ChainDims(12, 512, 512, 64, 64, softmax=True)
    a = markov_search(spec, dims, seed=3)
    b = markov_search(spec, dims, seed=3)
    assert a.schedule == b.schedule and a.evaluated == b.evaluated


def test_construction_on_a_toy_space_reaches_the_minimum():
    # A space of its own (the protocol is generic): integers 1..64, cost (x - 37)^2 + 1,
    # actions +-1 and x2 / /2 on each of three levels.
    class Toy:
        levels = 3

        def initial(self):
            return 1

        def actions(self, x, level):
            return [(n, y) for n, y in (("inc", x + 1), ("dec", x - 1), ("tile", x * 2),
                                        ("invtile", x // 2)) if 1 <= y <= 64]

        def cost(self, x):
            return (x - 37) ** 2 + 1.0

    got = construct(Toy(), walks=16, max_steps=60, seed=random.Random(1).randrange(100))
    assert got.best == 37 and got.best_cost == 1.0


def test_annealing_grows_the_cache_weight():
    assert annealed_cache_factor(0) < annealed_cache_factor(10) < annealed_cache_factor(30)
    assert annealed_cache_factor(10) == pytest.approx(1.5)


def test_space_actions_stay_legal_or_cost_inf():
    spec = get_spec("a100")
    dims = ChainDims(1, 512, 256, 64, 64)
    space = ChainSearchSpace(spec, dims)
    s = space.initial()
    for level in range(space.levels):
        for _, nxt in space.actions(s, level):
            c = space.cost(nxt)
            assert c == math.inf or (space.legal(nxt) and c == objective(
                spec, chain_cost(spec, dims, nxt)))
