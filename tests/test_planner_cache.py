"""The plan cache (stitch.explorer.plan_cache): memory and disk hits give the same plan,
a second process skips planning, bad or tampered entries are dropped and the plan is made
again, and an unsafe cache directory turns the disk cache off."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import stitch
from stitch.explorer.plan_cache import PlanCache
from bench.planner.scale import elementwise_chain_hlo

ROOT = Path(__file__).resolve().parents[1]
SOFTMAX = """HloModule softmax
add {
  a = f32[] parameter(0)
  b = f32[] parameter(1)
  ROOT s = f32[] add(a, b)
}
ENTRY main {
  x = f32[64,256] parameter(0)
  y = f32[64,256] parameter(1)
  z = f32[64,256] multiply(x, y)
  e = f32[64,256] exponential(z)
  zero = f32[] constant(0)
  s = f32[64] reduce(e, zero), dimensions={1}, to_apply=add
  sb = f32[64,256] broadcast(s), dimensions={0}
  ROOT d = f32[64,256] divide(e, sb)
}
"""


def _members(plan) -> list[tuple[int, ...]]:
    return [k.members for k in plan.kernels]


def test_memory_hit_returns_the_same_plan(tmp_path):
    cache = PlanCache(tmp_path / "plans")
    first = stitch.plan(SOFTMAX, "h100", cache=cache)
    second = stitch.plan(SOFTMAX, "h100", cache=cache)
    assert cache.misses == 1 and cache.hits == 1
    assert _members(second) == _members(first)


def test_disk_entry_rebuilds_a_valid_plan(tmp_path):
    directory = tmp_path / "plans"
    first = stitch.plan(SOFTMAX, "a100", cache=PlanCache(directory))
    fresh = PlanCache(directory)                       # as a second process would
    again = stitch.plan(SOFTMAX, "a100", cache=fresh)
    assert fresh.disk_hits == 1 and fresh.misses == 0
    assert _members(again) == _members(first)
    assert [k.schedule is not None for k in again.kernels] == \
        [k.schedule is not None for k in first.kernels]
    assert again.summary()["stitched"] == first.summary()["stitched"]
    assert all(g.report.status == "cached" for g in again.graphs)


def test_key_separates_targets_and_planners(tmp_path):
    cache = PlanCache(tmp_path / "plans")
    stitch.plan(SOFTMAX, "h100", cache=cache)
    stitch.plan(SOFTMAX, "v100", cache=cache)
    stitch.plan(SOFTMAX, "h100", "blp", cache=cache)
    assert cache.misses == 3 and cache.hits == 0
    assert len(list((tmp_path / "plans").glob("*.json"))) == 3


def test_entries_are_json_files_only_the_user_can_read(tmp_path):
    directory = tmp_path / "plans"
    stitch.plan(SOFTMAX, "h100", cache=PlanCache(directory))
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    [entry] = list(directory.glob("*.json"))
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600
    data = json.loads(entry.read_text())
    assert data["graphs"][0]["kernels"]
    assert not list(directory.glob(".plan-*"))        # no temp file left behind


def test_an_entry_that_fails_validation_is_dropped_and_planned_again(tmp_path):
    directory = tmp_path / "plans"
    first = stitch.plan(SOFTMAX, "h100", cache=PlanCache(directory))
    [entry] = list(directory.glob("*.json"))
    data = json.loads(entry.read_text())
    # Drop the kernel computing the graph's output: the plan no longer covers the graph.
    data["graphs"][0]["kernels"] = data["graphs"][0]["kernels"][:-1]
    data["graphs"][0]["origins"] = data["graphs"][0]["origins"][:-1]
    assert data["graphs"][0]["kernels"], "the fixture needs at least two kernels"
    entry.write_text(json.dumps(data))
    fresh = PlanCache(directory)
    again = stitch.plan(SOFTMAX, "h100", cache=fresh)
    assert fresh.dropped == 1 and fresh.misses == 1 and fresh.disk_hits == 0
    assert _members(again) == _members(first)
    assert json.loads(entry.read_text())["graphs"][0]["kernels"] == \
        [list(m) for m in _members(first)]               # rewritten


def test_garbage_and_foreign_entries_are_dropped(tmp_path):
    directory = tmp_path / "plans"
    stitch.plan(SOFTMAX, "h100", cache=PlanCache(directory))
    [entry] = list(directory.glob("*.json"))
    for text in ("{not json", json.dumps({"format": 1, "key": "someone else's"}),
                 json.dumps([1, 2, 3])):
        entry.write_text(text)
        fresh = PlanCache(directory)
        plan = stitch.plan(SOFTMAX, "h100", cache=fresh)
        assert fresh.dropped == 1 and fresh.misses == 1
        assert plan.kernels


def test_member_ids_outside_the_graph_are_refused(tmp_path):
    directory = tmp_path / "plans"
    stitch.plan(SOFTMAX, "h100", cache=PlanCache(directory))
    [entry] = list(directory.glob("*.json"))
    data = json.loads(entry.read_text())
    data["graphs"][0]["kernels"][0] = [10_000]
    entry.write_text(json.dumps(data))
    fresh = PlanCache(directory)
    assert stitch.plan(SOFTMAX, "h100", cache=fresh).kernels
    assert fresh.dropped == 1


@pytest.mark.parametrize("graphs", [[[1, 2, 3]], ["graph"], [None]],
                         ids=["list", "string", "null"])
def test_a_malformed_graph_entry_is_dropped_not_kept(tmp_path, graphs):
    """An entry whose graphs are not objects used to raise inside the rebuild (a PlanError
    for the caller) and stay on disk: every later run then stayed stock."""
    directory = tmp_path / "plans"
    first = stitch.plan(SOFTMAX, "h100", cache=PlanCache(directory))
    [entry] = list(directory.glob("*.json"))
    data = json.loads(entry.read_text())
    data["graphs"] = graphs
    entry.write_text(json.dumps(data))
    fresh = PlanCache(directory)
    again = stitch.plan(SOFTMAX, "h100", cache=fresh)
    assert fresh.dropped == 1 and fresh.misses == 1
    assert _members(again) == _members(first)
    assert json.loads(entry.read_text())["graphs"][0]["kernels"] == \
        [list(m) for m in _members(first)]               # rewritten


def test_a_world_writable_directory_turns_the_disk_cache_off(tmp_path):
    directory = tmp_path / "plans"
    directory.mkdir()
    os.chmod(directory, 0o777)
    cache = PlanCache(directory)
    stitch.plan(SOFTMAX, "h100", cache=cache)
    stitch.plan(SOFTMAX, "h100", cache=cache)
    assert not list(directory.iterdir())
    assert cache.hits == 1                              # memory still serves


def test_a_second_process_skips_planning(tmp_path):
    text = elementwise_chain_hlo(300)
    hlo = tmp_path / "chain.hlo"
    hlo.write_text(text)
    script = (
        "import sys, time, stitch\n"
        "from stitch.explorer.plan_cache import default_plan_cache\n"
        "t = open(sys.argv[1]).read()\n"
        "p = stitch.plan(t, 'h100', cache=True)\n"
        "c = default_plan_cache()\n"
        "print(c.misses, c.disk_hits, len(p.kernels))\n")
    env = dict(os.environ, STITCH_CACHE_DIR=str(tmp_path / "cache"))
    runs = [subprocess.run([sys.executable, "-c", script, str(hlo)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    first, second = (r.stdout.split() for r in runs)
    assert first[:2] == ["1", "0"] and second[:2] == ["0", "1"]
    assert first[2] == second[2]
    assert list((tmp_path / "cache" / "plans").glob("*.json"))


def test_module_metadata_attributes_do_not_change_the_fingerprint():
    """XLA GPU's module carries frontend_attributes={fingerprint_before_lhs=...}, a hash taken
    over the module with stitch's request token: new in every process (every plan missed)."""
    from stitch.hlo import parse_hlo
    from stitch.explorer.plan_cache import module_fingerprint
    body = """
ENTRY e {
  p = f32[8,16] parameter(0)
  ROOT n = f32[8,16] negate(p)
}"""
    first = parse_hlo('HloModule m, frontend_attributes={fingerprint_before_lhs="8ad0"}' + body)
    second = parse_hlo('HloModule m, frontend_attributes={fingerprint_before_lhs="28c4"}' + body)
    other = parse_hlo('HloModule m, frontend_attributes={fingerprint_before_lhs="8ad0"}' +
                      body.replace("negate", "exponential"))
    assert module_fingerprint(first) == module_fingerprint(second)
    assert module_fingerprint(first) != module_fingerprint(other)
    assert "fingerprint_before_lhs" in first.attrs["frontend_attributes"]   # module untouched


