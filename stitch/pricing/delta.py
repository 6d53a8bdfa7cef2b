"""The delta-evaluator (FusionStitching §5.4): f = T_reduced_mem + T_reduced_calls - T_penalty.

f(P) is what forming pattern P saves against running each of its ops as its own kernel, so
a plan's modeled time is sum(singletons) - sum(f). Every term comes from one kernel time
model, cheap enough to call thousands of times:

    T(K) = launch + C + M - 0.95 * min(C, M)          (XLA's GpuPerformanceModel overlap)

- M, memory: HBM bytes of K (each outside value read once, only the part K's outputs
  depend on, e.g. the gathered rows or the slice; each value used outside written once, an
  in-place dynamic-update-slice only its update; ``kernel_hbm_bytes``) over the bandwidth K
  can draw. A kernel draws full bandwidth only with enough threads in flight: we take one
  SM saturated at 1024 resident threads (half of its 2048; Little's law with ~16 B in
  flight per thread and ~600-cycle DRAM latency), so bandwidth scales with
  min(1, threads / (SMs * 1024)); a loop kernel runs a thread per element it computes (only
  the gathered or sliced ones under a gather or slice). Values that stay inside K live in
  registers (free) or, when shared by a block, in shared memory at its documented 128 B/clk/SM
  (``GpuSpec.shared_memory_bandwidth``).
- C, compute: thread instructions over the FP32 lanes of the SMs K engages, counting
  recomputation (thread composition recomputes a light producer for every consumer element;
  reductions and expanded expensive ops are sub-roots computed once and shared, §4.2).
  Instruction costs per op class are in ``instruction_costs``.
- Parallelism, the simplified latency-evaluator's occupancy (§5.4: 16 registers, so registers
  never limit): a pattern with a shared reduction runs one row per warp (rows of <= 256) or
  per block, or, for reductions over non-minor dimensions, 32 columns per block of 1024
  threads; a pattern without one runs one thread per output element.

A pattern only the global scope stitches (a persistent kernel with grid barriers)
is timed by that scope's schedule model (``stitch.schedule.global_scope``); with
``GLOBAL_RIVAL`` a pattern the block scopes stitch too is timed by the faster of the two.

T_reduced_mem = sum M(op) - M(P); T_reduced_calls = (launches(ops) - 1) * launch;
T_penalty is the rest of the difference (recomputation, lost parallelism, overlap).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable

from stitch.hlo.graph import OpGraph, OpNode
from stitch.hlo.loop_state import carried_copies, carried_nodes
from stitch.hlo.op_classes import OpClass

from ..analysis.buildable import build_problem
from ..analysis.feasibility import Infeasible, PatternAnalysis, analyze_pattern
from ..cost.contention import contention_seconds, tiles_prices
from ..cost.hbm_traffic import (element_count, graph_facts, in_place_updates, inside_users,
                                kernel_hbm_bytes, utilization)
from ..cost.gemm_rates import dot_flops, gemm_dot, gemm_precision, gemm_time
from ..cost.launch_forms import allows_global
from ..cost.gpu_specs import XLA_MEMORY_COMPUTE_PARALLELISM, GpuSpec
from .structure import StructureKeys, rename

SATURATING_THREADS_PER_SM = 1024
WARP_ROW_LIMIT = 256         # rows up to this length are reduced by one warp each
# Cost a pattern the block scopes stitch under the global scope too, keeping the faster.
# Off: over the zoo's training graphs the plans it led to modeled 0.3-1% slower under the
# latency-evaluator (delta's block-scope times of column reductions are optimistic, so
# the two disagree on which plan wins); the schedules still pick the global scope for a
# kernel where the latency-evaluator says it is faster (docs/benchmarks.md, global scope).
GLOBAL_RIVAL = False


@dataclass(frozen=True)
class KernelCost:
    hbm_bytes: int
    launches: int            # 0 for a kernel of free ops, else 1
    memory_s: float
    compute_s: float
    threads: int
    total_s: float
    # The loop-state copies placing the kernel in a loop body adds (stitch.hlo.loop_state),
    # included in hbm_bytes and total_s (CostModel(loop_copies=True)): bytes copied, µs.
    loop_copy_bytes: int = 0
    loop_copy_s: float = 0.0
    # Colliding scatter atomics serialized per address (stitch.cost.contention), included
    # in total_s.
    contention_s: float = 0.0

    def with_loop_copies(self, copy: "KernelCost", nbytes: int) -> "KernelCost":
        """This kernel followed by the copy kernel ``copy`` of ``nbytes`` loop state."""
        return dataclasses.replace(
            self, hbm_bytes=self.hbm_bytes + copy.hbm_bytes,
            total_s=self.total_s + copy.total_s, loop_copy_bytes=nbytes,
            loop_copy_s=copy.total_s)

    def without_loop_copies(self) -> "KernelCost":
        """The kernel alone (the copies priced apart, as the rewrite actually added them)."""
        if not self.loop_copy_bytes:
            return self
        return dataclasses.replace(
            self, hbm_bytes=self.hbm_bytes - 2 * self.loop_copy_bytes,
            total_s=self.total_s - self.loop_copy_s, loop_copy_bytes=0, loop_copy_s=0.0)


@dataclass(frozen=True)
class Delta:
    f: float
    reduced_mem_s: float
    reduced_calls_s: float
    penalty_s: float


_UNKNOWN = object()         # a set whose structure key was not computed


def _no_poll() -> None:
    return None


class CostModel:
    """Kernel times of op sets of one graph on one GPU, cached by member set."""

    def __init__(self, graph: OpGraph, spec: GpuSpec, poll: Callable[[], None] | None = None,
                 gemm_chains: bool = True, chain_tf32: bool = False,
                 chain_spill_check: bool = False, chain_grid_sync: bool = False,
                 share_structure: bool = True, grid_sync: str = "barrier",
                 loop_copies: bool = False,
                 left_to_xla: Iterable[frozenset[int]] = (),
                 xla_atomics: bool = False):
        self.graph = graph
        # Price colliding scatters as XLA generates them (an atomic per update element):
        # the model of XLA's own kernels. Else as stitch does (sorted ids added in runs).
        self.xla_atomics = xla_atomics
        # Kernels placed into an XLA module (the XLA pass): in a loop body every loop-state
        # value a kernel writes goes through a copy (stitch.hlo.loop_state), priced into the
        # kernel's cost, so a kernel that loses with its copies is not planned. XLA's own
        # kernels (``left_to_xla``: member sets the pass leaves to XLA) write the state in
        # place, and a single op is the reference the planner's gains are counted from:
        # neither pays copies.
        self.loop_copies = loop_copies and graph.kind != "entry" and \
            bool(carried_nodes(graph))
        self.left_to_xla = frozenset(left_to_xla) if self.loop_copies else frozenset()
        # The global-scope launch forms the target builds (stitch.schedule.launch_forms,
        # ExplorerOptions.grid_sync): "off" prices no global-scope-only pattern, the others
        # price one in the form the pass will build.
        self.grid_sync = grid_sync
        self.allow_global = allows_global(grid_sync)
        # Chain schedules may split n across blocks (ExplorerOptions.chain_grid_sync).
        self.chain_grid_sync = chain_grid_sync
        # Chain schedules ptxas spills are struck (ExplorerOptions.chain_spill_check).
        self.chain_spill_check = chain_spill_check
        # Chain kernels may use TF32 tensor cores for f32 dots that allow them (GPU paths).
        self.chain_tf32 = chain_tf32
        # Price GEMM chains and their GEMMs with the GEMM-tile model (chain_pricing); off:
        # every GEMM keeps the FP32 roofline and no chain is recognized.
        self.gemm_chains = gemm_chains
        # Called at every kernel scored or pattern analyzed: the planner's cancellation
        # poll (stitch.explorer.cancel), which raises to stop planning.
        self.poll: Callable[[], None] = poll or _no_poll
        self.spec = spec
        self._cache: dict[frozenset[int], KernelCost] = {}
        self.elements = graph_facts(graph).elements
        self.free = [graph.is_free(n.id) for n in graph.nodes]
        self.saturation = spec.sm_count * SATURATING_THREADS_PER_SM
        self._single_total: dict[int, float] = {}
        self._feasible: dict[frozenset[int], PatternAnalysis | str] = {}
        # Results shared by member sets of the same structure (stitch.pricing.structure):
        # repeated layers score each distinct kernel shape once. Verdicts keep the reason's
        # wording with the first set's names, renamed on reuse.
        self.share_structure = share_structure
        self.structure = StructureKeys(graph)
        self._key_of: dict[frozenset[int], Hashable | None] = {}
        self._part_keys: dict[frozenset[int], Hashable] = {}
        self._first_of: dict[tuple[int, int], frozenset[int]] = {}
        self._cost_by_key: dict[Hashable, KernelCost] = {}
        self._verdict_by_key: dict[Hashable, tuple[str | None, tuple[str, ...]]] = {}
        self.structure_hits = 0
        self.fresh = 0                  # analyses and kernel costs computed, not shared

    # --- feasibility -------------------------------------------------------------------
    def feasibility(self, members: Iterable[int]) -> PatternAnalysis | str:
        """The stitching analysis of ``members``, or why they cannot be stitched, cached by
        member set: the explorer, refinement, merging and packing ask about the same
        unions again and again, once per candidate plan."""
        key = members if isinstance(members, frozenset) else frozenset(members)
        got = self._feasible.get(key)
        if got is None:
            self.poll()
            self.fresh += 1
            try:
                got = analyze_pattern(self.graph, key, allow_global=self.allow_global)
            except Infeasible as exc:
                got = str(exc)
            self._feasible[key] = got
            skey = self.structure_key(key)
            if skey is not None and skey not in self._verdict_by_key:
                self._verdict_by_key[skey] = (got if isinstance(got, str) else None,
                                              self.structure.names(key))
        return got

    def structure_key(self, members: frozenset[int],
                      parts: tuple[frozenset[int], frozenset[int]] | None = None
                      ) -> Hashable | None:
        """``StructureKeys.key`` of the set (cached by member set). ``parts``: two disjoint
        sets whose union ``members`` is (a merge's kernels), for ``StructureKeys.union_key``
        where both have keys."""
        if not self.share_structure:
            return None
        if members in self._key_of:
            return self._key_of[members]
        # The first set of a fingerprint (equal keys have equal fingerprints) gets its key
        # only once a second set has that fingerprint too: a graph with little repetition
        # then pays a fingerprint per set, not a key.
        fingerprint = self.structure.fingerprint(members)
        if fingerprint is None:
            self._key_of[members] = None
            return None
        first = self._first_of.setdefault(fingerprint, members)
        if first is members or first == members:
            return None
        if first not in self._key_of:
            self._key_of[first] = self._publish(first)
        if parts is not None and len(parts[0]) + len(parts[1]) == len(members):
            key = self.structure.union_key(members, parts[0], parts[1],
                                           self._part_key(parts[0]), self._part_key(parts[1]))
        else:
            key = self.structure.key(members)
        self._key_of[members] = key
        return key

    def _part_key(self, members: frozenset[int]) -> Hashable:
        """The key of a union's part (of plannable ops, as the union is): the one scoring
        keeps, else computed and kept aside (not in ``_key_of``: the first set of a
        fingerprint stays keyless there)."""
        got = self._key_of.get(members)
        if got is None:
            got = self._part_keys.get(members)
            if got is None:
                got = self._part_keys[members] = self.structure.key(members)
        return got

    def full_structure_key(self, members: frozenset[int]) -> Hashable | None:
        """``StructureKeys.key`` of the set whether or not structures are shared: the one
        scoring computed when there is one (schedules are shared by it, and the planned
        kernels' keys were mostly computed while they were scored), else computed now and
        not kept (``structure_key``'s first-of-a-fingerprint rule stays as it was)."""
        got = self._key_of.get(members, _UNKNOWN)
        return self.structure.key(members) if got is _UNKNOWN else got

    def _publish(self, members: frozenset[int]) -> Hashable | None:
        """The key of a set scored before it had one, its results shared under it."""
        key = self.structure.key(members)
        if key is None:
            return None
        verdict = self._feasible.get(members)
        if verdict is not None and key not in self._verdict_by_key:
            self._verdict_by_key[key] = (verdict if isinstance(verdict, str) else None,
                                         self.structure.names(members))
        cost = self._cache.get(members)
        if cost is not None:
            self._cost_by_key.setdefault(key, cost)
        return key

    def verdict(self, members: Iterable[int],
                parts: tuple[frozenset[int], frozenset[int]] | None = None) -> str | None:
        """Why ``members`` cannot be stitched, None when they can: ``feasibility``'s answer,
        taken from an earlier set of the same structure when there is one (no analysis).
        ``parts``: as ``structure_key``'s."""
        members = members if isinstance(members, frozenset) else frozenset(members)
        got = self._feasible.get(members)
        if got is not None:
            return got if isinstance(got, str) else None
        key = self.structure_key(members, parts)
        known = self._verdict_by_key.get(key) if key is not None else None
        if known is not None:
            self.structure_hits += 1
            reason, names = known
            return None if reason is None else \
                rename(reason, names, self.structure.names(members))
        got = self.feasibility(members)
        return got if isinstance(got, str) else None

    def stitchable(self, members: Iterable[int],
                   parts: tuple[frozenset[int], frozenset[int]] | None = None) -> bool:
        return self.verdict(members, parts) is None

    def analysis(self, members: Iterable[int]) -> PatternAnalysis | None:
        """``feasibility`` as the analysis, None when not stitchable."""
        got = self.feasibility(members)
        return None if isinstance(got, str) else got

    # --- kernel time -------------------------------------------------------------------
    def kernel(self, members: Iterable[int], analysis: PatternAnalysis | None = None
               ) -> KernelCost:
        key = members if isinstance(members, frozenset) else frozenset(members)
        cost = self._cache.get(key)
        if cost is None:
            skey = self.structure_key(key)
            cost = self._cost_by_key.get(skey) if skey is not None else None
            if cost is not None:
                self.structure_hits += 1
            else:
                self.poll()
                self.fresh += 1
                cost = with_contention(self.graph, self.spec, key, self._kernel(key, analysis),
                                       runs=not self.xla_atomics)
                if skey is not None:
                    self._cost_by_key[skey] = cost
            if self.loop_copies:
                # After the structure share: sets of one structure differ in what they
                # write for the loop state.
                cost = self._with_loop_copies(key, cost)
            self._cache[key] = cost
        return cost

    def _with_loop_copies(self, members: frozenset[int], cost: KernelCost) -> KernelCost:
        if cost.launches == 0 or members in self.left_to_xla or \
                sum(not self.free[v] for v in members) < 2:
            return cost
        copies = carried_copies(self.graph, members)
        if not copies:
            return cost
        # One copy kernel per value, as the rewrite adds them.
        priced = [copy_kernel_cost(self.spec, n) for n in copies]
        total = KernelCost(sum(c.hbm_bytes for c in priced), len(priced),
                           sum(c.memory_s for c in priced), 0.0, 0,
                           sum(c.total_s for c in priced))
        return cost.with_loop_copies(total, sum(copies))

    def singleton(self, nid: int) -> KernelCost:
        return self.kernel((nid,))

    def _kernel(self, members: frozenset[int], analysis: PatternAnalysis | None) -> KernelCost:
        graph, spec = self.graph, self.spec
        work = [v for v in members if not self.free[v]]
        if not work:
            return KernelCost(0, 0, 0.0, 0.0, 0, 0.0)
        launch = spec.kernel_launch_overhead_s
        if self.gemm_chains and len(work) > 1 and \
                sum(graph.nodes[v].op_class is OpClass.COMPUTE for v in work) == 2:
            chain = self._chain_kernel(members)
            if chain is not None:
                return chain
        if len(members) == 1:
            node = graph.nodes[work[0]]
            if node.op_class is OpClass.COMPUTE:
                return self._compute_kernel(node, kernel_hbm_bytes(graph, members))
            if node.op_class is OpClass.OPAQUE:
                nbytes = kernel_hbm_bytes(graph, members)
                memory_s = nbytes / spec.hbm_bandwidth
                return KernelCost(nbytes, 1, memory_s, 0.0, 0, launch + memory_s)
        if analysis is None:
            analysis = self._pricing_analysis(members)
        if analysis is not None and analysis.scope == "global":
            return self._global_kernel(members, analysis)
        block = self._block_kernel(members, analysis, launch)
        # The global scope re-reads inputs per phase: it can only win by the parallelism
        # the block scopes lack (a few rows or column tiles for the whole machine).
        if not GLOBAL_RIVAL or analysis is None or analysis.global_phases is None or \
                block.threads >= self.saturation:
            return block
        rival = self._global_kernel(members, analysis)
        return block if block.total_s <= rival.total_s else rival

    def _pricing_analysis(self, members: frozenset[int]) -> PatternAnalysis | None:
        """The analysis a kernel is priced with: the stitching analysis, or where only
        codegen's limits refuse the set (a u64 counter, argmax's variadic reduce inside one
        of XLA's own kernels), the structural one: XLA's kernels are priced the same
        whatever stitch's codegen can build."""
        got = self.feasibility(members)
        if not isinstance(got, str):
            return got
        if not any(build_problem(self.graph, v) for v in members):
            return None
        try:
            return analyze_pattern(self.graph, members, allow_global=self.allow_global,
                                   buildable=False)
        except Infeasible:
            return None

    def block_scope_kernel(self, members: Iterable[int]) -> KernelCost:
        """The kernel's cost under the block scopes alone (warp/block/thread units; a
        pattern only the global scope stitches is costed as a plain loop kernel)."""
        key = frozenset(members)
        analysis = self.analysis(key)
        if analysis is not None and analysis.scope == "global":
            analysis = None
        return self._block_kernel(key, analysis, self.spec.kernel_launch_overhead_s)

    def _global_kernel(self, members: frozenset[int], analysis: PatternAnalysis) -> KernelCost:
        """The global scope's persistent kernel, timed by its schedule's model (phases on
        the resident grid plus grid barriers; ``stitch.schedule.global_scope``)."""
        from ..schedule.global_scope import estimate     # the schedules import this module
        got = estimate(self.graph, members, self.spec, analysis.global_phases,
                       block_sizes=(512,), setting=self.grid_sync)
        if got is None:
            return KernelCost(0, 1, math.inf, 0.0, 0, math.inf)
        seconds, nbytes = got
        memory_s = nbytes / self.spec.hbm_bandwidth
        return KernelCost(nbytes, 1, memory_s, max(seconds - memory_s, 0.0),
                          self.spec.sm_count * SATURATING_THREADS_PER_SM, seconds)

    def _block_kernel(self, members: frozenset[int], analysis: PatternAnalysis | None,
                      launch: float) -> KernelCost:
        graph, spec = self.graph, self.spec
        # Shared reductions are reduced row by row in full; the rest reads what it needs.
        whole = [r.node for r in analysis.shared] if analysis is not None else []
        # Who reads what inside the kernel, found once from the members' operands: walking
        # the users of each value instead costs a value's whole fan-out (a parameter read
        # by every op of a 2,000-op chain) for every pattern that reads it.
        inside = inside_users(graph, members)
        in_place = in_place_updates(graph, members)
        used = utilization(graph, members, whole, inside, in_place)
        nbytes = kernel_hbm_bytes(graph, members, whole, used, inside, in_place)
        per_component, smem_bytes = self._parallelism(members, analysis, used[0])
        threads = max(sum(per_component), 1)
        memory_s = self._memory_s(nbytes, threads)
        compute_s = self._compute_s(self._instructions(members, analysis, used[0], inside),
                                    threads)
        if analysis is not None and len(analysis.components) > 1:
            # Packed parts run side by side on different blocks: the kernel cannot end
            # before its slowest part, which draws only the bandwidth and lanes its own
            # threads can (a small part gains nothing from a big neighbour's threads).
            for comp, comp_threads in zip(analysis.components, per_component):
                comp = frozenset(comp)
                # Parts share no values: the kernel's utilization holds for each.
                memory_s = max(memory_s, self._memory_s(
                    kernel_hbm_bytes(graph, comp, whole, used, inside, in_place),
                    comp_threads))
                compute_s = max(compute_s, self._compute_s(
                    self._instructions(comp, analysis, used[0], inside), comp_threads))
        memory_s += smem_bytes / spec.shared_memory_bandwidth
        total = launch + compute_s + memory_s - XLA_MEMORY_COMPUTE_PARALLELISM * min(
            compute_s, memory_s)
        return KernelCost(nbytes, 1, memory_s, compute_s, threads, total)

    def _memory_s(self, nbytes: int, threads: int) -> float:
        return nbytes / (self.spec.hbm_bandwidth * min(1.0, max(threads, 1) / self.saturation))

    def _compute_s(self, instructions: float, threads: int) -> float:
        spec = self.spec
        lanes = spec.fp32_cores_per_sm * spec.sm_count * min(1.0, max(threads, 1) / (
            spec.sm_count * spec.fp32_cores_per_sm))
        return instructions / (lanes * spec.clock_hz)

    def _chain_kernel(self, members: frozenset[int]) -> KernelCost | None:
        """A GEMM chain (``stitch.pricing.chain_pricing``): the chain kernel at its best
        schedule under the GEMM-tile latency model; None when the members form no chain."""
        from .chain_pricing import chain_for, chain_price
        chain = chain_for(self.graph, members)
        if chain is None:
            return None
        tile = chain_price(self.graph, chain, self.spec, tf32=self.chain_tf32,
                           check_spills=self.chain_spill_check,
                           grid_sync=self.chain_grid_sync).cost
        return tile_kernel_cost(self.spec, tile, kernel_hbm_bytes(self.graph, members))

    def _compute_kernel(self, node: OpNode, nbytes: int) -> KernelCost:
        """GEMM/conv: a roofline at the target's achievable tensor-core rate for the dot's
        operand type and precision (``stitch.cost.gemm_rates``: the same rule on both sides
        of any comparison), except the GEMMs of a GEMM chain: those are priced by the same
        GEMM-tile model as the chain kernel that may replace them (XLA's Triton tile from
        the fusion's backend config; its tensor rates from the same table), so chain and
        unfused GEMMs compare under one model."""
        spec = self.spec
        if self.gemm_chains:
            from .chain_pricing import xla_gemm_cost
            tile = xla_gemm_cost(self.graph, node.id, spec)
            if tile is not None:
                return tile_kernel_cost(spec, tile, nbytes)
        cls = gemm_precision(self.graph, node, spec)
        t = gemm_time(spec, _flops(self.graph, node), nbytes, cls)
        return KernelCost(nbytes, 1, t.memory_s, t.compute_s, 0, t.total_s)

    def _parallelism(self, members: frozenset[int], analysis: PatternAnalysis | None,
                     used: dict[int, float]) -> tuple[list[int], int]:
        """Threads each independent part of the kernel can run at once, and the
        shared-memory bytes the kernel moves. A loop part runs a thread per element it
        computes: of its largest op, only the elements the outputs need (``used``, e.g. the
        gathered ones)."""
        if analysis is None:     # not stitchable: assume it is one plain loop kernel
            return [max(self._loop_threads(v, used) for v in members)], 0
        threads: list[int] = []
        smem = 0
        by_component: dict[int, list] = {}
        for red in analysis.shared:
            by_component.setdefault(analysis.component_of[red.node], []).append(red)
        for index, comp in enumerate(analysis.components):
            reds = by_component.get(index)
            if not reds:
                threads.append(max(self._loop_threads(v, used) for v in comp))
                continue
            comp_threads = None
            for red in reds:
                if red.minor:
                    t = red.rows * (32 if red.row_length <= WARP_ROW_LIMIT
                                    else min(1024, red.row_length))
                else:
                    t = math.ceil(red.rows / 32) * 1024
                t = min(t, red.rows * red.row_length)
                comp_threads = t if comp_threads is None else min(comp_threads, t)
                smem += red.rows * 4 * 2       # partials written and read back
            threads.append(comp_threads or 1)
        return threads, smem

    def _loop_threads(self, v: int, used: dict[int, float]) -> int:
        node = self.graph.nodes[v]
        if node.op_class is OpClass.REDUCTION and node.operands:
            # A reduction kernel reads its input with many threads per output.
            return max(self.elements[node.operands[0]] // 8, self.elements[v])
        return max(int(self.elements[v] * used.get(v, 1.0)), 1)

    def _instructions(self, members: frozenset[int], analysis: PatternAnalysis | None,
                      used: dict[int, float],
                      inside: dict[int, list[int]] | None = None) -> float:
        """Thread instructions, with thread composition's recomputation. An op computes
        at least the elements the outputs need (``used``): all of them, except under a
        gather, a slice or an in-place update. ``inside``: ``inside_users`` of a kernel
        holding ``members``."""
        graph = self.graph
        facts = graph_facts(graph)
        outputs = facts.outputs
        elements, free = self.elements, self.free
        reduction, expensive = facts.is_reduction, facts.is_expensive
        n_users, count, per_element = facts.n_users, facts.count, facts.per_element
        shared = {r.node for r in analysis.shared} if analysis else ()
        if inside is None:
            inside = inside_users(graph, members)
        factor: dict[int, float] = {}
        total = 0.0
        no_users: list[int] = []
        for v in sorted(members, reverse=True):
            readers = inside.get(v, no_users)
            if free[v]:
                # Free ops pass their consumers' demand through.
                need = max((factor.get(u, 0.0) * elements[u] / max(elements[v], 1)
                            for u in readers if u in members), default=1.0)
                factor[v] = max(need, used[v])
                continue
            if reduction[v] or v in shared:
                r = 1.0
            else:
                r = 1.0 if (v in outputs or len(readers) < n_users[v]) else 0.0
                ev = max(elements[v], 1)
                for u in readers:
                    if u not in members:
                        continue
                    if reduction[u]:
                        demand = 1.0
                    else:
                        demand = factor.get(u, 1.0)
                        demand *= elements[u] / ev
                    if demand > r:
                        r = demand
                if expensive[v] and r > 1.0:
                    r = 1.0            # expanded expensive op: a sub-root, computed once
                if used[v] > r:
                    r = used[v]
            factor[v] = r
            total += count[v] * r * per_element[v]
        return total

    # --- the delta-evaluator -----------------------------------------------------------
    def delta(self, members: Iterable[int], analysis: PatternAnalysis | None = None) -> Delta:
        members = frozenset(members)
        fused = self.kernel(members, analysis)
        singles = [self.singleton(v) for v in members]
        reduced_mem = sum(s.memory_s for s in singles) - fused.memory_s
        reduced_calls = (sum(s.launches for s in singles) - fused.launches) * \
            self.spec.kernel_launch_overhead_s
        f = sum(s.total_s for s in singles) - fused.total_s
        return Delta(f, reduced_mem, reduced_calls, reduced_mem + reduced_calls - f)

    def gain(self, members: frozenset[int], analysis: PatternAnalysis | None = None) -> float:
        """f alone (the score the explorer ranks by)."""
        fused = self.kernel(members, analysis)
        single = self._single_total
        total = 0.0
        for v in members:
            t = single.get(v)
            if t is None:
                t = single[v] = self.singleton(v).total_s
            total += t
        return total - fused.total_s


def with_contention(graph: OpGraph, spec: GpuSpec, members: Iterable[int],
                    cost: KernelCost, runs: bool = True) -> KernelCost:
    """``cost`` plus what its colliding scatters' atomics wait for one another (``runs``:
    as stitch generates them, see ``contention.contention_seconds``); a scatter stitch
    generates in column tiles lasts at least its blocks' chain of round trips, plus the ids
    its tiles reread (``contention.tiles_price``)."""
    members = list(members)
    extra = contention_seconds(graph, members, spec, runs)
    total = cost.total_s
    if runs and cost.launches:
        for tiles in tiles_prices(graph, members, spec):
            total = tiles.floor(total, spec)
    if extra <= 0.0 and total == cost.total_s:
        return cost
    return dataclasses.replace(cost, total_s=total + extra, contention_s=extra)


def copy_kernel_cost(spec: GpuSpec, nbytes: int, element_bytes: int = 4) -> KernelCost:
    """A copy kernel of ``nbytes`` (XLA's ``copy`` of one buffer): reads and writes every
    byte, one thread per element, priced like any other kernel (launch + memory time at the
    bandwidth its threads draw; no arithmetic)."""
    if nbytes <= 0:
        return KernelCost(0, 0, 0.0, 0.0, 0, 0.0)
    threads = max(1, nbytes // max(element_bytes, 1))
    saturation = spec.sm_count * SATURATING_THREADS_PER_SM
    moved = 2 * nbytes
    memory_s = moved / (spec.hbm_bandwidth * min(1.0, threads / saturation))
    return KernelCost(moved, 1, memory_s, 0.0, threads,
                      spec.kernel_launch_overhead_s + memory_s)


def tile_kernel_cost(spec: GpuSpec, tile, nbytes: int) -> KernelCost:
    """A KernelCost from a ``gemm_tile.TileCost`` (bytes as counted by kernel_hbm_bytes)."""
    pipes = tile.pipes
    memory_s = pipes.get("memory", 0.0) / spec.clock_hz
    compute_s = max((v for k, v in pipes.items() if k not in ("memory", "latency")),
                    default=0.0) / spec.clock_hz
    return KernelCost(nbytes, 1, memory_s, compute_s, tile.blocks * tile.threads,
                      tile.seconds)


def _flops(graph: OpGraph, node: OpNode) -> float:
    """2 * output elements * contracted size for dots/GEMM calls; convolutions: 2 * output
    elements * kernel elements / output features. Best effort: 0 when unknown."""
    dot, dot_operands = gemm_dot(graph, node)
    inside = None if dot is None else dot_flops(dot, dot_operands)
    if inside is not None:       # the dot itself, or the dot in a GEMM fusion's body
        return inside
    out = element_count(node)
    operands = [graph.nodes[o].shape for o in node.operands]
    if len(operands) < 2 or not operands[0].is_array or not operands[1].is_array:
        return 0.0
    lhs, rhs = operands[0], operands[1]
    inst = node.instruction
    contracting: tuple[int, ...] = ()
    if "lhs_contracting_dims" in inst.attrs:
        contracting = inst.ints("lhs_contracting_dims")
    else:
        config = inst.backend_config.get("gemm_backend_config", {})
        dims = config.get("dot_dimension_numbers", {}) if isinstance(config, dict) else {}
        contracting = tuple(int(d) for d in dims.get("lhs_contracting_dimensions", ()))
    if contracting:
        return 2.0 * out * math.prod(lhs.dims[d] for d in contracting)
    if node.opcode == "convolution" or "cudnn" in inst.attrs.get("custom_call_target", ""):
        features = max(_leaf_dims(node)[-1:] or [1])
        return 2.0 * out * rhs.num_elements / max(features, 1)
    # Unknown GEMM form: assume the lhs's last dim is contracted.
    return 2.0 * out * (lhs.dims[-1] if lhs.dims else 1)


def _leaf_dims(node: OpNode) -> list[int]:
    shape = next(node.shape.leaves()) if node.shape.is_tuple else node.shape
    return list(shape.dims)
