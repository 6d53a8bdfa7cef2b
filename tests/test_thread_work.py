"""The busiest thread of a kernel as built (stitch.codegen.thread_work) and the bound it puts
on the kernel's time (stitch.cost.latency.thread_bound_seconds): counts on hand-built
kernels whose loops, packed parts and branches give known answers."""
from __future__ import annotations

import math

import numpy as np
import pytest

from stitch.codegen import kir
from stitch.codegen.kir import (Binary, BlockIdx, Compare, For, If, Kernel, Let, Load, Local,
                                Param, Ref, Store, ThreadIdx, i32)
from stitch.codegen.thread_work import busiest_thread
from stitch.cost.gpu_specs import get_spec
from stitch.cost.latency import UNROLL, thread_bound_seconds
from tests.test_kir_host import add, elementwise_kernel, mul, warp_softmax_kernel


def _row_stats_then_column_sum(rows: int, cols: int, block: int = 32) -> Kernel:
    """What thread composition of a column reduction over row statistics is: one thread a
    column, and for each row of its column the row's mean recomputed by a loop."""
    x = Param("x", "f32", rows * cols)
    out = Param("out", "f32", cols, is_output=True)
    col = Ref("c", "i32")
    row = Ref("r", "i32")
    k = Ref("k", "i32")
    acc, total = Ref("acc", "f32"), Ref("total", "f32")
    mean_loop = For("k", i32(0), i32(cols), i32(1), [
        kir.Assign("acc", add(acc, Load(x, add(mul(row, i32(cols)), k))))])
    row_loop = For("r", i32(0), i32(rows), i32(1), [
        Local("acc", "f32", kir.f32(0.0)), mean_loop,
        kir.Assign("total", add(total, Binary("sub", Load(x, add(mul(row, i32(cols)), col)),
                                              acc)))])
    body = [Let("c", add(mul(BlockIdx(), i32(block)), ThreadIdx())),
            If(Compare("lt", col, i32(cols)), [Local("total", "f32", kir.f32(0.0)), row_loop,
                                               Store(out, col, total)])]
    return Kernel("colsum", [x, out], [], (cols + block - 1) // block, block, body)


def test_nested_recomputation_multiplies_the_loops() -> None:
    k = _row_stats_then_column_sum(16, 32)
    k.validate()
    work = busiest_thread(k)
    # Per row: the mean loop's 32 loads and the row's own element.
    assert work.loads == 16 * (32 + 1)
    assert work.thread in (0, 31) and work.block == 0


def test_a_thread_past_the_guard_does_nothing() -> None:
    k = _row_stats_then_column_sum(16, 20)          # 32 threads, 20 columns
    assert busiest_thread(k).thread == 0             # thread 31 fails the guard


def test_grid_stride_loop_counts_the_threads_share() -> None:
    n = 100_000
    k = elementwise_kernel("ew", ["f32", "f32"], "f32", n, lambda a, b: add(mul(a, b), a),
                           grid_stride=True)         # 3 blocks of 128
    work = busiest_thread(k)
    stride = 3 * 128
    assert work.loads == 2 * -(-n // stride)         # thread 0: the most iterations


def test_packed_parts_are_told_apart_by_their_block_ranges() -> None:
    x = Param("x", "f32", 4096)
    out = Param("out", "f32", 1, is_output=True)
    light = [Store(out, i32(0), Load(x, i32(0)))]
    heavy = [Local("s", "f32", kir.f32(0.0)),
             For("i", i32(0), i32(4096), i32(1), [
                 kir.Assign("s", add(Ref("s", "f32"), Load(x, Ref("i", "i32"))))]),
             Store(out, i32(0), Ref("s", "f32"))]
    inside = Binary("and", Compare("ge", BlockIdx(), i32(5)), Compare("lt", BlockIdx(), i32(6)))
    body = [If(Compare("lt", BlockIdx(), i32(5)), light), If(inside, heavy)]
    k = Kernel("packed", [x, out], [], 6, 32, body)
    work = busiest_thread(k)
    assert work.block == 5 and work.loads == 4096


def test_warp_kernels_are_light_per_thread() -> None:
    k = warp_softmax_kernel(50, 333, "reduce")
    work = busiest_thread(k)
    assert 0 < work.loads < 50 * 333 / 4             # lanes share each row


def test_the_bound_follows_the_busier_resource() -> None:
    spec = get_spec("h100")
    launch = spec.kernel_launch_overhead_s
    l1 = 33
    assert thread_bound_seconds(spec, 1000, 0) == pytest.approx(
        launch + 1000 * l1 / UNROLL / spec.clock_hz)
    assert thread_bound_seconds(spec, 10, 1e6) == pytest.approx(launch + 1e6 / spec.clock_hz)
    assert thread_bound_seconds(spec, 0, 0) == pytest.approx(launch)


# ------------------------------------------------ against a straightforward walk
# busiest_thread shares what does not depend on the thread between its candidate walks
# (each expression's counts, and which expressions meet data on every path): the reference
# walks every candidate afresh, evaluating every integer Let, as the module docstring says.

class _Data(Exception):
    pass


def _ref_value(e, env):
    if e.dtype.startswith(("f", "bf")):
        raise _Data
    if isinstance(e, kir.Const):
        return e.value
    if isinstance(e, Ref):
        if e.name not in env:
            raise _Data
        return env[e.name]
    if isinstance(e, (ThreadIdx, BlockIdx)):
        return env["%thread" if isinstance(e, ThreadIdx) else "%block"]
    if isinstance(e, kir.Convert):
        return _ref_value(e.a, env)
    if isinstance(e, kir.Select):
        return _ref_value(e.a, env) if _ref_value(e.cond, env) else _ref_value(e.b, env)
    if isinstance(e, Compare):
        a, b = _ref_value(e.a, env), _ref_value(e.b, env)
        return {"lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b, "eq": a == b,
                "ne": a != b}[e.op]
    if isinstance(e, Binary) and e.op in ("add", "sub", "mul", "div", "rem", "min", "max"):
        a, b = _ref_value(e.a, env), _ref_value(e.b, env)
        if e.op in ("div", "rem") and b == 0:
            raise _Data
        return {"add": a + b, "sub": a - b, "mul": a * b, "min": min(a, b), "max": max(a, b),
                "div": int(a / b) if b else 0, "rem": int(math.fmod(a, b)) if b else 0}[e.op]
    raise _Data


def _ref_counts(e):
    nodes, stack = {}, [e]
    while stack:
        x = stack.pop()
        if id(x) not in nodes:
            nodes[id(x)] = x
            stack.extend(kir.sub_exprs(x))
    return (sum(isinstance(x, Load) for x in nodes.values()),
            sum(isinstance(x, (Binary, kir.Unary, kir.Select, Compare, kir.Convert,
                               kir.Bitcast)) for x in nodes.values()))


def _ref_body(body, env):
    loads = ops = 0.0
    for s in body:
        if isinstance(s, (Let, Local, kir.Assign)):
            e = s.expr if isinstance(s, (Let, kir.Assign)) else s.init
            l, o = _ref_counts(e) if e is not None else (0, 0)
            loads, ops = loads + l, ops + o
            env.pop(s.name, None)
            if isinstance(s, Let):
                try:
                    env[s.name] = _ref_value(s.expr, env)
                except _Data:
                    pass
        elif isinstance(s, Store):
            (l, o), (li, oi) = _ref_counts(s.value), _ref_counts(s.index)
            loads, ops = loads + l + li, ops + o + oi + 1
        elif isinstance(s, For):
            try:
                start = _ref_value(s.start, env)
                trips = max(0, math.ceil((_ref_value(s.stop, env) - start) /
                                         _ref_value(s.step, env)))
            except _Data:
                start, trips = None, 1
            inner = {k: v for k, v in env.items() if k != s.var}
            if start is not None:
                inner[s.var] = start
            l, o = _ref_body(s.body, inner) if trips else (0, 0)
            loads, ops = loads + l * trips, ops + o * trips
        elif isinstance(s, If):
            try:
                l, o = _ref_body(s.then if _ref_value(s.cond, env) else s.orelse, dict(env))
            except _Data:
                l, o = max(_ref_body(s.then, dict(env)), _ref_body(s.orelse, dict(env)),
                           key=lambda w: w[0] + w[1])
            loads, ops = loads + l, ops + o
    return loads, ops


def _random_kernel(rng) -> Kernel:
    """Integer index arithmetic of the thread, block, loop variables and loaded data (shared
    between statements as lowering shares it), float values, loops and branches on them."""
    x, idx = Param("x", "f32", 1024), Param("idx", "i32", 1024)
    out = Param("out", "f32", 1024, is_output=True)
    ints: list = [ThreadIdx(), BlockIdx(), i32(0), i32(3)]

    def int_expr(depth: int):
        if depth == 0 or rng.random() < 0.3:
            pick = rng.random()
            if pick < 0.15:
                return Load(idx, ints[int(rng.integers(len(ints)))])      # data
            if pick < 0.3:
                return i32(int(rng.integers(0, 9)))
            return ints[int(rng.integers(len(ints)))]                    # shared
        a, b = int_expr(depth - 1), int_expr(depth - 1)
        kind = rng.random()
        if kind < 0.2:
            # Often one side data: known only where the condition picks the other.
            side = Load(idx, b) if rng.random() < 0.5 else b
            return kir.Select(Compare(str(rng.choice(["lt", "ge", "eq"])), a, b), a, side)
        if kind < 0.25:
            return kir.Convert(Load(x, a), "i32")
        return Binary(str(rng.choice(["add", "sub", "mul", "min", "max", "div", "rem"])), a, b)

    def float_expr():
        return add(Load(x, int_expr(2)), mul(Load(x, int_expr(1)), kir.f32(2.0)))

    names = iter(range(10 ** 6))

    def body(depth: int) -> list:
        stmts = []
        for _ in range(int(rng.integers(1, 5))):
            kind = rng.random()
            if kind < 0.35:
                name = f"v{next(names)}"
                e = int_expr(3)
                stmts.append(Let(name, e))
                ints.append(Ref(name, "i32"))
            elif kind < 0.5:
                stmts.append(Let(f"f{next(names)}", float_expr()))
            elif kind < 0.65:
                stmts.append(Store(out, int_expr(2), float_expr()))
            elif kind < 0.8 and depth:
                var = f"i{next(names)}"
                start, stop = int_expr(1), add(int_expr(2), i32(int(rng.integers(0, 6))))
                ints.append(Ref(var, "i32"))
                stmts.append(For(var, start, stop, i32(int(rng.integers(1, 3))), body(depth - 1)))
            elif depth:
                cond = Compare(str(rng.choice(["lt", "gt", "ne"])), int_expr(2), int_expr(1))
                stmts.append(If(cond, body(depth - 1), body(depth - 1)))
        return stmts

    return Kernel("random", [x, idx, out], [], int(rng.integers(1, 9)),
                  int(rng.choice([32, 64, 128])), body(3))


def test_busiest_thread_is_the_straightforward_walk_on_random_kernels() -> None:
    rng = np.random.default_rng()
    told_apart = 0
    for _ in range(200):
        k = _random_kernel(rng)
        work = busiest_thread(k)
        blocks = sorted({work.block, 0, k.grid - 1})
        threads = sorted({0, min(31, k.block - 1), k.block - 1})
        walks = {(b, t): _ref_body(k.body, {"%thread": t, "%block": b, "%block_dim": k.block,
                                            "%grid_dim": k.grid})
                 for b in blocks for t in threads}
        # The answer is its thread's walk, and no candidate thread of these blocks is busier.
        assert (work.loads, work.ops) == walks[(work.block, work.thread)], k
        assert sum(walks[(work.block, work.thread)]) >= max(sum(w) for w in walks.values())
        told_apart += len(set(walks.values())) > 1
    assert told_apart          # the candidates' walks differ: the thread matters
