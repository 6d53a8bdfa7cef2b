"""stitch.compiler.compile: every zoo model (tiny pre-optimization fixture) x GPU target's
plan, run on the CPU with poisoned kernel outputs against the reference evaluator and jax on
fresh random inputs; the PTX of every kernel through ptxas for the target's arch; argument,
target and device errors; the compile cache (warm hits, corrupt entries rebuilt); fallbacks
(a kernel that fails to lower or build, a planner that fails) with their reasons."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import stitch.hlo
from stitch.codegen.cache import CompileCache
from stitch.codegen.errors import CodegenError, ToolchainError
from stitch import compiler
from stitch.compiler import CompileError
from stitch.errors import StitchError
from tests.fixtures import BF16_TOLERANCE, DATA, GPU_TARGETS, uses_bf16, zoo_fixture

jax = pytest.importorskip("jax")
models = pytest.importorskip("stitch.models")

# transformer_train compiles ~110 kernels (~25 s per target on a 2-core CPU) from the same
# layer-norm / softmax / bias-GELU blocks bert_layer_train has: h100 only, for test time.
LARGE = {"transformer_train": ("h100",), "transformer_train_bf16": ("h100",)}
# Planner bugs compile() works around (planned again without packing); the note must say so.
# (log_softmax_xent_train was one until base fusion gave recomputed producers a writer.)
KNOWN_PLANNER_FAILURES: set[str] = set()
# Codegen limits a kernel may still fall back for (it then runs in the evaluator, checked
# like the rest): the embedding gradients of the *_bf16 models scatter-add bf16 rows with
# collisions, and codegen has no bf16 atomic add yet.
KNOWN_FALLBACKS = ("atomic scatter-add of bf16 is not generated",)
_HEAVY_OPS = ("reduce", "dot", "convolution", "custom-call", "reduce-window", "while")

CASES = [(m, t) for m in models.list_models() for t in LARGE.get(m, GPU_TARGETS)]
IDS = [f"{m}-{t}" for m, t in CASES]


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """‖out − ref‖ / ‖ref‖ (‖ref‖ floored at 1e-5: rounding noise around an exact zero is
    compared absolutely)."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    assert out.shape == ref.shape
    return float(np.linalg.norm((out - ref).ravel()) / max(np.linalg.norm(ref.ravel()), 1e-5))


def tolerance(module) -> float:
    """1e-5 for elementwise-only modules; 1e-4 where reductions (or GEMMs) reorder sums;
    BF16_TOLERANCE for modules that compute in bf16 (tests/fixtures.py says why)."""
    if uses_bf16(module):
        return BF16_TOLERANCE
    heavy = any(i.opcode in _HEAVY_OPS for _, i in module.instructions())
    return 1e-4 if heavy else 1e-5


def assert_close(got: list, want: list, tol: float, what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} outputs, {len(want)} expected"
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, \
            f"{what} output {i}: {g.dtype}{g.shape} vs {w.dtype}{w.shape}"
        if w.dtype.kind in "fc" or w.dtype.name == "bfloat16":
            assert np.array_equal(np.isnan(g), np.isnan(w)), f"{what} output {i}: NaNs differ"
            ok = ~np.isnan(w)
            err = relative_error(g[ok], w[ok])
            assert err <= tol, f"{what} output {i}: relative error {err:.2e} > {tol:.0e}"
        else:
            assert np.array_equal(g, w), f"{what} output {i} differs"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("stitch-cache")


@pytest.fixture(scope="module")
def compiled(cache_dir):
    """(model, target) -> Executable, compiled once per module (the PTX test reuses it)."""
    memo: dict[tuple[str, str], compiler.Executable] = {}

    def get(model: str, target: str) -> compiler.Executable:
        if (model, target) not in memo:
            text = zoo_fixture(model, "tiny", "pre").read_text()
            memo[model, target] = compiler.compile(text, target, cache=CompileCache(cache_dir),
                                                   poison_outputs=True)
        return memo[model, target]
    return get


def _seed(*parts: str) -> int:
    return zlib.crc32("/".join(parts).encode())


@pytest.mark.parametrize("model, target", CASES, ids=IDS)
def test_zoo_model_matches_evaluator_and_jax(model, target, compiled):
    exe = compiled(model, target)
    inst = models.build(model, "tiny")
    # The fixture's ENTRY parameters are the zoo fn's flattened args, in order.
    params = exe.module.entry.parameters
    assert [tuple(p.shape.dims) for p in params] == [tuple(s.shape) for s in inst.arg_specs]
    args = inst.random_args(_seed(model, target))
    assert all(np.any(a != 0) for a in args if a.size > 1), "inputs must not be zeros"
    assert not [f for f in exe.fallbacks
                if not any(known in f.reason for known in KNOWN_FALLBACKS)], exe.fallbacks
    if model in KNOWN_PLANNER_FAILURES:
        assert all("without packing" in n for n in exe.plan_notes), exe.plan_notes
    else:
        assert not exe.plan_notes
    got = exe(*args)
    tol = tolerance(exe.module)
    assert_close(got, stitch.hlo.evaluate(exe.module, args), tol, f"{model}/{target} vs evaluator")
    want = [np.asarray(r) for r in jax.tree_util.tree_leaves(jax.jit(inst.fn)(*args))]
    assert_close(got, want, tol, f"{model}/{target} vs jax")
    if not model.startswith("gemm_chain"):
        assert exe.kernels, f"{model}: no stitched kernel ran on the host"


