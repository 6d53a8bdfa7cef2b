"""The description of a GEMM chain (``stitch.hlo.gemm_chains``): the ``GemmChain``
the recognizer returns, its operand views, the program of element ops between the GEMMs and
the values also read outside; the softmax a program ends in.
"""
from __future__ import annotations

from dataclasses import dataclass

GEMM_DTYPES = frozenset({"f32", "bf16", "f16"})
# Element ops a chain program may hold (HLO opcodes; the lowering maps each).
ELEMENTWISE_OPS = frozenset({
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "power", "negate", "abs",
    "exponential", "exponential-minus-one", "log", "log-plus-one", "sqrt", "rsqrt", "tanh",
    "logistic", "erf", "sign", "floor", "ceil", "compare", "select", "clamp", "convert",
})
REDUCERS = frozenset({"add", "maximum", "minimum", "multiply"})
# Integer values an index computation may read from a buffer (labels spread over the tile).


class NotAChain(Exception):
    """Internal to the recognizer: why a candidate pair is not a chain (logged at debug)."""


@dataclass(frozen=True)
class OperandView:
    """A GEMM operand as a [batch, rows, cols] matrix over the row-major buffer of graph
    node ``node``: element (b, r, c) lies at flat offset
    ``b * batch_stride + r * row_stride + c * col_stride``."""
    node: int
    batch_stride: int
    row_stride: int
    col_stride: int
    # When b is not one strided run (heads x batch through a transpose, a mask broadcast
    # over heads): b's digits as (size, stride), major first; batch_stride is then 0.
    batch_dims: tuple[tuple[int, int], ...] = ()

    def batch_offset(self, b: int) -> int:
        """The offset of batch ``b`` (what lowerings compute with index arithmetic)."""
        if not self.batch_dims:
            return b * self.batch_stride
        offset = 0
        for size, stride in reversed(self.batch_dims):
            offset += (b % size) * stride
            b //= size
        return offset


@dataclass(frozen=True)
class ChainOp:
    """One element op of a chain program (see the module docstring).

    kind "acc": the first GEMM's sum at (b, m, n); "const": ``value``; "input": an outside
    value read through ``view`` (rows m, cols n; a row value has col_stride 0); "iota": an
    index XLA computes with iota (a causal mask's row / column), at (b, m, n)
    ``(view offset // period[0]) % period[1]`` (no buffer: the view's node is -1);
    "elementwise": HLO ``opcode`` over ``args`` (lower ranks broadcast: a row value is the
    same for every n); "reduce": ``opcode`` (the reducer) over n of ``args[0]`` starting
    from ``value``. ``dtype`` is the HLO element type of the result."""
    kind: str
    rank: str                       # "tile" | "row" | "scalar"
    dtype: str
    opcode: str = ""
    args: tuple[int, ...] = ()
    value: float = 0.0
    view: OperandView | None = None
    direction: str = ""             # compare's comparison_direction
    period: tuple[int, int] = ()    # iota: (stride, size) of its dim in the view's buffer


@dataclass(frozen=True)
class ChainOutput:
    """A value between the GEMMs that is also read outside the chain (a training step's
    backward reads the scores S, the softmax's row sums or P): the chain kernel writes it
    too. ``value``: its program index; ``view``: where element (b, m, n) (a row value: n = 0,
    col_stride 0) goes in the row-major buffer of graph node ``node``."""
    node: int
    value: int
    rank: str                       # "tile" | "row"
    dtype: str
    view: OperandView


