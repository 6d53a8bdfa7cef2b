"""The GPU pass's count settings (stitch.integration.config.env_count behind each): unset gives
the default, ``off`` turns the rule off, a number may carry spaces and underscores, and
anything else is a ConfigError naming the variable and its value."""
from __future__ import annotations

import pytest

from stitch.integration import code_budget, payback
from stitch.integration.config import ConfigError

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
    from stitch.integration.xla_pass import build_threads
    monkeypatch.setenv("STITCH_BUILD_THREADS", bad)
    with pytest.raises(ConfigError, match=f"STITCH_BUILD_THREADS='{bad}'"):
        build_threads()
    monkeypatch.setenv("STITCH_BUILD_THREADS", "3")
    assert build_threads() == 3
