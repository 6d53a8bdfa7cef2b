"""Schedules of the global stitching scope (AStitch's global scope): a kernel
whose reductions' consumers need data from every block runs as one *persistent* kernel —
its grid no larger than the blocks that can be resident at once (the occupancy calculator
× SMs), so a software grid barrier cannot deadlock — in phases separated by grid barriers:

- phase k, for every reduction of stage k (``feasibility.GlobalPhases``): the grid splits
  the reduction into work items — (output, split) pairs when the reduced elements are
  contiguous ("minor": a block strides over its split of the row, warp shuffles and shared
  memory combine the block's threads), (32-column tile, split) pairs for column reductions
  (lanes own columns, warps stride over the split's rows, shared memory combines the
  warps) — and writes one partial per work item into global scratch. Row-splitting is
  what lets a column reduction of 768 columns use every SM instead of 24;
- after a grid barrier the partials are folded: where a reduction has several outputs and
  several splits, a *combine* step folds each output once into a result buffer (grid-stride
  over the outputs) and another grid barrier follows; a reduction with one output is
  folded by every thread that needs it (once per thread: the value is loop-invariant), one
  with one split per output needs no fold;
- the last phase computes the written values by thread composition (grid-stride loops),
  reading reduction results from the scratch at whatever index they need.

The latency-evaluator models each phase as a part (``latency.part_cycles``) on the resident
grid, plus ``latency.grid_barrier_cycles`` per barrier; the alternative — the same phases as
a chain of kernels, a launch instead of a barrier and no residency limit — is modeled too
(``GlobalScope.chain_us``); codegen generates both (``kir.Kernel.grid_sync``), and
``launch_form(schedule)`` says which the model prefers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from stitch.hlo.graph import OpGraph

from ..cost.gpu_specs import GpuSpec
from ..cost.latency import UNROLL, LaunchShape, WarpWork, grid_barrier_cycles, part_cycles
from ..cost.occupancy import occupancy
from ..analysis.feasibility import GlobalPhases, leaf_shape, physical_order
from .kernel_schedule import GroupSchedule, KernelSchedule, PartSchedule
from ..cost.launch_forms import form_for, form_seconds
from .space import op_instructions, written_values

BLOCK_SIZES = (256, 512, 1024)
# Registers per thread, on the safe side (ptxas gave 28-47 on the tests' kernels): the
# grid must stay resident with the real count, or a grid barrier would never open.
GLOBAL_REGISTERS = 64
# Bytes of one partial (f32; f64 reductions take 8).
PARTIAL_BYTES = 4


@dataclass(frozen=True)
class GlobalReduction:
    node: int
    stage: int
    outputs: int            # O: output elements
    row_length: int         # L: input elements reduced into one output
    minor: bool             # an output's inputs are contiguous (else columns)
    splits: int             # S: partials per output (blocks sharing one output)
    items: int              # work items of its phase: O x S (minor) or tiles x S
    combine: bool           # folded once into a result buffer after its phase


@dataclass(frozen=True)
class GlobalScope:
    reductions: tuple[GlobalReduction, ...]
    stages: int
    barriers: int
    resident_blocks: int    # occupancy limit x SMs; the grid never exceeds it
    phase_us: tuple[float, ...]
    barrier_us: float
    chain_us: float         # the same phases as a chain of kernels (one launch each)
    hbm_bytes: int          # inputs read once per phase, outputs, partials and results


@dataclass
class _Phase:
    elements: float = 0.0       # elements computed (reduction inputs or written values)
    alu: float = 0.0            # thread instructions, summed over elements
    sfu: float = 0.0
    accesses: float = 0.0       # global loads/stores, summed over elements
    nbytes: float = 0.0
    items: int = 0              # block-combined work items (reduction phases)
    fold_loads: float = 0.0     # per thread: partials it folds itself


def launch_form(schedule: KernelSchedule, setting: str = "auto") -> str | None:
    """The launch form (``stitch.codegen.kir.GRID_SYNC_MODES``) of a global-scope schedule under
    ``setting`` (``launch_forms.form_for``; "auto": "relaunch" where the same phases as a
    chain of launches, ``chain_us``, are modeled faster than the persistent kernel with its
    grid barriers, else "barrier")."""
    scope = next((p.scope for p in schedule.parts if p.kind == "global"), None)
    if scope is None:
        raise ValueError("not a global-scope schedule")
    return form_for(setting, schedule.modeled_us, scope.chain_us)


def _elements(graph: OpGraph, v: int) -> int:
    return leaf_shape(graph.nodes[v].shape).num_elements


def _bytes(graph: OpGraph, v: int) -> int:
    node = graph.nodes[v]
    return node.shape.byte_size if not node.shape.is_tuple else leaf_shape(node.shape).byte_size


def reduction_geometry(graph: OpGraph, v: int) -> tuple[int, int, bool]:
    """(outputs, row length, minor) of a reduce: minor when its reduced dims are the
    physically minor ones (an output's inputs are contiguous)."""
    node = graph.nodes[v]
    src = leaf_shape(graph.nodes[node.operands[0]].shape)
    outputs = max(leaf_shape(node.shape).num_elements, 1)
    reduced = set(node.instruction.ints("dimensions"))
    order = [d for d in physical_order(src) if src.dims[d] != 1]
    kept = [d for d in order if d not in reduced]
    return outputs, max(src.num_elements // outputs, 1), order[:len(kept)] == kept


def _closure(graph: OpGraph, targets: Iterable[int], members: set[int]
             ) -> tuple[set[int], set[int]]:
    """(ops computed for ``targets``, outside values they read), not walking past reduces
    (their results come from the scratch)."""
    ops: set[int] = set()
    inputs: set[int] = set()
    stack = list(targets)
    while stack:
        v = stack.pop()
        if v in ops:
            continue
        if v not in members:
            inputs.add(v)
            continue
        ops.add(v)
        if graph.nodes[v].opcode == "reduce":
            continue
        stack.extend(graph.nodes[v].operands)
    return ops, inputs


def _splits(outputs: int, row_length: int, minor: bool, grid: int, tpb: int) -> tuple[int, int]:
    """(splits per output, work items): enough items to give every block one, no split
    shorter than a few loads per thread."""
    if minor:
        units, per_item_threads = outputs, tpb
    else:
        units, per_item_threads = math.ceil(outputs / 32), tpb // 32
    splits = max(1, min(grid // max(units, 1), math.ceil(row_length / (per_item_threads * UNROLL))))
    return splits, units * splits


def plan_reductions(graph: OpGraph, phases: GlobalPhases, grid: int, tpb: int
                    ) -> tuple[GlobalReduction, ...]:
    out = []
    for stage, reduces in enumerate(phases.stages):
        for v in reduces:
            outputs, length, minor = reduction_geometry(graph, v)
            splits, items = _splits(outputs, length, minor, grid, tpb)
            out.append(GlobalReduction(v, stage, outputs, length, minor, splits, items,
                                       outputs > 1 and splits > 1))
    return tuple(out)


def _phases(graph: OpGraph, members: set[int], reductions: tuple[GlobalReduction, ...],
            stages: int) -> list[_Phase]:
    """The work of each phase: reduction stages, combine steps (after a stage with a
    combined reduction; a written reduction is stored there), the final phase (none when
    the combine steps stored every output)."""
    by_node = {r.node: r for r in reductions}
    written = written_values(graph, members)
    stored: set[int] = set()
    out: list[_Phase] = []

    def account(phase: _Phase, ops: set[int], inputs: set[int], elements: float) -> None:
        phase.elements += elements
        for v in ops:
            if v in by_node:
                r = by_node[v]
                # A result read from the scratch: one load when combined or unsplit, a
                # fold of every partial (once per thread) otherwise.
                if r.combine or r.splits == 1:
                    phase.accesses += elements
                else:
                    phase.fold_loads += r.splits
                continue
            if graph.is_free(v):
                continue
            alu, sfu = op_instructions(graph, v)
            phase.alu += alu * elements
            phase.sfu += sfu * elements
        phase.accesses += len(inputs) * elements
        phase.nbytes += sum(_bytes(graph, o) for o in inputs)

    for stage in range(stages):
        phase = _Phase()
        mine = [r for r in reductions if r.stage == stage]
        for r in mine:
            node = graph.nodes[r.node]
            ops, inputs = _closure(graph, node.operands, members)
            account(phase, ops, inputs, r.outputs * r.row_length)
            phase.alu += r.outputs * r.row_length       # the reducer
            phase.items += r.items
            phase.nbytes += r.items * (1 if r.minor else 32) * PARTIAL_BYTES
        out.append(phase)
        combined = [r for r in mine if r.combine]
        if combined:
            step = _Phase()
            for r in combined:
                step.elements += r.outputs
                step.accesses += r.outputs * (r.splits + 1)
                step.alu += r.outputs * r.splits
                step.nbytes += r.outputs * PARTIAL_BYTES * 2
                if r.node in written:           # stored to its output here
                    step.nbytes += _bytes(graph, r.node)
                    stored.add(r.node)
            out.append(step)
    final = _Phase()
    if written <= stored:
        return out          # the combine steps stored every output: no last phase
    for v in sorted(written - stored):
        if v in by_node:
            r = by_node[v]
            final.elements += r.outputs
            final.accesses += r.outputs * (1 if (r.combine or r.splits == 1) else 0)
            final.fold_loads += 0 if (r.combine or r.splits == 1) else r.splits
            final.nbytes += _bytes(graph, v)
            continue
        ops, inputs = _closure(graph, [v], members)
        account(final, ops, inputs, _elements(graph, v))
        final.accesses += _elements(graph, v)
        final.nbytes += _bytes(graph, v)
    out.append(final)
    return out


def _phase_cycles(spec: GpuSpec, phase: _Phase, grid: int, tpb: int, regs: int, smem: int,
                  occ) -> float:
    warps_per_block = tpb // 32
    threads = grid * tpb
    per_thread = phase.elements / threads
    items_per_block = math.ceil(phase.items / grid) if phase.items else 0
    combine_steps = 5 + math.ceil(math.log2(max(warps_per_block, 1)))
    work = WarpWork(
        alu=phase.alu / threads + phase.fold_loads,
        sfu=phase.sfu / threads,
        global_bytes=phase.nbytes / (grid * warps_per_block),
        global_instr=phase.accesses / threads + phase.fold_loads,
        memory_rounds=max(1.0, math.ceil(per_thread / UNROLL)) + (1 if phase.fold_loads else 0),
        shared_instr=items_per_block * (2 + warps_per_block),
        shuffles=items_per_block * 5,
        barriers=items_per_block * 2,
        chain_alu=items_per_block * combine_steps)
    throughput, latency, _ = part_cycles(spec, LaunchShape(grid, tpb, regs, smem), work, occ)
    return max(throughput, latency)


def schedule_global(graph: OpGraph, members: Iterable[int], spec: GpuSpec,
                    phases: GlobalPhases, block_sizes: tuple[int, ...] = BLOCK_SIZES
                    ) -> KernelSchedule | None:
    """The fastest persistent-kernel schedule of ``members`` under the global scope, or None
    when no block size can launch."""
    member_set = set(members)
    best: KernelSchedule | None = None
    for tpb in block_sizes:
        got = _schedule(graph, member_set, spec, phases, tpb)
        if got is not None and (best is None or got.modeled_us < best.modeled_us):
            best = got
    return best


def estimate(graph: OpGraph, members: Iterable[int], spec: GpuSpec, phases: GlobalPhases,
             block_sizes: tuple[int, ...] = BLOCK_SIZES, setting: str = "barrier"
             ) -> tuple[float, int] | None:
    """(modeled seconds, HBM bytes) of the best global-scope schedule in the launch form
    ``setting`` gives it (``launch_forms``: the persistent kernel, or its phases as a chain
    of launches), for the cost model (which asks for one block size: it scores thousands of
    patterns). None where no schedule fits or the setting builds no global-scope kernel."""
    got = schedule_global(graph, members, spec, phases, block_sizes)
    if got is None:
        return None
    scope = got.parts[0].scope
    seconds = form_seconds(setting, got.modeled_us * 1e-6, scope.chain_us * 1e-6)
    if seconds is None:
        return None
    return seconds, scope.hbm_bytes


def _schedule(graph: OpGraph, members: set[int], spec: GpuSpec, phases: GlobalPhases,
              tpb: int) -> KernelSchedule | None:
    warps = tpb // 32
    # Shared slots for the block combine: a slot per warp and column (8-byte values).
    smem = warps * 32 * 8
    regs = GLOBAL_REGISTERS
    occ = occupancy(spec, tpb, regs, smem)
    if occ.blocks_per_sm == 0:
        return None
    resident = occ.blocks_per_sm * spec.sm_count
    largest = max([_elements(graph, v) for v in written_values(graph, members)] +
                  [_elements(graph, graph.nodes[v].operands[0]) for v in phases.reductions])
    grid = max(1, min(resident, math.ceil(largest / tpb)))
    reductions = plan_reductions(graph, phases, grid, tpb)
    work = _phases(graph, members, reductions, len(phases.stages))
    cycles = [_phase_cycles(spec, p, grid, tpb, regs, smem, occ) for p in work]
    barrier = grid_barrier_cycles(spec, grid)
    launch = spec.kernel_launch_overhead_s
    total_s = launch + (sum(cycles) + barrier * (len(work) - 1)) / spec.clock_hz
    chain_s = len(work) * launch + sum(cycles) / spec.clock_hz
    nbytes = int(sum(p.nbytes for p in work))
    scope = GlobalScope(reductions, len(phases.stages), len(work) - 1, resident,
                        tuple(c / spec.clock_hz * 1e6 for c in cycles),
                        barrier / spec.clock_hz * 1e6, chain_s * 1e6, nbytes)
    groups = [GroupSchedule(r.node, (r.node,), "global", True) for r in reductions]
    groups += [GroupSchedule(v, (v,), "thread", False)
               for v in sorted(written_values(graph, members)) if v not in phases.reductions]
    first = reductions[0]
    part = PartSchedule(tuple(sorted(members)), "global", "block", first.outputs,
                        first.row_length, first.minor, tpb, 1, 1, grid, groups,
                        registers=regs, modeled_cycles=sum(cycles), scope=scope)
    return KernelSchedule(tuple(sorted(members)), [part], grid, tpb, smem, regs, occ,
                          total_s * 1e6, "global")
