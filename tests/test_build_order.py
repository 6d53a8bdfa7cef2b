"""The pass lowers a graph's stitched kernels largest first (``pass_planning._largest_first``):
on the GPU each lowered kernel's PTX build starts at once, so the long builds start first
and the small ones fill the end, instead of a large kernel planned last building alone
while the other cores wait. The rewrite still places the kernels in plan order: the module
is the one lowering in plan order gives."""
from __future__ import annotations

import numpy as np
import pytest

from stitch.hlo import parse_hlo
from stitch.hlo.evaluator.interpreter import Evaluator
from stitch.xla_pass import pass_planning, payback, entry as xla_pass
from stitch.xla_pass.code_budget import estimated_statements
from stitch.cost.gpu_specs import get_spec
from stitch.explorer.planner import ExplorerOptions, plan

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402


def _small_then_large(x, w1, w2):
    """A softmax kernel (small) planned before a layer norm with a long elementwise tail."""
    g = jax.nn.softmax(x @ w1, axis=-1)
    h = g @ w2
    m = h.mean(-1, keepdims=True)
    v = ((h - m) ** 2).mean(-1, keepdims=True)
    h = jnp.tanh((h - m) * jax.lax.rsqrt(v + 1e-5)) * 1.5 + x
    return jnp.exp(h) * jnp.sin(h) + jnp.cos(h) * 2.0


def _module_text() -> str:
    rng = np.random.default_rng(11)
    args = [rng.standard_normal(s, np.float32) for s in ((64, 128), (128, 128), (128, 128))]
    return jax.jit(_small_then_large).lower(*args).compile().as_text()


OPTIONS = ExplorerOptions(xla_units=True, gemm_chains=False)


def _sizes(kernels) -> list[int]:
    return [estimated_statements(k.schedule) for k in kernels]


def _lower_for_gpu(module, fusion_plan):
    """The GPU pass's lowering of ``fusion_plan`` (compile-only): its report, jobs in
    lowering order and the kernels handed to the build, in order."""
    request = xla_pass.PassRequest("f", "h100", "gpu", compile_only=True)
    report = xla_pass.PassReport(module.name, 0, 0, 0)
    submitted = []
    jobs = pass_planning._lower_jobs(request, report, fusion_plan, module, get_spec("h100"),
                                Evaluator(module), {},
                                lambda kernel, key=None: submitted.append(kernel))
    return report, jobs, submitted


def test_kernels_are_submitted_largest_first(monkeypatch):
    monkeypatch.setenv(payback.PAYBACK_ENV, "off")
    module = parse_hlo(_module_text())
    fusion_plan = plan(module, "h100", options=OPTIONS)
    planned = [k for k in fusion_plan.kernels if getattr(k.schedule, "parts", None)]
    assert len(planned) >= 2
    assert _sizes(planned) != sorted(_sizes(planned), reverse=True), \
        "the plan is already largest first: this test would not see the order change"
    report, jobs, submitted = _lower_for_gpu(module, fusion_plan)
    assert [j[3].kernel for j in jobs] == submitted
    order = [j[1] for j in jobs]
    assert sorted(k.name for k in order) == sorted(k.name for k in planned)
    assert _sizes(order) == sorted(_sizes(planned), reverse=True)


def test_the_rewrite_is_the_plan_order_one(monkeypatch):
    text = _module_text()
    request = xla_pass.PassRequest("f", "h100", "cpu", options=OPTIONS, token="order")
    largest_first = xla_pass.stitch_module_text(text, request)
    report = request.report
    assert largest_first is not None and len(report.placed) >= 2
    plan_names = [k.name for k in report.plan.kernels]
    assert report.placed == sorted(report.placed, key=plan_names.index)

    monkeypatch.setattr(pass_planning, "_largest_first",               # plan order
                        lambda kernels, *args, **kwargs: list(kernels))
    again = xla_pass.PassRequest("f", "h100", "cpu", options=OPTIONS, token="order")
    assert xla_pass.stitch_module_text(text, again) == largest_first
    assert again.report.placed == report.placed


def _fake(name: str, members: int):
    from types import SimpleNamespace
    part = SimpleNamespace(vector_width=1, members=list(range(members)))
    return SimpleNamespace(name=name, schedule=SimpleNamespace(parts=[part]))


def test_likely_paid_kernels_lead_then_largest_first():
    """The first ``lead`` kernels are the largest of those payback is expected to build;
    the others keep their largest-first places (a misjudged kernel is not pushed to the
    end of the build)."""
    kernels = [_fake(n, m) for n, m in (("a", 10), ("b", 500), ("c", 300), ("d", 200),
                                         ("e", 400), ("f", 50))]
    paid = {"c", "d", "f"}
    order = pass_planning._largest_first(kernels, lambda k: k.name in paid, lead=2)
    assert [k.name for k in order] == ["c", "d", "b", "e", "f", "a"]
    assert [k.name for k in pass_planning._largest_first(kernels)] == ["b", "e", "c", "d", "f", "a"]
    assert [k.name for k in pass_planning._largest_first(kernels, lambda k: False, lead=2)] == \
        ["b", "e", "c", "d", "f", "a"]
    assert [k.name for k in pass_planning._largest_first(kernels, lambda k: True, lead=0)] == \
        ["b", "e", "c", "d", "f", "a"]


def test_the_gpu_pass_lowers_a_likely_paid_kernel_first(monkeypatch):
    """With payback on, the pass lowers (and so submits) first a kernel the estimate expects
    to be built, even where a larger kernel comes first largest first; that one is still
    lowered, and left to XLA."""
    from stitch.xla_pass import code_budget
    monkeypatch.delenv(payback.PAYBACK_ENV, raising=False)
    module = parse_hlo(_module_text())
    fusion_plan = plan(module, "h100", options=OPTIONS)
    planned = [k for k in fusion_plan.kernels if getattr(k.schedule, "parts", None)]
    largest = max(planned, key=lambda k: estimated_statements(k.schedule))
    # The largest never repays its build; the others as payback says (this module's do).
    monkeypatch.setattr(pass_planning, "build_threads", lambda: 1)
    real_unpaid = payback.unpaid
    monkeypatch.setattr(payback, "unpaid", lambda name, gain, size, limit: (
        payback.Unpaid(name, gain * 1e6, 1.0, 1e9) if name == largest.name
        else real_unpaid(name, gain, size, limit)))
    lowered = []
    real_lower = code_budget.lower_within_budget

    def recorded(graph, schedule, spec, name, lower, budget=None):
        lowered.append(name)
        return real_lower(graph, schedule, spec, name, lower, budget)
    monkeypatch.setattr(code_budget, "lower_within_budget", recorded)
    report, jobs, submitted = _lower_for_gpu(module, fusion_plan)
    assert sorted(lowered) == sorted(k.name for k in planned)
    assert lowered[0] != largest.name and lowered[1] == largest.name
    assert submitted == [j[3].kernel for j in jobs] and jobs[0][1].name == lowered[0]
    assert [u.name for u in report.unpaid] == [largest.name]
