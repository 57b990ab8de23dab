"""kvbridge.memory.heap: a new process's allocator keeps a large request's arrays in its heap
after ``raise_thresholds``, as a long-running one does, instead of mapping and faulting them in
anew each request. Measured in fresh processes (the allocator's state is the process's)."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc" or not hasattr(ctypes.CDLL(None), "mallinfo2"),
    reason="glibc's malloc thresholds (mallinfo2: glibc 2.33 or later)",
)

# Each "request": three 6 MiB arrays alive together, written, then freed (a plan's arrays).
# Printed: the blocks glibc mapped for the first array of a request (mallinfo2's hblks),
# and the page faults of the requests after the first two.
_REQUESTS = """
import ctypes, json, resource, sys
import numpy as np
if sys.argv[1] == "raised":
    from kvbridge.memory import heap
    heap.raise_thresholds()
class Info(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
mapped = libc.mallinfo2().hblks
first = np.empty(6 << 20, np.uint8)
mapped = libc.mallinfo2().hblks - mapped
del first
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    arrays = [np.empty(6 << 20, np.uint8) for _ in range(3)]
    for a in arrays:
        a.fill(1)
    del arrays, a
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps([mapped, sum(faults[2:])]))
"""


def _requests(mode: str) -> tuple[int, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), *filter(None, [env.get("PYTHONPATH")])])
    out = subprocess.run(
        [sys.executable, "-c", _REQUESTS, mode],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=60,
    )
    mapped, faults = json.loads(out.stdout)
    return mapped, faults


@pytest.mark.slow  # starts processes: the fast tier's are in-process
def test_a_new_process_keeps_a_requests_arrays_once_the_thresholds_are_raised() -> None:
    mapped, _ = _requests("default")
    assert mapped == 1  # a new process maps a 6 MiB block of its own
    mapped, faults = _requests("raised")
    assert mapped == 0  # from the heap
    pages = 4 * 3 * (6 << 20) // 4096  # four requests' arrays, page by page
    assert faults < pages // 100  # the heap's memory, kept and reused: not faulted in anew
