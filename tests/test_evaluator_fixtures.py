"""The committed fixtures evaluated: TF steps reproduce the outputs TF computed, and XLA
GPU's optimized modules (layouts, bitcasts, fusions, cuBLAS / cuDNN calls) compute what the
pre-optimisation HLO computes."""
from __future__ import annotations

import glob
import os
import zlib

import numpy as np
import pytest

from stitch.hlo.evaluator import evaluate
from stitch.hlo.evaluator.dtypes import numpy_dtype
from stitch.hlo.parser import parse_hlo
from tests.fixtures import BF16_TOLERANCE, DATA as FIXTURES, uses_bf16
from tests.test_evaluator import assert_close

DATA = str(FIXTURES)

TF_FIXTURES = sorted(glob.glob(os.path.join(DATA, "tf", "*.npz")))


@pytest.mark.parametrize("path", TF_FIXTURES, ids=[os.path.basename(p)[:-4] for p in TF_FIXTURES])
def test_tensorflow_fixtures_reproduce_their_outputs(path):
    data = np.load(path)
    args = [data[f"arg{i}"] for i in range(sum(k.startswith("arg") for k in data))]
    refs = [data[f"out{i}"] for i in range(sum(k.startswith("out") for k in data))]
    for ext in ("hlo", "optimized_hlo"):
        hlo = path[:-4] + "." + ext
        if not os.path.exists(hlo):
            continue
        with open(hlo) as fh:
            out = evaluate(parse_hlo(fh.read()), args)
        assert len(out) == len(refs)
        for i, (o, r) in enumerate(zip(out, refs)):
            assert_close(o, r, 1e-4, f"{os.path.basename(hlo)} output {i}")


def _gpu_fixture_dirs() -> list[str]:
    dirs = []
    for pre in sorted(glob.glob(os.path.join(DATA, "*", "tiny.pre.hlo"))):
        if glob.glob(os.path.join(os.path.dirname(pre), "tiny.gpu-*.hlo")):
            dirs.append(os.path.dirname(pre))
    return dirs


@pytest.mark.parametrize("folder", _gpu_fixture_dirs(), ids=os.path.basename)
def test_gpu_optimized_fixtures_agree_with_their_source(folder):
    """XLA GPU dumps (layouts, bitcasts, fusions, cuBLAS / cuDNN calls) compute what the
    pre-optimisation HLO computes."""
    with open(os.path.join(folder, "tiny.pre.hlo")) as fh:
        pre = parse_hlo(fh.read())
    rng = np.random.default_rng(zlib.crc32(folder.encode()))
    args = []
    for param in pre.entry.parameters:
        dtype = numpy_dtype(param.shape.element_type)
        if np.issubdtype(dtype, np.integer):
            args.append(rng.integers(0, 4, param.shape.dims).astype(dtype))
        else:
            args.append((rng.standard_normal(param.shape.dims) * 0.5).astype(dtype))
    ref = evaluate(pre, args)
    # bf16 modules: XLA GPU fuses and reorders bf16 arithmetic (each op rounds), so the
    # two programs agree to bf16 rounding (tests.fixtures.BF16_TOLERANCE), not f32's.
    tol = BF16_TOLERANCE if uses_bf16(pre) else 1e-4
    for path in sorted(glob.glob(os.path.join(folder, "tiny.gpu-*.hlo"))):
        with open(path) as fh:
            out = evaluate(parse_hlo(fh.read()), args)
        assert len(out) == len(ref)
        for i, (o, r) in enumerate(zip(out, ref)):
            assert_close(o, r, tol, f"{os.path.relpath(path, DATA)} output {i}")
