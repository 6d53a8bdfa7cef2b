"""What placing a kernel in a loop body costs beyond the kernel: the copies of the loop
state it writes.

XLA's copy insertion has run before stitch's pass sees the module, so inside a while body
(any computation but the entry) the root's operands live in the loop-state buffers, which a
stitch custom call also reads: each value a stitched kernel writes for the root goes through
a ``copy`` (``stitch.xla_pass.hlo_rewrite`` adds them; without them the kernel would write into
buffers it is still reading). ``carried_bytes`` is the one prediction of those copies: the
planner prices them into a loop-body kernel's cost (``stitch.pricing.delta``), the pass checks
a site against them and the rewrite's recorded copies agree with it (tests).
"""
from __future__ import annotations

import weakref

from .graph import OpGraph

_CARRIED: "weakref.WeakKeyDictionary[OpGraph, frozenset[int]]" = weakref.WeakKeyDictionary()


def carried_nodes(graph: OpGraph) -> frozenset[int]:
    """The nodes whose values are the root's (the loop state a body writes); empty for the
    entry computation, where outputs need no copy."""
    got = _CARRIED.get(graph)
    if got is None:
        got = frozenset() if graph.kind == "entry" else frozenset(graph.outputs)
        _CARRIED[graph] = got
    return got


def carried_copies(graph: OpGraph, members: frozenset[int] | set[int]) -> list[int]:
    """Bytes of each copy a kernel computing ``members`` adds in ``graph``'s computation:
    one per array of each distinct member that is a value of the root (none in the
    entry), in node order."""
    carried = carried_nodes(graph)
    if not carried:
        return []
    copies: list[int] = []
    for v in sorted(carried.intersection(members)):
        shape = graph.nodes[v].shape
        copies.extend(leaf.byte_size for leaf in shape.leaves()) if shape.is_tuple \
            else copies.append(shape.byte_size)
    return copies


def carried_bytes(graph: OpGraph, members: frozenset[int] | set[int]) -> int:
    """Total bytes of ``carried_copies``."""
    return sum(carried_copies(graph, members))
