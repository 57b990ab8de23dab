"""The receiving request: one request on one decode rank, and whether its pages may be reused.

A :class:`Receiver` is what a decode engine holds per request: :meth:`Receiver.init` with the
destination placement, then :meth:`Receiver.poll`. It owns the request's state: its link to the
prefill engine, its placement and completion, and its release. Its role (:mod:`.role`) and
landing (:mod:`.landing`) change that state only through the methods below the engine's.

Fencing. When a request fails for any reason its pages are not reusable until no write of it
can land (:attr:`Receiver.release`): every writer acknowledged the abort after draining, or is
proven gone (same host, its process no longer exists), or the transport fenced the request
(tcp, where this rank does the writing); and no staged segment of it is being scattered.
Heartbeat silence proves nothing: a stalled writer resumes. Until then the request is HELD,
and QUARANTINED (with a reason) once the abort deadline passed.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from typing import Protocol

from kvbridge.errors import FailureKind, KVBridgeError
from kvbridge.planner.placement import Placement
from kvbridge.planner.plan import Pairing
from kvbridge.runtime.decode.link import LinkState, PrefillLink
from kvbridge.runtime.status import Completion, KVPoll, RequestStatus
from kvbridge.wire.protocol import fingerprint_of, process_of


class Release(enum.Enum):
    """Whether a request's destination pages may be reused."""

    HELD = "held"  # live, or failed and a writer may still write
    RELEASED = "released"  # no byte of the request can land any more
    QUARANTINED = "quarantined"  # failed; past the abort deadline a writer may still write


class Owner(Protocol):
    """What a receiver needs of its role."""

    rank: int

    def check_open(self) -> None: ...
    def progress(self) -> bool: ...
    def start_request(self, r: Receiver) -> None: ...
    def fail(self, request: Receiver, kind: FailureKind, reason: str) -> None: ...
    def expire(self, r: Receiver, now: float) -> None: ...


