"""kvbridge's test-only kernel stand-ins for SGLang's CPU path (tests/sglang_standins/sgl_kernel:
the causal conv1d, the gated delta rule, the Mamba2 scan and update, the gated RMSNorm, the shared
expert's gate) against independent pure-torch references, in the SGLang venv where they are used
(tests/sglang_standin_checks.py holds the checks; KVBRIDGE_SGLANG_PY or scripts/sglang_env.sh
gives the python). The state these kernels leave in SGLang's pools is what kvbridge moves
between a prefill and a decode server, so each check is a packed prefill into scattered slots then
one decode step, compared with the reference's all-at-once run, outputs and slot states both.

Skips, saying why, where SGLang cannot be installed (scripts/sglang_env.sh).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from sglang_servers import sglang_python

pytestmark = pytest.mark.slow  # the SGLang venv (built on first use) and a 20 s subprocess

CHECKS = (
    "conv_prefill_then_update",
    "gdn_prefill_then_decode",
    "mamba2_prefill_then_decode",
    "gated_norm_and_shared_expert_gate",
    "patched_and_loud",
)


@pytest.fixture(scope="module")
def results() -> dict[str, str]:
    script = Path(__file__).with_name("sglang_standin_checks.py")
    # SGLANG_USE_CPU_ENGINE: SGLang's CPU path, the only one the stand-ins patch.
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
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
def test_standin_matches_reference(results: dict[str, str], name: str) -> None:
    assert results.get(name) == "ok", results.get(name)
