"""The byte grid over SGLang 0.5.23's REAL pool classes: kvbridge's description of each pool
type (``HybridReqToTokenPool`` + ``HybridLinearKVPool`` for a Mamba2, a gated-delta-net and a
Kimi-delta-attention hybrid, ``SWAKVPool`` for gpt-oss and for Llama 4's chunked layers,
``MLATokenToKVPool``, ``DSATokenToKVPool``), read from
the ``KVArgs`` SGLang's own ``setup_state_kv_args`` fills, and a request moved between the real
pools of prefill and decode ranks at TP pairs (1, 1), (2, 1), (1, 2), (2, 4), (4, 2), different
page sizes and page tables, a decode prefix hit and two chunks: every buffer of every decode
rank must equal SGLang's own writes of the decode-TP shard of one logical cache, canary bytes
elsewhere. tests/test_sglang_states.py and tests/test_sglang_mla_pools.py prove the same on numpy
stand-ins shaped like these pools, with many more shapes; this proves the stand-ins' shapes and
SGLang's ``KVArgs`` contract are the real ones.

The pools are built on CPU in the SGLang venv (tests/sglang_real_pool_checks.py holds the
checks, how each pool is built, and the oracle; KVBRIDGE_SGLANG_PY or scripts/sglang_env.sh gives
the python). Skips, saying why, where SGLang cannot be installed (scripts/sglang_env.sh).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from sglang_servers import sglang_python

pytestmark = pytest.mark.slow  # the SGLang venv (built on first use) and a 15-40 s subprocess

CASES = ("mamba2", "mamba2_1g", "gdn", "swa", "llama4", "mla", "dsa", "kda")
TP_PAIRS = ((1, 1), (2, 1), (1, 2), (2, 4), (4, 2))
# Llama 4 described wrongly on purpose: "ok" where the bytes differed or kvbridge refused.
CONTROLS = (
    "llama4 control window-1 2->1",
    "llama4 control last-chunk 1->2",
    "llama4_norope refused",
)
CHECKS = tuple(f"{case} {p}->{d}" for case in CASES for p, d in TP_PAIRS) + CONTROLS


@pytest.fixture(scope="module")
def results() -> dict[str, str]:
    script = Path(__file__).with_name("sglang_real_pool_checks.py")
    # The pools' accelerator layouts: SGLang's CPU engine pads GDN heads to the TP size and
    # re-lays conv state on AMX CPUs (the checks' docstring).
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_USE_CPU_ENGINE"}
    done = subprocess.run(
        [str(sglang_python()), str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_every_check_ran(results: dict[str, str]) -> None:
    assert set(results) == set(CHECKS)


@pytest.mark.parametrize("name", CHECKS)
def test_real_pools_move_exactly(results: dict[str, str], name: str) -> None:
    got = results.get(name)
    if got != "ok":
        pytest.fail(str(got), pytrace=False)
