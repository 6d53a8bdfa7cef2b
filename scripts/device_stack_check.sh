#!/usr/bin/env bash
# The GPU machine's own software stack, checked on a machine without a GPU: Python 3.12,
# jax/jaxlib 0.11.2 with jax's CUDA 13 plugin, numpy 2.5, llvmlite 0.50, ml_dtypes, ptxas and
# libdevice from the CUDA 13 nvcc wheel, and none of pulp, highspy, keras, tensorflow,
# matplotlib. stitch is not installed there; it runs from the checkout on PYTHONPATH, and so
# does every check here:
#
#   1. tests/test_pass_registration.py     (jax's real registration API)
#   2. tests/deviceless                    (one H100 and two H100s, deviceless environment)
#   3. scripts/gpu_check.sh --rehearse     (exit 0, at most 8 files returned, all CPU steps
#                                           passed; bench.gpu_kit.ingest refuses it: exit 2)
#   4. STITCH_ENABLE=1 from PYTHONPATH     (jax.jit patched)
#
#   scripts/device_stack_check.sh
#
# The stack is a venv made with a Python 3.12 and cached; it is rebuilt when PINS (below) or
# the interpreter change (a stamp file in the venv holds both). pip installs by package
# name, with the machine's own pip configuration.
#
# Environment:
#   STITCH_DEVICE_VENV    the venv (default: ~/.cache/stitch/device-stack-venv)
#   STITCH_DEVICE_PYTHON  the Python 3.12 to make it from (default: python3.12 on PATH, else
#                         the newest pyenv 3.12, else /usr/bin or /usr/local/bin python3.12)
#
# Prints one line per check and closes with `device stack: N passed, N failed` (checks);
# exits non-zero when any check failed or the venv could not be made.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"

# ----------------------------------------------------------------- the GPU machine's stack
# One place: a change here rebuilds the cached venv.
PYTHON_VERSION="3.12"
PINS=(
    "jax==0.11.2"
    "jaxlib==0.11.2"
    "jax-cuda13-plugin==0.11.2"
    "jax-cuda13-pjrt==0.11.2"
    "numpy==2.5.2"
    "llvmlite==0.50.*"
    "ml_dtypes"
    "nvidia-cuda-nvcc==13.0.*"
    "pytest"
)
# Absent on the GPU machine: stitch must work without them, so they must stay out of the venv.
ABSENT=(pulp highspy keras tensorflow matplotlib)
# Importable in a usable venv (the plugin's module name is jax's CUDA 13 plugin).
REQUIRED_IMPORTS="jax, jaxlib, jax_plugins.xla_cuda13, numpy, llvmlite, ml_dtypes, pytest"

VENV="${STITCH_DEVICE_VENV:-$HOME/.cache/stitch/device-stack-venv}"
STAMP="$VENV/stitch-device-stack.stamp"
VPY="$VENV/bin/python"

say() { echo "device_stack_check: $*" >&2; }

# Nothing from the calling environment may change what runs: each check sets its own.
unset PYTHONPATH PYTHONHOME PYTHONSTARTUP STITCH_ENABLE JAX_PLATFORMS JAX_PLATFORM_NAME \
      CUDA_VISIBLE_DEVICES JAX_SKIP_CUDA_CONSTRAINTS_CHECK XLA_FLAGS VIRTUAL_ENV \
      STITCH_PTXAS STITCH_LIBDEVICE STITCH_BLOCK_MODULES
export PYTHONNOUSERSITE=1

