"""Schedule tuning: enumerate the schedule space of a kernel and keep the fastest by the
latency-evaluator (FusionStitching §4.2-4.4).

Per part the space is: the unit owning a row (thread = recompute per consumer element,
warp = shuffles, block = shared memory), threads per block 32...1024, vector width 1/2/4
(where rows divide), per-row expensive ops as sub-roots or recomputed per element, and
full-size expensive ops needed by several passes cached in registers or recomputed. Packed
parts share one block size; the tuner tries each and keeps the fastest kernel. Illegal
combinations are discarded with a reason (``KernelSchedule.rejected``).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Iterable

from stitch.hlo.graph import OpGraph
from stitch.hlo.grouped_scatter import TILE_THREADS, GroupedScatter, grouped_scatter
from stitch.hlo.scatter_forms import scatter_form

from ..cost.contention import contention_seconds, tiles_prices
from ..cost.gpu_specs import GpuSpec
from ..cost.latency import UNROLL, LaunchShape, WarpWork, evaluate, part_cycles
from ..cost.occupancy import occupancy
from ..errors import StitchError
from ..analysis.feasibility import Infeasible, analyze_pattern
from .global_scope import schedule_global
from .kernel_schedule import GroupSchedule, KernelSchedule, PartSchedule, SharedBuffer
from .layout_access import apply_layouts
from .space import PartFacts, PassWork, op_instructions, part_facts, written_values

log = logging.getLogger(__name__)

THREADS_PER_BLOCK = (32, 64, 128, 256, 512, 1024)
VECTOR_WIDTHS = (1, 2, 4)
BASE_REGISTERS = 16          # indices, loop counters, parameter pointers
MAX_REGISTERS = 255
# Thread composition recomputes, per consumer element, the reduction outputs it needs:
# only reductions of up to this many elements per output are worth enumerating (longer
# ones are always far slower than sharing).
MAX_RECOMPUTED_ROW = 4096


class ScheduleError(StitchError):
    """No legal schedule exists for a kernel (the reasons are listed)."""


@dataclass
class _Choice:
    work: WarpWork
    launch: LaunchShape
    seconds: float
    unit: str
    vector_width: int
    # Builds the part's schedule (groups, shared buffers): only the winners are built,
    # not every one of the dozens of combinations tried.
    build: Callable[[], PartSchedule]
    _part: PartSchedule | None = None

    @property
    def part(self) -> PartSchedule:
        if self._part is None:
            self._part = self.build()
        return self._part


def _log2(n: int) -> int:
    return max(int(math.ceil(math.log2(max(n, 1)))), 0)


def _register_terms(facts: PartFacts) -> tuple[int, int]:
    """(values live per vector lane in the widest pass, per-row values) of a part."""
    widest = max((min(len(p.full_ops), 2 + p.loads) for p in facts.passes), default=1)
    per_row = sum(len(p.row_ops) + len(p.reductions) for p in facts.passes)
    return widest, per_row


def _registers(facts: PartFacts, vw: int, cached_values: int,
               terms: tuple[int, int] | None = None, scale: float = 1.0) -> int:
    """Liveness estimate: the widest pass keeps about one value per op of its longest
    dependency front live per vector lane, plus per-row values and cached elements.
    ``terms``: ``_register_terms(facts)`` when the caller has them. ``scale``: ptxas's
    count over this estimate for a kernel already built (stitch/schedule/ptxas_feedback.py),
    applied to every candidate of that kernel."""
    widest, per_row = terms or _register_terms(facts)
    regs = BASE_REGISTERS + widest * vw + per_row + cached_values
    return regs if scale == 1.0 else max(math.ceil(regs * scale), 1)


def _allocate_shared(graph: OpGraph, facts: PartFacts, unit: str, warps: int,
                     rows_per_block: int, members: set[int]) -> list[SharedBuffer]:
    """Shared buffers for block-level sharing, reused by dominance (§4.4): one scratch
    area for warp partials (each reduction finishes with a barrier before the next starts),
    and a result buffer per shared reduction whose space is handed to a later reduction
    once every consumer of the earlier one is an ancestor of it (all its reads are done)."""
    if unit != "block":
        return []
    shared = [r for r in facts.reductions if r.shared]
    partial_slots = warps if facts.minor else warps * 32
    buffers = [SharedBuffer(facts.reductions[0].node, partial_slots * 4, 0, "partials")]
    offset = partial_slots * 4
    ancestors: dict[int, set[int]] = {}

    def ancestors_of(v: int) -> set[int]:
        if v not in ancestors:
            seen, stack = set(), [v]
            while stack:
                for o in graph.nodes[stack.pop()].operands:
                    if o in members and o not in seen:
                        seen.add(o)
                        stack.append(o)
            ancestors[v] = seen
        return ancestors[v]

    live: list[tuple[int, int, int]] = []        # (offset, bytes, reduction)
    free: list[tuple[int, int]] = []
    for r in sorted(shared, key=lambda r: r.node):
        # One f32 per reduction output of every row the block owns (column tiling owns
        # 32 column rows; rows_per_block already counts them).
        size = r.outputs_per_row * rows_per_block * 4
        before = ancestors_of(r.node)
        still = []
        for off, nbytes, owner in live:
            consumers = [u for u in graph.nodes[owner].users if u in members]
            if all(u in before for u in consumers):
                free.append((off, nbytes))
            else:
                still.append((off, nbytes, owner))
        live = still
        slot = next((f for f in free if f[1] >= size), None)
        if slot is not None:
            free.remove(slot)
            at = slot[0]
        else:
            at = offset
            offset += size
        live.append((at, size, r.node))
        buffers.append(SharedBuffer(r.node, size, at, "result"))
    return buffers


def _row_work(graph: OpGraph, facts: PartFacts, unit: str, tpb: int, vw: int,
              sub_roots: bool, cache: bool) -> tuple[WarpWork, int, int, int] | str:
    """Per-warp work, blocks, rows per block and cached registers of a row-part schedule,
    or why it is illegal."""
    R, L = facts.rows, facts.row_length
    if facts.locality_error and unit != "thread":
        return facts.locality_error
    if (not facts.minor or facts.mixed_layout) and vw > 1:
        return "vector loads need contiguous rows"
    if facts.minor and L % vw:
        return f"row length {L} is not a multiple of vector width {vw}"
    length = facts.reduction_length
    outputs = {r.node: r.rows * r.outputs_per_row for r in facts.reductions}
    last = facts.passes[-1]
    if unit != "thread" and facts.reductions and \
            all(r.outputs_per_row > 1 for r in facts.reductions):
        # Codegen proves a row layout only from a reduction with one output per row (its
        # ``codegen.row_layout``); without one the part is built with thread composition, which
        # is what must be priced.
        return "no reduction has one output per row: warp/block composition is not built"
    if unit == "thread":
        # Thread composition (codegen's index propagation): a thread computes vw consumer
        # elements of the last pass, or vw outputs of a reduction finishing there, and
        # recomputes each reduction output they read by a loop over that output's own
        # inputs: the row length over the outputs a (coarsened) row holds, not the row.
        longest = max(length.values())
        if longest > MAX_RECOMPUTED_ROW:
            return (f"recomputing a {longest}-element reduction per consumer element is "
                    "never worth it")
        final_outputs = max((outputs[v] for v in last.reductions), default=0)
        consumers = math.ceil(max(last.elements, final_outputs, R) / vw)
        threads_per_row = 1
        blocks = math.ceil(consumers / tpb)
        rows_per_block = max(tpb // max(L // vw, 1), 1)
    elif unit == "warp":
        threads_per_row = 32 if facts.minor else 1
        rows_per_block = tpb // threads_per_row
        blocks = math.ceil(R / rows_per_block)
    else:
        if facts.minor:
            threads_per_row, rows_per_block = tpb, 1
            blocks = R
        else:
            if tpb < 64:
                return "block tiling of columns needs at least two warps"
            threads_per_row, rows_per_block = tpb // 32, 32
            blocks = math.ceil(R / 32)
    warps_per_block = max(tpb // 32, 1)
    alu = sfu = instr = shuffles = barriers = shared = chain = rounds = 0.0
    cached_regs = 0
    thread_iters = _thread_iterations(facts, vw, consumers) if unit == "thread" else []
    for index, p in enumerate(facts.passes):
        if unit == "thread":
            lanes = 1
            iters = thread_iters[index]
        else:
            iters = math.ceil(L / (threads_per_row * vw))
            lanes = vw
        elem_alu, elem_sfu = (p.alu, p.sfu) if unit == "thread" else (p.walk_alu, p.walk_sfu)
        if cache and index > 0 and unit != "thread":
            # Cached expensive values are read from registers instead of recomputed.
            for v in facts.multi_pass_expensive:
                if v in p.full_ops:
                    a, s = op_instructions(graph, v)
                    elem_alu -= a
                    elem_sfu -= s
        alu += elem_alu * lanes * iters
        sfu += elem_sfu * lanes * iters
        instr += (p.loads + p.stores) * iters
        rounds += math.ceil(iters / UNROLL) if p.loads else 0
        for v in p.row_ops:
            a, s = op_instructions(graph, v)
            times = 1 if sub_roots or unit == "thread" else lanes * iters
            alu += a * times
            sfu += s * times
        instr += p.row_loads + p.row_stores
        for r in (x for x in facts.reductions if x.node in p.reductions):
            if unit == "thread":
                continue
            per_output = max(threads_per_row // max(r.outputs_per_row, 1), 1)
            steps = _log2(min(per_output, 32))
            shuffles += steps
            chain += steps
            if unit == "block" and per_output > 32:
                barriers += 2
                shared += 3
                shuffles += _log2(warps_per_block)
                chain += _log2(warps_per_block)
            elif unit == "block" and not facts.minor:
                barriers += 2
                shared += 2 + threads_per_row / warps_per_block
                chain += _log2(threads_per_row)
    if cache and unit != "thread" and facts.multi_pass_expensive:
        cached_regs = len(facts.multi_pass_expensive) * math.ceil(L / (threads_per_row * vw)) * vw
        if cached_regs > 64:
            return f"caching {len(facts.multi_pass_expensive)} values per element needs " \
                   f"{cached_regs} registers per thread"
    total_warps = blocks * warps_per_block
    nbytes = facts.thread_bytes if unit == "thread" else facts.hbm_bytes
    work = WarpWork(alu=alu, sfu=sfu, global_bytes=nbytes / max(total_warps, 1),
                    global_instr=instr, memory_rounds=max(rounds, 1.0), shared_instr=shared,
                    shuffles=shuffles, barriers=barriers, chain_alu=chain,
                    sector_bytes=facts.sector_bytes / max(total_warps, 1))
    return work, blocks, rows_per_block, cached_regs


def _outputs_per_row(facts: PartFacts, p: PassWork) -> int:
    return max((r.outputs_per_row for r in facts.reductions if r.node in p.reductions),
               default=1)


def _thread_iterations(facts: PartFacts, vw: int, consumers: int) -> list[float]:
    """Per pass, the loop iterations one thread of a thread-composition part runs.

    The last pass: the thread's share of its outputs (vw elements, or the reduction outputs
    finishing there, each a loop over its inputs). Earlier passes are recomputed where they
    are read (codegen's index propagation: a thread keeps no row statistic between
    iterations of a loop that reads them):

    - a pass whose row holds one output is read as one value per row: once;
    - a pass whose (coarsened) row holds several outputs, read by a reduction of the next
      pass with the same outputs per row (the same sub-rows: the value is loop-invariant
      there), once per output that reduction computes;
    - read by a reduction across its sub-rows (a column reduction over rows whose
      statistics each row recomputes: a layer norm's backward), once per iteration of that
      reduction's loop — priced as one loop, such kernels were modeled at 2-4 µs and ran
      95-850 µs on an H200 (GPU check, 2026-11);
    - read by elementwise consumers: once per different output among the thread's vw
      elements."""
    length = facts.reduction_length
    outputs = {r.node: r.rows * r.outputs_per_row for r in facts.reductions}
    passes = facts.passes
    last = passes[-1]
    per_output = max((length[v] for v in last.reductions), default=1)
    share = math.ceil(max((outputs[v] for v in last.reductions), default=0)
                      / max(consumers, 1))
    iters = [0.0] * len(passes)
    iters[-1] = float(max(vw, share * per_output))
    computed = float(max(share, 1))         # outputs of the pass after, per thread
    for index in range(len(passes) - 2, -1, -1):
        p, after = passes[index], passes[index + 1]
        opr = _outputs_per_row(facts, p)
        if opr == 1:
            reads = 1.0
        elif not after.reductions:
            reads = float(min(vw, opr))
        elif _outputs_per_row(facts, after) == opr:
            reads = computed
        else:
            reads = iters[index + 1]
        iters[index] = max((length[v] for v in p.reductions), default=1) * reads
        computed = reads
    return iters


def _loop_work(facts: PartFacts, tpb: int, vw: int, tiles: GroupedScatter | None = None
               ) -> tuple[WarpWork, int] | str:
    if facts.elements % vw:
        return f"{facts.elements} elements are not a multiple of vector width {vw}"
    threads = math.ceil(facts.elements / vw)
    blocks = math.ceil(threads / tpb)
    if tiles is not None:
        # A scatter in column tiles (``hlo.grouped_scatter``): one work item a block
        # of TILE_THREADS; its chain of round trips is priced by ``tiles_price``.
        if tpb != TILE_THREADS:
            return f"a scatter in column tiles runs blocks of {TILE_THREADS} threads"
        blocks = tiles.items
    p = facts.passes[0]
    warps = blocks * max(tpb // 32, 1)
    work = WarpWork(alu=p.alu * vw, sfu=p.sfu * vw,
                    global_bytes=facts.hbm_bytes / max(warps, 1),
                    global_instr=p.loads + p.stores, memory_rounds=1.0,
                    sector_bytes=facts.sector_bytes / max(warps, 1))
    return work, blocks


def _groups(graph: OpGraph, facts: PartFacts, unit: str, sub_roots: bool,
            written: set[int] | None = None) -> list[GroupSchedule]:
    """Groups rooted at sub-roots (reductions, per-row expensive ops when they are
    sub-roots) and at the part's roots; every other op joins the first group downstream
    that needs it (index propagation). ``written``: ``written_values`` of the part."""
    members = set(facts.members)
    roots = [r.node for r in facts.reductions]
    if sub_roots:
        roots += facts.per_row_expensive
    if written is None:
        written = written_values(graph, members)
    root_set = set(roots)
    roots += [v for v in facts.members if v not in root_set and v in written]
    root_set = set(roots)
    assigned: set[int] = set()
    groups = []
    for root in sorted(root_set):
        seen, stack = [root], [root]
        seen_set = {root}
        while stack:
            for o in graph.nodes[stack.pop()].operands:
                if o in members and o not in assigned and o not in seen_set and \
                        o not in root_set:
                    seen.append(o)
                    seen_set.add(o)
                    stack.append(o)
        assigned.update(seen)
        is_sub_root = root in {r.node for r in facts.reductions} or (
            sub_roots and root in facts.per_row_expensive)
        scheme = unit if is_sub_root and facts.reductions else "thread"
        groups.append(GroupSchedule(root, tuple(sorted(seen)), scheme, is_sub_root))
    return groups


class _PartCache:
    """What a part's schedules share across block sizes: its written values, its groups
    per (unit, sub-roots) and its shared buffers per (unit, warps, rows per block), built
    once per part instead of once per combination tried."""

    def __init__(self, graph: OpGraph, facts: PartFacts):
        self.graph, self.facts = graph, facts
        self.members = set(facts.members)
        self.written = written_values(graph, self.members)
        self.register_terms = _register_terms(facts)
        # A scatter whose updates may collide is generated as a walk over its updates, one
        # atomic add each under a bounds guard (``codegen.scatter_lowering``): no vector
        # accesses, so its part is priced at vector width 1 only.
        atomic = any(graph.nodes[v].opcode == "scatter" and scatter_form(graph, v).kind != "row"
                     for v in self.members)
        self.vector_widths = (1,) if atomic else VECTOR_WIDTHS
        tiled = [grouped_scatter(graph, v) for v in self.members
                 if graph.nodes[v].opcode == "scatter"]
        self.tiles = max((t for t in tiled if t is not None), key=lambda t: t.items,
                         default=None)
        self._groups: dict[tuple[str, bool], list[GroupSchedule]] = {}
        self._shared: dict[tuple[str, int, int], list[SharedBuffer]] = {}

    def groups(self, unit: str, sub_roots: bool) -> list[GroupSchedule]:
        key = (unit, sub_roots)
        got = self._groups.get(key)
        if got is None:
            got = self._groups[key] = _groups(self.graph, self.facts, unit, sub_roots,
                                              self.written)
        return list(got)

    def shared(self, unit: str, warps: int, rows_per_block: int) -> list[SharedBuffer]:
        key = (unit, warps, rows_per_block)
        got = self._shared.get(key)
        if got is None:
            got = self._shared[key] = _allocate_shared(self.graph, self.facts, unit, warps,
                                                       rows_per_block, self.members)
        return list(got)


def _part_choices(graph: OpGraph, spec: GpuSpec, facts: PartFacts, tpb: int,
                  rejected: list[str], cache: _PartCache | None = None,
                  register_scale: float = 1.0) -> list[_Choice]:
    cache = cache or _PartCache(graph, facts)
    choices: list[_Choice] = []
    if not facts.reductions:
        for vw in cache.vector_widths:
            got = _loop_work(facts, tpb, vw, cache.tiles)
            if isinstance(got, str):
                rejected.append(f"loop vw={vw}: {got}")
                continue
            work, blocks = got
            regs = _registers(facts, vw, 0, cache.register_terms, register_scale)
            launch = LaunchShape(blocks, tpb, min(regs, MAX_REGISTERS), 0)
            lat = evaluate(spec, launch, work)
            if lat.occupancy.blocks_per_sm == 0:
                rejected.append(f"loop tpb={tpb} vw={vw}: cannot launch ({lat.occupancy.reason})")
                continue

            def build(vw=vw, blocks=blocks, regs=regs, cycles=lat.cycles) -> PartSchedule:
                return PartSchedule(facts.members, "loop", "thread", facts.elements, 1, True,
                                    tpb, tpb * vw, vw, blocks, cache.groups("thread", False),
                                    registers=regs, modeled_cycles=cycles)
            choices.append(_Choice(work, launch, lat.seconds, "thread", vw, build))
        return choices
    sub_root_options = (True, False) if facts.per_row_expensive else (True,)
    cache_options = (False, True) if facts.multi_pass_expensive else (False,)
    for unit in ("warp", "block", "thread"):
        for vw in cache.vector_widths:
            for sub_roots in sub_root_options:
                for cached_values in cache_options:
                    label = (f"{unit} tpb={tpb} vw={vw} sub_roots={sub_roots} "
                             f"cache={cached_values}")
                    got = _row_work(graph, facts, unit, tpb, vw, sub_roots, cached_values)
                    if isinstance(got, str):
                        rejected.append(f"{label}: {got}")
                        continue
                    work, blocks, rows_per_block, cached = got
                    regs = _registers(facts, vw, cached, cache.register_terms, register_scale)
                    if regs > MAX_REGISTERS:
                        rejected.append(f"{label}: needs about {regs} registers per thread")
                        continue
                    buffers = cache.shared(unit, max(tpb // 32, 1), rows_per_block)
                    smem = max((b.offset + b.bytes for b in buffers), default=0)
                    # Kernels declare their shared memory statically: what codegen builds
                    # (stitch.codegen.nvptx.STATIC_SHARED_LIMIT) is the limit without the opt-in,
                    # not the opt-in's (a schedule past it was planned, then never built).
                    if smem > spec.shared_memory_per_block:
                        rejected.append(f"{label}: needs {smem} bytes of shared memory "
                                        f"(static limit {spec.shared_memory_per_block})")
                        continue
                    launch = LaunchShape(blocks, tpb, regs, smem)
                    lat = evaluate(spec, launch, work)
                    if lat.occupancy.blocks_per_sm == 0:
                        rejected.append(f"{label}: cannot launch ({lat.occupancy.reason})")
                        continue

                    def build(unit=unit, vw=vw, sub_roots=sub_roots, cached=cached_values,
                              rows_per_block=rows_per_block, blocks=blocks, buffers=buffers,
                              regs=regs, cycles=lat.cycles) -> PartSchedule:
                        return PartSchedule(
                            facts.members, "row", unit, facts.rows, facts.row_length,
                            facts.minor, tpb, rows_per_block, vw, blocks,
                            cache.groups(unit, sub_roots), buffers,
                            tuple(facts.multi_pass_expensive) if cached else (),
                            registers=regs, modeled_cycles=cycles)
                    choices.append(_Choice(work, launch, lat.seconds, unit, vw, build))
    return choices


TIE = 0.01


def part_signature(part: PartSchedule) -> tuple:
    """What the tuner chose for a part (block size, unit, vector width, groups and their
    schemes, cached values): equal signatures lower to the same code."""
    groups = tuple((g.root, g.scheme, g.sub_root) for g in part.groups)
    return (part.kind, part.unit, part.threads_per_block, part.vector_width, groups,
            part.cached)


def schedule_signature(schedule: KernelSchedule) -> tuple:
    return (schedule.block, tuple(part_signature(p) for p in schedule.parts))


def _preference(choice: _Choice) -> tuple[float, float, int]:
    """Fastest first; modeled times within 1% count as equal, then wider vectors win
    (fewer instructions than the model's issue bound shows)."""
    bucket = round(math.log(choice.seconds) / math.log1p(TIE)) if choice.seconds > 0 else 0
    return (bucket, -choice.vector_width, choice.launch.threads_per_block)


def schedule_kernel(graph: OpGraph, members: Iterable[int], spec: GpuSpec,
                    force: dict[str, str] | None = None, *, register_scale: float = 1.0,
                    pin: KernelSchedule | None = None,
                    layouts: dict[int, tuple[int, ...]] | None = None,
                    vector_widths: tuple[int, ...] | None = None) -> KernelSchedule:
    """The fastest legal schedule of the stitched kernel ``members`` on ``spec``.

    ``force`` = {"unit": "warp"} (or "block"/"thread") keeps only schedules whose row parts
    use that unit (tests, and forcing schemes in codegen checks); {"scope": "global"} only
    the global scope's persistent kernel. ``register_scale`` multiplies every register
    estimate (ptxas feedback: the measured count over the estimate of the kernel as built).
    ``pin``: only ``pin``'s own choices (block size and, per part, unit, vector width,
    groups, cached values), re-evaluated: what that schedule costs under
    ``register_scale``. ``layouts``: buffers whose layout stitch chooses (node -> logical
    dims, major to minor; ``layouts.py``): their reads and writes are priced by access
    order (``layout_access.apply_layouts``). ``vector_widths``: only these widths (a
    narrower kernel: less code to compile, ``stitch.xla_pass.code_budget``); the global
    scope is not tried. Raises ScheduleError when nothing is legal, listing why."""
    members = sorted(set(members))
    try:
        analysis = analyze_pattern(graph, members, allow_global=True)
    except Infeasible as exc:
        raise ScheduleError(f"kernel at {graph.nodes[members[0]].name}: {exc}") from None
    # The global scope (a persistent kernel with grid barriers): alone where the block
    # scopes cannot stitch the kernel, else a rival the latency-evaluator judges.
    rival = None
    if analysis.global_phases is not None and pin is None and vector_widths is None and \
            (not force or force.get("scope") == "global"):
        rival = schedule_global(graph, members, spec, analysis.global_phases)
    if analysis.scope == "global" or (force and force.get("scope") == "global"):
        if rival is None:
            raise ScheduleError(f"kernel at {graph.nodes[members[0]].name}: no global-scope "
                                "schedule launches")
        return rival
    facts = [part_facts(graph, comp, analysis) for comp in analysis.components
             if any(not graph.is_free(v) for v in comp)]
    if layouts:
        facts = [apply_layouts(graph, f, layouts) for f in facts]
    if not facts:
        raise ScheduleError(f"kernel at {graph.nodes[members[0]].name} computes nothing")
    rejected: list[str] = []
    best: KernelSchedule | None = None
    caches = [_PartCache(graph, f) for f in facts]
    if vector_widths is not None:
        for cache in caches:
            cache.vector_widths = tuple(w for w in cache.vector_widths
                                        if w in vector_widths) or (1,)
    if pin is not None and len(pin.parts) != len(facts):
        raise ScheduleError(f"kernel at {graph.nodes[members[0]].name}: the pinned schedule "
                            f"has {len(pin.parts)} parts, the kernel {len(facts)}")
    for tpb in THREADS_PER_BLOCK if pin is None else (pin.block,):
        picked: list[_Choice] = []
        for i, (f, cache) in enumerate(zip(facts, caches)):
            options = _part_choices(graph, spec, f, tpb, rejected, cache, register_scale)
            if force and f.reductions:
                options = [c for c in options if c.unit == force.get("unit", c.unit)]
            if pin is not None:
                want = part_signature(pin.parts[i])
                options = [c for c in options if part_signature(c.part) == want]
            if not options:
                break
            picked.append(min(options, key=_preference))
        if len(picked) != len(facts):
            continue
        schedule = _combine(spec, members, picked, rejected)
        if schedule is None:
            continue
        # Within 1% the model cannot tell schedules apart: prefer the higher occupancy
        # (more latency hiding than the model credits).
        if best is None or schedule.modeled_us < best.modeled_us * (1 - TIE) or (
                schedule.modeled_us <= best.modeled_us * (1 + TIE)
                and schedule.occupancy.occupancy > best.occupancy.occupancy):
            best = schedule
    if rival is not None and (best is None or rival.modeled_us < best.modeled_us * (1 - TIE)):
        rival.rejected = list(dict.fromkeys(rejected))
        return rival
    if best is None:
        reasons = "; ".join(dict.fromkeys(rejected))[:2000]
        raise ScheduleError(f"no legal schedule for the kernel at "
                            f"{graph.nodes[members[0]].name}: {reasons}")
    best.rejected = list(dict.fromkeys(rejected))
    # Colliding scatter atomics wait for one another at their addresses' L2 slices.
    best.modeled_us += contention_seconds(graph, members, spec) * 1e6
    # A scatter in column tiles lasts at least its blocks' chain of round trips.
    for tiles in tiles_prices(graph, members, spec):
        best.modeled_us = tiles.floor(best.modeled_us * 1e-6, spec) * 1e6
    return best


def _combine(spec: GpuSpec, members: list[int], picked: list[_Choice], rejected: list[str]
             ) -> KernelSchedule | None:
    """Pack the parts into one grid: blocks in consecutive ranges, one block size, the
    largest register and shared-memory need. Parts share the machine: their issue cycles
    add up, and the kernel lasts at least as long as its slowest part's chain."""
    tpb = picked[0].launch.threads_per_block
    regs = max(c.launch.registers_per_thread for c in picked)
    smem = max(c.launch.shared_bytes_per_block for c in picked)
    occ = occupancy(spec, tpb, regs, smem)
    if occ.blocks_per_sm == 0:
        rejected.append(f"packed tpb={tpb}: cannot launch ({occ.reason})")
        return None
    shared_machine = slowest = latency = 0.0
    offset = 0
    for c in picked:
        t, l, _ = part_cycles(spec, LaunchShape(c.launch.blocks, tpb, regs, smem), c.work, occ)
        shared_machine += t * min(spec.sm_count, c.launch.blocks) / spec.sm_count
        slowest = max(slowest, t)
        latency = max(latency, l)
        c.part.block_offset = offset
        offset += c.launch.blocks
    throughput = max(shared_machine, slowest)
    cycles = max(throughput, latency)
    seconds = spec.kernel_launch_overhead_s + cycles / spec.clock_hz
    return KernelSchedule(tuple(members), [c.part for c in picked], offset, tpb, smem, regs,
                          occ, seconds * 1e6,
                          "throughput" if throughput >= latency else "latency")
