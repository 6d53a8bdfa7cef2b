"""Whether codegen can build a node inside a stitched kernel, by the rules codegen itself
applies, read from the HLO layer (``stitch.hlo.element_types``, ``stitch.hlo.combiners``):
the planner's feasibility asks ``build_problem`` for every member of a pattern, so it never
offers a kernel codegen refuses for its types or its reductions — one rule, not a second
list that can drift.
"""
from __future__ import annotations

import weakref

from stitch.hlo import combiners, element_types
from stitch.hlo.graph import OpGraph, OpNode
from stitch.hlo.ir import Computation
from stitch.hlo.grouped_scatter import grouped_scatter
from stitch.hlo.scatter_forms import scatter_form
from stitch.hlo.sorted_runs import run_scatter

# Per graph: node id -> why codegen cannot build it (a pure function of the node).
_BUILD_PROBLEMS: "weakref.WeakKeyDictionary[OpGraph, dict[int, str | None]]" = \
    weakref.WeakKeyDictionary()


def build_problem(graph: OpGraph, v: int) -> str | None:
    """Why a kernel holding node ``v`` cannot be built (None when it can): its result or
    an operand of a type codegen has no kernel IR dtype for, or a bit reinterpretation
    codegen refuses; a reduce or reduce-window that is variadic or whose combiner is not a
    single add/multiply/max/min/and/or; a scatter whose combiner codegen does not generate
    for its form (colliding updates: only an atomic add). Operands are checked whether or
    not they are members: a member's own result is checked as a member, an outside one is
    loaded."""
    memo = _BUILD_PROBLEMS.get(graph)
    if memo is None:
        memo = _BUILD_PROBLEMS[graph] = {}
    if v not in memo:
        node = graph.nodes[v]
        problem = _problem(graph, node)
        memo[v] = None if problem is None else f"{node.name} ({node.opcode}): {problem}"
    return memo[v]


def _problem(graph: OpGraph, node: OpNode) -> str | None:
    problem = element_types.shape_problem(node.shape)
    for o in node.operands:
        if problem:
            return problem
        problem = element_types.shape_problem(graph.nodes[o].shape)
    if problem:
        return problem
    if node.operands:
        src = graph.nodes[node.operands[0]].shape
        if element_types.changes_element_type(node.opcode, src, node.shape):
            return element_types.reinterpret_problem(src.element_type,
                                                     node.shape.element_type)
    if node.opcode in ("reduce", "reduce-window"):
        return combiners.reduction_problem(len(node.operands), _combiner_kind(graph, node))
    if node.opcode == "scatter":
        form = scatter_form(graph, node.id)
        if form.kind in ("row", "atomic"):     # the other forms: feasibility's own reason
            shape = node.shape if not node.shape.is_tuple else next(node.shape.leaves())
            # In column tiles (groups of distinct ids) updates meet only in order.
            colliding = form.kind == "atomic" and grouped_scatter(graph, node.id) is None
            return combiners.scatter_problem(_combiner_kind(graph, node), colliding,
                                             shape.element_type,
                                             run_scatter(graph, node.id) is not None)
    return None


def _combiner_kind(graph: OpGraph, node: OpNode) -> str | None:
    comp: Computation | None = graph.computations.get(
        node.instruction.attrs.get("to_apply", "").lstrip("%"))
    return combiners.combiner_kind(comp) if comp is not None else None
