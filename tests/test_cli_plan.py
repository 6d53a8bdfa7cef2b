"""``stitch plan``: the table, JSON, HTML and DOT outputs, and how bad input is reported."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from stitch.cli import main
from stitch.explorer.planner import plan
from tests.fixtures import zoo_fixture


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _plan_fixture(model: str, config: str, target: str, planner: str = "beam"):
    gpu = "h100" if target == "h200" else target
    return plan(zoo_fixture(model, config, f"gpu-{gpu}").read_text(), target, planner)


def _without_time(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k != "plan_seconds"}


@pytest.mark.parametrize("model,config,target,planner", [
    ("bert_layer_infer", "tiny", "v100", "beam"),
    ("layer_norm", "full", "a100", "blp"),
    ("asr_infer", "tiny", "h100", "beam"),      # loop bodies: several graphs, weights > 1
])
def test_json_numbers_equal_plan_summary(capsys, model, config, target, planner):
    rc, out, err = _run(capsys, "--model", model, "--config", config, "--target", target,
                        "--planner", planner, "--json")
    assert rc == 0, err
    doc = json.loads(out)                       # stdout is the JSON document and nothing else
    expected = _plan_fixture(model, config, target, planner)
    assert _without_time(doc["summary"]) == _without_time(expected.summary())
    assert len(doc["graphs"]) == len(expected.graphs)
    for got, result in zip(doc["graphs"], expected.graphs):
        assert got["name"] == result.graph.name
        assert got["weight"] == result.stitched.weight
        assert got["report"]["planner"] == planner
        assert got["report"]["status"] == result.report.status
        for side in ("baseline", "stitched"):
            gplan = getattr(result, side)
            assert [k["name"] for k in got[side]] == [k.name for k in gplan.kernels]
            assert [k["ops"] for k in got[side]] == [gplan.ops(k) for k in gplan.kernels]
            assert [k["hbm_bytes"] for k in got[side]] == [k.cost.hbm_bytes
                                                           for k in gplan.kernels]
            for k in got[side]:
                assert k["kind"] in ("fused", "gemm", "opaque", "control")
                assert k["origin"] and k["modeled_us"] >= 0
    if planner == "blp":
        assert all(g["report"]["status"] for g in doc["graphs"])
        assert all("gap" in g["report"] for g in doc["graphs"])


def test_json_reasons(capsys):
    rc, out, _ = _run(capsys, "--model", "bert_layer_infer", "--config", "tiny", "--json",
                      "--reasons")
    assert rc == 0
    doc = json.loads(out)
    assert doc["reasons"] == _plan_fixture("bert_layer_infer", "tiny", "h100").reasons()


def test_table_shows_both_sides_and_kernels(capsys):
    rc, out, _ = _run(capsys, "--model", "bert_layer_infer", "--config", "tiny",
                      "--target", "v100", "--reasons")
    assert rc == 0
    expected = _plan_fixture("bert_layer_infer", "tiny", "v100")
    summary = expected.summary()
    header = next(line for line in out.splitlines() if "baseline" in line and "stitched" in line
                  and "ratio" in line)
    assert header
    kernels_row = next(line for line in out.splitlines() if line.strip().startswith("kernels"))
    assert kernels_row.split()[1:3] == [str(summary["baseline"]["kernels"]),
                                        str(summary["stitched"]["kernels"])]
    for label in ("memory-intensive kernels", "launches per run", "HBM bytes",
                  "modeled µs", "memory-intensive modeled µs"):
        assert label in out
    assert "baseline: XLA's fusions" in out
    assert "planner status per graph" in out
    for kernel in expected.kernels:
        assert re.search(rf"\b{re.escape(kernel.name)}\s", out), kernel.name
    assert "why producers were not fused" in out
    for line in expected.reasons()[:5]:
        assert line in out


def test_table_blp_reports_status_and_gap(capsys):
    rc, out, _ = _run(capsys, "--model", "softmax", "--config", "tiny", "--planner", "blp")
    assert rc == 0
    status = out.split("planner status per graph:")[1].splitlines()[1]
    assert "blp: status" in status and "gap" in status


def test_h200_uses_the_h100_fixture_and_says_so(capsys):
    rc, out, _ = _run(capsys, "--model", "layer_norm", "--config", "tiny", "--target", "h200",
                      "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["summary"]["target"] == "h200"
    assert doc["input"].endswith("tiny.gpu-h100.hlo")
    assert any("h100" in note for note in doc["notes"])
    rc, out, _ = _run(capsys, "--model", "layer_norm", "--config", "tiny", "--target", "h200")
    assert rc == 0 and "note: no XLA fixture for h200" in out


def test_plan_a_file(capsys):
    path = zoo_fixture("softmax", "tiny", "gpu-a100")
    rc, out, _ = _run(capsys, str(path), "--target", "a100", "--json")
    assert rc == 0
    assert json.loads(out)["input"] == str(path)


def _strip_dot_strings(dot: str) -> str:
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', dot)


@pytest.mark.parametrize("model,config", [("log_softmax_xent_train", "tiny"),
                                          ("asr_infer", "tiny")])
def test_html_and_dot_files(capsys, tmp_path, model, config):
    html_path, dot_path = tmp_path / "plan.html", tmp_path / "plan.dot"
    rc, out, err = _run(capsys, "--model", model, "--config", config, "--json",
                        "--html", str(html_path), "--dot", str(dot_path))
    assert rc == 0, err
    json.loads(out)                 # the "wrote ..." notices went to stderr
    assert "wrote HTML" in err and "wrote DOT" in err
    expected = _plan_fixture(model, config, "h100")

    page = html_path.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "<script" not in page and "http://" not in page and "https://" not in page
    for kernel in expected.kernels:
        assert kernel.name in page
    total = sum(len(g.baseline.kernels) + len(g.stitched.kernels) for g in expected.graphs)
    assert page.count('<div class="kernel ') == total

    dot = dot_path.read_text(encoding="utf-8")
    assert dot.startswith("digraph")
    bare = _strip_dot_strings(dot)
    depth = 0
    for ch in bare:
        depth += {"{": 1, "}": -1}.get(ch, 0)
        assert depth >= 0
    assert depth == 0
    kernel_clusters = re.findall(r'subgraph "cluster_g\d+[bs]_k\d+"', dot)
    assert len(kernel_clusters) == len(set(kernel_clusters)) == total
    if shutil.which("dot"):
        done = subprocess.run(["dot", "-Tsvg"], input=dot, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr


def test_pre_fixture_uses_base_fusion(capsys):
    rc, out, err = _run(capsys, "--model", "softmax", "--config", "tiny", "--pre", "--json")
    assert "Traceback" not in err
    if rc == 2:
        # The base fusion pass is being written alongside; a failure must still be clean.
        assert "tiny.pre.hlo" in err
        pytest.xfail(f"planning pre-optimization HLO fails for now: {err.strip()}")
    assert rc == 0
    doc = json.loads(out)
    assert doc["summary"]["baseline_source"] == "base-fusion"
    assert doc["input"].endswith("tiny.pre.hlo")


def test_missing_base_fusion_pass_is_a_clean_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "hlo_passes.base_fusion", None)   # import now fails
    rc, out, err = _run(capsys, "--model", "softmax", "--config", "tiny", "--pre")
    assert rc == 2 and out == ""
    assert "base fusion pass" in err and "tiny.pre.hlo" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv,named", [
    (["no/such/file.hlo"], "no/such/file.hlo"),
    (["--model", "no_such_model"], "no_such_model"),
    (["--model", "softmax", "--target", "x100"], "x100"),
    (["--model", "softmax", "--planner", "greedy"], "greedy"),
    (["softmax"], "--model softmax"),                   # a model name given as a file
    (["--model", "softmax", "--config", "tiny", "--html", "/no/such/dir/p.html"],
     "/no/such/dir/p.html"),
    ([], "an HLO file or --model"),
    (["x.hlo", "--model", "softmax"], "exactly one input"),
    (["x.hlo", "--pre"], "--pre"),
])
def test_errors_exit_2_and_name_the_input(capsys, argv, named):
    rc, _, err = _run(capsys, *argv)
    assert rc == 2
    assert err.startswith("stitch: error:") and named in err
    assert "Traceback" not in err


def test_parse_error_names_the_file(capsys, tmp_path):
    bad = tmp_path / "broken.hlo"
    bad.write_text("HloModule m\n\nENTRY e {\n  p = f32[4] parameter(0)\n  ROOT r = f32[4] nope(p)\n")
    rc, out, err = _run(capsys, str(bad))
    assert rc == 2 and out == ""
    assert "cannot parse" in err and str(bad) in err
    assert "Traceback" not in err
