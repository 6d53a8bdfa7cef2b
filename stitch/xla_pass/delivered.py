"""What the XLA pass delivers against what it planned: the final module priced the way the
planner prices XLA's.

The planner compares its stitched plan with XLA's kernels under the delta cost model
(``stitch.pricing.delta``); what a program gets is only what the pass puts into the module.
``price_delivery`` prices the module the pass returns kernel by kernel with the same model:

- each stitch custom call placed: its member set, priced as the planner priced it (the
  plan's own ``KernelCost`` where snapping kept the planned members, else the cost model's
  price of the snapped set), less the loop copies the planner predicted for it; a kernel
  the pass priced itself (``priced``: one it placed outside the plan — an LM head loss, an
  attention backward — or a planned chain it built writing fewer values than planned) at
  that price;
- each XLA kernel left in the module: the baseline's price of that XLA kernel;
- each ``copy`` the rewrite added (a loop body's carried values, an in-place operand): a copy
  kernel reading and writing its bytes (``stitch.pricing.delta.copy_kernel_cost``).

Every planned stitched kernel that did not reach the module is listed with the pass's reason
and the saving the plan expected from it (the XLA kernels it would replace less its own
price), and classed ``payback`` (left to XLA by design: its build would not repay),
``build`` (lowering or the GPU build failed) or ``placement`` (snapping, site finding or the
rewrite refused it). Times and bytes are per module execution (loop bodies weighted by their
trip counts), memory-intensive kernels only in the ``mem_`` figures, as in
``FusionPlan.summary()``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterable

log = logging.getLogger("stitch.delivered")

DROP_KINDS = ("payback", "build", "placement")


@dataclass
class Side:
    """One module's kernels, priced: launches and HBM bytes per module run, modeled µs."""
    kernels: int = 0
    mem_kernels: int = 0
    hbm_bytes: float = 0.0
    mem_hbm_bytes: float = 0.0
    modeled_us: float = 0.0
    mem_modeled_us: float = 0.0

    def add(self, cost: Any, memory: bool, weight: int) -> None:
        if cost.launches == 0:
            return
        self.kernels += 1
        self.hbm_bytes += cost.hbm_bytes * weight
        self.modeled_us += cost.total_s * 1e6 * weight
        if memory:
            self.mem_kernels += 1
            self.mem_hbm_bytes += cost.hbm_bytes * weight
            self.mem_modeled_us += cost.total_s * 1e6 * weight


@dataclass(frozen=True)
class Mover:
    """One kernel of the delivered module: HBM bytes and modeled µs per module run (trip
    counts applied); ``tops``: the top-level instructions it is or replaces (a stitched
    kernel's are its site's where the rewrite gave them)."""
    name: str
    tops: tuple[str, ...]
    hbm_bytes: float
    modeled_us: float
    memory: bool
    stitched: bool


@dataclass(frozen=True)
class Dropped:
    """A planned stitched kernel the final module does not hold."""
    name: str
    kind: str                   # one of DROP_KINDS
    reason: str
    planned_saving_us: float    # what the plan expected it to save per module run


@dataclass(frozen=True)
class LoopCopy:
    """A ``copy`` the rewrite added for a placed kernel (a loop body's carried value, an
    in-place operand), with its bytes per execution of its computation."""
    kernel: str
    graph_index: int
    nbytes: int


