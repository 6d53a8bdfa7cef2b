"""What a kernel part computes, pass by pass: the facts every schedule of it shares.

A row part walks each row in *passes*: pass 0 computes what the first reductions read and
reduces it; pass k computes the consumers of stage-(k-1) reductions, and so on (an op's
stage is the number of reductions on the longest path to it inside the part). Ops whose
value is one per row (``rows`` elements, e.g. mean, rsqrt(var)) are *per-row* ops: as
sub-roots each thread computes them once per pass, otherwise once per element. Full-size
ops a later pass needs are recomputed there (thread composition) unless cached in
registers.

The locality check lives here too: warp/block sharing is legal only when every consumer
element of a shared value is computed by the unit owning the row. Within a part the row
partition comes from the feasibility analysis (row maps), so the check reduces to every
reduction of the part agreeing on that partition.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from stitch.hlo.graph import OpGraph
from stitch.hlo.op_classes import OpClass

from ..cost.hbm_traffic import kernel_hbm_bytes
from ..cost.instruction_costs import EXPENSIVE_INSTRUCTIONS, INSTRUCTIONS_PER_ELEMENT
from ..analysis.feasibility import PatternAnalysis, leaf_shape, reduction_rows


@dataclass(frozen=True)
class Reduction:
    node: int
    rows: int                   # rows of the block partition
    row_length: int             # input elements per row
    outputs_per_row: int        # reduction outputs inside one row (> 1 after coarsening)
    minor: bool
    shared: bool                # consumed inside the part (else a root)


@dataclass
class PassWork:
    """Per-element and per-row work of one pass over a row (or of a loop part)."""

    full_ops: list[int] = field(default_factory=list)       # computed per element
    row_ops: list[int] = field(default_factory=list)        # computed per row
    loads: int = 0              # distinct full-size inputs read per element
    row_loads: int = 0          # per-row inputs read once per row
    stores: int = 0             # full-size values written per element
    row_stores: int = 0         # per-row values written once per row
    alu: float = 0.0            # per element
    sfu: float = 0.0            # per element
    # Per element of the row a warp/block unit walks: ops with fewer elements per row run
    # that many times (loop-invariant motion). Thread composition counts per consumer
    # element instead (``alu``/``sfu``).
    walk_alu: float = 0.0
    walk_sfu: float = 0.0
    reductions: list[int] = field(default_factory=list)     # reductions finishing this pass
    elements: int = 0           # elements of the largest full-size value the pass writes


@dataclass
class PartFacts:
    members: tuple[int, ...]
    reductions: list[Reduction]
    rows: int
    row_length: int
    minor: bool
    elements: int               # loop parts: elements of the largest root
    passes: list[PassWork]
    per_row_expensive: list[int]     # sub-root candidates (expensive ops, one per row)
    multi_pass_expensive: list[int]  # full-size expensive ops more than one pass needs
    hbm_bytes: int              # a warp or block reduces its whole row (every reduction in full)
    locality_error: str | None = None
    # Reductions of the part read their rows in different layouts (some contiguous, some
    # strided): a unit then owns exactly one row of each, and loads are not vectorized.
    mixed_layout: bool = False
    # Thread composition computes only the elements the written values need (a reduction
    # whose result is sliced reduces only the kept outputs): at most ``hbm_bytes``.
    thread_bytes: int = 0
    # Sector traffic of strided reads/writes of buffers in a layout stitch chose
    # (``layout_access.apply_layouts``; 0 without layouts).
    sector_bytes: float = 0.0

    @property
    def reduction_length(self) -> dict[int, int]:
        """Input elements reduced into one output, per reduction: the row length over
        the outputs a (coarsened) row holds."""
        return {r.node: max(r.row_length // max(r.outputs_per_row, 1), 1)
                for r in self.reductions}


def op_instructions(graph: OpGraph, v: int) -> tuple[float, float]:
    """(ALU, SFU) instructions per element of op v."""
    node = graph.nodes[v]
    if graph.is_free(v):
        return 0.0, 0.0
    if node.op_class is OpClass.EXPENSIVE:
        total = EXPENSIVE_INSTRUCTIONS.get(node.opcode, 10.0)
        # The libdevice expansion issues about a quarter of its instructions on the SFU
        # (ex2/lg2/rsqrt approximations), the rest on the FP32 pipe.
        return total * 0.75, total * 0.25
    if node.opcode == "reduce-window" and node.operands:
        # One accumulate per window element, computed per output element.
        window = _elements(graph, node.operands[0]) / max(_elements(graph, v), 1)
        return INSTRUCTIONS_PER_ELEMENT[OpClass.REDUCTION] * max(window, 1.0), 0.0
    return INSTRUCTIONS_PER_ELEMENT.get(node.op_class, 2.0), 0.0


def _elements(graph: OpGraph, v: int) -> int:
    return leaf_shape(graph.nodes[v].shape).num_elements


def _reduction_facts(graph: OpGraph, v: int, members: set[int],
                     analysis: PatternAnalysis) -> Reduction:
    node = graph.nodes[v]
    src_elements = _elements(graph, node.operands[0])
    out_elements = max(_elements(graph, v), 1)
    # The same partition the feasibility predicate checked (row maps for shared ones).
    rows, minor = reduction_rows(graph, v, analysis)
    return Reduction(v, rows, max(src_elements // max(rows, 1), 1),
                     max(out_elements // max(rows, 1), 1), minor,
                     any(u in members for u in node.users))


def written_values(graph: OpGraph, members: set[int]) -> set[int]:
    """Computed values a kernel part writes: used outside or leaving the graph, directly
    or through free aliases inside the part (a bitcast of a broadcast that a GEMM reads)."""
    outputs = set(graph.outputs)
    escapes: set[int] = set()
    for v in sorted(members, reverse=True):
        if v in outputs or any(u not in members or (u in escapes and graph.is_free(u))
                               for u in graph.nodes[v].users):
            escapes.add(v)
    return {v for v in escapes if not graph.is_free(v)}


def part_facts(graph: OpGraph, members: list[int], analysis: PatternAnalysis) -> PartFacts:
    member_set = set(members)
    order = sorted(members)
    # Only reduce partitions rows; a reduce-window is a loop op (a thread per window).
    reductions = [_reduction_facts(graph, v, member_set, analysis) for v in order
                  if graph.nodes[v].opcode == "reduce"]
    # Only what the kernel's outputs depend on is read (gathered rows, slices, in-place
    # updates); a warp or block unit reduces every row in full.
    hbm = kernel_hbm_bytes(graph, member_set, whole=[r.node for r in reductions])
    thread_hbm = kernel_hbm_bytes(graph, member_set)
    written = written_values(graph, member_set)
    if not reductions:
        elements = max((_elements(graph, v) for v in written), default=1)
        work = _pass_work(graph, member_set, [v for v in order if not graph.is_free(v)],
                          [], written, [], _evaluations(graph, member_set, written, elements))
        return PartFacts(tuple(order), [], elements, 1, True, elements, [work], [], [], hbm,
                         thread_bytes=thread_hbm)
    primary = max(reductions, key=lambda r: r.rows * r.row_length)
    error = None
    mixed = any(r.minor != primary.minor for r in reductions)
    for r in reductions:
        if r.rows != primary.rows:
            error = (f"{graph.nodes[r.node].name} partitions rows differently from "
                     f"{graph.nodes[primary.node].name} ({r.rows} vs {primary.rows} rows): "
                     "no unit can own both rows")
    rows = primary.rows
    row_length = primary.row_length
    reduction_ids = {r.node for r in reductions}
    stage: dict[int, int] = {}
    for v in order:
        s = 0
        for o in graph.nodes[v].operands:
            if o in member_set:
                s = max(s, stage[o] + (o in reduction_ids))
        stage[v] = s
    per_row = {v for v in order if v not in reduction_ids and stage[v] > 0
               and _elements(graph, v) <= rows and not graph.is_free(v)}
    n_passes = max(stage[r] for r in reduction_ids) + 1
    last_full = max((stage[v] for v in order if v not in per_row and v not in reduction_ids
                     and not graph.is_free(v)), default=0)
    n_passes = max(n_passes, last_full + 1)
    # A pass walks a row's ``row_length`` elements; an op with fewer elements per row (the
    # label's index math, a split reduction's second level over 128 partials) runs that
    # many times, not once per element: codegen computes a value in the outermost loop
    # whose variable its index reads (loop-invariant motion). A reduce works per input.
    row_elements = max(rows * row_length, 1)
    per_element = {v: min(_work_elements(graph, v) / row_elements, 1.0) for v in order}
    passes = []
    needed_in: dict[int, set[int]] = {}
    for p in range(n_passes):
        targets = [v for v in order if stage[v] == p and not graph.is_free(v)]
        full = _closure(graph, [v for v in targets if v not in per_row], member_set,
                        reduction_ids | per_row)
        for v in full:
            needed_in.setdefault(v, set()).add(p)
        rows_here = [v for v in targets if v in per_row]
        finishing = [v for v in targets if v in reduction_ids]
        passes.append(_pass_work(graph, member_set, full, rows_here, written, finishing,
                                 walk=per_element))
    expensive = [v for v in order if graph.nodes[v].op_class is OpClass.EXPENSIVE]
    return PartFacts(tuple(order), reductions, rows, row_length, primary.minor or mixed,
                     rows * row_length, passes,
                     [v for v in expensive if v in per_row],
                     [v for v in expensive if len(needed_in.get(v, ())) > 1], hbm, error,
                     mixed, thread_hbm)


def _work_elements(graph: OpGraph, v: int) -> int:
    """Elements op v computes: a reduce accumulates its inputs; a broadcast's index math
    depends only on its operand's index, so it is hoisted with its operand (a per-row
    value broadcast along the row costs nothing per element)."""
    node = graph.nodes[v]
    if node.opcode in ("reduce", "broadcast") and node.operands:
        return _elements(graph, node.operands[0])
    return _elements(graph, v)


def _closure(graph: OpGraph, targets: list[int], members: set[int], stop: set[int]
             ) -> list[int]:
    """Targets and their in-part ancestors, not walking past ``stop`` (values available
    per row)."""
    seen = set()
    stack = list(targets)
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        stack.extend(o for o in graph.nodes[v].operands
                     if o in members and o not in seen and o not in stop)
    return sorted(seen)


def _evaluations(graph: OpGraph, members: set[int], written: set[int], domain: int
                 ) -> dict[int, float]:
    """How often thread composition evaluates each op of a loop part, per element of the
    part's domain. Codegen computes each written value in a loop of its own, every element
    by index propagation with the values of one element memoized, so within one written
    value an op runs as often as its most demanding consumer asks (recomputed under a
    broadcast, only the gathered or sliced elements, and for a dynamic-update-slice,
    concatenate or pad only inside the operand's window, a guarded branch); the loops of
    different written values add up."""
    order = sorted(members, reverse=True)
    runs: dict[int, float] = {}
    for root in written:
        mine = {root: float(_elements(graph, root))}
        for v in order:
            if v >= root:
                continue
            need = max((mine[w] * _reads_per_element(graph, w, v)
                        for w in graph.nodes[v].users if w in mine), default=0.0)
            if need > 0.0:
                mine[v] = need
        for v, n in mine.items():
            runs[v] = runs.get(v, 0.0) + n
    return {v: n / max(domain, 1) for v, n in runs.items()}


def _reads_per_element(graph: OpGraph, w: int, v: int) -> float:
    """Elements of operand v that one element of w evaluates, on average."""
    node = graph.nodes[w]
    out = max(_elements(graph, w), 1)
    total = 0.0
    for position, o in enumerate(node.operands):
        if o != v:
            continue
        if node.opcode == "dynamic-update-slice" and position < 2:
            inside = min(_elements(graph, node.operands[1]) / out, 1.0)
            total += inside if position == 1 else 1.0 - inside
        elif node.opcode == "concatenate" or (node.opcode == "pad" and position == 0):
            total += min(_elements(graph, v) / out, 1.0)
        elif node.opcode == "pad":                  # the padding value, outside the operand
            total += max(1.0 - _elements(graph, node.operands[0]) / out, 0.0)
        elif node.opcode == "reduce-window" and position < len(node.operands) // 2:
            total += max(_elements(graph, v) / out, 1.0)
        else:
            # The same element read twice (add(x, x)) is computed once.
            total = max(total, 1.0)
    return total


def _pass_work(graph: OpGraph, members: set[int], full: list[int], rows_here: list[int],
               written: set[int], finishing: list[int],
               evaluations: dict[int, float] | None = None,
               walk: dict[int, float] | None = None) -> PassWork:
    """The pass's loads, stores and instructions per element; ``evaluations`` weighs each
    op's instructions by its evaluations per element (loop parts), else each op counts
    once. ``walk`` (row parts): each op's share of a row element, for ``walk_alu``/
    ``walk_sfu``; a scalar input there (a reduction's init value) is loaded once per row."""
    work = PassWork(full_ops=[v for v in full if not graph.is_free(v)], row_ops=rows_here,
                    reductions=finishing)
    full_set = set(full)
    inputs: set[int] = set()
    row_inputs: set[int] = set()
    for v in list(full) + rows_here:
        for o in graph.nodes[v].operands:
            if o in members:
                continue
            per_row = v in rows_here or (walk is not None and _elements(graph, o) <= 1)
            (row_inputs if per_row else inputs).add(o)
    work.loads = len(inputs)
    work.row_loads = len(row_inputs)
    work.stores = sum(1 for v in full_set if v in written)
    work.elements = max((_elements(graph, v) for v in work.full_ops if v in written), default=0)
    work.row_stores = sum(1 for v in rows_here if v in written) + sum(
        1 for v in finishing if v in written)
    for v in work.full_ops:
        alu, sfu = op_instructions(graph, v)
        weight = 1.0 if evaluations is None else evaluations.get(v, 1.0)
        work.alu += alu * weight
        work.sfu += sfu * weight
        share = 1.0 if walk is None else walk.get(v, 1.0)
        work.walk_alu += alu * share
        work.walk_sfu += sfu * share
    return work
