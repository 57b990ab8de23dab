#!/usr/bin/env bash
# A separate venv in which SGLang (on CPU), its router and kvbridge live together, for the SGLang
# transfer backend's tests and benchmark. SGLang pins a CUDA torch, CUDA kernel packages and
# transformers versions that kvbridge's own environment does not share, so it cannot be the main
# environment.
#
#   scripts/sglang_env.sh          build (or reuse) the venv; prints its python on stdout
#
# Where: "${KVBRIDGE_SGLANG_VENV:-$HOME/.cache/kvbridge/sglang-venv}".
# Idempotent: a marker file in the venv records what was installed; when it matches this script's
# versions and this checkout, only the final import check runs.
#
# What runs on CPU, and why the venv is built the way it is: ../shared/facts/sglang-cpu.md.
# In short: the local torch 2.13.0+cpu wheel; sglang with --no-deps; then sglang's own declared
# runtime dependencies (read from its wheel's metadata) less the CUDA-only ones, with torch held
# at the CPU build; and two test-only stand-ins (tests/sglang_standins/: sgl_kernel and
# torchvision), which are put on this venv's path only.
#
# Exit status: 0 ready (the venv's python is the last line on stdout); 2 SGLang cannot be
# installed on this machine (one line on stderr starting "sglang_env.sh: SKIP:" gives the reason;
# callers skip their SGLang tests with it); 1 anything else went wrong (the log's path is printed).
set -euo pipefail

SGLANG_VERSION=0.5.23
ROUTER_VERSION=0.3.2
MOONCAKE_VERSION=0.3.13.post1
# Not on the public index as a CPU build: pip finds it through find-links (the machine's local
# wheel path, /opt/wheels here). The exact +cpu pin keeps pip from taking a CUDA build.
TORCH_VERSION=2.13.0+cpu
# What the torchvision stand-in calls itself (the release that goes with torch 2.13).
TORCHVISION_STANDIN_VERSION=0.28.0+kvbridge.standin
# sglang's declared dependencies that are left out. torch: held at the CPU build (sglang pins a
# CUDA 2.14.1). torchvision: the stand-in (the registry's is a CUDA build that fails on CPU torch).
# torchaudio, torchcodec: CUDA builds tied to other torch releases, unused by a text model. The
# rest are CUDA-only kernels, bindings and compilers that have no CPU use (several GB).
EXCLUDED_DEPS=(
  torch torchvision torchaudio torchcodec
  cuda-python flashinfer-python flash-attn-4 humming-kernels nvidia-cutlass-dsl nvidia-mathdx
  nvshmem4py-cu13 quack-kernels sgl-deep-ep sgl-deep-gemm sgl-flash-mla sglang-kernel sgl-kernel
  tilelang torch-memory-saver
)

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STANDINS="$ROOT/tests/sglang_standins"
VENV="${KVBRIDGE_SGLANG_VENV:-$HOME/.cache/kvbridge/sglang-venv}"
PYTHON="${KVBRIDGE_SGLANG_PYTHON:-python3}"
MARKER="$VENV/.kvbridge-sglang-env"
LOG="$VENV.log"

note() { echo "sglang_env.sh: $*" >&2; }
skip() { note "SKIP: $*"; exit 2; }
fail() { note "FAILED: $* (log: $LOG)"; exit 1; }

# sglang 0.5.23 ships cp311 wheels and requires Python >= 3.11: say so rather than let pip's
# resolver say it less plainly.
PY_VERSION=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) \
  || skip "no Python interpreter '$PYTHON' (set KVBRIDGE_SGLANG_PYTHON)"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || skip "sglang $SGLANG_VERSION needs Python >= 3.11; $PYTHON is $PY_VERSION" \
       "(set KVBRIDGE_SGLANG_PYTHON)"

# What the marker must say for the venv to be reused: the versions, the interpreter, the
# excluded set, and the checkout kvbridge and the stand-ins come from (both are used in place:
# another checkout is re-pointed, not rebuilt).
ENGINE="sglang==$SGLANG_VERSION sglang-router==$ROUTER_VERSION"
ENGINE="$ENGINE mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION torch==$TORCH_VERSION"
ENGINE="$ENGINE excluded=$(IFS=,; echo "${EXCLUDED_DEPS[*]}") python=$PY_VERSION"
# The project's metadata too: a new entry point (SGLang's plugin) needs the editable install
# redone.
WANT="$ENGINE kvbridge-editable=$ROOT kvbridge-metadata=$(cksum <"$ROOT/pyproject.toml" | cut -d' ' -f1)"

