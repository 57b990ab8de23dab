#!/usr/bin/env bash
# Proves kvbridge's CUDA device-memory path on one GPU machine, in one run (about 5.5 minutes on an
# H100; every step under a timeout of its own):
#   scripts/gpu_check.sh [nixl] [mooncake]
# installs kvbridge (pip --no-deps -e .; no package registry is needed), and the optional
# engines named, each from a wheel placed beside the tree (wheels/nixl*.whl, wheels/mooncake*.whl);
# (scripts/gpu_wheels.sh puts all of them there, small enough to travel together); runs
# tests/test_gpu.py (the byte grid on device pools over every transport present, the refusals,
# the ordering hook, the demo's models on the GPU over each transport, the vLLM connector's
# workers over CUDA tensors), tcp's admission and fence on device memory, the Bridge's faults on
# device pools (tests/test_fencing.py's [cuda] cases: writers stopped and killed, a decode rank
# killed and paused, every rank its own process), `kvbridge demo
# --device cuda` (every model and layout of the demo, on the GPU: cudaipc and tcp) and
# `kvbridge bench --device cuda`; ends with one summary table. Without CUDA it prints one SKIP
# line and exits 2.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
ENGINES=("$@")

# torch alone (importing kvbridge needs its dependencies, checked below: a missing one must not
# read as "no CUDA").
why="$("$PY" -c '
try:
    import torch
except ImportError as e:
    print(f"no torch ({e})")
else:
    if torch.version.cuda is None:
        print(f"torch {torch.__version__} is built without CUDA")
    elif not torch.cuda.is_available():
        print(f"torch {torch.__version__} sees no CUDA device")' 2>&1 | tail -n 1)"
if [ -n "$why" ]; then
    echo "gpu_check.sh: SKIP: $why"
    exit 2
fi
for engine in "${ENGINES[@]}"; do
    case "$engine" in
        nixl|mooncake) ;;
        *) echo "gpu_check.sh: unknown engine '$engine' (nixl or mooncake)" >&2; exit 2 ;;
    esac
done

LOG="${GPU_CHECK_LOG:-$ROOT/gpu_check.log}"
: > "$LOG"
declare -a ROWS=()
status=0

step() {  # step NAME TIMEOUT_S COMMAND...
    local name="$1" limit="$2"; shift 2
    local t0=$SECONDS rc
    echo "=== $name: $*" | tee -a "$LOG"
    timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    local verdict=PASS
    [ "$rc" -eq 124 ] && verdict="TIMEOUT(${limit}s)"
    [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && verdict="FAIL(rc=$rc)"
    [ "$rc" -ne 0 ] && status=1
    ROWS+=("$(printf '%-34s %-14s %5ss' "$name" "$verdict" "$((SECONDS - t0))")")
}

# kvbridge's own pure-python dependencies (pyproject's), expected on the machine already.
missing="$("$PY" - <<'PYEOF'
import importlib.util as u
need = {"numpy": "numpy", "click": "click", "rich": "rich", "msgspec": "msgspec",
        "zmq": "pyzmq", "aiohttp": "aiohttp", "prometheus_client": "prometheus-client",
        "pytest": "pytest", "torch": "torch", "setuptools": "setuptools"}
print(" ".join(p for m, p in need.items() if u.find_spec(m) is None))
PYEOF
)"
if [ -n "$missing" ]; then
    wheels=$(ls wheels/*.whl 2>/dev/null || true)
    [ -n "$wheels" ] && "$PY" -m pip install --no-index --find-links wheels $missing >>"$LOG" 2>&1
    still="$("$PY" -c "import importlib.util as u, sys; print(' '.join(m for m in sys.argv[1:] \
        if u.find_spec({'pyzmq': 'zmq', 'prometheus-client': 'prometheus_client'}.get(m, m)) is None))" \
        $missing)"
    if [ -n "$still" ]; then
        echo "gpu_check.sh: FAILED: missing $still (no package registry here: put their wheels" \
             "in wheels/, e.g. pip download -d wheels $still, carried with the tree)" >&2
        exit 1
    fi
fi
step "install kvbridge" 60 "$PY" -m pip install --no-deps --no-build-isolation -e .
# The transformers release the demo's specs are written against (the machine's may be older).
demo_tf=$(ls wheels/transformers-*.whl 2>/dev/null | head -n 1)
if [ -n "$demo_tf" ]; then
    step "install $(basename "$demo_tf" | cut -d- -f1-2)" 60 "$PY" -m pip install --no-deps "$demo_tf"
fi
for engine in "${ENGINES[@]}"; do
    wheel=$(ls wheels/"$engine"*.whl 2>/dev/null | head -n 1)
    if [ -n "$wheel" ]; then
        step "install $engine ($(basename "$wheel"))" 30 "$PY" -m pip install --no-deps "$wheel"
    else
        ROWS+=("$(printf '%-34s %-14s' "install $engine" "SKIP(no wheel)")")
    fi
done
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name(0))' 2>&1 | tee -a "$LOG"
step "tests/test_gpu.py, tcp fencing" 200 "$PY" -m pytest -q -p no:cacheprovider -rA \
    tests/test_gpu.py tests/test_tcp_fencing.py -k "not tcp_fencing or cuda"
step "fencing faults, device pools" 180 "$PY" -m pytest -q -p no:cacheprovider -rA \
    tests/test_fencing.py -k cuda
step "kvbridge demo --device cuda" 140 "$PY" -m kvbridge demo --device cuda
step "kvbridge bench --device cuda" 60 "$PY" -m kvbridge bench --device cuda

echo
echo "gpu_check.sh summary ($(date -u +%FT%TZ), engines: ${ENGINES[*]:-none}; log: $LOG)"
printf '%-34s %-14s %6s\n' STEP RESULT TIME
for r in "${ROWS[@]}"; do echo "$r"; done
exit $status
