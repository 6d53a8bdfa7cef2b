"""The LM head + softmax cross-entropy at GPT-2 small's size (8192 tokens, vocabulary 50257,
768 wide), modeled: the fused forward (``stitch.pricing.lm_head_pricing``: the chain search's
best schedule the loss kernel builds, struck by ptxas where it spills) against XLA's logits
GEMM plus one read of the logits; the backward's two GEMM chains in the recomputed form
(hlo_fixtures/lm_head_backward.py: dH over the vocabulary, dE over the tokens;
``chain_price``) against XLA's dlogits kernel (logits read, dlogits written, both f32) and
its two GEMMs; the two-phase backward kernel (``codegen.lm_head_backward``: dH and dE in
one launch, the logits tiles recomputed, no dlogits) priced as the attention backward is
(``pricing.lm_head_backward_price``), its registers from ptxas. A100 and H100, f32
(TF32) and bf16.

``python -m bench plans --part lm-head`` (about half a minute; ptxas where installed) writes
it into docs/benchmarks.md; ``python -m bench.plans.lm_head`` prints it. Modeled, not
measured on a device.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.report import publish
from stitch.codegen.lm_head_loss import lower_lm_head_loss, tiling_from_schedule
from stitch.cost import get_spec
from stitch.pricing.chain_pricing import chain_price
from stitch.cost.gemm_rates import FP32, precision_class
from stitch.cost.gemm_tile import LIBRARY_TILE, gemm_cost
from stitch.pricing.lm_head_pricing import loss_price
from stitch.codegen.lm_head_backward import LmHeadBackward, lower_lm_head_backward
from stitch.cost.mma_efficiency import kernel_efficiency
from stitch.pricing.lm_head_backward_price import backward_price
from stitch.hlo.gemm_chains import find_gemm_chains
from stitch.hlo.graph import build_op_graphs
from stitch.hlo.lm_head_loss import LmHeadLoss, row_major_views
from stitch.hlo.parser import parse_hlo
from hlo_fixtures.lm_head_backward import DE, DH, backward_text

SECTION = "bench-lm-head"
TOKENS, VOCAB, HIDDEN = 8192, 50257, 768
TARGETS = (("a100", "sm_80"), ("h100", "sm_90"))


def _spills(loss: LmHeadLoss, arch: str):
    """ptxas's spill verdict on a schedule (None where ptxas is missing)."""
    from stitch.codegen.nvptx import emit_ptx
    from stitch.codegen.toolchain import ToolchainError, assemble

    def check(schedule) -> bool:
        kernel = lower_lm_head_loss(loss, tiling_from_schedule(schedule), name="lmh",
                                    arch=arch).kernel
        report = assemble(emit_ptx(kernel, arch), arch, kernel_name="lmh")["lmh"]
        return report.spill_store_bytes + report.spill_load_bytes > 0
    try:
        from stitch.codegen.toolchain import find_ptxas
        find_ptxas(arch)
    except (ToolchainError, OSError):
        return None
    return check


def forward_rows() -> list[str]:
    out = []
    for target, arch in TARGETS:
        spec = get_spec(target)
        for dtype in ("f32", "bf16"):
            hv, ev = row_major_views(0, 1, TOKENS, VOCAB, HIDDEN)
            loss = LmHeadLoss(TOKENS, VOCAB, HIDDEN, hv, ev, 2, dtype, dtype, tf32=True,
                              log_prob=3)
            for split in (False, True):
                price = loss_price(spec, loss, grid_sync=split, spills=_spills(loss, arch))
                out.append(
                    f"| {target} | {dtype} | {'yes' if split else 'no'} | "
                    f"{price.schedule.text()} | {price.stitched.seconds * 1e3:.2f} | "
                    f"{price.stitched.hbm_bytes / 1e9:.2f} | {price.xla_s * 1e3:.2f} | "
                    f"{price.logits_bytes / 1e9:.2f} | {'stitch' if price.wins else 'XLA'} |")
    return out


def backward_rows() -> list[str]:
    out = []
    for target, _ in TARGETS:
        spec = get_spec(target)
        for dtype in ("f32", "bf16"):
            cells = []
            total = 0.0
            for form in (DH, DE):
                graph = build_op_graphs(parse_hlo(
                    backward_text(form, dtype, TOKENS, VOCAB, HIDDEN)))[0]
                (chain,) = find_gemm_chains(graph)
                price = chain_price(graph, chain, spec, tf32=True, grid_sync=True)
                total += price.cost.seconds
                cells.append(f"{price.cost.seconds * 1e3:.2f} ({price.schedule.text()})")
            size = 4 if dtype == "f32" else 2
            xla = (8.0 * TOKENS * VOCAB / spec.hbm_bandwidth
                   + gemm_cost(spec, 1, TOKENS, HIDDEN, VOCAB, LIBRARY_TILE, dtype, True,
                               size).seconds
                   + gemm_cost(spec, 1, VOCAB, HIDDEN, TOKENS, LIBRARY_TILE, dtype, True,
                               4).seconds)
            out.append(f"| {target} | {dtype} | {cells[0]} | {cells[1]} | "
                       f"{total * 1e3:.2f} | {xla * 1e3:.2f} |")
    return out


