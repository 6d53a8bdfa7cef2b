"""The zoo's bf16 mixed-precision training variants (stitch/models/mixed_precision.py).

What is specific to them is checked here: their signature (bf16 data, f32 master weights and
updates, f32 loss), that their HLO computes mostly in bf16, that a bf16 step tracks the f32
step it comes from, that stitched kernels compute in f32 and load/store bf16, and that their
plans move fewer bytes than the f32 models' plans. The checks every zoo model gets run them
too, at BF16_TOLERANCE (tests/fixtures.py says why 2e-2): the evaluator against jax on every
stage (test_zoo_evaluation.py), the compiled tiny configs on the host with poisoned outputs
against the evaluator and jax (test_compile.py), plan validity on every target
(test_explorer_zoo.py) and forced schemes (test_lowering_zoo_schemes.py)."""
from __future__ import annotations

import dataclasses
import re
import zlib

import numpy as np
import pytest

import stitch
from stitch.codegen import kir
from stitch.hlo import parse_hlo
from tests.fixtures import DATA, zoo_fixture

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
models = pytest.importorskip("stitch.models")

BASES = ("log_softmax_xent_train", "bert_layer_train", "transformer_train", "dien_train")
VARIANTS = [b + "_bf16" for b in BASES]
BF16 = np.dtype(jnp.bfloat16)


def test_every_training_model_has_a_bf16_variant():
    training = [m for m in models.list_models() if models.get_model(m).kind == "training"]
    assert sorted(m for m in training if not m.endswith("_bf16")) == sorted(BASES)
    assert sorted(m for m in training if m.endswith("_bf16")) == sorted(VARIANTS)


@pytest.mark.parametrize("base", BASES)
def test_signature_bf16_data_f32_master_weights(base):
    f32, low = models.build(base, "tiny"), models.build(base + "_bf16", "tiny")
    assert low.arg_names == f32.arg_names and low.param_argnums == f32.param_argnums
    params = set(low.param_argnums)
    for i, (a, b, kind) in enumerate(zip(f32.arg_specs, low.arg_specs, low.arg_kinds)):
        assert a.shape == b.shape
        if i in params or kind != "float":
            assert b.dtype == a.dtype, low.arg_names[i]
        else:
            assert b.dtype == BF16, low.arg_names[i]
    outs = jax.eval_shape(low.fn, *low.arg_specs)
    assert outs[0].dtype == np.float32 and outs[0].shape == ()
    if low.param_argnums:       # updated master weights: f32, in argument order
        assert [(o.shape, o.dtype) for o in outs[1:]] == \
            [(low.arg_specs[i].shape, np.float32) for i in low.param_argnums]
    else:                       # the loss layer alone: d loss / d logits in bf16
        assert outs[1].dtype == BF16


def _element_counts(text: str) -> dict[str, int]:
    counts: dict[str, int] = {"bf16": 0, "f32": 0}
    for dtype, dims in re.findall(r"= (f32|bf16)\[([\d,]*)\]", text):
        counts[dtype] += int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return counts


@pytest.mark.parametrize("model", VARIANTS)
def test_full_hlo_computes_mostly_in_bf16(model):
    """Instruction results of the pre-optimization HLO: bf16 elements outnumber f32 ones
    at least 4 to 1 (f32 is left for the master weights, their update and the loss)."""
    counts = _element_counts(zoo_fixture(model, "full", "pre").read_text())
    assert counts["bf16"] >= 4 * counts["f32"], counts


@pytest.mark.parametrize("base", BASES)
def test_bf16_step_tracks_the_f32_step(base):
    """Same inputs (data rounded to bf16 for both): the loss agrees to bf16 accuracy and
    the weight updates w_new - w point the same way (cosine > 0.95)."""
    f32, low = models.build(base, "tiny"), models.build(base + "_bf16", "tiny")
    args = f32.random_args(zlib.crc32(base.encode()))
    low_args = [np.asarray(a, s.dtype) for a, s in zip(args, low.arg_specs)]
    same = [np.asarray(a, np.float32) if s.dtype == BF16 else a
            for a, s in zip(low_args, low.arg_specs)]
    want = [np.asarray(o, np.float64) for o in jax.jit(f32.fn)(*same)]
    got = [np.asarray(np.asarray(o, np.float32), np.float64) for o in jax.jit(low.fn)(*low_args)]
    assert abs(got[0] - want[0]) <= 3e-2 * abs(want[0]), (got[0], want[0])
    if low.param_argnums:
        weights = [np.asarray(same[i], np.float64) for i in low.param_argnums]
        d_want = np.concatenate([(o - w).ravel() for o, w in zip(want[1:], weights)])
        d_got = np.concatenate([(o - w).ravel() for o, w in zip(got[1:], weights)])
    else:
        d_want, d_got = want[1].ravel(), got[1].ravel()
    assert np.any(d_got != 0)
    cosine = d_got @ d_want / (np.linalg.norm(d_got) * np.linalg.norm(d_want))
    assert cosine > 0.95, cosine


def _unary_ops(node) -> set[str]:
    """Every Unary op anywhere under a Kernel IR node."""
    found: set[str] = set()
    stack = [node]
    while stack:
        x = stack.pop()
        if isinstance(x, kir.Unary):
            found.add(x.op)
        if dataclasses.is_dataclass(x):
            stack.extend(getattr(x, f.name) for f in dataclasses.fields(x))
        elif isinstance(x, (tuple, list)):
            stack.extend(x)
    return found


def test_stitched_kernels_load_store_bf16_and_compute_f32():
    from stitch import compiler

    exe = compiler.compile(zoo_fixture("bert_layer_train_bf16", "tiny", "pre").read_text(),
                           "h100", cache=False)
    bf16_kernels = [ck.kernel for ck in exe.kernels
                    if any(p.dtype == "bf16" for p in ck.kernel.params)]
    assert len(bf16_kernels) >= len(exe.kernels) // 2
    # bf16 is a storage type only: loads widen it, arithmetic has no bf16 form, and results
    # stored as bf16 are rounded from f32 the way XLA rounds them.
    assert "bf16" in kir.STORAGE_DTYPES and "bf16" not in kir.VALUE_DTYPES
    assert any("round_to_bf16" in _unary_ops(k.body) for k in bf16_kernels)
    for k in bf16_kernels:
        k.validate()


def _mem_bytes(model: str, target: str) -> tuple[float, float]:
    s = stitch.plan((DATA / model / f"full.gpu-{target}.hlo").read_text(), target).summary()
    return s["baseline"]["mem_hbm_bytes"], s["stitched"]["mem_hbm_bytes"]


@pytest.mark.parametrize("base", ["log_softmax_xent_train", "bert_layer_train"])
def test_bf16_plans_move_fewer_bytes_than_f32(base):
    """h100, full size: XLA's and stitch's memory-intensive bytes both drop in bf16, and
    stitch stays at or below XLA."""
    xla32, st32 = _mem_bytes(base, "h100")
    xla16, st16 = _mem_bytes(base + "_bf16", "h100")
    assert st16 <= xla16
    assert xla16 < 0.8 * xla32 and st16 < 0.8 * st32, (xla32, st32, xla16, st16)


def test_fixtures_are_listed_in_the_manifest():
    import json

    files = set(json.loads((DATA / "manifest.json").read_text())["files"])
    for model in VARIANTS:
        for config in ("full", "tiny"):
            for stage in ("pre", "gpu-v100", "gpu-a100", "gpu-h100"):
                name = f"{model}/{config}.{stage}.hlo"
                assert name in files and (DATA / name).exists(), name
                if stage == "pre":
                    parse_hlo((DATA / name).read_text())