mkdir -p "$(dirname "$VENV")"
# One builder at a time (two test runs starting together must not both pip into one venv).
exec 9>"$VENV.lock"
if command -v flock >/dev/null; then
  timeout 1800 flock 9 || fail "timed out waiting for $VENV.lock"
fi

VPY="$VENV/bin/python"
# The last word: SGLang, its router and kvbridge import, SGLang is the wanted release, and
# sgl_kernel and torchvision are the stand-ins (a real CUDA build that slipped in would shadow
# them and break on CPU torch).
import_check() {
  timeout 300 "$VPY" - "$SGLANG_VERSION" "$STANDINS" >>"$LOG" 2>&1 <<'EOF'
import os, sys
import sglang, sglang_router, kvbridge, sgl_kernel, torchvision
want, standins = sys.argv[1], os.path.realpath(sys.argv[2])
assert sglang.__version__ == want, f"sglang {sglang.__version__}, want {want}"
for mod in (sgl_kernel, torchvision):
    where = os.path.realpath(mod.__file__)
    assert where.startswith(standins + os.sep), f"{mod.__name__} is {where}, not the stand-in"
EOF
}

# Puts the stand-ins (this checkout's) on the venv's path, and tells pip that torchvision is
# present, so that a dependency asking for it (timm) does not pull the CUDA build in.
install_standins() {
  local site
  site=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
  # A .pth line is a directory appended to sys.path: after site-packages, so the import check
  # above is what catches a real package shadowing a stand-in.
  echo "$STANDINS" >"$site/kvbridge-sglang-standins.pth"
  # A METADATA-only dist-info (no RECORD, so pip can never uninstall files through it), as
  # scripts/vllm_env.sh does for its vllm alias.
  local dist="$site/torchvision-$TORCHVISION_STANDIN_VERSION.dist-info"
  rm -rf "$site"/torchvision-*.dist-info
  mkdir -p "$dist"
  {
    echo "Metadata-Version: 2.1"
    echo "Name: torchvision"
    echo "Version: $TORCHVISION_STANDIN_VERSION"
    echo "Summary: kvbridge's test-only torchvision stand-in ($STANDINS/torchvision)"
  } >"$dist/METADATA"
  echo kvbridge-sglang_env.sh >"$dist/INSTALLER"
}

# mooncake (SGLang's own backend, the comparison) loads libibverbs even for TCP; scripts/test.sh
# installs libibverbs1. Without it only the comparison is lost, so this is a note, not a failure.
mooncake_check() {
  timeout 120 "$VPY" -c 'from mooncake.engine import TransferEngine' >>"$LOG" 2>&1 \
    || note "mooncake's engine does not load in $VENV (libibverbs1 missing?):" \
            "SGLang's mooncake backend is unavailable"
}

if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$WANT" ] && [ -x "$VPY" ]; then
  if import_check; then
    mooncake_check
    note "reusing $VENV ($WANT)"
    echo "$VPY"
    exit 0
  fi
  note "marker matches but the import check fails; rebuilding $VENV"
elif [ -f "$MARKER" ] && [ "$(sed 's/ kvbridge-editable=.*//' "$MARKER")" = "$ENGINE" ] \
    && [ -x "$VPY" ]; then
  # The same engines, kvbridge from another checkout (a CI clone): point the editable install
  # and the stand-ins here instead of rebuilding 3.6 GB.
  if timeout 600 "$VPY" -m pip --disable-pip-version-check install -q --no-deps -e "$ROOT" \
      >>"$LOG" 2>&1 && install_standins && import_check; then
    echo "$WANT" >"$MARKER"
    mooncake_check
    note "reusing $VENV, kvbridge and the stand-ins now from $ROOT"
    echo "$VPY"
    exit 0
  fi
  note "could not point $VENV at $ROOT; rebuilding"
fi

start=$(date +%s)
rm -rf "$VENV"
: >"$LOG"
note "building $VENV (log: $LOG)"
"$PYTHON" -m venv "$VENV" >>"$LOG" 2>&1 || fail "$PYTHON -m venv $VENV"
pip() {
  pip_from=$(( $(wc -l <"$LOG") + 1 ))  # where this call's output starts in the log
  timeout 1200 "$VPY" -m pip --disable-pip-version-check "$@" >>"$LOG" 2>&1
}
# Where the build's time goes, in the log (a fresh build is minutes; the reuse path seconds).
stamp() { echo "=== sglang_env.sh: +$(( $(date +%s) - start )) s: $*" >>"$LOG"; }
# The last pip call's first error line, for a SKIP reason: the first names the cause ("Could not
# find a version that satisfies..."), the last only that resolution failed; the resolver's note
# about sglang's unmet CUDA pins is not a cause. (|| true: with pipefail a log without an error
# line would otherwise end the script here.)
pip_error() {
  tail -n "+$pip_from" "$LOG" | { grep -E '^(ERROR|error):' || true; } \
    | { grep -v "dependency resolver does not currently" || true; } | head -n 1 | cut -c1-300
}

