"""Markov-guided schedule construction (Gensor, shared/papers/gensor.txt §IV), for any
schedule space that states its states and actions.

The construction graph's nodes are schedules (states); its edges are scheduling primitives
(actions): tiling / inverse tiling of one loop (double or halve a tile), caching to the next
memory level (global -> shared -> registers: from then on the tiling actions act on the
next level's tiles), and virtual threads (more or fewer threads sharing a tile). A walk
starts at the initial state on the outermost level; at each step every legal action is
weighed by its normalized benefit under the cost model, ``benefit = cost(s) / cost(s')``
(raised to ``sharpness``; an illegal or unlaunchable next state weighs 0), and one is drawn
from those probabilities. As in Gensor's annealing, the cache action's weight is multiplied
by 3 / (1 + exp(-ln(5)/10 * (t - 10))) as the walk's step t grows, so a walk descends the
memory levels and ends when it caches past the last level (or after ``max_steps``). The
Markov property holds because a state's benefit depends only on the state, not on the path
to it. ``walks`` walks run from one seeded RNG (reproducible): the first half start from the
initial states, the second half from the best state found so far; the best state seen on
any walk wins. Every state's cost is computed once (memoized), so a search costs at most
walks x max_steps x actions cost-model calls and far fewer in practice.

Using it for another space: implement :class:`ScheduleSpace` (``initial``, ``levels``,
``actions(state, level)`` returning (name, next state) pairs for the tiling / virtual
thread moves legal at that level, and ``cost(state)`` returning modeled seconds or inf).
A memory-intensive kernel's space (``stitch.schedule.tuner``'s enumeration: row unit, block
size, vector width, sub-roots) maps onto it with the block size as the tiled loop
(double/halve threads), the vector width as the register-level tile, and the row unit as
the memory level (thread -> warp -> block caches a row in registers, shuffles or shared
memory): the construction then samples that product space instead of enumerating it.
"""
from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass
from typing import Generic, Hashable, Protocol, Sequence, TypeVar

log = logging.getLogger(__name__)

S = TypeVar("S", bound=Hashable)

CACHE_ACTION = "cache"


class ScheduleSpace(Protocol[S]):
    """What the construction needs from a schedule space."""

    levels: int

    def initial(self) -> S: ...

    def actions(self, state: S, level: int) -> Sequence[tuple[str, S]]:
        """Tiling / inverse tiling / virtual-thread moves from ``state`` at ``level``
        (the cache action is added by the construction)."""

    def cost(self, state: S) -> float:
        """Modeled seconds of ``state`` (inf when it cannot run)."""


@dataclass
class MarkovResult(Generic[S]):
    best: S
    best_cost: float
    evaluations: int           # distinct states costed
    steps: int                 # actions taken over all walks
    seconds: float
    visited: dict = None       # every state costed -> its cost


def annealed_cache_factor(step: int) -> float:
    """Gensor's schedule for the cache action: 3 / (1 + exp(-ln 5 / 10 * (t - 10)))."""
    return 3.0 / (1.0 + math.exp(-math.log(5.0) / 10.0 * (step - 10)))


def construct(space: ScheduleSpace[S], walks: int = 16, max_steps: int = 48, seed: int = 0,
              sharpness: float = 4.0, starts: Sequence[S] = ()) -> MarkovResult[S]:
    """Markov-guided construction over ``space`` (module docstring). ``starts``: extra
    initial states (a walk cycles through [initial, *starts])."""
    start = time.perf_counter()
    rng = random.Random(seed)
    memo: dict[S, float] = {}

    def cost(state: S) -> float:
        got = memo.get(state)
        if got is None:
            got = memo[state] = space.cost(state)
        return got

    origins = [space.initial(), *starts]
    best = origins[0]
    best_cost = cost(best)
    steps = 0
    for w in range(walks):
        # The first half of the walks start from the initial states, the rest from the
        # best state found so far (Gensor keeps its top results and builds on them).
        state = origins[w % len(origins)] if w < (walks + 1) // 2 else best
        level = 0
        here = cost(state)
        if here < best_cost:
            best, best_cost = state, here
        for t in range(max_steps):
            moves = list(space.actions(state, level))
            weights: list[float] = []
            for _, nxt in moves:
                there = cost(nxt)
                if not math.isfinite(there) or there <= 0:
                    weights.append(0.0)
                elif not math.isfinite(here):
                    weights.append(1.0)            # anything that runs beats a dead end
                else:
                    weights.append((here / there) ** sharpness)
            # Staying on this level has the mean benefit of its moves; the cache action's
            # weight grows with the step (annealing), so the walk moves on.
            legal = [x for x in weights if x > 0]
            base = sum(legal) / len(legal) if legal else 1.0
            weights.append(base * annealed_cache_factor(t))
            moves.append((CACHE_ACTION, state))
            total = sum(weights)
            pick = rng.random() * total
            index = 0
            while index < len(weights) - 1 and pick >= weights[index]:
                pick -= weights[index]
                index += 1
            name, nxt = moves[index]
            steps += 1
            if name == CACHE_ACTION:
                level += 1
                if level >= space.levels:
                    break
                continue
            state, here = nxt, cost(nxt)
            if here < best_cost:
                best, best_cost = state, here
    seconds = time.perf_counter() - start
    log.debug("markov construction: best %.3g s after %d walks, %d steps, %d states in %.3f s",
              best_cost, walks, steps, len(memo), seconds)
    return MarkovResult(best, best_cost, len(memo), steps, seconds, memo)
