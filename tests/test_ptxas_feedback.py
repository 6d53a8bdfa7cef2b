"""ptxas feedback (stitch/schedule/ptxas_feedback.py): a built kernel's schedule re-tuned
with ptxas's register count, and rebuilt once when another schedule now wins.

The case that flips is constructed: a softmax f32[4096,128] on h100 whose model estimate
(38 registers) is far below what ptxas is made to report (4x the real count, ~100-150:
``Executable.ptxas`` wrapped), so the tuner's 64-thread, 4-wide schedule loses occupancy and a
32-thread one wins. The rebuilt kernel runs on the host with poisoned outputs on fresh
random inputs against the reference evaluator. A kernel whose estimate is exactly ptxas's
count keeps its schedule and is not rebuilt."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import stitch
from stitch.codegen import toolchain
from stitch.codegen.errors import ToolchainError
from stitch.hlo import evaluate, parse_hlo
from stitch import compiler
from stitch.cost.gpu_specs import get_spec
from stitch.schedule import schedule_kernel
from stitch.schedule.ptxas_feedback import revise
from stitch.schedule.tuner import schedule_signature
from tests.fixtures import REDUCERS


def _have_ptxas() -> bool:
    try:
        toolchain.find_ptxas(refresh=True)
        return True
    except ToolchainError:
        return False


needs_ptxas = pytest.mark.skipif(not _have_ptxas(), reason="no ptxas on this machine")

ROWS, COLS = 4096, 128
SOFTMAX = f"""HloModule softmax
{REDUCERS}
ENTRY e {{
  x = f32[{ROWS},{COLS}] parameter(0)
  ninf = f32[] constant(-inf)
  mx = f32[{ROWS}] reduce(x, ninf), dimensions={{1}}, to_apply=max
  mb = f32[{ROWS},{COLS}] broadcast(mx), dimensions={{0}}
  s = f32[{ROWS},{COLS}] subtract(x, mb)
  ex = f32[{ROWS},{COLS}] exponential(s)
  zero = f32[] constant(0)
  sm = f32[{ROWS}] reduce(ex, zero), dimensions={{1}}, to_apply=add
  sb = f32[{ROWS},{COLS}] broadcast(sm), dimensions={{0}}
  ROOT d = f32[{ROWS},{COLS}] divide(ex, sb)
}}
"""


def _only_kernel(plan):
    kernels = [k for g in plan.graphs for k in g.stitched.kernels if k.schedule is not None]
    assert len(kernels) == 1
    return plan.graphs[0].graph, kernels[0]


def _patch_ptxas(monkeypatch, registers) -> None:
    """Executable.ptxas reports ``registers(real report, kernel schedule estimate)``."""
    real = compiler.Executable.ptxas

    def fake(self, arch=None):
        estimates = {ck.name: self.plan.graphs[ck.graph_index] for ck in self.kernels}
        out = {}
        for name, report in real(self, arch).items():
            planned = [k for k in estimates[name].stitched.kernels
                       if k.name.replace(".", "_") == name]
            out[name] = dataclasses.replace(
                report, registers=registers(report, planned[0].schedule.regs_estimate))
        return out
    monkeypatch.setattr(compiler.Executable, "ptxas", fake)


def test_pinned_schedule_is_re_evaluated_as_tuned():
    plan = stitch.plan(SOFTMAX, "h100")
    graph, k = _only_kernel(plan)
    again = schedule_kernel(graph, k.members, get_spec("h100"), pin=k.schedule)
    assert schedule_signature(again) == schedule_signature(k.schedule)
    assert again.modeled_us == pytest.approx(k.schedule.modeled_us, rel=1e-9)
    assert again.regs_estimate == k.schedule.regs_estimate


def test_revise_keeps_a_schedule_whose_estimate_is_right():
    plan = stitch.plan(SOFTMAX, "h100")
    graph, k = _only_kernel(plan)
    rev = revise(graph, k.schedule, get_spec("h100"), k.schedule.regs_estimate)
    assert rev.scale == 1.0 and not rev.changed and rev.schedule is None
    assert rev.before_us == pytest.approx(k.schedule.modeled_us, rel=1e-9)


def test_revise_flips_when_ptxas_needs_far_more_registers():
    spec = get_spec("h100")
    plan = stitch.plan(SOFTMAX, "h100")
    graph, k = _only_kernel(plan)
    rev = revise(graph, k.schedule, spec, 4 * k.schedule.regs_estimate)
    assert rev.changed, rev
    assert schedule_signature(rev.schedule) != schedule_signature(k.schedule)
    assert rev.after_us < rev.before_us * 0.99
    # The built schedule at 4x its registers is slower than the model first said.
    assert rev.before_us > k.schedule.modeled_us
    # The winner's own registers were scaled the same way (4x its liveness estimate).
    plain = schedule_kernel(graph, k.members, spec, pin=rev.schedule)
    assert rev.schedule.regs_estimate >= 3 * plain.regs_estimate


@needs_ptxas
def test_compile_rebuilds_a_kernel_ptxas_says_needs_more_registers(monkeypatch, tmp_path):
    from stitch.codegen.cache import CompileCache

    _patch_ptxas(monkeypatch, lambda report, estimate: min(4 * estimate, 255))
    exe = compiler.compile(SOFTMAX, "h100", cache=CompileCache(tmp_path), poison_outputs=True,
                           ptxas_feedback=True)
    assert len(exe.ptxas_feedback) == 1
    rev = exe.ptxas_feedback[0]
    assert rev.changed and rev.rebuilt, rev
    assert rev.rebuilt_registers > 0
    assert rev.before != rev.after
    _, k = _only_kernel(exe.plan)
    assert k.schedule is rev.schedule            # the plan carries the rebuilt schedule
    (ck,) = exe.kernels
    assert ck.kernel.block == rev.schedule.block  # and the kernel was lowered from it
    assert set(exe.ptx) == {ck.name}
    rng = np.random.default_rng(19)
    x = (rng.standard_normal((ROWS, COLS)) * 2).astype(np.float32)
    (got,) = exe(x)
    assert not np.isnan(got).any()
    (want,) = evaluate(parse_hlo(SOFTMAX), [x])
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err <= 1e-5, f"relative error {err:.2e}"


@needs_ptxas
def test_compile_keeps_a_kernel_whose_estimate_is_right(monkeypatch, tmp_path):
    from stitch.codegen.cache import CompileCache

    _patch_ptxas(monkeypatch, lambda report, estimate: estimate)
    first = compiler.compile(SOFTMAX, "h100", cache=CompileCache(tmp_path))
    built = first.kernels[0]
    exe = compiler.compile(SOFTMAX, "h100", cache=CompileCache(tmp_path), ptxas_feedback=True)
    (rev,) = exe.ptxas_feedback
    assert not rev.changed and not rev.rebuilt and rev.scale == 1.0
    (ck,) = exe.kernels
    assert ck.kernel.block == built.kernel.block
    _, k = _only_kernel(exe.plan)
    assert k.schedule.regs_estimate == rev.estimate


@needs_ptxas
def test_real_ptxas_counts_are_fed_back_once_per_kernel(tmp_path):
    """Without a patch: every kernel gets one revision with ptxas's own count."""
    from stitch.codegen.cache import CompileCache

    exe = compiler.compile(SOFTMAX, "h100", cache=CompileCache(tmp_path), ptxas_feedback=True)
    reports = exe.ptxas()
    assert [r.kernel for r in exe.ptxas_feedback] == [ck.name for ck in exe.kernels]
    for rev in exe.ptxas_feedback:
        assert rev.measured == reports[rev.kernel].registers > 0
        assert rev.rebuilt == rev.changed


@needs_ptxas
def test_bench_counts_revisions_per_target():
    import bench.codegen.schedule_feedback as bench

    rows, problems = bench.collect(["softmax"], ("h100",))
    assert not problems and rows
    assert all(r.target == "h100" and r.measured > 0 and r.estimate > 0 for r in rows)
    text = bench.markdown(rows, problems, "cmd", 1.0)
    assert f"| h100 | {len(rows)} |" in text
