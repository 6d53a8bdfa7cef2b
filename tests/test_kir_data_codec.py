"""Kernel IR as data (stitch.codegen.kir_data) on random kernels: what is read back equals
what was written (values of every kind the format holds, ints, bools, non-finite floats,
tuples and lists), a subexpression shared in the kernel is one object again, and data that is
not Kernel IR (a reference forward, a bool or float where a reference stands, an untagged
dict) is refused."""
from __future__ import annotations

import json
import math
import random

import pytest

from stitch.codegen import kir
from stitch.codegen.kir_data import KirDataError, kernel_from_data, kernel_to_data


class _RandomKernel:
    """A random kernel: expression DAGs (later expressions reuse earlier ones), nested
    loops and branches, constants of every kind the format writes."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.ints: list[kir.Expr] = [kir.ThreadIdx(), kir.BlockIdx(), kir.BlockDim()]
        self.floats: list[kir.Expr] = []

    def int_expr(self, depth: int = 0) -> kir.Expr:
        rng = self.rng
        roll = rng.random()
        if roll < 0.25 or len(self.ints) < 4 or depth > 4 and roll >= 0.5:
            got: kir.Expr = kir.Const(rng.choice([0, 1, -1, rng.randint(-2**40, 2**40)]), "i32")
        elif roll < 0.35:
            got = kir.Ref(f"v{rng.randint(0, 50)}", "i32")
        elif roll < 0.5:
            return rng.choice(self.ints)             # shared: one object, many readers
        else:
            got = kir.Binary(rng.choice(["add", "mul", "rem", "min"]),
                             self.int_expr(depth + 1), self.int_expr(depth + 1))
        self.ints.append(got)
        return got

    def float_expr(self, depth: int = 0) -> kir.Expr:
        rng = self.rng
        roll = rng.random()
        if roll < 0.2 or not self.floats or depth > 4 and roll >= 0.35:
            value = rng.choice([rng.uniform(-1e6, 1e6), math.inf, -math.inf, math.nan, 0.0,
                                float(rng.randint(-9, 9))])
            got: kir.Expr = kir.Const(value, "f32")
        elif roll < 0.35:
            return rng.choice(self.floats)
        elif roll < 0.55:
            got = kir.Load(f"p{rng.randint(0, 3)}", self.int_expr(), "f32")
        elif roll < 0.75:
            got = kir.Binary(rng.choice(["add", "mul", "max"]), self.float_expr(depth + 1),
                             self.float_expr(depth + 1))
        else:
            got = kir.Select(kir.Compare(rng.choice(["lt", "ne"]), self.int_expr(),
                                         self.int_expr()),
                             self.float_expr(depth + 1), self.float_expr(depth + 1))
        self.floats.append(got)
        return got

    def body(self, depth: int) -> list[kir.Stmt]:
        rng = self.rng
        out: list[kir.Stmt] = []
        for i in range(rng.randint(1, 6)):
            roll = rng.random()
            if roll < 0.3:
                out.append(kir.Let(f"v{rng.randint(0, 50)}", self.float_expr()))
            elif roll < 0.5:
                out.append(kir.Store(f"p{rng.randint(0, 3)}", self.int_expr(),
                                     self.float_expr()))
            elif roll < 0.6:
                out.append(kir.Local(f"l{i}", "f32", rng.choice([None, self.float_expr()])))
            elif roll < 0.75 and depth < 3:
                out.append(kir.For(f"i{depth}", kir.Const(0, "i32"), self.int_expr(),
                                   kir.Const(rng.randint(1, 8), "i32"), self.body(depth + 1)))
            elif roll < 0.9 and depth < 3:
                out.append(kir.If(kir.Compare("lt", self.int_expr(), self.int_expr()),
                                  self.body(depth + 1),
                                  self.body(depth + 1) if rng.random() < 0.5 else ()))
            else:
                out.append(kir.Barrier())
        return out

    def kernel(self) -> kir.Kernel:
        rng = self.rng
        params = [kir.Param(f"p{i}", "f32", rng.randint(1, 2**20), rng.random() < 0.5)
                  for i in range(4)]
        shared = [kir.Shared("s0", "f32", rng.randint(1, 4096))]
        twice = self.float_expr()           # read twice: at least one shared object
        body = self.body(0) + [kir.Store("p0", self.int_expr(), kir.Binary("add", twice, twice))]
        return kir.Kernel(f"k{rng.randint(0, 999)}", params, shared, rng.randint(1, 2**16),
                          rng.choice([32, 128, 256]), body,
                          register_budget=rng.choice([None, 64, 255]))


def _exprs(kernel: kir.Kernel) -> list[kir.Expr]:
    """Every expression object of the kernel, in walk order, shared ones once per reader."""
    found: list[kir.Expr] = []

    def expr(e: kir.Expr) -> None:
        found.append(e)
        for sub in kir.sub_exprs(e):
            expr(sub)

    for s in kir.walk_stmts(kernel.body):
        for name in ("expr", "index", "value", "init", "cond", "start", "stop", "step"):
            e = getattr(s, name, None)
            if isinstance(e, kir.Expr):
                expr(e)
    return found


def _same(a: object, b: object) -> bool:
    """Dataclass equality with NaN equal to NaN (a kernel holding a NaN constant is not
    equal to itself under ==)."""
    return repr(a) == repr(b)


@pytest.mark.parametrize("seed_round", range(6))
def test_random_kernels_read_back_as_written(seed_round):
    rng = random.Random()
    kernel = _RandomKernel(rng).kernel()
    text = json.dumps(kernel_to_data(kernel))
    back = kernel_from_data(json.loads(text))
    assert type(back) is kir.Kernel and _same(back, kernel)
    assert [type(e) for e in _exprs(back)] == [type(e) for e in _exprs(kernel)]
    # Sharing is kept: two readers of one object read one object again.
    ids_in, ids_out = [id(e) for e in _exprs(kernel)], [id(e) for e in _exprs(back)]
    assert len(set(ids_in)) == len(set(ids_out)) < len(ids_in)
    assert len({(a, b) for a, b in zip(ids_in, ids_out)}) == len(set(ids_in))
    # Written again, the same text.
    assert json.dumps(kernel_to_data(back)) == text


def test_ints_bools_and_references_stay_apart():
    kernel = kir.Kernel("k", [kir.Param("p", "i32", 7, True)], [], 1, 32,
                        [kir.Store("p", kir.Const(3, "i32"), kir.Const(True, "i1")),
                         kir.Store("p", kir.Const(0, "i32"), kir.Const(2.0, "f32"))])
    back = kernel_from_data(json.loads(json.dumps(kernel_to_data(kernel))))
    first, second = back.body
    assert type(first.index.value) is int and first.index.value == 3
    assert type(first.value.value) is bool
    assert type(second.value.value) is float
    assert back.params[0].size == 7 and back.params[0].is_output is True


def test_data_that_is_not_kernel_ir_is_refused():
    kernel = _RandomKernel(random.Random()).kernel()
    good = kernel_to_data(kernel)
    nodes = good["nodes"]
    binary = next(i for i, (name, _) in enumerate(nodes) if name == "Binary")

    def broken(change) -> dict:
        data = json.loads(json.dumps(good))
        change(data["nodes"])
        return data

    forward = broken(lambda ns: ns[binary][1].__setitem__(1, binary))        # itself
    later = broken(lambda ns: ns[binary][1].__setitem__(1, len(ns) + 5))
    as_bool = broken(lambda ns: ns[binary][1].__setitem__(1, True))
    untagged = broken(lambda ns: ns[binary][1].__setitem__(1, {"r": 0}))
    unknown = broken(lambda ns: ns[binary].__setitem__(0, "Popen"))
    for data in (forward, later, as_bool, untagged, unknown):
        with pytest.raises(KirDataError):
            kernel_from_data(data)
    with pytest.raises(KirDataError):
        kernel_from_data({"nodes": nodes, "root": True})
