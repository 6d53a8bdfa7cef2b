"""What colliding scatter updates cost: atomics to one address serialize at its L2 slice.

A scatter whose updates may collide (``stitch.hlo.scatter_forms``: form ``atomic``) is run,
by XLA and by stitch alike, as one atomic read-modify-write per update element. Updates to
distinct addresses pipeline through the L2 at about the speed their bytes already cost; the
ones that meet another update of the same address wait for it. So the price of a scatter
is its bytes plus a contention term set by how many updates land on each address:

- ``collisions`` c, the expected number of updates sharing an address, is *proved* where
  the index values follow from the module (``known_index_values``: iota, constants,
  ``iota // L`` ...; sorted segments of length L give c = L), and otherwise *assumed*
  uniform: c = update windows / distinct index vectors the operand offers (at least 1).
- A native atomic (a hardware ``red``/``atom``: add of f32/f64/s32/u32/s64/u64, of f16 and
  bf16 from sm_90 on; max/min of integers and, as XLA emits them through the integer
  units, of f32) holds the address for ``SAME_ADDRESS_ATOMIC_CYCLES``; the waiting
  fraction (1 - 1/c) of the updates serializes there. A compare-and-swap loop (other
  combiners and types) makes an address's c contenders retry: c rounds, one winner per
  round, about c(c+1)/2 attempts per address, each attempt holding the slice as long as a
  native atomic does; the rounds follow one another an L2 round trip apart.
- The L2 serves different addresses in parallel over ``L2_ATOMIC_SLICES`` slices
  (assumed: the L2 slice counts of the parts, 64 on V100, 80 on A100 and H100).

    serial_cycles = max(L2 operations that wait × same-address cycles / slices,
                        one address's chain)   # c × same-address cycles, or c round trips
    contention_s  = serial_cycles / clock

The figures are assumptions built from the same microbenchmark papers as
``latency.SAME_ADDRESS_ATOMIC_CYCLES`` (not measured here), and the same for XLA's kernels
and stitch's, so only the index pattern changes which plan wins — except for a
scatter-add over sorted ids that stitch generates in runs (``hlo.sorted_runs``:
about c / run_rows + 1 atomics per address instead of c), which XLA does not
(``contention_seconds(runs=False)`` prices XLA's kernels); and except for a scatter whose
update rows fall into groups of distinct ids (``hlo.grouped_scatter``: an
expert-choice MoE combine), which stitch generates without atomics in column tiles: no
contention, but its blocks walk the rows in dependent round trips and every tile rereads
the ids (``tiles_price``).
"""
from __future__ import annotations

import dataclasses
import logging
import weakref
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from stitch.hlo.combiners import combiner_kind
from stitch.hlo.graph import OpGraph
from stitch.hlo.grouped_scatter import UNROLL_ROWS, GroupedScatter, grouped_scatter
from stitch.hlo.scatter_forms import known_index_values, scatter_form
from stitch.hlo.sorted_runs import run_scatter

from .gpu_specs import GpuSpec
from .latency import (BARRIER_LATENCY_CYCLES, DRAM_LATENCY_CYCLES, L2_LATENCY_CYCLES,
                      SAME_ADDRESS_ATOMIC_CYCLES)

log = logging.getLogger(__name__)

# L2 slices that serve atomics in parallel (assumed; see the module docstring).
L2_ATOMIC_SLICES = {7: 64, 8: 80, 9: 80}

_NATIVE_ADD = {"f32", "f64", "s32", "u32", "s64", "u64"}
_NATIVE_ADD_SM90 = _NATIVE_ADD | {"f16", "bf16"}
_NATIVE_MINMAX = {"s32", "u32", "s64", "u64", "f32"}


