"""Tests of the model zoo (stitch.models): registry, tiny runs, full-config lowering."""

from __future__ import annotations

import math
import re

import pytest

jax = pytest.importorskip("jax")
np = pytest.importorskip("numpy")

from stitch import models  # noqa: E402  (after the importorskip guard)

ALL = models.list_models()
TRAINING = [n for n in ALL if models.get_model(n).kind == "training"]

# Output shapes of the tiny configs, written out by hand from each model's tiny sizes.
TINY_OUT = {
    "layer_norm": [(16, 32)],
    "softmax": [(2, 2, 8, 8)],
    "bias_gelu": [(16, 64)],
    "bias_gelu_tanh": [(16, 64)],
    "log_softmax_xent": [()],
    "log_softmax_xent_train": [(), (16, 64)],
    "log_softmax_xent_train_bf16": [(), (16, 64)],
    "layer_norm_nonminor": [(2, 16, 8)],
    "column_reduce_broadcast": [(16, 32)],
    "bert_layer_infer": [(2, 8, 32)],
    "dien_infer": [(4, 2)],
    "asr_infer": [(2, 4, 29)],  # 16 frames / 2 / 2
    "crnn_infer": [(2, 4, 37)],  # width 16 / 2 / 2 / 1
    # Segmented reductions (stitch/models/segment_models.py): 12 segments of 8, 2 heads; 6 bags
    # of 4 tokens plus 2 empty ones, dim 8; 8 tokens of dim 8.
    **{f"{name}{suffix}": [shape] for suffix in ("", "_bf16") for name, shape in (
        ("segment_softmax", (96, 2)), ("segment_softmax_grad", (96, 2)),
        ("embedding_bag", (8, 8)), ("moe_layer", (8, 8)))},
}

# First input of each full config (paper sizes) and the arg count.
FULL_FIRST_ARG = {
    "layer_norm": ((4096, 768), 3),
    "softmax": ((32, 12, 128, 128), 1),
    "bias_gelu": ((4096, 3072), 2),
    "log_softmax_xent": ((4096, 32000), 2),
    "layer_norm_nonminor": ((32, 768, 128), 3),
    "column_reduce_broadcast": ((4096, 768), 2),
    "bert_layer_infer": ((32, 128, 768), 18),
    "bert_layer_train": ((32, 128, 768), 19),
    "transformer_train": ((128, 32), 88),
    "dien_infer": ((256,), 22),
    "dien_train": ((256,), 23),
    "asr_infer": ((8, 400, 80, 1), 13),
    "crnn_infer": ((8, 32, 128, 1), 15),
    "gemm_chain_g1": ((1, 512, 64), 3),
    "gemm_chain_g12": ((8, 1024, 128), 3),
    "attention_bert_base": ((12, 512, 64), 3),
    "attention_vit_huge": ((16, 256, 80), 3),
    "attention_mlp_mixer_l": ((1, 1024, 64), 3),
}


def _outputs(out) -> list:
    return list(out) if isinstance(out, tuple) else [out]


def _expected_tiny(inst: models.ModelInstance) -> list[tuple[int, ...]]:
    name = inst.name
    if name in TINY_OUT:
        return TINY_OUT[name]
    if models.get_model(name).kind == "training":
        return [()] + [tuple(inst.arg_specs[i].shape) for i in inst.param_argnums]
    # MCFuser chains and attention: (batch, M, K)..(batch, N, H) -> (batch, M, H).
    first, last = inst.arg_specs[0].shape, inst.arg_specs[-1].shape
    return [(first[0], first[1], last[2])]


# ------------------------------------------------------------------------------- registry


