"""The XLA pass prices the module it returns the way the planner prices XLA's, and says
what the plan lost on the way (stitch/xla_pass/delivered.py)."""
from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from tests.fixtures import compile_with_cpu_pass  # noqa: E402
from stitch.xla_pass.delivered import LoopCopy, price_delivery  # noqa: E402
from stitch.pricing.delta import copy_kernel_cost  # noqa: E402
from stitch.cost.gpu_specs import get_spec  # noqa: E402


def _rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _compile(fn, *args):
    return compile_with_cpu_pass(fn, *args)[0]


def _softmax_ln(x, w):
    y = jax.nn.softmax(jnp.tanh(x) * w, axis=-1)
    m = y.mean(-1, keepdims=True)
    v = ((y - m) ** 2).mean(-1, keepdims=True)
    return (y - m) * jax.lax.rsqrt(v + 1e-5)


def _scan_loss(w, xs):
    def cell(h, x):
        h = jnp.tanh(h @ w + x)
        return h, jax.nn.softmax(h, axis=-1)
    _, ys = jax.lax.scan(cell, jnp.zeros((8, 16), jnp.float32), xs)
    return jnp.sum(ys * xs)


def _independent_price(report, copies=()):
    """The final module's memory-intensive µs summed here from the plan: every placed
    kernel at its planned price, XLA's kernels for the rest, the copies."""
    spec = get_spec("h100")
    placed = set(report.placed)
    total = 0.0
    for gp in report.plan.graphs:
        taken: set[int] = set()
        for k in gp.stitched.kernels:
            if k.name in placed:
                taken |= set(k.members)
                if k.is_memory and k.cost.launches:
                    # The plan's price carries the copies it predicted; the rewrite's are
                    # added below.
                    total += k.cost.without_loop_copies().total_s * 1e6 * gp.stitched.weight
        total += sum(b.cost.total_s * 1e6 * gp.stitched.weight for b in gp.baseline.kernels
                     if b.is_memory and b.cost.launches and not taken & set(b.members))
    for c in copies:
        total += copy_kernel_cost(spec, c.nbytes).total_s * 1e6 * \
            report.plan.graphs[c.graph_index].stitched.weight
    return total


def test_entry_only_module_delivers_what_it_planned_when_every_kernel_is_placed():
    rng = np.random.default_rng()
    report = _compile(_softmax_ln, _rand(rng, 32, 64), _rand(rng, 32, 64))
    s = report.summary()
    assert report.kernels_stitched >= 1
    for key in ("xla_mem_us", "planned_mem_us", "delivered_mem_us", "xla_mem_bytes",
                "planned_mem_bytes", "delivered_mem_bytes", "delivered_share",
                "dropped_kernels", "copies"):
        assert key in s, key
    assert s["copies"] == 0
    delivered = report.delivery.delivered.mem_modeled_us
    assert delivered == pytest.approx(_independent_price(report), rel=1e-6)
    if not report.delivery.dropped:
        assert delivered == pytest.approx(report.delivery.planned.mem_modeled_us, rel=1e-6)


def test_largest_movers_are_the_delivered_modules_kernels_by_bytes():
    """Every delivered kernel is one mover: their bytes and µs add up to the delivered
    side, the placed kernels are the stitched ones, the largest come first."""
    rng = np.random.default_rng()
    report = _compile(_softmax_ln, _rand(rng, 32, 64), _rand(rng, 32, 64))
    delivery = report.delivery
    movers = delivery.movers
    assert len(movers) == delivery.delivered.kernels >= 1
    assert sum(m.hbm_bytes for m in movers) == pytest.approx(delivery.delivered.hbm_bytes)
    assert sum(m.modeled_us for m in movers) == pytest.approx(delivery.delivered.modeled_us)
    assert {m.name for m in movers if m.stitched} == set(report.placed)
    assert all(m.tops for m in movers)
    largest = delivery.largest_movers(2)
    assert [m.hbm_bytes for m in largest] == sorted((m.hbm_bytes for m in movers),
                                                    reverse=True)[:2]


