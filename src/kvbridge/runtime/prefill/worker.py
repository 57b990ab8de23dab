"""The prefill rank's one worker thread: it takes the jobs (:mod:`.jobs`) in order.

A chunk's job plans, writes and waits until the writes ended before the chunk is reported
(:mod:`.writer`). One synchronous worker means that when it takes a failure notice or an
abort's acknowledgement, no write of any request is in flight: draining is free, and an
acknowledgement is the truth.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Protocol

from kvbridge.errors import FailureKind, TransferFailed
from kvbridge.runtime.contracts import Rank
from kvbridge.runtime.prefill.jobs import Job, Notify, Stop, WriteChunk
from kvbridge.runtime.prefill.sender import Sender
from kvbridge.runtime.prefill.writer import ChunkWriter
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
        self._jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._work, daemon=True, name=f"kvbridge-worker-{bridge.agent}"
        )

    def start(self) -> None:
        self._thread.start()

    def put(self, job: Job) -> None:
        self._jobs.put(job)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if isinstance(job, Stop):
                return
            try:
                if isinstance(job, WriteChunk):
                    self.writer.transfer(job.sender, job.decode_rank, job.index)
                elif isinstance(job, Notify):
                    self._notify(job.sender)
                else:
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
            except Exception as e:  # a bug here must fail the request, never the rank
                log.exception("%s: worker error", self.b.agent)
                if isinstance(job, (WriteChunk, Notify)):
                    self.role.fail(
                        job.sender, FailureKind.SENDER_ERROR, f"prefill rank {self.rank}: {e!r}"
                    )

    def _notify(self, s: Sender) -> None:
        """Tell every decode rank of a failed request why, once nothing of it is in flight."""
        failure = s.status.failure
        for peer in s.peers():
            self.b.send(
                peer.agent,
                Failure(
                    sender=self.b.agent,
                    session=peer.session,
                    room=s.room,
                    rank=self.rank,
                    kind=failure.kind if failure else FailureKind.SENDER_ERROR,
                    reason=failure.detail if failure else "failed",
                ),
            )
        self.role.notified(s, failure)
