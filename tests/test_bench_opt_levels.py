"""bench/opt_levels.py without a GPU: the table from a manifest and timings, the random
inputs, and the timing step's bookkeeping against a stand-in for cupy (outputs poisoned,
written or not, compared with the default variant's, graph replays timed)."""
from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest

from bench import opt_levels


def _code(entry: str, variant: str) -> str | None:
    """Machine-code digests: O3-no-unroll keeps k_small's code, O2 changes both, the
    noalias build has none (a cubin without the kernel's section)."""
    if variant == "O3-noalias":
        return None
    if variant == "O3" or (variant == "O3-no-unroll" and entry == "k_small"):
        return f"code-of-{entry}"
    return f"code-of-{entry}-{variant}"


def _manifest(tmp_path=None) -> dict:
    params = [{"name": "x", "dtype": "f32", "size": 64, "bytes": 4, "output": False},
              {"name": "y", "dtype": "bf16", "size": 64, "bytes": 2, "output": True},
              {"name": "z", "dtype": "f32", "size": 8, "bytes": 4, "output": True}]
    kernels = []
    for i, entry in enumerate(("k_small", "k_big")):
        kernels.append({"model": "m", "config": "tiny", "entry": entry, "grid": 2,
                        "block": 32, "launches": 1 + i, "cooperative": False,
                        "params": params, "variants": {
                            v.name: {"cubin": f"{entry}-{v.name}.cubin", "emit_s": 0.1 * (i + 1),
                                     "ptxas_s": 0.05, "ptx_lines": 100 * (i + 1),
                                     "registers": 32, "spill_bytes": 8 if v.name == "O3" else 0,
                                     "code_sha256": _code(entry, v.name)}
                            for v in opt_levels.VARIANTS}})
    return {"arch": "sm_90", "variants": [{"name": v.name} for v in opt_levels.VARIANTS],
            "kernels": kernels, "errors": [{"model": "n", "config": "tiny", "error": "boom"}]}


def test_table_prices_each_pipeline_against_the_default() -> None:
    us = {("k_small", "O3"): 2.0, ("k_big", "O3"): 8.0, ("k_small", "O3-no-unroll"): 3.0,
          ("k_big", "O3-no-unroll"): 8.0, ("k_small", "O2"): 1.0, ("k_big", "O2"): 9.0}
    timings = [{"model": "m", "config": "tiny", "entry": e, "variant": v, "us": t,
                "rel_error": 1e-7 if v != "O3" else 0.0} for (e, v), t in us.items()]
    text = opt_levels.markdown(_manifest(), timings, "cmd")
    rows = {line.split(" | ")[1]: line for line in text.splitlines()
            if line.startswith("| m (tiny)")}
    assert rows["O3"].split(" | ")[2:9] == ["2", "0.40", "300", "64", "2", "2/2", "10.0"]
    assert "| 1/2 | 11.0 | 1.100× | k_small 1.50× |" in rows["O3-no-unroll"]
    assert "| 0/2 | 10.0 | 1.000× | k_big 1.12× |" in rows["O2"]
    assert rows["O3-noalias"].split(" | ")[7] == "–"   # no code to compare: unknown
    assert "| n (tiny) |" in text and "boom" in text
    header = next(line for line in text.splitlines() if line.startswith("| function"))
    assert len(header.split(" | ")) == len(rows["O2"].split(" | "))
    # Without timings the GPU columns are empty, the build columns stay.
    bare = opt_levels.markdown(_manifest(), None, "cmd")
    assert "| m (tiny) | O2 | 2 | 0.40 | 300 | 64 | 0 | 0/2 | – | – | – | – |" in bare


def test_random_inputs_by_dtype() -> None:
    rng = np.random.default_rng(7)
    bf16 = opt_levels.random_input(rng, "bf16", 1000)
    assert bf16.dtype == np.uint16
    values = opt_levels.as_float("bf16", bf16)
    assert np.isfinite(values).all() and 0.5 < values.std() < 2
    ints = opt_levels.random_input(rng, "i32", 1000)
    assert ints.dtype == np.int32 and ints.min() >= 0 and ints.max() < 4
    preds = opt_levels.random_input(rng, "i1", 100)
    assert set(np.unique(preds)) <= {0, 1}
    assert opt_levels.random_input(rng, "f16", 10).dtype == np.float16


class _Array:
    """A device array of the stand-in: host bytes."""

    def __init__(self, host: np.ndarray) -> None:
        self.host = np.array(host)

    def get(self) -> np.ndarray:
        return self.host.copy()