# ---------------------------------------------------------------------- the interpreter
find_python312() {
    local candidates=() c
    [[ -n "${STITCH_DEVICE_PYTHON:-}" ]] && candidates+=("$STITCH_DEVICE_PYTHON")
    c="$(command -v "python$PYTHON_VERSION" 2>/dev/null || true)"
    [[ -n "$c" ]] && candidates+=("$c")
    # pyenv's shim for python3.12 refuses to run when 3.12 is not the selected version;
    # the installed interpreters themselves always run.
    local pyenv_root="${PYENV_ROOT:-$HOME/.pyenv}"
    if [[ -d "$pyenv_root/versions" ]]; then
        while IFS= read -r c; do
            candidates+=("$c")
        done < <(find "$pyenv_root/versions" -maxdepth 3 -path "*/versions/$PYTHON_VERSION.*/bin/python" \
                     2>/dev/null | sort -rV)
    fi
    candidates+=("/usr/bin/python$PYTHON_VERSION" "/usr/local/bin/python$PYTHON_VERSION")
    for c in "${candidates[@]}"; do
        if [[ -x "$c" ]] && "$c" -c "import sys, venv
assert sys.version_info[:2] == tuple(map(int, '$PYTHON_VERSION'.split('.')))" >/dev/null 2>&1; then
            echo "$c"
            return 0
        fi
    done
    return 1
}

# ------------------------------------------------------------------------------ the venv
stamp_text() {  # what the venv was made from: the pins and the interpreter's exact version
    printf 'python %s\n' "$1"
    printf '%s\n' "${PINS[@]}"
}

venv_usable() {
    [[ -f "$STAMP" && -x "$VPY" ]] || return 1
    local base_version
    base_version="$("$VPY" -c 'import platform; print(platform.python_version())' 2>/dev/null)" \
        || return 1
    [[ "$(cat "$STAMP")" == "$(stamp_text "$base_version")" ]] || return 1
    "$VPY" -c "import $REQUIRED_IMPORTS" >/dev/null 2>&1
}

build_venv() {
    local py="$1" version start
    version="$("$py" -c 'import platform; print(platform.python_version())')"
    start=$(date +%s)
    say "making $VENV from $py (Python $version): ${PINS[*]}"
    if [[ -e "$VENV" ]]; then
        # Only ever a venv (or an empty folder) is replaced, never what a mistyped
        # STITCH_DEVICE_VENV names.
        if [[ -f "$VENV/pyvenv.cfg" ]] || [[ -d "$VENV" && -z "$(ls -A "$VENV")" ]]; then
            rm -rf "$VENV"
        else
            say "ERROR: $VENV exists and is not a venv; not replacing it"
            return 1
        fi
    fi
    "$py" -m venv "$VENV"
    # --no-cache-dir: the wheels (about 0.8 GB) would otherwise be kept twice.
    "$VPY" -m pip install -q --no-cache-dir "${PINS[@]}"
    stamp_text "$version" > "$STAMP"      # last: a half-made venv has no stamp
    say "venv made in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1) on disk"
}

ensure_venv() {
    if venv_usable; then
        say "reusing $VENV ($(head -1 "$STAMP"))"
        return 0
    fi
    local py
    if ! py="$(find_python312)"; then
        say "ERROR: no Python $PYTHON_VERSION found (tried \$STITCH_DEVICE_PYTHON," \
            "python$PYTHON_VERSION on PATH, ${PYENV_ROOT:-$HOME/.pyenv}/versions/$PYTHON_VERSION.*," \
            "/usr/bin and /usr/local/bin). CI must run the GPU machine's stack: install a" \
            "Python $PYTHON_VERSION (e.g. pyenv install $PYTHON_VERSION) or point" \
            "STITCH_DEVICE_PYTHON at one."
        return 1
    fi
    build_venv "$py" || { say "ERROR: installing the stack into $VENV failed"; return 1; }
    venv_usable || { say "ERROR: $VENV was made but does not import: $REQUIRED_IMPORTS"; return 1; }
}

# Two CI jobs on one machine share the cache: one makes the venv, the other waits.
mkdir -p "$(dirname "$VENV")"
if command -v flock >/dev/null 2>&1; then
    exec 9>"$VENV.lock"
    flock 9
fi
if ! ensure_venv; then
    echo "device stack: 0 passed, 1 failed"
    exit 1
