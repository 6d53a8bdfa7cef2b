"""A module the pass saw before, under the same settings and code, takes the stored result
(stitch.xla_pass.result_store): the same stitched module, kernels and figures as the whole
pass, and the same numbers; any change of module or setting, and any stored entry that does
not stand for this compile, runs the whole pass."""
from __future__ import annotations

import json
import zlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from stitch.frontends.job_decisions import program_digest  # noqa: E402
from stitch.frontends.verify import compare_trees  # noqa: E402
from stitch.xla_pass import kernel_builds, result_store  # noqa: E402
from stitch.xla_pass.pass_request import untagged_attributes  # noqa: E402
from tests.fixtures import compile_with_cpu_pass  # noqa: E402

RTOL = 1e-4


def _compile(fn, *args):
    """``compile_with_cpu_pass``, its result's store written before the next compile."""
    got = compile_with_cpu_pass(fn, *args)
    result_store.wait_for_writes()
    return got


def _softmax_ln(x, w):
    y = jax.nn.softmax(jnp.tanh(x) * w, axis=-1)
    m = y.mean(-1, keepdims=True)
    v = ((y - m) ** 2).mean(-1, keepdims=True)
    return (y - m) * jax.lax.rsqrt(v + 1e-5)


@pytest.fixture
def store_on(monkeypatch, tmp_path):
    """The result store on, in a fresh compile cache."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("STITCH_PASS_RESULTS", "1")
    monkeypatch.setenv("STITCH_CACHE_DIR", str(cache))
    monkeypatch.setattr(kernel_builds, "_CACHE", None)
    return cache


def _inputs(shape, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape).astype(np.float32), \
        rng.standard_normal(shape).astype(np.float32)


def _figures(report) -> dict:
    """The report's figures a replay must repeat (not its timings or lowering counts)."""
    return {k: v for k, v in report.summary().items()
            if not k.endswith("_s") and k not in ("from_store", "kernels_lowered",
                                                   "lowerings_reused",
                                                   "lowerings_from_cache")}


def test_the_same_module_again_takes_the_stored_result(store_on):
    seed = int(np.random.default_rng().integers(1 << 30))
    x, w = _inputs((32, 64), seed)
    first, compiled_first = _compile(_softmax_ln, x, w)
    again, compiled_again = _compile(_softmax_ln, x, w)
    assert not first.from_store and again.from_store
    assert first.kernels_stitched >= 1
    assert _figures(again) == _figures(first)
    assert again.placed == first.placed and again.skipped == first.skipped
    assert again.where == first.where
    # The same kernels, names included: processes of a job agree on the program.
    assert program_digest(again) == program_digest(first)
    assert [k.target.name for k in again.kernels] == [k.target.name for k in first.kernels]
    # The module XLA compiled is the same but for the request's own token.
    assert _untokened(compiled_again.as_text()) == _untokened(compiled_first.as_text())
    x2, w2 = _inputs((32, 64), seed + 1)
    want = jax.jit(_softmax_ln)(x2, w2)
    for compiled in (compiled_first, compiled_again):
        why = compare_trees(compiled(x2, w2), want, RTOL)
        assert why is None, why


def _untokened(text: str) -> str:
    import re
    return re.sub(r'stitch\.request="[0-9a-f]+"', "", text)


def test_another_module_or_an_output_setting_runs_the_whole_pass(store_on, monkeypatch):
    x, w = _inputs((32, 64), 1)
    assert not _compile(_softmax_ln, x, w)[0].from_store
    # Where the log goes changes nothing the pass hands back: the stored result stands.
    monkeypatch.setenv("STITCH_LOG", "warning")
    assert _compile(_softmax_ln, x, w)[0].from_store
    # A setting the plan depends on, or another shape, is another result.
    monkeypatch.setenv("STITCH_SEGMENT_ROWS", "0")
    assert not _compile(_softmax_ln, x, w)[0].from_store
    monkeypatch.delenv("STITCH_SEGMENT_ROWS")
    x3, w3 = _inputs((16, 64), 2)
    report, compiled = _compile(_softmax_ln, x3, w3)
    assert not report.from_store
    why = compare_trees(compiled(x3, w3), jax.jit(_softmax_ln)(x3, w3), RTOL)
    assert why is None, why
    monkeypatch.setenv("STITCH_PASS_RESULTS", "0")
    assert not _compile(_softmax_ln, x, w)[0].from_store


def _stored_as(monkeypatch, change):
    """Stored results pass through ``change(data)`` before they are written."""
    real = result_store.result_to_bytes

    def changed(new_text, report_data, kernels):
        data = json.loads(zlib.decompress(real(new_text, report_data, kernels)))
        change(data)
        return zlib.compress(json.dumps(data).encode())
    monkeypatch.setattr(result_store, "result_to_bytes", changed)


@pytest.mark.parametrize("what", ["target", "groups", "format", "kernels"])
def test_a_stored_result_that_does_not_stand_runs_the_whole_pass(store_on, monkeypatch,
                                                                 what, caplog):
    def change(data):
        if what == "target":      # a kernel that no longer builds as the module calls it
            data["kernels"][0]["target"] = "stitch_cpu_someone_elses_0000"
        elif what == "groups":    # an entry that is not one
            del data["groups"]
        elif what == "kernels":   # a module calling targets the entry does not make
            data["kernels"] = data["kernels"][1:]
        else:
            data["format"] = -1
    _stored_as(monkeypatch, change)
    x, w = _inputs((32, 64), 3)
    _compile(_softmax_ln, x, w)
    with caplog.at_level("INFO", logger="stitch.xla_pass.results"):
        report, compiled = _compile(_softmax_ln, x, w)
    assert not report.from_store and report.kernels_stitched >= 1
    assert "stored pass result is not used" in caplog.text
    why = compare_trees(compiled(x, w), jax.jit(_softmax_ln)(x, w), RTOL)
    assert why is None, why