@dataclass(frozen=True)
class Contention:
    """The atomics of one scatter: update elements, distinct addresses they hit, expected
    updates per address hit, whether that figure is proved from the index values, and
    whether each update is one hardware atomic (else a compare-and-swap loop)."""

    node: int
    updates: int
    addresses: int
    collisions: float
    proved: bool
    native: bool

    def serial_cycles(self, spec: GpuSpec) -> float:
        """SM-clock cycles the address chains add to the kernel (module docstring)."""
        c = max(self.collisions, 1.0)
        if c <= 1.0:
            return 0.0
        slices = L2_ATOMIC_SLICES.get(spec.compute_capability[0], 80)
        per_op = float(SAME_ADDRESS_ATOMIC_CYCLES)
        if self.native:
            waiting_ops = self.updates * (1.0 - 1.0 / c)
            chain = c * per_op
        else:
            waiting_ops = self.addresses * (c * (c + 1) / 2 - 1)
            chain = c * float(L2_LATENCY_CYCLES.get(spec.compute_capability[0], 260))
        return max(waiting_ops * per_op / slices, chain)

    def seconds(self, spec: GpuSpec) -> float:
        return self.serial_cycles(spec) / spec.clock_hz

    def in_runs(self, run_rows: int) -> "Contention":
        """The atomics left when each thread first adds ``run_rows`` consecutive updates
        of an element column while their id repeats (``hlo.sorted_runs``): a
        segment of c updates spans about c / run_rows + 1 runs, one atomic each."""
        c = max(self.collisions, 1.0)
        runs = min(c, c / run_rows + 1.0)
        return dataclasses.replace(self, updates=max(int(round(self.updates * runs / c)), 1),
                                   collisions=runs)


def _native(kind: str | None, element_type: str, spec_major: int) -> bool:
    if kind == "add":
        return element_type in (_NATIVE_ADD_SM90 if spec_major >= 9 else _NATIVE_ADD)
    if kind in ("maximum", "minimum"):
        return element_type in _NATIVE_MINMAX
    return False


_CACHE: "weakref.WeakKeyDictionary[OpGraph, dict[tuple[int, int], Contention | None]]" = \
    weakref.WeakKeyDictionary()


def scatter_contention(graph: OpGraph, v: int, spec_major: int = 9) -> Contention | None:
    """The atomics of scatter ``v`` (None when it is not a scatter whose updates may
    collide). Cached per graph."""
    cache = _CACHE.setdefault(graph, {})
    key = (v, spec_major)
    if key not in cache:
        cache[key] = _contention(graph, v, spec_major)
    return cache[key]


def _contention(graph: OpGraph, v: int, spec_major: int) -> Contention | None:
    node = graph.nodes[v]
    if node.opcode != "scatter" or node.shape.is_tuple or len(node.operands) != 3:
        return None
    form = scatter_form(graph, v)
    if form.kind != "atomic" or form.index_map is None:
        return None
    imap = form.index_map
    inst = node.instruction
    update_shape = graph.nodes[node.operands[2]].shape
    operand_shape = graph.nodes[node.operands[0]].shape
    updates = update_shape.num_elements
    window = int(np.prod(imap.window, dtype=np.int64)) if imap.window else 1
    points = int(np.prod(imap.batch_shape, dtype=np.int64)) if imap.batch_shape else 1
    names = [n.lstrip("%") for n in inst.called_computations]
    comp = graph.computations.get(names[0]) if names else None
    kind = combiner_kind(comp) if comp is not None else None
    native = _native(kind, operand_shape.element_type, spec_major)
    proved = _proved_collisions(graph, node.operands[1], imap.index_vector_dim, points)
    if proved is not None:
        distinct, collisions = proved
    else:
        # Assumed uniform over the index vectors the operand offers on its data dims.
        offered = 1
        for od, _ in imap.data:
            offered *= max(operand_shape.dims[od] - imap.window[od] + 1, 1)
        distinct = max(min(points, offered), 1)
        collisions = max(points / distinct, 1.0)
    return Contention(v, updates, distinct * window, collisions, proved is not None, native)


