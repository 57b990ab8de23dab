"""Ctrl-C at any moment of a command that starts processes: the command says ``Aborted!`` and
exits 1, no process prints a traceback, and none is left running.

The terminal sends SIGINT to the whole foreground process group; these tests do the same
(``killpg``), once its first child exists: early (the fork server importing torch, ranks
importing kvbridge) and mid-run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from process_group import members

pytestmark = pytest.mark.slow

CASES = [  # (command, seconds after its first child exists)
    (["demo", "--model", "qwen3"], 1.0),  # the fork server importing torch
    (["chaos", "--requests", "300"], 1.0),  # spawned ranks importing kvbridge
    (["chaos", "--requests", "300"], 6.0),  # a round with its fault in flight
    (["bench", "transfer", "--transports", "tcp,shm"], 5.0),  # ranks mid-transfer
]


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize(("argv", "after"), CASES, ids=[f"{c[0][0]}-{c[1]}s" for c in CASES])
def test_ctrl_c_ends_the_command_and_every_process_it_started(
    argv: list[str], after: float
) -> None:
    if argv[0] == "demo":
        pytest.importorskip("transformers", reason="the demo needs pip install -e '.[demo]'")
    p = subprocess.Popen(
        [sys.executable, "-m", "kvbridge.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, as a terminal's foreground job
        # SIGINT as a terminal's job has it: a suite started in the background (`nohup ... &`)
        # hands its children SIGINT ignored, and Python then never installs its handler.
        preexec_fn=_default_sigint,
    )
    end = time.monotonic() + 60
    while len(members(p.pid)) < 2 and p.poll() is None and time.monotonic() < end:
        time.sleep(0.05)  # the command's first child: from here on, there is one to shield
    time.sleep(after)
    assert p.poll() is None, "the command ended before Ctrl-C: nothing was tested"
    assert len(members(p.pid)) >= 2, "no child process yet: nothing was tested"
    os.killpg(p.pid, signal.SIGINT)
    out = p.communicate(timeout=60)[0].decode()
    assert "Traceback" not in out, out
    # (after it, the chaos soak may print the resource tracker's note that it unlinked the
    # segments of a rank the soak had killed -9 in its last round: cleanup, not an error)
    assert p.returncode == 1 and "Aborted!" in out.splitlines(), (p.returncode, out[-2000:])
    end = time.monotonic() + 15
    while (left := members(p.pid)) and time.monotonic() < end:
        time.sleep(0.2)
    assert not left, left
