"""What a soak's ranks hold, sampled as it runs, and whether any of it keeps rising.

A leak shows as a slope, not as a level: a rank's resident memory, threads, open file
descriptors and shared-memory segments may take a while to settle (pools faulted in, caches
filled, a peer's connections opened once), then must stay flat however many requests and
faults follow. :class:`Sample` is the deployment's total at one moment (every live rank summed:
a rank killed and restarted starts small again, which can only hide growth, never make it);
:func:`rising` compares the median of the run's last fifth with that of its second (the first
is warm-up), and names every resource whose growth passes its tolerance.
"""

from __future__ import annotations

import glob
import os
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvbridge.memory.pools import SEGMENT_PREFIX

# Growth allowed between the second fifth and the last, per rank: a thread or two that a
# transport starts for a peer met late, an fd that a restarted peer's connection took, an
# allocator that has not given memory back yet. A leak of one per fault or per hundred
# requests passes these within a few thousand requests.
TOLERANCE = {"threads": 2, "fds": 4, "segments": 1, "rss": 16 << 20}
MIN_SAMPLES = 10  # fewer: too short a run to tell a slope from noise (said so, not judged)


@dataclass(frozen=True)
class Sample:
    requests: int  # requests done when it was taken
    rss: int  # bytes
    threads: int
    fds: int
    segments: int


def _status(pid: int) -> tuple[int, int]:
    """(resident bytes, threads) of a live process, from /proc (0, 0 if it is gone)."""
    rss = threads = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("Threads:"):
                    threads = int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return 0, 0
    return rss, threads


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError):
        return 0


def sample(requests: int, pids: Iterable[int], all_pids: Iterable[int]) -> Sample:
    """The total over the live ranks ``pids``; segments of every rank the soak ever started
    (``all_pids``: a killed rank's segments must be gone too)."""
    rss = threads = fds = 0
    for pid in pids:
        r, t = _status(pid)
        rss, threads, fds = rss + r, threads + t, fds + _fds(pid)
    segments = sum(len(glob.glob(f"/dev/shm/{SEGMENT_PREFIX}{pid}_*")) for pid in all_pids)
    return Sample(requests, rss, threads, fds, segments)


def _window(samples: Sequence[Sample], fifth: int) -> list[Sample]:
    n = len(samples)
    return list(samples[n * fifth // 5 : n * (fifth + 1) // 5])


def growth(samples: Sequence[Sample]) -> dict[str, tuple[float, float]]:
    """Each resource's median in the run's second fifth and in its last."""
    early, late = _window(samples, 1), _window(samples, 4)
    return {
        name: (
            statistics.median(getattr(s, name) for s in early),
            statistics.median(getattr(s, name) for s in late),
        )
        for name in TOLERANCE
    }


def rising(samples: Sequence[Sample], ranks: int) -> list[str]:
    """A violation for each resource that grew past its tolerance (``ranks`` live ranks)."""
    if len(samples) < MIN_SAMPLES:
        return []
    out = []
    for name, (early, late) in growth(samples).items():
        allowed = TOLERANCE[name] * ranks
        if late - early > allowed:
            out.append(
                f"{name} kept rising: median {early:,.0f} in the run's second fifth, "
                f"{late:,.0f} in its last (allowed +{allowed:,} for {ranks} ranks)"
            )
    return out
