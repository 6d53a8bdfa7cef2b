"""stitch.xla_pass.payback: on the GPU path a stitched kernel is built only when its modeled
saving per step repays its estimated build within STITCH_PAYBACK_STEPS steps; kernels of
one structure (built once) repay it together."""
from __future__ import annotations

import numpy as np
import pytest

from stitch.hlo import parse_hlo
from stitch.hlo.evaluator.interpreter import Evaluator
from stitch.xla_pass import pass_planning, payback, entry as xla_pass
from stitch.xla_pass.code_budget import statements
from stitch.pricing.delta import CostModel
from stitch.cost.gpu_specs import get_spec
from stitch.explorer.planner import ExplorerOptions, plan

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402


def test_a_kernel_is_unpaid_exactly_when_its_saving_repays_the_build_too_late():
    build = payback.estimated_build_s(500)
    assert build > payback.estimated_build_s(100) > payback.BUILD_S_PER_KERNEL
    gain = build / 1000.0                                # repays after 1,000 steps
    assert payback.unpaid("k", gain, 500, 1000) is None
    late = payback.unpaid("k", gain, 500, 999)
    assert late is not None and late.steps == pytest.approx(1000.0)
    assert "999" in late.reason(999) and payback.PAYBACK_ENV in late.reason(999)
    loss = payback.unpaid("k", -1e-6, 10, 10**12)
    assert loss is not None and loss.steps is None and "nothing" in loss.reason(10**12)


def _two_blocks(w1, w2, x):
    """The same layer-norm + tanh block twice: its kernels repeat, names aside."""
    def block(h, w):
        h = h @ w
        m = h.mean(-1, keepdims=True)
        v = ((h - m) ** 2).mean(-1, keepdims=True)
        return jnp.tanh((h - m) * jax.lax.rsqrt(v + 1e-5)) * 1.5 + h
    return block(block(x, w1), w2)


def _planned():
    rng = np.random.default_rng(7)
    args = (rng.standard_normal((128, 128), np.float32) * 0.1,
            rng.standard_normal((128, 128), np.float32) * 0.1,
            rng.standard_normal((64, 128), np.float32))
    module = parse_hlo(jax.jit(_two_blocks).lower(*args).compile().as_text())
    # No GEMM chains: the two blocks' kernels are the memory-intensive ones.
    return module, plan(module, "h100", options=ExplorerOptions(xla_units=True,
                                                                gemm_chains=False))


def test_gains_of_a_unit_plan_add_up_to_its_modeled_saving():
    module, fusion_plan = _planned()
    (gp,) = fusion_plan.graphs
    cost = CostModel(gp.graph, get_spec("h100"), gemm_chains=False)    # as planned
    total = sum(payback.modeled_gain_s(gp, frozenset(k.members), cost)
                for k in gp.stitched.kernels)
    assert total > 0
    assert total == pytest.approx(gp.baseline.objective_s - gp.stitched.objective_s,
                                  rel=1e-6)


def _lower_jobs(module, fusion_plan, monkeypatch, steps: str):
    monkeypatch.setenv(payback.PAYBACK_ENV, steps)
    request = xla_pass.PassRequest("two_blocks", "h100", "gpu", compile_only=True)
    report = xla_pass.PassReport(module.name, 0, 0, 0)
    submitted = []
    jobs = pass_planning._lower_jobs(request, report, fusion_plan, module, get_spec("h100"),
                                Evaluator(module), {}, lambda k, key=None: submitted.append(k))
    assert [j[3].kernel for j in jobs] == submitted
    return jobs, report


def _stitched(jobs):
    """The jobs of stitched (memory-intensive) kernels: GEMM chains are always built."""
    return [j for j in jobs if getattr(j[1], "kind", "fused") != "gemm_chain"]


def test_the_gpu_pass_leaves_kernels_that_do_not_pay_to_xla(monkeypatch):
    module, fusion_plan = _planned()
    every, report = _lower_jobs(module, fusion_plan, monkeypatch, "off")
    every = _stitched(every)
    assert len(every) >= 2 and not report.unpaid
    none, report = _lower_jobs(module, fusion_plan, monkeypatch, "1")
    assert not _stitched(none)
    assert sorted(u.name for u in report.unpaid) == sorted(j[1].name for j in every)
    assert all(name in dict(report.skipped) for name in (u.name for u in report.unpaid))


