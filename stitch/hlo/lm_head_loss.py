"""The LM head's logits GEMM followed by a softmax cross-entropy over its columns.

``logits[r, v] = sum_d H[r, d] * E[v, d]`` (the tied embedding read transposed), and per row
r the values a cross-entropy loss and its gradient are built from:

* ``lse[r] = log(sum_v exp(logits[r, v]))`` (online over vocabulary tiles: a running max
  and a sum rescaled as the max grows);
* ``picked[r] = logits[r, labels[r]]`` (jax's take_along_axis: a negative label counts
  from the end, one outside [0, vocab) after that picks NaN);
* ``log_prob[r] = picked[r] - lse[r]`` (what jax's ``log_softmax`` + ``take_along_axis``
  give; the loss is minus its mean).
 A kernel computing these from H, E and the labels never
writes the [rows, vocab] logits (Cut Cross-Entropy, Liger's fused linear cross-entropy).

``LmHeadLoss`` describes one such site. It offers the attributes a GEMM chain's first GEMM
is lowered from (``a``, ``b``, ``m``, ``n``, ``k``, ``operand_dtype``, ``tf32``), so the
chain kernels' thread layouts compute its logits tiles. ``find_lm_head_losses`` finds sites in
XLA GPU's optimized module (the section below).
"""
from __future__ import annotations

import heapq
import logging
import math
from dataclasses import dataclass

import numpy as np

from .combiners import combiner_kind
from .gemm_chains import OperandView, allows_tf32
from .ir import parse_padding
from .literals import literal_to_numpy
from .scatter_forms import gather_index_map

log = logging.getLogger(__name__)

# Element types of H and E the kernel reads (the logits GEMM's operands).
OPERAND_TYPES = ("f32", "bf16", "f16")


@dataclass(frozen=True)
class LmHeadLoss:
    """One LM head + softmax cross-entropy site (see the module docstring)."""
    rows: int                   # tokens (m)
    vocab: int                  # logits columns (n)
    hidden: int                 # the GEMM's contraction (k)
    hidden_view: OperandView    # H as [1, rows, hidden]
    embedding_view: OperandView  # E as [1, hidden, vocab] (E [vocab, hidden] transposed)
    labels: int                 # node id of the s32 [rows] labels
    operand_dtype: str          # element type of H and E
    logits_dtype: str = "f32"   # the GEMM's result type: bf16 logits are rounded so
    tf32: bool = False          # f32 operands may run as TF32 (XLA's default precision)
    # Node ids of the results the kernel writes (-1: not written): per row, and the sum of
    # log_prob over the rows (an f32 scalar).
    lse: int = -1
    picked: int = -1
    log_prob: int = -1
    log_prob_sum: int = -1

    def __post_init__(self) -> None:
        if self.operand_dtype not in OPERAND_TYPES:
            raise ValueError(f"LM head operands of type {self.operand_dtype}")
        if min(self.rows, self.vocab, self.hidden) < 1:
            raise ValueError("LM head dims must be positive")

    # --- the first-GEMM interface of the chain kernels' layouts ---------------------------
    @property
    def m(self) -> int:
        return self.rows

    @property
    def n(self) -> int:
        return self.vocab

    @property
    def k(self) -> int:
        return self.hidden

    @property
    def batch(self) -> int:
        return 1

    @property
    def a(self) -> OperandView:
        return self.hidden_view

    @property
    def b(self) -> OperandView:
        return self.embedding_view

    @property
    def inputs(self) -> tuple[int, int, int]:
        """Node ids the kernel reads, in param order."""
        return (self.hidden_view.node, self.embedding_view.node, self.labels)


def row_major_views(hidden: int, embedding: int, rows: int, vocab: int,
                    depth: int) -> tuple[OperandView, OperandView]:
    """H [rows, depth] and E [vocab, depth], both row-major, as the GEMM's [1, rows, depth]
    and [1, depth, vocab] operands."""
    return (OperandView(hidden, rows * depth, depth, 1),
            OperandView(embedding, vocab * depth, 1, depth))


# ----------------------------------------------------------------------------- recognition
#
# From the logits GEMM down, every op is read as a value of one of these kinds (a small
# symbolic interpretation): a logits tile plus a row offset (``_Tile``, exp'ed or not), a
# row value (``_Row``: a sum of the row atoms max, logz and picked), a row value
# broadcast over the vocabulary (``_Spread``), a row value summed over the rows
# (``_Total``: the loss before its mean), a scalar constant, the labels (``_Label``,
# wrapped as jax wraps negative ones) and jax's in-range test of them (``_InRange``). An op
# that reads a tile or an unfinished row value and is not read this way takes the value
# outside the site (``LossSite.escapes``: the backward of a training step reads them).


