"""Every ```python snippet of the README runs as written (from the repository root, in a
fresh interpreter), so the README never shows code that fails."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()
SNIPPETS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_the_readme_has_python_snippets():
    assert len(SNIPPETS) >= 2


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_snippet_runs(index):
    code = SNIPPETS[index]
    if "import jax" in code or "import stitch" in code:
        pytest.importorskip("jax")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": ROOT, "STITCH_ASYNC": "0"})
    assert run.returncode == 0, f"snippet {index}:\n{code}\n{run.stderr[-2000:]}"


def test_the_first_screen_holds_the_two_commands():
    """A newcomer's first 40 lines: the main job's command and the test commands, the quick
    one among them; every quick file named exists (a renamed one would shrink the subset)."""
    from pathlib import Path

    from tests.conftest import QUICK_FILES
    first = "\n".join(README.splitlines()[:40])
    assert 'pip install -e ".[jax]" && stitch demo' in first
    assert "python -m pytest -q -n 2 -m quick" in first
    with open(os.path.join(ROOT, ".ci", "run")) as ci:
        full = next(line for line in ci if "python -m pytest -q" in line).strip()
    assert full.split("&& scripts/device_stack_check.sh")[0].strip() in first
    missing = {name for name in QUICK_FILES if not (Path(ROOT) / "tests" / name).is_file()}
    assert missing == set()
