"""scripts/deviceless_check.sh's venv, made from inside another venv, sees that venv's
packages (a --system-site-packages venv alone sees only the base interpreter's)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_cuda_venv_made_inside_a_venv_sees_the_outer_venvs_packages(tmp_path) -> None:
    outer = tmp_path / "outer"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(outer)], check=True, timeout=120)
    site = subprocess.run([str(outer / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "only_in_outer_venv.py").write_text("VALUE = 42\n")
    inner = tmp_path / "inner"
    run = subprocess.run([str(REPO / "scripts" / "deviceless_check.sh"), "--venv-only"],
                         env={"PATH": "/usr/bin:/bin", "PYTHON": str(outer / "bin" / "python"),
                              "STITCH_CUDA_VENV": str(inner)},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    probe = subprocess.run([str(inner / "bin" / "python"), "-c",
                            "import only_in_outer_venv, numpy; print(only_in_outer_venv.VALUE)"],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert probe.stdout.strip() == "42", probe.stderr
