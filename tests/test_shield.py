"""kvbridge.deploy.shield.running: after its block, the processes share one grace window to
end, then those left are killed (a demo case with two stopped ranks waited twice its grace);
a command that runs no demo forks its ranks from a server that did not import torch."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbridge.deploy import shield


@pytest.mark.slow  # waits out its grace window
def test_stuck_processes_share_one_grace_window_then_are_killed() -> None:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=time.sleep, args=(60,)) for _ in range(3)]
    quick = ctx.Process(target=time.sleep, args=(0,))
    grace = 2.0
    with shield.running(*procs, quick, grace=grace):
        quick.join(30)
        t0 = time.monotonic()
    took = time.monotonic() - t0
    assert quick.exitcode == 0
    assert [p.exitcode for p in procs] == [-9, -9, -9]
    assert grace <= took < 2.5 * grace, took  # one window, not one a process (6 s)


# A command's rank, forked from the fork server: says whether it has torch without importing it.
PROBE = """
import sys
from kvbridge.deploy import shield

def probe(q):
    q.put("torch" in sys.modules)

if __name__ == "__main__":
    if sys.argv[1] == "without_demo":
        shield.without_demo()
    ctx = shield.fork_context()
    q = ctx.Queue()
    p = ctx.Process(target=probe, args=(q,))
    with shield.running(p):
        print(q.get(timeout=120))
"""


@pytest.mark.parametrize("how", ["default", "without_demo"])
def test_a_command_without_the_demo_forks_its_ranks_from_a_server_without_torch(
    how: str, tmp_path: Path
) -> None:
    """By default the fork server imports the demo's torch and transformers for every user's
    ranks; a command that runs none of the demo's (``kvbridge bench``, ``chaos``) leaves them
    out: its ranks come from a server that never imported torch (7-8 s of CPU less)."""
    (tmp_path / "probe.py").write_text(PROBE)
    got = subprocess.run(
        [sys.executable, str(tmp_path / "probe.py"), how],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == str(how == "default"), got.stdout + got.stderr
