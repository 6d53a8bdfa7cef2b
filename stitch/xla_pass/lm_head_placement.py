"""LM head + softmax cross-entropy sites placed by the XLA pass: the logits GEMM, XLA's
softmax fusion and its gather/reduce fusion replaced by one kernel that never writes the
logits (``stitch.codegen.lm_head_loss``).

A site is placed where ``stitch.hlo.lm_head_loss.find_lm_head_losses`` finds it
closed (no value but its results read outside: an eval loss; a training step's backward
reads the softmax's sums and exps, so its site stays XLA's), its XLA instructions are whole
(``hlo_rewrite.find_site`` on every op of the instructions it touches), and the GEMM-tile
model prices the fused kernel faster than XLA's GEMM plus a read of the logits
(``cost.lm_head_pricing``; on the GPU the schedule's kernel assembled by ptxas, spilling
ones struck). Instructions it takes are taken from the plan's stitched kernels.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from stitch.hlo.lm_head_loss import find_lm_head_losses

from .hlo_rewrite import ComputationView, NotPlaceable, find_site

log = logging.getLogger(__name__)

# The pass places LM head sites (off: they stay with XLA and the plan's kernels).
LM_HEAD_SITES = True


@dataclass(frozen=True)
class LossKernel:
    """A placed site's name, as the pass's jobs name their kernels, and its modeled
    ``KernelCost`` at the schedule it is built with (the delivered price)."""
    name: str
    cost: Any = None


def lm_head_jobs(request: Any, report: Any, view: ComputationView, graph_index: int,
                 graph: Any, spec: Any, grid_sync: bool) -> tuple[list, set[str]]:
    """(jobs, XLA instructions taken): one (view, kernel, site, lowered) job per placeable
    site of ``graph``; the reasons of the others in ``report.skipped``."""
    from stitch.codegen.errors import CodegenError
    from stitch.codegen.lm_head_loss import lower_lm_head_loss, tiling_from_schedule
    from stitch.codegen.lower import kernel_identifier
    from stitch.pricing.delta import tile_kernel_cost
    from stitch.pricing.lm_head_pricing import loss_price

    jobs: list = []
    taken: set[str] = set()
    if not LM_HEAD_SITES or request.device != "gpu":
        return jobs, taken          # the recognized forms are XLA GPU's
    arch = request.gpu_arch()
    for i, found in enumerate(find_lm_head_losses(graph)):
        name = f"lm_head_loss_{graph_index}_{i}"
        loss = found.loss
        if found.escapes:
            names = ", ".join(graph.nodes[v].name for v in found.escapes[:4])
            report.skipped.append((name, f"values beyond its rows are read outside ({names}"
                                         f"{', ...' if len(found.escapes) > 4 else ''}): "
                                         "left to XLA"))
            continue
        try:
            tops = {view.top_of(m) for m in found.members
                    if graph.nodes[m].op_class.value != "source"}
            if None in tops:
                raise NotPlaceable("an op inlined from a called computation")
            members = frozenset(m for t in tops for m in view.group_ops.get(t, ()))
            site = find_site(view, graph_index, name, members)
            if taken & set(site.tops):
                raise NotPlaceable("shares XLA instructions with another LM head site")
        except NotPlaceable as exc:
            report.skipped.append((name, str(exc)))
            continue
        try:
            price = loss_price(spec, loss, grid_sync=grid_sync,
                               spills=spill_check(loss, arch))
        except ValueError as exc:
            report.skipped.append((name, f"no schedule: {exc}"))
            continue
        if not price.wins:
            report.skipped.append((name, f"modeled {price.stitched.seconds * 1e6:.1f} µs "
                                         f"against XLA's {price.xla_s * 1e6:.1f} µs: left "
                                         "to XLA"))
            continue
        try:
            lowered = lower_lm_head_loss(loss, tiling_from_schedule(price.schedule),
                                         kernel_identifier(name), arch)
        except CodegenError as exc:
            report.fallbacks.append((name, f"{type(exc).__name__}: {exc}"))
            continue
        log.info("%s: LM head loss %dx%dx%d in one kernel (%s), modeled %.1f µs vs XLA "
                 "%.1f µs", name, loss.rows, loss.vocab, loss.hidden, price.schedule.text(),
                 price.stitched.seconds * 1e6, price.xla_s * 1e6)
        taken |= set(site.tops)
        jobs.append((view, LossKernel(name, tile_kernel_cost(
            spec, price.stitched, int(price.stitched.hbm_bytes))), site, lowered))
    return jobs, taken


def spill_check(loss: Any, arch: str):
    """Whether ptxas spills the loss kernel a schedule builds (None where ptxas is not
    installed: the schedule is taken unchecked)."""
    from stitch.codegen.lm_head_loss import lower_lm_head_loss, tiling_from_schedule
    from stitch.codegen.nvptx import emit_ptx
    from stitch.codegen.toolchain import ToolchainError, assemble, find_ptxas
    try:
        find_ptxas(arch)
    except (ToolchainError, OSError):
        return None

    def spills(schedule: Any) -> bool:
        kernel = lower_lm_head_loss(loss, tiling_from_schedule(schedule), "lmh", arch).kernel
        report = assemble(emit_ptx(kernel, arch), arch, kernel_name="lmh")["lmh"]
        return report.spill_store_bytes + report.spill_load_bytes > 0
    return spills
