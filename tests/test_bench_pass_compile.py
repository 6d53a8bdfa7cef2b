"""bench.compile.in_xla's accounting and table (no compile here: the rows are made up, the CPU
timer runs real work)."""
from __future__ import annotations

import subprocess
import sys

import pytest

import bench.compile.in_xla as pass_compile


def _burn(seconds: float) -> None:
    """Spin this thread for ``seconds`` of its own CPU time."""
    import time
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_timed_counts_this_thread_and_ended_children():
    child = [sys.executable, "-c",
             "import time\nend = time.process_time() + 0.3\n"
             "while time.process_time() < end: pass"]

    def work() -> str:
        _burn(0.2)
        subprocess.run(child, check=True)
        return "done"

    result, wall, cpu = pass_compile._timed_result(work)
    assert result == "done"
    # 0.2 s here and 0.3 s in the child (plus its start-up); neither alone reaches 0.45.
    assert cpu >= 0.45
    assert wall >= 0.45


def test_timed_leaves_out_idle_waiting():
    import time
    wall, cpu = pass_compile._timed(lambda: time.sleep(0.3))
    assert wall >= 0.3
    assert cpu < 0.1


def _row(**over) -> dict:
    row = {"model": "transformer_train", "config": "tiny", "jax_s": 4.0, "stitched_s": 6.0,
           "plan_s": 0.9, "build_s": 2.4, "kernels_xla": 120, "kernels_after": 100,
           "stitched": 26, "unpaid": 8, "overheads": [0.5, 0.4, 0.6],
           "warm_stitched_s": 4.5, "warm_jax_s": 4.1,
           "jax_cpu_s": 7.0, "stitched_cpu_s": 11.2, "cores": 2}
    row.update(over)
    return row


def test_cpu_floor_is_the_cpu_spread_over_every_core():
    # 11.2 CPU s on 2 cores take at least 5.6 s: 0.4 over jax.jit's 4.0 s.
    assert pass_compile.cpu_floor(_row()) == pytest.approx(0.4)
    assert pass_compile.cpu_floor(_row(cores=4)) == pytest.approx(-0.3)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


@pytest.mark.parametrize("gpu", [False, True])
def test_table_rows_match_the_header(gpu):
    rows = [_row(device_handlers_s=0.3),
            _row(model="bert_layer_train", cores=4),
            {k: v for k, v in _row(model="old").items()
             if k not in ("jax_cpu_s", "stitched_cpu_s", "cores")},
            {"model": "keras_hub_llama", "config": "tiny", "error": "keras_hub is not installed"}]
    text = pass_compile.markdown(rows, "python -m bench.compile.in_xla", gpu=gpu)
    table = [line for line in text.splitlines() if line.startswith("|")]
    header, rule, body = _cells(table[0]), _cells(table[1]), table[2:]
    assert len(rule) == len(header)
    assert len(body) == len(rows)
    for line in body:
        assert len(_cells(line)) == len(header), line
    first = dict(zip(header, _cells(body[0])))
    assert first["overhead"] == "0.5×"
    assert first["CPU s jax.jit → stitched"] == "7.0 → 11.2"
    assert first["CPU floor"] == "0.40× (2 cores)"
    assert first["all cold overheads"] == "0.50×, 0.40×, 0.60×"
    # Spread over 4 cores the CPU allows less than jax.jit's own time: no floor above 0.
    assert dict(zip(header, _cells(body[1])))["CPU floor"] == "0.00× (4 cores)"
    assert dict(zip(header, _cells(body[2])))["CPU floor"] == "–"
    assert "keras_hub is not installed" in body[3]
