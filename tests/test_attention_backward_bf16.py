"""Attention's backward of a bf16 training step recognized in XLA's optimized module for an
H100 (hlo_fixtures/data/attention_backward/xla_h100_step_bf16.hlo: the small causal step of
tests/deviceless/test_training_attention.py in bf16, as XLA compiled it): S, P, dP and dS
stored as bf16 with the softmax math in f32 between, and, as in GPT-2's full-size step,
the causal mask computed by a fusion of its own, and (as in the Llama-style step) Q and K
joined from halves that dQ's and dK's GEMMs read apart. The kernels fed from the match round
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
from stitch.hlo.attention_backward import find_attention_backwards
from stitch.hlo.evaluator import evaluate
from stitch.hlo.evaluator.dtypes import numpy_dtype
from stitch.hlo.parser import parse_hlo

from .test_attention_backward_recognition import _with_outputs
from hlo_fixtures import DATA

_STEP = DATA / "attention_backward" / "xla_h100_step_bf16.hlo"
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


def _halves_joined(text: str) -> str:
    """The step with Q and K each joined from two halves of the head dim by a fusion of
    their own (S reads the joined values) while dK's and dQ's GEMM fusions join the
    halves themselves (XLA's form of Llama's rotary Q and K)."""
    half = "bf16[4,8,256,32]{3,2,1,0}"
    joins, entry_lines = [], []
    for x, param, gemm, inner in (("q", "q.1", "gemm_fusion_dot.8", "parameter_1.6"),
                                  ("k", "k.1", "gemm_fusion_dot.7", "parameter_1.5")):
        joins.append(f"joined_{x} {{\n  {x}a = {half} parameter(0)\n  {x}b = {half} "
                     f"parameter(1)\n  ROOT {x}j = bf16[4,8,256,64]{{3,2,1,0}} "
                     f"concatenate({x}a, {x}b), dimensions={{3}}\n}}")
        old_inner = f"  {inner} = bf16[32,256,64]{{2,1,0}} parameter(1)\n"
        assert old_inner in text
        text = text.replace(old_inner, (
            f"  {x}pa = {half} parameter(1)\n  {x}pb = {half} parameter(2)\n"
            f"  {x}cat = bf16[4,8,256,64]{{3,2,1,0}} concatenate({x}pa, {x}pb), "
            f"dimensions={{3}}\n  {inner} = bf16[32,256,64]{{2,1,0}} bitcast({x}cat)\n"))
        read = "bitcast.49.0" if x == "q" else "bitcast.48.0"
        old_read = f"  {read} = bf16[32,256,64]{{2,1,0}} bitcast({param})\n"
        assert old_read in text
        text = text.replace(old_read, (
            f"  {x}_lo = {half} slice({param}), slice={{[0:4], [0:8], [0:256], [0:32]}}\n"
            f"  {x}_hi = {half} slice({param}), slice={{[0:4], [0:8], [0:256], [32:64]}}\n"
            f"  {x}_joined = bf16[4,8,256,64]{{3,2,1,0}} fusion({x}_lo, {x}_hi), kind=kLoop, "
            f"calls=joined_{x}\n  {read} = bf16[32,256,64]{{2,1,0}} bitcast({x}_joined)\n"))
        old_call = f"  {gemm} = bf16[32,256,64]{{2,1,0}} fusion(bitcast.67.0, {read})"
        assert old_call in text
        text = text.replace(old_call, f"  {gemm} = bf16[32,256,64]{{2,1,0}} "
                                      f"fusion(bitcast.67.0, {x}_lo, {x}_hi)")
    entry = text.index("\nENTRY")
    return text[:entry] + "\n\n" + "\n\n".join(joins) + "\n" + text[entry:]


def _step(mask_apart: bool, halves: bool = False):
    text = _STEP.read_text()
    text = _mask_apart(text) if mask_apart else text
    return parse_hlo(_halves_joined(text) if halves else text)


@pytest.mark.parametrize("mask_apart,halves", [(False, False), (True, False), (True, True)],
                         ids=("mask-fused", "mask-apart", "halves-joined"))
def test_the_bf16_step_s_backward_is_recognized(mask_apart: bool, halves: bool) -> None:
    (match,) = find_attention_backwards(_step(mask_apart, halves))
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


def test_halves_joined_in_another_order_are_not_recognized() -> None:
    text = _halves_joined(_STEP.read_text()).replace(
        "fusion(bitcast.67.0, k_lo, k_hi)", "fusion(bitcast.67.0, k_hi, k_lo)")
    assert find_attention_backwards(parse_hlo(text)) == []


def test_a_separate_mask_that_is_not_causal_is_not_recognized() -> None:
    text = _mask_apart(_STEP.read_text()).replace("compare(iota.c1, iota.c0), direction=LE",
                                                  "compare(iota.c1, iota.c0), direction=GE")
    assert find_attention_backwards(parse_hlo(text)) == []


def test_kernels_from_the_bf16_match_compute_xlas_gradients() -> None:
    module = _step(mask_apart=True, halves=True)
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
