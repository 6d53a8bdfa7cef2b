#!/usr/bin/env bash
# The GPU bring-up check: one command on a GPU machine (no install, no network), results
# under $OUT (gpu_check.json, gpu_check.md, one <step>.json/.log per step). Steps and budgets
# are in bench/gpu_kit (package docstring); each runs under `timeout`, a failing one is
# recorded and the next runs.
#
#   scripts/gpu_check.sh              on the GPU machine ($OUT: where results go)
#   scripts/gpu_check.sh --rehearse   on a CPU machine: GPU steps say "skipped: no GPU"
#   scripts/gpu_check.sh --only env,smoke
#
# Back here: python -m bench.gpu_kit.ingest <the returned folder> (docs/benchmarks.md's GPU
# section, the latency-evaluator's calibration table).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONPATH="$PWD:$PWD/scripts/pythonpath${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m bench.gpu_kit "$@"
