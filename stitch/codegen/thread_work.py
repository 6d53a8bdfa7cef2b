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
import operator
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
    # Most frequent first (the node types are disjoint: the order changes no answer).
    if isinstance(e, kir.Ref):
        if e.name in env:
            return env[e.name]
        raise _Unknown(e.name)
    if isinstance(e, kir.Binary):
        a, b = _value(e.a, env), _value(e.b, env)
        if e.op in ("div", "rem") and b == 0:
            raise _Unknown("division by zero")
        binary = _BINARY.get(e.op)
        if binary is not None:
            return binary(a, b)
    if isinstance(e, kir.Const):
        return e.value
    if isinstance(e, kir.Compare):
        a, b = _value(e.a, env), _value(e.b, env)
        compare = _COMPARE.get(e.op)
        return False if compare is None else compare(a, b)
    if isinstance(e, kir.ThreadIdx):
        return env["%thread"]
    if isinstance(e, kir.BlockIdx):
        return env["%block"]
    if isinstance(e, kir.Select):
        return _value(e.a, env) if _value(e.cond, env) else _value(e.b, env)
    if isinstance(e, kir.Convert):
        return _value(e.a, env)
    if isinstance(e, kir.BlockDim):
        return env["%block_dim"]
    if isinstance(e, kir.GridDim):
        return env["%grid_dim"]
    raise _Unknown(type(e).__name__)


# The integer ops the walk follows, built once (not per evaluated node).
_COMPARE = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
            "eq": operator.eq, "ne": operator.ne}
_BINARY = {"add": operator.add, "sub": operator.sub, "mul": operator.mul,
           "div": lambda a, b: int(a / b), "rem": lambda a, b: int(math.fmod(a, b)),
           "min": min, "max": max, "and": lambda a, b: a and b, "or": lambda a, b: a or b}


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


def _never_known(e: kir.Expr, memo: dict[int, bool]) -> bool:
    """Whether ``_value(e, env)`` raises ``_Unknown`` whatever ``env`` holds: it meets data
    (a float, a load, an op it does not follow) on every path it evaluates."""
    got = memo.get(id(e))
    if got is None:
        if e.dtype.startswith(("f", "bf")):
            got = True
        elif isinstance(e, (kir.Const, kir.Ref, kir.ThreadIdx, kir.BlockIdx, kir.BlockDim,
                            kir.GridDim)):
            got = False
        elif isinstance(e, kir.Convert):
            got = _never_known(e.a, memo)
        elif isinstance(e, kir.Select):
            got = _never_known(e.cond, memo) or (_never_known(e.a, memo) and
                                                 _never_known(e.b, memo))
        elif isinstance(e, kir.Compare):
            got = _never_known(e.a, memo) or _never_known(e.b, memo)
        elif isinstance(e, kir.Binary):
            got = e.op not in _BINARY or _never_known(e.a, memo) or _never_known(e.b, memo)
        else:
            got = True
        memo[id(e)] = got
    return got


class _Walk:
    """What one kernel's walks share (every candidate thread walks the same statements):
    each expression object's ``_expr_work`` and whether it is never known, neither of
    which depends on the thread. Keyed by object (equal expressions may share their nodes
    differently); the kernel keeps the objects alive, so their ids stay their own."""

    def __init__(self) -> None:
        self._counts: dict[int, tuple[int, int]] = {}
        self._never: dict[int, bool] = {}

    def __getitem__(self, e: kir.Expr) -> tuple[int, int]:
        got = self._counts.get(id(e))
        if got is None:
            got = self._counts[id(e)] = _expr_work(e)
        return got

    def value(self, e: kir.Expr, env: dict) -> int | float | bool:
        """``_value(e, env)``, without walking expressions that are never known."""
        if _never_known(e, self._never):
            raise _Unknown("data")
        return _value(e, env)


def _body_work(body: tuple[kir.Stmt, ...], env: dict, work: _Walk
               ) -> tuple[float, float]:
    loads = ops = 0.0
    for s in body:
        if isinstance(s, kir.Let):
            l, o = work[s.expr]
            loads, ops = loads + l, ops + o
            try:
                env[s.name] = work.value(s.expr, env)
            except _Unknown:
                env.pop(s.name, None)
        elif isinstance(s, (kir.Local, kir.Assign)):
            e = s.init if isinstance(s, kir.Local) else s.expr
            if e is not None:
                l, o = work[e]
                loads, ops = loads + l, ops + o
            env.pop(s.name, None)
        elif isinstance(s, (kir.Store, kir.AtomicAdd)):
            l, o = work[s.value]
            li, oi = work[s.index]
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
                l, o = _body_work(s.body, inner, work)
                loads, ops = loads + l * trips, ops + o * trips
        elif isinstance(s, kir.If):
            try:
                taken = s.then if work.value(s.cond, env) else s.orelse
                l, o = _body_work(taken, dict(env), work)
            except _Unknown:
                l, o = max(_body_work(s.then, dict(env), work),
                           _body_work(s.orelse, dict(env), work),
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
    work = _Walk()
    for block in sorted(b for b in blocks if 0 <= b < kernel.grid):
        for thread in sorted(threads):
            env = {"%thread": thread, "%block": block, "%block_dim": kernel.block,
                   "%grid_dim": kernel.grid}
            loads, ops = _body_work(kernel.body, env, work)
            if loads + ops > best.loads + best.ops:
                best = ThreadWork(loads, ops, block, thread)
    return best
