"""Kernels are traced back to the user's code: XLA's metadata (op_name, source_file /
source_line, or stack_frame_id into the module's tables) gives each stitched and dropped
kernel its functions and file:line, in the pass's report, STITCH_STATS and the info line."""
from __future__ import annotations

import inspect
import logging
import os
import re

import numpy as np
import pytest

from stitch.hlo import parse_hlo
from stitch.hlo.source_lines import SourceLines, op_name_function


def _module(lines: tuple[int, int, int]) -> str:
    a, b, c = lines
    return f"""HloModule jit_step

FileNames
1 "/home/me/model.py"
2 "/home/me/train.py"

FunctionNames
1 "layer"
2 "step"

FileLocations
1 {{file_name_id=1 function_name_id=1 line={a} end_line={a} column=4 end_column=9}}
2 {{file_name_id=2 function_name_id=2 line={b} end_line={b} column=4 end_column=9}}

StackFrames
1 {{file_location_id=1 parent_frame_id=2}}
2 {{file_location_id=2 parent_frame_id=0}}

ENTRY main {{
  p = f32[8] parameter(0)
  t = f32[8] tanh(p), metadata={{op_name="jit(step)/jit(layer)/tanh" stack_frame_id=1}}
  e = f32[8] exponential(t), metadata={{op_name="jit(step)/exp" source_file="/old/jax.py" source_line={c}}}
  ROOT m = f32[8] multiply(t, e), metadata={{op_name="jit(step)/mul" stack_frame_id=2}}
}}
"""


def test_each_instruction_is_traced_to_its_function_and_line() -> None:
    rng = np.random.default_rng()
    a, b, c = (int(x) for x in rng.integers(1, 5000, 3))
    module = parse_hlo(_module((a, b, c)))
    lines = SourceLines(module)
    by_name = {i.name: i for i in module.entry.instructions}
    assert lines.of(by_name["p"]) is None
    t, e, m = (lines.of(by_name[n]) for n in ("t", "e", "m"))
    assert (t.function, os.path.basename(t.file), t.line) == ("layer", "model.py", a)
    assert (e.function, e.file, e.line) == ("step", "/old/jax.py", c)
    assert (m.function, os.path.basename(m.file), m.line) == ("step", "train.py", b)
    said = lines.where(module.entry.instructions)
    assert said == f"layer (model.py:{a}), step (jax.py:{c}), step (train.py:{b})"


def test_op_name_names_the_innermost_user_function() -> None:
    assert op_name_function("jit(step)/jit(main)/jvp(jit(layer))/sub") == "layer"
    assert op_name_function("jit(f)/tanh") == "f"
    assert op_name_function("") == ""


def _normed(x):
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    var = (centred * centred).mean(axis=-1, keepdims=True)
    return centred / (var + 1e-5) ** 0.5 * 1.5


def test_stitch_jit_reports_where_its_kernels_come_from(caplog) -> None:
    jax = pytest.importorskip("jax")
    import stitch
    from stitch.frontends.switching import stats_records

    f = stitch.jit(_normed, async_compile=False, guard=False, device="cpu")
    x = np.random.default_rng().standard_normal((16, 48)).astype(np.float32)
    with caplog.at_level(logging.INFO, logger="stitch"):
        np.testing.assert_allclose(np.asarray(f(x)), np.asarray(jax.jit(_normed)(x)),
                                   rtol=1e-4, atol=1e-5)
    (report,) = f.programs()
    sources = report.sources()
    assert sources["stitched"], report.placed
    source, first = inspect.getsourcelines(_normed)
    count = len(source)
    here = os.path.basename(__file__)
    for where in sources["stitched"].values():
        m = re.search(rf"_normed \({re.escape(here)}:([\d,]+)\)", where)
        assert m, where
        assert all(first < int(n) < first + count for n in m.group(1).split(",")), where
    mine = [r for r in stats_records() if r["function"].endswith("_normed")]
    assert mine and mine[-1]["where"] == sources
    said = [r.getMessage() for r in caplog.records if "stitched kernels" in r.getMessage()
            and here in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
