"""The quick subset: ``python -m pytest -q -m quick`` runs the files below (each layer's
core: parse, evaluate, graph, cost, plan, schedule, codegen on the host, the XLA pass,
stitch.jit, the CLI, settings and the README), under 5 minutes on 2 cores where the whole
suite takes about 30. A file is quick as a whole: its tests get the ``quick`` marker here."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests patch the pass's internals and compile the same small modules many times: a stored
# whole-pass result (stitch.xla_pass.result_store) would stand in for the pass they patch.
# Its own tests turn it on (tests/test_pass_result_store.py).
os.environ.setdefault("STITCH_PASS_RESULTS", "0")

QUICK_FILES = frozenset({
    "test_parser.py", "test_parser_xla_forms.py", "test_evaluator.py", "test_graph.py",
    "test_gpu_specs.py", "test_launch_forms.py", "test_explorer.py", "test_schedules.py",
    "test_kir_host.py", "test_hlo_rewrite.py", "test_snap.py", "test_xla_pass.py",
    "test_jit_reliability.py", "test_cli_plan.py", "test_env_settings.py",
    "test_settings_registry.py", "test_size_gate.py", "test_source_lines.py",
    "test_xla_stderr.py", "test_import_layers.py", "test_readme.py", "test_payback.py",
    "test_code_budget.py",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).name in QUICK_FILES:
            item.add_marker(pytest.mark.quick)
