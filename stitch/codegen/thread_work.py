"""The busiest thread of a kernel as built: the loads and arithmetic one thread executes, loop
trip counts multiplied in, maximised over the blocks and threads that can differ.

Why: the schedule tuner prices a part from its schedule, and a thread-composition part that
recomputes earlier passes inside a later pass's loop (a column reduction over rows whose
statistics each row recomputes) can execute far more per thread than the schedule's count:
on an H200 such kernels ran 95-850 µs where 2-4 µs were modeled (GPU check, 2026-11). What a
thread executes is a floor on the kernel's time no matter how many threads run beside it
(``stitch.cost.latency.serial_floor_seconds``).

The walk evaluates integer expressions of the thread and block index, loop variables and
``Let`` values where they are known (a loop's bounds at its entry, a loop variable at its
first value); a branch it cannot decide counts its costlier side. Candidate blocks are the
first and last block and both sides of every block-index constant the kernel compares with
(kernel packing dispatches parts by block ranges); candidate threads are the first, the last
of the first warp and the last of the block.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from . import kir

_ARITHMETIC = (kir.Binary, kir.Unary, kir.Select, kir.Compare, kir.Convert, kir.Bitcast)
WARP_REDUCE_STEPS = 5          # a WarpReduce is a five-step xor butterfly


class _Unknown(Exception):
    """A value the walk cannot know (data, a mutable variable)."""


@dataclass(frozen=True)
class ThreadWork:
    """What one thread executes: global loads and stores, arithmetic instructions, and
    which (block, thread) that is."""
    loads: float
    ops: float
    block: int
    thread: int


def _value(e: kir.Expr, env: dict) -> int | float | bool:
    """An integer or predicate value of ``e`` (floating values are data: not followed)."""
    if e.dtype.startswith(("f", "bf")):
        raise _Unknown(e.dtype)
    if isinstance(e, kir.Const):
        return e.value
    if isinstance(e, kir.Ref):
        if e.name in env:
            return env[e.name]
        raise _Unknown(e.name)
    if isinstance(e, kir.ThreadIdx):
        return env["%thread"]
    if isinstance(e, kir.BlockIdx):
        return env["%block"]
    if isinstance(e, kir.BlockDim):
        return env["%block_dim"]
    if isinstance(e, kir.GridDim):
        return env["%grid_dim"]
    if isinstance(e, kir.Convert):
        return _value(e.a, env)
    if isinstance(e, kir.Select):
        return _value(e.a, env) if _value(e.cond, env) else _value(e.b, env)
    if isinstance(e, kir.Compare):
        a, b = _value(e.a, env), _value(e.b, env)
        return {"lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b, "eq": a == b,
                "ne": a != b}.get(e.op, False)
    if isinstance(e, kir.Binary):
        a, b = _value(e.a, env), _value(e.b, env)
        if e.op in ("div", "rem") and b == 0:
            raise _Unknown("division by zero")
        ops = {"add": lambda: a + b, "sub": lambda: a - b, "mul": lambda: a * b,
               "div": lambda: int(a / b), "rem": lambda: int(math.fmod(a, b)),
               "min": lambda: min(a, b), "max": lambda: max(a, b),
               "and": lambda: a and b, "or": lambda: a or b}
        if e.op in ops:
            return ops[e.op]()
    raise _Unknown(type(e).__name__)


def _expr_work(e: kir.Expr) -> tuple[int, int]:
    """(loads, arithmetic instructions) of evaluating ``e`` once: each distinct node of the
    expression DAG once (shared subexpressions are computed once)."""
    loads = ops = 0
    stack = [e]
    seen: set[int] = set()
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, kir.Load):
            loads += 1
        elif isinstance(x, _ARITHMETIC):
            ops += 1
        stack.extend(kir.sub_exprs(x))
    return loads, ops


def _body_work(body: tuple[kir.Stmt, ...], env: dict) -> tuple[float, float]:
    loads = ops = 0.0
    for s in body:
        if isinstance(s, kir.Let):
            l, o = _expr_work(s.expr)
            loads, ops = loads + l, ops + o
            try:
                env[s.name] = _value(s.expr, env)
            except _Unknown:
                env.pop(s.name, None)
        elif isinstance(s, (kir.Local, kir.Assign)):
            e = s.init if isinstance(s, kir.Local) else s.expr
            if e is not None:
                l, o = _expr_work(e)
                loads, ops = loads + l, ops + o
            env.pop(s.name, None)
        elif isinstance(s, (kir.Store, kir.AtomicAdd)):
            l, o = _expr_work(s.value)
            li, oi = _expr_work(s.index)
            loads, ops = loads + l + li, ops + o + oi + 1
        elif isinstance(s, kir.For):
            try:
                start = _value(s.start, env)
                trips = max(0, math.ceil((_value(s.stop, env) - start) / _value(s.step, env)))
            except _Unknown:
                start, trips = None, 1
            if trips:
                inner = dict(env)
                if start is None:
                    inner.pop(s.var, None)
                else:
                    inner[s.var] = start
                l, o = _body_work(s.body, inner)
                loads, ops = loads + l * trips, ops + o * trips
        elif isinstance(s, kir.If):
            try:
                taken = s.then if _value(s.cond, env) else s.orelse
                l, o = _body_work(taken, dict(env))
            except _Unknown:
                l, o = max(_body_work(s.then, dict(env)), _body_work(s.orelse, dict(env)),
                           key=lambda w: w[0] + w[1])
            loads, ops = loads + l, ops + o
        elif isinstance(s, kir.WarpShuffle):
            ops += 1
            env.pop(s.dest, None)
        elif isinstance(s, kir.WarpReduce):
            ops += WARP_REDUCE_STEPS
            env.pop(s.dest, None)
        elif isinstance(s, kir.MmaSync):
            ops += 1
            for name in s.dest:
                env.pop(name, None)
    return loads, ops


def _block_constants(kernel: kir.Kernel) -> set[int]:
    """Integer constants the kernel compares the block index with."""
    found: set[int] = set()
    for s in kir.walk_stmts(kernel.body):
        exprs = [s.cond] if isinstance(s, kir.If) else []
        while exprs:
            e = exprs.pop()
            if isinstance(e, kir.Compare) and isinstance(e.a, kir.BlockIdx) and \
                    isinstance(e.b, kir.Const):
                found.add(int(e.b.value))
            exprs.extend(kir.sub_exprs(e))
    return found


def busiest_thread(kernel: kir.Kernel) -> ThreadWork:
    """The candidate thread (module docstring) executing the most loads and arithmetic."""
    blocks = {0, kernel.grid - 1}
    for c in _block_constants(kernel):
        blocks.update({c - 1, c})
    threads = {0, min(31, kernel.block - 1), kernel.block - 1}
    best = ThreadWork(0.0, 0.0, 0, 0)
    for block in sorted(b for b in blocks if 0 <= b < kernel.grid):
        for thread in sorted(threads):
            env = {"%thread": thread, "%block": block, "%block_dim": kernel.block,
                   "%grid_dim": kernel.grid}
            loads, ops = _body_work(kernel.body, env)
            if loads + ops > best.loads + best.ops:
                best = ThreadWork(loads, ops, block, thread)
    return best