def test_loop_body_copies_are_priced_in_the_delivered_module():
    """Kernels in a scan's body write loop-carried values through copies the rewrite adds:
    the delivered figures carry them (before, the pass counted none)."""
    rng = np.random.default_rng()
    report = _compile(jax.value_and_grad(_scan_loss), 0.3 * _rand(rng, 16, 16),
                      _rand(rng, 6, 8, 16))
    delivery = report.delivery
    assert report.in_loop_bodies >= 1
    assert delivery.copies, "the rewrite added copies in the loop body"
    assert all(c.graph_index > 0 and c.nbytes > 0 for c in delivery.copies)
    assert delivery.delivered.mem_modeled_us == pytest.approx(
        _independent_price(report, delivery.copies), rel=1e-6)
    without = price_delivery(report.plan, get_spec("h100"),
                             [(p.graph_index, p.name, p.members) for p in _sites(report)],
                             {})
    assert delivery.delivered.mem_hbm_bytes > without.delivered.mem_hbm_bytes


def _sites(report):
    placed = set(report.placed)
    out = []
    for gi, gp in enumerate(report.plan.graphs):
        for k in gp.stitched.kernels:
            if k.name in placed:
                out.append(type("S", (), {"graph_index": gi, "name": k.name,
                                          "members": frozenset(k.members)}))
    return out


def test_dropped_kernels_carry_their_kind_reason_and_planned_saving():
    rng = np.random.default_rng()
    report = _compile(_softmax_ln, _rand(rng, 32, 64), _rand(rng, 32, 64))
    plan = report.plan
    stitched = [(gi, k) for gi, gp in enumerate(plan.graphs) for k in gp.stitched.kernels
                if k.schedule is not None]
    assert stitched
    gi, dropped = stitched[0]
    kept = [(g, k.name, frozenset(k.members)) for g, k in stitched[1:]]
    delivery = price_delivery(plan, get_spec("h100"), kept,
                              {dropped.name: ("build", "CodegenError: refused")})
    assert [d.name for d in delivery.dropped] == [dropped.name]
    d = delivery.dropped[0]
    assert d.kind == "build" and "refused" in d.reason
    replaced = sum(b.cost.total_s for b in plan.graphs[gi].baseline.kernels
                   if set(b.members) & set(dropped.members))
    assert d.planned_saving_us == pytest.approx((replaced - dropped.cost.total_s) * 1e6)
    lost = delivery.delivered.mem_modeled_us - delivery.planned.mem_modeled_us
    assert lost == pytest.approx(d.planned_saving_us, rel=1e-6)
    assert any(dropped.name in line for line in delivery.log_lines("m"))


def test_predicted_loop_copies_match_the_rewrite_and_a_losing_kernel_is_refused():
    """hlo_rewrite.carried_copy_bytes predicts, per kernel, the copies the rewrite then adds;
    delivered.loses_with_copies refuses a loop kernel whose copies make it lose."""
    from stitch.hlo import parse_hlo
    from stitch.xla_pass.delivered import loses_with_copies
    from stitch.xla_pass.hlo_rewrite import ComputationView, KernelSite, carried_copy_bytes
    from stitch.pricing.delta import CostModel

    rng = np.random.default_rng()
    fn = jax.value_and_grad(_scan_loss)
    args = (0.3 * _rand(rng, 16, 16), _rand(rng, 6, 8, 16))
    report = _compile(fn, *args)
    recorded: dict[str, int] = {}
    for c in report.delivery.copies:
        recorded[c.kernel] = recorded.get(c.kernel, 0) + c.nbytes
    assert recorded
    # XLA's own compile of the same function: its loop body holds the instructions the
    # plan's graphs name (the views look them up by name).
    module = parse_hlo(jax.jit(fn).lower(*args).compile().as_text())
    spec = get_spec("h100")
    checked = 0
    for gi, gp in enumerate(report.plan.graphs):
        if gp.graph.kind == "entry":
            continue
        for k in gp.stitched.kernels:
            if k.name not in recorded:
                continue
            view = ComputationView(module, gp.graph)
            tops = {view.top_of(m) for m in k.members} - {None}
            site = KernelSite(k.name, gi, frozenset(k.members),
                              tuple(sorted(tops, key=view.position.__getitem__)))
            assert carried_copy_bytes(view, site) == recorded[k.name], k.name
            cost = CostModel(gp.graph, spec, gemm_chains=False)
            huge = 1 << 30
            assert loses_with_copies(gp, frozenset(k.members), huge, spec, cost)
            assert loses_with_copies(gp, frozenset(k.members), 0, spec, cost) is None
            checked += 1
    assert checked


