"""MCFuser's schedule space of a GEMM-chain kernel (shared/papers/mcfuser.txt §III), and
its search: exhaustive enumeration or Gensor's Markov-guided construction (``markov.py``).

Tiling expressions. The chain E = between(A B) D has four cross-tile loops m, n, k, h.
Deep tilings nest all four (4! = 24 orders, e.g. "mhnk"); flat tilings run k and h one
after the other inside n ("mn(k,h)", "nm(k,h)"): 26 expressions. Each statement (load,
compute, store) sits under the loops that index its tile after the DAG hoisting: a load or
store moves out to the rightmost loop indexing it (E's store leaves the n and k loops; A's
load leaves n when the k loop has one trip, ``block_k == k``: ``hoist_a``).

Pruning (MCFuser's rules):
- Rule 1, deduplication by the per-block sub-expression: spatial loops are bound to
  blockIdx (m always; h in deep tilings, where it is a loop of its own), and expressions
  whose remaining per-block loops agree are one candidate: the 24 deep orders give "nk"
  or "kn", the two flat ones "n(k,h)" (26 -> 3). Schedules whose per-block work is the same
  are kept once (a deep "nk" whose h tile is all of h is the flat kernel).
- Rule 2: a reduction loop outside a spatial loop of the intermediate ("kn": k outside n)
  keeps every n-tile of partial scores in shared memory: pruned (3 -> 2).
- Rule 3, padding: a tile must divide a power-of-two dimension; otherwise padding at most 5%.
- Rule 4, shared memory: the estimate (``chain_smem_bytes``, equation (1)) at most 1.2x the
  per-block opt-in limit (the slack MCFuser gives its estimate); then the launch itself is
  checked by occupancy (a schedule over the real limit costs inf and is never chosen).
Plus what a register tile needs: threads x thread tile = block tile, at most 255 registers.

Search. ``enumerate_schedules`` lists the pruned space; ``exhaustive`` costs every one;
``markov_search`` walks it (states = schedules, actions = tile/inverse-tile of m, n, k, h at
the block level, of the thread tile at the register level, caching A (the hoisting) and
more pipeline stages at the shared level, virtual threads = doubling/halving threads (on
tensor cores: warp columns, warps sharing 16 rows that split each n step), MMA on/off).
Both minimize the modeled time; each then returns, among the schedules it costed
within ``EQUIVALENT_WITHIN`` (10%) of its fastest, the one whose busiest SM executes the
fewest flops (``settle``: no recomputed first GEMM where it costs nothing, every SM busy),
the choice least exposed to the model's error about math throughput. ``best_schedule``
caches the winner per chain dims and target.
"""
from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Iterator, Sequence

from ..cost.gemm_tile import (ChainDims, GemmChainSchedule, TileCost, chain_cost,
                              chain_grid, chain_registers, chain_smem_bytes)
from ..cost.gpu_specs import GpuSpec
from .chain_tiling import buildable
from .markov import MarkovResult, construct

__all__ = ["GemmChainSchedule", "TILING_EXPRESSIONS", "block_expression", "pruned_expressions",
           "enumerate_schedules", "exhaustive", "markov_search", "best_schedule",
           "SearchResult", "ChainSearchSpace"]

log = logging.getLogger(__name__)

LOOPS = "mnkh"
TILING_EXPRESSIONS: tuple[str, ...] = tuple(
    ["".join(p) for p in itertools.permutations(LOOPS)] + ["mn(k,h)", "nm(k,h)"])
SHARED_MEMORY_SLACK = 1.2           # MCFuser Rule 4
PADDING_LIMIT = 0.05                # MCFuser Rule 3
TILE_SIZES = (16, 32, 64, 128, 256)
THREADS = (64, 128, 256, 512)
THREAD_TILES = (1, 2, 4, 8)
STAGES = (1, 2, 3)
# Blocks sharing one output tile, each on its share of n (ChainDims.n_splittable only).
N_SPLITS = (1, 2, 4, 8, 16)


def block_expression(expression: str) -> str:
    """Rule 1: the per-block sub-expression once the blockIdx-bound loops are removed
    (m always; h when it is a loop of its own, i.e. in a deep tiling)."""
    if "(" in expression:
        return "n(k,h)"
    return "".join(c for c in expression if c in "nk")


