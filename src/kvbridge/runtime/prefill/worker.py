"""The prefill rank's one worker thread: it takes the jobs (:mod:`.jobs`) one at a time.

A chunk's job plans, writes and waits until the writes ended before the chunk is reported
(:mod:`.writer`). One synchronous worker means that when it takes a failure notice or an
abort's acknowledgement, no write of any request is in flight: draining is free, and an
acknowledgement is the truth.

The thread that makes a chunk ready may plan and post it itself where the worker is idle
(:meth:`Worker.post_now`): the engine's at ``send()``, or the one that took the decode's ask
when that comes last (vLLM's one leg after the other; not in integrity mode, whose checksums
of a whole chunk stay off the control thread). One thread hand-off less before the
bytes leave, which on a core the engine keeps busy is most of a small request's transfer time.
It does so holding the worker's lock, and the worker lands every such write (waits for it,
reports the chunk) before any job it takes next: the promise above holds unchanged. Where every
write it posted has ended already (shm copies a small batch at the post), that thread lands
them itself, still holding the lock: one more hand-off less.

Failure notices and acknowledgements go before the writes queued: a request that ended frees
what the decode rank holds for it (its staging slots) only once told, and a write queued
before the notice may wait for exactly those slots (to its deadline, the worker held).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from typing import Protocol

from kvbridge.errors import FailureKind, TransferFailed
from kvbridge.runtime.contracts import Rank
from kvbridge.runtime.prefill.jobs import Ack, Job, Land, Notify, Stop, WriteChunk
from kvbridge.runtime.prefill.sender import Sender
from kvbridge.runtime.prefill.writer import ChunkWriter, Flight
from kvbridge.transports.base import XferState
from kvbridge.wire.protocol import AbortAck, Failure

log = logging.getLogger("kvbridge.sender")


class Notifying(Protocol):
    """What the worker needs of the role that owns it."""

    def fail(self, request: Sender, kind: FailureKind, reason: str) -> None: ...
    def notified(self, s: Sender, failure: TransferFailed | None) -> None: ...


class Worker:
    """The thread that writes chunks, tells decode ranks of failures and acknowledges aborts,
    one job after the other."""

    def __init__(self, bridge: Rank, role: Notifying, writer: ChunkWriter) -> None:
        self.b, self.role, self.writer = bridge, role, writer
        self.rank = bridge.rank
        # (urgency, order, job): notices and acknowledgements first, then in the order put.
        self._jobs: queue.PriorityQueue[tuple[int, int, Job]] = queue.PriorityQueue()
        self._order = itertools.count()
        # Held while a job runs, and by another thread posting (post_now): never both.
        self._busy = threading.Lock()
        self._flights: list[Flight] = []  # posted by other threads, not landed yet
        self._thread = threading.Thread(
            target=self._work, daemon=True, name=f"kvbridge-worker-{bridge.agent}"
        )

    def start(self) -> None:
        self._thread.start()

    def put(self, job: Job) -> None:
        self._jobs.put((0 if isinstance(job, (Notify, Ack)) else 1, next(self._order), job))

    def held(self) -> threading.Lock:
        """Held, no job runs and no other thread posts (``with worker.held(): ...``)."""
        return self._busy

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def describe(self) -> str:
        """For a diagnosis: the jobs waiting, the writes other threads posted, whether busy."""
        busy = "busy" if self._busy.locked() else "idle"
        return f"worker {busy}, {self._jobs.qsize()} jobs queued, {len(self._flights)} to land"

    def post_now(self, s: Sender, ready: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """On the calling thread: plan and post those of ``ready`` (decode rank, chunk
        index) that can be, where the worker is idle; returns the rest, to queue. A chunk is
        posted here only if it is its decode rank's next, completes its tokens (a layer group
        of a forward still running is planned by the worker, beside the forward), and its
        write is direct and needs no wait for a CUDA event: what makes ``begin`` return at
        once."""
        if not ready or not self._busy.acquire(blocking=False):
            return ready
        left: list[tuple[int, int]] = []
        posted = False
        try:
            if not self._jobs.empty():  # the worker has work queued: it goes first
                return ready
            for d, index in ready:
                job = s.write(d, index) if s.next_unwritten(d) == index else None
                if (
                    job is None
                    or not job.chunk.completes
                    or job.chunk.ready
                    or not self.writer.direct_only(job.peer)
                ):
                    left.append((d, index))
                    continue
                try:
                    flight = self.writer.begin(s, d, job)
                except Exception as e:  # as in the worker: it fails the request, not send()
                    self._failed(s, e)
                    continue
                if flight is not None:
                    self._flights.append(flight)
                    posted = True
            if posted and all(_written(f) for f in self._flights):
                # Written already (a transport that copied at post): reported here, not by the
                # worker, which on an interpreter the engine keeps busy waits up to a switch
                # interval to take the Land.
                self._land()
                posted = False
        finally:
            self._busy.release()
        if posted:
            self.put(Land())  # lands them now, if no other job comes first
        return left

    def _land(self) -> None:
        """Land the writes other threads posted (the worker's lock held)."""
        flights, self._flights = self._flights, []
        for f in flights:
            try:
                self.writer.land(f)
            except Exception as e:
                self._failed(f.sender, e)

    def _failed(self, s: Sender, e: Exception) -> None:
        log.exception("%s: worker error", self.b.agent)
        self.role.fail(s, FailureKind.SENDER_ERROR, f"prefill rank {self.rank}: {e!r}")

    def _work(self) -> None:
        while True:
            _, _, job = self._jobs.get()
            with self._busy:
                self._land()
                if isinstance(job, Stop):
                    return
                try:
                    self._run(job)
                except Exception as e:  # a bug here must fail the request, never the rank
                    if isinstance(job, (WriteChunk, Notify)):
                        self._failed(job.sender, e)
                    else:
                        log.exception("%s: worker error", self.b.agent)

    def _run(self, job: Job) -> None:
        if isinstance(job, WriteChunk):
            self.writer.transfer(job.sender, job.decode_rank, job.index)
        elif isinstance(job, Notify):
            self._notify(job.sender)
        elif isinstance(job, Ack):  # (a Land's work is done before any job: nothing left)
            self.b.send_to(
                job.abort.sender,
                job.endpoint,
                AbortAck(
                    sender=self.b.agent,
                    session=job.abort.session,
                    room=job.abort.room,
                    prefill_rank=self.rank,
                ),
            )

    def _notify(self, s: Sender) -> None:
        """Tell every decode rank of a failed request why, once nothing of it is in flight."""
        failure = s.status.failure
        kind, why = (failure.kind, failure.detail) if failure else (FailureKind.SENDER_ERROR, "")
        try:
            for peer in s.peers():
                tell(self.b, peer.agent, peer.session, s.room, kind, why or "failed")
        finally:  # nothing of it is in flight either way: the engine may have its pages back
            self.role.notified(s, failure)


def tell(b: Rank, agent: str, session: int, room: int, kind: FailureKind, why: str) -> None:
    """Fail decode agent ``agent``'s request ``room`` of ``session`` now, saying why."""
    msg = Failure(sender=b.agent, session=session, room=room, rank=b.rank, kind=kind, reason=why)
    b.send(agent, msg)


def _written(f: Flight) -> bool:
    """Whether ``f``'s write has ended (or it had nothing to write)."""
    return f.handle is None or f.handle.state is not XferState.PENDING
