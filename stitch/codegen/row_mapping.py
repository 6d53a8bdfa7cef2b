"""How a row-reducing kernel maps rows onto a value's elements (``RowSplit``) and onto the
threads of a block (``RowUnit``); shared by the block-scope lowering (``lower``) and the
global-scope one (``lower_global``)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stitch.hlo.graph import OpNode

from . import compact_rows, kir
from .values import ValueEmitter, delinearize, iadd, imul

_c = kir.i32


@dataclass(frozen=True)
class RowSplit:
    """Where the ``j``-th element of row ``row`` of a value lies: "rows" (row after row,
    linear e = row * per_row + j), "columns" (e = j * rows + row) or "dims" (the row's
    coordinates on ``row_dims``, major first, j's on the other dims, row-major)."""
    kind: str
    rows: int
    per_row: int
    row_dims: tuple[int, ...] = ()

    def index(self, row: kir.Expr, j: kir.Expr, dims: tuple[int, ...]) -> tuple[kir.Expr, ...]:
        if self.kind == "rows":
            return delinearize(iadd(imul(row, self.per_row), j), dims)
        if self.kind == "columns":
            return delinearize(iadd(imul(j, self.rows), row), dims)
        inner = tuple(d for d in range(len(dims)) if d not in self.row_dims)
        out: list[kir.Expr] = [_c(0)] * len(dims)
        for group, e in ((self.row_dims, row), (inner, j)):
            for d, i in zip(group, delinearize(e, tuple(dims[d] for d in group))):
                out[d] = i
        return tuple(out)

    def step_dim(self, dims: tuple[int, ...], width: int) -> int | None:
        """The dim whose index grows by one from a row's element j to j + 1 inside a group
        of ``width`` (j a multiple of ``width``, which divides ``per_row``): a vector walk
        adds its offsets there; None where the digits of j + 1 may differ elsewhere."""
        if self.kind == "columns" or not dims:
            return None
        if self.kind == "rows":
            minor = len(dims) - 1
        else:
            inner = [d for d in range(len(dims)) if d not in self.row_dims]
            if not inner:
                return None
            minor = inner[-1]
        return minor if dims[minor] % width == 0 else None

    def agrees(self, ids: np.ndarray) -> bool:
        """Whether ``ids`` (a full array, -1 where row-independent) has this split's row
        wherever it has one: ``ids`` compared where known with ``self.ids``, without
        building that (the layout proof's values reach millions of elements)."""
        if self.kind == "rows":
            view = ids.reshape(self.rows, self.per_row)
            want = np.arange(self.rows)[:, None]
        elif self.kind == "columns":
            view = ids.reshape(self.per_row, self.rows)
            want = np.arange(self.rows)[None, :]
        else:
            # Broadcastable (extent 1 off the row dims): compared with ``ids`` as they are.
            view, want = ids, compact_rows.dims_ids(ids.shape, self.row_dims)
        return not np.any(view != want, where=view >= 0)


def kept_dims(node: OpNode, rank: int) -> tuple[int, ...]:
    """The dims of a rank-``rank`` operand a reduce ``node`` keeps (its rows' coordinates)."""
    reduced = set(node.instruction.ints("dimensions"))
    return tuple(d for d in range(rank) if d not in reduced)


@dataclass(frozen=True)
class RowUnit:
    """How the threads of a block own rows. Rows are "minor" (contiguous): the lanes of a
    warp stride over a row (a warp or the whole block per row); else "columns": lanes own
    consecutive rows (a thread per row, or 32 rows a block with the warps striding)."""
    row: kir.Expr                # the row this thread works on (may be past the last)
    first: kir.Expr              # this thread's first element of the row
    step: int                    # ... and the stride to its next
    lanes_per_row: int           # 32: finish with a warp reduction
    slots: int                   # > 1: partials per row combined in shared memory
    columns: int = 1             # rows whose partials share the buffer
    share: kir.Expr = kir.i32(0)     # this thread's partial slot of the row
    column: kir.Expr = kir.i32(0)    # this thread's row among ``columns``
    share_writer: kir.Expr | None = None

    @staticmethod
    def rows_per_block(part, tpb: int) -> int:
        if part.minor:
            return tpb // 32 if part.unit == "warp" else 1
        return tpb if part.unit == "warp" else 32

    @staticmethod
    def of(part, tpb: int, em: ValueEmitter, bid: kir.Expr) -> "RowUnit":
        warps = tpb // 32
        tid = kir.ThreadIdx()
        lane = em.let("lane", kir.Binary("rem", tid, _c(32)))
        warp = em.let("warp", kir.Binary("div", tid, _c(32)))
        if part.minor and part.unit == "warp":
            return RowUnit(row=iadd(imul(bid, warps), warp), first=lane, step=32,
                         lanes_per_row=32, slots=1)
        if part.minor:
            return RowUnit(row=bid, first=tid, step=tpb, lanes_per_row=32, slots=warps,
                         share=warp, share_writer=kir.Compare("eq", lane, _c(0)))
        if part.unit == "warp":
            return RowUnit(row=iadd(imul(bid, tpb), tid), first=_c(0), step=1,
                         lanes_per_row=1, slots=1)
        return RowUnit(row=iadd(imul(bid, 32), lane), first=warp, step=warps, lanes_per_row=1,
                     slots=warps, columns=32, share=warp, column=lane)