@dataclass
class Delivery:
    xla: Side
    planned: Side
    delivered: Side
    dropped: list[Dropped] = field(default_factory=list)
    copies: list[LoopCopy] = field(default_factory=list)
    copy_us: float = 0.0         # modeled µs of the copies, per module run (in delivered)
    movers: list[Mover] = field(default_factory=list)   # the delivered module's kernels

    def largest_movers(self, count: int = 10) -> list[Mover]:
        """The delivered module's kernels moving the most HBM bytes, largest first."""
        return sorted(self.movers, key=lambda m: -m.hbm_bytes)[:count]

    @property
    def share(self) -> float | None:
        """Share of the planned memory-intensive saving that reached the module (None when
        the plan saves nothing)."""
        planned = self.xla.mem_modeled_us - self.planned.mem_modeled_us
        if planned <= 1e-9:
            return None
        return (self.xla.mem_modeled_us - self.delivered.mem_modeled_us) / planned

    def lost_us(self, kind: str) -> float:
        return sum(d.planned_saving_us for d in self.dropped if d.kind == kind)

    def summary(self) -> dict:
        """Flat figures for PassReport.summary() / STITCH_STATS records."""
        share = self.share
        return {
            "xla_mem_us": round(self.xla.mem_modeled_us, 3),
            "planned_mem_us": round(self.planned.mem_modeled_us, 3),
            "delivered_mem_us": round(self.delivered.mem_modeled_us, 3),
            "xla_mem_bytes": int(self.xla.mem_hbm_bytes),
            "planned_mem_bytes": int(self.planned.mem_hbm_bytes),
            "delivered_mem_bytes": int(self.delivered.mem_hbm_bytes),
            # The whole module, GEMMs included (at the target's tensor-core rates).
            "xla_us": round(self.xla.modeled_us, 3),
            "delivered_us": round(self.delivered.modeled_us, 3),
            "xla_bytes": int(self.xla.hbm_bytes),
            "delivered_bytes": int(self.delivered.hbm_bytes),
            "xla_kernels": self.xla.kernels,
            "delivered_kernels": self.delivered.kernels,
            "delivered_share": None if share is None else round(share, 4),
            "dropped_kernels": len(self.dropped),
            **{f"dropped_{kind}_us": round(self.lost_us(kind), 3) for kind in DROP_KINDS},
            "copies": len(self.copies),
            "copy_bytes": sum(c.nbytes for c in self.copies),
        }

    def log_lines(self, module: str) -> list[str]:
        """The report at STITCH_LOG=info: totals, then each dropped kernel."""
        share = self.share
        lines = [f"{module}: memory-intensive {self.xla.mem_modeled_us:.1f} µs / "
                 f"{self.xla.mem_hbm_bytes / 1e3:.1f} KB as XLA made it, planned "
                 f"{self.planned.mem_modeled_us:.1f} µs / "
                 f"{self.planned.mem_hbm_bytes / 1e3:.1f} KB, delivered "
                 f"{self.delivered.mem_modeled_us:.1f} µs / "
                 f"{self.delivered.mem_hbm_bytes / 1e3:.1f} KB"
                 + ("" if share is None else f" ({share:.0%} of the planned saving)")
                 + (f"; {len(self.copies)} copies added "
                    f"({sum(c.nbytes for c in self.copies) / 1e3:.1f} KB, "
                    f"{self.copy_us:.1f} µs)" if self.copies else "")]
        for d in sorted(self.dropped, key=lambda d: -d.planned_saving_us):
            lines.append(f"{module}: kernel {d.name} dropped ({d.kind}, planned saving "
                         f"{d.planned_saving_us:.2f} µs): {d.reason}")
        return lines


@dataclass(frozen=True)
class XlaKernel:
    """One of XLA's kernels as XLA made it: the top-level instructions it is, its price."""
    tops: frozenset[str]
    cost: Any
    memory: bool


def _tops(graph: Any, members: Iterable[int]) -> frozenset[str]:
    """The top-level instructions ``members`` belong to (by name: the planned module and
    XLA's share them)."""
    out = set()
    for m in members:
        node = graph.nodes[m]
        out.add(node.xla_group if node.xla_group is not None else node.instruction.name)
    return frozenset(out)


def price_xla_kernels(module: Any, spec: Any) -> dict[str, list[XlaKernel]]:
    """XLA's kernels of ``module`` per computation, priced by the cost model the planner
    prices its baseline with (scatter atomics' contention included). The pass asks for
    them where it planned another module than XLA's (segments as rows in fusion bodies:
    stitch.xla_pass.segment_rows), so that the XLA side is XLA's own module."""
    from stitch.pricing.delta import CostModel
    from stitch.explorer.graph_plan import kernel_kind, memory_intensive
    from stitch.explorer.planner import baseline_groups
    from stitch.hlo.graph import build_op_graphs

    out: dict[str, list[XlaKernel]] = {}
    for graph in build_op_graphs(module):
        cost_model = CostModel(graph, spec, gemm_chains=False, xla_atomics=True)
        kernels = out.setdefault(graph.name, [])
        for group in baseline_groups(graph, "xla"):
            members = tuple(sorted(group))
            cost = cost_model.kernel(frozenset(members))
            kernels.append(XlaKernel(_tops(graph, members), cost,
                                     memory_intensive(kernel_kind(graph, members), cost)))
    return out