@dataclass(frozen=True)
class _Row:
    terms: tuple[tuple[str, float], ...]      # sorted (atom, coefficient)
    nan_outside: bool = False                 # NaN where the label is outside the vocabulary

    def plus(self, other: "_Row", sign: float = 1.0) -> "_Row":
        total: dict[str, float] = dict(self.terms)
        for atom, c in other.terms:
            total[atom] = total.get(atom, 0.0) + sign * c
        return _Row(tuple(sorted((a, c) for a, c in total.items() if c)),
                    self.nan_outside or other.nan_outside)


_ZERO = _Row(())
_LSE = _Row((("logz", 1.0), ("max", 1.0)))
_RESULT_FORMS = {"log_prob": _Row((("logz", -1.0), ("max", -1.0), ("picked", 1.0)), True),
                 "lse": _LSE, "picked": _Row((("picked", 1.0),), True)}


@dataclass(frozen=True)
class _Total:
    """The sum over all rows of a row value (one f32)."""
    row: _Row


@dataclass(frozen=True)
class _Tile:
    offset: _Row
    exp: bool = False


@dataclass(frozen=True)
class _Padded:
    """A tile padded at the vocabulary's end with ``value`` to ``width`` columns; ``split``:
    renamed as [rows, parts, width / parts] (XLA's split row reduction)."""
    tile: _Tile
    value: float
    width: int
    split: bool = False


@dataclass(frozen=True)
class _Partial:
    """A split row reduction's partials over the vocabulary (``kind``: the combiner)."""
    tile: _Tile
    kind: str


@dataclass(frozen=True)
class _Spread:
    row: "_Row | str"


@dataclass(frozen=True)
class _Const:
    value: float


@dataclass(frozen=True)
class _Label:
    wrapped: bool


@dataclass(frozen=True)
class _InRange:
    pass


# The initial values the row reductions must start from (their combiner's identity).
_IDENTITIES = {"maximum": float("-inf"), "add": 0.0}
# How far, and over values of how many elements per row, the walk pulls in operands.
_DEMAND_DEPTH = 12
_SMALL_ROWS = 4
_SUM_OF_EXP = "sum_of_exp"     # sum over the vocabulary of exp(logits - max): only log reads it


@dataclass(frozen=True)
class LossSite:
    """A recognized LM head + cross-entropy: the description (``loss``, with the row results
    the site's readers take), its op-graph members, and the members whose values other ops
    read beyond the per-row results (empty: the site can be one kernel)."""
    loss: LmHeadLoss
    members: tuple[int, ...]
    escapes: tuple[int, ...]


def find_lm_head_losses(graph) -> list[LossSite]:
    """Every LM head + softmax cross-entropy of ``graph`` in the form XLA GPU's optimized
    module (and jax's ``log_softmax`` + ``take_along_axis``) gives it; sites that do not
    read as one are left out (debug log says why)."""
    sites = []
    for node in graph.nodes:
        if node.op_class.value != "compute":
            continue
        try:
            site = _site(graph, node)
        except _NotASite as why:
            log.debug("%s: no LM head loss: %s", node.name, why)
            continue
        if site is not None:
            sites.append(site)
    return sites


class _NotASite(Exception):
    pass


def _elements(node) -> int:
    return node.shape.num_elements if node.shape.is_array else -1


def _row_major(shape) -> bool:
    return shape.is_array and shape.minor_to_major() == tuple(range(shape.rank - 1, -1, -1))


def _through_aliases(graph, v: int) -> int:
    """The node whose row-major buffer ``v`` relabels (bitcasts, row-major reshapes)."""
    node = graph.nodes[v]
    while node.opcode in ("bitcast", "reshape") and _row_major(node.shape) and \
            _row_major(graph.nodes[node.operands[0]].shape):
        node = graph.nodes[node.operands[0]]
    return node.id


