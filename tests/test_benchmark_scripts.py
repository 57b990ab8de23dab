"""The benchmark scripts the docs quote still start: each answers --help (their imports and
options parse) without the engines they measure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

# A name starting with "_" is a helper module the scripts import, not a script.
SCRIPTS = sorted(
    p
    for p in (Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py")
    if not p.name.startswith("_")
)


@pytest.mark.slow  # starts processes: the fast tier's are in-process
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


# The vLLM benchmarks' --nixl-poll-us way: a start-up hook on the servers' PYTHONPATH.
NIXL_POLL_CHECK = """
import importlib, os
api = importlib.import_module("nixl_cu12._api")
config = api.nixlBind.nixlAgentConfig()
config.pthrDelay = 0  # what nixl_agent sets, whatever its caller asked
print(config.pthrDelay)
config.pthrDelay = 5000
print(config.pthrDelay)
api.nixl_agent("kvbridge-bench-check")  # NIXL still takes the config it builds
print("agent", flush=True)
os._exit(0)  # (NIXL 1.5.1's agent crashes the interpreter's exit, hook or not)
"""


@pytest.mark.slow  # starts processes: the fast tier's are in-process
def test_the_nixl_poll_hook_makes_nixls_progress_thread_wait() -> None:
    pytest.importorskip("nixl_cu12", reason="NIXL is not installed here")
    hook = Path(__file__).resolve().parents[1] / "benchmarks" / "nixl_poll"
    env = {"PYTHONPATH": str(hook), "KVBRIDGE_BENCH_NIXL_POLL_US": "2000", "PATH": ""}
    got = subprocess.run(
        [sys.executable, "-c", NIXL_POLL_CHECK], capture_output=True, text=True, env=env, timeout=60
    )
    assert got.returncode == 0, got.stderr[-2000:]
    lines = got.stdout.split("\n")  # (NIXL logs to standard output too)
    assert lines[:2] == ["2000", "5000"] and "agent" in lines, got.stdout
    assert "NIXL's progress thread waits 2000 us" in got.stderr


@pytest.mark.slow  # two processes a way
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="ask_path.py pins two cores")
def test_the_ask_path_benchmark_measures_both_ways() -> None:
    """`benchmarks/ask_path.py` runs its requests through a real pair of Bridges and a bare
    ZeroMQ pair, and prints both ways' times (docs/benchmarks.md quotes it)."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "ask_path.py"
    got = subprocess.run(
        [sys.executable, str(script), "--requests", "30", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert got.returncode == 0, got.stderr[-2000:]
    lines = got.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["kvbridge", "zmq"], got.stdout
    assert all("(10 requests)" in line for line in lines), got.stdout


def _paired() -> type:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        from _spread import Paired
    finally:
        sys.path.pop(0)
    return Paired


def test_a_paired_ratio_says_level_only_where_its_interval_holds_one() -> None:
    paired = _paired()
    rng = np.random.default_rng(7)

    def rounds(factor: float, noise: float) -> list[list[tuple[float, float]]]:
        base = [rng.uniform(0.05, 0.5, 32) for _ in range(6)]
        return [[(b * factor * rng.lognormal(0, noise), b) for b in r] for r in base]

    same = paired.of(rounds(1.0, 0.0))
    assert (same.median, same.lo, same.hi, same.n) == (1.0, 1.0, 1.0, 192)
    assert paired.of(rounds(1.1, 0.02)).verdict() == "behind"
    assert paired.of(rounds(0.9, 0.02)).verdict() == "ahead"
    noisy = paired.of(rounds(1.0, 0.3))
    assert noisy.lo < 1 < noisy.hi and noisy.verdict() == "level"
    # A round's requests move together under load: drawing whole rounds widens the interval
    # beyond what the requests' own spread gives.
    shifts = (0.85, 0.92, 0.97, 1.03, 1.08, 1.15)
    shifted = [[(a * s, b) for a, b in r] for r, s in zip(rounds(1.0, 0.05), shifts, strict=True)]
    by_round, pooled = paired.of(shifted), paired.of([[p for r in shifted for p in r]])
    assert by_round.hi - by_round.lo > 2 * (pooled.hi - pooled.lo)
    failed_only = [[(0.0, 1.0)], [(1.0, float("nan"))]]
    with pytest.raises(ValueError, match="no pair"):
        paired.of(failed_only)
