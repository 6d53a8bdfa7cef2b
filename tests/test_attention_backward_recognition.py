"""Attention's backward recognized in XLA's optimized module for an H100
(stitch/hlo/attention_backward.py; hlo_fixtures/data/attention_backward: the small causal
training step of tests/deviceless/test_training_attention.py, f32, as XLA compiled it),
and the two backward kernels fed from the match computing exactly what XLA's
instructions compute: the module evaluated by the reference evaluator on fresh random
inputs, the kernels run on the host from the same buffers (1e-4 of the largest
gradient), outputs poisoned."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from stitch.codegen.attention_backward import (DQ_INPUTS, DKV_OUTPUTS, STATS, dq_params,
                                               lower_dkv, lower_dq, problem_for)
from stitch.codegen.host import NUMPY_DTYPES, compile_host
from stitch.hlo.attention_backward import Strides, find_attention_backwards
from stitch.hlo.evaluator import evaluate
from stitch.hlo.evaluator.dtypes import numpy_dtype
from stitch.hlo.ir import Shape
from stitch.hlo.parser import parse_hlo
from hlo_fixtures import DATA

_STEP = DATA / "attention_backward" / "xla_h100_step_f32.hlo"


def _step(text: str | None = None):
    return parse_hlo(text if text is not None else _STEP.read_text())


def _with_outputs(module, names: list[str]):
    """The module with ``names`` (entry values) appended to its root tuple."""
    entry = module.entry
    by_name = entry.by_name()
    root = entry.root
    shapes = root.shape.tuple_shapes + tuple(by_name[n].shape for n in names)
    new_root = replace(root, operands=[*root.operands, *names],
                       shape=Shape("tuple", tuple_shapes=shapes))
    entry.instructions[entry.instructions.index(root)] = new_root
    return module, len(root.operands)


def test_the_step_s_backward_is_recognized() -> None:
    (match,) = find_attention_backwards(_step())
    assert (match.batch, match.queries, match.keys, match.head_dim) == (32, 256, 256, 64)
    assert match.causal and match.scale == 0.125 and match.dtype == "f32" and match.tf32
    assert (match.q, match.k, match.v, match.d_o) == (
        "bitcast.48.0", "bitcast.47.0", "bitcast.51.0", "bitcast.60.0")
    assert (match.d_probs, match.d_scores, match.dq, match.dk, match.dv) == (
        "gemm_fusion_dot.6", "fusion.22", "gemm_fusion_dot.7", "gemm_fusion_dot.8",
        "gemm_fusion_dot.9")
    assert (match.scores, match.row_sums, match.probs) == (
        "gemm_fusion_dot.4", "fusion.24", "fusion.18")
    row_major = Strides(256 * 64, 64, 1)
    assert dict(match.result_strides) == {"dq": row_major, "dk": row_major, "dv": row_major}


def _mutated(old: str, new: str) -> str:
    text = _STEP.read_text()
    assert old in text
    return text.replace(old, new)


@pytest.mark.parametrize("old,new", [
    # The gradient's row sum over the wrong value (dP instead of dP / L^2 * e).
    ("%reduce_sum.30.5 = f32[4,8,256]{2,1,0} reduce(%mul.17.5,",
     "%reduce_sum.30.5 = f32[4,8,256]{2,1,0} reduce(%mul.16.7,"),
    # A mask that is not causal (col >= row).
    ("%le.1.7 = pred[256,256]{1,0} compare(%iota.13, %iota.1.7), direction=LE",
     "%le.1.7 = pred[256,256]{1,0} compare(%iota.13, %iota.1.7), direction=GE"),
    # dQ's scale not the scores' scale.
    ("%constant_3 = f32[] constant(0.125)", "%constant_3 = f32[] constant(0.25)"),
    # dS read through a bitcast that moves elements (a transposing layout).
    ("%bitcast.64.0 = f32[32,256,256]{2,1,0} bitcast(%fusion.22)",
     "%bitcast.64.0 = f32[32,256,256]{1,2,0} bitcast(%fusion.22)"),
], ids=("reduced-value", "mask", "scale", "layout"))
def test_a_different_computation_is_not_recognized(old: str, new: str) -> None:
    assert find_attention_backwards(_step(_mutated(old, new))) == []


def test_kernels_from_the_match_compute_xlas_gradients() -> None:
    module = _step()
    (match,) = find_attention_backwards(module)
    module, first = _with_outputs(module, [match.d_o, match.dq, match.dk, match.dv])
    rng = np.random.default_rng(41)
    args = [rng.standard_normal(p.shape.dims).astype(numpy_dtype(p.shape.element_type))
            for p in module.entry.parameters]
    values = evaluate(module, args)
    by_param = {p.name: a for p, a in zip(module.entry.parameters, args)}
    d_o, *want = values[first:]
    # q, k, v are bitcasts of the parameters q.1, k.1, v.1 (row-major: the same buffer).
    buffers = {"q": by_param["q.1"].reshape(-1), "k": by_param["k.1"].reshape(-1),
               "v": by_param["v.1"].reshape(-1), "d_o": d_o.reshape(-1)}
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
        np.testing.assert_allclose(got, expected, rtol=1e-4,
                                   atol=1e-4 * np.abs(expected).max(), err_msg=name)
    assert set(STATS) <= set(buffers)
