"""The benchmark scripts the docs quote still start: each answers --help (their imports and
options parse) without the engines they measure."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# A name starting with "_" is a helper module the scripts import, not a script.
SCRIPTS = sorted(
    p
    for p in (Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py")
    if not p.name.startswith("_")
)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_benchmark_script_starts(script: Path) -> None:
    got = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60
    )
    assert got.returncode == 0, got.stderr
    assert "usage:" in got.stdout.lower()  # argparse and click


def test_there_are_scripts_to_check() -> None:
    assert {p.name for p in SCRIPTS} >= {
        "vllm_connectors.py",
        "vllm_serving.py",
        "sglang_backends.py",
    }