fi

# What the venv holds, and what it must not.
"$VPY" - "${ABSENT[@]}" <<'EOF' >&2 || { echo "device stack: 0 passed, 1 failed"; exit 1; }
import importlib.util, platform, sys
from importlib.metadata import version
print("device_stack_check: Python", platform.python_version() + ";",
      ", ".join(f"{p} {version(p)}" for p in ("jax", "jaxlib", "jax-cuda13-plugin",
                "jax-cuda13-pjrt", "numpy", "llvmlite", "ml_dtypes", "nvidia-cuda-nvcc")))
present = [m for m in sys.argv[1:] if importlib.util.find_spec(m) is not None]
if present:
    sys.exit(f"device_stack_check: ERROR: the venv has {', '.join(present)}, absent on the "
             "GPU machine; remove the venv to rebuild it")
EOF

# ptxas and libdevice: the CUDA 13 wheels', as on the GPU machine (which has no other CUDA).
# Named explicitly, so a CUDA install on this machine (/usr/local/cuda, a ptxas on PATH) is
# never what the checks use — for stitch (STITCH_PTXAS, STITCH_LIBDEVICE) nor for XLA
# (its CUDA data directory).
CUDA_WHEEL="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia/cu13"
if [[ ! -x "$CUDA_WHEEL/bin/ptxas" || ! -f "$CUDA_WHEEL/nvvm/libdevice/libdevice.10.bc" ]]; then
    say "ERROR: the CUDA 13 wheels gave no ptxas or libdevice under $CUDA_WHEEL"
    echo "device stack: 0 passed, 1 failed"
    exit 1
fi
export STITCH_PTXAS="$CUDA_WHEEL/bin/ptxas"
export STITCH_LIBDEVICE="$CUDA_WHEEL/nvvm/libdevice/libdevice.10.bc"
export XLA_FLAGS="--xla_gpu_cuda_data_dir=$CUDA_WHEEL"
say "ptxas $("$STITCH_PTXAS" --version | tail -1)"

# ----------------------------------------------------------------------------- the checks
TMP="$(mktemp -d "${TMPDIR:-/tmp}/stitch-device-stack.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
PASSED=0
FAILED=0
FAILED_NAMES=()

# check NAME COMMAND...: runs COMMAND from the checkout, its output kept in $TMP/NAME.log
# and shown (the tail) when it fails.
check() {
    local name="$1" start rc=0
    shift
    start=$(date +%s)
    ( "$@" ) >"$TMP/$name.log" 2>&1 || rc=$?
    local took=$(( $(date +%s) - start ))
    if (( rc == 0 )); then
        PASSED=$((PASSED + 1))
        echo "device stack: PASS $name (${took} s)$(summary_of "$TMP/$name.log")"
    else
        FAILED=$((FAILED + 1))
        FAILED_NAMES+=("$name")
        echo "device stack: FAIL $name (${took} s, exit status $rc)"
        tail -n 60 "$TMP/$name.log" | sed 's/^/    /'
    fi
}

summary_of() {  # pytest's last line, when there is one
    local last
    last="$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error)' "$1" | tail -1 | tr -d '=')" || true
    [[ -n "$last" ]] && echo ": ${last# }"
    return 0
}