def _gemm(graph, node):
    """(dot, lhs node, rhs node) of a GEMM node computing lhs [R, D] x rhs [V, D]^T: a plain
    dot, or a GEMM fusion whose body is that dot on its two parameters."""
    if node.opcode == "dot":
        dot, (lhs, rhs) = node.instruction, node.operands[:2]
    else:
        names = node.instruction.called_computations
        comp = graph.computations.get(names[0]) if len(names) == 1 else None
        if comp is None or len(comp.instructions) != 3:
            raise _NotASite("a GEMM fusion with more than its dot (a prologue or epilogue)")
        by_name = {i.name: i for i in comp.instructions}
        dot = next((i for i in comp.instructions if i.opcode == "dot"), None)
        if dot is None or any(by_name[o].opcode != "parameter" for o in dot.operands):
            raise _NotASite("the fusion's dot does not read its parameters directly")
        lhs, rhs = (node.operands[by_name[o].parameter_number] for o in dot.operands[:2])
    if dot.ints("lhs_batch_dims", ()) or dot.ints("rhs_batch_dims", ()) or \
            dot.ints("lhs_contracting_dims") != (1,) or dot.ints("rhs_contracting_dims") != (1,):
        raise _NotASite("not an [R, D] x [V, D]^T dot")
    a, b = graph.nodes[lhs].shape, graph.nodes[rhs].shape
    if a.rank != 2 or b.rank != 2 or not (_row_major(a) and _row_major(b)) or \
            not _row_major(node.shape) or node.shape.rank != 2:
        raise _NotASite("operands or result not row-major matrices")
    return dot, lhs, rhs


def _scalar_constant(graph, v: int) -> float | None:
    """The value of a scalar constant (through a broadcast of it)."""
    node = graph.nodes[v]
    if node.opcode == "broadcast" and graph.nodes[node.operands[0]].shape.rank == 0:
        node = graph.nodes[node.operands[0]]
    if node.opcode != "constant" or node.shape.rank != 0 or node.instruction.literal is None:
        return None
    dtype = {"f32": np.float32, "bf16": np.float32, "f16": np.float16, "s32": np.int32}.get(
        node.shape.element_type)
    if dtype is None:
        return None
    return float(literal_to_numpy(node.instruction.literal, node.shape, dtype).reshape(()))


