"""The GPU pass's count settings (stitch.config.env_count behind each): unset gives
the default, ``off`` turns the rule off, a number may carry spaces and underscores, and
anything else is a ConfigError naming the variable and its value."""
from __future__ import annotations

import pytest

from stitch.xla_pass import code_budget, payback
from stitch.config import ConfigError

SETTINGS = {
    "payback steps": (payback.payback_setting, payback.PAYBACK_ENV, payback.PAYBACK_STEPS,
                      " 250_000 ", 250_000, "soon"),
    "code budget": (code_budget.budget_setting, code_budget.BUDGET_ENV,
                    code_budget.CODE_BUDGET, " 2500 ", 2500, "lots"),
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_setting_reads_the_environment(monkeypatch, name: str) -> None:
    setting, env, default, spelled, value, bad = SETTINGS[name]
    monkeypatch.delenv(env, raising=False)
    assert setting() == default
    monkeypatch.setenv(env, "off")
    assert setting() is None
    monkeypatch.setenv(env, spelled)
    assert setting() == value
    monkeypatch.setenv(env, bad)
    with pytest.raises(ConfigError, match=f"{env}='{bad}'"):
        setting()


@pytest.mark.parametrize("bad", ["-3", "0", "many"])
def test_build_threads_refuses_what_it_cannot_use(monkeypatch, bad):
    """A count it cannot use was dropped silently; now the pass's compile falls back with
    the reason (like every pass setting)."""
    from stitch.xla_pass.entry import build_threads
    monkeypatch.setenv("STITCH_BUILD_THREADS", bad)
    with pytest.raises(ConfigError, match=f"STITCH_BUILD_THREADS='{bad}'"):
        build_threads()
    monkeypatch.setenv("STITCH_BUILD_THREADS", "3")
    assert build_threads() == 3


def test_a_misspelled_setting_is_named_with_the_nearest_one() -> None:
    from stitch.config import unknown_settings
    got = unknown_settings({"STITCH_TAGRET": "v100", "STITCH_TARGET": "h100",
                            "STITCH_NOTHING_LIKE_IT": "1", "HOME": "/root"})
    assert got == ["STITCH_NOTHING_LIKE_IT is not a stitch setting and is ignored",
                   "STITCH_TAGRET is not a stitch setting and is ignored (did you mean "
                   "STITCH_TARGET?)"]


def test_every_setting_the_code_reads_is_known() -> None:
    """A STITCH_* name in the library, scripts or bench that KNOWN_SETTINGS lacks would be
    reported as a misspelling."""
    import re
    from pathlib import Path

    from stitch.config import KNOWN_SETTINGS
    root = Path(__file__).resolve().parents[1]
    files = [*root.glob("stitch/**/*.py"), *root.glob("bench/**/*.py"),
             *root.glob("scripts/*"), root / "stitch_autoload.py"]
    read = set()
    for path in files:
        if path.is_file():
            read |= set(re.findall(r"STITCH_[A-Z][A-Z_]+[A-Z]", path.read_text(errors="replace")))
    assert read - KNOWN_SETTINGS == set()


@pytest.mark.parametrize("kwargs,match", [({"target": "rtx4090"}, "stitch plans for"),
                                          ({"device": "tpu"}, "run on cpu or gpu")])
def test_stitch_jit_refuses_a_bad_argument_at_once(kwargs, match) -> None:
    import stitch
    with pytest.raises(ValueError, match=match):
        stitch.jit(lambda x: x, **kwargs)
    assert stitch.jit(lambda x: x, target="H100", device="CPU") is not None


@pytest.mark.parametrize("value,said", [("2", True), ("enable", True), ("0", False),
                                        ("1", False)])
def test_stitch_enable_neither_on_nor_off_is_said(value, said) -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("STITCH_")}
    env.update(STITCH_ENABLE=value, PYTHONPATH=str(root))
    run = subprocess.run([sys.executable, "-c", "import stitch_autoload"], env=env,
                         capture_output=True, text=True, timeout=120, cwd=root)
    assert run.returncode == 0, run.stderr
    assert ("stitch stays off" in run.stderr) is said, run.stderr


@pytest.mark.parametrize("kwargs,error", [({"verify": "yes"}, TypeError),
                                          ({"verify": 0}, TypeError),
                                          ({"guard": "no"}, TypeError),
                                          ({"async_compile": 2}, TypeError),
                                          ({"static_argnums": "a"}, TypeError),
                                          ({"static_argnums": 5}, ValueError)])
def test_stitch_jit_checks_its_switches_as_jax_jit_does(kwargs, error) -> None:
    """A switch stitch cannot use is refused when the function is made, not later."""
    import stitch

    def f(x, y):
        return x + y

    with pytest.raises(error):
        stitch.jit(f, **kwargs)
    with pytest.raises(error):
        stitch.jit(**kwargs)(f)
    assert stitch.jit(f, verify=3, guard=False, async_compile=True) is not None
