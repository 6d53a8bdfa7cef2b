"""Scatter-adds (and -max/-min) over sorted ids whose segments are not known until run time,
combined in runs.

``jax.ops.segment_sum(x, ids, S, indices_are_sorted=True)`` with ``ids`` data (a graph's
destination nodes, an embedding bag's bag of each token: segments of any length, CSR
order) is a scatter-add whose updates collide: XLA adds every update element atomically,
and the updates of one segment wait for each other at its address. Stitch generates such
a scatter in *runs*: each thread takes one element column of ``RUN_ROWS`` consecutive
update rows, adds the rows while their id stays the same and adds the sum atomically when
it changes (and at the end). A segment of L rows then costs about L / RUN_ROWS + 1 atomic
adds per element instead of L. ``segment_max`` / ``segment_min`` go the same way: each
run's maximum is combined by a compare-and-swap loop (XLA's own float maximum is an
atomic per update element).

The result does not depend on the ids being sorted: any run of equal ids is summed first,
so unsorted ids only make more runs (never more atomics than one per update). Sums are
formed in another order than XLA's (its atomics have no fixed order either). Ids outside
the operand are skipped per run, as XLA skips their updates.

What qualifies (``run_scatter``): a colliding scatter of whole operand rows
(``scatter_forms.whole_rows_scatter``: one update batch dim leading the updates, one index
component into operand dim 0, the window spanning the rest of the operand, no batching
dims) whose combiner is add, maximum or minimum, marked ``indices_are_sorted=true`` or
with index values proved never to decrease (where ids are not sorted, runs buy nothing).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

from .graph import OpGraph
from .scatter_forms import known_index_values, whole_rows_scatter

# Update rows one thread adds before its atomic (per element column).
RUN_ROWS = 16


# Combiners generated in runs, as codegen's binary ops: a run's result is combined into
# the operand by an atomic add, or by a compare-and-swap loop for max and min.
_RUN_OPS = {"add": "add", "maximum": "max", "minimum": "min"}


@dataclass(frozen=True)
class RunScatter:
    """A scatter generated in runs: ``rows`` update rows of ``width`` elements each,
    combined by ``op`` (codegen's "add", "max" or "min")."""
    rows: int
    width: int
    op: str = "add"
    run_rows: int = RUN_ROWS

    @property
    def runs(self) -> int:
        """Work items: element columns times chunks of ``run_rows`` rows."""
        return self.width * -(-self.rows // self.run_rows)


_CACHE: "weakref.WeakKeyDictionary[OpGraph, dict[int, RunScatter | None]]" = \
    weakref.WeakKeyDictionary()


def run_scatter(graph: OpGraph, v: int) -> RunScatter | None:
    """How scatter ``v`` is generated in runs, or None (module docstring). Cached per graph:
    the cost model asks for every pattern holding a scatter."""
    cache = _CACHE.setdefault(graph, {})
    if v not in cache:
        cache[v] = _run_scatter(graph, v)
    return cache[v]


def _run_scatter(graph: OpGraph, v: int) -> RunScatter | None:
    node = graph.nodes[v]
    if node.opcode != "scatter" or len(node.operands) != 3:
        return None
    if node.instruction.attrs.get("indices_are_sorted", "false").strip().lower() != "true" \
            and not _proved_sorted(graph, node.operands[1]):
        return None
    rows = whole_rows_scatter(graph, v)
    if rows is None or rows.kind not in _RUN_OPS:
        return None
    return RunScatter(rows.rows, rows.width, _RUN_OPS[rows.kind])


def _proved_sorted(graph: OpGraph, indices: int) -> bool:
    """Whether the index values follow from the module and never decrease (a constant
    array of variable-length segments): sorted without the flag."""
    values, known = known_index_values(graph, indices)
    if values.size < 2 or not bool(known.all()):
        return False
    flat = values.reshape(-1)
    return bool((flat[1:] >= flat[:-1]).all())


def holds_run_scatter(graph: OpGraph, members) -> bool:
    """Whether ``members`` hold a scatter generated in runs: stitch's kernel of them is not
    XLA's, whose atomics take every update one by one."""
    return any(graph.nodes[v].opcode == "scatter" and run_scatter(graph, v) is not None
               for v in members)


__all__ = ["RUN_ROWS", "RunScatter", "holds_run_scatter", "run_scatter"]
