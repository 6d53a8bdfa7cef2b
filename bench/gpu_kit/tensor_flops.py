"""What the ``tensor_cores`` step counts, with no device: the flops each timed kernel
executes (recomputation and the padded, masked tiles included: what the units do, not the
algorithm's minimum) and a timed row's rates against the target's peak
(``stitch.cost.gemm_rates.peak_flops``).

Attention backward (``stitch.codegen.attention_backward.lower_attention_backward``): per
head-dim block of ``block_h`` (``r`` = ceil(d / block_h) blocks), the dQ phase walks its
visited score tiles twice (statistics pass, then dQ), each time computing S and dP over the
whole head dim (4 d flops an element), and adds its dQ block (2 block_h); the dK/dV phase
computes S and dP once and adds dK and dV (4 block_h). With a causal mask a block visits
only the column steps its walk bounds give (``walk_bounds``): dQ's up to its last row,
dK/dV's from the step holding its first key. At r = 1 and half the tiles this is
``attention_backward_jobs.kernel_cost``'s 9 · 2 b m n d · share.

LM head backward (``lower_lm_head_backward``): each phase computes the logits
``recompute_factor`` times and one result GEMM: 2 (r + 1) · 2 rows · vocab · hidden, as
``lm_head_backward_price.kernel_cost`` counts. A GEMM chain (softmax(Q K^T) V): 2 b m n
(k + h).
"""
from __future__ import annotations


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def visited_elements(length: int, block_rows: int, block_cols: int, causal: bool,
                     key_rows: bool) -> int:
    """Score elements one batch entry's blocks of one phase compute (whole tiles)."""
    tiles = 0
    for r0 in range(0, length, block_rows):
        if not causal:
            tiles += _ceil(length, block_cols)
        elif key_rows:
            tiles += _ceil(length - (r0 // block_cols) * block_cols, block_cols)
        else:
            tiles += _ceil(min(r0 + block_rows, length), block_cols)
    return tiles * block_rows * block_cols


def attention_backward_flops(batch: int, length: int, head_dim: int, causal: bool,
                             block_rows: int, block_cols: int, block_h: int) -> float:
    """The two-phase attention backward kernel's flops (module docstring); square scores."""
    blocks = _ceil(head_dim, block_h)
    dq = visited_elements(length, block_rows, block_cols, causal, key_rows=False)
    dkv = visited_elements(length, block_rows, block_cols, causal, key_rows=True)
    per_batch = dq * (8 * head_dim * blocks + 2 * head_dim) \
        + dkv * (4 * head_dim * blocks + 4 * head_dim)
    return float(batch * per_batch)


def lm_head_backward_flops(rows: int, vocab: int, hidden: int, recompute: int) -> float:
    return float(2 * (recompute + 1) * 2 * rows * vocab * hidden)


def gemm_chain_flops(batch: int, m: int, n: int, k: int, h: int) -> float:
    return float(2 * batch * m * n * (k + h))


def rates(flops: float, us: float | None, peak_flops: float | None) -> dict:
    """Achieved TFLOP/s and the fraction of ``peak_flops`` (None where not timed)."""
    if not us or us <= 0:
        return {"tflops": None, "fraction_of_peak": None}
    achieved = flops / (us * 1e-6)
    return {"tflops": achieved / 1e12,
            "fraction_of_peak": achieved / peak_flops if peak_flops else None}
