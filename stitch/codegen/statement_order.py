"""Statement order that helps the NVPTX back end: a vector group's loads in one basic block."""
from __future__ import annotations

from . import kir


def loads_first(body: tuple[kir.Stmt, ...]) -> tuple[kir.Stmt, ...]:
    """``body`` with its top-level loads (``Let x = buffer[i]``) moved to the front, in
    order, where nothing before them in ``body`` defines or assigns a name they read,
    writes their buffer or is a barrier. A vector group's loads then share one basic block: the elements'
    math between them may become branches once LLVM inlines libdevice (tanh, erf, log),
    which would keep the back end from merging the loads into one vector access."""
    moved: list[kir.Stmt] = []
    rest: list[kir.Stmt] = []
    names: set[str] = set()         # defined or assigned by the statements left in place
    written: set[str] = set()       # buffers they store to
    fenced = False                  # a barrier left in place: nothing moves past it
    for stmt in body:
        if not fenced and isinstance(stmt, kir.Let) and isinstance(stmt.expr, kir.Load) and \
                stmt.expr.buffer not in written and \
                not any(name in names for name, _ in kir.expr_refs(stmt.expr)):
            moved.append(stmt)
            continue
        rest.append(stmt)
        for inner in kir.walk_stmts((stmt,)):
            if isinstance(inner, (kir.Let, kir.Local, kir.Assign)):
                names.add(inner.name)
            elif isinstance(inner, (kir.WarpReduce, kir.WarpShuffle)):
                names.add(inner.dest)
            elif isinstance(inner, kir.MmaSync):
                names.update(inner.dest)
            elif isinstance(inner, kir.For):
                names.add(inner.var)
            elif isinstance(inner, (kir.Store, kir.AtomicAdd)):
                written.add(inner.buffer)
            elif isinstance(inner, (kir.Barrier, kir.GridBarrier)):
                fenced = True
    return tuple(moved + rest)
