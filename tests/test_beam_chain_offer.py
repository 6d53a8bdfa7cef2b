"""The beam search offers a GEMM chain's pattern where the first pattern competing for its
ops starts (stitch.explorer.beam.offer_points): a pattern that starts earlier and takes part
of the chain (XLA's causal-mask kernel) no longer hides the chain from the beam, whose
accumulated f then decides between them; the look-ahead weighs the chain against what its
ops gain without it."""
from __future__ import annotations

import random

import pytest

from stitch.explorer.beam import CHAIN_ORIGIN, beam_search, chain_op_holders, offer_points
from stitch.explorer.patterns import Pattern
from stitch.hlo import parse_hlo
from stitch.hlo.graph import build_op_graphs

# x -> mask (exp) and the chain's first op (negate); both meet in add -> tanh -> sine.
MODULE = """HloModule m
ENTRY main {
  x = f32[64] parameter(0)
  mask = f32[64] exponential(x)
  first = f32[64] negate(x)
  meet = f32[64] add(first, mask)
  t = f32[64] tanh(meet)
  ROOT out = f32[64] sine(t)
}
"""


@pytest.fixture(scope="module")
def graph():
    return build_op_graphs(parse_hlo(MODULE))[0]


def _ids(graph, *names: str) -> frozenset[int]:
    by_name = {n.name: n.id for n in graph.nodes}
    return frozenset(by_name[n] for n in names)


@pytest.mark.parametrize("lookahead", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_chain_is_compared_with_an_earlier_overlapping_pattern(graph, lookahead, seed):
    rng = random.Random(seed)
    # Gains drawn fresh: the chain gains more than the mask pattern it overlaps.
    mask_gain = rng.uniform(1.0, 5.0)
    chain_gain = mask_gain * rng.uniform(1.1, 2.0)
    mask = Pattern(_ids(graph, "mask", "meet", "t"), mask_gain, "dp")
    chain = Pattern(_ids(graph, "first", "meet", "t", "out"), chain_gain, CHAIN_ORIGIN)
    assert mask.first < chain.first
    best = beam_search(graph, [mask, chain], width=1, lookahead=lookahead)[0]
    assert best.patterns == (chain,)
    assert best.gain == pytest.approx(chain_gain)


@pytest.mark.parametrize("lookahead", [False, True])
def test_a_better_earlier_pattern_still_wins(graph, lookahead):
    mask = Pattern(_ids(graph, "mask", "meet", "t"), 4.0, "dp")
    chain = Pattern(_ids(graph, "first", "meet", "t", "out"), 3.0, CHAIN_ORIGIN)
    best = beam_search(graph, [mask, chain], width=1, lookahead=lookahead)[0]
    assert best.patterns == (mask,)


def test_only_chains_move_and_only_to_a_competitor_before_them(graph):
    mask = Pattern(_ids(graph, "mask", "meet", "t"), 2.0, "dp")
    chain = Pattern(_ids(graph, "first", "meet", "t", "out"), 3.0, CHAIN_ORIGIN)
    late = Pattern(_ids(graph, "t", "out"), 1.0, "dp")
    everything = chain_op_holders([mask, chain, late])
    assert offer_points(chain, everything) == (mask.first, chain.first)
    assert offer_points(chain, chain_op_holders([chain, late])) == (chain.first,)
    assert offer_points(late, everything) == (late.first,)


def _offer_points_by_scan(pattern: Pattern, patterns: list[Pattern]) -> tuple[int, ...]:
    """The reference: a chain's earliest competitor found by a scan of every pattern."""
    if pattern.origin != CHAIN_ORIGIN:
        return (pattern.first,)
    earliest = min((q.first for q in patterns
                    if q.first < pattern.first and q.members & pattern.members),
                   default=pattern.first)
    return (pattern.first,) if earliest == pattern.first else (earliest, pattern.first)


def test_chain_offer_points_from_the_op_holders_match_the_scan():
    """``offer_points`` given ``chain_op_holders`` (one pass over the patterns) offers every
    pattern where the scan over all patterns does: random patterns and chains over 60 ops
    (fresh seeds)."""
    rng = random.Random()
    checked = moved = 0
    for _ in range(20):
        patterns = []
        for _ in range(rng.randint(5, 40)):
            start = rng.randrange(55)
            members = frozenset(rng.sample(range(start, min(60, start + 12)),
                                           rng.randint(2, 5)))
            origin = CHAIN_ORIGIN if rng.random() < 0.25 else "dp"
            patterns.append(Pattern(members, rng.uniform(0.1, 2.0), origin))
        holders = chain_op_holders(patterns)
        for p in patterns:
            want = _offer_points_by_scan(p, patterns)
            assert offer_points(p, holders) == want
            checked += 1
            moved += len(want) == 2
    assert checked > 100 and moved > 5