# Until 2026-11-24 ptxas (CUDA 13) spilled 16 bytes at 31 registers on sm_90 in one packed
# bf16 layer-norm kernel of bert_layer_train_bf16 (an xfail here); the refined plans (repack
# moves) no longer form that kernel, and every case must assemble without spills again.
@pytest.mark.parametrize("model, target", CASES, ids=IDS)
def test_zoo_ptx_assembles_without_spills(model, target, compiled):
    """Every kernel's PTX for its target's arch (v100: sm_70, a100: sm_80, h100: sm_90)
    through ptxas: no spills, no stack."""
    from stitch.codegen.toolchain import find_ptxas
    from stitch.codegen.nvptx import default_libdevice_path

    exe = compiled(model, target)
    if default_libdevice_path() is None:
        pytest.skip("no libdevice")
    try:
        find_ptxas(exe.arch)
    except ToolchainError as exc:
        pytest.skip(f"no ptxas for {exe.arch}: {exc}")
    reports = exe.ptxas()
    assert set(reports) == {k.name for k in exe.kernels}
    for name, r in reports.items():
        assert r.arch == exe.arch and r.registers > 0, (name, r)
        assert (r.spill_store_bytes, r.spill_load_bytes) == (0, 0), (name, r)
        assert r.stack_bytes == 0, (name, r)
        assert r.shared_bytes <= 48 * 1024, (name, r)


# ---------------------------------------------------------------------------- the API

LAYER_NORM = DATA / "layer_norm" / "tiny.pre.hlo"


def _layer_norm_args(seed: int = 3) -> list[np.ndarray]:
    return models.build("layer_norm", "tiny").random_args(seed)


def test_argument_count_and_shape_errors_name_the_parameter():
    exe = compiler.compile(LAYER_NORM.read_text(), "h100", cache=False)
    args = _layer_norm_args()
    with pytest.raises(CompileError, match="3 arguments expected, got 2"):
        exe(*args[:2])
    bad = [args[0], args[1][:-1], args[2]]
    name = exe.module.entry.parameters[1].name
    with pytest.raises(CompileError, match=rf"parameter 1 \({name}\).*float32\[32\].*\[31\]"):
        exe(*bad)
    with pytest.raises(CompileError, match=r"parameter 0 .*float64"):
        exe(args[0].astype(np.float64), *args[1:])
    assert issubclass(CompileError, StitchError)


def test_unknown_target_device_and_bad_text():
    text = LAYER_NORM.read_text()
    with pytest.raises(CompileError, match="unknown target 'p100'"):
        compiler.compile(text, "p100", cache=False)
    with pytest.raises(CompileError, match="device 'gpu' is not supported"):
        compiler.compile(text, "h100", device="gpu", cache=False)
    with pytest.raises(CompileError, match="cannot parse"):
        compiler.compile("HloModule broken\nENTRY main {\n  x = f32[ parameter(0)\n}\n", "h100",
                         cache=False)


BERT = DATA / "bert_layer_train" / "tiny.pre.hlo"


def test_second_compile_is_served_from_the_cache(tmp_path):
    text = DATA.joinpath("bert_layer_infer", "tiny.pre.hlo").read_text()
    args = models.build("bert_layer_infer", "tiny").random_args(11)
    cold = compiler.compile(text, "a100", cache=CompileCache(tmp_path), poison_outputs=True)
    assert cold.kernels and cold.stats.host_cache_hits == 0
    warm = compiler.compile(text, "a100", cache=CompileCache(tmp_path), poison_outputs=True)
    assert warm.stats.host_cache_hits == len(warm.kernels) == len(cold.kernels)
    assert all(k.from_cache for k in warm.kernels)
    module = stitch.hlo.parse_hlo(text)
    want = stitch.hlo.evaluate(module, args)
    assert_close(warm(*args), want, 1e-4, "warm")
    assert_close(cold(*args), want, 1e-4, "cold")