@dataclass(frozen=True)
class GemmChain:
    members: tuple[int, ...]   # sorted op-graph node ids one chain kernel covers: both GEMM
                               # nodes, the memory-intensive ops between them, bitcasts, a
                               # split-K reduce of the second GEMM
    first: int                 # node id of the first GEMM (dot, GEMM fusion or cuBLAS call)
    second: int                # node id of the second GEMM
    batch: int                 # product of batch dims (heads x batch)
    m: int                     # rows of the first GEMM's result
    n: int                     # columns of the first GEMM = contraction of the second
    k: int                     # contraction of the first GEMM
    h: int                     # columns of the second GEMM's result
    operand_dtype: str         # HLO element type of the GEMM operands: "f32" | "bf16" | "f16"
    softmax: bool              # a row softmax (max, exp, sum, divide) over n sits between
    between: tuple[int, ...]   # ids of the memory-intensive ops between the two GEMMs
    inputs: tuple[int, ...]    # node ids (outside members) the kernel reads
    output: int                # the member node whose value leaves the kernel (chain result)
    # --- added by chaincg (defaults only): what the lowering needs ---------------------
    a: OperandView | None = None        # first GEMM lhs  [b, m, k]
    b: OperandView | None = None        # first GEMM rhs  [b, k, n]
    c: OperandView | None = None        # second GEMM rhs [b, n, h]
    out: OperandView | None = None      # the result      [b, m, h] over ``output``
    program: tuple[ChainOp, ...] = ()   # element ops from S to P (P is the last one)
    output_dtype: str = "f32"           # HLO element type of ``output``
    output_scale: float = 1.0           # the second GEMM's cuBLAS alpha
    # --- added by tf32 (default only) ----------------------------------------------------
    tf32: bool = False                  # both dots let f32 operands run as TF32 (no HIGHEST
                                        # operand precision, no algorithm but TF32's)
    # --- values also read outside (default only) -----------------------------------------
    extra_outputs: tuple[ChainOutput, ...] = ()



@dataclass(frozen=True)
class SoftmaxParts:
    """P = divide(E, sum_n E) with E = exp(X - max_n X): program indices of each part."""
    x: int
    row_max: int
    e: int
    row_sum: int
    p: int


def softmax_parts(program: tuple[ChainOp, ...], through_convert: bool = False
                  ) -> SoftmaxParts | None:
    """The row softmax the program ends in, or None (see ``SoftmaxParts``).
    ``through_convert``: also one whose P is converted last (bf16 attention's
    ``convert(divide(E, sum))``; ``p`` is then the divide)."""
    if not program:
        return None
    p = len(program) - 1
    last = program[p]
    if through_convert and last.kind == "elementwise" and last.opcode == "convert":
        p = last.args[0]
        last = program[p]
    if last.kind != "elementwise" or last.opcode != "divide":
        return None
    e, row_sum = last.args
    s = program[row_sum]
    if s.kind != "reduce" or s.opcode != "add" or s.args != (e,) or s.value != 0.0:
        return None
    ex = program[e]
    if ex.kind != "elementwise" or ex.opcode != "exponential":
        return None
    sub = program[ex.args[0]]
    if sub.kind != "elementwise" or sub.opcode != "subtract":
        return None
    x, row_max = sub.args
    mx = program[row_max]
    if mx.kind != "reduce" or mx.opcode != "maximum" or mx.args != (x,) \
            or mx.value != float("-inf"):
        return None
    if any(program[i].kind == "reduce" for i in program_ancestors(program, x)):
        return None
    return SoftmaxParts(x, row_max, e, row_sum, p)


def needs_row_pass(chain: GemmChain) -> bool:
    """Whether a tile value the kernel writes out needs a row reduction's final value (P of
    a training step's softmax): the kernel then computes the rows' statistics in a pass
    over n first and writes exact values in the second, instead of online-softmax running
    ones. Row values (the row sums) and tiles before the reductions (S) are exact in one
    pass: the online softmax's final max and sum are the rows' max and sum."""
    return any(out.rank == "tile" and any(
        chain.program[i].kind == "reduce" for i in program_ancestors(chain.program, out.value))
        for out in chain.extra_outputs)


def program_ancestors(program: tuple[ChainOp, ...], i: int) -> set[int]:
    seen: set[int] = set()
    stack = [i]
    while stack:
        j = stack.pop()
        if j not in seen:
            seen.add(j)
            stack.extend(program[j].args)
    return seen