def test_registry_lists_every_family():
    expected = {
        "layer_norm", "softmax", "bias_gelu", "log_softmax_xent", "log_softmax_xent_train",
        "layer_norm_nonminor", "column_reduce_broadcast", "bert_layer_infer",
        "bert_layer_train", "transformer_train", "dien_infer", "dien_train", "asr_infer",
        "crnn_infer", "attention_bert_small", "attention_bert_base", "attention_bert_large",
        "attention_vit_base", "attention_vit_large", "attention_vit_huge",
        "attention_mlp_mixer_s", "attention_mlp_mixer_b", "attention_mlp_mixer_l",
    } | {f"gemm_chain_g{i}" for i in range(1, 13)}
    assert expected <= set(ALL)
    assert len(ALL) == len(set(ALL))
    for name in ALL:
        spec = models.get_model(name)
        assert spec.name == name
        assert spec.kind in ("inference", "training")
        assert spec.configs in (("full", "tiny"), ("full", "medium", "tiny"))
        assert spec.description and "\n" not in spec.description


def test_unknown_model_is_key_error_listing_names():
    with pytest.raises(KeyError) as err:
        models.get_model("no_such_model")
    assert "layer_norm" in str(err.value)
    with pytest.raises(KeyError):
        models.build("no_such_model")


def test_bad_config_is_value_error_naming_configs():
    with pytest.raises(ValueError) as err:
        models.build("layer_norm", "huge")
    assert "full" in str(err.value) and "tiny" in str(err.value)
    with pytest.raises(ValueError):
        models.get_model("dien_infer").build("medium")
    assert models.build("bert_layer_infer", "medium").arg_specs[0].shape == (8, 64, 256)


# ---------------------------------------------------------------------------- tiny configs


@pytest.mark.parametrize("name", ALL)
def test_tiny_runs_finite_with_expected_shapes(name):
    inst = models.build(name, "tiny")
    assert inst.name == name and inst.config == "tiny"
    n = len(inst.arg_specs)
    assert len(inst.arg_kinds) == n
    args = inst.random_args(seed=1)
    assert len(args) == n
    # The *_bf16 mixed-precision variants take bf16 data and may return bf16 gradients.
    floats = (np.float32, jax.numpy.bfloat16) if name.endswith("_bf16") else (np.float32,)
    for arg, spec, kind in zip(args, inst.arg_specs, inst.arg_kinds):
        assert arg.shape == tuple(spec.shape) and arg.dtype == spec.dtype
        if kind == "float":
            assert arg.dtype in floats and np.all(arg != 0)
        else:
            high = int(kind.split(":")[1])
            assert arg.dtype == np.int32 and arg.min() >= 0 and arg.max() < high
    jitted = jax.jit(inst.fn)
    outs = _outputs(jitted(*args))
    assert [tuple(o.shape) for o in outs] == _expected_tiny(inst)
    for o in outs:
        assert o.dtype in floats
        assert np.all(np.isfinite(np.asarray(o, np.float32)))
    hlo = jitted.lower(*inst.arg_specs).as_text(dialect="hlo")
    assert "ENTRY" in hlo


def test_random_args_deterministic_per_seed():
    inst = models.build("dien_train")
    a, b, c = inst.random_args(3), inst.random_args(3), inst.random_args(4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_training_outputs_are_loss_then_params():
    for name in TRAINING:
        inst = models.build(name)
        if name.startswith("log_softmax_xent_train"):  # and its bf16 variant
            continue  # returns (loss, dlogits) by design
        assert inst.param_argnums, name
        assert inst.param_argnums == tuple(range(inst.param_argnums[0], len(inst.arg_specs)))


@pytest.mark.parametrize("name", ["bert_layer_train", "dien_train", "transformer_train",
                                  "bert_layer_train_bf16", "dien_train_bf16",
                                  "transformer_train_bf16"])
def test_training_loss_decreases(name):
    inst = models.build(name)
    step = jax.jit(inst.fn)
    args = inst.random_args(seed=0)
    losses = []
    for _ in range(4):
        out = step(*args)
        losses.append(float(out[0]))
        for i, new in zip(inst.param_argnums, out[1:]):
            args[i] = new
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0], losses


