"""Third-party training scripts (keras_hub, flax nnx, equinox, plain jax with sharding,
remat, jax.random dropout, donation) run unchanged, plain and under
``STITCH_ENABLE=1 STITCH_ASYNC=0 STITCH_GUARD=0``: the stitched run must exit 0, match the
plain run's per-step losses within 1e-4 relative, keep donation where the script checks it,
and STITCH_STATS must show the script's train step ran stitched kernels.

Scripts marked ``thirdparty`` (keras_hub, flax nnx, equinox: 20-60 s plain, 120-440 s stitched
on this 2-core machine, most of it planning) are skipped unless selected: ``python -m pytest tests/thirdparty/test_thirdparty.py -m thirdparty``
(or STITCH_THIRDPARTY=1). A script whose library is not installed is skipped
(``pip install -e '.[integration]'``)."""
from __future__ import annotations

import math
import os

import pytest

pytest.importorskip("jax")

from . import harness  # noqa: E402


def _param(script: harness.ThirdPartyScript):
    marks = [pytest.mark.thirdparty] if script.slow else []
    return pytest.param(script, id=script.name, marks=marks)


PARAMS = [_param(s) for s in harness.SCRIPTS]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("thirdparty")


@pytest.fixture(scope="module")
def plain_runs(workdir) -> dict[str, harness.ScriptRun]:
    """Plain runs, shared by the plain and the stitched test of a script."""
    return {}


def _require(script: harness.ThirdPartyScript, request) -> None:
    missing = script.missing_modules()
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (pip install -e '.[integration]')")
    selected = request.config.getoption("markexpr", "") or os.environ.get("STITCH_THIRDPARTY")
    if script.slow and not selected:
        pytest.skip("slow third-party script: run with -m thirdparty (or STITCH_THIRDPARTY=1)")


def _plain(script, plain_runs, workdir) -> harness.ScriptRun:
    if script.name not in plain_runs:
        plain_runs[script.name] = harness.run_script(script, stitched=False, workdir=workdir)
    return plain_runs[script.name]


@pytest.mark.parametrize("script", PARAMS)
def test_plain_run_trains(script, plain_runs, workdir, request):
    _require(script, request)
    plain = _plain(script, plain_runs, workdir)
    assert plain.ok, plain.diagnosis()
    assert len(plain.losses) >= 3 and all(math.isfinite(x) for x in plain.losses), plain.result
    if script.checks_donation:
        assert plain.result["donated_deleted"] is True, plain.result
    assert "stitch" not in plain.stderr.lower(), plain.stderr[-2000:]


@pytest.mark.parametrize("script", PARAMS)
def test_stitched_run_matches_plain(script, plain_runs, workdir, request):
    _require(script, request)
    plain = _plain(script, plain_runs, workdir)
    if not plain.ok:
        pytest.fail("the plain run failed, nothing to compare:\n" + plain.diagnosis())
    stitched = harness.run_script(script, stitched=True, workdir=workdir)
    assert stitched.ok, stitched.diagnosis()
    mismatch = harness.loss_mismatch(plain.losses, stitched.losses, script.loss_rtol)
    assert mismatch is None, f"{mismatch}\n{stitched.diagnosis()}"
    if script.checks_donation:
        assert stitched.result["donated_deleted"] is True, \
            f"donation dropped under stitch\n{stitched.diagnosis()}"
    entries = stitched.stitched_train_entries()
    assert entries, \
        f"no STITCH_STATS entry for {script.train_step!r} ran stitched kernels\n" \
        + stitched.diagnosis()


def test_loss_mismatch_reports_the_first_bad_step():
    plain = [2.5, 1.75, 1.25]
    assert harness.loss_mismatch(plain, [2.5, 1.75 * (1 + 5e-5), 1.25]) is None
    assert "step 1" in harness.loss_mismatch(plain, [2.5, 1.75 * (1 + 3e-4), 1.25])
    assert "2 stitched losses" in harness.loss_mismatch(plain, plain[:2])


def test_result_line_is_the_last_one_printed():
    out = 'noise\nSTITCH_TEST_RESULT {"losses": [1.0]}\nSTITCH_TEST_RESULT {"losses": [3.5]}\n'
    assert harness.parse_result(out) == {"losses": [3.5]}
    assert harness.parse_result("step 1 loss 2.0\n") is None
