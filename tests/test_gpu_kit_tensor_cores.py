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


class HostDriver:
    """``bench.cuda_driver.Driver``'s calls the step makes, on host memory: a launch runs
    the kernel through the host backend (every phase at once; the kernels rewrite all
    their outputs, so a second phase's launch repeats the same result)."""

    def __init__(self) -> None:
        self.kernels: dict = {}
        self.memory: dict[int, np.ndarray] = {}
        self.allocated = 0
        self.launches = 0

    def alloc(self, nbytes: int) -> int:
        self.allocated += 1
        pointer = self.allocated
        self.memory[pointer] = np.zeros(nbytes, np.uint8)
        return pointer

    def free(self, pointer: int) -> None:
        del self.memory[pointer]

    def to_device(self, pointer: int, host) -> None:
        self.memory[pointer][:] = np.ascontiguousarray(host).view(np.uint8).reshape(-1)

    def to_host(self, pointer: int, host) -> None:
        host[:] = self.memory[pointer]

    def fill(self, pointer: int, byte: int, nbytes: int) -> None:
        self.memory[pointer][:nbytes] = byte

    def load(self, image: bytes, entry: str):
        return entry

    def launch(self, function, grid, block, pointers, stream=None, **_) -> None:
        kernel, compiled = self.kernels[function]
        self.launches += 1
        compiled(*[self.memory[q].view(NUMPY_DTYPES[p.dtype])
                   for q, p in zip(pointers, kernel.params)])

    def synchronize(self) -> None:
        pass

    def stream(self):
        return None

    def event(self):
        return object()

    def record(self, event, stream) -> None:
        pass

    def elapsed_ms(self, start, end) -> float:
        return 2.0

    def capture(self, stream, body):
        return body

    def graph_launch(self, graph, stream) -> None:
        graph()


def test_run_case_end_to_end_on_host_memory(monkeypatch) -> None:
    """The step's device path (allocate, poison, launch per phase, read back, check, time,
    XLA's time, rates) with the driver on host memory and ptxas stubbed."""
    from types import SimpleNamespace

    from stitch.codegen import nvptx, toolchain
    from stitch.cost.gpu_specs import get_spec

    driver = HostDriver()
    monkeypatch.setattr(nvptx, "emit_ptx", lambda kernel, arch: "ptx")
    report = SimpleNamespace(registers=99, spill_store_bytes=0, spill_load_bytes=4)

    def assemble(ptx, arch, kernel_name):
        return b"cubin", {kernel_name: report}
    monkeypatch.setattr(toolchain, "assemble_cubin", assemble)
    builder = tensor_cores.BUILDERS["attention_backward"]

    def remembering(case, arch):
        built = builder(case, arch)
        driver.kernels[built.kernel.name] = (built.kernel, compile_host(built.kernel, opt=0))
        return built
    monkeypatch.setitem(tensor_cores.BUILDERS, "attention_backward", remembering)
    row = tensor_cores.run_case(SMALL[0], driver, "sm_90", get_spec("h200"))
    assert row["correct"] and row["launches"] == 2 and row["registers"] == 99
    assert row["spill_bytes"] == 4 and row["unit"] == "f16/bf16"
    assert row["us"] > 0 and row["xla_us"] > 0 and row["peak_tflops"] == pytest.approx(989.5)
    assert row["fraction_of_peak"] == pytest.approx(row["tflops"] / 989.5)
    assert driver.memory == {}                    # every buffer freed


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


# ------------------------------------------------------------------ ingest and calibration

def _tensor_rows() -> list[dict]:
    """A synthetic step result: two correct rows on the tensor cores, one wrong, one
    failed."""
    def row(name, kind, unit, us, fraction, correct=True):
        return {"name": name, "kind": kind, "dtype": "bf16", "unit": unit, "flops": 1e12,
                "us": us, "tflops": 1e12 / us / 1e6, "fraction_of_peak": fraction,
                "xla_us": 2 * us, "errors": {"dq": 1e-3 if correct else 0.5},
                "tolerance": 3e-2, "correct": correct, "registers": 160, "notes": "n"}
    return [row("attn", "attention_backward", "f16/bf16", 1000.0, 0.30),
            row("head", "lm_head_backward", "f16/bf16", 4000.0, 0.50),
            row("wrong", "attention_backward", "tf32", 10.0, 0.90, correct=False),
            {"name": "broken", "kind": "gemm_chain", "dtype": "f32", "error": "CudaError: x"}]