def price_delivery(fusion_plan: Any, spec: Any, placed: Iterable[tuple[int, str, frozenset]],
                   reasons: dict[str, tuple[str, str]],
                   copies: Iterable[LoopCopy] = (),
                   xla_kernels: dict[str, list[XlaKernel]] | None = None,
                   dead: Iterable[str] = (),
                   priced: dict[str, Any] | None = None) -> Delivery:
    """Price what the pass put in the module (module docstring).

    ``placed``: (graph index, kernel name, members[, the top-level instructions it
    replaced]) of each stitch call in the final module;
    ``reasons``: kernel name -> (drop kind, reason) for planned kernels left out;
    ``copies``: the copies the rewrite added; ``xla_kernels``: XLA's own kernels
    (``price_xla_kernels``) where the plan's baseline is of another module: they are the
    XLA side, and each one no placed kernel replaces is delivered at its price;
    ``dead``: XLA's instructions the rewrite dropped as unread once the placed kernels were
    in (hlo_rewrite's ``dead_kernels``): delivered at no price; ``priced``: kernel name ->
    the ``KernelCost`` the pass priced it at (module docstring)."""
    from stitch.pricing.delta import CostModel, copy_kernel_cost
    from stitch.explorer.graph_plan import kernel_kind, memory_intensive

    by_graph: dict[int, list[tuple[str, frozenset, frozenset[str]]]] = {}
    for gi, name, members, *tops in placed:
        by_graph.setdefault(gi, []).append((name, frozenset(members),
                                            frozenset(tops[0]) if tops else frozenset()))
    copies = list(copies)
    gone = frozenset(dead)
    priced = priced or {}
    xla, planned, delivered = Side(), Side(), Side()
    dropped: list[Dropped] = []
    movers: list[Mover] = []

    def deliver_kernel(name: str, tops: Iterable[str], cost: Any, memory: bool,
                       weight: int, stitched: bool) -> None:
        delivered.add(cost, memory, weight)
        if cost.launches:
            movers.append(Mover(name, tuple(sorted(tops)), cost.hbm_bytes * weight,
                                cost.total_s * 1e6 * weight, memory, stitched))
    for gi, gp in enumerate(fusion_plan.graphs):
        weight = gp.stitched.weight
        own = xla_kernels.get(gp.graph.name) if xla_kernels is not None else None
        if own is not None:
            for x in own:
                xla.add(x.cost, x.memory, weight)
        else:
            for k in gp.baseline.kernels:
                xla.add(k.cost, k.is_memory, weight)
        for k in gp.stitched.kernels:
            planned.add(k.cost, k.is_memory, weight)
        planned_by_name = {k.name: k for k in gp.stitched.kernels}
        cost_model: Any = None
        taken: set[int] = set()
        for name, members, site_tops in by_graph.get(gi, []):
            k = planned_by_name.get(name)
            if name in priced:
                # GEMM work inside: not memory-intensive, like the plan's chains.
                cost, memory = priced[name], k.is_memory if k is not None else False
            elif k is not None and frozenset(k.members) == members:
                # The plan's price less the loop copies it predicted: the copies the
                # rewrite actually added are priced below.
                cost, memory = k.cost.without_loop_copies(), k.is_memory
            else:
                if cost_model is None:
                    cost_model = CostModel(gp.graph, spec, gemm_chains=False)
                cost = cost_model.kernel(members)
                memory = memory_intensive(kernel_kind(gp.graph, tuple(sorted(members))),
                                          cost)
            deliver_kernel(name, site_tops or _tops(gp.graph, members), cost, memory,
                           weight, True)
            taken |= members
        if own is not None:
            replaced = _tops(gp.graph, taken).union(
                *(tops for _, _, tops in by_graph.get(gi, [])))
            for x in own:
                if not (replaced | gone) & x.tops:
                    deliver_kernel(min(x.tops), x.tops, x.cost, x.memory, weight, False)
        else:
            for k in gp.baseline.kernels:
                if not taken & set(k.members) and not (gone and
                                                       _tops(gp.graph, k.members) & gone):
                    tops = _tops(gp.graph, k.members)
                    deliver_kernel(min(tops) if tops else k.name, tops, k.cost, k.is_memory,
                                   weight, False)
        placed_names = {name for name, _, _ in by_graph.get(gi, [])}
        for k in gp.stitched.kernels:
            if k.name in placed_names or not _stitched(k):
                continue
            kind, reason = reasons.get(k.name, ("placement", "not placed (no reason given)"))
            replaced = sum(b.cost.total_s for b in gp.baseline.kernels
                           if set(b.members) & set(k.members))
            saving = (replaced - k.cost.total_s) * 1e6 * weight     # copies included
            dropped.append(Dropped(k.name, kind, reason, saving))
    copy_us = 0.0
    for c in copies:
        weight = fusion_plan.graphs[c.graph_index].stitched.weight
        cost = copy_kernel_cost(spec, c.nbytes)
        deliver_kernel(f"copy for {c.kernel}", (), cost, True, weight, False)
        copy_us += cost.total_s * 1e6 * weight
    return Delivery(xla, planned, delivered, dropped, copies, copy_us, movers)


