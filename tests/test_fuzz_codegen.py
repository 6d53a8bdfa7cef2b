"""Differential fuzzing of code generation: random memory-intensive HLO modules
(tests/hlo_fuzz.py) planned for a random GPU target, compiled by stitch.compiler.compile and
run on the CPU (poisoned kernel outputs) against the reference evaluator; each stitched
kernel is also lowered with one randomly forced scheme (thread / warp / block) where that is
legal, and kernels with a reduction in the global scope (a persistent kernel with grid
barriers). A failure names its seed (in the test id and the message); reproduce it with
``python -m pytest -q tests/test_fuzz_codegen.py -k 'seed_<N>-'``.

CI runs a fixed set of seeds; STITCH_FUZZ_SEEDS=N runs seeds 0..N-1 instead (and
STITCH_FUZZ_START=S starts at S)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pytest

import stitch.hlo
from stitch.codegen.errors import CodegenError
from stitch.codegen.lower import lower_kernel, reference_values, run_on_host
from stitch.hlo.evaluator.interpreter import Evaluator
from stitch.hlo.graph import build_op_graphs
from stitch import compiler
from stitch.cost.gpu_specs import get_spec
from stitch.schedule import ScheduleError, schedule_kernel
from tests import hlo_fuzz
from tests.fixtures import GPU_TARGETS

# The fixed CI seeds include the ones that found bugs (each also has its own regression
# test in tests/test_lowering*.py or below).
# They keep the modules they had when found (no scatter/gather added).
REGRESSION_SEEDS: tuple[int, ...] = (35, 76, 125, 399, 619)
CI_SEEDS = tuple(range(64)) + REGRESSION_SEEDS     # ~25 s on 2 cores


def _seeds() -> list[int]:
    if "STITCH_FUZZ_SEEDS" in os.environ:
        start = int(os.environ.get("STITCH_FUZZ_START", "0"))
        return list(range(start, start + int(os.environ["STITCH_FUZZ_SEEDS"])))
    return sorted(set(CI_SEEDS))


def _norm(x) -> float:
    return float(np.linalg.norm(np.asarray(x, np.float64).ravel()))


@dataclass
class Judge:
    """Compares f32 results with the module evaluated in float64. Random modules can be
    ill-conditioned (x minus its own mean when x is constant along the reduced axes leaves
    pure rounding noise), so an output passes when its distance to the f64 value is within

        tol * ‖ref64‖  +  10 * (the f32 evaluator's own distance)  +  1e-6 * scale

    where scale is the RMS magnitude of the largest intermediate value (f64) times
    sqrt(output size): rounding noise left by cancelling values of that size is below it,
    a wrong element is not."""
    tol: float
    scale: float            # RMS per element of the largest intermediate value

    @staticmethod
    def of(values64: dict[int, np.ndarray], tol: float) -> "Judge":
        rms = [_norm(v) / np.sqrt(max(np.size(v), 1)) for v in values64.values()
               if np.asarray(v).dtype.kind == "f"]
        finite = [r for r in rms if np.isfinite(r)]
        return Judge(tol, max(finite, default=1.0))

    def check(self, got: list, want32: list, want64: list, what: str) -> None:
        assert len(got) == len(want32) == len(want64), what
        for i, (g, w, x) in enumerate(zip(got, want32, want64)):
            g, w, x = np.asarray(g), np.asarray(w), np.asarray(x, np.float64)
            assert g.shape == w.shape, f"{what} output {i}: shape {g.shape} vs {w.shape}"
            assert np.array_equal(np.isnan(g), np.isnan(w)), \
                f"{what} output {i}: NaN at {np.argwhere(np.isnan(g) != np.isnan(w))[:4].tolist()}"
            ok = ~np.isnan(w) & ~np.isnan(x)
            d_kernel = _norm(g[ok].astype(np.float64) - x[ok])
            d_eval = _norm(w[ok].astype(np.float64) - x[ok])
            bound = self.tol * _norm(x[ok]) + 10 * d_eval + 1e-6 * self.scale * np.sqrt(ok.sum())
            assert d_kernel <= bound, (
                f"{what} output {i}: |kernel - f64| {d_kernel:.3e} > {bound:.3e} (|f32 "
                f"evaluator - f64| {d_eval:.3e}, |f64| {_norm(x[ok]):.3e}, relative to the "
                f"f32 evaluator {_norm(g[ok] - w[ok]) / max(_norm(w[ok]), 1e-30):.2e})")


def _tolerance(text: str) -> float:
    return 1e-4 if " reduce(" in text else 1e-5


def _as_f64(text: str) -> stitch.hlo.HloModule:
    return stitch.hlo.parse_hlo(text.replace("f32[", "f64["))


def check_seed(seed: int) -> list[str]:
    """Checks one seed; returns the planner bugs met on the way (compile() worked around
    them: planned again without packing, or an unschedulable kernel run through the
    evaluator), which the test reports as xfail after checking the rest."""
    text, shapes = hlo_fuzz.module(seed, index_ops=seed not in REGRESSION_SEEDS)
    rng = np.random.default_rng(seed)
    target = GPU_TARGETS[int(rng.integers(0, len(GPU_TARGETS)))]
    unit = ("thread", "warp", "block")[int(rng.integers(0, 3))]
    what = f"seed {seed} ({target}, forced {unit})"
    module = stitch.hlo.parse_hlo(text)
    exe = compiler.compile(module, target, cache=False, poison_outputs=True)
    # A kernel the planner chose but could not schedule runs through the evaluator: a
    # planner bug, reported like plan_notes. Any other fallback is a codegen failure.
    planner_bugs = list(exe.plan_notes) + [f"{f.name}: {f.reason}" for f in exe.fallbacks
                                           if f.error == "ScheduleError"]
    assert all(f.error == "ScheduleError" for f in exe.fallbacks), \
        f"{what}: {exe.fallbacks}\n{text}"
    args = hlo_fuzz.random_args(shapes, seed)
    tol = _tolerance(text)
    module64 = _as_f64(text)
    evaluator, evaluator64 = Evaluator(module), Evaluator(module64)
    args64 = [a.astype(np.float64) if a.dtype.kind == "f" else a for a in args]
    graph = exe.graphs[0]
    graph64 = build_op_graphs(module64)[0]
    assert len(exe.graphs) == 1 and len(graph64.nodes) == len(graph.nodes)
    params = {n.id: n.instruction.parameter_number for n in graph.nodes
              if n.opcode == "parameter"}
    every = [n.id for n in graph.nodes]
    values = reference_values(graph, evaluator, every, {v: args[p] for v, p in params.items()})
    values64 = reference_values(graph64, evaluator64, every,
                                {v: args64[p] for v, p in params.items()})
    judge = Judge.of(values64, tol)
    try:
        judge.check(exe(*args), stitch.hlo.evaluate(module, args),
                    stitch.hlo.evaluate(module64, args64), what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{text}") from None
    # The same kernels with one scheme forced (where the schedule space has it), fed the
    # module's own intermediate values (random ones would leave rsqrt/log domains).
    # Kernels with a reduction are also lowered in the global scope (a persistent kernel
    # with grid barriers) where it applies.
    spec = get_spec(target)
    kernels = [k for k in (exe.plan.graphs[0].stitched.kernels if exe.plan else [])
               if k.schedule is not None]
    forcing = [(k, {"unit": unit}, unit) for k in kernels] + [
        (k, {"scope": "global"}, "global") for k in kernels
        if any(graph.nodes[v].opcode == "reduce" for v in k.members)]
    for k, force, label in forcing:
        try:
            forced = schedule_kernel(graph, k.members, spec, force=force)
        except ScheduleError:
            continue
        try:
            lowered = lower_kernel(graph, evaluator, forced, f"{k.name}_{label}",
                                   in_place=True)
        except CodegenError as exc:
            if label == "global" and "global" in str(exc):
                continue        # a reducer or atomic scatter the global scope refuses
            raise
        inputs = {v: values[v] for v in lowered.inputs}
        got = run_on_host(lowered, graph, inputs, opt=0)
        want64 = reference_values(graph64, evaluator64, sorted(k.members),
                                  {v: np.asarray(x, np.float64) for v, x in inputs.items()})
        ids = sorted(got)
        try:
            judge.check([got[v] for v in ids], [values[v] for v in ids],
                        [want64[v] for v in ids],
                        f"{what} kernel {k.name} schemes {lowered.schemes}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{text}") from None
    return planner_bugs


@pytest.mark.parametrize("seed", _seeds(), ids=lambda s: f"seed_{s}-")
def test_random_module_compiles_and_matches_the_evaluator(seed):
    notes = check_seed(seed)
    if notes:
        # Code generation was checked on the replanned module; the planner bug stays visible.
        pytest.xfail(f"seed {seed}: planner bug worked around: {notes}")


def test_generator_is_deterministic_and_covers_the_op_set():
    texts = [hlo_fuzz.module(s)[0] for s in range(60)]
    assert texts[:5] == [hlo_fuzz.module(s)[0] for s in range(5)]
    joined = "\n".join(texts)
    for op in ("exponential(", "log(", "rsqrt(", "tanh(", "divide(", "broadcast(", "reduce(",
               "to_apply=max", "reshape(", "transpose(", "slice(", "concatenate(", "reverse(",
               "pad(", "select(", "compare(", "scatter(", "gather(", "iota("):
        assert op in joined, op
    for t in texts:
        stitch.hlo.parse_hlo(t)
    # Reductions over non-minor axes happen.
    assert any("dimensions={0}, to_apply" in t for t in texts)
    # Both scatter forms: one update per row at iota/label vectors, and colliding ids.
    assert any("scatter_dims_to_operand_dims={0,1}" in t for t in texts)
    assert any("scatter_dims_to_operand_dims={0}," in t for t in texts)
    # Regression seeds keep their original modules.
    assert "scatter(" not in hlo_fuzz.module(76, index_ops=False)[0]


def test_judge_catches_a_wrong_or_unwritten_element():
    """The comparison can fail: one wrong element or one NaN (an unwritten poisoned
    element) in an otherwise exact output is caught, rounding noise is not."""
    rng = np.random.default_rng(0)
    ref64 = rng.standard_normal((40, 30))
    ref32 = ref64.astype(np.float32)
    judge = Judge(1e-4, scale=float(np.sqrt(np.mean(ref64 ** 2))))
    judge.check([ref32 * (1 + 1e-7)], [ref32], [ref64], "noise")
    wrong = ref32.copy()
    wrong[7, 3] += 0.5
    with pytest.raises(AssertionError, match="kernel - f64"):
        judge.check([wrong], [ref32], [ref64], "wrong")
    unwritten = ref32.copy()
    unwritten[0, 0] = np.nan
    with pytest.raises(AssertionError, match="NaN at"):
        judge.check([unwritten], [ref32], [ref64], "unwritten")
