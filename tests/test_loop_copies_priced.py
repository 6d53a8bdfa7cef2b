"""The planner prices the copies a loop body's stitched kernel needs (each loop-state value it
writes goes through a copy the rewrite adds): one prediction (stitch.hlo.loop_state) for the
plan, the pass's check and the rewrite, so the plan's figures are the module's."""
from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from stitch.hlo.loop_state import carried_copies  # noqa: E402
from tests.fixtures import compile_with_cpu_pass  # noqa: E402
from stitch.pricing.delta import CostModel, copy_kernel_cost  # noqa: E402
from stitch.cost.gpu_specs import get_spec  # noqa: E402


def _compile(fn, *args):
    return compile_with_cpu_pass(fn, *args)


def _softmax_scan(w, xs):
    def cell(h, x):
        y = jax.nn.softmax(h * w + x, axis=-1)
        return y, y.sum()
    h, ys = jax.lax.scan(cell, jnp.zeros(w.shape, jnp.float32), xs)
    return h.sum() + ys.sum()


def _loop_kernels(report):
    placed = set(report.placed)
    for gi, gp in enumerate(report.plan.graphs):
        if gp.graph.kind == "entry":
            continue
        for k in gp.stitched.kernels:
            if k.name in placed:
                yield gi, gp, k


# (150, 256): the explored plans' only loop kernel is global scope and moves more bytes
# than XLA's kernels, copies or not; the plan must fall back to XLA's kernels there.
@pytest.mark.parametrize("size", ["random", (150, 256)])
def test_the_plan_prices_the_copies_the_rewrite_adds(size):
    rng = np.random.default_rng()
    rows, cols = (int(rng.integers(64, 300)), int(rng.integers(128, 600))) \
        if size == "random" else size
    steps = 4
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    xs = rng.standard_normal((steps, rows, cols)).astype(np.float32)
    report, compiled = _compile(_softmax_scan, w, xs)
    delivery = report.delivery
    spec = get_spec("h100")
    # No graph's plan moves more memory-intensive bytes than XLA's kernels of it.
    for gp in report.plan.graphs:
        planned = sum(k.cost.hbm_bytes for k in gp.stitched.kernels if k.is_memory)
        assert planned <= sum(b.cost.hbm_bytes for b in gp.baseline.kernels if b.is_memory)
    kernels = list(_loop_kernels(report))
    as_xla = all({frozenset(k.members) for k in gp.stitched.kernels}
                 == {frozenset(b.members) for b in gp.baseline.kernels}
                 for gp in report.plan.graphs if gp.graph.kind != "entry")
    if size != "random":
        assert not kernels and as_xla
    elif not kernels:
        # A size whose explored loop plans all move more than XLA: XLA's kernels kept.
        assert as_xla
    else:
        assert delivery.copies, "a loop-body kernel writes loop state"
    for gi, gp, k in kernels:
        added = sorted(c.nbytes for c in delivery.copies if c.kernel == k.name)
        assert sorted(carried_copies(gp.graph, frozenset(k.members))) == added
        assert k.cost.loop_copy_bytes == sum(added)
        assert k.cost.loop_copy_s == pytest.approx(
            sum(copy_kernel_cost(spec, n).total_s for n in added))
        # It still wins with its copies, against the XLA kernels it replaces.
        replaced = [b for b in gp.baseline.kernels if set(b.members) & set(k.members)]
        assert k.cost.total_s < sum(b.cost.total_s for b in replaced)
        # (the pass's rule: its copies never make it move more than XLA's or itself alone)
        assert k.cost.hbm_bytes <= max(sum(b.cost.hbm_bytes for b in replaced),
                                       k.cost.without_loop_copies().hbm_bytes)
    # Every planned kernel placed: the plan moved the bytes the module moves, copies too.
    if not delivery.dropped:
        assert delivery.planned.mem_hbm_bytes == pytest.approx(delivery.delivered.mem_hbm_bytes)
    assert delivery.delivered.mem_hbm_bytes <= delivery.xla.mem_hbm_bytes
    assert delivery.delivered.mem_modeled_us <= delivery.xla.mem_modeled_us
    np.testing.assert_allclose(np.asarray(compiled(w, xs)),
                               np.asarray(jax.jit(_softmax_scan)(w, xs)), rtol=2e-4)


def test_a_kernel_writing_loop_state_costs_its_copies_and_xla_kernels_do_not():
    rng = np.random.default_rng()
    # Sizes whose loop body gets a stitched (block-scope) kernel.
    rows, cols = [(64, 128), (100, 300), (200, 500), (64, 599), (256, 512)][rng.integers(5)]
    report, _ = _compile(_softmax_scan, rng.standard_normal((rows, cols)).astype(np.float32),
                         rng.standard_normal((3, rows, cols)).astype(np.float32))
    spec = get_spec("h100")
    (gi, gp, k), *_ = list(_loop_kernels(report))
    members = frozenset(k.members)
    groups = [frozenset(b.members) for b in gp.baseline.kernels]
    plain = CostModel(gp.graph, spec, gemm_chains=False).kernel(members)
    priced = CostModel(gp.graph, spec, gemm_chains=False, loop_copies=True,
                       left_to_xla=groups).kernel(members)
    copies = [copy_kernel_cost(spec, n) for n in carried_copies(gp.graph, members)]
    assert copies
    assert priced.total_s == pytest.approx(plain.total_s + sum(c.total_s for c in copies))
    assert priced.hbm_bytes == plain.hbm_bytes + sum(c.hbm_bytes for c in copies)
    alone = priced.without_loop_copies()
    assert alone.hbm_bytes == plain.hbm_bytes and alone.loop_copy_bytes == 0
    assert alone.total_s == pytest.approx(plain.total_s)
    xla = CostModel(gp.graph, spec, gemm_chains=False, loop_copies=True, left_to_xla=groups)
    for g in groups:
        assert xla.kernel(g).loop_copy_bytes == 0