# ------------------------------------------------------------------- numeric spot checks


def _run(name, seed=0):
    inst = models.build(name)
    args = inst.random_args(seed)
    return args, _outputs(jax.jit(inst.fn)(*args))


def test_layer_norms_match_numpy():
    (x, g, b), (y,) = _run("layer_norm")
    mean = x.mean(-1, keepdims=True)
    ref = (x - mean) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * g + b
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)
    (x, g, b), (y,) = _run("layer_norm_nonminor")
    mean = x.mean(1, keepdims=True)
    ref = (x - mean) / np.sqrt(x.var(1, keepdims=True) + 1e-5) * g[:, None] + b[:, None]
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)


def test_softmax_and_xent_match_numpy():
    (x,), (y,) = _run("softmax")
    e = np.exp(x - x.max(-1, keepdims=True))
    np.testing.assert_allclose(y, e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)
    (logits, labels), (loss, grad) = _run("log_softmax_xent_train")
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    rows = np.arange(len(labels))
    np.testing.assert_allclose(loss, -logp[rows, labels].mean(), rtol=1e-5)
    onehot = np.zeros_like(logits)
    onehot[rows, labels] = 1.0
    np.testing.assert_allclose(grad, (np.exp(logp) - onehot) / len(labels), atol=1e-6)


def test_bias_gelu_matches_erf_definition():
    (x, bias), (y,) = _run("bias_gelu")
    v = (x + bias).astype(np.float64)
    ref = 0.5 * v * (1.0 + np.vectorize(math.erf)(v / math.sqrt(2.0)))
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)


def test_gemm_chain_and_attention_match_numpy():
    (a, b, c), (y,) = _run("gemm_chain_g2")
    np.testing.assert_allclose(y, (a @ b) @ c, rtol=1e-4, atol=1e-5)
    (q, k, v), (y,) = _run("attention_vit_huge")
    s = q @ k.transpose(0, 2, 1) / math.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(y, (p / p.sum(-1, keepdims=True)) @ v, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------- full configs


@pytest.fixture(scope="module")
def full_hlo() -> dict[str, str]:
    """Shape-only lowering of every full config (nothing is executed)."""
    out = {}
    for name in ALL:
        inst = models.build(name, "full")
        out[name] = jax.jit(inst.fn).lower(*inst.arg_specs).as_text(dialect="hlo")
    return out


def test_full_configs_lower(full_hlo):
    assert set(full_hlo) == set(ALL)
    for name, hlo in full_hlo.items():
        assert "ENTRY" in hlo, name


def test_full_input_shapes():
    for name, (shape, count) in FULL_FIRST_ARG.items():
        inst = models.build(name, "full")
        assert tuple(inst.arg_specs[0].shape) == shape, name
        assert len(inst.arg_specs) == count, name


def test_full_hlo_structure(full_hlo):
    for name in ("dien_infer", "dien_train", "asr_infer", "crnn_infer"):
        assert re.search(r"\bwhile\(", full_hlo[name]), name
    for name in ("bert_layer_infer", "bert_layer_train", "transformer_train"):
        assert re.search(r"\bdot\(", full_hlo[name]), name
    assert re.search(r"\bconvolution\(", full_hlo["asr_infer"])
    assert re.search(r"\breduce-window\(", full_hlo["crnn_infer"])
    assert re.search(r"\bgather\(", full_hlo["dien_infer"])


def test_parameters_are_hlo_parameters_not_constants(full_hlo):
    # Every positional arg (weights included) is an ENTRY parameter, none a baked constant.
    for name in ("bert_layer_infer", "bert_layer_train", "dien_train", "crnn_infer"):
        entry = full_hlo[name].split("\nENTRY", 1)[1].split("\n}", 1)[0]
        n_args = len(models.build(name, "full").arg_specs)
        assert len(re.findall(r"\bparameter\(", entry)) == n_args, name
