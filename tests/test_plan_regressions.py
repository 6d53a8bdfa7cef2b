"""Pre-optimization HLO that broke the planner once, planned for every target: the plan is
valid (stitch.plan validates coverage, writers, convexity and launch order) and the stitched
program computes what the module computes.

- keras_jax_train_step: Keras 3's JAX train step (examples/keras_fit.py). Base
  fusion duplicated a compare into a second group without its producer (a scalar convert
  no group wrote); packing then joined two kernels whose union a recomputed producer made
  non-convex.
- log_softmax_xent_train_keep_unused: merge_adjacent's path search pruned by op ids and
  merged two kernels around a scatter into a cycle.
- fuzz_seed619 (tests/hlo_fuzz.py): merge_adjacent took a recomputed reader of rsqrt into
  rsqrt's kernel, so its other copies read a value no kernel wrote.
- dense_ln_mse_sgd (.pre and .opt: jax's pre-optimization HLO and XLA CPU's optimized HLO of
  one Dense layer + a hand-written layer norm + MSE loss + SGD under value_and_grad): base
  fusion duplicated a broadcast reading a free reshape of another broadcast into a second
  group; the value behind the reshape was written by no group (kernel 7 reads mul.24,
  which no kernel writes), on every target and with both planners.

- xla_corpus_00010 (XLA's in_place_dynamic_update_slice_fusion benchmark module, from the
  XLA test corpus): a loop body's kernel read a slice no kernel wrote (fixed with the
  dense_ln_mse_sgd case).

Every fixture (``*.pre.hlo``, XLA-optimized ``*.opt.hlo``, corpus ``*.hlo``) must plan valid on every
target with both planners, and nothing but a StitchError may leave ``stitch.plan``.
"""
from __future__ import annotations


import numpy as np
import pytest

import stitch.hlo
import stitch
from stitch.hlo.evaluator.dtypes import numpy_dtype
from hlo_fixtures import DATA

REGRESS = DATA / "regress"
CASES = sorted(p.name.removesuffix(".pre.hlo") for p in REGRESS.glob("*.pre.hlo"))
FIXTURES = sorted(p.name for p in REGRESS.glob("*.hlo"))


def _args(module, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for p in module.entry.parameters:
        dtype = numpy_dtype(p.shape.element_type)
        if np.issubdtype(dtype, np.integer):
            out.append(rng.integers(0, 4, size=p.shape.dims).astype(dtype))
        elif dtype == np.bool_:
            out.append(rng.integers(0, 2, size=p.shape.dims).astype(bool))
        else:
            out.append((rng.standard_normal(p.shape.dims) + 0.5).astype(dtype))
    return out


@pytest.mark.parametrize("target", ["v100", "a100", "h100"])
@pytest.mark.parametrize("case", CASES)
def test_plans_are_valid(case, target):
    plan = stitch.plan((REGRESS / f"{case}.pre.hlo").read_text(), target)
    summary = plan.summary()
    assert summary["stitched"]["mem_kernels"] <= summary["baseline"]["mem_kernels"]


@pytest.mark.parametrize("planner", ["beam", "blp"])
@pytest.mark.parametrize("target", ["v100", "a100", "h100"])
@pytest.mark.parametrize("fixture", FIXTURES)
def test_every_fixture_plans_valid_with_both_planners(fixture, target, planner):
    plan = stitch.plan((REGRESS / fixture).read_text(), target, planner)
    assert plan.kernels
    summary = plan.summary()
    assert summary["stitched"]["mem_kernels"] <= summary["baseline"]["mem_kernels"]


@pytest.mark.parametrize("case", CASES)
def test_compiled_program_matches_the_evaluator(case):
    module = stitch.hlo.parse_hlo((REGRESS / f"{case}.pre.hlo").read_text())
    exe = stitch.compile(module, "h100", cache=False)
    assert exe.kernels
    args = _args(module, 3)
    for got, want in zip(exe(*args), stitch.hlo.evaluate(module, args)):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert got.shape == want.shape
        err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
        assert err <= 1e-4, err


def test_an_unexpected_error_inside_the_planner_leaves_as_a_stitch_error(monkeypatch):
    """A StopIteration once leaked out of stitch.plan on a corpus module: whatever a bug
    raises inside planning, the caller gets a StitchError (and falls back to XLA)."""
    import stitch.explorer.planner as planner_mod

    def broken(*args, **kwargs):
        raise StopIteration
    monkeypatch.setattr(planner_mod, "plan_graph", broken)
    with pytest.raises(stitch.StitchError, match="StopIteration"):
        stitch.plan((REGRESS / "fuzz_seed619.pre.hlo").read_text(), "h100")
