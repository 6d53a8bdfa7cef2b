"""One deviceless compile per child process: the venv with jax's CUDA plugin
(``STITCH_CUDA_VENV``, made by scripts/deviceless_check.sh) runs ``python -m MODULE --one
NAME`` with an empty compile cache, and the JSON line after ``mark`` on its standard output
is the row."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.report import REPO


def cuda_python() -> Path:
    """The deviceless venv's interpreter (it may not exist: callers say so in the row)."""
    return Path(os.environ.get("STITCH_CUDA_VENV", REPO / ".venv-cuda")) / "bin" / "python"


def run_one(module: str, name: str, mark: str, key: str, timeout: float,
            xla_flags: str | None = None) -> dict:
    """The row child ``python -m module --one name`` printed after ``mark``, or a row
    ``{key: name, "error": why}``."""
    python = cuda_python()
    if not python.exists():
        return {key: name, "error": f"{python} not found (scripts/deviceless_check.sh makes it)"}
    with tempfile.TemporaryDirectory() as cache:
        os.chmod(cache, 0o700)
        env = {**os.environ, "STITCH_CACHE_DIR": cache, "CUDA_VISIBLE_DEVICES": "-1",
               "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1",
               # The repository first; a PYTHONPATH the caller set (keras_hub's packages,
               # say) after it.
               "PYTHONPATH": os.pathsep.join(filter(None, [
                   str(REPO), os.environ.get("PYTHONPATH")]))}
        if xla_flags:
            env["XLA_FLAGS"] = " ".join(filter(None, (env.get("XLA_FLAGS"), xla_flags)))
        try:
            run = subprocess.run([str(python), "-m", module, "--one", name], env=env,
                                 capture_output=True, text=True, timeout=timeout, cwd=REPO)
        except subprocess.TimeoutExpired:
            return {key: name, "error": f"timed out after {timeout:.0f} s"}
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith(mark)), None)
    if run.returncode != 0 or line is None:
        tail = (run.stderr.strip().splitlines() or ["?"])[-1]
        row = {key: name, "error": f"exit {run.returncode}: {tail[:200]}"}
    else:
        row = json.loads(line[len(mark):])
    print(f"[{module.rsplit('.', 1)[-1]}] {row}", file=sys.stderr, flush=True)
    return row
