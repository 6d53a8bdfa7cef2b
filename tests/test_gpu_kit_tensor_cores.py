"""The kit's ``tensor_cores`` step without a GPU: each kind of case at small sizes, its kernel
run by the host backend on the step's own inputs and checked by the step's own jax
reference (so a wrong input mapping or reference shows here, not on the device), the flop
counts against the pricing's, and the rehearsal's record."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from bench.gpu_kit import tensor_cores
from bench.gpu_kit.tensor_cores import Case, check_outputs
from bench.gpu_kit.tensor_flops import (attention_backward_flops, lm_head_backward_flops,
                                        rates, visited_elements)
from stitch.codegen.host import NUMPY_DTYPES, compile_host

SMALL = (
    Case("attention_bf16", "attention_backward", "bf16", False,
         {"batch": 2, "length": 48, "head_dim": 16, "causal": True}),
    Case("attention_f32", "attention_backward", "f32", False,
         {"batch": 2, "length": 40, "head_dim": 8, "causal": True}),
    Case("lm_head_bf16", "lm_head_backward", "bf16", False,
         {"rows": 32, "vocab": 72, "hidden": 16}),
)


def _host_outputs(built) -> dict:
    kernel = built.kernel
    ins = [np.ascontiguousarray(built.inputs[p.name], NUMPY_DTYPES[p.dtype]).reshape(-1)
           for p in kernel.params if not p.is_output]
    outs = {p.name: np.full(p.size, np.nan, NUMPY_DTYPES[p.dtype])
            for p in kernel.params if p.is_output}
    compile_host(kernel, opt=0)(*ins, *outs.values())
    return {name: value.astype(np.float32) for name, value in outs.items()}


@pytest.mark.parametrize("case", SMALL, ids=[c.name for c in SMALL])
def test_case_kernel_matches_the_steps_reference(case: Case) -> None:
    built = tensor_cores.BUILDERS[case.kind](case, "sm_90")
    got = _host_outputs(built)
    result = check_outputs(built, got)
    assert result["correct"], result
    # The check can fail: a wrong output is reported as wrong.
    name = next(iter(got))
    got[name] = got[name] * 1.1
    assert not check_outputs(built, got)["correct"]


def test_chain_case_builds_at_real_size_and_maps_every_input() -> None:
    case = Case("chain", "gemm_chain", "f32", True, {"batch": 2, "length": 64, "head_dim": 64})
    built = tensor_cores.BUILDERS["gemm_chain"](case, "sm_90")
    assert built.unit == "tf32"
    assert {p.name for p in built.kernel.params if not p.is_output} == set(built.inputs)
    assert built.flops == 2 * 2 * 64 * 64 * 128


def test_attention_flops_equal_the_pricings_count_where_it_is_exact() -> None:
    # No mask, one head block: 9 GEMMs of 2 b m n d (attention_backward_jobs.kernel_cost).
    b, n, d = 3, 256, 64
    assert attention_backward_flops(b, n, d, False, 64, 16, 64) == 9 * 2 * b * n * n * d
    # A causal mask visits a little over half the tiles; two head blocks add S and dP.
    causal = attention_backward_flops(b, 1024, d, True, 64, 16, 64)
    assert 0.5 < causal / (9 * 2 * b * 1024 * 1024 * d) < 0.55
    assert attention_backward_flops(b, n, d, False, 64, 16, 32) == (
        2 * 12 * d + 6 * d) * b * n * n
    assert visited_elements(64, 32, 16, True, key_rows=False) == (2 + 4) * 32 * 16
    assert visited_elements(64, 32, 16, True, key_rows=True) == (4 + 2) * 32 * 16
    assert lm_head_backward_flops(10, 20, 30, 3) == 2 * 4 * 2 * 10 * 20 * 30


def test_rates_against_the_peak() -> None:
    got = rates(2e12, 1e6, 4e12)            # 2 TFLOP in 1 s on a 4 TFLOP/s unit
    assert math.isclose(got["tflops"], 2.0) and math.isclose(got["fraction_of_peak"], 0.5)
    assert rates(1.0, None, 1.0) == {"tflops": None, "fraction_of_peak": None}


def test_rehearsal_writes_a_skipped_record(tmp_path) -> None:
    assert tensor_cores.main(["--out", str(tmp_path), "--rehearse"]) == 0
    record = json.loads((tmp_path / "tensor_cores.json").read_text())
    assert record["kernels"] == [] and "no GPU" in record["skipped"]
