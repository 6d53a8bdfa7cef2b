"""stitch.frontends.tf.tf_frontend: tf.function(jit_compile=True) under stitch (skipped without TF).

The mapping (ENTRY parameters = the concrete function's inputs: tensor arguments, then
captures; root = flat outputs, then variable updates named by input_output_alias), the
stitched steps equal stock TF (outputs and every variable), a forced compile failure and a
wrong stitched result both fall back to TF."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
pytest.importorskip("jax")

from stitch.frontends.tf import tf_frontend  # noqa: E402


def _model(seed: int = 0):
    """Variables (two trained, one read-only, an s64 counter), a captured eager tensor, a
    default argument and a nested output with a Python constant."""
    rng = np.random.default_rng(seed)
    v = {"w": tf.Variable(rng.standard_normal((8, 16)).astype(np.float32), name="w"),
         "b": tf.Variable(np.zeros(16, np.float32), name="b"),
         "scale": tf.Variable(1.5, name="scale"),
         "count": tf.Variable(0, dtype=tf.int64, name="count")}
    shift = tf.constant(np.linspace(-1, 1, 16).astype(np.float32))

    def step(x, y, lr=0.1):
        with tf.GradientTape() as tape:
            h = tf.tanh(x @ v["w"] + v["b"]) * v["scale"] + shift
            mean, var = tf.nn.moments(h, axes=[-1], keepdims=True)
            h = (h - mean) * tf.math.rsqrt(var + 1e-5)
            loss = tf.reduce_mean((h - y) ** 2)
        gw, gb = tape.gradient(loss, [v["w"], v["b"]])
        v["b"].assign_sub(lr * gb)
        v["w"].assign_sub(lr * gw)
        v["count"].assign_add(1)
        return {"loss": loss, "h_max": tf.reduce_max(h)}, 7
    return v, step


def _batches(n: int):
    rng = np.random.default_rng(1)
    return [(rng.standard_normal((32, 8)).astype(np.float32),
             rng.standard_normal((32, 16)).astype(np.float32)) for _ in range(n)]


def _flat(result):
    return [np.asarray(t) for t in tf.nest.flatten(result)]


def test_importing_the_front_end_does_not_import_tensorflow():
    code = ("import sys, stitch.frontends.tf.tf_frontend; "
            "assert 'tensorflow' not in sys.modules, 'tensorflow imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_parameters_and_outputs_map_to_arguments_captures_and_variable_updates():
    from stitch.hlo import parse_hlo

    v, step = _model()
    fn = tf.function(step, jit_compile=True)
    x, y = _batches(1)[0]
    concrete = fn.get_concrete_function(x, y)
    hlo = fn.experimental_get_compiler_ir(x, y, 0.1)(stage="hlo")
    module = parse_hlo(hlo)
    _, leaves = tf_frontend.bound_leaves(step, (x, y), {})
    assert len(leaves) == 2                       # lr is a Python value: no parameter
    mapping = tf_frontend.build_mapping(concrete, module, hlo, leaves)
    kinds = [k for k, _ in mapping.sources]
    assert kinds[:2] == ["arg", "arg"] and kinds.count("const") == 1
    variables = {value.name.split(":")[0]: i for i, (k, value) in enumerate(mapping.sources)
                 if k == "var"}
    assert set(variables) == {"w", "b", "scale", "count"}
    assert mapping.n_outputs == 3                 # loss, h_max, the constant 7
    updated = {mapping.sources[p][1].name.split(":")[0] for _, p in mapping.updates}
    assert updated == {"w", "b", "count"}         # "scale" is only read
    assert [o for o, _ in mapping.updates] == [3, 4, 5]
    assert len(module.entry.parameters) == len(mapping.sources)


def test_a_mapping_that_does_not_fit_is_refused():
    from stitch.hlo import parse_hlo

    v, step = _model()
    fn = tf.function(step, jit_compile=True)
    x, y = _batches(1)[0]
    concrete = fn.get_concrete_function(x, y)
    hlo = fn.experimental_get_compiler_ir(x, y, 0.1)(stage="hlo")
    module = parse_hlo(hlo)
    _, leaves = tf_frontend.bound_leaves(step, (x, y), {})
    no_alias = hlo.replace("input_output_alias=", "no_alias=", 1)
    with pytest.raises(tf_frontend.TFMappingError, match="aliased variable updates"):
        tf_frontend.build_mapping(concrete, module, no_alias, leaves)
    with pytest.raises(tf_frontend.TFMappingError, match="argument inputs"):
        tf_frontend.build_mapping(concrete, module, hlo, leaves[:1])


def _train(fn, v, batches):
    results = [_flat(fn(x, y)) for x, y in batches]
    return results, {k: var.numpy() for k, var in v.items()}


def test_stitched_steps_equal_stock_tf():
    v_ref, step_ref = _model()
    v, step = _model()
    batches = _batches(6)
    want, want_vars = _train(tf.function(step_ref, jit_compile=True), v_ref, batches)
    fn = tf_frontend.stitch_function(step, async_compile=False, guard=False)
    got, got_vars = _train(fn, v, batches)
    # call 1: verified (stock ran the step), calls 2..6 stitched
    assert fn.stats.fallbacks == [] and fn.stats.stitched_calls == 5
    assert fn.stats.switched_at_call == 2 and fn.stats.stitched_kernels >= 1
    for a, b in zip(got, want):
        for ga, wb in zip(a, b):
            assert ga.dtype == wb.dtype
            np.testing.assert_allclose(ga, wb, rtol=1e-5, atol=1e-6)
    assert got_vars["count"] == 6
    for k in want_vars:
        np.testing.assert_allclose(got_vars[k], want_vars[k], rtol=1e-5, atol=1e-6)


def test_forced_compile_failure_falls_back_to_tf(monkeypatch):
    monkeypatch.setenv("STITCH_INJECT_FAILURE", "compile")
    v_ref, step_ref = _model()
    v, step = _model()
    batches = _batches(3)
    want, want_vars = _train(tf.function(step_ref, jit_compile=True), v_ref, batches)
    fn = tf_frontend.stitch_function(step, async_compile=False, guard=False)
    got, got_vars = _train(fn, v, batches)
    assert fn.stats.stitched_calls == 0 and len(fn.stats.fallbacks) == 1
    assert "STITCH_INJECT_FAILURE" in fn.stats.fallbacks[0]
    for a, b in zip(got, want):
        for ga, wb in zip(a, b):
            np.testing.assert_array_equal(ga, wb)
    for k in want_vars:
        np.testing.assert_array_equal(got_vars[k], want_vars[k])


def test_a_wrong_stitched_result_is_caught_by_the_first_call_check():
    v_ref, step_ref = _model()
    v, step = _model()
    batches = _batches(3)
    want, want_vars = _train(tf.function(step_ref, jit_compile=True), v_ref, batches)
    fn = tf_frontend.stitch_function(step, async_compile=False, guard=False)
    real_run = tf_frontend.TFStitchedFunction._run_program

    def swapped(self, entry, args, kwargs, call=None):   # a wrong first stitched output
        outs = real_run(self, entry, args, kwargs, call)
        if call is None:                                  # not XLA's own compile
            outs[0] = outs[0] + np.float32(1.0)
        return outs
    fn._run_program = swapped.__get__(fn)
    got, got_vars = _train(fn, v, batches)
    assert fn.stats.stitched_calls == 0
    assert "verify" in fn.stats.fallbacks[0] and "output 0" in fn.stats.fallbacks[0]
    for k in want_vars:
        np.testing.assert_allclose(got_vars[k], want_vars[k], rtol=1e-6)


def test_patched_tf_function_wraps_only_jit_compile():
    original = tf.function
    namespace = type("tf_ns", (), {"function": staticmethod(original)})
    tf_frontend.patch_tensorflow(namespace)              # a stand-in: tf itself untouched
    assert namespace.function.__stitch_original__ is original
    plain = namespace.function(lambda x: x + 1)
    assert not isinstance(plain, tf_frontend.TFStitchedFunction)
    jitted = namespace.function(jit_compile=True)(lambda x: x * 2)
    assert isinstance(jitted, tf_frontend.TFStitchedFunction)
    assert isinstance(namespace.function(lambda x: x, None, True, True),   # positional
                      tf_frontend.TFStitchedFunction)


def _step_with_a_large_constant():
    """A tf2xla module with a 64-element constant: TF's ``stage="hlo"`` text elides it."""
    rng = np.random.default_rng(3)
    w = tf.Variable(rng.standard_normal((16, 16)).astype(np.float32), name="w")
    table = rng.standard_normal((4, 16)).astype(np.float32)

    def step(x):
        h = tf.tanh(x @ w) * tf.constant(table)
        h = h - tf.reduce_max(h, axis=-1, keepdims=True)
        loss = tf.reduce_mean(tf.exp(h))
        w.assign_sub(0.1 * tf.reduce_sum(h) * tf.ones_like(w))
        return loss
    return w, step