def _proved_collisions(graph: OpGraph, indices: int, vector_dim: int, points: int
                       ) -> tuple[int, float] | None:
    """(distinct index vectors, expected updates per address an update meets) when every
    index value is known: sum(count²) / sum(count) over the distinct vectors."""
    values, known = known_index_values(graph, indices)
    if not bool(known.all()) or points == 0:
        return None
    if vector_dim == values.ndim:
        values = values[..., None]
    else:
        values = np.moveaxis(values, vector_dim, -1)
    flat = values.reshape(points, values.shape[-1])
    if flat.shape[1] == 1:
        _, counts = np.unique(flat[:, 0], return_counts=True)
    else:
        _, counts = np.unique(flat, axis=0, return_counts=True)
    counts = counts.astype(np.float64)
    return len(counts), float((counts * counts).sum() / counts.sum())


@dataclass(frozen=True)
class TilesPrice:
    """What a scatter generated in column tiles costs beyond its bytes: ``chain_s``, the
    dependent round trips of one block's walk (a floor under the kernel's time: the items
    run at most two blocks per SM), and ``extra_s``, the ids every item rereads (L2)."""
    chain_s: float
    extra_s: float

    def floor(self, total_s: float, spec: GpuSpec) -> float:
        """A kernel's ``total_s`` with the tiles' chain as its floor and their rereads added."""
        return max(total_s, spec.kernel_launch_overhead_s + self.chain_s) + self.extra_s


def tiles_price(grouped: GroupedScatter, spec: GpuSpec) -> TilesPrice:
    """Per group, a thread walks its rows in chunks of ``UNROLL_ROWS``: the chunk's ids (an
    L2 round trip), its updates (a DRAM round trip), then a read-modify-write (an L2 round
    trip) for each row whose id is in the item's range, one after another; a barrier and a
    round trip start each group and the tile's first stores."""
    major = spec.compute_capability[0]
    l2 = L2_LATENCY_CYCLES.get(major, 260)
    dram = DRAM_LATENCY_CYCLES.get(major, 480)
    chunk = l2 + dram + UNROLL_ROWS * grouped.hit_share * l2
    per_item = (grouped.groups + 1) * (BARRIER_LATENCY_CYCLES + l2) + \
        grouped.groups * grouped.chunks() * chunk
    waves = -(-grouped.items // (2 * spec.sm_count))
    index_bytes = grouped.items * grouped.rows * 4
    return TilesPrice(waves * per_item / spec.clock_hz, index_bytes / spec.l2_bandwidth)


def tiles_prices(graph: OpGraph, members: Iterable[int], spec: GpuSpec) -> list[TilesPrice]:
    """The column-tiled scatters among ``members``, priced (``tiles_price``)."""
    return [tiles_price(g, spec) for g in (grouped_scatter(graph, v) for v in members
                                            if graph.nodes[v].opcode == "scatter")
            if g is not None]


def contention_seconds(graph: OpGraph, members: Iterable[int], spec: GpuSpec,
                       runs: bool = True) -> float:
    """Seconds the colliding scatters among ``members`` add to their kernel: as stitch
    generates them (``runs``: a scatter-add over sorted ids in runs,
    ``hlo.sorted_runs``; one over groups of distinct ids in column tiles,
    ``hlo.grouped_scatter``), or as XLA does (one atomic per update element)."""
    major = spec.compute_capability[0]
    total = 0.0
    for v in members:
        if graph.nodes[v].opcode != "scatter":
            continue
        if runs and grouped_scatter(graph, v) is not None:
            continue        # no atomics: priced by tiles_prices
        got = scatter_contention(graph, v, major)
        if got is None:
            continue
        in_runs = run_scatter(graph, v) if runs else None
        if in_runs is not None:
            got = got.in_runs(in_runs.run_rows)
            if in_runs.op != "add":     # a run's max/min: a compare-and-swap loop
                got = dataclasses.replace(got, native=False)
        total += got.seconds(spec)
    return total


__all__ = ["Contention", "L2_ATOMIC_SLICES", "scatter_contention", "contention_seconds",
           "TilesPrice", "tiles_price", "tiles_prices"]