def pruned_expressions() -> dict[str, list[str]]:
    """Per-block sub-expressions surviving Rules 1-2, with the expressions each stands for."""
    classes: dict[str, list[str]] = {}
    for e in TILING_EXPRESSIONS:
        classes.setdefault(block_expression(e), []).append(e)
    # Rule 2: k (the first GEMM's reduction) outside n (a spatial loop of the scores).
    return {sub: exprs for sub, exprs in classes.items() if sub != "kn"}


@lru_cache(maxsize=1024)
def _tile_options(dim: int) -> tuple[int, ...]:
    """Rule 3: tiles dividing a power-of-two dim; else padding within PADDING_LIMIT. A dim
    below the smallest tile is taken whole."""
    options = []
    for t in TILE_SIZES:
        if t > dim and options:
            break
        padded = math.ceil(dim / t) * t
        power_of_two = dim & (dim - 1) == 0
        if (power_of_two and dim % t == 0) or (not power_of_two and
                                               (padded - dim) / dim <= PADDING_LIMIT):
            options.append(t)
    return tuple(options) or (dim,)


def _legal(spec: GpuSpec, dims: ChainDims, s: GemmChainSchedule) -> bool:
    if s.threads % spec.warp_size or s.threads > spec.max_threads_per_block:
        return False
    if s.threads < min(spec.fp32_cores_per_sm, s.block_m * s.block_n):
        return False            # a block narrower than an SM's FP32 lanes leaves lanes idle
    if s.mma and not dims.mma_allowed(spec):
        return False
    if s.hoist_a and s.block_k != dims.k:
        return False
    if s.n_split != 1:
        # Split n only where a grid barrier can run and nothing reduces rows over n; every
        # split gets at least one n step.
        if s.n_split not in N_SPLITS or not dims.n_splittable or \
                s.n_split * s.block_n > dims.n:
            return False
    # Tiles from the Rule 3 options (k may also be taken whole: the hoisting).
    if s.block_m not in _tile_options(dims.m) or s.block_n not in _tile_options(dims.n) or \
            s.block_k not in (*_tile_options(dims.k), dims.k) or \
            s.block_h not in (*_tile_options(dims.h), dims.h):
        return False
    if not s.mma:
        if s.threads * s.thread_m * s.thread_n != s.block_m * s.block_n:
            return False
        if s.thread_m > s.block_m or s.thread_n > s.block_n:
            return False
        second = s.block_m * (dims.h if s.expression != "nk" else s.block_h)
        if second % (s.threads * s.thread_m):
            return False
    else:
        # mma.sync m16n8k8 (TF32) / m16n8k16: every warp owns whole 16 x 8 fragments of
        # both GEMMs' tiles, and the contractions (k, n) and h come in whole fragments.
        warps = s.threads // spec.warp_size
        step = 8 if dims.itemsize == 4 else 16
        if dims.k % step or dims.n % step or dims.h % 8:
            return False
        if s.block_m * s.block_n < warps * 128 or s.block_m < 16:
            return False
        if (s.thread_m, s.thread_n) != (1, 1):
            return False
    if chain_smem_bytes(dims, s) > SHARED_MEMORY_SLACK * spec.shared_memory_per_block_optin:
        return False
    if chain_registers(dims, s) > spec.max_registers_per_thread:
        return False
    return buildable(dims, s)     # only what codegen builds as planned


def objective(spec: GpuSpec, cost: TileCost) -> float:
    """What the search minimizes: the modeled time of the kernel."""
    return cost.seconds