def test_large_constants_keep_their_values_in_the_stitched_program():
    """Llama on TF fell back on verify: tf2xla's text elided its rotary tables, which XLA
    read back as zeros. The module stitch compiles carries every constant's values."""
    w, step = _step_with_a_large_constant()
    fn = tf.function(step, jit_compile=True)
    x = np.random.default_rng(4).standard_normal((4, 16)).astype(np.float32)
    text = tf_frontend.tf2xla_hlo_text(fn.experimental_get_compiler_ir(x))
    assert "{...}" not in text
    w_ref, step_ref = _step_with_a_large_constant()
    want = [float(tf.function(step_ref, jit_compile=True)(x)) for _ in range(4)]
    stitched = tf_frontend.stitch_function(step, async_compile=False, guard=False)
    got = [float(stitched(x)) for _ in range(4)]
    assert stitched.stats.fallbacks == [] and stitched.stats.stitched_calls == 3
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(w.numpy(), w_ref.numpy(), rtol=1e-5, atol=1e-6)


def test_an_elided_constant_is_refused_not_compiled_as_zeros():
    from stitch.xla_pass.entry import PassError, PassRequest, compile_hlo_text

    text = """HloModule elided
ENTRY main {
  p = f32[4,16] parameter(0)
  c = f32[4,16] constant({...})
  ROOT m = f32[4,16] multiply(p, c)
}
"""
    with pytest.raises(PassError, match=r"constant\(s\) printed without their values"):
        compile_hlo_text(text, PassRequest("elided", "h100", "cpu"))


def test_spread_check_allows_what_two_xla_versions_disagree_on_and_nothing_more():
    from stitch.frontends.verify import spread_check

    rng = np.random.default_rng(5)
    plain = rng.standard_normal(64).astype(np.float32)
    # an output that is rounding noise: TF's XLA and jax's differ wholly, so may stitch
    noise_plain = (rng.standard_normal(64) * 1e-9).astype(np.float32)
    noise_tf = (rng.standard_normal(64) * 1e-9).astype(np.float32)
    noise_stitched = (rng.standard_normal(64) * 1e-9).astype(np.float32)
    assert spread_check(noise_stitched, noise_plain, noise_tf, 1e-4) is None
    # the compilers agree: the stitched result must match at rtol
    assert spread_check(plain * 1.01, plain, plain, 1e-4) is not None
    # they differ a little (dropout bits): a stitched result far outside that is refused
    tf_out = plain * (1 + 1e-3)
    assert spread_check(plain * (1 + 5e-4), plain, tf_out, 1e-4) is None
    why = spread_check(plain * 1.1, plain, tf_out, 1e-4)
    assert why is not None and "XLA's own compile differs from TF" in why
