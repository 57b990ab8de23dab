"""kvbridge's SGLang sender and receiver through the sequences SGLang's schedulers drive, in the
SGLang venv, without servers (tests/sglang_adapter_checks.py holds the checks and says how;
KVBRIDGE_SGLANG_PY or scripts/sglang_env.sh gives the python). Skips, saying why, where SGLang
cannot be installed (scripts/sglang_env.sh)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from sglang_servers import sglang_python

pytestmark = pytest.mark.slow  # the SGLang venv (built on first use) and a 15 s subprocess

CHECKS = (
    "an_abort_before_init_leaves_nothing_behind",
    "a_sender_holding_an_ask_ends_when_the_decode_aborts_or_at_its_deadline",
    "bad_state_indices_and_rooms_fail_typed_and_at_once",
    "released_receivers_sglang_never_cleared_are_forgotten",
)


@pytest.fixture(scope="module")
def results() -> dict[str, str]:
    script = Path(__file__).with_name("sglang_adapter_checks.py")
    done = subprocess.run(
        [str(sglang_python()), str(script)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_every_check_ran(results: dict[str, str]) -> None:
    assert set(results) == set(CHECKS)


@pytest.mark.parametrize("name", CHECKS)
def test_the_adapter_ends_it_right(results: dict[str, str], name: str) -> None:
    assert results.get(name) == "ok", results.get(name)
