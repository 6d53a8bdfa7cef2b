"""Layouts chosen jointly with schedules (ALT).

A value one stitched kernel writes and only stitched kernels read (a *crossing value*)
lives in a buffer stitch owns, so its layout is stitch's to choose: the permutation of its
logical dims that the buffer holds, major to minor (``stitch.codegen.values.physical_offset``).
Run on a finished plan (the explorer has picked the kernels, the tuner their schedules):

1. crossing values: not free, rank >= 2, written by exactly one fused kernel with a block
   schedule, every reader a member of a scheduled fused kernel (so no evaluator, GEMM,
   custom call, XLA kernel or module output ever sees the buffer);
2. candidates per value (ALT's layout space cut to what the readers can use): the default;
   per reader's reduction of it, the layout that puts the reduced dims minor (a column
   reduction becomes a row reduction of the buffer: coalesced, row schedules, one row per
   warp/block); per reader's transpose of it, the transpose's permutation (the transpose
   reads the buffer in order); and, ALT's propagation, the layout of a re-laid-out value
   the producer derives it from elementwise (the producer keeps walking in that order);
3. the choice: each candidate re-tunes the producer and every reader with the layout
   (``schedule_kernel(layouts=...)``; the latency-evaluator prices strided reads and writes
   by ``layout_access``), and the fastest sum wins, by more than the tuner's 1% tie, else
   the default stays. Values are taken in topological order with the layouts already chosen
   in place, so a chain of crossing values propagates a layout;
4. every kernel touching a chosen layout is re-tuned under the final layouts (a layout may
   change which schedule wins) and takes that schedule.

A kernel whose re-tuned schedule is a global-scope one (``global_scope.py``, whose model
does not price layouts) never reads or writes a re-laid-out value: such a candidate is
dropped. Values leaving stitch keep XLA's layout by construction (rule 1).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from stitch.hlo.graph import OpGraph

from ..cost.gpu_specs import GpuSpec, get_spec
from ..errors import StitchError
from ..analysis.feasibility import leaf_shape
from .kernel_schedule import KernelSchedule
from .layout_access import Layout, UNIFORM, UNKNOWN, feeding_inputs, identity, trace_dim
from .tuner import TIE, schedule_kernel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayoutChoice:
    value: int                     # node id
    name: str
    shape: str
    layout: Layout                 # logical dims, major to minor
    reason: str                    # which candidate rule proposed it
    producer: str                  # kernel names
    readers: tuple[str, ...]
    before_us: float               # producer + readers, default layout (access-priced)
    after_us: float                # ... with this layout


@dataclass(frozen=True)
class LayoutCandidate:
    """One candidate priced for one value (chosen or not): the producer's and the readers'
    modeled µs at the default layout and with the candidate (None: no block schedule)."""
    value: int
    name: str
    layout: Layout
    reason: str
    producer_us: tuple[float, float | None]
    readers_us: tuple[float, float | None]

    @property
    def delta_us(self) -> float | None:
        """Modeled µs the candidate saves (negative: it costs)."""
        if self.producer_us[1] is None or self.readers_us[1] is None:
            return None
        return sum(x[0] for x in (self.producer_us, self.readers_us)) - \
            self.producer_us[1] - self.readers_us[1]


@dataclass
class GraphLayouts:
    """The layouts of one graph plan: ``layouts`` (node -> layout, identities left out),
    the choices with their modeled times, how many crossing values were considered, and
    the schedules the kernels touching a chosen layout were re-tuned to (by kernel name)."""
    layouts: dict[int, Layout] = field(default_factory=dict)
    choices: list[LayoutChoice] = field(default_factory=list)
    considered: int = 0
    candidates: list[LayoutCandidate] = field(default_factory=list)
    schedules: dict[str, KernelSchedule] = field(default_factory=dict)
    before_us: float = 0.0         # modeled µs of the kernels re-tuned, as planned
    after_us: float = 0.0          # ... with the layouts


def kernel_layouts(graph: OpGraph, layouts: dict[int, Layout], members) -> dict[int, Layout]:
    """The layouts in ``layouts`` of values a kernel with ``members`` reads or writes."""
    return _touching(graph, layouts, members)


def _touching(graph: OpGraph, layouts: dict[int, Layout], members) -> dict[int, Layout]:
    members = set(members)
    out = {}
    for v, layout in layouts.items():
        if v in members or any(v in graph.nodes[m].operands for m in members):
            out[v] = layout
    return out


def _block_schedule(k) -> bool:
    return k.kind == "fused" and k.schedule is not None and \
        all(p.kind != "global" for p in k.schedule.parts)


def crossing_values(graph: OpGraph, kernels: list) -> dict[int, tuple[int, list[int]]]:
    """value -> (producer kernel index, reader kernel indices) for every value whose buffer
    only stitched kernels see (module docstring, rule 1)."""
    owners: dict[int, list[int]] = {}
    for i, k in enumerate(kernels):
        for v in k.members:
            owners.setdefault(v, []).append(i)
    outputs = set(graph.outputs)
    found: dict[int, tuple[int, list[int]]] = {}
    for v, ks in owners.items():
        node = graph.nodes[v]
        if len(ks) != 1 or graph.is_free(v) or v in outputs or not node.shape.is_array \
                or leaf_shape(node.shape).rank < 2 or leaf_shape(node.shape).num_elements <= 1:
            continue
        producer = ks[0]
        if not _block_schedule(kernels[producer]):
            continue
        readers: set[int] = set()
        ok = True
        for u in node.users:
            if producer in owners.get(u, []):
                continue
            reading = owners.get(u, [])
            if not reading or not all(kernels[j].kind == "fused" and
                                      kernels[j].schedule is not None for j in reading):
                ok = False
                break
            readers.update(reading)
        if ok and readers:
            found[v] = (producer, sorted(readers))
    return found


def candidate_layouts(graph: OpGraph, v: int, reader_members: list[frozenset[int]],
                      producer_members: frozenset[int], chosen: dict[int, Layout]
                      ) -> list[tuple[Layout, str]]:
    """Non-default layouts worth pricing for ``v`` (module docstring, rule 2)."""
    shape = leaf_shape(graph.nodes[v].shape)
    rank = shape.rank
    out: dict[Layout, str] = {}
    for members in reader_members:
        for r in sorted(members):
            node = graph.nodes[r]
            if node.opcode == "reduce" and len(node.operands) == 2 and \
                    v in feeding_inputs(graph, members, r):
                got = _reduction_layout(graph, members, r, v, shape.dims)
                if got is not None:
                    out.setdefault(got, f"{node.name} reduces it by rows")
            elif node.opcode == "transpose":
                dims = [trace_dim(graph, members, r, k, v)
                        for k in range(leaf_shape(node.shape).rank)]
                if sorted(d for d in dims if d is not None) == list(range(rank)):
                    out.setdefault(tuple(dims), f"{node.name} reads it in order")
    # Propagation: the producer computes v from a re-laid-out value of the same dims.
    for u, layout in chosen.items():
        if leaf_shape(graph.nodes[u].shape).dims == shape.dims and \
                any(u in graph.nodes[m].operands for m in producer_members):
            out.setdefault(layout, f"propagated from {graph.nodes[u].name}")
    out.pop(identity(rank), None)
    return list(out.items())


def _reduction_layout(graph: OpGraph, members: frozenset[int], r: int, v: int,
                      dims: tuple[int, ...]) -> Layout | None:
    """The layout of v that puts what reduction r reduces of it minor (kept dims first,
    both in logical order), or None where the dims do not map one to one."""
    node = graph.nodes[r]
    operand = node.operands[0]
    src = leaf_shape(graph.nodes[operand].shape)
    reduced_axes = set(node.instruction.ints("dimensions"))
    kept_v: list[int] = []
    kept_elements = 1
    for a in range(src.rank):
        if a in reduced_axes or src.dims[a] == 1:
            continue
        kept_elements *= src.dims[a]
        d = trace_dim(graph, members, operand, a, v)
        if d is None or d in (UNKNOWN, UNIFORM):
            return None
        kept_v.append(d)
    kept = sorted(set(kept_v))
    if len(kept) != len(kept_v):
        return None
    if math.prod(dims[d] for d in kept) != kept_elements:
        return None            # a kept axis merges several dims of v: not a permutation
    reduced = [d for d in range(len(dims)) if d not in kept]
    return tuple(kept + reduced)


def _tune(graph: OpGraph, spec: GpuSpec, kernel, layouts: dict[int, Layout]
          ) -> KernelSchedule | None:
    mine = _touching(graph, layouts, kernel.members)
    try:
        return schedule_kernel(graph, kernel.members, spec, layouts=mine)
    except StitchError as exc:
        log.debug("layouts: %s has no schedule under %s: %s", kernel.name, mine, exc)
        return None


def _priced(graph: OpGraph, spec: GpuSpec, kernels: list, indices: list[int],
            layouts: dict[int, Layout], laid_out: set[int]) -> tuple[float, dict] | None:
    """Modeled µs of the kernels ``indices`` re-tuned under ``layouts``; None when one has
    no schedule or takes a global-scope one while touching a re-laid-out value."""
    total = 0.0
    schedules = {}
    for i in indices:
        s = _tune(graph, spec, kernels[i], layouts)
        if s is None:
            return None
        touching = any(layouts.get(v) != identity(len(layouts[v]))
                       for v in _touching(graph, layouts, kernels[i].members) if v in laid_out)
        if touching and any(p.kind == "global" for p in s.parts):
            return None
        total += s.modeled_us
        schedules[i] = s
    return total, schedules


def choose_layouts(graph: OpGraph, kernels: list, spec: GpuSpec) -> GraphLayouts:
    """The layouts of one graph's stitched kernels (module docstring); ``kernels`` is the
    plan's kernel list in launch order. Nothing is changed on the kernels."""
    result = GraphLayouts()
    crossing = crossing_values(graph, kernels)
    result.considered = len(crossing)
    chosen: dict[int, Layout] = {}
    for v in sorted(crossing):
        producer, readers = crossing[v]
        rank = leaf_shape(graph.nodes[v].shape).rank
        candidates = candidate_layouts(graph, v, [frozenset(kernels[j].members) for j in readers],
                                       frozenset(kernels[producer].members), chosen)
        if not candidates:
            continue
        affected = [producer] + [j for j in readers if j != producer]
        laid_out = set(chosen) | {v}
        base = _priced(graph, spec, kernels, affected, {**chosen, v: identity(rank)}, laid_out)
        if base is None:
            continue
        best: tuple[float, Layout, str] | None = None
        base_producer = base[1][producer].modeled_us
        for layout, reason in candidates:
            got = _priced(graph, spec, kernels, affected, {**chosen, v: layout}, laid_out)
            producer_us = got[1][producer].modeled_us if got else None
            result.candidates.append(LayoutCandidate(
                v, graph.nodes[v].name, layout, reason, (base_producer, producer_us),
                (base[0] - base_producer, got[0] - producer_us if got else None)))
            if got is not None and (best is None or got[0] < best[0]):
                best = (got[0], layout, reason)
        if best is None or best[0] >= base[0] * (1 - TIE):
            continue
        chosen[v] = best[1]
        result.choices.append(LayoutChoice(
            v, graph.nodes[v].name, str(graph.nodes[v].shape), best[1], best[2],
            kernels[producer].name, tuple(kernels[j].name for j in readers), base[0], best[0]))
        log.info("layouts: %s %s stored as %s (%s): %.2f -> %.2f us", graph.nodes[v].name,
                 graph.nodes[v].shape, best[1], best[2], base[0], best[0])
    result.layouts = chosen
    for k in kernels:
        mine = _touching(graph, chosen, k.members)
        if not mine or k.schedule is None:
            continue
        tuned = _tune(graph, spec, k, chosen)
        if tuned is None:
            raise StitchError(f"layouts: {k.name} lost its schedule under the chosen layouts")
        result.schedules[k.name] = tuned
        result.before_us += k.schedule.modeled_us
        result.after_us += tuned.modeled_us
    return result


def apply_layouts(plan, target: str | GpuSpec | None = None, *, assign: bool = True
                  ) -> list[GraphLayouts]:
    """Choose the layouts of every graph of a ``FusionPlan``; with ``assign`` the kernels
    touching them take their re-tuned schedules (the compiler passes False and lowers
    with ``GraphLayouts.schedules``, leaving a cached plan as planned). Returns one
    ``GraphLayouts`` per graph (plan order)."""
    spec = target if isinstance(target, GpuSpec) else get_spec(target or plan.target)
    out = []
    for g in plan.graphs:
        got = choose_layouts(g.graph, g.stitched.kernels, spec)
        if assign:
            for k in g.stitched.kernels:
                if k.name in got.schedules:
                    k.schedule = got.schedules[k.name]
        out.append(got)
    return out


def drop_layouts(graph: OpGraph, chosen: GraphLayouts, values) -> set[int]:
    """Return ``values``' buffers to the row-major layout (a kernel touching them runs
    through the evaluator, which reads logical buffers); the node ids dropped."""
    dropped = {v for v in values if v in chosen.layouts}
    for v in dropped:
        del chosen.layouts[v]
    chosen.choices = [c for c in chosen.choices if c.value not in dropped]
    return dropped
