#!/usr/bin/env bash
# The deviceless GPU check: stitch's pass inside a real XLA GPU compile for an H100, on a
# machine without a GPU (tests/deviceless). jax's CUDA plugin goes into a separate virtual
# environment that sees the main one's packages (--system-site-packages), never into the
# main environment: there it would change jax's backends for every other test.
#
#   scripts/deviceless_check.sh [pytest args...]
#
# Environment:
#   STITCH_CUDA_VENV    the venv (default: .venv-cuda in the repository)
#   STITCH_WHEELS       a folder with the plugin's wheels to install from instead of the
#                       package index (jax_cuda12_plugin, jax_cuda12_pjrt)
#   PYTHON              the interpreter the venv is made from (default: python, as in CI)
# stitch finds ptxas (for sm_90) the way it always does: $STITCH_PTXAS, $PATH, CUDA_HOME,
# /usr/local/cuda, or the nvidia-cuda-nvcc-cu12 wheel.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${STITCH_CUDA_VENV:-.venv-cuda}"
PY="${PYTHON:-$(command -v python || command -v python3)}"
JAX_VERSION="$("$PY" -c 'import jax; print(jax.__version__)')"

if ! "$VENV/bin/python" -c "import jax_cuda12_plugin, jax_plugins.xla_cuda12" 2>/dev/null; then
    start=$(date +%s)
    echo "deviceless_check: creating $VENV with jax-cuda12-plugin==$JAX_VERSION" >&2
    "$PY" -m venv --system-site-packages "$VENV"
    # --no-deps: the plugin's nvidia-* runtime wheels are for running on a GPU; a deviceless
    # compile needs none of them. It does need ptxas and libdevice (XLA's own kernels,
    # stitch's): jax points XLA at the nvidia-cuda-nvcc-cu12 wheel of the [test] extras,
    # else a CUDA install (/usr/local/cuda).
    if [[ -n "${STITCH_WHEELS:-}" ]]; then
        "$VENV/bin/pip" install -q --no-deps --no-index --find-links "$STITCH_WHEELS" \
            "jax-cuda12-plugin==$JAX_VERSION" "jax-cuda12-pjrt==$JAX_VERSION"
    else
        "$VENV/bin/pip" install -q --no-deps \
            "jax-cuda12-plugin==$JAX_VERSION" "jax-cuda12-pjrt==$JAX_VERSION"
    fi
    echo "deviceless_check: installed in $(( $(date +%s) - start )) s," \
         "$(du -sh "$VENV" | cut -f1) on disk" >&2
fi

export CUDA_VISIBLE_DEVICES=-1 JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1
exec "$VENV/bin/python" -m pytest -q tests/deviceless "$@"
