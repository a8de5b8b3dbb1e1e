#!/usr/bin/env bash
# The test command (README, and .ci/run runs exactly this).
#
# It never leans on what the machine happens to have: every run makes a fresh virtual environment
# of its own (no system or user site-packages, no PYTHONPATH), installs the project, every extra
# and the verifiers environment package into it from this checkout's files, and runs the whole
# suite with that interpreter. pip's wheel cache keeps the llama-cpp-python build, so a rerun
# costs minutes, not a compile. Installs skip byte-compiling (--no-compile): pip would compile every
# file of torch, ray, gradio and the rest (~70 of the main environment's ~110 s), while a run imports
# a small part of them, compiled once on first import. Arguments go to pytest (e.g. `-m "not slow"`).
#
# The suite runs in BLACKJACK_RL_TEST_WORKERS pytest-xdist workers (default 2; 0: one process): most
# tests wait on a subprocess, a server or a lone Python thread, so one process leaves a core idle.
# Each test file stays on one worker (--dist loadfile), so its module fixtures load once. xdist hands
# the files out by their number of tests, many first, which mixes long files with quick ones; handing
# the long ones out first ran two model-heavy files side by side and was slower (README, Tests).
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
unset PYTHONPATH PYTHONHOME PYTHONUSERBASE PIP_USER VIRTUAL_ENV
# the environments are installed without bytecode (below): a module is compiled on its first import
# and kept, so a machine that sets PYTHONDONTWRITEBYTECODE would compile torch in every subprocess
unset PYTHONDONTWRITEBYTECODE
VENV="${BLACKJACK_RL_TEST_VENV:-.venv-test}"
PYTHON="${PYTHON:-python3}"

# the HTML pages are tested in Debian's Chromium (driven by playwright, which never downloads a browser)
command -v chromium >/dev/null || (apt-get update && apt-get install -y chromium)

# --- verifiers >= 0.4: a second environment of its own -------------------------------------------
# verifiers 0.4 cannot share one with the 0.3 release the `verifiers` extra pins, so the taskset
# package gets its own venv; tests/test_adapters_verifiers_taskset.py runs its vf-eval from there
# (and skips, saying why, when it is absent). uv runs the seat's chat program (a uv script).
VF04_VENV="${BLACKJACK_RL_VF04_VENV:-.venv-vf04}"
install_vf04() {
    "$PYTHON" -m venv --clear "$VF04_VENV"
    "$VF04_VENV/bin/python" -m pip install --upgrade pip
    "$VF04_VENV/bin/python" -m pip install --no-compile -e . -e environments/blackjack_rl_taskset "verifiers>=0.4,<0.5" uv
    "$VF04_VENV/bin/python" -m pip check
}

install_main() {
    "$PYTHON" -m venv --clear "$VENV"
    "$VENV/bin/python" -m pip install --upgrade pip
    "$VENV/bin/python" -m pip install --no-compile -e ".[dev,train,ray,trl,verifiers,openenv,skyrl]" -e environments/blackjack_rl_env
    "$VENV/bin/python" -m pip check
    # Atropos' run-api, the wire reference: its other requirements serve its own environments (pyproject)
    "$VENV/bin/python" -m pip install --no-compile --no-deps "atroposlib==0.4.0"
}

# The two installs are mostly unpacking and waiting on the index, so they run side by side once
# pip's cache holds the llama-cpp-python wheel both need (timings: README, Tests).
# Until then they run one after the other, so that it is compiled once, not twice at once.
LLAMA_WHEEL="llama_cpp_python-$(sed -n 's/.*"llama-cpp-python==\([^"]*\)".*/\1/p' pyproject.toml | head -n 1)-"
if "$PYTHON" -m pip cache list 2>/dev/null | grep -qF "$LLAMA_WHEEL"; then
    VF04_LOG="$(mktemp)"
    install_vf04 >"$VF04_LOG" 2>&1 &
    VF04_PID=$!
    install_main
    VF04_RC=0
    wait "$VF04_PID" || VF04_RC=$?
    cat "$VF04_LOG"
    rm -f "$VF04_LOG"
    if [ "$VF04_RC" -ne 0 ]; then
        echo "the verifiers 0.4 environment ($VF04_VENV) failed to install (its output is above)" >&2
        exit 1
    fi
else
    install_vf04
    install_main
fi
BLACKJACK_RL_VF04_VENV="$(cd "$VF04_VENV" && pwd)"
export BLACKJACK_RL_VF04_VENV
# shellcheck disable=SC1091
source "$VENV/bin/activate"
WORKERS="${BLACKJACK_RL_TEST_WORKERS:-2}"
if [ "$WORKERS" -gt 0 ]; then
    python -m pytest -n "$WORKERS" --dist loadfile "$@"
else
    python -m pytest "$@"
fi
