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


class _FakeDriver:
    """bench.cuda_driver.Driver's stand-in: device memory as host byte arrays, a clock
    that a launch advances by 1 and a graph replay by 10 per captured launch."""

    def __init__(self) -> None:
        self.calls: list = []
        self.clock = 0.0
        self.memory: dict[int, np.ndarray] = {}
        self.capturing: list | None = None
        self.freed: list[int] = []

    def use(self, ordinal: int) -> None:
        pass

    def alloc(self, nbytes: int) -> int:
        pointer = 4096 * (len(self.memory) + 1)
        self.memory[pointer] = np.zeros(nbytes, np.uint8)
        return pointer

    def free(self, pointer: int) -> None:
        self.freed.append(pointer)

    def to_device(self, pointer: int, host) -> None:
        self.memory[pointer][:] = np.ascontiguousarray(host).view(np.uint8).ravel()

    def to_host(self, pointer: int, host) -> None:
        host[:] = self.memory[pointer]

    def fill(self, pointer: int, byte: int, nbytes: int) -> None:
        self.memory[pointer][:nbytes] = byte

    def synchronize(self) -> None:
        pass

    def load(self, image: bytes, entry: str, dynamic_shared_bytes: int = 0):
        return (entry, self._variant)

    def launch(self, function, grid, block, pointers, stream=None, *, cooperative=False,
               dynamic_shared_bytes=0) -> None:
        entry, variant = function
        if self.capturing is not None:
            self.capturing.append((function, list(pointers)))
            return
        self.calls.append((entry, variant, grid, block, cooperative))
        self.clock += 1.0
        x = self.memory[pointers[0]].view(np.float32)
        # y (bf16 bits): x rounded to bf16, the O2 build a little off; z never written.
        y = x * (1.01 if variant == "O2" else 1.0)
        self.memory[pointers[1]][:] = ((y.view(np.uint32) >> 16).astype(np.uint16)
                                       .view(np.uint8))

    def stream(self):
        return "stream"

    def capture(self, stream, body):
        self.capturing = []
        body()
        graph, self.capturing = self.capturing, None
        self.calls.append("capture")
        return graph

    def graph_launch(self, graph, stream) -> None:
        self.clock += 10.0 * len(graph)

    def event(self):
        return {}

    def record(self, event, stream) -> None:
        event["at"] = self.clock

    def elapsed_ms(self, start, end) -> float:
        return (end["at"] - start["at"]) / 1000.0


class _VariantFromPath(_FakeDriver):
    def load(self, image: bytes, entry: str, dynamic_shared_bytes: int = 0):
        return (entry, image.decode())


def test_timing_step_checks_and_times_every_variant(tmp_path) -> None:
    manifest = _manifest()
    for entry in manifest["kernels"]:
        for v in entry["variants"].values():
            (tmp_path / v["cubin"]).write_bytes(v["cubin"].split("-", 1)[1][:-6].encode())
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    driver = _VariantFromPath()
    rows = opt_levels.time_kernels(tmp_path, driver=driver)
    assert [(r["entry"], r["variant"]) for r in rows] == [
        (e, v.name) for e in ("k_small", "k_big") for v in opt_levels.VARIANTS]
    for row in rows:
        assert "error" not in row, row
        # One replay's time per call: each call is `launches` launches of 10 each.
        launches = 2 if row["entry"] == "k_big" else 1
        assert row["us"] == pytest.approx(10.0 * launches)
        assert row["unwritten_outputs"] == 1             # z is never written
        assert (row["rel_error"] > 1e-3) == (row["variant"] == "O2"), row
    # k_big runs two launches a call (a relaunched kernel's phases), k_small one.
    first = [c for c in driver.calls if c != "capture"]
    assert sum(1 for c in first if c[0] == "k_big" and c[1] == "O3") == \
        2 * sum(1 for c in first if c[0] == "k_small" and c[1] == "O3")
    assert all(c[2] == 2 and c[3] == 32 and c[4] is False for c in first)
    assert len(driver.freed) == len(driver.memory)       # every buffer given back


def test_check_only_launches_once_and_times_nothing(tmp_path) -> None:
    manifest = _manifest()
    for entry in manifest["kernels"]:
        for v in entry["variants"].values():
            (tmp_path / v["cubin"]).write_bytes(v["cubin"].split("-", 1)[1][:-6].encode())
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    driver = _VariantFromPath()
    rows = opt_levels.time_kernels(tmp_path, driver=driver, check_only=True)
    assert all("us" not in r and "error" not in r for r in rows)
    assert "capture" not in driver.calls


def test_variants_are_the_pipelines_stitch_llvm_pipeline_names():
    """bench/opt_levels builds the pipelines nvptx builds with: the same names and
    settings, the default first."""
    from stitch.codegen.nvptx import PIPELINES, LlvmPipeline
    assert [v.name for v in opt_levels.VARIANTS] == list(PIPELINES)
    for v in opt_levels.VARIANTS:
        assert LlvmPipeline(v.speed_level, v.loop_unrolling, v.noalias_inputs,
                            v.gvn_memdep) == PIPELINES[v.name], v.name


def test_the_gpu_step_imports_without_llvmlite():
    """The GPU machine's `time` step has numpy and libcuda, not stitch's dependencies nor
    cupy: the bench module, its ctypes driver and the pipeline table import with llvmlite
    and cupy unavailable."""
    import subprocess
    import sys
    from pathlib import Path
    blocker = ("import sys\n"
               "class Block:\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] in ('llvmlite', 'cupy'):\n"
               "            raise ImportError(name + ' is blocked')\n"
               "sys.meta_path.insert(0, Block())\n"
               "import bench.opt_levels as b, bench.cuda_driver\n"
               "print(len(b.VARIANTS), 'llvmlite' in sys.modules)\n")
    run = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True,
                         cwd=Path(__file__).parents[1], timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [str(len(opt_levels.VARIANTS)), "False"]


def test_device_step_times_a_carried_folder_else_prepares_one_there(tmp_path, monkeypatch):
    """The GPU kit's opt_levels step: a carried .gpu_bench is timed as it is; without one,
    the models are prepared on the machine itself (its own Python), then timed."""
    prepared = []

    def fake_prepare(models, directory, python, timeout=1800):
        prepared.append((models, python))
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "manifest.json").write_text("{}")

    monkeypatch.setattr(opt_levels, "prepare", fake_prepare)
    monkeypatch.setattr(opt_levels, "time_kernels",
                        lambda directory, check_only=False: [{"dir": str(directory)}])
    carried, scratch, out = tmp_path / "carried", tmp_path / "scratch", tmp_path / "t.json"
    opt_levels.main(["device", "--dir", str(carried), "--scratch", str(scratch),
                     "--models", "bert_layer_train:tiny", "--json", str(out)])
    assert prepared == [(["bert_layer_train:tiny"], sys.executable)]
    assert json.loads(out.read_text()) == [{"dir": str(scratch)}]
    carried.mkdir()
    (carried / "manifest.json").write_text("{}")
    opt_levels.main(["device", "--dir", str(carried), "--scratch", str(scratch),
                     "--json", str(out)])
    assert len(prepared) == 1 and json.loads(out.read_text()) == [{"dir": str(carried)}]
