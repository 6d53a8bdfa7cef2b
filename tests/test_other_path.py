"""merge_adjacent's question, "is b reachable from a other than by their direct edge?",
searched from both ends (stitch.explorer.beam.has_other_path), against a one-sided search
on random DAGs."""
from __future__ import annotations

import random

import pytest

from stitch.explorer.beam import has_other_path


def _random_dag(rng: random.Random, n: int) -> dict[int, set[int]]:
    succ: dict[int, set[int]] = {v: set() for v in range(n)}
    for v in range(n):
        for _ in range(rng.randint(0, 3)):
            # Mostly near successors, some far (a path that skips ahead).
            w = v + (rng.randint(1, 4) if rng.random() < 0.8 else rng.randint(1, n))
            if w < n:
                succ[v].add(w)
    # Relabel at random: node ids carry no order (merged kernels do not).
    names = list(range(n))
    rng.shuffle(names)
    return {names[v]: {names[w] for w in ws} for v, ws in succ.items()}


def _reaches(succ: dict[int, set[int]], start: int, goal: int) -> bool:
    stack, seen = [start], {start}
    while stack:
        v = stack.pop()
        if v == goal:
            return True
        for w in succ[v] - seen:
            seen.add(w)
            stack.append(w)
    return False


@pytest.mark.parametrize("seed", range(5))
def test_both_ended_search_agrees_with_a_one_sided_one(seed: int) -> None:
    rng = random.Random(seed)
    succ = _random_dag(rng, 40)
    pred: dict[int, set[int]] = {v: set() for v in succ}
    for v, ws in succ.items():
        for w in ws:
            pred[w].add(v)
    answers = []
    for a in succ:
        for b in succ:
            if a == b:
                continue
            want = any(_reaches(succ, c, b) for c in succ[a] if c != b)
            got = has_other_path(a, b, succ.__getitem__, pred.__getitem__)
            assert got == want, (a, b)
            answers.append((b in succ[a], want))
    # Adjacent pairs with and without another path both occur.
    assert (True, True) in answers and (True, False) in answers