def test_ptx_is_served_from_the_cache(tmp_path):
    from stitch.codegen.nvptx import default_libdevice_path
    if default_libdevice_path() is None:
        pytest.skip("no libdevice")
    text = DATA.joinpath("softmax", "tiny.pre.hlo").read_text()
    cold = compiler.compile(text, "h100", cache=CompileCache(tmp_path))
    ptx = cold.ptx
    assert cold.stats.ptx_cache_hits == 0 and all(".entry" in p for p in ptx.values())
    warm = compiler.compile(text, "h100", cache=CompileCache(tmp_path))
    assert warm.ptx == ptx and warm.stats.ptx_cache_hits == len(warm.kernels)
    assert all("sm_90" in k.ptx_s for k in warm.kernels)


def test_a_corrupt_cache_entry_is_rebuilt(tmp_path):
    text = DATA.joinpath("bert_layer_infer", "tiny.pre.hlo").read_text()
    args = models.build("bert_layer_infer", "tiny").random_args(12)
    cold = compiler.compile(text, "h100", cache=CompileCache(tmp_path))
    entries = sorted(tmp_path.glob("*.bin"))
    assert len(entries) == len(cold.kernels) >= 2
    blob = bytearray(entries[0].read_bytes())
    blob[-1] ^= 0xFF                      # a flipped bit in the object code
    entries[0].write_bytes(bytes(blob))
    entries[1].write_bytes(entries[1].read_bytes()[:20])    # a torn write
    cache = CompileCache(tmp_path)
    rebuilt = compiler.compile(text, "h100", cache=cache, poison_outputs=True)
    assert cache.stats.corrupt == 2
    assert rebuilt.stats.host_cache_hits == len(rebuilt.kernels) - 2
    module = stitch.hlo.parse_hlo(text)
    assert_close(rebuilt(*args), stitch.hlo.evaluate(module, args), 1e-4, "rebuilt")
    again = compiler.compile(text, "h100", cache=CompileCache(tmp_path))
    assert again.stats.host_cache_hits == len(again.kernels)


@pytest.mark.parametrize("where, error", [("lower_kernel", CodegenError),
                                          ("lower_kernel", RuntimeError),
                                          ("compile_host", CodegenError)])
def test_a_kernel_that_fails_runs_through_the_evaluator(monkeypatch, where, error):
    text = BERT.read_text()
    real = getattr(compiler, where)
    plan_kernels: list[str] = []

    def flaky(*a, **kw):
        name = a[3] if where == "lower_kernel" else a[0].name
        plan_kernels.append(name)
        if len(plan_kernels) == 2:           # the second kernel fails
            raise error(f"forced failure of {name}")
        return real(*a, **kw)
    monkeypatch.setattr(compiler, where, flaky)
    exe = compiler.compile(text, "h100", cache=False, poison_outputs=True)
    assert len(exe.fallbacks) == 1, exe.fallbacks
    fb = exe.fallbacks[0]
    assert "forced failure" in fb.reason and fb.error == error.__name__
    assert fb.reason.startswith("lowering" if where == "lower_kernel" else "host build")
    assert fb.name not in {k.name for k in exe.kernels} and exe.kernels
    assert exe.summary()["fallbacks"] == [(fb.name, fb.reason)]
    args = models.build("bert_layer_train", "tiny").random_args(5)
    module = stitch.hlo.parse_hlo(text)
    assert_close(exe(*args), stitch.hlo.evaluate(module, args), 1e-4, "with a fallback")


@pytest.mark.parametrize("failures", [1, 2])
def test_a_failing_planner_is_retried_then_given_up(monkeypatch, failures):
    real = compiler.make_plan
    calls: list[bool] = []

    def flaky(module, target, options=None):
        calls.append(options.packing)
        if len(calls) <= failures:
            raise ValueError("graph main: the kernels form a cycle")
        return real(module, target, options=options)
    monkeypatch.setattr(compiler, "make_plan", flaky)
    text = DATA.joinpath("log_softmax_xent", "tiny.pre.hlo").read_text()
    exe = compiler.compile(text, "h100", cache=False, poison_outputs=True)
    assert calls == [True, False]
    assert len(exe.plan_notes) == failures and "form a cycle" in exe.plan_notes[0]
    if failures == 1:
        assert exe.plan is not None and exe.kernels
    else:
        assert exe.plan is None and not exe.kernels     # all through the evaluator
    args = models.build("log_softmax_xent", "tiny").random_args(8)
    module = stitch.hlo.parse_hlo(text)
    assert_close(exe(*args), stitch.hlo.evaluate(module, args), 1e-4, "replanned")


def test_poisoned_outputs_expose_a_kernel_that_writes_nothing():
    """The check above can fail: a kernel that never stores leaves NaN in its outputs."""
    exe = compiler.compile(LAYER_NORM.read_text(), "h100", cache=False, poison_outputs=True)
    args = _layer_norm_args(4)
    want = stitch.hlo.evaluate(exe.module, args)
    exe.kernels[0].host = lambda *arrays: None      # writes nothing
    got = exe(*args)
    assert np.isnan(got[0]).all()
    with pytest.raises(AssertionError, match="NaNs differ"):
        assert_close(got, want, 1e-4, "no stores")