def _registers(problem: LmHeadBackward, arch: str) -> str:
    """ptxas's registers and spill bytes of the one-launch kernel ("-" without ptxas)."""
    from stitch.codegen.nvptx import emit_ptx
    from stitch.codegen.toolchain import ToolchainError, assemble, find_ptxas
    try:
        find_ptxas(arch)
    except (ToolchainError, OSError):
        return "-"
    kernel = lower_lm_head_backward(problem, name="bwd", arch=arch, allow_tf32=True)
    report = assemble(emit_ptx(kernel, arch), arch, kernel_name="bwd")["bwd"]
    return f"{report.registers} ({report.spill_store_bytes + report.spill_load_bytes} B)"


def kernel_rows() -> list[str]:
    out = []
    for target, arch in TARGETS:
        spec = get_spec(target)
        for dtype in ("f32", "bf16"):
            problem = LmHeadBackward(TOKENS, VOCAB, HIDDEN, dtype, dtype, tf32=True)
            price = backward_price(problem, spec, arch)
            t = price.tiling
            room = price.xla_s - spec.kernel_launch_overhead_s
            # The tensor-core efficiency at which the kernel's work takes XLA's time: at
            # its tiles, and were the logits computed once per phase.
            unit = precision_class(spec, (dtype,), True) if t.mma else FP32
            assumed = kernel_efficiency(target, unit, "lm_head_backward")
            even = assumed * price.kernel.compute_s / room
            once = even * 2 / (price.recompute + 1)
            out.append(f"| {target} | {dtype} | m{t.block_rows} n{t.block_cols} "
                       f"k{t.block_k} h{t.block_h} t{t.threads} | {price.recompute} | "
                       f"{_registers(problem, arch)} | {price.kernel.total_s * 1e3:.2f} | "
                       f"{price.xla_s * 1e3:.2f} | {even:.2f} / {once:.2f} |")
    return out


def section() -> str:
    start = time.perf_counter()
    forward, backward, kernel = forward_rows(), backward_rows(), kernel_rows()
    return "\n".join([
        f"GPT-2 small's LM head: {TOKENS} tokens, vocabulary {VOCAB}, {HIDDEN} wide; the "
        "logits are f32 [tokens, vocab] (1.65 GB). Forward: the fused kernel (logits tiles, "
        "online logsumexp, the label's logit; per-row results only) at the chain search's "
        "best schedule it builds without spills (vocabulary split across blocks where "
        "grid sync is allowed) against XLA's GEMM writing the logits plus one read of "
        "them (a lower bound: XLA's reductions read them two or three times).",
        "",
        "| target | type | vocab split | schedule | stitch ms | stitch HBM GB | XLA ≥ ms | "
        "logits GB | faster |",
        "|---|---|---|---|---|---|---|---|---|",
        *forward,
        "",
        "Backward in the recomputed form, the chain kernels at their best schedules: dH "
        "(rows tokens, n vocabulary, second GEMM 768 wide) and dE (rows vocabulary, n "
        "tokens) against XLA's dlogits kernel (logits read, dlogits written, f32, at HBM "
        "bandwidth) and its two GEMMs.",
        "",
        "| target | type | dH ms (schedule) | dE ms (schedule) | stitch ms | XLA ms |",
        "|---|---|---|---|---|---|",
        *backward,
        "",
        "The two-phase backward kernel (FlashAttention-2's backward shape: token rows walk "
        "the vocabulary for dH, vocabulary rows walk the tokens for dE, one launch, each "
        "logits tile recomputed from H and E, dS = (exp(S - lse) - onehot) g never "
        "stored) at its default tiles, priced as the attention backward "
        "(tensor cores at the efficiency `stitch.cost.mma_efficiency` gives: measured where the "
        "GPU kit calibrated the target, else 0.2 of their peak; each phase computes the "
        "logits once per result block of the 768-wide hidden dim and its result GEMM "
        "once) against the same XLA side. Break-even: the tensor-core efficiency at "
        "which its work takes XLA's time, at its tiles / were the logits computed once "
        "per phase.",
        "",
        "| target | type | tiles | logits per phase | registers (spills) | stitch ms | "
        "XLA ms | break-even efficiency |",
        "|---|---|---|---|---|---|---|---|",
        *kernel,
        "",
        f"({time.perf_counter() - start:.0f} s.)",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    publish(args.out, SECTION, section())


if __name__ == "__main__":
    main()
