"""The live processes of a process group, for the tests that check a command leaves none."""

from __future__ import annotations

import subprocess


def members(pgid: int) -> list[str]:
    """``pid stat args`` of each process in group ``pgid`` that is not a zombie (a zombie is
    gone, waiting for init to reap it)."""
    ps = subprocess.run(["ps", "-o", "pid=,stat=,args=", "-g", str(pgid)], capture_output=True)
    return [line for line in ps.stdout.decode().splitlines() if line.split()[1:2] != ["Z"]]