class _Reader:
    """The symbolic interpretation of the ops below one logits GEMM (section comment)."""

    def __init__(self, graph, gemm: int, rows: int, vocab: int):
        self.graph = graph
        self.rows, self.vocab = rows, vocab
        self.values: dict[int, object] = {gemm: _Tile(_ZERO)}
        self.failed: set[int] = set()
        self.labels: int | None = None

    def kind(self, v: int) -> str:
        n = _elements(self.graph.nodes[v])
        return "tile" if n == self.rows * self.vocab else "row" if n == self.rows else \
            "scalar" if n == 1 else "other"

    def value(self, v: int):
        got = self.values.get(v)
        if got is None:
            c = _scalar_constant(self.graph, v)
            if c is not None:
                return _Const(c)
        return got

    def read(self, node):
        """The value of ``node`` from its operands' values, or None (not part of a site)."""
        ops = [self.value(o) for o in node.operands]
        op = node.opcode
        if op in ("bitcast", "reshape", "copy") and len(ops) == 1 and ops[0] is not None:
            if not (_row_major(node.shape) and
                    _row_major(self.graph.nodes[node.operands[0]].shape)):
                return None
            dims = node.shape.dims
            if isinstance(ops[0], _Tile) and dims[-1] != self.vocab:
                return None         # the vocabulary no longer the minor dim
            if isinstance(ops[0], _Padded) and not ops[0].split:
                # XLA's split row reduction: [rows, parts, width / parts].
                if len(dims) >= 2 and dims[-2] * dims[-1] == ops[0].width and \
                        dims[-2] > 1 and math.prod(dims[:-2]) == self.rows:
                    return _Padded(ops[0].tile, ops[0].value, ops[0].width, True)
                return None
            if isinstance(ops[0], (_Padded, _Partial)) and node.shape.num_elements != \
                    self.graph.nodes[node.operands[0]].shape.num_elements:
                return None
            return ops[0]
        if op == "pad" and isinstance(ops[0], _Tile) and isinstance(ops[1], _Const):
            pads = parse_padding(node.instruction.attrs.get("padding", "{}"))
            if pads and all(p.low == 0 and p.interior == 0 for p in pads) and \
                    all(p.high == 0 for p in pads[:-1]) and pads[-1].high > 0:
                return _Padded(ops[0], ops[1].value, node.shape.dims[-1])
            return None
        if op == "convert" and isinstance(ops[0], _Tile) and \
                node.shape.element_type == "f32":
            return ops[0]
        if op == "broadcast" and isinstance(ops[0], _Row | str) and self.kind(node.id) == "tile":
            dims = node.instruction.ints("dimensions", ())
            if dims == tuple(range(node.shape.rank - 1)) and node.shape.dims[-1] == self.vocab:
                return _Spread(ops[0])
            return None
        if op == "reduce":
            return self.reduce(node, ops)
        if op == "subtract" and isinstance(ops[0], _Tile) and not ops[0].exp and \
                isinstance(ops[1], _Spread) and isinstance(ops[1].row, _Row):
            return _Tile(ops[0].offset.plus(ops[1].row, -1.0))
        if op in ("subtract", "add") and all(isinstance(x, _Row) for x in ops):
            return ops[0].plus(ops[1], -1.0 if op == "subtract" else 1.0)
        if op == "exponential" and isinstance(ops[0], _Tile) and not ops[0].exp:
            return _Tile(ops[0].offset, exp=True)
        if op == "log" and ops[0] == _SUM_OF_EXP:
            return _Row((("logz", 1.0),))
        if op == "gather":
            return self.gather(node, ops)
        if op == "select" and isinstance(ops[0], _InRange) and isinstance(ops[1], _Row) and \
                isinstance(ops[2], _Const) and ops[2].value != ops[2].value:
            return _Row(ops[1].terms, True)
        return self.label_op(node, ops)

    def reduce(self, node, ops):
        if len(ops) != 2 or not isinstance(ops[1], _Const):
            return None
        source = self.graph.nodes[node.operands[0]].shape
        names = node.instruction.called_computations
        comp = self.graph.computations.get(names[0]) if names else None
        kind = combiner_kind(comp) if comp is not None else None
        if isinstance(ops[0], _Row) and kind == "add" and ops[1].value == 0.0 and \
                node.instruction.ints("dimensions", ()) == tuple(range(source.rank)):
            return _Total(ops[0])
        if node.instruction.ints("dimensions", ()) != (source.rank - 1,):
            return None
        init = ops[1].value
        if kind not in _IDENTITIES or init != _IDENTITIES[kind]:
            return None
        if isinstance(ops[0], _Padded):
            # The partials of a split row reduction: the padding adds the identity.
            if not ops[0].split or ops[0].value != init:
                return None
            return _Partial(ops[0].tile, kind)
        if isinstance(ops[0], _Partial):
            if ops[0].kind != kind:
                return None
            tile = ops[0].tile
        elif isinstance(ops[0], _Tile) and source.dims[-1] == self.vocab:
            tile = ops[0]
        else:
            return None
        if kind == "maximum" and init == float("-inf") and not tile.exp:
            return tile.offset.plus(_Row((("max", 1.0),)))
        if kind == "add" and init == 0.0 and tile.exp and \
                tile.offset == _Row((("max", -1.0),)):
            return _SUM_OF_EXP
        return None

    def gather(self, node, ops):
        """The tile at each row's label: the index map proves the batch walks the rows
        (identity over every dim but the vocabulary), the vocabulary start is data — the
        labels, read through the concatenate XLA builds the index vectors with."""
        if not isinstance(ops[0], _Tile) or ops[0].exp:
            return None
        operand = self.graph.nodes[node.operands[0]].shape
        index = gather_index_map(self.graph, node.id)
        last = operand.rank - 1
        if index is None or not index.proved or sorted(index.identity) != list(range(last)) \
                or len(index.data) != 1 or index.data[0][0] != last or \
                any(w != 1 for w in index.window) or self.kind(node.id) != "row":
            return None
        component = index.data[0][1]
        concat = self.graph.nodes[_through_aliases(self.graph, node.operands[1])]
        if concat.opcode != "concatenate" or \
                concat.instruction.ints("dimensions") != (concat.shape.rank - 1,) or \
                any(self.graph.nodes[o].shape.dims[-1] != 1 for o in concat.operands):
            return None
        label = self.value(concat.operands[component])
        if not isinstance(label, _Label) or not label.wrapped:
            return None
        return ops[0].offset.plus(_Row((("picked", 1.0),)))

    def label_op(self, node, ops):
        """The labels, jax's wrap of negative ones (select(l < 0, l + V, l)) and its in-range
        test (and(l >= 0, l <= V - 1))."""
        op = node.opcode
        if op == "compare":
            direction = node.instruction.string("direction")
            a, b = ops
            if isinstance(a, _Label) and isinstance(b, _Const):
                return ("cmp", direction, b.value, a.wrapped)
            return None
        if op == "add" and isinstance(ops[0], _Label) and not ops[0].wrapped and \
                isinstance(ops[1], _Const) and ops[1].value == self.vocab:
            return ("shifted",)
        if op == "select" and ops[0] == ("cmp", "LT", 0.0, False) and \
                ops[1] == ("shifted",) and ops[2] == _Label(False):
            return _Label(True)
        if op == "and" and {ops[0], ops[1]} == {("cmp", "GE", 0.0, True),
                                                ("cmp", "LE", float(self.vocab - 1), True)}:
            return _InRange()
        return None

    def demand(self, v: int, depth: int) -> None:
        """Read ``v`` from its operands, read first the same way, when it is small (the
        labels' index computation: at most ``_SMALL_ROWS`` values a row) and within
        ``depth`` ops of a value the walk met; logits-sized values come only from the GEMM."""
        node = self.graph.nodes[v]
        if v in self.values or v in self.failed or depth <= 0 or \
                _elements(node) > _SMALL_ROWS * self.rows or self.value(v) is not None:
            return
        if node.op_class.value == "source":
            self.start_labels(v)
            return
        for o in node.operands:
            self.demand(o, depth - 1)
        got = self.read(node)
        if got is None:
            self.failed.add(v)
        else:
            self.values[v] = got

    def start_labels(self, v: int) -> None:
        node = self.graph.nodes[v]
        if node.shape.element_type == "s32" and _elements(node) == self.rows and \
                node.op_class.value == "source":
            if self.labels is not None and self.labels != v:
                raise _NotASite("two label arrays")
            self.labels = v
            self.values[v] = _Label(False)


