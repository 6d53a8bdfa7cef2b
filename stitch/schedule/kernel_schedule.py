"""The schedule of one stitched kernel: what codegen lowers (FusionStitching §4.1-4.5).

A kernel is made of independent *parts* (kernel packing: each part owns a range of the
grid's blocks). A part is either a plain loop (one thread per ``vector_width`` elements of
its roots) or a *row part*: its reductions share one row partition (``rows`` rows of
``row_length`` elements; ``minor`` when a row is contiguous in memory, else the rows are
columns). Each row is owned by a *unit* - a warp or a block - that reduces it and shares the
result with every consumer element of the row (the locality check proves they are all in
the unit). Inside a part, ops form *groups* rooted at sub-roots (reductions, and expensive
ops computed once per row) and at the part's roots; each group has a scheme:

- ``thread``: every thread computes what it needs itself (recomputation, XLA's way);
- ``warp``: a warp reduces the row, the result is shared through register shuffles;
- ``block``: the block reduces the row, the result is shared through shared memory;
- ``global``: the grid reduces it (a part of kind "global": a persistent kernel whose
  phases are separated by grid barriers, partials in global scratch; see
  ``global_scope.py``, whose ``GlobalScope`` the part carries).

``KernelSchedule.schemes`` lists them, with ``packing`` first when the kernel has more than
one part.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..cost.occupancy import Occupancy

SCHEMES = ("packing", "thread", "warp", "block", "global")


@dataclass(frozen=True)
class GroupSchedule:
    root: int                       # sub-root or root op id
    members: tuple[int, ...]        # ops computed with the root's index
    scheme: str                     # "thread" | "warp" | "block"
    sub_root: bool                  # a reduction or an expensive op computed once per row


@dataclass(frozen=True)
class SharedBuffer:
    node: int                       # the op whose per-row values (or partials) it holds
    bytes: int
    offset: int                     # byte offset in the block's shared memory
    purpose: str                    # "partials" | "result"


@dataclass
class PartSchedule:
    members: tuple[int, ...]
    kind: str                       # "loop" | "row" | "global"
    unit: str                       # "thread" | "warp" | "block": who owns a row (or element)
    rows: int                       # rows (row parts) or elements (loop parts)
    row_length: int                 # reduced elements per row (1 for loops)
    minor: bool                     # rows contiguous (else column rows)
    threads_per_block: int
    rows_per_block: int
    vector_width: int
    blocks: int
    groups: list[GroupSchedule] = field(default_factory=list)
    shared_buffers: list[SharedBuffer] = field(default_factory=list)
    cached: tuple[int, ...] = ()    # full-size sub-roots kept in registers across passes
    block_offset: int = 0           # first block of this part in the kernel's grid
    registers: int = 0
    modeled_cycles: float = 0.0
    scope: object | None = None     # kind "global": its global_scope.GlobalScope

    @property
    def smem_bytes(self) -> int:
        return max((b.offset + b.bytes for b in self.shared_buffers), default=0)


@dataclass
class KernelSchedule:
    members: tuple[int, ...]
    parts: list[PartSchedule]
    grid: int                       # blocks (1-D grid; parts own consecutive ranges)
    block: int                      # threads per block
    smem_bytes: int
    regs_estimate: int
    occupancy: Occupancy
    modeled_us: float
    bound: str = ""                 # "throughput" | "latency" | "global" (phases)
    rejected: list[str] = field(default_factory=list)   # discarded combinations, why

    @property
    def schemes(self) -> list[str]:
        out = ["packing"] if len(self.parts) > 1 else []
        for part in self.parts:
            out.extend(g.scheme for g in part.groups)
        return out
