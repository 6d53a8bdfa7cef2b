"""One settings registry (stitch.config.SETTINGS_TABLE): the README's table is
generated from it, every STITCH_* variable the package reads is in it, the modules' own
defaults are the registry's, and a bad value names what the setting accepts."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from stitch import config
from stitch.config import SETTINGS, ConfigError

ROOT = Path(__file__).resolve().parents[1]
START = "<!-- settings table:"
END = "<!-- end of the settings table -->"
# How the package reads a variable: os.environ / getenv, the registry's readers, or a
# module constant naming the variable it reads (PAYBACK_ENV = "STITCH_PAYBACK_STEPS").
READ = re.compile(r"(?:environ\.get\(|environ\[|getenv\(|env_flag\(|env_count\(|setting_raw\("
                  r"|choice_setting\(|_ENV\s*=\s*)\s*[\"'](STITCH_[A-Z_]+)[\"']")


def _package_files() -> list[Path]:
    return [*ROOT.glob("stitch/**/*.py"), ROOT / "stitch_autoload.py"]


def test_the_readme_table_is_the_registry_s() -> None:
    readme = (ROOT / "README.md").read_text()
    assert readme.count(START) == 1 and readme.count(END) == 1
    block = readme[readme.index(START):readme.index(END)]
    table = block[block.index("\n") + 1:]
    assert table.strip() == config.settings_markdown().strip()


def test_every_variable_the_package_reads_is_registered() -> None:
    read: dict[str, str] = {}
    for path in _package_files():
        for name in READ.findall(path.read_text(errors="replace")):
            read.setdefault(name, str(path.relative_to(ROOT)))
    assert len(read) >= 20, sorted(read)           # the pattern still finds the readers
    missing = {name: where for name, where in read.items() if name not in SETTINGS}
    assert missing == {}
    # A setting the library reads is documented for users, unless it is a test aid.
    library = {name for name, where in read.items() if not where.endswith(
        ("test_scenarios.py", "harness.py", "test_thirdparty.py"))}
    assert {n for n in library if SETTINGS[n].audience != "user"} == set()


def test_modules_defaults_are_the_registry_s() -> None:
    from stitch.codegen.pipelines import PIPELINES
    from stitch.cost.launch_forms import GRID_SYNC_SETTINGS
    from stitch.xla_pass import code_budget, payback
    from stitch.frontends import size_gate
    assert str(payback.PAYBACK_STEPS) == SETTINGS["STITCH_PAYBACK_STEPS"].default
    assert str(code_budget.CODE_BUDGET) == SETTINGS["STITCH_CODE_BUDGET"].default
    assert str(size_gate.MIN_BYTES) in SETTINGS["STITCH_MIN_BYTES"].default
    assert config.DEFAULT_TARGET == SETTINGS["STITCH_TARGET"].default
    assert tuple(PIPELINES) == SETTINGS["STITCH_LLVM_PIPELINE"].choices
    assert next(iter(PIPELINES)) == SETTINGS["STITCH_LLVM_PIPELINE"].default
    assert set(GRID_SYNC_SETTINGS) == set(SETTINGS["STITCH_GRID_SYNC"].choices)


def test_a_reader_of_an_unregistered_name_fails_loudly() -> None:
    with pytest.raises(KeyError, match="registry"):
        config.setting_raw("STITCH_TAGRET")


@pytest.mark.parametrize("name,reader,bad", [
    ("STITCH_TARGET", config.target_setting, "rtx4090"),
    ("STITCH_DEVICE", config.device_setting, "tpu"),
    ("STITCH_GRID_SYNC", config.grid_sync_on_gpu, "sometimes"),
    ("STITCH_SEGMENT_ROWS", config.segment_rows_setting, "maybe"),
    ("STITCH_LOG", config.log_level_setting, "chatty")])
def test_a_bad_value_names_what_the_setting_accepts(monkeypatch, name, reader, bad) -> None:
    monkeypatch.setenv(name, bad)
    with pytest.raises(ConfigError) as caught:
        reader()
    message = str(caught.value)
    assert message.startswith(f"{name}={bad!r}: expected ")
    assert SETTINGS[name].accepts() in message
    for choice in SETTINGS[name].choices:
        monkeypatch.setenv(name, choice.upper())
        assert reader() == choice
    monkeypatch.delenv(name)
    reader()                                          # unset: its default, no error
