"""Where a request's time goes on one rank: the moments of its phases (issue 30's budget).

A :class:`Timeline` belongs to a request's :class:`~kvbridge.runtime.status.RequestStatus`; the
runtime marks each :class:`Phase` once, the first time it happens, on whichever thread sees it.
At the request's end the runtime turns the marks into :meth:`Timeline.durations` (each phase's
time from the mark before it), which go to the metrics (``kvbridge_phase_seconds``, labelled
by phase) and to the request's ``end`` trace line. Only phases a rank goes through are marked:
a prefill rank's and a decode rank's lists differ, and a failed request stops where it failed.
"""

from __future__ import annotations

import enum
import time


class Phase(enum.Enum):
    """A request's moments on one rank, in the order they happen. The value names the phase
    that ends there (the time since the mark before it)."""

    # Decode rank
    ASKED = "ask"  # its request metadata (where to write) went to the prefill ranks
    FIRST_NOTICE = "first_write"  # the first chunk notice arrived: bytes landed
    # Prefill rank
    TOLD = "told"  # the decode's metadata arrived: the rank knows where to write
    READY = "ready"  # the engine said the first tokens are computed (send)
    POSTED = "post"  # the first write was planned and posted to the transport
    WRITTEN = "writes"  # the last write the transport reported done
    NOTIFIED = "notice"  # the last chunk notice went out
    # Both
    ENDED = "end"  # success (every notice counted / delivery confirmed) or failure


class Timeline:
    """The first moment (``time.monotonic()``) of each phase of one request on one rank."""

    def __init__(self, created_at: float) -> None:
        self.created_at = created_at
        self._at: dict[Phase, float] = {}

    def mark(self, phase: Phase, at: float | None = None, *, latest: bool = False) -> None:
        """``phase`` happened now (or at ``at``): its first time, or with ``latest`` its last
        (a prefill rank writes to each decode rank: the writes end with the last one)."""
        t = time.monotonic() if at is None else at
        if latest:
            self._at[phase] = t
        else:
            self._at.setdefault(phase, t)

    def at(self, phase: Phase) -> float | None:
        return self._at.get(phase)

    def durations(self) -> dict[str, float]:
        """Each marked phase's seconds since the mark before it (the request's creation for
        the first), in the order the phases happened."""
        out: dict[str, float] = {}
        last = self.created_at
        for phase, t in sorted(self._at.items(), key=lambda kv: kv[1]):
            out[phase.value] = max(0.0, t - last)
            last = t
        return out