def _stitched(k: Any) -> bool:
    """A planned kernel the pass would build: scheduled (a fused kernel stitch made) or a
    GEMM chain. Kernels that are one XLA kernel unchanged carry no schedule."""
    return k.schedule is not None or k.kind == "gemm_chain"


def drop_reasons(skipped: Iterable[tuple[str, str]], fallbacks: Iterable[tuple[str, str]],
                 unpaid: Iterable[Any]) -> dict[str, tuple[str, str]]:
    """kernel name -> (drop kind, reason) from a PassReport's lists (the first reason a
    kernel got wins: payback before build before placement)."""
    reasons: dict[str, tuple[str, str]] = {}
    paid_names = {u.name for u in unpaid}
    for name, reason in skipped:
        if name in paid_names:
            reasons.setdefault(name, ("payback", reason))
    for name, reason in fallbacks:
        reasons.setdefault(name, ("build", reason))
    for name, reason in skipped:
        reasons.setdefault(name, ("placement", reason))
    return reasons


def deliver(report: Any, fusion_plan: Any, spec: Any, placed: Iterable[Any],
            rewrite: Any, xla_kernels: dict[str, list[XlaKernel]] | None = None,
            priced: dict[str, Any] | None = None) -> Delivery:
    """The pass's Delivery for its module (``placed``: the PlacedKernels it tried to put
    in, ``rewrite``: hlo_rewrite's RewriteReport, ``xla_kernels`` and ``priced``: see
    ``price_delivery``), logged at info."""
    names = set(rewrite.placed)
    sites = [(p.site.graph_index, p.site.name, p.site.members, p.site.tops) for p in placed
             if p.site.name in names]
    delivery = price_delivery(
        fusion_plan, spec, sites, drop_reasons(report.skipped, report.fallbacks, report.unpaid),
        [LoopCopy(k, gi, n) for k, gi, n in rewrite.copies], xla_kernels,
        rewrite.dead_kernels, priced)
    for line in delivery.log_lines(report.module):
        log.info("%s", line)
    return delivery


def loses_with_copies(graph_plan: Any, members: frozenset, copy_bytes: int, spec: Any,
                      cost: Any) -> str | None:
    """Why a kernel placed in a loop body would lose once the copies it needs there
    (``hlo_rewrite.carried_copy_bytes``) are counted — slower than the XLA kernels it
    replaces, or moving more memory-intensive bytes than they do — else None. ``cost``: a
    CostModel of the graph (the price the plan and the delivered figures use)."""
    if copy_bytes <= 0:
        return None
    from stitch.pricing.delta import copy_kernel_cost
    own = cost.kernel(members)
    copies = copy_kernel_cost(spec, copy_bytes)
    replaced = [b for b in graph_plan.baseline.kernels if set(b.members) & members]
    xla_s = sum(b.cost.total_s for b in replaced)
    xla_bytes = sum(b.cost.hbm_bytes for b in replaced)
    with_s = own.total_s + copies.total_s
    with_bytes = own.hbm_bytes + copies.hbm_bytes
    if with_s >= xla_s or with_bytes > max(xla_bytes, own.hbm_bytes):
        return (f"loses with the copies its loop body needs ({copy_bytes / 1e3:.1f} KB): "
                f"{with_s * 1e6:.2f} µs / {with_bytes / 1e3:.1f} KB against XLA's "
                f"{xla_s * 1e6:.2f} µs / {xla_bytes / 1e3:.1f} KB")
    return None