def enumerate_schedules(spec: GpuSpec, dims: ChainDims) -> Iterator[GemmChainSchedule]:
    """Every schedule of the pruned space (module docstring), each per-block form once."""
    ms, ns, ks = _tile_options(dims.m), _tile_options(dims.n), _tile_options(dims.k)
    hs = _tile_options(dims.h)
    k_choices = sorted(set(ks) | {dims.k})
    mma_choices = (False, True) if dims.mma_allowed(spec) else (False,)
    splits = N_SPLITS if dims.n_splittable else (1,)
    for sub in pruned_expressions():
        expression = "nk" if sub == "nk" else "n(k,h)"
        for bm, bn, bk in itertools.product(ms, ns, k_choices):
            # Deep "nk" binds h to blocks; its h tile must be below h (else it is the
            # flat kernel: Rule 1's dedup). The flat kernel stages D in h-tiles of
            # min(h, 64) columns.
            h_tiles = [t for t in hs if t < dims.h] if expression == "nk" else \
                [max((t for t in hs if t <= 64), default=dims.h)]
            for bh, threads, mma, stages in itertools.product(h_tiles, THREADS, mma_choices,
                                                              STAGES):
                for hoist in ((False, True) if bk == dims.k else (False,)):
                    tiles = [(1, 1)] if mma else itertools.product(THREAD_TILES, THREAD_TILES)
                    for tm, tn in tiles:
                        for split in splits:
                            s = GemmChainSchedule(expression, bm, bn, bk, bh, threads, tm,
                                                  tn, mma, stages, hoist, split)
                            if _legal(spec, dims, s):
                                yield s


@dataclass
class SearchResult:
    schedule: GemmChainSchedule
    cost: TileCost
    evaluated: int              # schedules costed
    space: int                  # schedules in the pruned space (exhaustive only; else 0)
    seconds: float
    method: str
    fastest_s: float = math.inf     # the fastest modeled time among the schedules costed
    costed: dict | None = None      # every schedule costed -> its modeled seconds

    def without(self, spec: GpuSpec, dims: ChainDims,
                rejected: frozenset[GemmChainSchedule]) -> "SearchResult":
        """The result ``settle`` gives once ``rejected`` schedules (e.g. ones ptxas spills)
        are struck from the costed ones; ValueError when none is left."""
        remaining = {s: t for s, t in (self.costed or {}).items() if s not in rejected}
        best = settle(spec, dims, remaining)
        return replace(self, schedule=best, cost=chain_cost(spec, dims, best))


# Schedules modeled within this fraction of the fastest are equivalent to the model: among
# them the search takes the one whose busiest SM executes the fewest flops (executed
# flops per block x blocks per SM: no recomputed first GEMM, little padding, every SM
# busy), which is the least exposed to the model's error about math throughput.
EQUIVALENT_WITHIN = 0.10


def settle(spec: GpuSpec, dims: ChainDims,
           costed: dict[GemmChainSchedule, float]) -> GemmChainSchedule:
    """The schedule a search returns from the ones it costed (EQUIVALENT_WITHIN)."""
    finite = {s: t for s, t in costed.items() if math.isfinite(t)}
    if not finite:
        raise ValueError(f"no legal schedule for chain {dims}")
    fastest = min(finite.values())
    near = [s for s, t in finite.items() if t <= fastest * (1 + EQUIVALENT_WITHIN)]

    def rank(s: GemmChainSchedule) -> tuple:
        c = chain_cost(spec, dims, s)
        busiest = c.flops / max(c.blocks, 1) * math.ceil(c.blocks / spec.sm_count)
        return (busiest, c.seconds, s.text())
    return min(near, key=rank)


def exhaustive(spec: GpuSpec, dims: ChainDims) -> SearchResult:
    start = time.perf_counter()
    costed: dict[GemmChainSchedule, float] = {}
    for s in enumerate_schedules(spec, dims):
        costed[s] = objective(spec, chain_cost(spec, dims, s))
    best = settle(spec, dims, costed)
    return SearchResult(best, chain_cost(spec, dims, best), len(costed), len(costed),
                        time.perf_counter() - start, "exhaustive", min(costed.values()), costed)


