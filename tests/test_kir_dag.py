"""Kernel IR expressions are DAGs (one index expression feeds many loads): hashing, keys and
validation must cost the distinct nodes, not the paths (a transformer step's kernels spent
minutes hashing and printing them). Structural counts, no timings."""
from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest

from stitch.codegen import kir
from stitch.codegen.errors import CodegenError
from stitch.codegen.gpu_cache import kernel_ir_text, structure_key


def _doubling(depth: int, leaf: kir.Expr, shared: bool = True) -> kir.Expr:
    """x, x+x, (x+x)+(x+x), ...: ``depth`` + 1 distinct nodes, 2**depth paths to the leaf."""
    e = leaf
    for _ in range(depth):
        e = kir.Binary("add", e, e if shared else _copy(e))
    return e


def _copy(e: kir.Expr) -> kir.Expr:
    return pickle.loads(pickle.dumps(e))


def _kernel(value: kir.Expr, name: str = "k") -> kir.Kernel:
    body = (kir.Let("x", kir.Load("inp", kir.ThreadIdx(), "f32")),
            kir.Store("out", kir.ThreadIdx(), value))
    return kir.Kernel(name, (kir.Param("inp", "f32", 32), kir.Param("out", "f32", 32, is_output=True)), (),
                      1, 32, body)


def test_hash_walks_each_node_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"ref": 0}
    ref_hash = kir.Ref.__hash__

    def counting(self: kir.Ref) -> int:
        calls["ref"] += 1
        return ref_hash(self)

    monkeypatch.setattr(kir.Ref, "__hash__", counting)
    e = _doubling(16, kir.Ref("x", "f32"))
    assert hash(e) == hash(e)
    assert calls["ref"] == 2                # x + x hashes its leaf twice; the generated
    #                                         hash of every level: 2**16 = 65536
    again = _doubling(16, kir.Ref("x", "f32"))
    assert again is not e and again == e and {e: 1}[again] == 1


def test_memos_do_not_travel_between_processes() -> None:
    e = _doubling(3, kir.Ref("x", "f32"))
    hash(e), kir.expr_refs(e), kir.reads_thread_idx(e)
    assert {"_hash", "_refs", "_thread"} <= set(e.__dict__)
    copy = _copy(e)
    assert copy == e and not {"_hash", "_refs", "_thread"} & set(copy.__dict__)


def test_refs_and_thread_reads_are_the_tree_walks() -> None:
    i = kir.Binary("add", kir.ThreadIdx(), kir.Ref("base", "i32"))
    e = kir.Select(kir.Compare("lt", i, kir.Ref("n", "i32")),
                   kir.Load("a", i, "f32"), kir.Convert(kir.Ref("y", "i32"), "f32"))
    assert kir.expr_refs(e) == {("base", "i32"), ("n", "i32"), ("y", "i32")}
    assert kir.reads_thread_idx(e) and not kir.reads_thread_idx(kir.Ref("n", "i32"))


def test_key_text_is_linear_and_independent_of_sharing() -> None:
    shared = _kernel(_doubling(20, kir.Ref("x", "f32")))
    assert len(kernel_ir_text(shared)) < 4000      # the dataclass repr: ~2**20 * 40 chars
    small_shared = _kernel(_doubling(6, kir.Ref("x", "f32")))
    small_tree = _kernel(_doubling(6, kir.Ref("x", "f32"), shared=False))
    assert kernel_ir_text(small_shared) == kernel_ir_text(small_tree)
    assert structure_key(small_shared) == structure_key(_kernel(small_tree.body[1].value, "k2"))
    other = _kernel(kir.Binary("mul", small_tree.body[1].value, kir.Const(2.0, "f32")))
    assert kernel_ir_text(other) != kernel_ir_text(small_tree)


def test_validation_of_a_deep_dag_and_its_errors() -> None:
    _kernel(_doubling(40, kir.Ref("x", "f32"))).validate()     # 2**40 paths
    with pytest.raises(CodegenError, match="undefined variable 'z'"):
        _kernel(_doubling(30, kir.Ref("z", "f32"))).validate()
    with pytest.raises(CodegenError, match="Ref\\(x\\) has dtype i32"):
        _kernel(kir.Convert(_doubling(30, kir.Ref("x", "i32")), "f32")).validate()
    with pytest.raises(CodegenError, match="operands f32 vs i32"):
        _kernel(kir.Binary("add", _doubling(30, kir.Ref("x", "f32")),
                           kir.Const(1, "i32"))).validate()


def _random_dag(rng: np.random.Generator, nodes: int = 300) -> list[kir.Expr]:
    """Random expressions of every node type, each reusing earlier ones (DAGs)."""
    made: list[kir.Expr] = [kir.ThreadIdx(), kir.BlockIdx(), kir.BlockDim(), kir.GridDim(),
                            kir.Ref("n", "i32"), kir.Const(2, "i32")]

    def pick_int() -> kir.Expr:
        ints = [e for e in made[-40:] if e.dtype == "i32"]
        return ints[int(rng.integers(len(ints)))]

    while len(made) < nodes:
        a, b = pick_int(), pick_int()
        made.append([
            lambda: kir.Binary(str(rng.choice(["add", "mul", "min"])), a, b),
            lambda: kir.Select(kir.Compare("lt", a, b), a, b),
            lambda: kir.Convert(kir.Load("p", a, "f32"), "i32"),
            lambda: kir.Bitcast(kir.Unary("neg", kir.Bitcast(a, "f32")), "i32"),
            lambda: kir.Ref(f"v{int(rng.integers(5))}", "i32"),
        ][int(rng.integers(5))]())
    return made


class _Sum(kir.Binary):
    """A subclass: its operands are found by isinstance, not by its exact type."""


def test_operands_refs_and_thread_reads_are_their_definitions_on_random_dags() -> None:
    def operands(e: kir.Expr) -> tuple:
        return tuple(getattr(e, f.name) for f in dataclasses.fields(e)
                     if isinstance(getattr(e, f.name), kir.Expr))

    seen: dict[tuple[str, int], object] = {}       # (the walks per distinct node)

    def refs(e: kir.Expr) -> set:
        if ("refs", id(e)) not in seen:
            own = {(e.name, e.dtype)} if isinstance(e, kir.Ref) else set()
            seen["refs", id(e)] = own.union(*map(refs, operands(e)))
        return seen["refs", id(e)]

    def thread(e: kir.Expr) -> bool:
        if ("thread", id(e)) not in seen:
            seen["thread", id(e)] = isinstance(e, kir.ThreadIdx) or \
                any([thread(x) for x in operands(e)])
        return seen["thread", id(e)]

    rng = np.random.default_rng()
    made = _random_dag(rng) + [_Sum("add", kir.Ref("s", "i32"), kir.ThreadIdx())]
    for e in rng.permutation(np.array(made, dtype=object)):    # memos filled in any order
        assert kir.sub_exprs(e) == operands(e)
        assert kir.expr_refs(e) == refs(e)
        assert kir.reads_thread_idx(e) == thread(e)
    assert any(kir.reads_thread_idx(e) for e in made) and \
        not all(kir.reads_thread_idx(e) for e in made)
