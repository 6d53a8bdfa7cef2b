"""The LM head + softmax cross-entropy forward kernel (``codegen/lm_head_loss.py``): per-row
lse and the label's logit from H, E and the labels, never the logits. Host-target runs with
fresh random inputs (labels at both vocabulary ends included) and NaN-poisoned outputs
against numpy in float64: f32 FMA 1e-4, TF32 tensor cores 1e-2, bf16 tensor cores 2e-2
against logits rounded to bf16 as XLA's bf16 GEMM writes them. PTX at GPT-2 small's size
assembled for sm_80 / sm_90 without spills."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from stitch.codegen.errors import CodegenError
from stitch.codegen.gemm_chain import ChainTiling
from stitch.codegen.host import NUMPY_DTYPES, compile_host
from stitch.codegen.lm_head_loss import default_tiling, lower_lm_head_loss
from stitch.hlo.lm_head_loss import LmHeadLoss, row_major_views

# No tile divides them.
ROWS, VOCAB, HIDDEN = 37, 101, 13
_FMA = ChainTiling(block_m=16, block_n=16, threads=32, thread_m=4, thread_n=2, block_k=4,
                   block_h=8)
_MMA = ChainTiling(block_m=16, block_n=16, threads=32, thread_m=1, thread_n=1, block_k=16,
                   block_h=8, mma=True)
_TF32 = replace(_MMA, block_k=8)



def ptxas_or_skip(arch: str) -> None:
    """Skip where ptxas for ``arch`` or libdevice is not installed."""
    from stitch.codegen.nvptx import default_libdevice_path
    from stitch.codegen.toolchain import ToolchainError, find_ptxas
    if default_libdevice_path() is None:
        pytest.skip("no libdevice")
    try:
        find_ptxas(arch)
    except ToolchainError:
        pytest.skip(f"no ptxas for {arch}")

def _loss(dtype: str = "f32", rows: int = ROWS, vocab: int = VOCAB, hidden: int = HIDDEN,
          tf32: bool = False, log_prob: bool = False, total: bool = False) -> LmHeadLoss:
    hv, ev = row_major_views(0, 1, rows, vocab, hidden)
    return LmHeadLoss(rows, vocab, hidden, hv, ev, labels=2, operand_dtype=dtype,
                      logits_dtype=dtype, tf32=tf32, lse=3, picked=4,
                      log_prob=5 if log_prob else -1, log_prob_sum=6 if total else -1)


def _run(loss: LmHeadLoss, tiling: ChainTiling | None, seed: int, tol: float,
         labels: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The kernel's results against numpy's (logits in float64 from the operands as stored,
    rounded to the logits' type; labels as jax's take_along_axis reads them: negative ones
    from the end, NaN outside); the outputs poisoned with +inf first (a NaN result is
    expected of labels outside the vocabulary)."""
    rng = np.random.default_rng(seed)
    lowered = lower_lm_head_loss(loss, tiling)
    params = lowered.kernel.params
    h = rng.standard_normal((loss.rows, loss.hidden)).astype(NUMPY_DTYPES[params[0].dtype])
    e = rng.standard_normal((loss.vocab, loss.hidden)).astype(NUMPY_DTYPES[params[1].dtype])
    if labels is None:
        labels = rng.integers(0, loss.vocab, loss.rows).astype(np.int32)
        labels[:2] = (0, loss.vocab - 1)
    outs = [np.full(p.size, np.inf, np.float32) for p in params if p.is_output]
    compile_host(lowered.kernel)(h.reshape(-1), e.reshape(-1), labels, *outs)
    logits = h.astype(np.float64) @ e.astype(np.float64).T
    if loss.logits_dtype != "f32":
        logits = logits.astype(NUMPY_DTYPES[loss.logits_dtype]).astype(np.float64)
    top = logits.max(axis=1)
    lse = top + np.log(np.exp(logits - top[:, None]).sum(axis=1))
    wrapped = np.where(labels < 0, labels + loss.vocab, labels)
    inside = (wrapped >= 0) & (wrapped < loss.vocab)
    picked = np.where(inside, logits[np.arange(loss.rows), np.clip(wrapped, 0, loss.vocab - 1)],
                      np.nan)
    want = {"lse": lse, "picked": picked, "log_prob": picked - lse,
            "log_prob_sum": np.array([(picked - lse).sum()])}
    names = [w for w in ("lse", "picked", "log_prob", "log_prob_sum") if getattr(loss, w) >= 0]
    assert len(names) == len(outs) == len(lowered.outputs)
    for name, got in zip(names, outs):
        np.testing.assert_allclose(got, want[name], rtol=tol, atol=tol, err_msg=name)
    return dict(zip(names, outs))


