"""A kernel's buffers are arrays: an op that reads or writes a tuple of several arrays whole
(XLA's sharding-propagation test module that copies a stable two-operand sort's tuple,
hlo_fixtures/data/regress/xla_corpus_07428.hlo, shapes cut from 1024x1024 to 64x128) is refused at
compile time and left to the evaluator / XLA, so the compiled program runs and computes what
the module computes. Before, the copy became a kernel whose input was bound as the tuple's
first leaf, and every call raised "param 'in0_sort_0' wants 8192 elements, got 16384"."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import stitch.hlo
import stitch
from hlo_fixtures import DATA

MODULE = DATA / "regress" / "xla_corpus_07428.hlo"


def _input(seed: int) -> np.ndarray:
    # Repeated values: the stable sort's tie order shows in the iota it carries.
    return np.random.default_rng(seed).integers(-4, 4, (64, 128)).astype(np.float32)


def test_stitch_compile_runs_a_tuple_copy_of_a_sort():
    module = stitch.hlo.parse_hlo(MODULE.read_text())
    exe = stitch.compile(module, "h100", "cpu", cache=False, poison_outputs=True)
    for seed in (0, 1):
        x = _input(seed)
        got = exe(x)
        want = stitch.hlo.evaluate(module, [x])
        assert len(got) == len(want) == 2
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), w)


def test_the_pass_compiles_a_tuple_copy_of_a_sort_that_runs():
    pytest.importorskip("jax")
    from stitch.xla_pass.entry import PassRequest, compile_hlo_text
    text = MODULE.read_text()
    module = stitch.hlo.parse_hlo(text)
    call, _ = compile_hlo_text(text, PassRequest("tuple_copy_sort", "h100", "cpu"))
    x = _input(2)
    for g, w in zip(call(x), stitch.hlo.evaluate(module, [x])):
        np.testing.assert_array_equal(np.asarray(g), w)
