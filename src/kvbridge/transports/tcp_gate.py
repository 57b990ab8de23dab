"""TCP transport, receiving side: which requests may write on an agent, and fencing them.

Each batch header carries the key of its post. With ``admission`` on, a batch whose key was
not admitted (or was fenced since) is answered DISCARDED: its payload is read into scratch and
dropped, and the connection goes on. ``fence(key)`` closes the key's
admission and flags each batch of it being received; the worker looks at the flag between
pieces and between receive steps of at most 4 MiB, and once set it writes no more region memory
(the rest of the payload goes to scratch; the batch is answered DISCARDED). A worker that has
not left region memory within a short grace is blocked in recv on a stalled peer: its
connection is shut down, which ends the recv at once.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import socket
import threading
import time
from dataclasses import dataclass, field

from kvbridge.transports.base import FenceKey

log = logging.getLogger(__name__)
_FENCE_GRACE = 0.25  # how long a flagged worker may take to leave region memory by itself
_REMEMBER_FENCED = 4096  # recently fenced keys, only to say "fenced" in a refusal


@dataclass(eq=False)
class Batch:
    """A batch being received into region memory, as fence sees it."""

    key: FenceKey | None
    sock: socket.socket
    fenced: bool = False  # set by fence; the worker looks at it between steps
    left: threading.Event = field(default_factory=threading.Event)  # set by the worker only


class Gate:
    """Which keys may write on one receiving agent, and the batches writing now."""

    def __init__(self, admission: bool) -> None:
        self.admission = admission
        self._lock = threading.Lock()
        self._admitted: set[FenceKey] = set()
        self._fenced: collections.OrderedDict[FenceKey, None] = collections.OrderedDict()
        self._active: dict[FenceKey, set[Batch]] = {}

    def admit(self, key: FenceKey) -> None:
        if not self.admission:
            return  # nothing is refused, so there is nothing to remember
        with self._lock:
            self._admitted.add(key)
            self._fenced.pop(key, None)

    def enter(self, key: FenceKey | None, sock: socket.socket) -> Batch | str:
        """A batch of ``key`` starts writing: its fencing handle, or why it may not. Checked
        and recorded under one lock, so a fence either sees the batch or refuses it."""
        with self._lock:
            if self.admission:
                if key is None:
                    return "the batch names no request (admission is on)"
                if key not in self._admitted:
                    why = "was fenced" if key in self._fenced else "was not admitted"
                    return f"request {tuple(key)} {why}"
            batch = Batch(key, sock)
            if key is not None:
                self._active.setdefault(key, set()).add(batch)
            return batch

    def leave(self, batch: Batch) -> None:
        """The worker of ``batch`` writes no more region memory for it."""
        with self._lock:
            batch.left.set()
            if batch.key is not None:
                mine = self._active.get(batch.key)
                if mine is not None:
                    mine.discard(batch)
                    if not mine:
                        del self._active[batch.key]

    def fence(self, key: FenceKey, timeout: float) -> bool:
        end = time.monotonic() + max(0.0, timeout)
        with self._lock:
            self._admitted.discard(key)
            if self.admission:
                self._fenced[key] = None
                self._fenced.move_to_end(key)
                while len(self._fenced) > _REMEMBER_FENCED:
                    self._fenced.popitem(last=False)
            batches = list(self._active.get(key, ()))
            for b in batches:
                b.fenced = True
        if timeout <= 0:  # no time to let a worker leave, nor to tell a stall from a step
            return all(b.left.is_set() for b in batches)
        grace = time.monotonic() + min(_FENCE_GRACE, timeout / 2)
        for b in batches:
            b.left.wait(max(0.0, grace - time.monotonic()))
        with self._lock:  # a worker closes its socket only after leave(): never closed here
            stalled = [b for b in batches if not b.left.is_set()]
            for b in stalled:
                with contextlib.suppress(OSError):
                    b.sock.shutdown(socket.SHUT_RDWR)
        if stalled:
            log.warning(
                "fenced request %s: shut down %d connection(s) stalled mid-batch",
                tuple(key),
                len(stalled),
            )
        return all(b.left.wait(max(0.0, end - time.monotonic())) for b in batches)