class ChainSearchSpace:
    """The chain's schedules as Gensor states (``markov.ScheduleSpace``).

    Levels: 0 global (block tiles m, n, k, h of the tiling expression; switching the
    expression), 1 shared (caching A: the hoisting; pipeline stages), 2 registers (thread
    tile, MMA on/off). Virtual threads (threads x2 / /2) are legal on every level (on tensor
    cores, where they are warp columns, on the register level)."""

    levels = 3

    def __init__(self, spec: GpuSpec, dims: ChainDims):
        self.spec, self.dims = spec, dims
        self._legal: dict[GemmChainSchedule, bool] = {}
        self.evaluations = 0

    def initial(self) -> GemmChainSchedule:
        d = self.dims
        bm = min(64, max(_tile_options(d.m)))
        bn = min(64, max(_tile_options(d.n)))
        bk = min(32, max(_tile_options(d.k)))
        bh = max((t for t in _tile_options(d.h) if t <= 64), default=d.h)
        return GemmChainSchedule("n(k,h)", bm, bn, bk, bh, 128, 4, 4, False, 1, False)

    def legal(self, s: GemmChainSchedule) -> bool:
        got = self._legal.get(s)
        if got is None:
            got = self._legal[s] = _legal(self.spec, self.dims, s)
        return got

    def cost(self, s: GemmChainSchedule) -> float:
        if not self.legal(s):
            return math.inf
        self.evaluations += 1
        return objective(self.spec, chain_cost(self.spec, self.dims, s))

    def actions(self, s: GemmChainSchedule, level: int) -> Sequence[tuple[str, GemmChainSchedule]]:
        d = self.dims
        moves: list[tuple[str, GemmChainSchedule]] = []

        def add(name: str, nxt: GemmChainSchedule) -> None:
            if nxt != s:
                moves.append((name, nxt))

        # Virtual threads on every level; on tensor cores (more / fewer warp columns over
        # the same rows) at the register level only, where the MMA action lives.
        for f in (2, 0.5) if not s.mma or level == 2 else ():
            threads = int(s.threads * f)
            if 32 <= threads <= 1024:
                # Virtual threads: the same block tile over more (fewer) threads, the
                # register tile shrinking (growing) along its longer side.
                tm, tn = s.thread_m, s.thread_n
                if not s.mma:
                    if f == 2:
                        tm, tn = (tm // 2, tn) if tm >= tn else (tm, tn // 2)
                    else:
                        tm, tn = (tm * 2, tn) if tm <= tn else (tm, tn * 2)
                    if min(tm, tn) < 1:
                        continue
                add("vthread", replace(s, threads=threads, thread_m=tm, thread_n=tn))
        if level == 0:
            for name, field_, limit in (("m", "block_m", d.m), ("n", "block_n", d.n),
                                        ("k", "block_k", d.k), ("h", "block_h", d.h)):
                value = getattr(s, field_)
                for f in (2, 0.5):
                    size = int(value * f)
                    if 16 <= size <= max(limit, 16):
                        nxt = replace(s, **{field_: size})
                        if field_ == "block_k" and size != d.k:
                            nxt = replace(nxt, hoist_a=False)
                        kept = self._fit_threads(nxt, field_)
                        add(("tile " if f == 2 else "invtile ") + name, kept)
                        if s.mma and field_ == "block_m":
                            # Also the one-warp-column layout of the new rows.
                            one = replace(nxt, threads=2 * size)
                            if one != kept and 32 <= one.threads <= 1024:
                                add(("tile " if f == 2 else "invtile ") + name, one)
            if d.n_splittable:
                # Split n across more (fewer) blocks: the cross-block combine's partials.
                for f, name in ((2, "split n"), (0.5, "unsplit n")):
                    split = int(s.n_split * f)
                    if split in N_SPLITS:
                        add(name, replace(s, n_split=split))
            other = "nk" if s.expression == "n(k,h)" else "n(k,h)"
            bh = s.block_h if other == "n(k,h)" else min(s.block_h, max(d.h // 2, 16))
            add("expression", replace(s, expression=other, block_h=bh))
        elif level == 1:
            if s.block_k != d.k:
                add("cache A", self._fit_threads(replace(s, block_k=d.k, hoist_a=True),
                                                 "block_k"))
            else:
                add("cache A" if not s.hoist_a else "uncache A", replace(s, hoist_a=not s.hoist_a))
            for st in (s.stages + 1, s.stages - 1):
                if 1 <= st <= max(STAGES):
                    add("stages", replace(s, stages=st))
        else:
            if self.dims.mma_allowed(self.spec):
                add("mma", self._fit_threads(replace(s, mma=True, thread_m=1, thread_n=1), "")
                    if not s.mma
                    else self._fit_threads(replace(s, mma=False, thread_m=4, thread_n=4), ""))
            if not s.mma:
                for field_ in ("thread_m", "thread_n"):
                    for f in (2, 0.5):
                        size = int(getattr(s, field_) * f)
                        if 1 <= size <= 8:
                            nxt = replace(s, **{field_: size})
                            threads = s.block_m * s.block_n // max(nxt.thread_m * nxt.thread_n, 1)
                            if 32 <= threads <= 1024:
                                add(("tile " if f == 2 else "invtile ") + field_,
                                    replace(nxt, threads=threads))
        return moves

    def _fit_threads(self, s: GemmChainSchedule, changed: str) -> GemmChainSchedule:
        """After a block tile changes, keep the register tile and move the thread count
        so threads x thread tile = block tile (FMA); MMA: warps of 16 rows, the threads kept
        as warp columns where they fit, as codegen lays it out (stitch.schedule.chain_tiling)."""
        if s.mma:
            # Keep the block's threads as warp columns where they divide into whole rows of
            # warps (a smaller block_m at the same threads: more warp columns), else one.
            columns = s.threads // (2 * s.block_m)
            whole = s.threads % (2 * s.block_m) == 0 and columns >= 1 and \
                columns & (columns - 1) == 0
            threads = s.threads if whole else 2 * s.block_m
            return replace(s, threads=threads) if 32 <= threads <= 1024 else s
        threads = s.block_m * s.block_n // max(s.thread_m * s.thread_n, 1)
        if threads > 1024:
            return s
        return replace(s, threads=max(threads, 32))


def _filling_split(spec: GpuSpec, dims: ChainDims,
                   s: GemmChainSchedule) -> GemmChainSchedule | None:
    """``s`` with the fewest n splits whose grid covers every SM (the most that fit n
    when none does); None when that is no split."""
    fits = [x for x in N_SPLITS if x > 1 and x * s.block_n <= dims.n]
    if not fits:
        return None
    covering = [x for x in fits if chain_grid(dims, replace(s, n_split=x)) >= spec.sm_count]
    return replace(s, n_split=min(covering) if covering else max(fits))


def markov_search(spec: GpuSpec, dims: ChainDims, walks: int = 32, max_steps: int = 48,
                  seed: int = 0) -> SearchResult:
    """Gensor's Markov-guided construction over the chain's space (``markov.construct``)."""
    space = ChainSearchSpace(spec, dims)
    starts = []
    if dims.mma_allowed(spec):
        mma = space._fit_threads(replace(space.initial(), mma=True, thread_m=1, thread_n=1),
                                 "")
        # Tensor cores with one and with two warp columns (warps sharing 16 rows).
        starts += [mma, replace(mma, threads=2 * mma.threads)]
    if dims.n_splittable:
        # The same starts with n split until the grid fills the SMs: the split schedules
        # sit far from the unsplit ones (every tile move changes how many splits fit).
        starts += [x for x in (_filling_split(spec, dims, s)
                               for s in [space.initial(), *starts]) if x is not None]
    if not any(space.legal(s) for s in [space.initial(), *starts]):
        # Small chains (tiles below the default ones): start from the first legal
        # schedule of the pruned space.
        first = next(enumerate_schedules(spec, dims), None)
        if first is not None:
            starts.append(first)
    result: MarkovResult = construct(space, walks=walks, max_steps=max_steps, seed=seed,
                                     starts=starts)
    if not math.isfinite(result.best_cost):
        raise ValueError(f"no legal schedule found for chain {dims}")
    best = settle(spec, dims, result.visited)
    return SearchResult(best, chain_cost(spec, dims, best), space.evaluations,
                        0, result.seconds, "markov", result.best_cost, result.visited)


_BEST: dict[tuple, SearchResult] = {}


def best_schedule(spec: GpuSpec, dims: ChainDims, method: str = "markov") -> SearchResult:
    """The best schedule found for a chain on a target, cached per (dims, target, method)."""
    key = (dims.key, spec.name, method)
    got = _BEST.get(key)
    if got is None:
        got = exhaustive(spec, dims) if method == "exhaustive" else markov_search(spec, dims)
        _BEST[key] = got
    return got