def test_dumped_modules_carry_the_pass_summary_the_xla_units_bench_reads(tmp_path,
                                                                         monkeypatch):
    """bench/delivered/units.py used to report what snapping leaves as if the pass delivered it;
    it now reads the delivered figure the pass itself wrote beside the module."""
    from bench.delivered.units import delivered_us
    monkeypatch.setenv("STITCH_DUMP_MODULES", str(tmp_path))
    rng = np.random.default_rng()
    report = _compile(_softmax_ln, _rand(rng, 32, 64), _rand(rng, 32, 64))
    (module,) = sorted(tmp_path.glob("*.hlo"))
    assert delivered_us(module) == pytest.approx(report.delivery.delivered.mem_modeled_us,
                                                 abs=1e-3)
    (module.with_suffix(".summary.json")).unlink()
    assert delivered_us(module) is None


def test_kernels_the_pass_priced_itself_are_delivered_at_that_price():
    """A planned kernel built differently (a chain writing fewer values) and a kernel
    placed outside the plan (an LM head loss, an attention backward) carry the pass's own
    price: the first in place of the plan's, the second in place of the XLA kernels its
    members were; neither is priced by the memory-intensive model of its member set."""
    from stitch.pricing.delta import KernelCost
    rng = np.random.default_rng()
    report = _compile(_softmax_ln, _rand(rng, 32, 64), _rand(rng, 32, 64))
    plan, spec = report.plan, get_spec("h100")
    sites = [(p.graph_index, p.name, p.members) for p in _sites(report)]
    assert sites
    base = price_delivery(plan, spec, sites, {})
    gi, name, members = sites[0]
    planned = next(k for k in plan.graphs[gi].stitched.kernels if k.name == name)
    price_s = float(rng.uniform(1e-4, 1e-3))
    own = KernelCost(int(rng.integers(1, 1 << 30)), 1, price_s, 0.0, 0, price_s)
    again = price_delivery(plan, spec, sites, {}, priced={name: own})
    assert again.delivered.modeled_us - base.delivered.modeled_us == pytest.approx(
        (price_s - planned.cost.without_loop_copies().total_s) * 1e6, rel=1e-6)
    assert again.delivered.hbm_bytes - base.delivered.hbm_bytes == pytest.approx(
        own.hbm_bytes - planned.cost.hbm_bytes, rel=1e-9)
    # Outside the plan: the XLA kernels of its members are no longer delivered, and it is
    # not memory-intensive (GEMM work inside).
    outside = [(gi, "outside_kernel", members)] + sites[1:]
    side = price_delivery(plan, spec, outside, {name: ("placement", "taken")},
                          priced={"outside_kernel": own})
    without = price_delivery(plan, spec, sites[1:], {name: ("placement", "taken")})
    replaced = [b for b in plan.graphs[gi].baseline.kernels
                if set(b.members) & set(members) and b.cost.launches]
    assert replaced
    weight = plan.graphs[gi].stitched.weight
    assert side.delivered.modeled_us - without.delivered.modeled_us == pytest.approx(
        (price_s - sum(b.cost.total_s for b in replaced)) * 1e6 * weight, rel=1e-6)
    assert side.delivered.mem_modeled_us == pytest.approx(
        without.delivered.mem_modeled_us - sum(b.cost.total_s for b in replaced
                                               if b.is_memory) * 1e6 * weight, rel=1e-6)
