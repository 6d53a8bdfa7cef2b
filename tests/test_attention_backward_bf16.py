"""Attention's backward of a bf16 training step recognized in XLA's optimized module for an
H100 (tests/data/attention_backward/xla_h100_step_bf16.hlo: the small causal step of
tests/deviceless/test_training_attention.py in bf16, as XLA compiled it): S, P, dP and dS
stored as bf16 with the softmax math in f32 between, and, as in GPT-2's full-size step,
the causal mask computed by a fusion of its own. The kernels fed from the match round
where XLA's module rounds, so they compute what the reference evaluator computes from the
module on fresh random inputs to bf16 accuracy (outputs poisoned)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from stitch.codegen.attention_backward import (DQ_INPUTS, DKV_OUTPUTS, dq_params,
                                               lower_dkv, lower_dq, problem_for)
from stitch.codegen.host import NUMPY_DTYPES, compile_host
from stitch.hlo_passes.attention_backward import find_attention_backwards
from stitch.hlo_passes.evaluator import evaluate
from stitch.hlo_passes.evaluator.dtypes import numpy_dtype
from stitch.hlo_passes.parser import parse_hlo

from .test_attention_backward_recognition import _with_outputs

_STEP = Path(__file__).parent / "data" / "attention_backward" / "xla_h100_step_bf16.hlo"
_MASK = re.compile(r"  (\S+) = pred\[256,256\]\{1,0\} compare\(\S+, \S+\), direction=LE\n")


def _mask_apart(text: str) -> str:
    """The step with the causal mask computed once by a fusion of its own and read by
    S's row-sum, P and dS fusions as a pred[256, 256] parameter (XLA's form at GPT-2's
    size)."""
    blocks = text.split("\n\n")
    callers = {}
    for i, block in enumerate(blocks):
        found = _MASK.search(block)
        if not found:
            continue
        name = block.split(" ", 1)[0]
        params = len(re.findall(r" parameter\(\d+\)", block))
        block = re.sub(r"  iota\S* = s32\[256,256\]\{1,0\} iota\(\), iota_dimension=\d\n", "",
                       block)
        blocks[i] = _MASK.sub(f"  {found.group(1)} = pred[256,256]{{1,0}} "
                              f"parameter({params})\n", block)
        callers[name] = True
    mask = ("fused_causal_mask {\n  iota.c1 = s32[256,256]{1,0} iota(), iota_dimension=1\n"
            "  iota.c0 = s32[256,256]{1,0} iota(), iota_dimension=0\n"
            "  ROOT le.c = pred[256,256]{1,0} compare(iota.c1, iota.c0), direction=LE\n}")
    entry = next(i for i, b in enumerate(blocks) if b.startswith("ENTRY"))
    lines = blocks[entry].split("\n")
    for j, line in enumerate(lines):
        called = re.search(r"calls=(\S+?),", line)
        if called and called.group(1) in callers:
            lines[j] = re.sub(r"fusion\(([^)]*)\)", r"fusion(\1, causal_mask)", line, count=1)
    lines.insert(1, "  causal_mask = pred[256,256]{1,0} fusion(), kind=kLoop, "
                    "calls=fused_causal_mask")
    blocks[entry] = "\n".join(lines)
    assert len(callers) == 3, callers
    return "\n\n".join([*blocks[:entry], mask, *blocks[entry:]])


def _step(mask_apart: bool):
    text = _STEP.read_text()
    return parse_hlo(_mask_apart(text) if mask_apart else text)


@pytest.mark.parametrize("mask_apart", [False, True], ids=("mask-fused", "mask-apart"))
def test_the_bf16_step_s_backward_is_recognized(mask_apart: bool) -> None:
    (match,) = find_attention_backwards(_step(mask_apart))
    assert (match.batch, match.queries, match.keys, match.head_dim) == (32, 256, 256, 64)
    assert match.causal and match.scale == 0.125
    assert match.dtype == "bf16" and match.intermediates == "bf16"
    assert (match.d_probs, match.d_scores, match.dq, match.dk, match.dv) == (
        "gemm_fusion_dot.6", "fusion.29", "gemm_fusion_dot.7", "gemm_fusion_dot.8",
        "gemm_fusion_dot.9")
    assert (match.scores, match.row_sums, match.probs) == (
        "gemm_fusion_dot.4", "fusion.28", "fusion.26")


@pytest.mark.parametrize("old,new", [
    # dS stored without rounding to bf16 first: bf16 arithmetic, not the form the kernels
    # round like.
    ("mul.20.5 = f32[4,8,256,256]{3,2,1,0} multiply(add_any.3.7, exp.1.15)\n"
     "  convert_element_type.11.3 = bf16[4,8,256,256]{3,2,1,0} convert(mul.20.5)",
     "mul.20.5 = f32[4,8,256,256]{3,2,1,0} multiply(add_any.3.7, exp.1.15)\n"
     "  convert_element_type.11.3 = bf16[4,8,256,256]{3,2,1,0} negate(select_n.0.13)"),
    # A mask that is not causal.
    ("le.1.7 = pred[256,256]{1,0} compare(iota.13, iota.1.7), direction=LE",
     "le.1.7 = pred[256,256]{1,0} compare(iota.13, iota.1.7), direction=GE"),
], ids=("unrounded", "mask"))
def test_a_different_bf16_computation_is_not_recognized(old: str, new: str) -> None:
    text = _STEP.read_text()
    assert old in text
    assert find_attention_backwards(parse_hlo(text.replace(old, new))) == []


def test_a_separate_mask_that_is_not_causal_is_not_recognized() -> None:
    text = _mask_apart(_STEP.read_text()).replace("compare(iota.c1, iota.c0), direction=LE",
                                                  "compare(iota.c1, iota.c0), direction=GE")
    assert find_attention_backwards(parse_hlo(text)) == []


def test_kernels_from_the_bf16_match_compute_xlas_gradients() -> None:
    module = _step(mask_apart=True)
    (match,) = find_attention_backwards(module)
    module, first = _with_outputs(module, [match.d_o, match.dq, match.dk, match.dv])
    rng = np.random.default_rng()
    # Scores of a few units (the softmax neither flat nor one-hot), fresh each run.
    args = [(rng.standard_normal(p.shape.dims) * (0.5 if p.name == "wo.1" else 1.5)).astype(
        numpy_dtype(p.shape.element_type)) for p in module.entry.parameters]
    values = evaluate(module, args)
    by_param = {p.name: a for p, a in zip(module.entry.parameters, args)}
    d_o, *want = values[first:]
    buffers = {"q": by_param["q.1"].reshape(-1), "k": by_param["k.1"].reshape(-1),
               "v": by_param["v.1"].reshape(-1), "d_o": np.asarray(d_o).reshape(-1)}
    problem = problem_for(match)
    dq_ins, dq_outs = dq_params(stats_pass=True)
    for kernel, ins, outs in ((lower_dq(problem, stats_pass=True), dq_ins, dq_outs),
                              (lower_dkv(problem), DQ_INPUTS, DKV_OUTPUTS)):
        args_k = [np.ascontiguousarray(buffers[p.name], NUMPY_DTYPES[p.dtype])
                  for p in kernel.params[:len(ins)]]
        results = [np.full(p.size, np.nan, NUMPY_DTYPES[p.dtype])
                   for p in kernel.params[len(ins):]]
        compile_host(kernel)(*args_k, *results)
        buffers.update(zip(outs, results))
    for name, expected in zip(("dq", "dk", "dv"), want):
        got = buffers[name].astype(np.float64)
        assert not np.isnan(got).any(), name
        expected = np.asarray(expected, np.float64).reshape(-1)
        # bf16 results (8 bits): XLA's roundings reproduced, only the sums' order differs,
        # so nearly every element is within one bf16 step (2^-8) of XLA's and all within
        # two (without the roundings: about half of them off by more than one step).
        np.testing.assert_allclose(got, expected, rtol=8e-3,
                                   atol=2e-3 * np.abs(expected).max(), err_msg=name)
        within_a_step = np.abs(got - expected) <= 2.0 ** -8 * np.abs(expected)
        assert within_a_step.mean() >= 0.9, (name, within_a_step.mean())