def test_ingest_tabulates_the_step_and_calibrates_only_correct_kernels(tmp_path) -> None:
    from bench.gpu_kit import ingest
    from stitch.cost.calibration import load_calibration
    from tests.test_gpu_kit import _gpu_results, _packed

    _gpu_results(tmp_path / "results")
    (tmp_path / "results" / "tensor_cores.json").write_text(json.dumps(
        {"device": "NVIDIA H200", "target": "h200", "kernels": _tensor_rows()}))
    results = _packed(tmp_path / "results", tmp_path / "returned")
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n")
    assert ingest.main([str(results), "--docs", str(docs), "--calibration-dir",
                        str(tmp_path / "cal")]) == 0
    text = docs.read_text()
    assert "| attn | f16/bf16 | 1000.0 | 1000.0 | 30% | 2000.0 | 2.00× | ok (1.0e-03, " \
        "tolerance 3e-02) | 160 | n |" in text
    assert "| wrong | tf32 |" in text and "WRONG (5.0e-01" in text
    assert "| broken | – |" in text and "CudaError: x" in text
    cal = load_calibration("h200", tmp_path / "cal")
    assert {e.name for e in cal.efficiencies} == {"attn", "head"}
    assert cal.efficiency("f16/bf16") == pytest.approx(0.40)       # median of both
    assert cal.efficiency("f16/bf16", "lm_head_backward") == pytest.approx(0.50)
    assert cal.efficiency("tf32") is None                          # the wrong one is not taken
    assert len(cal.samples) == 3                                   # the kernels step's too


def test_a_run_without_the_step_keeps_the_tables_efficiencies(tmp_path) -> None:
    from bench.gpu_kit import ingest
    from stitch.cost.calibration import load_calibration
    from tests.test_gpu_kit import _gpu_results, _packed

    _gpu_results(tmp_path / "first")
    (tmp_path / "first" / "tensor_cores.json").write_text(json.dumps(
        {"kernels": _tensor_rows()}))
    _gpu_results(tmp_path / "second")
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n")
    for name in ("first", "second"):
        results = _packed(tmp_path / name, tmp_path / f"{name}_returned")
        assert ingest.main([str(results), "--docs", str(docs), "--calibration-dir",
                            str(tmp_path / "cal")]) == 0
    assert load_calibration("h200", tmp_path / "cal").efficiency("f16/bf16") == \
        pytest.approx(0.40)


def test_kernel_efficiency_calibrated_where_measured_else_assumed(tmp_path, monkeypatch) -> None:
    from stitch.cost import calibration, mma_efficiency
    from stitch.cost.calibration import Calibration, KernelEfficiency, save_calibration
    from stitch.cost.gemm_rates import FP32, HALF, TF32

    monkeypatch.setattr(calibration, "CALIBRATION_DIR", tmp_path)
    mma_efficiency.forget_tables()
    try:
        assert mma_efficiency.kernel_efficiency("h200", HALF) == mma_efficiency.MMA_EFFICIENCY
        assert mma_efficiency.kernel_efficiency("h200", FP32) == mma_efficiency.FMA_EFFICIENCY
        save_calibration(Calibration("h200", "NVIDIA H200", "d", efficiencies=(
            KernelEfficiency("a", "attention_backward", HALF, 1e12, 1e3, 0.35, None),
            KernelEfficiency("l", "lm_head_backward", HALF, 1e12, 1e3, 0.45, None))), tmp_path)
        mma_efficiency.forget_tables()
        assert mma_efficiency.kernel_efficiency("H200", HALF) == pytest.approx(0.40)
        assert mma_efficiency.kernel_efficiency("h200", HALF, "lm_head_backward") == \
            pytest.approx(0.45)
        assert mma_efficiency.kernel_efficiency("h200", HALF, "gemm_chain") == \
            pytest.approx(0.40)
        assert mma_efficiency.kernel_efficiency("h200", TF32) == mma_efficiency.MMA_EFFICIENCY
        assert mma_efficiency.kernel_efficiency("h100", HALF) == mma_efficiency.MMA_EFFICIENCY
    finally:
        mma_efficiency.forget_tables()


def test_a_table_written_before_efficiencies_still_reads(tmp_path) -> None:
    from stitch.cost.calibration import load_calibration
    old = {"format": 1, "target": "h200", "device": "NVIDIA H200", "date": "d", "scale": 1.0,
           "rank_correlation": None, "median_relative_error": None,
           "kernels": [{"model": "m", "entry": "k", "modeled_us": 1.0, "measured_us": 2.0}]}
    (tmp_path / "h200.json").write_text(json.dumps(old))
    cal = load_calibration("h200", tmp_path)
    assert cal.efficiencies == () and cal.efficiency("tf32") is None and cal.scale == 2.0