def _fake_cupy(calls: list, clock: list) -> types.ModuleType:
    cp = types.ModuleType("cupy")
    cp.uint8 = np.uint8
    cp.asarray = lambda host: _Array(host)
    cp.full = lambda n, value, dtype: _Array(np.full(n, value, dtype))

    class Function:
        def __init__(self, path: str, name: str) -> None:
            self.variant = next(v.name for v in opt_levels.VARIANTS
                                if path.endswith(f"-{v.name}.cubin"))
            self.name = name

        def __call__(self, grid, block, args, stream=None, enable_cooperative_groups=False):
            calls.append((self.name, self.variant, grid, block, enable_cooperative_groups))
            clock[0] += 1.0
            x = args[0].host
            # y (bf16 bits): x rounded to bf16, the O2 build a little off; z never written.
            y = (x.astype(np.float32) * (1.01 if self.variant == "O2" else 1.0))
            args[1].host[:] = (y.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)

    class RawModule:
        def __init__(self, path: str) -> None:
            self.path = path

        def get_function(self, name: str):
            return types.SimpleNamespace(kernel=Function(self.path, name))

    class Stream:
        def __init__(self, non_blocking: bool = False) -> None:
            self.captured: list = []

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

        def begin_capture(self) -> None:
            calls.append("capture")

        def end_capture(self):
            stream = self

            class Graph:
                def launch(self, _stream) -> None:
                    clock[0] += 10.0 * stream_replays[0]
            return Graph()

        def synchronize(self) -> None:
            pass

    class Event:
        def record(self, _stream) -> None:
            self.at = clock[0]

        def synchronize(self) -> None:
            pass

    stream_replays = [opt_levels.REPLAYS]
    cp.RawModule = RawModule
    cp.cuda = types.SimpleNamespace(
        Stream=Stream, Event=Event,
        Device=lambda: types.SimpleNamespace(synchronize=lambda: None),
        get_elapsed_time=lambda start, end: (end.at - start.at) / 1000.0)
    return cp


def test_timing_step_checks_and_times_every_variant(tmp_path, monkeypatch) -> None:
    manifest = _manifest()
    for entry in manifest["kernels"]:
        for v in entry["variants"].values():
            (tmp_path / v["cubin"]).write_bytes(b"\0")
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    calls, clock = [], [0.0]
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(calls, clock))
    rows = opt_levels.time_kernels(tmp_path)
    assert [(r["entry"], r["variant"]) for r in rows] == [
        (e, v.name) for e in ("k_small", "k_big") for v in opt_levels.VARIANTS]
    for row in rows:
        assert "error" not in row, row
        assert row["us"] == pytest.approx(10.0)          # one replay's time per launch
        assert row["unwritten_outputs"] == 1             # z is never written
        assert (row["rel_error"] > 1e-3) == (row["variant"] == "O2"), row
    # k_big runs two launches a call (a relaunched kernel's phases), k_small one.
    first = [c for c in calls if c != "capture"]
    assert sum(1 for c in first if c[0] == "k_big" and c[1] == "O3") == \
        2 * sum(1 for c in first if c[0] == "k_small" and c[1] == "O3")
    assert all(c[2] == (2,) and c[3] == (32,) and c[4] is False for c in first)


def test_variants_are_the_pipelines_stitch_llvm_pipeline_names():
    """bench/opt_levels builds the pipelines nvptx builds with: the same names and
    settings, the default first."""
    from codegen.nvptx import PIPELINES, LlvmPipeline
    assert [v.name for v in opt_levels.VARIANTS] == list(PIPELINES)
    for v in opt_levels.VARIANTS:
        assert LlvmPipeline(v.speed_level, v.loop_unrolling, v.noalias_inputs,
                            v.gvn_memdep) == PIPELINES[v.name], v.name


def test_the_gpu_step_imports_without_llvmlite():
    """The GPU machine's `time` step has numpy and cupy, not stitch's dependencies: the
    bench module (and the pipeline table it reads) imports with llvmlite unavailable."""
    import subprocess
    import sys
    from pathlib import Path
    blocker = ("import sys\n"
               "class Block:\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] == 'llvmlite':\n"
               "            raise ImportError('llvmlite is blocked')\n"
               "sys.meta_path.insert(0, Block())\n"
               "import bench.opt_levels as b\n"
               "print(len(b.VARIANTS), 'llvmlite' in sys.modules)\n")
    run = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True,
                         cwd=Path(__file__).parents[1], timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [str(len(opt_levels.VARIANTS)), "False"]
