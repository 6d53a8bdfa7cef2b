"""The exact planner (Korch's kernel orchestration as binary linear programming).

Variables: x_K in {0, 1} for every candidate kernel K (the explorer's patterns, remote and
packed kernels, XLA's groups, and every op alone). Kernels may overlap: an op may be
computed by several chosen kernels (recomputation). Each kernel writes the members used
outside it (multi-output). Minimise sum_K T(K) x_K subject to

- coverage: every op that needs computing is in some chosen kernel;
- outputs: every graph output is written by some chosen kernel;
- dependencies: a chosen kernel's inputs are written by chosen kernels
  (sum_{K' writes p} x_K' >= x_K for each input p of K).

These constraints do not exclude a cycle between two chosen kernels (each writing what the
other reads), so after each solve the launch order is built; if it gets stuck, a cut is
added saying "not all of these stuck kernels unless another writer of their missing inputs
is chosen", and the problem is solved again. Solved with PuLP on HiGHS (highspy) under a
time limit; the report carries the solver status and the relative MIP gap.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from hlo_passes.graph import OpGraph

from ..cost.delta import CostModel
from ..errors import StitchError
from .plan import _written, needs_kernel, producers_needed, resolve_aliases

log = logging.getLogger(__name__)

MAX_CYCLE_CUTS = 50


class BlpError(StitchError):
    """The BLP planner found no feasible plan (solver failure or time limit)."""


@dataclass
class BlpResult:
    chosen: list[frozenset[int]]
    objective_s: float
    status: str               # "optimal" | "time limit" | ...
    gap: float | None         # relative MIP gap reported by HiGHS
    seconds: float
    variables: int
    constraints: int
    cuts: int


def solve_blp(graph: OpGraph, cost: CostModel, candidates: list[frozenset[int]],
              time_limit_s: float = 30.0) -> BlpResult:
    import pulp

    start = time.perf_counter()
    unique = list(dict.fromkeys(frozenset(c) for c in candidates if c))
    required = [v for v in range(len(graph.nodes)) if needs_kernel(graph, v)]
    present = {v for c in unique for v in c}
    unique.extend(frozenset((v,)) for v in required if v not in present)
    # Times in microseconds keep the solver's tolerances meaningful.
    times = [cost.kernel(c).total_s * 1e6 for c in unique]
    written = [_written(graph, set(c)) for c in unique]
    needed = [producers_needed(graph, set(c)) for c in unique]
    writers: dict[int, list[int]] = {}
    for i, w in enumerate(written):
        for v in w:
            writers.setdefault(v, []).append(i)
    containing: dict[int, list[int]] = {}
    for i, c in enumerate(unique):
        for v in c:
            containing.setdefault(v, []).append(i)

    prob = pulp.LpProblem("kernel_orchestration", pulp.LpMinimize)
    if hasattr(prob, "add_variable"):       # PuLP >= 3.3 attaches variables to the model
        x = [prob.add_variable(f"k{i}", cat="Binary") for i in range(len(unique))]
    else:
        x = [pulp.LpVariable(f"k{i}", cat="Binary") for i in range(len(unique))]
    prob += pulp.lpSum(t * xi for t, xi in zip(times, x))
    for v in required:
        prob += pulp.lpSum(x[i] for i in containing.get(v, [])) >= 1, f"cover_{v}"
    for v in resolve_aliases(graph, graph.outputs):
        prob += pulp.lpSum(x[i] for i in writers.get(v, [])) >= 1, f"out_{v}"
    infeasible = []
    for i, need in enumerate(needed):
        for v in need:
            ws = [j for j in writers.get(v, []) if j != i]
            if not ws:
                infeasible.append(i)
                break
            prob += pulp.lpSum(x[j] for j in ws) >= x[i], f"dep_{i}_{v}"
    for i in infeasible:
        prob += x[i] == 0, f"unusable_{i}"

    cuts = 0
    status = "unknown"
    gap: float | None = None
    chosen_idx: list[int] = []
    while True:
        remaining = max(1.0, time_limit_s - (time.perf_counter() - start))
        solver = pulp.HiGHS(msg=False, timeLimit=remaining)
        code = prob.solve(solver)
        status = pulp.LpStatus.get(code, str(code)).lower()
        model = getattr(prob, "solverModel", None)
        if model is not None:
            status = model.modelStatusToString(model.getModelStatus()).lower()
            gap = float(model.getInfo().mip_gap)
        chosen_idx = [i for i, xi in enumerate(x) if (xi.value() or 0) > 0.5]
        if not chosen_idx:
            raise BlpError(f"graph {graph.name}: BLP found no plan (status {status})")
        stuck = _stuck(chosen_idx, written, needed)
        if not stuck or cuts >= MAX_CYCLE_CUTS:
            break
        missing = {v for i in stuck for v in needed[i]} - {
            v for i in chosen_idx if i not in stuck for v in written[i]}
        others = {j for v in missing for j in writers.get(v, []) if j not in chosen_idx}
        prob += (pulp.lpSum(x[i] for i in stuck) - pulp.lpSum(x[j] for j in others)
                 <= len(stuck) - 1), f"cycle_{cuts}"
        cuts += 1
    if _stuck(chosen_idx, written, needed):
        raise BlpError(f"graph {graph.name}: BLP plans kept a kernel cycle after {cuts} cuts")
    objective = sum(times[i] for i in chosen_idx) * 1e-6
    return BlpResult([unique[i] for i in chosen_idx], objective, status, gap,
                     time.perf_counter() - start, len(x), prob.numConstraints(), cuts)


def _stuck(chosen: list[int], written: list[set[int]], needed: list[set[int]]) -> list[int]:
    """Chosen kernels that can never launch (their inputs wait on each other)."""
    available: set[int] = set()
    pending = list(chosen)
    progress = True
    while pending and progress:
        progress = False
        rest = []
        for i in pending:
            if needed[i] <= available:
                available |= written[i]
                progress = True
            else:
                rest.append(i)
        pending = rest
    return pending
