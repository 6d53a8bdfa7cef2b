"""The Kernel IR kernel: parameters, shared and scratch buffers, launch shape and body."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .check import KernelChecker
from .nodes import (AtomicAdd, Buffer, GlobalScratch, GridBarrier, Param, Shared,
                    Stmt, as_tuple, grid_phases, is_identifier, walk_stmts)


@dataclass(frozen=True)
class Kernel:
    name: str
    params: tuple[Param, ...]
    shared: tuple[Shared, ...]
    grid: int
    block: int
    body: tuple[Stmt, ...]
    scratch: tuple[GlobalScratch, ...] = ()
    # How a GPU meets the grid barriers (`GRID_SYNC_MODES`); the host ignores it.
    grid_sync: str = "barrier"
    # Registers per thread ptxas may use (PTX .maxnreg); None leaves the choice to ptxas.
    register_budget: int | None = None

    def __post_init__(self) -> None:
        for attr in ("params", "shared", "body", "scratch"):
            object.__setattr__(self, attr, as_tuple(getattr(self, attr)))

    @property
    def buffers(self) -> dict[str, Buffer]:
        return {b.name: b for b in (*self.params, *self.shared, *self.scratch)}

    def validate(self) -> "Kernel":
        """Raise CodegenError (naming the kernel and the statement) if the kernel is malformed.
        A kernel is immutable: once it passed, later calls (lowering, each build) are free."""
        if not self.__dict__.get("_valid", False):
            KernelChecker(self).run()
            object.__setattr__(self, "_valid", True)
        return self

    def known_valid(self) -> "Kernel":
        """This kernel marked as passing ``validate()`` without walking it again. Only for a
        kernel whose validity the caller knows: a copy of a checked kernel changed in ways
        the check gives the same answer for at every site (``lowering_reuse``: one lowering
        bound to a repeated layer's sites), or one read back from the authenticated compile
        cache with the record that it passed the same code's check."""
        object.__setattr__(self, "_valid", True)
        return self

    def renamed(self, name: str) -> "Kernel":
        """This kernel called ``name``. Validity does not depend on the name once it is an
        identifier, so a validated kernel's copy is not checked again."""
        copy = dataclasses.replace(self, name=name)
        if self.__dict__.get("_valid", False) and is_identifier(name):
            object.__setattr__(copy, "_valid", True)
        return copy



def has_atomics(kernel: "Kernel") -> bool:
    """True if the kernel adds atomically into an output (an in-place scatter: its output
    buffer may be one of its inputs' buffers, ``LoweredKernel.initial``)."""
    return any(isinstance(s, AtomicAdd) for s in walk_stmts(kernel.body))


def has_grid_barrier(kernel: "Kernel") -> bool:
    """True if the kernel synchronises its grid (its blocks must all be resident)."""
    return any(isinstance(s, GridBarrier) for s in kernel.body)


def launches(kernel: "Kernel") -> int:
    """Launches a GPU makes of the kernel per call (a phase each in "relaunch" mode)."""
    if kernel.grid_sync == "relaunch" and has_grid_barrier(kernel):
        return len(grid_phases(kernel.body))
    return 1
