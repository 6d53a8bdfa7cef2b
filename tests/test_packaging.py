"""What installing stitch puts into site-packages: one import package, ``stitch``, plus the
autoload module and its ``.pth`` (no generic top-level names such as ``codegen`` or
``integration`` that other distributions own), under a distribution name of its own."""
from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    # Built from a copy of the tracked files: a build/ folder left in the checkout by an
    # earlier build could carry modules that no longer exist into the wheel.
    source = tmp_path_factory.mktemp("source")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout.decode().split("\0")
    for name in filter(None, tracked):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                           "-w", str(out), str(source)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = out.glob("*.whl")
    return zipfile.ZipFile(built)


def test_the_wheel_installs_one_package_and_the_autoload(wheel):
    top = {name.split("/")[0] for name in wheel.namelist()}
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert top - dist_info == {"stitch", "stitch_autoload.py", "stitch-autoload.pth"}
    (info,) = dist_info
    assert info.startswith("stitch_xla-")


def test_every_layer_ships_inside_the_stitch_package(wheel):
    names = set(wheel.namelist())
    for module in ("stitch/hlo/parser.py", "stitch/codegen/lower.py",
                   "stitch/xla_pass/entry.py", "stitch/explorer/planner.py"):
        assert module in names
    # The .pth imports only the autoload module, which imports nothing unless enabled.
    pth = wheel.read("stitch-autoload.pth").decode()
    assert "stitch_autoload" in pth and "hlo" not in pth
