"""Sorted fixed-length segments as rows inside the XLA pass.

XLA's optimized module keeps a segmented reduction as an atomic scatter inside an
``input_scatter_fusion`` (GPU) or ``wrapped_scatter`` (CPU), its ids computed by iota and
shifts in other fusions. ``segments.fused_segments_as_rows`` rewrites the bodies of those
fusions only (reshape + reduce for the scatters, broadcasts for the gathers, proved masks
as their chosen side): every top-level instruction keeps its name, operands and shape, and
every fusion returns what it returned. So the pass plans and lowers from the rewritten
module while placement replaces XLA's own instructions by name: a fusion a stitched kernel
replaces is computed without atomics, one left to XLA stays exactly as XLA made it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from stitch.hlo import HloModule
from stitch.hlo.segments_as_rows import fused_segments_as_rows

from stitch.config import segment_rows_setting

log = logging.getLogger("stitch.xla_pass.segments")


@dataclass
class SegmentRows:
    """The module the pass plans from and what it computes as rows."""
    planned: HloModule                                   # ``module`` itself when unchanged
    reductions: list[str] = field(default_factory=list)  # scatters planned as reduces
    broadcasts: list[str] = field(default_factory=list)  # gathers planned as broadcasts
    # Top-level fusions whose bodies the planned module computes otherwise: a kernel of one
    # of them alone is not "the same as XLA's" (the pass schedules and places it).
    fusions: frozenset[str] = frozenset()

    @property
    def changed(self) -> bool:
        return bool(self.reductions or self.broadcasts)


def segment_rows(module: HloModule) -> SegmentRows:
    """The module to plan from for XLA's ``module`` (STITCH_SEGMENT_ROWS; a bad value is the
    pass's ConfigError, as the other settings' are)."""
    if not segment_rows_setting():
        return SegmentRows(module)
    rewrite = fused_segments_as_rows(module)
    if not rewrite.changed:
        return SegmentRows(module)
    log.info("%s: %d segment scatters planned as row reductions, %d gathers as broadcasts",
             module.name, len(rewrite.reductions), len(rewrite.broadcasts))
    before = {c.name: c for c in module.computations}
    changed = {c.name for c in rewrite.module.computations if before.get(c.name) is not c}
    fusions = frozenset(i.name for c in module.computations for i in c.instructions
                        if i.opcode == "fusion" and i.called_computations and
                        i.called_computations[0].lstrip("%") in changed)
    return SegmentRows(rewrite.module, list(rewrite.reductions), list(rewrite.broadcasts),
                       fusions)


__all__ = ["SegmentRows", "segment_rows"]
