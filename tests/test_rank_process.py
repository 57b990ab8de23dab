"""A rank process (:class:`kvbridge.chaos.process.RankProcess`) outlives nothing: its parent
gone, however it went, it ends quietly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# A parent that sends a rank three commands, waits until their replies are there, and dies
# without reading them: its end of the pipe goes with unread bytes, so the rank's next read
# is refused (ECONNRESET), not ended (EOF), as when a command is interrupted mid-run.
PARENT = """
import os, sys
sys.path.insert(0, sys.argv[1])
from kvbridge.chaos.process import RankProcess

if __name__ == "__main__":
    rank = RankProcess("rank", dict).started()
    for key in ("a", "b", "c"):
        rank.start("get", key)
    assert rank._conn.poll(30), "no reply"
    print(rank.pid, flush=True)
    os._exit(0)
"""


@pytest.mark.slow  # a parent killed, and its ranks given seconds to end: 5-16 s
def test_a_rank_whose_parent_died_with_replies_unread_ends_without_a_traceback(
    tmp_path: Path,
) -> None:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    # The rank inherits the parent's stderr: reading it to its end waits for the rank too.
    done = subprocess.run(
        [sys.executable, str(script), str(SRC)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip().isdigit(), done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
