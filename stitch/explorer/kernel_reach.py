"""Fast proofs that a set of kernels stays acyclic, from the graph's reachability bitmasks.

A new kernel P closes a cycle with the kernels K already chosen when a path leaves P and
comes back, where reaching any member of a kernel reaches all of its users. Searching that
path op by op covers everything P reaches up to the furthest op a held kernel holds; with
patterns that span a training step's forward and backward, most of the graph, per question.

The same closure over bitmasks: start from what P's outside users reach, add the closure of
each kernel the set touches, until nothing changes. ``OpGraph.reachability`` gives the masks
per op (exact); above its size limit ``OpGraph.unit_reachability`` gives them per unit (an
XLA fusion, or an op alone), where a path between ops is one between their units, so the
closure holds at least every unit the exact search reaches. When P's units stay outside it,
no cycle; otherwise the caller searches exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from stitch.hlo.graph import OpGraph


@dataclass(frozen=True)
class KernelMasks:
    """Per kernel (a member set): its last op, the units it holds, and what they reach
    (themselves included)."""
    last: int
    units: int
    closure: int


class KernelReach:
    """Unit-level reachability of one graph, and per-kernel masks cached by member set."""

    def __init__(self, unit_of: list[int], desc: list[int], users: list[list[int]]):
        self.unit_of = unit_of
        self.desc = desc
        self.users = users
        self.cache: dict[frozenset[int], tuple[KernelMasks, int]] = {}

    @staticmethod
    def of(graph: OpGraph) -> "KernelReach | None":
        """None when the graph keeps no reachability masks (too many units)."""
        users = [n.users for n in graph.nodes]
        masks = graph.reachability()
        if masks is not None:
            return KernelReach(list(range(len(graph.nodes))), masks[0], users)
        units = graph.unit_reachability()
        if units is None:
            return None
        return KernelReach(units.unit_of, units.desc, users)

    def masks(self, members: frozenset[int]) -> tuple[KernelMasks, int]:
        """(the kernel's masks, what its outside users reach, themselves included)."""
        got = self.cache.get(members)
        if got is None:
            unit_of, desc = self.unit_of, self.desc
            units = closure = out = 0
            for m in members:
                u = unit_of[m]
                units |= 1 << u
                closure |= desc[u]
                for x in self.users[m]:
                    if x not in members:
                        ux = unit_of[x]
                        out |= desc[ux] | (1 << ux)
            got = self.cache[members] = (KernelMasks(max(members), units, closure | units), out)
        return got

    def surely_acyclic(self, held: Iterable[KernelMasks], members: frozenset[int],
                       held_units: int | None = None) -> bool:
        """True when adding kernel ``members`` to the ``held`` kernels (acyclic together,
        disjoint from it) surely closes no cycle; False: undecided. ``held_units``: the
        union of the held kernels' ``units`` where the caller keeps it; when the new
        kernel's outside users reach none of them nor the kernel, the closure below would
        enter no kernel (the usual answer, and a scan of every held kernel per question)."""
        mine, reached = self.masks(members)
        if held_units is not None and not reached & (held_units | mine.units):
            return True
        pending = list(held)
        changed = True
        while changed:
            if reached & mine.units:
                return False
            changed = False
            rest = []
            for k in pending:
                if not reached & k.units:
                    rest.append(k)
                elif k.closure & ~reached:
                    # Entered: every unit of the kernel is reached, and what they reach.
                    reached |= k.closure
                    changed = True
            pending = rest
        return True
