"""Many processes, one decision: a jax.distributed job (two processes on localhost, gloo
collectives on the CPU, one device each) switches to stitched kernels at the same call on
every process and ends with identical replicated parameters; processes sharing one cache
directory plan and build each module once.

Children run scripts written to a temporary folder (never this test's ``__main__``) and are
killed when they overrun.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
CHILD_TIMEOUT_S = 120

# A data-parallel SGD step: batch sharded over the processes, parameters replicated.
DATA_PARALLEL = r'''
import hashlib, json, os, sys
rank, nproc, port, out, seed = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
                                int(sys.argv[5]))
if os.environ.get("SEPARATE_CACHES"):               # each process plans and builds alone
    os.environ["STITCH_CACHE_DIR"] = os.path.join(os.environ["STITCH_CACHE_DIR"], f"p{rank}")
if os.environ.get("FAIL_RANK") == str(rank):      # this process cannot build the program
    os.environ["STITCH_INJECT_FAILURE"] = "compile"
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=rank,
                           local_device_ids=[0])
import numpy as np
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
try:
    import stitch.frontends.job_decisions as job_decisions
    job_decisions.DECISION_TIMEOUT_S = 60.0
except ImportError:           # a stitch without job decisions (the test's own check)
    pass

mesh = Mesh(np.array(jax.devices()), ("data",))
replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
rng = np.random.default_rng(seed)
D, H, B = 64, 128, 32
params = {"w1": rng.standard_normal((D, H)).astype(np.float32) * 0.1,
          "w2": rng.standard_normal((H, 1)).astype(np.float32) * 0.1}
params = {k: jax.make_array_from_process_local_data(replicated, v) for k, v in params.items()}

def loss_fn(p, x, y):
    h = jnp.tanh(x @ p["w1"])
    h = h * jax.nn.sigmoid(h) + 0.1 * h
    return jnp.mean((h @ p["w2"] - y) ** 2)

@jax.jit
def step(p, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
    return jax.tree_util.tree_map(lambda a, g: a - 0.05 * g, p, grads), loss

losses = []
for i in range(int(os.environ["STEPS"])):
    data = np.random.default_rng(seed + 1 + i)
    x = data.standard_normal((B * nproc, D)).astype(np.float32)
    y = data.standard_normal((B * nproc, 1)).astype(np.float32)
    xs = jax.make_array_from_process_local_data(sharded, x[rank * B:(rank + 1) * B])
    ys = jax.make_array_from_process_local_data(sharded, y[rank * B:(rank + 1) * B])
    params, loss = step(params, xs, ys)
    losses.append(float(loss))
    if i == 4 and hasattr(step, "wait"):
        step.wait(90)          # the compile is done by then: the switch comes in this run
local = b"".join(np.asarray(params[k].addressable_data(0)).tobytes() for k in ("w1", "w2"))
stats = getattr(step, "stats", None)
json.dump({"losses": losses, "params": hashlib.sha256(local).hexdigest(),
           "switched_at": None if stats is None else stats.switched_at_call,
           "stitched_calls": None if stats is None else stats.stitched_calls,
           "guard": None if stats is None else stats.guard,
           "fallbacks": None if stats is None else stats.fallbacks}, open(out, "w"))
jax.distributed.shutdown()
'''

# One process of several sharing a cache directory: compiles one function, counts.
SHARED_CACHE = r'''
import json, os, sys, time
from pathlib import Path
import numpy as np
import jax, jax.numpy as jnp
import stitch
from stitch.explorer.plan_cache import default_plan_cache
from stitch.xla_pass.kernel_builds import compile_cache

def f(x, w):
    h = x @ w
    for i in range(5):        # planning takes long enough for the processes to overlap
        h = jnp.tanh(h) * jax.nn.sigmoid(h + i)
        h = h - jnp.max(h, axis=1, keepdims=True) + jnp.mean(h, axis=0)
    return h

g = stitch.jit(f, device="cpu", async_compile=False, guard=False)
rng = np.random.default_rng(int(sys.argv[2]))
x = rng.standard_normal((64, 32)).astype(np.float32)
w = rng.standard_normal((32, 48)).astype(np.float32)
expected = np.asarray(jax.jit(f)(x, w))
Path(sys.argv[1] + ".ready").touch()
while not Path(sys.argv[3]).exists():       # all start compiling together
    time.sleep(0.01)
g(x, w)
out = np.asarray(g(x, w))
json.dump({"plans": default_plan_cache().misses, "builds": compile_cache().stats.builds,
           "stitched_calls": g.stats.stitched_calls,
           "kernels": [p.kernels_stitched for p in g.programs()],
           "error": float(np.max(np.abs(out - expected)))}, open(sys.argv[1], "w"))
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp_path: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STITCH_")}
    env.update(PYTHONPATH=str(ROOT), STITCH_CACHE_DIR=str(tmp_path / "cache"),
               JAX_PLATFORMS="cpu", XLA_FLAGS="", **extra)
    return env


def _run_all(commands: list[list[str]], env: dict, logs: Path) -> None:
    """Start every command, wait for all (killing every child past the timeout)."""
    children = []
    for i, cmd in enumerate(commands):
        log = open(logs / f"child{i}.log", "w")
        children.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          cwd=logs), log))
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    try:
        for child, _ in children:
            child.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for child, log in children:
            if child.poll() is None:
                child.kill()
                child.wait()
            log.close()
    for i, (child, _) in enumerate(children):
        assert child.returncode == 0, \
            f"child {i} exited {child.returncode}:\n" + (logs / f"child{i}.log").read_text()[-3000:]


def _data_parallel_job(tmp_path: Path, name: str, steps: int, seed: int, **env: str) -> list[dict]:
    folder = tmp_path / name
    folder.mkdir()
    script = folder / "step.py"
    script.write_text(DATA_PARALLEL)
    port = str(_free_port())
    outs = [folder / f"rank{r}.json" for r in range(2)]
    _run_all([[sys.executable, str(script), str(r), "2", port, str(outs[r]), str(seed)]
              for r in range(2)], _env(tmp_path, STEPS=str(steps), **env), folder)
    return [json.loads(o.read_text()) for o in outs]


STEPS = 40


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory) -> tuple[int, list[dict]]:
    """(seed, each process's result) of the job without stitch, shared by the tests."""
    seed = int(np.random.default_rng().integers(1 << 20))
    plain = _data_parallel_job(tmp_path_factory.mktemp("plain"), "plain", STEPS, seed,
                               STITCH_ENABLE="0")
    assert plain[0]["params"] == plain[1]["params"]
    return seed, plain


@pytest.mark.parametrize("mode", ["async", "forced"])
def test_two_processes_switch_together_and_keep_identical_parameters(tmp_path, mode,
                                                                     plain_run):
    seed, plain = plain_run
    steps = STEPS
    # Forced: each process plans alone (its own cache), so their plans must agree.
    settings = ({"STITCH_ASYNC": "1", "STITCH_GUARD": "1"} if mode == "async"
                else {"STITCH_ASYNC": "0", "STITCH_GUARD": "0", "SEPARATE_CACHES": "1"})
    ranks = _data_parallel_job(tmp_path, "stitched", steps, seed, STITCH_ENABLE="1",
                               STITCH_MIN_BYTES="off", **settings)
    switched = [r["switched_at"] for r in ranks]
    assert switched[0] is not None, ranks[0]["fallbacks"]
    assert switched[0] == switched[1], switched
    assert ranks[0]["stitched_calls"] == ranks[1]["stitched_calls"]
    assert ranks[0]["guard"] == ranks[1]["guard"]       # one verdict (process 0's)
    assert ranks[0]["params"] == ranks[1]["params"]     # replicated: byte for byte
    np.testing.assert_allclose(ranks[0]["losses"], plain[0]["losses"], rtol=0, atol=1e-4)
    np.testing.assert_allclose(ranks[1]["losses"], plain[1]["losses"], rtol=0, atol=1e-4)


def test_a_process_that_cannot_build_takes_the_whole_job_to_stock(tmp_path, plain_run):
    seed, plain = plain_run
    ranks = _data_parallel_job(tmp_path, "stitched", STEPS, seed, STITCH_ENABLE="1",
                               STITCH_MIN_BYTES="off", STITCH_ASYNC="0", STITCH_GUARD="0",
                               FAIL_RANK="1")
    assert [r["switched_at"] for r in ranks] == [None, None]
    assert any("process 1 could not build" in f for f in ranks[0]["fallbacks"]), ranks[0]
    assert ranks[0]["params"] == ranks[1]["params"] == plain[0]["params"]


def test_four_processes_sharing_a_cache_plan_and_build_each_module_once(tmp_path):
    (tmp_path / "cache").mkdir(mode=0o700)
    script = tmp_path / "child.py"
    script.write_text(SHARED_CACHE)
    go = tmp_path / "go"
    outs = [tmp_path / f"proc{i}.json" for i in range(4)]
    seed = int(np.random.default_rng().integers(1 << 20))
    env = _env(tmp_path)
    import threading
    starter = threading.Thread(target=_start_when_ready, args=(outs, go), daemon=True)
    starter.start()
    _run_all([[sys.executable, str(script), str(o), str(seed), str(go)] for o in outs], env,
             tmp_path)
    results = [json.loads(o.read_text()) for o in outs]
    assert all(r["stitched_calls"] == 2 and r["kernels"] and r["kernels"][0] >= 1
               for r in results), results
    assert all(r["error"] < 1e-5 for r in results), results
    assert sum(r["plans"] for r in results) == 1, results
    # The compile cache also keeps Kernel IR lowerings (codegen/lowering_reuse.py: JSON) and
    # the pass's whole result (xla_pass/result_store.py: zlib at level 1 after the entry's
    # 46-byte header), written with put, never built: only the other entries are builds.
    entries = [e for e in (tmp_path / "cache").glob("*.bin")
               if b'{"kernel": {"nodes": ' not in e.read_bytes()[:256]
               and e.read_bytes()[46:48] != b"\x78\x01"]
    assert sum(r["builds"] for r in results) == len(entries) >= 1, (results, entries)
    assert len(list((tmp_path / "cache" / "plans").glob("*.json"))) == 1


def _start_when_ready(outs: list[Path], go: Path) -> None:
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while time.monotonic() < deadline:
        if all(Path(str(o) + ".ready").exists() for o in outs):
            break
        time.sleep(0.02)
    go.touch()
