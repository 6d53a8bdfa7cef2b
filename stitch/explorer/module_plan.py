"""A module's fusion plan as the planner returns it (``FusionPlan``): per graph, the baseline
and stitched kernel plans and the planner's report."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from stitch.hlo.graph import OpGraph

from .graph_plan import GraphPlan, PlannedKernel, PlannerReport, SideSummary, kernel_kind, needs_kernel


@dataclass
class GraphResult:
    graph: OpGraph
    baseline: GraphPlan
    stitched: GraphPlan
    report: PlannerReport
    reasons: dict[tuple[int, int], str] = field(default_factory=dict)


@dataclass
class FusionPlan:
    module_name: str
    target: str
    planner: str
    baseline_source: str            # "xla" | "base-fusion"
    graphs: list[GraphResult]
    seconds: float = 0.0
    # Its plan cache key (None: planned uncached) and whether the cache handed it back.
    cache_key: str | None = field(default=None, compare=False, repr=False)
    from_cache: bool = field(default=False, compare=False, repr=False)
    # Planned beside chain spill checks it did not wait for (``ExplorerOptions.
    # defer_spill_checks``): waits for them, True where every guess held.
    pending_checks: Callable[[], bool] | None = field(default=None, compare=False, repr=False)

    def checks_held(self) -> bool:
        """Whether the plan is the one the chain spill checks' prices make (waiting for
        checks still running; the plan cache keeps the plan once they held). False: plan
        the module again (the checked prices are known by now)."""
        if self.pending_checks is not None:
            held = self.pending_checks()
            self.pending_checks = None if held else (lambda: False)
            return held
        return True

    @property
    def kernels(self) -> list[PlannedKernel]:
        """The stitched plan's kernels, graph by graph, each graph in launch order."""
        return [k for g in self.graphs for k in g.stitched.kernels]

    def summary(self) -> dict:
        base, stitched = SideSummary(), SideSummary()
        for g in self.graphs:
            base.add(g.baseline)
            stitched.add(g.stitched)
        return {"baseline": base.as_dict(), "stitched": stitched.as_dict(),
                "baseline_source": self.baseline_source, "target": self.target,
                "planner": self.planner, "plan_seconds": round(self.seconds, 3)}

    def reasons(self, source: Callable[[OpGraph, int], str] | None = None) -> list[str]:
        """Why producers were not fused with their consumers in the stitched plan;
        ``source(graph, node)``: the producer's place in the user's code, added where known."""
        lines = []
        for g in self.graphs:
            graph = g.graph
            where: dict[int, int] = {}
            for ki, k in enumerate(g.stitched.kernels):
                for v in k.members:
                    where.setdefault(v, ki)
            for node in graph.nodes:
                if not needs_kernel(graph, node.id) or kernel_kind(graph, (node.id,)) != "fused":
                    continue
                for u in node.users:
                    if u not in where or where.get(u) == where.get(node.id):
                        continue
                    reason = g.reasons.get((node.id, u), "another pattern scored higher "
                                           "in beam search")
                    at = source(graph, node.id) if source is not None else ""
                    lines.append(f"{graph.name}: {node.name} -> {graph.nodes[u].name}: {reason}"
                                 + (f" [at {at}]" if at else ""))
        return lines
