"""kvbridge.deploy.shield.running: after its block, the processes share one grace window to
end, then those left are killed (a demo case with two stopped ranks waited twice its grace)."""

from __future__ import annotations

import multiprocessing as mp
import time

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
