"""kvbridge.deploy.shield.running: after its block, the processes share one grace window to
end, then those left are killed (a demo case with two stopped ranks waited twice its grace),
a stopped one at once;
a command process that runs no demo forks its ranks from a server that did not import torch."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbridge.deploy import shield
from kvbridge.wire import liveness


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


def _wait_for_the_writers(r: int, w: int) -> None:
    """Ends when every holder of the pipe's write end is gone (a peer waiting on another)."""
    os.close(w)
    while os.read(r, 1):
        pass


@pytest.mark.slow  # starts processes
def test_a_stopped_process_is_killed_at_once_not_after_the_grace() -> None:
    """A rank stopped by SIGSTOP (a stall fault) cannot end in its grace: it is killed before
    any wait, while the others still get theirs, a peer that waits on it (listed first here)
    included (a demo case with a stopped rank waited its whole grace for nothing)."""
    ctx = mp.get_context("fork")
    r, w = os.pipe()
    waiting = ctx.Process(target=_wait_for_the_writers, args=(r, w))
    stuck = ctx.Process(target=time.sleep, args=(120,))  # holds the write end
    try:
        with shield.running(waiting, stuck, grace=60):
            os.close(w)
            os.kill(stuck.pid, signal.SIGSTOP)
            for _ in range(1000):
                if liveness.stopped(stuck.pid):
                    break
                time.sleep(0.01)
            assert liveness.stopped(stuck.pid)
            t0 = time.monotonic()
        took = time.monotonic() - t0
    finally:
        os.close(r)
    assert stuck.exitcode == -signal.SIGKILL
    assert waiting.exitcode == 0  # given its grace: it ended by itself once its peer was gone
    assert took < 30, took  # not the 60 s grace


# A command process's rank, forked from its fork server: says whether it has torch.
PROBE = """
import sys
from kvbridge.deploy import shield

def probe(q):
    q.put("torch" in sys.modules)

if __name__ == "__main__":
    shield.command_process()
    shield.without_demo()
    ctx = shield.fork_context()
    q = ctx.Queue()
    p = ctx.Process(target=probe, args=(q,))
    with shield.running(p):
        print(q.get(timeout=120))
"""


@pytest.mark.slow  # starts processes: the fast tier's are in-process
def test_a_command_without_the_demo_forks_its_ranks_from_a_server_without_torch(
    tmp_path: Path,
) -> None:
    """``kvbridge bench`` and ``chaos`` as processes of their own: their ranks come from a fork
    server that never imported the demo's torch and transformers (7-8 s of CPU less)."""
    pytest.importorskip("torch", reason="the demo's torch not installed: nothing to leave out")
    (tmp_path / "probe.py").write_text(PROBE)
    got = subprocess.run(
        [sys.executable, str(tmp_path / "probe.py")], capture_output=True, text=True, timeout=180
    )
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "False", got.stdout + got.stderr


def test_a_command_called_inside_another_process_keeps_its_fork_server_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Called in-process (a test's, a program's), ``bench`` leaves the fork server as it is: that
    process's later demo ranks come from the same server and need torch (imported in each, a
    test module of demo cases took 78 -> 1,156 core-s)."""
    from click.testing import CliRunner

    from kvbridge.cli import main

    def bench() -> None:  # refused after its first step (no such device): nothing started
        got = CliRunner().invoke(main, ["bench", "--device", "tpu"])
        assert got.exit_code == 2, got.output

    bench()
    assert shield.preload() == shield.PRELOAD
    # The control: the same call in a command process leaves the demo out.
    monkeypatch.setattr(shield, "_command_process", True)
    monkeypatch.setattr(shield, "_demo", True)
    bench()
    assert shield.preload() == tuple(m for m in shield.PRELOAD if m not in shield.DEMO)


# A demo command's parent: which of the ranks' heavy modules it imported by its end.
DEMO_PARENT = """
import sys
from kvbridge.cli.commands import main

if __name__ == "__main__":
    try:
        main(["demo", "--model", "qwen3", "--topology", "tp2-tp1", "--transport", "shm",
              "--new-tokens", "2"], prog_name="kvbridge", standalone_mode=False)
    finally:
        print(sorted(m for m in ("torch", "transformers", "kvbridge.demo.workers")
                     if m in sys.modules))
"""


@pytest.mark.slow  # a demo case's processes
def test_the_demo_commands_parent_leaves_torch_to_its_ranks(tmp_path: Path) -> None:
    """`kvbridge demo` computes in its ranks and its reference process; its parent only
    deploys and judges, and imported the ranks' module (torch, transformers, every case's
    modeling module: 4-5 s of CPU) for one constant until 0268057."""
    pytest.importorskip("torch", reason="the demo needs torch: pip install -e '.[demo]'")
    (tmp_path / "parent.py").write_text(DEMO_PARENT)
    got = subprocess.run(
        [sys.executable, str(tmp_path / "parent.py")], capture_output=True, text=True, timeout=180
    )
    assert got.returncode == 0, got.stderr[-2000:]
    assert "1 of 1 cases token-exact" in got.stdout, got.stdout[-2000:]
    assert got.stdout.strip().splitlines()[-1] == "[]", got.stdout[-2000:]
