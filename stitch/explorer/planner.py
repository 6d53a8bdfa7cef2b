"""The explorer's front door: ``plan(hlo, target, planner) -> FusionPlan``.

Per op graph of the module: the baseline partition (XLA's own fusions when the input is
XLA-optimized HLO, else the base fusion pass), PatternReduction candidates (with remote
fusion), then one of two planners behind one interface:

- ``beam``: beam search (width 3) over the candidates, kernel packing of each beam's plan,
  final choice by modeled time (the latency-evaluator's job once the schedules issue lands);
- ``blp``: the exact BLP over the same candidates plus singletons (and the beam's kernels,
  so it is a true yardstick for beam search).

A stitched plan is never allowed to be worse than the baseline on memory-intensive kernels
or HBM bytes: the baseline (packed) is itself a candidate plan, and plans worse on either
count are set aside with a logged reason.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Collection

from stitch.hlo.graph import OpGraph, build_op_graphs
from stitch.hlo.ir import HloModule
from stitch.hlo.op_classes import OpClass
from stitch.hlo.parser import parse_hlo
from stitch.hlo.segments_as_rows import segments_as_rows
from stitch.hlo.grouped_scatter import holds_grouped_scatter
from stitch.hlo.sorted_runs import holds_run_scatter

from ..analysis.buildable import build_problem
from ..analysis.feasibility import infeasible_reason
from ..cost.gpu_specs import GpuSpec, get_spec
from ..cost.launch_forms import GRID_SYNC_SETTINGS
from ..errors import Cancelled, StitchError
from ..pricing.chain_pricing import (chain_price, graph_chains, guesses_done, guesses_held,
                                     speculating, start_spill_checks)
from ..pricing.delta import CostModel
from ..schedule.kernel_schedule import KernelSchedule
from .beam import Buffer, KernelCycleError, beam_search, merge_adjacent, pack_levels
from .blp import BlpError, solve_blp
from .cancel import CancelPoll
from .graph_plan import (GraphPlan, KernelIO, PlannedKernel, PlannerReport, PlanValidationError,
                         kernel_kind, launch_order, make_kernel, needs_kernel, node_facts,
                         validate)
from .module_plan import FusionPlan, GraphResult
from .options import ExplorerOptions
from .patterns import (MAX_PATTERN_OPS, Candidates, Pattern, PatternExplorer, Vertices,
                       unit_vertices)
from .plan_cache import (PlanCache, StoredGraph, default_plan_cache, module_fingerprint,
                         plan_entry, plan_key, stored_graphs)
from .plan_schedules import (AS_XLA_MADE_IT, ScheduleCache, kept_as_xla, schedule_plan,
                             tuned_schedule)
from .refine import reduction_stages, refine_plan

log = logging.getLogger(__name__)

PLANNERS = ("beam", "blp")


SMALL_GRAPH_OPS = 400
LARGE_GRAPH_PATTERN_OPS = 32
# On graphs over SMALL_GRAPH_OPS, refinement leaves kernels over this many ops alone
# (refine_plan's max_ops; bounded candidate set, see docs/benchmarks.md for its cost).
LARGE_GRAPH_REFINE_OPS = 64
LARGE_GRAPH_KERNEL_OPS = MAX_PATTERN_OPS
LOOKAHEAD_ONLY_OPS = 1000
# Remote fusion (the explorer's virtual producer of all vertices) runs on graphs up to this
# many ops; above, independent kernels are still packed level by level (bounded candidate
# set, see docs/benchmarks.md for its cost).
REMOTE_FUSION_MAX_OPS = 1000
# Above this many ops the packed baseline is finished but not refined (it did not win on
# any large zoo or corpus graph; same modeled time there, dlrm 2.0 -> 1.3 s cpu).
BASELINE_REFINE_MAX_OPS = 1000


def kernel_bound(size: int) -> int:
    """Ops per kernel that merging and packing may build on a graph of ``size`` vertices
    (its ops, or its XLA units)."""
    return MAX_PATTERN_OPS if size <= SMALL_GRAPH_OPS else LARGE_GRAPH_KERNEL_OPS


def pattern_bound(size: int, options: "ExplorerOptions") -> int:
    """Ops per explored pattern on a graph of ``size`` vertices (see
    ExplorerOptions.max_pattern_ops)."""
    if options.max_pattern_ops is not None:
        return options.max_pattern_ops
    return MAX_PATTERN_OPS if size <= SMALL_GRAPH_OPS else LARGE_GRAPH_PATTERN_OPS


# Per graph: XLA's partition (``OpGraph.baseline_groups``), asked for the explorer's units
# and for the baseline kernels of one plan; read, never changed.
_XLA_GROUPS: "weakref.WeakKeyDictionary[OpGraph, tuple[int, dict[str, list[int]]]]" = \
    weakref.WeakKeyDictionary()


def _xla_groups(graph: OpGraph) -> dict[str, list[int]]:
    got = _XLA_GROUPS.get(graph)
    if got is None or got[0] != len(graph.nodes):
        got = _XLA_GROUPS[graph] = (len(graph.nodes), graph.baseline_groups())
    return got[1]


def xla_unit_vertices(graph: OpGraph, options: "ExplorerOptions", source: str
                      ) -> "Vertices | None":
    """The explorer's vertices when ``graph`` is planned with XLA's instructions as units
    (``options.xla_units`` on XLA's own graph, and its units form an acyclic graph), else
    None: planned op by op."""
    if not options.xla_units or source != "xla":
        return None
    vertices = unit_vertices(graph, _xla_groups(graph).values())
    if vertices is None:
        log.info("graph %s: XLA's instructions form no acyclic graph of units; planned "
                 "op by op", graph.name)
    return vertices


class PlanError(StitchError):
    """Planning failed for a reason the caller can act on (bad planner name, bad input)."""


class PlanOptionsError(PlanError, ValueError):
    """ExplorerOptions out of range."""


def _check_options(options: "ExplorerOptions") -> None:
    for name in ("top_k", "beam_width", "group_size"):
        if getattr(options, name) < 1:
            raise PlanOptionsError(f"{name} must be at least 1, got {getattr(options, name)}")
    if options.max_pattern_ops is not None and options.max_pattern_ops < 1:
        raise PlanOptionsError(f"max_pattern_ops must be at least 1, got "
                               f"{options.max_pattern_ops}")
    if options.grid_sync not in GRID_SYNC_SETTINGS:
        raise PlanOptionsError(f"grid_sync must be one of {', '.join(GRID_SYNC_SETTINGS)}, "
                               f"got {options.grid_sync!r}")


def _graph_weights(graphs: list[OpGraph]) -> list[int]:
    """Executions of each graph per module run: loop bodies run trip-count times, loop
    conditions once more (unknown trip counts count once)."""
    weights = [0] * len(graphs)
    if graphs:
        weights[0] = 1
    for gi, graph in enumerate(graphs):
        for node in graph.nodes:
            if not node.subgraphs:
                continue
            base = max(weights[gi], 1)
            if node.opcode == "while":
                trips = graphs[node.subgraphs[0]].trip_count
                body, cond = node.subgraphs[0], node.subgraphs[1]
                weights[body] = max(weights[body], base * (trips or 1))
                weights[cond] = max(weights[cond], base * ((trips + 1) if trips else 1))
            else:
                for sub in node.subgraphs:
                    weights[sub] = max(weights[sub], base)
    return [max(w, 1) for w in weights]


def is_xla_optimized(module: HloModule, graphs: list[OpGraph]) -> bool:
    """XLA's optimized modules are scheduled (``is_scheduled=true`` in the header); an
    unscheduled dump with fusions in it has been through XLA's fusion passes too."""
    if module.attrs.get("is_scheduled", "").strip().lower() == "true":
        return True
    return any(n.xla_group is not None for g in graphs for n in g.nodes)


def places_into_xla(options: "ExplorerOptions", source: str) -> bool:
    """Whether the plan's kernels go into XLA's own module (the XLA pass: XLA units over
    XLA's optimized graph), so a loop body's kernels pay the copies of the loop state they
    write (CostModel(loop_copies=True), stitch.hlo.loop_state)."""
    return options.xla_units and source == "xla"


def baseline_groups(graph: OpGraph, source: str) -> list[frozenset[int]]:
    if source == "xla":
        groups = [frozenset(ids) for ids in _xla_groups(graph).values()]
    else:
        try:
            from stitch.hlo.base_fusion import base_fusion
        except ImportError as exc:
            raise PlanError(f"pre-optimization HLO needs the base fusion pass: {exc}") from exc
        groups = [frozenset(ids) for ids in base_fusion(graph)]
    needs = node_facts(graph).needs
    groups = [g for g in groups if any(needs[v] for v in g)]
    covered = {v for g in groups for v in g}
    groups.extend(frozenset((v,)) for v, need in enumerate(needs) if need and v not in covered)
    return groups


def _packable(graph: OpGraph, members: frozenset[int], cost: CostModel | None = None) -> bool:
    plannable = node_facts(graph).plannable
    if not all(plannable[v] for v in members):
        return False
    if cost is None:
        return infeasible_reason(graph, members) is None
    return cost.stitchable(members)


def _finish(graph: OpGraph, cost: CostModel, groups: list[frozenset[int]], origins: list[str],
            packing: bool, weight: int, prefix: str = "k", size: int | None = None
            ) -> GraphPlan:
    """Kernels from groups: optional packing, launch order, validation. ``size``: the
    graph's size for the merge bound where it is not its op count (XLA units)."""
    if packing:
        mergeable = [_packable(graph, g, cost) for g in groups]
        origin_of = {g: o for g, o in zip(groups, origins)}
        max_ops = kernel_bound(len(graph.nodes) if size is None else size)
        groups = merge_adjacent(graph, cost, groups, mergeable, max_ops)
        origins = [origin_of.get(g, "merged") for g in groups]
        packable = [_packable(graph, g, cost) for g in groups]
        origin_of = {g: o for g, o in zip(groups, origins)}
        packed = pack_levels(graph, cost, groups, packable, max_ops)
        groups = [g for g, _ in packed]
        origins = ["packing" if merged else origin_of.get(g, "single") for g, merged in packed]
    kernels = [make_kernel(graph, cost, g, o) for g, o in zip(groups, origins)]
    # The candidate plans of a graph share most kernels (XLA's, unmerged): their written
    # and needed values are found once.
    io = node_facts(graph).io
    return _named(graph, launch_order(graph, kernels, io), weight, prefix, io)


def _named(graph: OpGraph, kernels: list[PlannedKernel], weight: int,
           prefix: str = "k", io: KernelIO | None = None, check: bool = True) -> GraphPlan:
    """A validated plan from kernels in launch order, kernels named <graph>.<prefix><i>.
    ``io``: the launch order's kernel inputs and outputs (stitch.explorer.graph_plan.KernelIO).
    ``check``: False for a plan known valid (a cached baseline), not validated again."""
    if check:
        validate(graph, kernels, io)
    for i, k in enumerate(kernels):
        k.name = f"{graph.name}.{prefix}{i}"
        k.ops = tuple(graph.nodes[v].name for v in k.members)
    return GraphPlan(graph, kernels, weight)


def holds_own_scatter(graph: OpGraph, members) -> bool:
    """Whether ``members`` hold a scatter stitch generates otherwise than XLA's one atomic
    per update element: added in runs (sorted ids) or in column tiles (groups of distinct
    ids)."""
    return holds_run_scatter(graph, members) or holds_grouped_scatter(graph, members)


def as_xla_made_them(graph: OpGraph, groups: Collection[frozenset[int]]
                     ) -> frozenset[frozenset[int]]:
    """XLA's kernels (``groups``) a kernel of the same members would only redo: all but
    those stitch generates differently (``holds_own_scatter``)."""
    return frozenset(g for g in groups if not holds_own_scatter(graph, g))


def xla_cost_model(graph: OpGraph, spec: GpuSpec, cost: CostModel) -> CostModel:
    """The cost model of XLA's own kernels: ``cost`` unless the graph has a scatter stitch
    generates otherwise (XLA then pays an atomic per update element, ``contention``)."""
    if not holds_own_scatter(graph, range(len(graph.nodes))):
        return cost
    return CostModel(graph, spec, cost.poll, gemm_chains=cost.gemm_chains,
                     chain_tf32=cost.chain_tf32, chain_spill_check=cost.chain_spill_check,
                     chain_grid_sync=cost.chain_grid_sync, grid_sync=cost.grid_sync,
                     loop_copies=cost.loop_copies, left_to_xla=cost.left_to_xla,
                     xla_atomics=True)


def _schedulable_parts(graph: OpGraph, spec: GpuSpec, members: frozenset[int],
                       cache: ScheduleCache, grid_sync: str = "barrier"
                       ) -> list[frozenset[int]] | None:
    """A kernel the feasibility predicate accepted but no schedule can stitch, cut into
    parts that each have one: its stages (cut after every reduction), and a stage that still
    has none cut once more into one part per reduction with its ancestors in the stage
    (shared ancestors go to the first) plus the rest. None when some part still has none."""
    parts: list[frozenset[int]] = []
    for stage in reduction_stages(graph, members):
        if isinstance(tuned_schedule(graph, spec, stage, cache, grid_sync), KernelSchedule):
            parts.append(stage)
            continue
        taken: set[int] = set()
        for r in sorted(v for v in stage if graph.nodes[v].op_class is OpClass.REDUCTION):
            part, stack = {r}, [r]
            while stack:
                for o in graph.nodes[stack.pop()].operands:
                    if o in stage and o not in taken and o not in part:
                        part.add(o)
                        stack.append(o)
            taken |= part
            parts.append(frozenset(part))
        if stage - taken:
            parts.append(frozenset(stage - taken))
    parts = [p for p in parts if any(needs_kernel(graph, v) for v in p)]
    if len(parts) < 2 or not all(isinstance(tuned_schedule(graph, spec, p, cache, grid_sync),
                                            KernelSchedule) for p in parts):
        return None
    return parts


def _split_unschedulable(graph: OpGraph, spec: GpuSpec, cost: CostModel, plan: GraphPlan,
                         cache: ScheduleCache, weight: int) -> GraphPlan | None:
    """The plan with every stitched kernel that has no legal schedule split into parts that
    have one (None when there is none to split, or the split plan is not valid): the
    feasibility predicate is coarser than the schedules' locality rule, and a kernel without
    a schedule would run unstitched."""
    kernels, changed = [], False
    for k in plan.kernels:
        if k.schedule is None and k.schedule_note and k.schedule_note != AS_XLA_MADE_IT \
                and k.kind == "fused" and not kept_as_xla(graph, k.members):
            parts = _schedulable_parts(graph, spec, frozenset(k.members), cache,
                                       cost.grid_sync)
            if parts is not None:
                kernels += [make_kernel(graph, cost, p, "split") for p in parts]
                changed = True
                continue
        kernels.append(make_kernel(graph, cost, frozenset(k.members), k.origin))
    if not changed:
        return None
    try:
        io = node_facts(graph).io
        repaired = _named(graph, launch_order(graph, kernels, io), weight, io=io)
    except PlanValidationError as exc:
        log.debug("graph %s: splitting unschedulable kernels gave no valid plan: %s",
                  graph.name, exc)
        return None
    schedule_plan(graph, spec, repaired, cache, chain_tf32=cost.chain_tf32,
                  chain_spill_check=cost.chain_spill_check,
                  chain_grid_sync=cost.chain_grid_sync, grid_sync=cost.grid_sync,
                  keys=cost.full_structure_key)
    return repaired


def latency_objective_s(graph: OpGraph, spec: GpuSpec, plan: GraphPlan,
                        cache: ScheduleCache, grid_sync: str = "barrier") -> float:
    """Modeled time of a plan under the latency-evaluator: each stitched kernel at its
    tuned schedule's time; GEMM/conv, opaque ops and XLA's kept fusions at the delta cost
    model's time (the same kernels in every candidate plan, so they do not decide). A
    stitched kernel without a legal schedule costs infinity: codegen could not lower it."""
    total = 0.0
    for k in plan.kernels:
        if k.kind == "fused" and k.cost.launches and \
                not kept_as_xla(graph, k.members):
            got = tuned_schedule(graph, spec, frozenset(k.members), cache, grid_sync)
            total += math.inf if isinstance(got, str) else got.modeled_us * 1e-6
        else:
            total += k.cost.total_s
    return total


def chain_patterns(graph: OpGraph, cost: CostModel, locked: list[Pattern]) -> list[Pattern]:
    """A candidate pattern per GEMM chain of the graph (stitch.hlo.gemm_chains) whose
    kernel the GEMM-tile model finds faster than its ops run apart (f > 0), and that takes
    no op of a locked XLA fusion. Free members only a chain reads stay in it; the beam
    and the BLP weigh the pattern like any other."""
    taken = frozenset().union(*(p.members for p in locked)) if locked else frozenset()
    found: list[Pattern] = []
    for chain in graph_chains(graph).chains:
        members = frozenset(chain.members)
        if members & taken:
            log.debug("graph %s: chain at %s overlaps a locked XLA fusion", graph.name,
                      graph.nodes[chain.first].name)
            continue
        try:
            chain_price(graph, chain, cost.spec, tf32=cost.chain_tf32,
                        check_spills=cost.chain_spill_check,
                        grid_sync=cost.chain_grid_sync)
        except ValueError as exc:           # no legal schedule for these dims
            log.debug("graph %s: chain at %s has no schedule: %s", graph.name,
                      graph.nodes[chain.first].name, exc)
            continue
        gain = cost.gain(members)
        if gain <= 0:
            log.debug("graph %s: chain at %s is modeled slower than its ops apart (%.3g s)",
                      graph.name, graph.nodes[chain.first].name, gain)
            continue
        found.append(Pattern(members, gain, "gemm_chain"))
    return found


def _complete(graph: OpGraph, patterns: list[Pattern],
              units: list[frozenset[int]] | None = None
              ) -> tuple[list[frozenset[int]], list[str]]:
    """The patterns plus a kernel for every op they leave that needs one: alone, or with
    ``units`` (XLA's kernels, when patterns are unions of them) the unit it is in."""
    covered = {v for p in patterns for v in p.members}
    groups = [p.members for p in patterns]
    origins = [p.origin for p in patterns]
    if units is not None:
        for g in units:
            if not g & covered:
                groups.append(g)
                origins.append("baseline")
                covered |= g
    for v, need in enumerate(node_facts(graph).needs):
        if need and v not in covered:
            groups.append(frozenset((v,)))
            origins.append("single")
    return groups, origins


# A plan may move this share more memory-intensive bytes than XLA's kernels: a global-scope
# kernel's cross-block partials (a few bytes per block) for a launch saved; a plan moving
# more than that is set aside.
BYTES_SLACK = 0.01


def _memory_counts(plan: GraphPlan) -> tuple[int, int]:
    kernels = [k for k in plan.kernels if k.is_memory]
    return len(kernels), sum(k.cost.hbm_bytes for k in kernels)


def planning_cost_model(graph: OpGraph, spec: GpuSpec, poll: Callable[[], None] | None,
                        options: ExplorerOptions, source: str,
                        base_groups: list[frozenset[int]]) -> CostModel:
    """The cost model a graph is planned with (and a cached plan is priced with again)."""
    return CostModel(graph, spec, poll, gemm_chains=options.gemm_chains,
                     chain_tf32=options.chain_tf32,
                     chain_spill_check=options.chain_spill_check,
                     chain_grid_sync=options.chain_grid_sync,
                     share_structure=options.share_structure,
                     grid_sync=options.grid_sync,
                     loop_copies=places_into_xla(options, source),
                     left_to_xla=base_groups)


@dataclass
class _Explored:
    """What the explorer found for one graph: its patterns (and XLA's locked fusions)."""
    explorer: PatternExplorer
    found: Candidates               # the explorer's result (its stats and reasons)
    patterns: list[Pattern]
    locked: list[Pattern]
    # When the explorer finished (perf_counter): the explore phase's end, before the
    # candidates are completed with XLA's fusions and GEMM chains.
    explored_at: float


def _explore(graph: OpGraph, cost: CostModel, options: ExplorerOptions,
             base_groups: list[frozenset[int]], vertices: Vertices | None, size: int
             ) -> _Explored:
    """Candidate patterns: the explorer's, XLA's convex fusions, GEMM chains; none taking
    an op of an XLA fusion kept whole."""
    explorer = PatternExplorer(graph, cost, options.top_k, options.group_size,
                               options.remote_fusion and size <= REMOTE_FUSION_MAX_OPS,
                               max_pattern_ops=pattern_bound(size, options),
                               vertices=vertices)
    found = explorer.explore()
    explored_at = time.perf_counter()
    patterns = found.all_patterns()
    for g in base_groups:
        if len(g) > 1 and graph.is_convex(g):
            patterns.append(Pattern(g, cost.gain(g), "baseline"))
    # XLA fusions around ops we cannot stitch (a scatter with its index computation) stay
    # as XLA made them: every plan keeps them whole, and no pattern may take their ops.
    locked = [Pattern(g, cost.gain(g), "baseline") for g in base_groups
              if len(g) > 1 and (any(kernel_kind(graph, (v,)) != "fused" for v in g)
                                 or any(build_problem(graph, v) for v in g))]
    if locked:
        taken = frozenset().union(*(p.members for p in locked))
        patterns = [p for p in patterns if not p.members & taken]
    if options.gemm_chains:
        patterns += chain_patterns(graph, cost, locked)
    return _Explored(explorer, found, patterns, locked, explored_at)


def _searched(graph: OpGraph, candidates: _Explored, options: ExplorerOptions, size: int,
              poll: CancelPoll) -> list[Buffer]:
    """The beam searches' buffers that become candidate plans."""
    def trim(members: frozenset[int]) -> Pattern | None:
        got = candidates.explorer.evaluate(members, "trimmed")
        return got if isinstance(got, Pattern) else None

    # The paper ranks buffers by accumulated f; ranking by f plus an optimistic estimate of
    # what the undecided ops can still gain avoids a different set of early mistakes. Both
    # run; the final choice is by modeled time.
    # On large graphs only each search's best buffer becomes a plan: finishing (merging,
    # packing) and refining a plan costs far more than the search, and the runners-up
    # rarely win there (bounded candidate set; small graphs keep every buffer).
    keep = options.beam_width if size <= SMALL_GRAPH_OPS else 1
    # On graphs over LOOKAHEAD_ONLY_OPS only the lookahead search runs (bounded candidate
    # set: each plan costs a finish and a refinement; see docs/benchmarks.md for its cost).
    plain = not options.lookahead_beam or size <= LOOKAHEAD_ONLY_OPS
    patterns = candidates.patterns
    beams = beam_search(graph, patterns, options.beam_width, trim, lookahead=False,
                        poll=poll)[:keep] if plain else []
    if options.lookahead_beam:
        beams += beam_search(graph, patterns, options.beam_width, trim, lookahead=True,
                             poll=poll)[:keep]
    return beams


def _finished_plans(graph: OpGraph, cost: CostModel, beams: list[Buffer], candidates: _Explored,
                    base_groups: list[frozenset[int]], baseline: GraphPlan,
                    options: ExplorerOptions, weight: int, size: int, units: bool
                    ) -> list[tuple[str, GraphPlan]]:
    """Candidate plans: each beam's patterns completed and finished, XLA's own kernels, and
    XLA's kernels finished (merged and packed)."""
    plans: list[tuple[str, GraphPlan]] = []
    for i, buf in enumerate(beams):
        groups, origins = _complete(graph, candidates.locked + list(buf.patterns),
                                    base_groups if units else None)
        try:
            plans.append((f"beam {i}", _finish(graph, cost, groups, origins, options.packing,
                                               weight, size=size)))
        except KernelCycleError as exc:
            # The beam's kernels (recomputed producers shared between patterns) can still
            # close a cycle its bounded check missed: that candidate is dropped, never used.
            log.info("graph %s: beam %d set aside: %s", graph.name, i, exc)
    # XLA's own kernels are always a candidate, and refined like the others (on
    # bert_layer_train_bf16 for V100 that refinement is the best plan): the plan never moves
    # more memory-intensive bytes, or launches more memory-intensive kernels, than XLA (the
    # check in ``_within_baseline``), even where every explored plan would (a loop body's
    # kernels paying their state copies).
    plans.append(("baseline", baseline))
    plans.append(("baseline packed", _finish(graph, cost, base_groups,
                                             ["baseline"] * len(base_groups),
                                             options.packing, weight, size=size)))
    return plans


def _refined_plans(graph: OpGraph, cost: CostModel, plans: list[tuple[str, GraphPlan]],
                   options: ExplorerOptions, weight: int) -> list[tuple[str, GraphPlan]]:
    """Refinement's plans (op-level moves) from the candidate plans, merged and packed
    again and refined once more."""
    added: list[tuple[str, GraphPlan]] = []
    refined_from: set[frozenset[frozenset[int]]] = set()
    to_refine = list(plans)
    if len(graph.nodes) > SMALL_GRAPH_OPS:
        # Large graphs: refine the best beam plan and the packed baseline only
        # (refinement costs seconds per plan there; bounded candidate set).
        beam_plans = [lp for lp in plans if lp[0].startswith("beam")]
        to_refine = [lp for lp in plans if not lp[0].startswith("beam")
                     and len(graph.nodes) <= BASELINE_REFINE_MAX_OPS]
        if beam_plans:
            to_refine.insert(0, min(beam_plans, key=lambda lp: lp[1].objective_s))
    refine_ops = MAX_PATTERN_OPS if len(graph.nodes) <= SMALL_GRAPH_OPS \
        else LARGE_GRAPH_REFINE_OPS
    for label, p in to_refine:
        key = frozenset(frozenset(k.members) for k in p.kernels)
        if key in refined_from:
            continue
        refined_from.add(key)
        kernels, moves = refine_plan(graph, cost, p.kernels, max_ops=refine_ops)
        if not moves:
            continue
        added.append((f"{label} + {moves} refinement moves", _named(graph, kernels, weight)))
        # Splits and recomputation open merges and packs that were not there before:
        # merge and pack again, then refine once more. Merging and packing assume
        # disjoint kernels (one owner per op).
        groups = [frozenset(k.members) for k in kernels]
        if sum(map(len, groups)) == len(frozenset().union(*groups)):
            try:
                again = _finish(graph, cost, groups, [k.origin for k in kernels],
                                options.packing, weight)
            except KernelCycleError as exc:
                log.info("graph %s: %s, merged, set aside: %s", graph.name, label, exc)
                continue
            kernels, more = refine_plan(graph, cost, again.kernels, max_ops=refine_ops)
            added.append((f"{label} + {moves} refinement moves, merged, {more} more",
                          _named(graph, kernels, weight)))
    return added


def _within_baseline(graph: OpGraph, plans: list[tuple[str, GraphPlan]], baseline: GraphPlan
                     ) -> list[tuple[str, GraphPlan]]:
    """The plans launching no more memory-intensive kernels, and moving no more of their
    bytes (``BYTES_SLACK``), than XLA's. Never empty: XLA's own kernels pass."""
    base_kernels, base_bytes = _memory_counts(baseline)
    allowed = []
    for label, p in plans:
        kernels, nbytes = _memory_counts(p)
        if kernels <= base_kernels and nbytes <= base_bytes * (1 + BYTES_SLACK):
            allowed.append((label, p))
        else:
            log.debug("graph %s: %s set aside: %d memory kernels / %d bytes vs baseline %d / %d",
                     graph.name, label, kernels, nbytes, base_kernels, base_bytes)
    return allowed


def _picked(graph: OpGraph, spec: GpuSpec, plans: list[tuple[str, GraphPlan]],
            allowed: list[tuple[str, GraphPlan]], options: ExplorerOptions,
            schedules: ScheduleCache, detail: dict) -> tuple[str, GraphPlan]:
    """The chosen plan among ``allowed`` (its label), by the latency-evaluator or by the
    delta cost model; ``detail`` gets the latency objectives."""
    if options.final_pick == "latency" and options.schedules:
        # The paper's final step (§4.3/§5.3): the latency-evaluator, which sees each
        # kernel's schedule, occupancy and waves, picks among the candidate plans; the
        # delta cost model breaks ties (and stays the BLP's objective).
        latency = {id(p): latency_objective_s(graph, spec, p, schedules, options.grid_sync)
                   for _, p in allowed}
        label, best = min(allowed, key=lambda lp: (latency[id(lp[1])], lp[1].objective_s))
        detail["latency_objectives_s"] = [latency.get(id(p)) for _, p in plans]
        detail["latency_objective_s"] = latency[id(best)]
        return label, best
    return min(allowed, key=lambda lp: lp[1].objective_s)


def _blp_plan(graph: OpGraph, cost: CostModel, pool: list[frozenset[int]], best: GraphPlan,
              base_groups: list[frozenset[int]], report: PlannerReport,
              options: ExplorerOptions, weight: int, poll: CancelPoll, start: float
              ) -> tuple[GraphPlan, PlannerReport]:
    """The BLP's plan over ``pool`` started from ``best``, and its report; the beam plan
    when the solver fails."""
    detail = report.detail
    try:
        result = solve_blp(graph, cost, pool, options.blp_time_limit_s,
                           initial=[frozenset(k.members) for k in best.kernels],
                           poll=poll if options.cancel is not None else None)
    except BlpError as exc:
        log.warning("%s; keeping the beam plan", exc)
        return best, PlannerReport("blp", best.objective_s, time.perf_counter() - start,
                                   status=f"failed: {exc}")
    base_set = set(base_groups)
    kernels = [make_kernel(graph, cost, c, "baseline" if c in base_set else "blp")
               for c in result.chosen]
    io = node_facts(graph).io
    best = _named(graph, launch_order(graph, kernels, io), weight, io=io)
    return best, PlannerReport("blp", result.objective_s, time.perf_counter() - start,
                               result.status, result.gap,
                               {"variables": result.variables,
                                "constraints": result.constraints,
                                "cycle_cuts": result.cuts,
                                "solve_seconds": result.seconds,
                                "lower_bound_s": result.lower_bound_s,
                                "beam_objective_s": report.objective_s,
                                "evaluations": detail["evaluations"],
                                "scored": detail["scored"],
                                "reused": detail["reused"],
                                "structure_hits": detail["structure_hits"]})


def _scheduled(graph: OpGraph, spec: GpuSpec, cost: CostModel, best: GraphPlan,
               schedules: ScheduleCache, base_groups: list[frozenset[int]], units: bool,
               options: ExplorerOptions, weight: int, poll: CancelPoll,
               report: PlannerReport) -> GraphPlan:
    """``best`` with every stitched kernel's schedule; kernels no schedule can stitch split
    into parts that have one."""
    start_schedules = time.perf_counter()
    left_to_xla = as_xla_made_them(graph, base_groups) if units else frozenset()
    schedule_plan(graph, spec, best, schedules, poll, chain_tf32=options.chain_tf32,
                  chain_spill_check=options.chain_spill_check,
                  chain_grid_sync=options.chain_grid_sync, left_to_xla=left_to_xla,
                  grid_sync=options.grid_sync, keys=cost.full_structure_key)
    repaired = _split_unschedulable(graph, spec, cost, best, schedules, weight)
    if repaired is not None:
        best = repaired
        report.detail["split_unschedulable"] = True
    for k in best.kernels:
        if k.schedule is None and k.schedule_note and k.schedule_note != AS_XLA_MADE_IT \
                and k.kind == "fused" and not kept_as_xla(graph, k.members):
            log.warning("graph %s: %s has no schedule, its ops run unstitched: %s",
                        graph.name, k.name, k.schedule_note)
    report.detail["schedule_seconds"] = time.perf_counter() - start_schedules
    return best


def plan_graph(graph: OpGraph, spec: GpuSpec, planner: str, baseline_source: str,
               options: ExplorerOptions, weight: int = 1,
               poll: CancelPoll | None = None) -> GraphResult:
    poll = poll or CancelPoll(options.cancel)
    base_groups = baseline_groups(graph, baseline_source)
    cost = planning_cost_model(graph, spec, poll, options, baseline_source, base_groups)
    baseline = _finish(graph, xla_cost_model(graph, spec, cost), base_groups,
                       ["baseline"] * len(base_groups), False, weight, prefix="b")
    start = time.perf_counter()
    # XLA units: the explorer's vertices are XLA's instructions, and the size bounds below
    # count them (an op-level bound would treat a few hundred fusions as a huge graph).
    vertices = xla_unit_vertices(graph, options, baseline_source)
    units = vertices is not None
    size = len(vertices.members) if units else len(graph.nodes)
    candidates = _explore(graph, cost, options, base_groups, vertices, size)
    phases: dict[str, float] = {"explore_s": candidates.explored_at - start}
    mark = time.perf_counter()
    beams = _searched(graph, candidates, options, size, poll)
    phases["beam_s"] = time.perf_counter() - mark
    mark = time.perf_counter()
    plans = _finished_plans(graph, cost, beams, candidates, base_groups, baseline, options,
                            weight, size, units)
    phases["finish_s"] = time.perf_counter() - mark
    mark = time.perf_counter()
    # Refinement's moves split and recompute single ops, which XLA units keep whole.
    if options.recompute and not units:
        plans += _refined_plans(graph, cost, plans, options, weight)
    phases["refine_s"] = time.perf_counter() - mark
    allowed = _within_baseline(graph, plans, baseline)
    schedules: ScheduleCache = {}
    stats = candidates.found.stats
    detail: dict = {**phases, "evaluations": stats.evaluations,
                    "scored": stats.scored, "reused": stats.reused,
                    "structure_hits": cost.structure_hits,
                    # What the explorer's vertices were: XLA's instructions or ops.
                    "xla_units": units, "vertices": size,
                    "candidates": len(candidates.patterns),
                    "beam_objectives_s": [p.objective_s for _, p in plans]}
    label, best = _picked(graph, spec, plans, allowed, options, schedules, detail)
    detail["choice"] = label
    report = PlannerReport("beam", best.objective_s, time.perf_counter() - start,
                           detail=detail)
    if planner == "blp":
        pool = [p.members for p in candidates.patterns] + \
            [frozenset(k.members) for _, p in plans for k in p.kernels]
        best, report = _blp_plan(graph, cost, pool, best, base_groups, report, options,
                                 weight, poll, start)
    if options.schedules:
        best = _scheduled(graph, spec, cost, best, schedules, base_groups, units, options,
                          weight, poll, report)
    return GraphResult(graph, baseline, best, report, candidates.found.reasons)


def _planned_beside_checks(graph: OpGraph, spec: GpuSpec, planner: str, source: str,
                           options: ExplorerOptions, weight: int, poll: CancelPoll
                           ) -> tuple[GraphResult, list]:
    """``plan_graph`` while the chains' ptxas checks still run: a chain whose check is not
    done is priced at its searched schedule, as if ptxas found no spill (what it mostly
    finds); the guesses made (``chain_pricing.speculating``) come with the result."""
    with speculating() as guesses:
        result = plan_graph(graph, spec, planner, source, options, weight, poll)
    return result, guesses


def _checked(result: GraphResult, guesses: list, graph: OpGraph, spec: GpuSpec, planner: str,
             source: str, options: ExplorerOptions, weight: int, poll: CancelPoll
             ) -> GraphResult:
    """``result`` where each of its guesses held (waiting for the checks), else the graph
    planned again with the checked prices: the plan is always the one they make."""
    if guesses_held(guesses):
        return result
    log.info("graph %s: ptxas struck a chain schedule it was planned with; planning it "
             "again with the checked one", graph.name)
    return plan_graph(graph, spec, planner, source, options, weight, poll)


def _cache_key(module: HloModule, target: str, planner: str,
               options: ExplorerOptions) -> str | None:
    from .plan_cache import code_version
    try:
        return plan_key(module_fingerprint(module), code_version(), target, planner, options)
    except Exception as exc:  # a module the printer cannot print: plan it uncached
        log.warning("plan cache: no fingerprint for %s: %s", module.name, exc)
        return None


def _cached_plan(store: PlanCache, key: str, graphs: list[OpGraph], weights: list[int],
                 source: str, spec: GpuSpec, planner: str, options: ExplorerOptions,
                 poll: CancelPoll) -> "FusionPlan | None":
    """The cached plan for ``key``: from memory, or rebuilt from a disk entry: as priced
    and stored, or (an entry without priced data) from its kernel member sets. A disk entry
    that does not fit, is malformed or does not validate is dropped (None: plan again)."""
    hit = store.memory.get(key)
    if hit is not None:
        store.hits += 1
        return hit
    started = time.perf_counter()
    entry = store.read(key)
    if entry is None:
        return None
    try:
        results = []
        for graph, weight, stored in zip(graphs, weights, stored_graphs(entry, graphs)):
            poll()
            if stored.kernels is not None and stored.baseline is not None:
                # The stored order is the fresh plan's launch order, validated again (what
                # the pass places must be a plan of this graph). The baseline, XLA's own
                # kernels, is placed nowhere: its digest is check enough (validating it
                # took as long as the rest of the rebuild).
                stitched = _named(graph, stored.kernels, weight)
                baseline = _named(graph, stored.baseline, weight, prefix="b", check=False)
            else:
                baseline, stitched = _repriced(graph, weight, stored, source, spec, options,
                                               poll)
            report = PlannerReport(planner, stitched.objective_s, 0.0, status="cached")
            results.append(GraphResult(graph, baseline, stitched, report))
    except Cancelled:
        raise
    except Exception as exc:  # noqa: BLE001 - any entry that does not rebuild is dropped
        # A malformed or stale entry makes stitch plan again, never stay stock for good.
        log.warning("plan cache: entry %s dropped, planning again: %s: %s", key[:12],
                    type(exc).__name__, exc)
        store.drop(key)
        return None
    store.disk_hits += 1
    store.disk_seconds += time.perf_counter() - started
    fusion_plan = FusionPlan(entry.get("module", ""), spec.name, planner, source, results)
    store.remember(key, fusion_plan)
    return fusion_plan


def _repriced(graph: OpGraph, weight: int, stored: StoredGraph, source: str, spec: GpuSpec,
              options: ExplorerOptions, poll: CancelPoll) -> tuple[GraphPlan, GraphPlan]:
    """The baseline and the stitched plan of stored member sets: costed, ordered,
    validated, schedules tuned as planning tunes them."""
    base_groups = baseline_groups(graph, source)
    cost = planning_cost_model(graph, spec, poll, options, source, base_groups)
    baseline = _finish(graph, xla_cost_model(graph, spec, cost), base_groups,
                       ["baseline"] * len(base_groups), False, weight, prefix="b")
    kernels = [make_kernel(graph, cost, m, o) for m, o in zip(stored.sets, stored.origins)]
    io = node_facts(graph).io
    stitched = _named(graph, launch_order(graph, kernels, io), weight, io=io)
    if options.schedules:
        # As planned: with XLA units, the kernels that are one XLA kernel untuned.
        units = xla_unit_vertices(graph, options, source) is not None
        schedule_plan(graph, spec, stitched, {}, poll, chain_tf32=options.chain_tf32,
                      chain_spill_check=options.chain_spill_check,
                      chain_grid_sync=options.chain_grid_sync,
                      left_to_xla=as_xla_made_them(graph, base_groups) if units
                      else frozenset(),
                      grid_sync=options.grid_sync, keys=cost.full_structure_key)
    return baseline, stitched


def plan(hlo: str | HloModule, target: str = "h100", planner: str = "beam",
         options: ExplorerOptions | None = None,
         cancel: Callable[[], bool] | None = None,
         cache: "PlanCache | bool | None" = None) -> FusionPlan:
    """Plan the fusion of ``hlo`` (HLO text or a parsed module) for ``target``.

    ``cancel`` (or ``options.cancel``): a callable polled every ~50 ms of planning work;
    once it returns True, planning stops with PlanCancelled.
    ``cache``: True for the process-wide plan cache (memory + $STITCH_CACHE_DIR/plans), a
    PlanCache, or None/False for none (stitch.explorer.plan_cache).

    Only StitchErrors leave: a bug anywhere in planning is logged with its traceback and
    raised as PlanError (the caller falls back to stock XLA)."""
    _check_options(options or ExplorerOptions())
    try:
        return _plan(hlo, target, planner, options, cancel, cache)
    except StitchError:
        raise
    except Exception as exc:
        log.error("planner failed on an unexpected error", exc_info=True)
        raise PlanError(f"internal planner error: {type(exc).__name__}: {exc}") from exc


def _plan(hlo: str | HloModule, target: str, planner: str, options: ExplorerOptions | None,
          cancel: Callable[[], bool] | None, cache: "PlanCache | bool | None") -> FusionPlan:
    if planner not in PLANNERS:
        raise PlanError(f"unknown planner {planner!r}: choose one of {', '.join(PLANNERS)}")
    spec = get_spec(target)
    options = options or ExplorerOptions()
    if cancel is not None:
        options = dataclasses.replace(options, cancel=cancel)
    poll = CancelPoll(options.cancel)
    if options.final_pick not in ("latency", "delta"):
        raise PlanError(f"unknown final_pick {options.final_pick!r}: choose latency or delta")
    start = time.perf_counter()
    module = parse_hlo(hlo) if isinstance(hlo, str) else hlo
    if options.segments_as_rows:
        module = segments_as_rows(module)
    graphs = build_op_graphs(module)
    source = "xla" if is_xla_optimized(module, graphs) else "base-fusion"
    weights = _graph_weights(graphs)
    store = default_plan_cache() if cache is True else (cache or None)
    key = _cache_key(module, spec.name, planner, options) if store is not None else None
    if store is None or key is None:
        return _fresh_plan(module, graphs, weights, source, spec, planner, options, poll,
                           start, store, key)
    hit = _cached_plan(store, key, graphs, weights, source, spec, planner, options, poll)
    if hit is None:
        # Processes sharing the cache directory plan a module once: the others wait for
        # the entry of the one planning it (plan_cache.PlanCache.planning).
        with store.planning(key, options.cancel):
            hit = _cached_plan(store, key, graphs, weights, source, spec, planner, options,
                               poll)
            if hit is None:
                return _fresh_plan(module, graphs, weights, source, spec, planner, options,
                                   poll, start, store, key)
    hit.seconds = time.perf_counter() - start
    hit.cache_key, hit.from_cache = key, True
    return hit


def _fresh_plan(module: HloModule, graphs: list[OpGraph], weights: list[int], source: str,
                spec: GpuSpec, planner: str, options: ExplorerOptions, poll: CancelPoll,
                start: float, store: PlanCache | None, key: str | None) -> FusionPlan:
    checks = options.gemm_chains and options.chain_spill_check
    if checks:
        # Each chain's ptxas check (a PTX build and ptxas: mostly waiting on a child) runs
        # beside the planner instead of stopping it where it prices the chain.
        for g in graphs:
            start_spill_checks(g, spec, tf32=options.chain_tf32,
                               grid_sync=options.chain_grid_sync, worker=options.spill_worker)
    results = []
    unchecked: list = []        # guesses left for the caller to confirm (defer_spill_checks)
    for g, w in zip(graphs, weights):
        if not checks:
            results.append(plan_graph(g, spec, planner, source, options, w, poll))
            continue
        result, guesses = _planned_beside_checks(g, spec, planner, source, options, w, poll)
        if guesses_done(guesses) or not options.defer_spill_checks:
            result = _checked(result, guesses, g, spec, planner, source, options, w, poll)
        else:
            unchecked += guesses
        results.append(result)
    fusion_plan = FusionPlan(module.name, spec.name, planner, source, results,
                             time.perf_counter() - start, cache_key=key)

    def keep() -> None:
        if store is not None and key is not None:
            store.misses += 1
            store.remember(key, fusion_plan)
            store.write(key, plan_entry(fusion_plan, key))

    def kept_if_held() -> bool:
        held = guesses_held(unchecked)
        if held:
            keep()
        return held

    if unchecked:
        # Kept in the plan cache once the caller found the guesses held.
        fusion_plan.pending_checks = kept_if_held
    else:
        keep()
    log.debug("planned %s for %s with %s in %.2f s: %s", module.name, spec.name, planner,
             fusion_plan.seconds, fusion_plan.summary())
    return fusion_plan
