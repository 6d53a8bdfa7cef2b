"""One rule for element types: the planner never offers a kernel codegen refuses for its
element types (a dropout's threefry counters are u64, which codegen has no kernel IR dtype
for), and the rule lives in the HLO layer, where codegen reads it too."""
from __future__ import annotations

import numpy as np
import pytest

from stitch.hlo import element_types, parse_hlo
from stitch.hlo.graph import build_op_graphs
from stitch.analysis.buildable import build_problem


def _dropout(key, x):
    jax = pytest.importorskip("jax")
    keep = jax.random.bernoulli(key, 0.9, x.shape)
    return jax.numpy.where(keep, jax.numpy.tanh(x) / 0.9, 0).sum(-1)


def test_the_pass_plans_no_kernel_codegen_refuses_for_its_types():
    jax = pytest.importorskip("jax")
    from stitch.xla_pass import entry as xla_pass
    rng = np.random.default_rng()
    rows, cols = int(rng.integers(4, 40)), int(rng.integers(8, 130))
    key = jax.random.key(int(rng.integers(0, 2**31)))
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    hlo = jax.jit(_dropout).lower(key, x).as_text(dialect="hlo")
    graphs = build_op_graphs(parse_hlo(hlo))
    assert "u64" in {n.shape.element_type for g in graphs for n in g.nodes
                     if not n.shape.is_tuple}
    xla_pass.ensure_registered("cpu")
    request = xla_pass.PassRequest("dropout_types", "h100", "cpu")
    lowered = request.prepare(jax.jit(_dropout).lower(key, x))
    with request:
        compiled = lowered.compile()
    report = request.result()
    refused = [k for k in report.delivery.dropped if "element type" in k.reason]
    assert not refused, refused
    for g in report.plan.graphs:
        for k in g.stitched.kernels:
            if k.name in set(report.placed):
                assert all(build_problem(g.graph, v) is None for v in k.members)
    np.testing.assert_allclose(np.asarray(compiled(key, x)),
                               np.asarray(jax.jit(_dropout)(key, x)), rtol=1e-5, atol=1e-5)


def test_codegen_reads_the_hlo_layers_table():
    from stitch.codegen import kir, values
    assert values.STORAGE is element_types.CODEGEN_STORAGE
    for src in element_types.REINTERPRET_WIDTHS:
        for dst in element_types.REINTERPRET_WIDTHS:
            a, b = (kir.value_dtype(values.STORAGE[t]) for t in (src, dst))
            assert (kir.bitcast_problem(a, b) is None) == \
                (element_types.reinterpret_problem(src, dst) is None)
    assert element_types.type_problem("u64") is not None
    assert element_types.reinterpret_problem("u32", "f32") is None
    assert element_types.reinterpret_problem("bf16", "s16") is not None
