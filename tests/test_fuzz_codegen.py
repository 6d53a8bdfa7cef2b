"""Differential fuzzing of code generation: random memory-intensive HLO modules
(tests/hlo_fuzz.py) planned for a random GPU target, compiled by stitch.compiler.compile and
run on the CPU (poisoned kernel outputs) against the reference evaluator; each stitched
kernel is also lowered with one randomly forced scheme (thread / warp / block) where that is
legal. A failure names its seed (in the test id and the message); reproduce it with
``python -m pytest -q tests/test_fuzz_codegen.py -k 'seed_<N>-'``.

CI runs a fixed set of seeds; STITCH_FUZZ_SEEDS=N runs seeds 0..N-1 instead (and
STITCH_FUZZ_START=S starts at S)."""
from __future__ import annotations

import os

import numpy as np
import pytest

import hlo_passes
from codegen.lower import lower_kernel, reference_values, run_on_host
from hlo_passes.evaluator.interpreter import Evaluator
from stitch import compiler
from stitch.cost.gpu_specs import get_spec
from stitch.schedule import ScheduleError, schedule_kernel
from tests import hlo_fuzz
from tests.fixtures import GPU_TARGETS

# The fixed CI seeds include the ones that found bugs (each also has its own regression
# test in tests/test_lowering*.py or below).
REGRESSION_SEEDS: tuple[int, ...] = ()
CI_SEEDS = tuple(range(24)) + REGRESSION_SEEDS


def _seeds() -> list[int]:
    if "STITCH_FUZZ_SEEDS" in os.environ:
        start = int(os.environ.get("STITCH_FUZZ_START", "0"))
        return list(range(start, start + int(os.environ["STITCH_FUZZ_SEEDS"])))
    return sorted(set(CI_SEEDS))


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm((out - ref).ravel()) / max(np.linalg.norm(ref.ravel()), 1e-5))


def _compare(got, want, tol: float, what: str) -> None:
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape, f"{what} output {i}: shape {g.shape} vs {w.shape}"
        assert np.array_equal(np.isnan(g), np.isnan(w)), \
            f"{what} output {i}: NaN at {np.argwhere(np.isnan(g) != np.isnan(w))[:4].tolist()}"
        err = relative_error(g[~np.isnan(w)], w[~np.isnan(w)])
        assert err <= tol, f"{what} output {i}: relative error {err:.2e} > {tol:.0e}"


def _tolerance(text: str) -> float:
    return 1e-4 if " reduce(" in text else 1e-5


def check_seed(seed: int) -> list[str]:
    """Checks one seed; returns the planner bugs met on the way (compile() worked around
    them: planned again without packing, or an unschedulable kernel run through the
    evaluator), which the test reports as xfail after checking the rest."""
    text, shapes = hlo_fuzz.module(seed)
    rng = np.random.default_rng(seed)
    target = GPU_TARGETS[int(rng.integers(0, len(GPU_TARGETS)))]
    unit = ("thread", "warp", "block")[int(rng.integers(0, 3))]
    what = f"seed {seed} ({target}, forced {unit})"
    module = hlo_passes.parse_hlo(text)
    exe = compiler.compile(module, target, cache=False, poison_outputs=True)
    # A kernel the planner chose but could not schedule runs through the evaluator: a
    # planner bug, reported like plan_notes. Any other fallback is a codegen failure.
    planner_bugs = list(exe.plan_notes) + [f"{f.name}: {f.reason}" for f in exe.fallbacks
                                           if f.error == "ScheduleError"]
    assert all(f.error == "ScheduleError" for f in exe.fallbacks), \
        f"{what}: {exe.fallbacks}\n{text}"
    args = hlo_fuzz.random_args(shapes, seed)
    tol = _tolerance(text)
    try:
        _compare(exe(*args), hlo_passes.evaluate(module, args), tol, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{text}") from None
    # The same kernels with one scheme forced (where the schedule space has it), fed the
    # module's own intermediate values (random ones would leave rsqrt/log domains).
    evaluator = Evaluator(module)
    spec = get_spec(target)
    for g in exe.plan.graphs:
        params = {n.id: args[n.instruction.parameter_number] for n in g.graph.nodes
                  if n.opcode == "parameter"}
        every = reference_values(g.graph, evaluator, [n.id for n in g.graph.nodes], params)
        for k in g.stitched.kernels:
            if k.schedule is None:
                continue
            try:
                forced = schedule_kernel(g.graph, k.members, spec, force={"unit": unit})
            except ScheduleError:
                continue
            lowered = lower_kernel(g.graph, evaluator, forced, f"{k.name}_{unit}")
            got = run_on_host(lowered, g.graph, {v: every[v] for v in lowered.inputs})
            ids = sorted(got)
            try:
                _compare([got[v] for v in ids], [every[v] for v in ids], tol,
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
               "to_apply=max", "reshape(", "transpose(", "slice(", "concatenate("):
        assert op in joined, op
    for t in texts:
        hlo_passes.parse_hlo(t)
    # Reductions over non-minor axes happen.
    assert any("dimensions={0}, to_apply" in t for t in texts)