def _site(graph, node) -> LossSite | None:
    dot, lhs, rhs = _gemm(graph, node)
    rows, vocab = node.shape.dims
    hidden = graph.nodes[lhs].shape.dims[1]
    if graph.nodes[rhs].shape.dims != (vocab, hidden):
        raise _NotASite("the right operand is not [vocab, hidden]")
    operand = graph.nodes[lhs].shape.element_type
    if operand not in OPERAND_TYPES or graph.nodes[rhs].shape.element_type != operand:
        raise _NotASite(f"operands of types {operand}")
    reader = _Reader(graph, node.id, rows, vocab)
    # Only the readers of values already read are tried, in topological order (node ids),
    # each pulling in its small operands not read yet (the labels' index computation): the
    # walk stays within the site, whatever the graph's size.
    waiting = list(graph.nodes[node.id].users)
    heapq.heapify(waiting)
    tried: set[int] = set()
    while waiting:
        v = heapq.heappop(waiting)
        if v in tried:
            continue
        tried.add(v)
        n = graph.nodes[v]
        for o in n.operands:
            reader.demand(o, _DEMAND_DEPTH)
        got = reader.read(n)
        if got is not None:
            reader.values[v] = got
            for u in n.users:
                if u not in tried:
                    heapq.heappush(waiting, u)
    members = sorted(v for v, x in reader.values.items() if v != reader.labels)
    inside = set(members)
    results: dict[str, int] = {}
    escapes: list[int] = []
    for v in members:
        value = reader.values[v]
        outside = [u for u in graph.nodes[v].users if u not in inside] or (
            [-1] if v in graph.outputs else [])
        if not outside or isinstance(value, (_Label, _InRange, tuple, _Const)):
            continue
        form = next((name for name, f in _RESULT_FORMS.items() if value == f), None)
        if value == _Total(_RESULT_FORMS["log_prob"]):
            form = "log_prob_sum"
        if form is not None and form not in results:
            results[form] = v
        else:
            escapes.append(v)
    if not results:
        raise _NotASite("no per-row result (log_prob, lse or picked) leaves the site")
    if reader.labels is None and "lse" not in results:
        raise _NotASite("no labels")
    hv = OperandView(_through_aliases(graph, lhs), rows * hidden, hidden, 1)
    ev = OperandView(_through_aliases(graph, rhs), vocab * hidden, 1, hidden)
    loss = LmHeadLoss(rows, vocab, hidden, hv, ev,
                      reader.labels if reader.labels is not None else -1, operand,
                      node.shape.element_type, allows_tf32(dot), **results)
    return LossSite(loss, tuple(members), tuple(escapes))