@pytest.mark.parametrize("tiling", (_FMA, replace(_FMA, n_split=3), None),
                         ids=("partial", "split", "default"))
def test_f32_lse_and_label_logit(tiling) -> None:
    _run(_loss(), tiling, seed=31, tol=1e-4)


@pytest.mark.parametrize("tiling", (_MMA, replace(_MMA, n_split=4)), ids=("one", "split"))
def test_bf16_on_tensor_cores(tiling) -> None:
    _run(_loss("bf16"), tiling, seed=32, tol=2e-2)


def test_f32_on_tf32_tensor_cores() -> None:
    _run(_loss(tf32=True), _TF32, seed=33, tol=1e-2)


def test_a_split_with_no_vocabulary_left_adds_nothing() -> None:
    """101 columns are 7 steps of 16; 5 splits take 2 steps each, so the last split's share
    is empty (its max stays -inf and weighs 0 in the combine)."""
    _run(_loss(), replace(_FMA, n_split=5), seed=34, tol=1e-4)


@pytest.mark.parametrize("tiling", (_FMA, replace(_FMA, n_split=3)), ids=("one", "split"))
def test_labels_as_jax_take_along_axis_reads_them(tiling) -> None:
    """-1 is the last column; labels outside the vocabulary after that pick NaN (and give a
    NaN log_prob), as jax's take_along_axis fills."""
    rng = np.random.default_rng(35)
    labels = rng.integers(0, VOCAB, ROWS).astype(np.int32)
    labels[:4] = (-1, VOCAB, VOCAB + 5, -VOCAB - 1)
    got = _run(_loss(log_prob=True), tiling, seed=35, tol=1e-4, labels=labels)
    assert np.isnan(got["picked"][1:4]).all() and np.isnan(got["log_prob"][1:4]).all()
    assert np.isfinite(got["picked"][0]) and np.isfinite(got["lse"]).all()


def test_log_prob_alone() -> None:
    loss = replace(_loss(log_prob=True), lse=-1, picked=-1)
    assert lower_lm_head_loss(loss, _FMA).outputs == [5]
    _run(loss, _FMA, seed=37, tol=1e-4)


@pytest.mark.parametrize("loss,tiling", [
    (_loss(total=True), _FMA), (_loss(total=True), replace(_FMA, n_split=3)),
    (_loss(total=True), None), (_loss("bf16", total=True), _MMA),
    (replace(_loss(total=True), lse=-1, picked=-1), replace(_FMA, threads=64, block_m=32)),
], ids=("fma", "split", "default", "bf16-mma", "sum-alone"))
def test_log_prob_summed_over_the_rows(loss: LmHeadLoss, tiling) -> None:
    """The loss before its mean (XLA's reduce over the rows): one f32, block 0 adding the
    rows' values after a grid barrier."""
    got = _run(loss, tiling, seed=38, tol=1e-4 if loss.operand_dtype == "f32" else 2e-2)
    assert got["log_prob_sum"].shape == (1,)


def test_the_kernel_has_no_logits_sized_buffer() -> None:
    """Params H, E, labels, lse, picked; shared tiles and scratch are tile- or row-sized:
    nothing holds rows x vocab values."""
    loss = _loss(rows=512, vocab=4000, hidden=64)
    for tiling in (default_tiling(loss), default_tiling(loss, n_split=4)):
        kernel = lower_lm_head_loss(loss, tiling).kernel
        sizes = [b.size for b in kernel.buffers.values()]
        assert max(sizes) == loss.vocab * loss.hidden
        assert [p.size for p in kernel.params] == [512 * 64, 4000 * 64, 512, 512, 512]
    with pytest.raises(CodegenError, match="none of"):
        lower_lm_head_loss(replace(loss, lse=-1, picked=-1), _FMA)


