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
chain kernels' thread layouts compute its logits tiles. Recognizing the site in XLA's
optimized module is not built yet: the description is made by its callers.
"""
from __future__ import annotations

from dataclasses import dataclass

from .gemm_chains import OperandView

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
    # Node ids of the per-row results the kernel writes (-1: not written).
    lse: int = -1
    picked: int = -1
    log_prob: int = -1

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