# pytest_run JUNIT REQUIRE_NO_SKIPS MUST_PASS ARGS...: pytest with this venv's Python from the
# checkout; any exit status but 0 fails, 5 (nothing collected) included. With
# REQUIRE_NO_SKIPS=1 a skipped test fails too (the deviceless tests skip when the plugin is
# unusable, which here is the failure); MUST_PASS names a test that must have passed.
pytest_run() {
    local junit="$1" no_skips="$2" must_pass="$3" rc=0
    shift 3
    PYTHONPATH="$REPO" "$VPY" -m pytest -q -p no:cacheprovider --junitxml="$junit" "$@" || rc=$?
    if (( rc == 5 )); then
        echo "pytest collected no tests (exit status 5)"
        return 5
    fi
    (( rc == 0 )) || return "$rc"
    "$VPY" - "$junit" "$no_skips" "$must_pass" <<'EOF'
import sys, xml.etree.ElementTree as ET
junit, no_skips, must_pass = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
cases = list(ET.parse(junit).getroot().iter("testcase"))
skipped = [c.get("name") for c in cases if c.find("skipped") is not None]
if not cases:
    sys.exit("no test ran")
if no_skips and skipped:
    sys.exit(f"{len(skipped)} skipped, none may be on this stack: {', '.join(skipped[:5])}")
if must_pass:
    ran = [c for c in cases if c.get("name") == must_pass]
    if not ran or any(c.find(t) is not None for c in ran for t in ("skipped", "failure", "error")):
        sys.exit(f"{must_pass} must pass on this stack (it "
                 f"{'was skipped or failed' if ran else 'was not collected'})")
EOF
}

check_registration() {
    # The plugin is installed here, so jax 0.11 must register under "cuda" deviceless.
    pytest_run "$TMP/registration.xml" 0 \
        test_cuda_registers_on_a_deviceless_cuda_plugin_under_its_own_name \
        tests/test_pass_registration.py
}

check_deviceless() {
    CUDA_VISIBLE_DEVICES=-1 JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 \
        pytest_run "$TMP/deviceless.xml" 1 "" tests/deviceless
}

check_rehearsal() {
    local out="$TMP/rehearsal/out" docs="$TMP/rehearsal/benchmarks.md" rc=0 files
    PYTHON="$VPY" scripts/gpu_check.sh --rehearse --out "$out" --work "$TMP/rehearsal/work" \
        || { echo "scripts/gpu_check.sh --rehearse: exit status $?"; return 1; }
    files="$(find "$out" -mindepth 1 | wc -l)"
    echo "returned: $files files ($(ls "$out" | tr '\n' ' '))"
    (( files <= 8 )) || { echo "more than 8 files returned"; return 1; }
    PYTHONPATH="$REPO" "$VPY" - "$out/gpu_check.json" <<'EOF' || return 1
import json, sys
steps = {s["name"]: s for s in json.load(open(sys.argv[1]))["steps"]}
bad = [f"{n}: {steps.get(n, {}).get('status', 'missing')}"
       for n in ("env", "smoke", "tests", "timings", "ingest")
       if steps.get(n, {}).get("status") != "passed"]
if bad:
    sys.exit("rehearsal steps that must pass without a GPU did not: " + "; ".join(bad))
EOF
    printf '# Benchmarks\n' > "$docs"
    PYTHONPATH="$REPO" "$VPY" -m bench.gpu_kit.ingest "$out" --docs "$docs" || rc=$?
    if (( rc != 2 )); then
        echo "bench.gpu_kit.ingest took the rehearsal (exit status $rc, 2 expected)"
        return 1
    fi
    [[ "$(cat "$docs")" == "# Benchmarks" ]] || { echo "the ingest changed the docs"; return 1; }
    echo "the ingest refused the rehearsal (exit status 2), docs untouched"
}

check_autoload() {
    local got
    got="$(cd "$TMP" && STITCH_ENABLE=1 PYTHONPATH="$REPO:$REPO/scripts/pythonpath" \
           "$VPY" -c "import jax; print(hasattr(jax.jit, '__stitch_original__'))")" || return 1
    echo "printed: $got"
    [[ "$(tail -n 1 <<<"$got")" == "True" ]]
}

check pass_registration check_registration
check deviceless check_deviceless
check gpu_check_rehearsal check_rehearsal
check stitch_enable_from_checkout check_autoload

(( FAILED == 0 )) || say "failed: ${FAILED_NAMES[*]}"
echo "device stack: $PASSED passed, $FAILED failed"
(( FAILED == 0 ))