def test_refusals() -> None:
    with pytest.raises(CodegenError, match="sm_80"):
        lower_lm_head_loss(_loss("bf16"), _MMA, arch="sm_70")
    with pytest.raises(CodegenError, match="TF32"):
        lower_lm_head_loss(_loss(tf32=False), _TF32)
    with pytest.raises(CodegenError, match="warp columns"):
        lower_lm_head_loss(_loss("bf16"), replace(_MMA, block_n=32, threads=64))


@pytest.mark.parametrize("arch", ("sm_80", "sm_90"))
@pytest.mark.parametrize("dtype", ("f32", "tf32", "bf16"))
@pytest.mark.parametrize("n_split", (1, 8))
def test_gpt2_sized_ptx_assembles_without_spills(dtype: str, arch: str, n_split: int) -> None:
    """GPT-2 small's LM head (8192 tokens, vocab 50257, 768 wide) with the default tiles."""
    from stitch.codegen.nvptx import emit_ptx
    from stitch.codegen.toolchain import assemble
    ptxas_or_skip(arch)
    loss = _loss("f32" if dtype == "tf32" else dtype, 8192, 50257, 768, tf32=True)
    tiling = default_tiling(loss, arch, allow_tf32=dtype == "tf32", n_split=n_split)
    assert tiling.mma == (dtype != "f32")
    kernel = lower_lm_head_loss(loss, tiling, name="lmh", arch=arch).kernel
    report = assemble(emit_ptx(kernel, arch), arch, kernel_name="lmh")["lmh"]
    assert report.spill_store_bytes == 0 and report.spill_load_bytes == 0, report
    assert 0 < report.registers <= 255


def test_priced_with_the_gemm_tile_model_and_built_as_priced() -> None:
    """cost/lm_head_pricing: the chain search's best buildable schedule, XLA's GEMM plus one
    read of the logits against it; the schedule's tiling lowers and computes the loss."""
    from stitch.codegen.lm_head_loss import tiling_from_schedule
    from stitch.cost import get_spec
    from stitch.pricing.lm_head_pricing import builds, loss_price
    loss = _loss("bf16", rows=256, vocab=1000, hidden=64)
    price = loss_price(get_spec("h100"), loss, grid_sync=True)
    assert builds(price.schedule) and price.schedule.mma
    assert price.logits_bytes == 4 * 256 * 1000
    assert price.stitched.seconds > 0 and price.xla_s > 0
    assert price.wins == (price.stitched.seconds < price.xla_s)
    _run(loss, tiling_from_schedule(price.schedule), seed=36, tol=2e-2)


def test_full_precision_f32_is_priced_on_the_fma_lanes() -> None:
    """A dot asking for full f32 precision (no TF32): the search keeps FMA schedules."""
    from stitch.cost import get_spec
    from stitch.pricing.lm_head_pricing import loss_price
    price = loss_price(get_spec("h100"), _loss("f32", rows=300, vocab=1000, hidden=64))
    assert not price.schedule.mma


def test_gpt2_sized_priced_schedule_is_spill_free(target: str = "h100",
                                                  arch: str = "sm_90") -> None:
    """GPT-2 small in bf16, vocabulary split allowed: ptxas strikes the schedules that spill
    (512 threads leave 128 registers), the one kept assembles without spills."""
    from stitch.codegen.lm_head_loss import tiling_from_schedule
    from stitch.codegen.nvptx import emit_ptx
    from stitch.codegen.toolchain import assemble
    from stitch.cost import get_spec
    from stitch.pricing.lm_head_pricing import loss_price
    ptxas_or_skip(arch)
    loss = _loss("bf16", 8192, 50257, 768)

    def report(schedule):
        kernel = lower_lm_head_loss(loss, tiling_from_schedule(schedule), name="lmh",
                                    arch=arch).kernel
        return assemble(emit_ptx(kernel, arch), arch, kernel_name="lmh")["lmh"]

    price = loss_price(get_spec(target), loss, grid_sync=True,
                       spills=lambda s: report(s).spill_store_bytes > 0)
    got = report(price.schedule)
    assert got.spill_store_bytes == 0 and got.spill_load_bytes == 0