def test_source_digest_follows_every_source_edit(tmp_path):
    """The version part of the keys: a digest of the code's own files, so an edit (no
    release bump) makes earlier plans and PTX unreachable."""
    from stitch.codegen.cache import source_digest
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "a.py").write_text("X = 1\n")
    (package / "sub" / "b.py").write_text("Y = 2\n")
    (package / "notes.txt").write_text("not code")
    first = source_digest(("pkg",), tmp_path)
    source_digest.cache_clear()
    (package / "notes.txt").write_text("still not code")
    assert source_digest(("pkg",), tmp_path) == first
    source_digest.cache_clear()
    (package / "sub" / "b.py").write_text("Y = 3\n")
    assert source_digest(("pkg",), tmp_path) != first
    source_digest.cache_clear()
    (package / "sub" / "b.py").write_text("Y = 2\n")
    (package / "sub" / "c.py").write_text("")
    assert source_digest(("pkg",), tmp_path) != first


def test_a_code_change_misses_the_plans_of_the_old_code(tmp_path, monkeypatch):
    from stitch.explorer import plan_cache
    directory = tmp_path / "plans"
    stitch.plan(SOFTMAX, "h100", cache=PlanCache(directory))
    assert plan_cache.code_version().startswith(stitch.__version__ + "+src.")
    monkeypatch.setattr(plan_cache, "code_version", lambda: stitch.__version__ + "+src.edited")
    fresh = PlanCache(directory)
    stitch.plan(SOFTMAX, "h100", cache=fresh)
    assert fresh.misses == 1 and fresh.disk_hits == 0
    assert len(list(directory.glob("*.json"))) == 2