# Any failure from here to the dependencies means "no SGLang on this machine": skip, with pip's
# reason, and leave no half-built venv behind.
# The CPU torch first, so that nothing after it can bring a CUDA one.
stamp "torch"
if ! pip install "torch==$TORCH_VERSION"; then
  reason=$(pip_error); rm -rf "$VENV"
  skip "pip install torch==$TORCH_VERSION (the CPU build SGLang runs on here) failed:" \
       "${reason:-see $LOG}"
fi
# sglang alone: its declared dependencies are read below and installed selectively.
stamp "sglang"
if ! pip install --no-deps "sglang==$SGLANG_VERSION"; then
  reason=$(pip_error); rm -rf "$VENV"
  skip "pip install sglang==$SGLANG_VERSION failed: ${reason:-see $LOG}"
fi

install_standins || fail "could not install the stand-ins from $STANDINS"

# sglang's runtime dependencies as its wheel declares them (Requires-Dist, markers evaluated for
# this interpreter, extras left out), less EXCLUDED_DEPS; then the router and mooncake.
reqs="$VENV/.sglang-requirements.txt"
"$VPY" - "${EXCLUDED_DEPS[@]}" >"$reqs" 2>>"$LOG" <<'EOF' \
  || fail "could not read sglang's dependencies"
import importlib.metadata as md
import sys

try:  # pip carries packaging even where the venv does not have it yet
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

excluded = {canonicalize_name(name) for name in sys.argv[1:]}
for line in md.requires("sglang") or ():
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # another platform's, or an optional extra's
    if canonicalize_name(req.name) in excluded:
        continue
    req.marker = None
    print(req)
EOF
[ -s "$reqs" ] || fail "sglang $SGLANG_VERSION declares no dependencies? ($reqs is empty)"
echo "sglang-router==$ROUTER_VERSION" >>"$reqs"
echo "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION" >>"$reqs"

# torch and the torchvision stand-in held where they are: a dependency that asked for another
# torch (a CUDA build) fails the resolution instead of replacing it.
constraints="$VENV/.sglang-constraints.txt"
printf 'torch==%s\ntorchvision==%s\n' "$TORCH_VERSION" "$TORCHVISION_STANDIN_VERSION" \
  >"$constraints"
stamp "sglang's dependencies"
# pip reports that sglang's own pins (torch 2.14.1, the CUDA packages) are not met: expected.
if ! pip install -c "$constraints" -r "$reqs"; then
  reason=$(pip_error); rm -rf "$VENV"
  skip "pip install of sglang $SGLANG_VERSION's dependencies (CPU torch held) failed:" \
       "${reason:-see $LOG}"
fi

# kvbridge without extras, editable. Every package already in the venv is held at its installed
# version (SGLang's pins), so pip can only add kvbridge's missing core dependencies.
stamp "kvbridge"
freeze="$VENV/.sglang-freeze.txt"
"$VPY" -m pip freeze --disable-pip-version-check 2>>"$LOG" | grep '==' >"$freeze" || true
if ! pip install -c "$freeze" -e "$ROOT"; then
  note "kvbridge's dependencies conflict with SGLang's pins; installing kvbridge with --no-deps"
  pip install --no-deps -e "$ROOT" || fail "pip install --no-deps -e $ROOT"
fi
# kvbridge's core dependencies must be importable whichever way it went in.
timeout 120 "$VPY" - >>"$LOG" 2>&1 <<'EOF' || fail "a kvbridge core dependency is missing"
import importlib
for mod in ("numpy", "click", "rich", "msgspec", "zmq", "aiohttp", "prometheus_client"):
    importlib.import_module(mod)
EOF

stamp "import check"
import_check || {
  reason=$({ grep -E 'Error' "$LOG" || true; } | tail -n 1 | cut -c1-300)
  fail "the import check fails in $VENV: ${reason:-see log}"
}
mooncake_check
stamp "done"
echo "$WANT" >"$MARKER"
note "ready in $(( $(date +%s) - start )) s: $VENV ($(du -sh "$VENV" 2>/dev/null | cut -f1))"
echo "$VPY"