def test_a_pass_with_failed_builds_is_not_stored(store_on, monkeypatch):
    from stitch.xla_pass import pass_registration
    real = pass_registration.stitch_module

    def failing_one(module, request):
        report = real(module, request)
        report.fallbacks.append(("some_kernel", "CodegenError: ptxas took too long"))
        return report
    monkeypatch.setattr(pass_registration, "stitch_module", failing_one)
    x, w = _inputs((32, 64), 4)
    _compile(_softmax_ln, x, w)
    monkeypatch.setattr(pass_registration, "stitch_module", real)
    assert not _compile(_softmax_ln, x, w)[0].from_store


def test_a_module_xla_did_not_take_is_not_stored(store_on, monkeypatch):
    """Kept only once XLA compiled the module the pass handed back: here XLA's parser
    refuses the rewritten text, the compile goes on with XLA's own module, and the next
    compile runs the whole pass."""
    from stitch.xla_pass import pass_registration
    from stitch.xla_pass.pass_request import PassError

    def refused(text):
        raise PassError("XLA's parser rejects stitch's rewritten module (test)")
    to_proto = pass_registration.to_proto
    monkeypatch.setattr(pass_registration, "to_proto", refused)
    x, w = _inputs((32, 64), 5)
    with pytest.raises(PassError, match="rejects"):
        _compile(_softmax_ln, x, w)
    monkeypatch.setattr(pass_registration, "to_proto", to_proto)
    assert not _compile(_softmax_ln, x, w)[0].from_store
    assert _compile(_softmax_ln, x, w)[0].from_store


def test_a_store_that_fails_leaves_the_compile_alone(store_on, monkeypatch, caplog):
    from stitch.xla_pass import pass_registration

    def broken(*args):
        raise TypeError("cannot serialise this (test)")
    monkeypatch.setattr(pass_registration, "store_result", broken)
    x, w = _inputs((32, 64), 6)
    with caplog.at_level("WARNING", logger="stitch.xla_pass.request"):
        report, compiled = _compile(_softmax_ln, x, w)
    assert report.kernels_stitched >= 1 and "cannot serialise this" in caplog.text
    why = compare_trees(compiled(x, w), jax.jit(_softmax_ln)(x, w), RTOL)
    assert why is None, why


def test_header_attributes_are_split_and_put_back():
    text = ('HloModule m, is_scheduled=true, frontend_attributes={a="x{\\"}",'
            'stitch.request="00ff",m={mesh = #sdy.mesh<["d"=1]>}}, other={1}\nENTRY e {}\n')
    program, value = result_store.split_header_attributes(text)
    assert program == "HloModule m, is_scheduled=true, other={1}\nENTRY e {}\n"
    assert value == '{a="x{\\"}",stitch.request="00ff",m={mesh = #sdy.mesh<["d"=1]>}}'
    assert untagged_attributes(value) == '{a="x{\\"}",m={mesh = #sdy.mesh<["d"=1]>}}'
    assert untagged_attributes('{stitch.request="00ff"}') is None
    assert result_store.split_header_attributes("HloModule m\nENTRY e {}\n") == \
        ("HloModule m\nENTRY e {}\n", None)


RESTARTED = r'''
import json, sys
import numpy as np
import jax, jax.numpy as jnp
from tests.fixtures import compile_with_cpu_pass

def step(x, w):
    y = jax.nn.softmax(jnp.tanh(x) * w, axis=-1)
    return y * jax.lax.rsqrt((y * y).mean(-1, keepdims=True) + 1e-5)

rng = np.random.default_rng(int(sys.argv[1]))
x, w = (rng.standard_normal((32, 64)).astype(np.float32) for _ in range(2))
report, compiled = compile_with_cpu_pass(step, x, w)
got, want = np.asarray(compiled(x, w)), np.asarray(jax.jit(step)(x, w))
print("RESULT " + json.dumps({"from_store": report.from_store,
                              "stitched": report.kernels_stitched,
                              "error": float(np.abs(got - want).max())}))
'''


def test_a_restarted_process_takes_the_result_the_first_one_stored(tmp_path):
    """The first process's result is written before it exits (the write runs in a thread
    of its own) and a new process takes it."""
    import os
    import subprocess
    import sys
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    script = tmp_path / "restarted.py"
    script.write_text(RESTARTED)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "STITCH_PASS_RESULTS": "1", "STITCH_CACHE_DIR": str(cache),
           "PYTHONPATH": root, "JAX_PLATFORMS": "cpu", "STITCH_LOG": "info"}
    seed = str(np.random.default_rng().integers(1 << 30))
    results, logs = [], []
    for _ in range(2):
        run = subprocess.run([sys.executable, str(script), seed], env=env, cwd=root,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        line = next(ln for ln in run.stdout.splitlines() if ln.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT "):]))
        logs.append("\n".join(ln for ln in run.stderr.splitlines() if "stitch" in ln))
    assert [r["from_store"] for r in results] == [False, True], logs
    assert results[0]["stitched"] == results[1]["stitched"] >= 1
    assert all(r["error"] < 1e-4 for r in results)