class Receiver:
    """One request on one decode rank: :meth:`init` with the destination, then :meth:`poll`.
    ``link`` is None until the prefill engine holding the room is known."""

    def __init__(
        self,
        owner: Owner,
        room: int,
        address: str,
        deadline: float,
        on_end: Callable[[RequestStatus], None] | None = None,
    ) -> None:
        self.room = room
        self.address = address
        self.link: PrefillLink | None = None
        self.status = RequestStatus(room, deadline, on_end)
        self.placement: Placement | None = None
        self.fingerprint = b""
        self.completion: Completion | None = None
        self.checked_by: Pairing | None = None  # the pairing init checked the placement with
        self.received_bytes = 0  # as the senders' chunk notices count them
        self.quarantine_reason = ""
        self._owner = owner
        self._lock = threading.Lock()
        self._started = False
        self._release = Release.HELD
        self._pending: set[str] = set()  # writers not yet acknowledged nor proven gone
        self._scattering = 0  # staged segments this rank is scattering into the pages now
        self._abort_deadline = 0.0
        self._next_abort = 0.0
        self._released = threading.Event()

    # ---- the engine's ----------------------------------------------------------------

    def init(self, placement: Placement, fingerprint: bytes = b"") -> None:
        """Give the destination placement (pages, slots). Raises PlacementError at once if it
        does not fit this rank's pools. ``fingerprint``: the engine's digest of the request's
        tokens (at most 64 bytes), which a prefill engine that gives its senders one checks:
        a prefill request with another one is refused, never sent into these pages."""
        self._owner.check_open()
        fingerprint = fingerprint_of(self.room, fingerprint)
        pairing = self.link.pairing if self.link is not None else None
        if pairing is not None:
            pairing.check_placement(placement, "decode", rank=self._owner.rank)
        with self._lock:
            if self.placement is not None:
                raise KVBridgeError(f"room {self.room}: init was already called")
            self.placement = placement
            self.fingerprint = fingerprint
            self.checked_by = pairing
        self._owner.start_request(self)

    def poll(self) -> KVPoll:
        """The request's state. Until it ends, the engine's polling thread first takes what
        arrived (Bridge.progress: its peers' messages, the writes landed whole): kvbridge's
        threads would wait for the interpreter it holds. Past the latest its deadline can be,
        the request fails here (the control thread's tick fails it at the deadline itself,
        unless held up)."""
        state = self.status.state
        if not state.terminal and self._owner.progress():
            state = self.status.state
        if not state.terminal and (now := time.monotonic()) >= self.status.latest:
            self._owner.expire(self, now)
            state = self.status.state
        return state

    @property
    def failure(self) -> KVBridgeError | None:
        return self.status.failure

    def wait(self, timeout: float) -> KVPoll:
        return self.status.wait(timeout)

    @property
    def release(self) -> Release:
        return self._release

    @property
    def released(self) -> bool:
        """True when no prefill write for this request can still land: the pages may be
        reused (after success, or after a failure once every writer is fenced)."""
        return self._released.is_set()

    def wait_released(self, timeout: float) -> bool:
        return self._released.wait(timeout)

    def abort(self, reason: str = "aborted by the decode engine") -> None:
        self._owner.fail(self, FailureKind.ABORTED, reason)

    def describe(self) -> str:
        """The request's state in a line, for a diagnosis (a request that never ends): its
        link, and what each prefill rank still owes it."""
        link = self.link
        linked = f"linked to {link.engine} ({link.state.name})" if link else "not linked"
        owed = self.completion.missing() if self.completion is not None else None
        what = (
            "not started"
            if owed is None
            else "; ".join(f"prefill rank {p} owes {w}" for p, w in sorted(owed.items()))
            or "nothing owed"
        )
        return f"room {self.room} {self.status.state.name}, {linked}: {what}"

    # ---- the role's: linking and starting ------------------------------------------------

    @property
    def linked(self) -> PrefillLink:
        """The link of a request that has one (every request that sent its metadata does)."""
        if self.link is None:
            raise KVBridgeError(f"room {self.room}: not linked to a prefill engine yet")
        return self.link

    def claim_start(
        self, completion: Callable[[Placement, Pairing], Completion]
    ) -> Placement | None:
        """The placement to send, once: when the link is ready and the engine gave it, and the
        request is live; None otherwise (or when it was claimed already). The request counts
        as started, with its ``completion`` (what its writers owe) set, in one step: a failure
        from then on fences exactly those writers. A ``completion`` that raises (the placement
        does not fit) leaves the request unstarted."""
        link = self.link
        with self._lock:
            if (
                self._started
                or self.placement is None
                or link is None
                or link.pairing is None
                or link.state is not LinkState.READY
                or self.status.state.terminal
            ):
                return None
            self.completion = completion(self.placement, link.pairing)
            self._started = True
            return self.placement

    # ---- the role's and the landing's: fencing and release ---------------------------------

    def fence_writers(self, now: float, abort_timeout: float, interval: float) -> bool:
        """The request failed: every writer it was owed by must acknowledge (or be proven
        gone) before its pages are released. Whether it had started (its writers know it)."""
        with self._lock:
            started = self._started
            if started and self.completion is not None:
                link = self.linked
                agents = {link.infos[p].agent for p in self.completion.expected}
                self._pending = {a for a in agents if not _gone(link, a)}
            self._abort_deadline = now + abort_timeout
            self._next_abort = now + interval
            return started

    def pending(self) -> set[str]:
        with self._lock:
            return set(self._pending)

    def acknowledged(self, agent: str | None = None) -> None:
        """``agent`` will not write any more (all of them, without one)."""
        with self._lock:
            if agent is None:
                self._pending.clear()
            else:
                self._pending.discard(agent)

    def abort_due(self, now: float, interval: float) -> set[str] | None:
        """Once per heartbeat interval after a failure: the writers still to ask again (an
        abort may have been lost to a stall), writers proven gone dropped; None when not due."""
        with self._lock:
            if now < self._next_abort:
                return None
            self._next_abort = now + interval
            if self._pending:
                link = self.linked
                self._pending = {a for a in self._pending if not _gone(link, a)}
            return set(self._pending)

    def begin_scatter(self) -> bool:
        """A staged segment is about to be scattered into the pages: False (and nothing to
        do) where the request is no longer live, else counted until :meth:`end_scatter`."""
        with self._lock:
            if self.status.state.terminal:  # never a byte into the pages of an ended request
                return False
            self._scattering += 1
            return True

    def end_scatter(self) -> None:
        with self._lock:
            self._scattering -= 1

    def settle(self, now: float, abort_timeout: float) -> Release | None:
        """Update the release state; what it moved to, if anything: RELEASED until the caller,
        having freed what the request held, calls :meth:`mark_released`; QUARANTINED once."""
        with self._lock:
            state = self.status.state
            if state is KVPoll.SUCCESS or (
                state is KVPoll.FAILED and not self._pending and not self._scattering
            ):
                self._release = Release.RELEASED
            elif (
                state is KVPoll.FAILED
                and now > self._abort_deadline
                and self._release is Release.HELD
            ):
                self._release = Release.QUARANTINED
                self.quarantine_reason = (
                    f"room {self.room}: prefill agents {sorted(self._pending)} neither "
                    f"acknowledged the abort within {abort_timeout} s nor can be proven gone; "
                    f"its pages stay quarantined until they do"
                )
                return Release.QUARANTINED
            if self._release is Release.RELEASED and not self._released.is_set():
                return Release.RELEASED
            return None

    def mark_released(self) -> None:
        self._released.set()


def _gone(link: PrefillLink, agent: str) -> bool:
    """Whether a prefill agent is proven gone (same host, its process no longer exists)."""
    return process_of(link.infos[link.ranks[agent]]).proven_gone()
