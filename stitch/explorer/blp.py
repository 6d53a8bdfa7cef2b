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
time limit, started from the beam's plan (so a time-limited answer is never worse than the
beam's); the report carries the solver status, the relative MIP gap and a proven lower
bound on the optimum.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from stitch.hlo.graph import OpGraph

from ..pricing.delta import CostModel
from ..errors import StitchError
from .cancel import CancelPoll
from .graph_plan import kernel_writes, needs_kernel, producers_needed, resolve_aliases

log = logging.getLogger(__name__)

MAX_CYCLE_CUTS = 50
# Longest single solve when planning can be cancelled (a solve cannot be interrupted).
BLP_SLICE_S = 1.0


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
    # A proven lower bound on the optimum (s): the best of HiGHS's dual bound and the
    # optimum of any solve whose answer was then cut for a cycle (each solve relaxes the
    # final problem). Equals objective_s when the status is optimal.
    lower_bound_s: float = 0.0


def _warm_highs(pulp):
    """PuLP's HiGHS interface with a MIP start: the variables' initial values are handed
    to HiGHS before it runs, so it starts from a known plan (the beam's) and never returns
    anything worse within its time limit."""

    class WarmHiGHS(pulp.HiGHS):
        def callSolver(self, lp):
            import highspy
            variables = lp.variables()
            if any(v.varValue is not None for v in variables):
                start = highspy.HighsSolution()
                values = [0.0] * len(variables)
                for v in variables:
                    values[v.index] = float(v.varValue or 0.0)
                start.col_value = values
                start.value_valid = True
                lp.solverModel.setSolution(start)
            super().callSolver(lp)

    return WarmHiGHS


def solve_blp(graph: OpGraph, cost: CostModel, candidates: list[frozenset[int]],
              time_limit_s: float = 30.0,
              initial: list[frozenset[int]] | None = None,
              poll: CancelPoll | None = None) -> BlpResult:
    """Solve the BLP over ``candidates`` (plus singletons). ``initial``, a valid plan made
    of candidates, is the solver's MIP start. ``poll`` (cancellation) is asked between
    solves, which then run in slices of at most BLP_SLICE_S seconds."""
    import pulp

    start = time.perf_counter()
    candidates = list(candidates) + list(initial or [])
    unique = list(dict.fromkeys(frozenset(c) for c in candidates if c))
    required = [v for v in range(len(graph.nodes)) if needs_kernel(graph, v)]
    present = {v for c in unique for v in c}
    unique.extend(frozenset((v,)) for v in required if v not in present)
    # Times in microseconds keep the solver's tolerances meaningful.
    times = [cost.kernel(c).total_s * 1e6 for c in unique]
    written = [kernel_writes(graph, set(c)) for c in unique]
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
    chosen_start = {frozenset(c) for c in initial or []}
    warm_solver = _warm_highs(pulp)

    cuts = 0
    status = "unknown"
    gap: float | None = None
    chosen_idx: list[int] = []
    bound = 0.0
    while True:
        if poll is not None:
            poll.now()
        remaining = max(1.0, time_limit_s - (time.perf_counter() - start))
        if poll is not None:
            # One solve cannot be interrupted: with a cancel callable, solve in slices
            # (the next slice starts from the best plan so far) and poll between them.
            remaining = min(remaining, BLP_SLICE_S)
        if chosen_start:
            # Start every solve from the given plan: it satisfies every cycle cut, unlike
            # the previous solve's answer.
            for c, xi in zip(unique, x):
                xi.setInitialValue(1 if c in chosen_start else 0)
        solver = warm_solver(msg=False, timeLimit=remaining)
        code = prob.solve(solver)
        status = pulp.LpStatus.get(code, str(code)).lower()
        model = getattr(prob, "solverModel", None)
        if model is not None:
            status = model.modelStatusToString(model.getModelStatus()).lower()
            gap = float(model.getInfo().mip_gap)
            info = model.getInfo()
            if status == "optimal":
                bound = max(bound, float(info.objective_function_value))
            else:
                bound = max(bound, float(getattr(info, "mip_dual_bound", 0.0) or 0.0))
        chosen_idx = [i for i, xi in enumerate(x) if (xi.value() or 0) > 0.5]
        if poll is not None and "time" in status and chosen_idx and \
                time.perf_counter() - start < time_limit_s:
            # The slice ran out: go on from its best plan (cycle-free or not, the
            # solve's start is only a hint).
            chosen_start = {unique[i] for i in chosen_idx} if not _stuck(
                chosen_idx, written, needed) else chosen_start
            continue
        if not chosen_idx:
            raise BlpError(f"graph {graph.name}: BLP found no plan (status {status})")
        stuck = _stuck(chosen_idx, written, needed)
        if not stuck or cuts >= MAX_CYCLE_CUTS:
            break
        chosen_set = set(chosen_idx)
        for cycle in _cycles(stuck, chosen_idx, written, needed):
            # Not all kernels of this cycle, unless another writer of what they wait for
            # is chosen too.
            missing = {v for i in cycle for v in needed[i]} - {
                v for i in chosen_idx if i not in cycle for v in written[i]}
            others = {j for v in missing for j in writers.get(v, []) if j not in chosen_set}
            prob += (pulp.lpSum(x[i] for i in cycle) - pulp.lpSum(x[j] for j in others)
                     <= len(cycle) - 1), f"cycle_{cuts}"
            cuts += 1
    if _stuck(chosen_idx, written, needed):
        raise BlpError(f"graph {graph.name}: BLP plans kept a kernel cycle after {cuts} cuts")
    objective = sum(times[i] for i in chosen_idx) * 1e-6
    return BlpResult([unique[i] for i in chosen_idx], objective, status, gap,
                     time.perf_counter() - start, len(x), prob.numConstraints(), cuts,
                     min(bound * 1e-6, objective))


def _cycles(stuck: list[int], chosen: list[int], written: list[set[int]],
            needed: list[set[int]]) -> list[list[int]]:
    """Disjoint cycles among stuck kernels: i waits on j when i needs a value that only
    stuck kernels write and j is one of them. Short cycles make strong cuts; the whole
    stuck set is the fallback."""
    stuck_set = set(stuck)
    free_values = {v for i in chosen if i not in stuck_set for v in written[i]}
    waits = {i: [j for j in stuck if j != i and any(v in written[j] for v in needed[i]
                                                     if v not in free_values)]
             for i in stuck}
    cycles: list[list[int]] = []
    used: set[int] = set()
    for root in stuck:
        if root in used:
            continue
        # Breadth-first search for the shortest way back to root.
        parent = {root: -1}
        frontier = [root]
        found = -1
        while frontier and found < 0:
            nxt = []
            for i in frontier:
                for j in waits[i]:
                    if j == root:
                        found = i
                        break
                    if j not in parent and j not in used:
                        parent[j] = i
                        nxt.append(j)
                if found >= 0:
                    break
            frontier = nxt
        if found < 0:
            continue
        cycle = []
        node = found
        while node != -1:
            cycle.append(node)
            node = parent[node]
        cycles.append(cycle)
        used.update(cycle)
    return cycles or [list(stuck)]


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
