"""The reference evaluator against jax on every zoo model's tiny configuration, for the
pre-optimization HLO, XLA CPU optimized HLO (compiled here) and the committed XLA GPU
optimized fixtures of every target; and against TensorFlow's own results for the Keras
fixtures."""
from __future__ import annotations

import numpy as np
import pytest

from stitch.hlo import evaluate, parse_hlo
from tests.fixtures import BF16_TOLERANCE, DATA, GPU_TARGETS, uses_bf16, zoo_fixture

jax = pytest.importorskip("jax")
models = pytest.importorskip("stitch.models")

STAGES = ("pre", "cpu") + tuple(f"gpu-{t}" for t in GPU_TARGETS)
_HEAVY_OPS = ("reduce", "dot", "convolution", "custom-call", "reduce-window", "while")


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """‖out − ref‖ / ‖ref‖, with ‖ref‖ floored at 1e-5: a reference that is rounding noise
    around an exact zero (e.g. the key-bias gradient of attention) is compared absolutely."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    assert out.shape == ref.shape
    denom = max(np.linalg.norm(ref.ravel()), 1e-5)
    return float(np.linalg.norm((out - ref).ravel()) / denom)


def tolerance(module) -> float:
    """1e-5 for elementwise-only modules; 1e-4 where reductions or GEMMs reorder sums;
    BF16_TOLERANCE for modules that compute in bf16 (tests/fixtures.py says why)."""
    if uses_bf16(module):
        return BF16_TOLERANCE
    heavy = any(i.opcode in _HEAVY_OPS for _, i in module.instructions())
    return 1e-4 if heavy else 1e-5


@pytest.fixture(scope="module")
def jax_results():
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            inst = models.build(name, "tiny")
            args = inst.random_args(seed=hash(name) % 1000 + 1)
            jitted = jax.jit(inst.fn)
            ref = jax.tree_util.tree_leaves(jitted(*args))
            cache[name] = (inst, args, [np.asarray(r) for r in ref])
        return cache[name]
    return get


def _hlo_text(inst, stage: str) -> str:
    if stage == "cpu":
        return jax.jit(inst.fn).lower(*inst.arg_specs).compile().as_text()
    path = zoo_fixture(inst.name, "tiny", stage)
    if not path.exists():
        pytest.fail(f"missing fixture {path}: run scripts/gen_fixtures.py")
    return path.read_text()


CASES = [(m, s) for m in models.list_models() for s in STAGES]


@pytest.mark.parametrize("model, stage", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_evaluate_matches_jax(model, stage, jax_results):
    inst, args, ref = jax_results(model)
    module = parse_hlo(_hlo_text(inst, stage))
    assert len(module.entry.parameters) == len(args), "jax dropped an unused argument"
    n_out = len(ref)
    poisoned = [np.full_like(r, np.nan) for r in ref]  # outputs start as NaN: never pass by default
    outs = evaluate(module, args)
    assert len(outs) == n_out
    for i, (out, want) in enumerate(zip(outs, ref)):
        poisoned[i] = np.asarray(out)
        assert poisoned[i].dtype == want.dtype, f"output {i}"
        assert np.isfinite(poisoned[i]).all() == np.isfinite(want).all(), f"output {i}"
        err = relative_error(poisoned[i], want)
        assert err <= tolerance(module), f"output {i}: relative error {err:.2e}"


TF_MODELS = sorted(p.stem for p in (DATA / "tf").glob("*.npz"))


@pytest.mark.parametrize("stage", ["hlo", "optimized_hlo"])
@pytest.mark.parametrize("name", TF_MODELS)
def test_evaluate_matches_tensorflow(name, stage):
    module = parse_hlo((DATA / "tf" / f"{name}.{stage}").read_text())
    data = np.load(DATA / "tf" / f"{name}.npz")
    args = [data[f"arg{i}"] for i in range(len(module.entry.parameters))]
    outs = evaluate(module, args)
    want = [data[f"out{i}"] for i in range(sum(k.startswith("out") for k in data.files))]
    assert len(outs) == len(want)
    for i, (out, ref) in enumerate(zip(outs, want)):
        err = relative_error(np.asarray(out).astype(ref.dtype), ref)
        assert err <= 1e-4, f"{name} output {i}: relative error {err:.2e}"
