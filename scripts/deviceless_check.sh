#!/usr/bin/env bash
# The deviceless GPU check: stitch's pass inside a real XLA GPU compile for an H100, on a
# machine without a GPU (tests/deviceless). jax's CUDA plugin goes into a separate virtual
# environment that sees the main one's packages (--system-site-packages), never into the
# main environment: there it would change jax's backends for every other test.
#
#   scripts/deviceless_check.sh [pytest args...]
#   scripts/deviceless_check.sh --venv-only      (make the venv, install nothing)
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
# A venv made with --system-site-packages sees the *base* interpreter's packages; when $PY
# is itself a venv's (CI inside a venv, a developer's env), its packages — stitch's
# dependencies, jax — would be missing. A .pth file in the new venv adds $PY's own
# site-packages after the venv's.
make_venv() {
    "$PY" -m venv --system-site-packages --without-pip "$VENV"
    local parent_sites own_site
    parent_sites="$("$PY" -c 'import site, sysconfig
paths = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
paths += site.getsitepackages() if hasattr(site, "getsitepackages") else []
# addsitedir, not a bare path: the parent'"'"'s own .pth files (editable installs) run too.
print("import site; " + "; ".join(f"site.addsitedir({p!r})" for p in dict.fromkeys(paths)))')"
    own_site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    printf '%s\n' "$parent_sites" > "$own_site/stitch-parent-env.pth"
}

if [[ "${1:-}" == "--venv-only" ]]; then     # tests: the venv, nothing installed
    make_venv
    exit 0
fi

JAX_VERSION="$("$PY" -c 'import jax; print(jax.__version__)')"

if ! "$VENV/bin/python" -c "import jax_cuda12_plugin, jax_plugins.xla_cuda12" 2>/dev/null; then
    start=$(date +%s)
    echo "deviceless_check: creating $VENV with jax-cuda12-plugin==$JAX_VERSION" >&2
    make_venv
    # --no-deps: the plugin's nvidia-* runtime wheels are for running on a GPU; a deviceless
    # compile needs none of them. It does need ptxas and libdevice (XLA's own kernels,
    # stitch's): jax points XLA at the nvidia-cuda-nvcc-cu12 wheel of the [test] extras,
    # else a CUDA install (/usr/local/cuda). pip is the parent environment's (the .pth).
    if [[ -n "${STITCH_WHEELS:-}" ]]; then
        "$VENV/bin/python" -m pip install -q --no-deps --no-index --find-links "$STITCH_WHEELS" \
            "jax-cuda12-plugin==$JAX_VERSION" "jax-cuda12-pjrt==$JAX_VERSION"
    else
        "$VENV/bin/python" -m pip install -q --no-deps \
            "jax-cuda12-plugin==$JAX_VERSION" "jax-cuda12-pjrt==$JAX_VERSION"
    fi
    echo "deviceless_check: installed in $(( $(date +%s) - start )) s," \
         "$(du -sh "$VENV" | cut -f1) on disk" >&2
fi

export CUDA_VISIBLE_DEVICES=-1 JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1
exec "$VENV/bin/python" -m pytest -q tests/deviceless "$@"
