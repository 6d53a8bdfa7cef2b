"""The benchmark report's plumbing: marked sections, ratios, verdicts, skip notes."""
from __future__ import annotations

import math

import numpy as np
import pytest

from bench.plans.zoo import PlanRow, Side, Totals, worse_columns
from bench.report import fit_exponent, geomean, write_section
from bench.runtime import markdown as runtime_markdown

DOC = """# Benchmarks

<!-- bench-overview:begin -->
old overview
<!-- bench-overview:end -->

## Someone else's section
keep me

<!-- plan-report:start -->
legacy plan report
<!-- plan-report:end -->

<!-- bench-plans:begin -->
old plans
<!-- bench-plans:end -->

<!-- compile-time:begin -->
another agent's numbers
<!-- compile-time:end -->
"""


def test_write_section_replaces_only_its_own_block(tmp_path):
    path = tmp_path / "b.md"
    path.write_text(DOC)
    write_section(path, "bench-plans", "new plans\n",
                  remove=[("<!-- plan-report:start -->", "<!-- plan-report:end -->")])
    text = path.read_text()
    assert "new plans" in text and "old plans" not in text
    assert "legacy plan report" not in text and "plan-report" not in text
    assert "keep me" in text and "another agent's numbers" in text and "old overview" in text
    assert text.index("keep me") < text.index("new plans") < text.index("another agent")


def test_write_section_places_a_new_block_after_its_anchor_or_at_the_end(tmp_path):
    path = tmp_path / "b.md"
    path.write_text(DOC)
    write_section(path, "bench-gpu", "gpu placeholder", after="bench-overview")
    text = path.read_text()
    assert text.index("<!-- bench-overview:end -->") < text.index("gpu placeholder") < \
        text.index("keep me")
    write_section(path, "bench-runtime", "runtime", after="no-such-section")
    assert path.read_text().rstrip().endswith("<!-- bench-runtime:end -->")
    write_section(path, "bench-runtime", "runtime again")
    assert path.read_text().count("bench-runtime:begin") == 1


def test_geomean_and_exponent():
    assert geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert math.isnan(geomean([]))
    assert fit_exponent([(10, 1.0), (100, 100.0), (1000, 10000.0)]) == pytest.approx(2.0)


def row(model: str, target: str, xla: tuple, stitch: tuple) -> PlanRow:
    def side(v):
        kernels, mem, nbytes, lat, formula = v
        return Side(kernels=kernels, mem_kernels=mem, mem_bytes=nbytes, latency_us=lat,
                    formula_us=formula)
    return PlanRow(model, target, side(xla), side(stitch), 0.0)


def test_worse_columns_name_every_column_stitch_loses():
    good = row("bert_layer_train", "v100", (10, 8, 100, 50, 40), (6, 3, 70, 30, 25))
    assert worse_columns(good) == []
    bad = row("dien_train", "h100", (10, 8, 100, 50, 40), (6, 3, 120, 30, 45))
    got = worse_columns(bad)
    assert [c.split(" ")[0:2] for c in got] == [["mem", "bytes"], ["XLA-formula", "µs"]]


def test_totals_sum_each_side():
    rows = [row("bert_layer_train", "v100", (10, 10, 100, 50, 40), (4, 4, 70, 30, 20)),
            row("dien_train", "v100", (10, 10, 100, 50, 40), (4, 5, 80, 30, 30))]
    assert Totals(rows).sum("mem_kernels") == (20, 9)


def test_runtime_section_says_why_it_was_skipped():
    text = "\n".join(runtime_markdown(None, "stitch.jit not available", lambda _: None))
    assert "Not measured: stitch.jit not available" in text
    assert "`medium` where the zoo has it" in text


def test_long_tables_keep_their_first_rows_in_the_report():
    from bench.report import cap_tables
    rng = np.random.default_rng()
    n = int(rng.integers(13, 40))
    rows = [f"| m{i} | {rng.integers(100)} |" for i in range(n)]
    text = "\n".join(["intro", "", "| model | x |", "|---|---:|", *rows, "", "after"])
    capped = cap_tables(text, most=12).split("\n")
    assert capped[2:16] == ["| model | x |", "|---|---:|", *rows[:12]]
    assert capped[16] == f"_(first 12 of {n} rows; the command without --out prints them all)_"
    assert capped[-1] == "after"
    short = "\n".join(["| a |", "|---|", *rows[:12]])
    assert cap_tables(short, most=12) == short
