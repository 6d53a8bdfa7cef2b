"""Execution of a module's op graphs (``graph.build_op_graphs``), node by node or by units.

The op graph is what the planner partitions, so it is also what an executable of a plan
runs: every node in topological order, except that a *unit* (a set of nodes computed
together, e.g. one stitched kernel) runs as one call from its input values to its output
values. Loops and conditionals run their body/condition/branch graphs recursively.

The arithmetic of single nodes is a backend's (``NumpyBackend`` runs the reference
evaluator's handlers; a framework backend can emit framework ops instead): the walker only
moves values, regroups operand leaves into the instruction's operand structure (tuple
values stay Python tuples) and orders the units.
"""
from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .errors import HloEvaluationError
from .graph import OpGraph, OpNode
from .ir import HloModule, Shape

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Unit:
    """Nodes computed by one call: ``run(input values) -> output values`` (both in the
    order of ``inputs`` / ``outputs``, node ids of the unit's graph)."""
    members: frozenset[int]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    run: Callable[[list[object]], list[object]]
    name: str = ""


class Backend(Protocol):
    def apply(self, node: OpNode, operands: list[object]) -> object: ...

    def constant(self, node: OpNode) -> object: ...

    def while_loop(self, cond: Callable[[list[object]], object],
                   body: Callable[[list[object]], list[object]], init: list[object]
                   ) -> list[object]: ...

    def switch(self, selector: object, branches: list[Callable[[], list[object]]]
               ) -> list[object]: ...


class NumpyBackend:
    """The reference evaluator's semantics, one instruction at a time."""

    def __init__(self, module: HloModule, evaluator=None):
        from .evaluator.interpreter import Evaluator  # numpy-heavy; imported on first use
        self.evaluator = evaluator if evaluator is not None else Evaluator(module)

    def apply(self, node: OpNode, operands: list[object]) -> object:
        return self.evaluator.apply_instruction(node.computation, node.instruction, operands)

    def constant(self, node: OpNode) -> object:
        return self.evaluator._constant(node.instruction)

    def while_loop(self, cond, body, init):
        state = init
        while bool(np.asarray(cond(state)).reshape(())):
            state = body(state)
        return state

    def switch(self, selector, branches):
        value = np.asarray(selector).reshape(())
        index = (0 if bool(value) else 1) if value.dtype == np.bool_ else int(value)
        if index < 0 or index >= len(branches):
            index = len(branches) - 1      # XLA runs the last branch for out-of-range indices
        return branches[index]()


def flatten_value(value: object) -> list[object]:
    """Array leaves of a (nested) tuple value, depth-first."""
    if isinstance(value, tuple):
        return [leaf for v in value for leaf in flatten_value(v)]
    return [value]


def unflatten_value(shape: Shape, leaves: Sequence[object]) -> object:
    """The inverse of ``flatten_value`` for a value of ``shape``."""
    it = iter(leaves)

    def build(s: Shape) -> object:
        return tuple(build(t) for t in s.tuple_shapes) if s.is_tuple else next(it)
    value = build(shape)
    if next(it, None) is not None:
        raise HloEvaluationError(f"too many leaves for shape {shape}")
    return value


def _same_structure(a: Shape, b: Shape) -> bool:
    if a.is_tuple != b.is_tuple:
        return False
    if not a.is_tuple:
        return True
    return len(a.tuple_shapes) == len(b.tuple_shapes) and all(
        _same_structure(x, y) for x, y in zip(a.tuple_shapes, b.tuple_shapes))


def parameter_leaves(graph: OpGraph) -> list[int]:
    """The graph's SOURCE nodes of parameter leaves in parameter order, each parameter's
    leaves depth-first (``graph.inputs`` is in order of first use)."""
    def key(v: int) -> tuple:
        node = graph.nodes[v]
        return (node.instruction.parameter_number or 0, node.index)
    return sorted(graph.inputs, key=key)