def test_copies_of_one_structure_repay_its_build_together(monkeypatch):
    from stitch.codegen.gpu_cache import structure_key
    module, fusion_plan = _planned()
    every, _ = _lower_jobs(module, fusion_plan, monkeypatch, "off")
    every = _stitched(every)
    (gp,) = fusion_plan.graphs
    cost = CostModel(gp.graph, get_spec("h100"), gemm_chains=False)
    by_key: dict[str, list] = {}
    for _, k, _, lowered in every:
        by_key.setdefault(structure_key(lowered.kernel), []).append((k, lowered))
    repeated = [group for group in by_key.values() if len(group) == 2]
    assert repeated, "the two blocks share no kernel structure"
    (k1, lowered), (k2, _) = repeated[0]
    gains = [payback.modeled_gain_s(gp, frozenset(k.members), cost) for k in (k1, k2)]
    build = payback.estimated_build_s(statements(lowered.kernel))
    # Steps between what both copies need together and what one needs alone.
    steps = int(build / sum(gains) * 1.1)
    assert steps < build / max(gains)
    jobs, report = _lower_jobs(module, fusion_plan, monkeypatch, str(steps))
    built = {j[1].name for j in jobs}
    assert {k1.name, k2.name} <= built, report.unpaid


def test_only_kernels_that_will_be_built_are_validated(monkeypatch):
    """Kernel.validate runs when a kernel is handed to the build, not as it is lowered: one
    payback leaves to XLA is never walked; one that fails the check stays with XLA, said
    in the report's fallbacks, and the others are still built."""
    from stitch.codegen import kir
    # Each kernel lowered on its own here (with reuse, a repeated kernel's lowering is
    # checked once: tests/test_lowering_reuse.py).
    monkeypatch.setattr(pass_planning, "REUSE_LOWERING", False)
    checked: list[str] = []
    run = kir.KernelChecker.run

    def counted(self):
        checked.append(self.k.name)
        return run(self)
    monkeypatch.setattr(kir.KernelChecker, "run", counted)
    module, fusion_plan = _planned()
    none, report = _lower_jobs(module, fusion_plan, monkeypatch, "1")
    assert not _stitched(none) and report.unpaid
    assert not checked
    every, report = _lower_jobs(module, fusion_plan, monkeypatch, "off")
    every = _stitched(every)
    assert sorted(checked) == sorted(j[3].kernel.name for j in every)

    checked.clear()
    first = every[0][3].kernel.name

    def broken(self):
        if self.k.name == first:
            self.fail("body", "planted lowering bug")
        return counted(self)
    monkeypatch.setattr(kir.KernelChecker, "run", broken)
    jobs, report = _lower_jobs(module, fusion_plan, monkeypatch, "off")
    assert first not in {j[3].kernel.name for j in jobs}
    assert any("planted lowering bug" in why for _, why in report.fallbacks)
    assert len(_stitched(jobs)) == len(every) - 1


def test_baseline_kernels_index_finds_what_a_scan_of_every_kernel_finds():
    """``BaselineKernels.inside`` / ``touching`` (an index by op) against the scan over
    every baseline kernel they replace: the same kernels in the same order, so the same
    sums to the last bit, on random kernels over random member sets (empty kernels too)."""
    from types import SimpleNamespace
    rng = np.random.default_rng()
    ops = 60
    kernels = [SimpleNamespace(members=tuple(int(v) for v in rng.choice(
        ops, size=int(rng.integers(0, 5)), replace=False)),
        cost=SimpleNamespace(total_s=float(rng.random()) * 1e-5)) for _ in range(80)]
    plan_ = SimpleNamespace(baseline=SimpleNamespace(kernels=kernels))
    index = payback.baseline_kernels(plan_)
    assert payback.baseline_kernels(plan_) is index             # kept for its graph
    for _ in range(200):
        members = frozenset(int(v) for v in rng.choice(ops, size=int(rng.integers(0, 25)),
                                                       replace=False))
        inside = [k for k in kernels if members.issuperset(k.members)]
        touching = [k for k in kernels if members & set(k.members)]
        assert index.inside(members) == inside
        assert index.touching(members) == touching
        assert sum(k.cost.total_s for k in index.inside(members)) == \
            sum(k.cost.total_s for k in inside)
    other = SimpleNamespace(baseline=SimpleNamespace(kernels=kernels[:10]))
    assert payback.baseline_kernels(other).kernels == kernels[:10]   # another graph: anew
