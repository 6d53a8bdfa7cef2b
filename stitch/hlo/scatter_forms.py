"""Where the windows of a scatter or gather go: which start-index components are provably
the window's own batch coordinate (``iota`` of the batch dim), and which are data.

jax writes ``x.at[rows, idx].add(u)`` (the backward of ``take_along_axis`` in cross-entropy)
as a scatter whose index vectors are ``concatenate(iota, idx)``: component 0 is the row
itself, so update r can only land in row r and no two updates collide. The same holds for
the loss's gather of one logit per row. This module proves that on index arrays: the known
values of the indices operand are computed with numpy through the ops that build index
tensors (iota, constant, broadcast, reshape, bitcast, transpose, slice, concatenate, copy,
convert); anything else is unknown data. A component is an *identity* when its values are
known everywhere and equal the coordinate along one batch dimension.

A scatter is of form ``row`` when every batch dimension of more than one element is an
identity whose operand dimension the window spans by one element: element p of the result
is hit by at most one update, found from p itself (codegen computes it in the producer's
index space, no atomics). Otherwise it is ``atomic``: updates may collide.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .combiners import combiner_kind
from .errors import StitchError
from .graph import OpGraph, OpNode
from .ir import Shape, parse_slice
from .literals import literal_to_numpy

# Largest index tensor whose values are computed for the proof.
MAX_INDEX_ELEMENTS = 1 << 24
# Most producers followed back from the indices operand (jnp.repeat's ids under
# jax_enable_x64 take about a hundred: s64 cumulative sums, a scatter of starts, clamps).
MAX_INDEX_OPS = 256

_INT_TYPES: dict[str, type] = {"s8": np.int8, "s16": np.int16, "s32": np.int32, "s64": np.int64,
              "u8": np.uint8, "u16": np.uint16, "u32": np.uint32, "u64": np.uint64}
_INDEX_TYPES = set(_INT_TYPES) | {"pred"}


@dataclass(frozen=True)
class IndexMap:
    """How a scatter/gather places its windows. The starts on ``identity`` (operand dims),
    read as a row-major number with ``radices``, are the batch point's own row-major
    number, for every batch point (proved on the index values; empty when no such set
    exists, or when the batch has one point). ``data``: (operand dim, index-vector
    component) pairs whose starts are data, read from the indices; ``window``: the
    window's size along every operand dim."""
    batch_shape: tuple[int, ...]
    identity: tuple[int, ...]
    radices: tuple[int, ...]
    data: tuple[tuple[int, int], ...]
    window: tuple[int, ...]
    index_vector_dim: int
    proved: bool = False         # the identity covers every batch point

    def blocks(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """(identity operand dims, batch positions) groups with equal element counts: how
        the identity dims turn into batch dims, as a reshape would (size-1 dims dropped)."""
        src = [(d, n) for d, n in zip(self.identity, self.radices) if n != 1]
        dst = [(b, n) for b, n in enumerate(self.batch_shape) if n != 1]
        out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        i = j = 0
        while i < len(src) and j < len(dst):
            a, b = [src[i][0]], [dst[j][0]]
            pa, pb = src[i][1], dst[j][1]
            i, j = i + 1, j + 1
            while pa != pb:
                if pa < pb and i < len(src):
                    pa *= src[i][1]
                    a.append(src[i][0])
                    i += 1
                elif pb < pa and j < len(dst):
                    pb *= dst[j][1]
                    b.append(dst[j][0])
                    j += 1
                else:
                    return []
            out.append((tuple(a), tuple(b)))
        return out


@dataclass(frozen=True)
class ScatterForm:
    kind: str                    # "row" | "atomic" | "unsupported"
    index_map: IndexMap | None
    reason: str = ""


def _leaf(shape: Shape) -> Shape:
    return next(shape.leaves()) if shape.is_tuple else shape


# ----------------------------------------------------------------- known index values
_Known = tuple[np.ndarray, np.ndarray]      # (int64 values, bool known) in logical shape


def _unknown(dims: tuple[int, ...]) -> _Known:
    if int(np.prod(dims, dtype=np.int64)) > MAX_INDEX_ELEMENTS:
        # Read-only views of one element: an index tensor too large to compute (one of
        # billions of elements) is unknown without being allocated.
        return (np.broadcast_to(np.zeros((), np.int64), dims),
                np.broadcast_to(np.zeros((), bool), dims))
    return np.zeros(dims, np.int64), np.zeros(dims, bool)


def _physical(arr: np.ndarray, shape: Shape) -> np.ndarray:
    order = list(reversed(shape.minor_to_major()))
    return np.transpose(arr, order).reshape(-1)


def _from_physical(flat: np.ndarray, shape: Shape) -> np.ndarray:
    order = list(reversed(shape.minor_to_major()))
    arr = flat.reshape(tuple(shape.dims[d] for d in order))
    return np.transpose(arr, np.argsort(order))


def _apply(node: OpNode, graph: OpGraph, ops: list[_Known]) -> _Known | None:
    """Known values of one index-building op, or None (unknown) for anything else."""
    op = node.opcode
    inst = node.instruction
    shape = _leaf(node.shape)
    dims = tuple(shape.dims)
    if op == "iota":
        dim = inst.int("iota_dimension")
        grid = np.arange(dims[dim], dtype=np.int64).reshape(
            [dims[dim] if d == dim else 1 for d in range(len(dims))])
        return np.broadcast_to(grid, dims).copy(), np.ones(dims, bool)
    if op == "constant":
        if inst.literal is None or shape.element_type not in _INDEX_TYPES:
            return None
        value = literal_to_numpy(inst.literal, shape,
                                 _INT_TYPES.get(shape.element_type, np.bool_))
        return np.asarray(value).astype(np.int64).reshape(dims), np.ones(dims, bool)
    if not ops:
        return None
    if op in ("copy", "convert"):
        src = _leaf(graph.nodes[node.operands[0]].shape)
        if src.element_type not in _INT_TYPES or shape.element_type not in _INT_TYPES:
            return None
        return ops[0]
    if op == "broadcast":
        table = list(inst.ints("dimensions", ()))
        order = np.argsort(table)
        out = []
        for arr in ops[0]:
            arr = np.transpose(arr, order) if arr.ndim else arr
            view = arr.reshape([dims[d] if d in table else 1 for d in range(len(dims))])
            out.append(np.broadcast_to(view, dims).copy())
        return out[0], out[1]
    if op == "reshape":
        return ops[0][0].reshape(dims), ops[0][1].reshape(dims)
    if op == "bitcast":
        src = _leaf(graph.nodes[node.operands[0]].shape)
        if src.element_type != shape.element_type:
            return None
        return tuple(_from_physical(_physical(a, src), shape) for a in ops[0])  # type: ignore
    if op == "transpose":
        perm = inst.ints("dimensions")
        return np.transpose(ops[0][0], perm), np.transpose(ops[0][1], perm)
    if op == "slice":
        spec = parse_slice(inst.attrs["slice"])
        index = tuple(slice(s.start, s.limit, s.stride) for s in spec)
        return ops[0][0][index], ops[0][1][index]
    if op == "concatenate":
        dim = inst.ints("dimensions")[0]
        return (np.concatenate([o[0] for o in ops], axis=dim),
                np.concatenate([o[1] for o in ops], axis=dim))
    if op == "reduce" and len(ops) == 2 and shape.element_type in _INDEX_TYPES:
        return _reduce(node, graph, ops)
    if op in _INT_ARITHMETIC and shape.element_type in _INT_TYPES:
        return _arithmetic(node, ops)
    if op in _BITWISE and shape.element_type in _INT_TYPES:
        return _bitwise(node, shape.element_type, ops)
    if op in _PRED_OPS and shape.element_type == "pred":
        return _predicate(node, graph, ops)
    if op in _EVALUATED and shape.element_type in _INDEX_TYPES and \
            all(bool(known.all()) for _, known in ops):
        return _evaluated(node, graph, ops)
    return None


# Index-building ops evaluated by the reference evaluator once every operand is known:
# ``jnp.repeat(arange(S), L, total_repeat_length=n)`` builds its ids with cumulative sums
# (reduce-window), a scatter of the segment starts and a gather from the arange.
_EVALUATED = {"reduce-window", "scatter", "gather", "dynamic-slice", "dynamic-update-slice",
              "pad", "reverse"}
_EVALUATORS: "weakref.WeakKeyDictionary[OpGraph, object]" = weakref.WeakKeyDictionary()


def _evaluated(node: OpNode, graph: OpGraph, ops: list[_Known]) -> _Known | None:
    from .evaluator import Evaluator
    from .evaluator.dtypes import numpy_dtype
    from .ir import HloModule

    evaluator = _EVALUATORS.get(graph)
    if evaluator is None:
        evaluator = _EVALUATORS[graph] = Evaluator(
            HloModule("index_proof", list(graph.computations.values())))
    operands = []
    for o, (values, _) in zip(node.operands, ops):
        oshape = _leaf(graph.nodes[o].shape)
        if oshape.element_type not in _INDEX_TYPES:
            return None
        operands.append(values.astype(numpy_dtype(oshape.element_type)))
    comp = graph.computations.get(node.computation)
    if comp is None:
        return None
    try:
        value = evaluator.apply_instruction(comp, node.instruction, operands)
    except StitchError:
        return None
    dims = tuple(_leaf(node.shape).dims)
    out = np.asarray(value).astype(np.int64).reshape(dims)
    return out, np.ones(dims, bool)


# Integer element ops whose result follows from known operands (jax builds index tensors
# with them: ``iota // L`` as a floor division with sign fix-ups, negative-index wrapping
# ``select(i < 0, i + n, i)``, clamps); predicates are held as 0/1.
_INT_ARITHMETIC = {"add", "subtract", "multiply", "divide", "remainder", "maximum",
                   "minimum", "negate", "abs", "sign", "select", "clamp"}
_PRED_OPS = {"compare", "and", "or", "xor", "not"}
# Integer bit operations: XLA's optimizations turn jax's ``iota // 2^k`` into a logical
# right shift and ``iota % 2^k`` into an ``and`` with a mask.
_BITWISE = {"and", "or", "xor", "not", "shift-left", "shift-right-logical",
            "shift-right-arithmetic"}
_COMPARE = {"EQ": np.equal, "NE": np.not_equal, "LT": np.less, "LE": np.less_equal,
            "GT": np.greater, "GE": np.greater_equal}


def _reduce(node: OpNode, graph: OpGraph, ops: list[_Known]) -> _Known | None:
    """A single-op and/or/add/max/min reduction of known values (jax's in-bounds checks
    reduce a [N, 1] predicate with ``and``)."""
    names = [n.lstrip("%") for n in node.instruction.called_computations]
    comp = graph.computations.get(names[0]) if names else None
    kind = combiner_kind(comp) if comp is not None else None
    fn = {"and": np.logical_and, "or": np.logical_or, "add": np.add,
          "maximum": np.maximum, "minimum": np.minimum}.get(kind or "")
    if fn is None:
        return None
    dims = tuple(node.instruction.ints("dimensions"))
    (values, known), (init, init_known) = ops
    out = fn.reduce(values, axis=dims) if dims else values
    out = fn(out, init).astype(np.int64)
    ok = known.all(axis=dims) & init_known if dims else known & init_known
    return out, np.broadcast_to(ok, out.shape).copy()


def _all_known(ops: list[_Known]) -> np.ndarray:
    return np.logical_and.reduce([o[1] for o in ops])


def _arithmetic(node: OpNode, ops: list[_Known]) -> _Known | None:
    """XLA's integer semantics on known values (division truncates toward zero; a
    division by zero is left unknown); an element is known where every operand is."""
    op = node.opcode
    values = [o[0] for o in ops]
    known = _all_known(ops)
    if op == "negate":
        out = -values[0]
    elif op == "abs":
        out = np.abs(values[0])
    elif op == "sign":
        out = np.sign(values[0])
    elif op in ("add", "subtract", "multiply", "maximum", "minimum"):
        fn = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply,
              "maximum": np.maximum, "minimum": np.minimum}[op]
        out = fn(values[0], values[1])
    elif op in ("divide", "remainder"):
        a, b = values
        zero = b == 0
        safe = np.where(zero, 1, b)
        quotient = np.sign(a) * np.sign(safe) * (np.abs(a) // np.abs(safe))
        out = quotient if op == "divide" else a - quotient * safe
        known = known & ~zero
    elif op == "select":
        out = np.where(values[0] != 0, values[1], values[2])
    elif op == "clamp":
        out = np.minimum(np.maximum(values[1], values[0]), values[2])
    else:
        return None
    dims = tuple(_leaf(node.shape).dims)
    return np.broadcast_to(out, dims).astype(np.int64), np.broadcast_to(known, dims).copy()


def _bitwise(node: OpNode, element_type: str, ops: list[_Known]) -> _Known | None:
    """XLA's bit operations on known integers of ``element_type``: values are held
    sign-extended in int64, so and/or/xor/not are exact; shifts are done on the type's own
    bits (a shift by the width or more gives 0, or the sign for an arithmetic one)."""
    op = node.opcode
    values = [o[0] for o in ops]
    known = _all_known(ops)
    np_type = _INT_TYPES[element_type]
    bits = np.dtype(np_type).itemsize * 8
    if op == "not":
        out = np.invert(values[0])
    elif op in ("and", "or", "xor"):
        fn = {"and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}[op]
        out = fn(values[0], values[1])
    else:
        a = values[0].astype(np_type)
        shift = values[1]
        over = (shift < 0) | (shift >= bits)
        amount = np.where(over, 0, shift).astype(np_type)
        if op == "shift-left":
            out = np.where(over, 0, np.left_shift(a, amount))
        elif op == "shift-right-arithmetic":
            signed = a.astype(np.dtype(f"i{bits // 8}"))
            out = np.where(over, np.where(signed < 0, -1, 0),
                           np.right_shift(signed, amount.astype(signed.dtype)))
        else:
            unsigned = a.view(np.dtype(f"u{bits // 8}"))
            out = np.where(over, 0, np.right_shift(unsigned, amount.astype(unsigned.dtype)))
        out = np.asarray(out).astype(np_type)
    dims = tuple(_leaf(node.shape).dims)
    return np.broadcast_to(np.asarray(out).astype(np.int64), dims).copy(), \
        np.broadcast_to(known, dims).copy()


def _predicate(node: OpNode, graph: OpGraph, ops: list[_Known]) -> _Known | None:
    """compare of known integers, and/or/xor/not of known predicates, as 0/1."""
    op = node.opcode
    values = [o[0] for o in ops]
    if op == "compare":
        fn = _COMPARE.get(node.instruction.attrs.get("direction", ""))
        types = {_leaf(graph.nodes[o].shape).element_type for o in node.operands}
        if fn is None or not types <= set(_INT_TYPES) | {"pred"}:
            return None
        out = fn(values[0], values[1])
    elif op == "not":
        out = values[0] == 0
    else:
        fn = {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}[op]
        out = fn(values[0] != 0, values[1] != 0)
    dims = tuple(_leaf(node.shape).dims)
    return (np.broadcast_to(out, dims).astype(np.int64),
            np.broadcast_to(_all_known(ops), dims).copy())


_KNOWN_CACHE: "weakref.WeakKeyDictionary[OpGraph, dict[int, _Known]]" = \
    weakref.WeakKeyDictionary()


def known_index_values(graph: OpGraph, v: int) -> _Known:
    """The values of index tensor ``v`` that follow from its construction alone (iota,
    constants, data movement, integer arithmetic), with a mask of which elements are known.
    Cached per graph; the arrays returned are shared and must not be written."""
    cache = _KNOWN_CACHE.setdefault(graph, {})
    got = cache.get(v)
    if got is None:
        got = cache[v] = _known_values(graph, v)
    return got


# Verdicts of ``uniform_predicate`` by the structure that decides them, across graphs and
# modules (a causal mask is the same iota compare in every layer's fusions): at most this
# many kept, the oldest first out.
MAX_VERDICTS = 1024
_VERDICTS: "OrderedDict[tuple, bool | None]" = OrderedDict()
_VERDICTS_LOCK = threading.Lock()


def uniform_predicate(graph: OpGraph, v: int) -> bool | None:
    """True if every element of ``v`` is known non-zero (a predicate proved all true), False
    if every one is known zero, None otherwise. Computed (``known_index_values``) once per
    structure of what decides it: the producers ``known_index_values`` computes, by opcode,
    shape, attributes and literal, and the shapes of the values it leaves unknown."""
    key = _producers_key(graph, v)
    if key is not None:
        with _VERDICTS_LOCK:
            if key in _VERDICTS:
                _VERDICTS.move_to_end(key)
                return _VERDICTS[key]
    values, known = known_index_values(graph, v)
    verdict: bool | None = None
    if values.size and bool(known.all()):
        verdict = True if bool((values != 0).all()) else \
            False if bool((values == 0).all()) else None
    if key is not None:
        with _VERDICTS_LOCK:
            _VERDICTS[key] = verdict
            while len(_VERDICTS) > MAX_VERDICTS:
                _VERDICTS.popitem(last=False)
    return verdict


def _producers_key(graph: OpGraph, v: int) -> tuple | None:
    """What ``_known_values(graph, v)`` depends on, names left out (None where a producer it
    computes calls a computation: those are not keyed)."""
    computed, _ = _computed_producers(graph, v)
    position: dict[int, int] = {}
    parts: list[tuple] = []

    def visit(u: int) -> int:
        if u in position:
            return position[u]
        node = graph.nodes[u]
        if u in computed:
            inst = node.instruction
            operands = tuple(visit(o) for o in node.operands) \
                if node.opcode not in ("iota", "constant") else ()
            part = (node.opcode, str(node.shape), operands, inst.literal,
                    tuple(sorted((k, a) for k, a in inst.attrs.items() if k != "metadata")))
        else:
            part = ("unknown", str(node.shape))
        position[u] = len(parts)
        parts.append(part)
        return position[u]

    if any(graph.nodes[u].instruction.called_computations for u in computed):
        return None
    visit(v)
    return tuple(parts)


def _computed_producers(graph: OpGraph, v: int) -> tuple[set[int], dict[int, int]]:
    """The producers ``_known_values`` computes for ``v`` (the first MAX_INDEX_OPS met depth
    first, each at most MAX_INDEX_ELEMENTS) and how many computed readers each value has."""
    budget = MAX_INDEX_OPS
    computed: set[int] = set()
    readers: dict[int, int] = {}
    seen: set[int] = set()
    stack = [v]
    while stack:
        u = stack.pop()
        if u in seen:
            continue
        seen.add(u)
        node = graph.nodes[u]
        if node.shape.is_tuple or _leaf(node.shape).num_elements > MAX_INDEX_ELEMENTS or \
                budget <= 0:
            continue
        # An op reading a value too large to compute is not computed either (its operand
        # would be an unknown of that size, walked element by element).
        if node.opcode not in ("iota", "constant") and any(
                _leaf(graph.nodes[o].shape).num_elements > MAX_INDEX_ELEMENTS
                for o in node.operands):
            continue
        budget -= 1
        computed.add(u)
        if node.opcode in ("iota", "constant"):
            continue
        for o in node.operands:
            readers[o] = readers.get(o, 0) + 1
        stack.extend(reversed(node.operands))
    return computed, readers


def _known_values(graph: OpGraph, v: int) -> _Known:
    # Which producers are computed (the first MAX_INDEX_OPS met depth first, each at most
    # MAX_INDEX_ELEMENTS), and how many computed readers each value has, so that an
    # intermediate is dropped once its last reader has it: index tensors of millions of
    # elements go through a dozen ops (jax's floor division), not all held at once.
    computed, readers = _computed_producers(graph, v)
    memo: dict[int, _Known] = {}

    def visit(u: int) -> _Known:
        if u in memo:
            return memo[u]
        node = graph.nodes[u]
        got: _Known | None = None
        if u in computed:
            ops = [visit(o) for o in node.operands] \
                if node.opcode not in ("iota", "constant") else []
            try:
                got = _apply(node, graph, ops)
            except (ValueError, IndexError, KeyError):
                got = None
            del ops
            if node.opcode not in ("iota", "constant"):
                for o in node.operands:
                    readers[o] -= 1
                    if readers[o] == 0 and o != v:
                        memo.pop(o, None)
        memo[u] = got if got is not None else _unknown(tuple(_leaf(node.shape).dims))
        return memo[u]

    return visit(v)


# ----------------------------------------------------------------- index maps
def _index_map(graph: OpGraph, indices: int, vector_dim: int, index_map: tuple[int, ...],
               operand_batching: tuple[int, ...], indices_batching: tuple[int, ...],
               window: tuple[int, ...]) -> IndexMap:
    ishape = _leaf(graph.nodes[indices].shape)
    values, known = known_index_values(graph, indices)
    if vector_dim == ishape.rank:
        values, known = values[..., None], known[..., None]
    else:
        values, known = np.moveaxis(values, vector_dim, -1), np.moveaxis(known, vector_dim, -1)
    batch_dims = [d for d in range(ishape.rank) if d != vector_dim]
    batch_shape = tuple(ishape.dims[d] for d in batch_dims)
    count = int(np.prod(batch_shape, dtype=np.int64))
    if count > MAX_INDEX_ELEMENTS:
        # Too many index vectors to prove anything on: every start is data.
        return IndexMap(batch_shape, (), (), tuple((od, k) for k, od in enumerate(index_map)),
                        window, vector_dim, False)
    coords = np.indices(batch_shape, dtype=np.int64).reshape(len(batch_shape), count)
    flat = values.reshape(count, values.shape[-1])
    # Candidate identity starts: fully known components with a one-element window, and the
    # operand batching dims (their start is the batch coordinate by definition).
    known_starts: dict[int, np.ndarray] = {}
    for k, od in enumerate(index_map):
        if count and bool(known[..., k].all()) and window[od] == 1:
            known_starts[od] = flat[:, k]
    for od, idim in zip(operand_batching, indices_batching):
        known_starts[od] = coords[batch_dims.index(idim)]
    identity: tuple[int, ...] = ()
    radices: tuple[int, ...] = ()
    proved = count == 1
    if count > 1:
        for order in (sorted(known_starts), [d for d in index_map if d in known_starts] +
                      [d for d in operand_batching if d in known_starts]):
            starts = [known_starts[d] for d in order]
            if any(int(s.min()) < 0 for s in starts):
                continue
            sizes = [int(s.max()) + 1 for s in starts]
            number = np.zeros(count, np.int64)
            for s, n in zip(starts, sizes):
                number = number * n + s
            if np.array_equal(number, np.arange(count)):
                identity, radices, proved = tuple(order), tuple(sizes), True
                break
    data = tuple((od, k) for k, od in enumerate(index_map) if od not in identity)
    return IndexMap(batch_shape, identity, radices, data, window, vector_dim, proved)


def scatter_window(graph: OpGraph, node: OpNode) -> tuple[int, ...]:
    """The update window's size along every operand dim (1 on inserted and batching dims)."""
    inst = node.instruction
    operand = _leaf(graph.nodes[node.operands[0]].shape)
    update = _leaf(graph.nodes[node.operands[-1]].shape)
    window_dims = inst.ints("update_window_dims", ())
    skipped = set(inst.ints("inserted_window_dims", ())) | set(inst.ints("input_batching_dims", ()))
    spanned = [d for d in range(operand.rank) if d not in skipped]
    if len(spanned) != len(window_dims):
        raise ValueError(f"{node.name}: {len(window_dims)} update window dims for "
                         f"{len(spanned)} operand window dims")
    sizes = [1] * operand.rank
    for d, w in zip(spanned, window_dims):
        sizes[d] = update.dims[w]
    return tuple(sizes)


_SCATTER_CACHE: "weakref.WeakKeyDictionary[OpGraph, dict[int, ScatterForm]]" = \
    weakref.WeakKeyDictionary()
_GATHER_CACHE: "weakref.WeakKeyDictionary[OpGraph, dict[int, IndexMap | None]]" = \
    weakref.WeakKeyDictionary()


def scatter_form(graph: OpGraph, v: int) -> ScatterForm:
    """How scatter ``v`` can be generated (cached per graph)."""
    cache = _SCATTER_CACHE.setdefault(graph, {})
    if v not in cache:
        cache[v] = _scatter_form(graph, graph.nodes[v])
    return cache[v]


def _scatter_form(graph: OpGraph, node: OpNode) -> ScatterForm:
    if len(node.operands) != 3 or node.shape.is_tuple:
        return ScatterForm("unsupported", None, f"{node.name}: variadic scatter")
    inst = node.instruction
    try:
        window = scatter_window(graph, node)
        imap = _index_map(graph, node.operands[1], inst.int("index_vector_dim"),
                          inst.ints("scatter_dims_to_operand_dims", ()),
                          inst.ints("input_batching_dims", ()),
                          inst.ints("scatter_indices_batching_dims", ()), window)
    except (ValueError, KeyError, IndexError) as exc:
        return ScatterForm("unsupported", None, f"{node.name}: {exc}")
    update = _leaf(graph.nodes[node.operands[2]].shape)
    if update.num_elements == 0:
        return ScatterForm("unsupported", imap, f"{node.name}: no updates")
    if not imap.proved:
        return ScatterForm("atomic", imap, f"{node.name}: the update batch is not an identity "
                           "of the index components (updates may collide)")
    if any(d not in imap.identity for d in inst.ints("input_batching_dims", ())):
        return ScatterForm("atomic", imap, f"{node.name}: batching dims outside the identity")
    return ScatterForm("row", imap)


@dataclass(frozen=True)
class WholeRows:
    """A colliding scatter of whole operand rows: ``rows`` update rows of ``width``
    elements, combined by ``kind`` (``combiners.combiner_kind``)."""
    kind: str | None
    rows: int
    width: int


def whole_rows_scatter(graph: OpGraph, v: int) -> WholeRows | None:
    """Scatter ``v`` when its updates may collide (form "atomic") and it scatters whole
    rows: one update batch dim leading the updates, one index component into operand
    dim 0, a window of one row along dim 0 and the operand's extent elsewhere, no batching
    dims, at least two rows. None otherwise."""
    node = graph.nodes[v]
    if node.opcode != "scatter" or len(node.operands) != 3 or node.shape.is_tuple:
        return None
    inst = node.instruction
    if scatter_form(graph, v).kind != "atomic":
        return None
    if inst.ints("input_batching_dims", ()) or \
            inst.ints("scatter_dims_to_operand_dims", ()) != (0,):
        return None
    operand, update = node.shape, graph.nodes[node.operands[2]].shape
    if scatter_batch_dims(node, graph) != [0] or update.rank < 1 or operand.rank < 1:
        return None
    try:
        window = scatter_window(graph, node)
    except ValueError:
        return None
    if window != (1,) + tuple(operand.dims[1:]):
        return None
    rows = update.dims[0]
    width = update.num_elements // rows if rows else 0
    if rows < 2 or width < 1:
        return None
    names = [n.lstrip("%") for n in inst.called_computations]
    comp = graph.computations.get(names[0]) if names else None
    return WholeRows(combiner_kind(comp) if comp is not None else None, rows, width)


def gather_index_map(graph: OpGraph, v: int) -> IndexMap | None:
    """The index map of gather ``v`` (None when its dimension numbers are not readable)."""
    cache = _GATHER_CACHE.setdefault(graph, {})
    if v not in cache:
        node = graph.nodes[v]
        inst = node.instruction
        try:
            cache[v] = _index_map(graph, node.operands[1], inst.int("index_vector_dim"),
                                  inst.ints("start_index_map", ()),
                                  inst.ints("operand_batching_dims", ()),
                                  inst.ints("start_indices_batching_dims", ()),
                                  tuple(inst.ints("slice_sizes")))
        except (ValueError, KeyError, IndexError):
            cache[v] = None
    return cache[v]


def gather_batch_dims(node: OpNode) -> list[int]:
    """Output dims of a gather that index the batch (the ones not in offset_dims), in order."""
    offset = set(node.instruction.ints("offset_dims", ()))
    return [p for p in range(_leaf(node.shape).rank) if p not in offset]


def scatter_batch_dims(node: OpNode, graph: OpGraph) -> list[int]:
    """Update dims that index the batch (the ones not in update_window_dims), in order."""
    window = set(node.instruction.ints("update_window_dims", ()))
    return [p for p in range(_leaf(graph.nodes[node.operands[-1]].shape).rank)
            if p not in window]


__all__ = ["IndexMap", "ScatterForm", "WholeRows", "known_index_values", "scatter_form",
           "scatter_window", "gather_index_map", "gather_batch_dims", "scatter_batch_dims",
           "whole_rows_scatter"]