class GraphRunner:
    """Runs the graphs of one module (``graphs[0]`` is ENTRY) with ``backend``; ``units``
    maps a graph index to the units computed by one call each."""

    def __init__(self, module: HloModule, graphs: list[OpGraph], backend: Backend | None = None,
                 units: dict[int, list[Unit]] | None = None):
        self.module = module
        self.graphs = graphs
        self.backend = backend if backend is not None else NumpyBackend(module)
        self.units = units or {}
        self._tables: dict[str, dict[str, object]] = {}
        self._schedules: dict[int, list[Unit | int]] = {}

    # --- public -------------------------------------------------------------------------
    def run(self, args: Sequence[object]) -> list[object]:
        """ENTRY on ``args`` (one value per parameter); the root's leaves depth-first."""
        return self.run_graph(0, [leaf for a in args for leaf in flatten_value(a)])

    def run_graph(self, index: int, inputs: list[object]) -> list[object]:
        graph = self.graphs[index]
        if len(inputs) != len(graph.inputs):
            raise HloEvaluationError(f"graph {graph.name!r} takes {len(graph.inputs)} leaves, "
                                     f"got {len(inputs)}")
        values: dict[int, object] = dict(zip(parameter_leaves(graph), inputs))
        for step in self._schedule(index):
            if isinstance(step, Unit):
                outs = step.run([values[v] for v in step.inputs])
                if len(outs) != len(step.outputs):
                    raise HloEvaluationError(f"unit {step.name!r} returned {len(outs)} values "
                                             f"for {len(step.outputs)} outputs")
                values.update(zip(step.outputs, outs))
            elif step not in values:
                values[step] = self._node(graph, graph.nodes[step], values)
        return [leaf for v in graph.outputs for leaf in flatten_value(values[v])]

    # --- ordering -----------------------------------------------------------------------
    def _schedule(self, index: int) -> list[Unit | int]:
        """Units and single nodes in a topological order of the unit graph, restricted to
        what the outputs need (dead code is skipped, as the evaluator does)."""
        if index in self._schedules:
            return self._schedules[index]
        graph = self.graphs[index]
        units = self.units.get(index, [])
        owner: dict[int, int] = {}
        for i, u in enumerate(units):
            for v in u.members:
                owner.setdefault(v, i)
        # A value several units compute (recomputation) is read from the first unit (in
        # launch order) writing it: keying it by a later one can make the unit graph cyclic.
        writer: dict[int, int] = {}
        for i, u in enumerate(units):
            for v in u.outputs:
                writer.setdefault(v, i)
        owner.update(writer)
        key = lambda v: ("u", owner[v]) if v in owner else ("n", v)  # noqa: E731

        def deps(k) -> list[int]:
            if k[0] == "u":
                return list(units[k[1]].inputs)
            return graph.nodes[k[1]].operands
        inputs = set(graph.inputs)
        needed: set = set()
        stack = [key(v) for v in graph.outputs]
        while stack:
            k = stack.pop()
            if k in needed:
                continue
            needed.add(k)
            stack.extend(key(o) for o in deps(k) if o not in inputs or o in owner)
        indegree = {k: 0 for k in needed}
        users: dict = {k: [] for k in needed}
        for k in needed:
            for d in {key(o) for o in deps(k)} - {k}:
                if d in needed:
                    indegree[k] += 1
                    users[d].append(k)
        first = lambda k: min(units[k[1]].members) if k[0] == "u" else k[1]  # noqa: E731
        ready = [(first(k), k) for k, n in indegree.items() if n == 0]
        heapq.heapify(ready)
        order: list[Unit | int] = []
        while ready:
            _, k = heapq.heappop(ready)
            order.append(units[k[1]] if k[0] == "u" else k[1])
            for u in users[k]:
                indegree[u] -= 1
                if indegree[u] == 0:
                    heapq.heappush(ready, (first(u), u))
        if len(order) != len(needed):
            raise HloEvaluationError(f"graph {graph.name!r}: the units form a cycle")
        self._schedules[index] = order
        return order

    # --- single nodes -------------------------------------------------------------------
    def _operand_shapes(self, node: OpNode) -> list[Shape]:
        table = self._tables.get(node.computation)
        if table is None:
            comp = next(c for c in self.module.computations if c.name == node.computation)
            table = self._tables[node.computation] = comp.by_name()
        return [table[name].shape for name in node.instruction.operands]

    def _operands(self, graph: OpGraph, node: OpNode, values: dict[int, object]) -> list[object]:
        """The instruction's operand values rebuilt from the node's operand leaves: a tuple
        operand is either one tuple-valued node or a tuple of its elements' values."""
        leaves = iter(node.operands)
        out = []
        for shape in self._operand_shapes(node):
            if shape.is_tuple:
                out.append(self._take_tuple(graph, shape, leaves, values))
            else:
                out.append(values[next(leaves)])
        return out

    def _take_tuple(self, graph: OpGraph, shape: Shape, leaves, values: dict[int, object],
                    first: int | None = None) -> object:
        if not shape.tuple_shapes:
            return ()
        v = next(leaves) if first is None else first
        if _same_structure(graph.nodes[v].shape, shape):
            return values[v]
        elems = []
        pending: int | None = v      # the leaf already taken, for the first element with one
        for s in shape.tuple_shapes:
            if s.is_tuple and _leafless(s):
                elems.append(_empty_value(s))  # an empty tuple has no leaf to take
                continue
            w = pending if pending is not None else next(leaves)
            pending = None
            if s.is_tuple:
                elems.append(self._take_tuple(graph, s, leaves, values, w))
            else:
                elems.append(values[w])
        return tuple(elems)

    def _node(self, graph: OpGraph, node: OpNode, values: dict[int, object]) -> object:
        if node.opcode == "constant":
            return self.backend.constant(node)
        operands = self._operands(graph, node, values)
        if node.opcode == "while":
            body, cond = node.subgraphs
            out = self.backend.while_loop(
                lambda state: self.run_graph(cond, state)[0],
                lambda state: self.run_graph(body, state),
                flatten_value(operands[0]))
            return unflatten_value(node.shape, out)
        if node.opcode == "conditional":
            branches = [lambda i=i, g=g: self.run_graph(g, flatten_value(operands[1 + i]))
                        for i, g in enumerate(node.subgraphs)]
            return unflatten_value(node.shape, self.backend.switch(operands[0], branches))
        return self.backend.apply(node, operands)


def _leafless(shape: Shape) -> bool:
    """A tuple with no leaf at all (``()``, ``((), ())``)."""
    return all(s.is_tuple and _leafless(s) for s in shape.tuple_shapes)


def _empty_value(shape: Shape) -> tuple:
    return tuple(_empty_value(s) for s in shape.tuple_shapes)


def run_graphs(module: HloModule, graphs: list[OpGraph], args: Sequence[object],
               backend: Backend | None = None, units: dict[int, list[Unit]] | None = None
               ) -> list[object]:
    """Run ENTRY of ``module`` through its op graphs; see ``GraphRunner``."""
    return GraphRunner(module, graphs, backend, units).run(args)
