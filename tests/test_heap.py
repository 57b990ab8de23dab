"""kvbridge.memory.heap: a new process's allocator keeps a large request's arrays in its heap
after ``raise_thresholds``, as a long-running one does, instead of mapping and faulting them in
anew each request. Measured in fresh processes (the allocator's state is the process's)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="glibc's malloc thresholds: another C library"
)

# Each "request": three 6 MiB arrays alive together, written, then freed (a plan's arrays).
_REQUESTS = """
import resource, sys
import numpy as np
if sys.argv[1] == "raised":
    from kvbridge.memory import heap
    heap.raise_thresholds()
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    arrays = [np.empty(6 << 20, np.uint8) for _ in range(3)]
    for a in arrays:
        a.fill(1)
    del arrays, a
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[2:]))
"""


def _faults(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", _REQUESTS, mode], capture_output=True, text=True, env=env, check=True
    )
    return int(out.stdout)


def test_a_new_process_keeps_a_requests_arrays_once_the_thresholds_are_raised() -> None:
    pages = 4 * 3 * (6 << 20) // 4096  # four requests' arrays, page by page
    assert _faults("default") > pages // 8  # mapped, or trimmed and faulted in, anew
    assert _faults("raised") < pages // 100  # kept in the heap, reused
