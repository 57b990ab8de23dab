"""The prefill worker's writes: one (decode rank, chunk) job, planned, written, reported.

:class:`ChunkWriter` runs under the prefill rank's worker lock (:mod:`.worker`). For a job it
plans the chunk for this pair (``Pairing.plan``), chooses the path from the transport's cost
model (:func:`kvbridge.staging.choose`: direct, or staged where the pair's plan is fragmented
and the transport pays per descriptor), writes, waits until every write has ended (never past
a write still in flight: an acknowledgement the worker sends next is the truth), and only then
reports the chunk (``ChunkDone``): :meth:`ChunkWriter.begin` to the post, :meth:`~ChunkWriter.land`
from there, on the worker thread (the thread that made the chunk ready may post and leave the
landing to the worker, or land itself what ended at the post: :meth:`.Worker.post_now`). A
chunk that could not be written fails its request and is not reported. Test-only faults act at
the seam's named points (:mod:`kvbridge.runtime.faults`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from kvbridge.errors import FailureKind, PlacementError, TransportError
from kvbridge.memory.device import wait_event
from kvbridge.memory.integrity import checksums
from kvbridge.planner.runs import Runs
from kvbridge.runtime.contracts import Rank
from kvbridge.runtime.metrics import trace
from kvbridge.runtime.prefill.sender import Chunk, DecodePeer, Sender, Write
from kvbridge.runtime.prefill.staged import StagedWriter
from kvbridge.runtime.timeline import Phase
from kvbridge.staging.cost import Path, choose
from kvbridge.transports.base import XferHandle, XferState
from kvbridge.wire.protocol import ChunkDone, encode


class Succeeding(Protocol):
    """What the writer needs of its role: ending a request either way."""

    def fail(self, request: Sender, kind: FailureKind, reason: str) -> None: ...
    def maybe_succeed(self, s: Sender) -> None: ...


@dataclass(frozen=True, eq=False)
class Flight:
    """A chunk's write between :meth:`ChunkWriter.begin` and :meth:`ChunkWriter.land`: posted
    (``handle``), made whole (a staged write), or nothing to write (no ``done``: the pair's
    plan is empty)."""

    sender: Sender
    decode_rank: int
    job: Write
    done: ChunkDone | None = None
    nbytes: int = 0
    staged: int = 0  # staged segments written
    descriptors: int = 0
    handle: XferHandle | None = None
    carried: bool = False  # the write carries ``done``


class ChunkWriter:
    """Writes for one prefill rank, used under its worker's lock: by the worker thread, or
    (:meth:`begin` of a direct write) by the thread that made the chunk ready."""

    def __init__(self, rank: Rank, role: Succeeding) -> None:
        self.b = rank
        self.role = role
        self.rank = rank.rank
        self.staged = StagedWriter(self, rank, rank.staging) if rank.staging else None

    def path(self, peer: DecodePeer, runs: Runs) -> Path:
        """Direct or staged for this pair's chunk: staged needs a staging region on both
        ranks; then the setting, or the transport's cost model, decides."""
        if self.staged is None or not peer.staging_slots:
            return Path.DIRECT
        return choose(
            runs, self.b.transport.cost, self.b.settings.staging, self.staged.segment_bytes(peer)
        )

    def direct_only(self, peer: DecodePeer) -> bool:
        """Whether every write to ``peer`` takes the direct path (no staging region on one
        side): then :meth:`begin` only plans and posts, and returns at once."""
        return self.staged is None or not peer.staging_slots

    def transfer(self, s: Sender, d: int, index: int) -> None:
        """Write chunk ``index`` to decode rank ``d`` and report it, start to end, with every
        chunk before it not written yet (writes go in chunk order: :meth:`Sender.write`). A
        job taken before an earlier chunk's must not stop at that chunk, whose own job then
        finds it written: its own chunk would never be (a hang)."""
        while (job := s.write(d, index)) is not None:  # None: ended, or written already
            flight = self.begin(s, d, job)
            if flight is None:
                return  # the request failed on the way
            self.land(flight)

    def begin(self, s: Sender, d: int, job: Write) -> Flight | None:
        """Plan ``job`` and post its write (a staged write is made whole here); None where
        the request failed on the way."""
        chunk, peer, faults = job.chunk, job.peer, self.b.faults
        if not self.ready(s, chunk):
            return None
        faults.planning(job.index)
        try:
            plan = job.pairing.plan(
                chunk.placement,
                job.dst,
                chunk.start,
                chunk.stop,
                last=chunk.last,
                prefill_rank=self.rank,
                decode_rank=d,
                layers=chunk.layers,
                aux=chunk.completes,
            )
        except PlacementError as e:
            self.fail(s, FailureKind.BAD_INPUT, f"prefill rank {self.rank}: {e}")
            return None
        if not plan.pairs:
            return Flight(s, d, job)
        pair = plan.pairs[0]
        runs = faults.to_write(job.index, job.taken, pair.runs)
        sums = checksums(plan, runs, self.b.views, source=True) if self.b.settings.integrity else {}
        faults.checksummed(runs, plan.src_regions, self.b.views)
        staged = 0
        stager = self.staged if self.path(peer, runs) is Path.STAGED else None
        if stager is not None:
            written = stager.write(s, peer, plan, runs, chunk)
            if written is None:
                return None
            staged = written
        done = ChunkDone(
            sender=self.b.agent,
            session=peer.session,
            room=s.room,
            prefill_rank=self.rank,
            start=chunk.start,
            stop=chunk.stop,
            parts=[p.kind.value for p in pair.parts],
            checksums=sums,
            staged=staged,
            layers=(chunk.layers.start, chunk.layers.stop),
            nbytes=runs.total_bytes,
        )
        handle, carried, descriptors = None, False, 0
        if stager is None and len(runs):
            sizes = {r.name: r.nbytes for r in job.pairing.decode.memory.regions}
            wire = faults.landing(runs, plan.dst_regions, sizes)
            src_names, dst_names, wire = wire.restricted(plan.src_regions, plan.dst_regions)
            handle, carried = self.post_noticed(s, peer, src_names, dst_names, wire, done)
            if handle is None:
                return None
            descriptors = len(wire)
        return Flight(s, d, job, done, runs.total_bytes, staged, descriptors, handle, carried)

    def land(self, f: Flight) -> None:
        """Wait until ``f``'s write ended, then report the chunk (unless its write carried
        the notice) and count it written."""
        s, chunk, peer = f.sender, f.job.chunk, f.job.peer
        if f.done is not None:
            if f.handle is not None and not self.finish(s, peer, f.handle):
                return
            if chunk.last and chunk.completes:
                s.status.timeline.mark(Phase.WRITTEN, latest=True)
            if not f.carried:
                self.b.send(peer.agent, f.done)
            s.sent_bytes += f.nbytes
            path = Path.STAGED if f.staged else Path.DIRECT
            self.b.metrics.sent(f.nbytes, path, f.staged or f.descriptors)
            trace(
                s.room,
                "chunk",
                role="prefill",
                rank=self.rank,
                decode_rank=f.decode_rank,
                tokens=[chunk.start, chunk.stop],
                layers=[chunk.layers.start, chunk.layers.stop],
                bytes=f.nbytes,
                path=path.value,
            )
            if chunk.last and chunk.completes:  # a notice a fault held back must not wait
                for agent, held in self.b.faults.flush_held():
                    self.b.send(agent, held, faults=False)
                s.status.timeline.mark(Phase.NOTIFIED, latest=True)
        s.written(f.decode_rank, f.job.taken)
        self.role.maybe_succeed(s)

    def fail(self, s: Sender, kind: FailureKind, reason: str) -> None:
        self.role.fail(s, kind, reason)

    def ready(self, s: Sender, chunk: Chunk) -> bool:
        """Never read before written: wait for the CUDA events the engine recorded after its
        forward wrote this chunk (none for host memory). Past the request's deadline the
        request fails; nothing was posted, so nothing can land."""
        for event in chunk.ready:
            if not wait_event(event, s.status.deadline):
                self.fail(
                    s,
                    FailureKind.DEADLINE,
                    f"prefill rank {self.rank}: the engine's CUDA event for tokens "
                    f"[{chunk.start}, {chunk.stop}) had not completed at the deadline",
                )
                return False
        return True

    def post(
        self, s: Sender, peer: DecodePeer, src: tuple[str, ...], dst: tuple[str, ...], runs: Runs
    ) -> XferHandle | None:
        """Post one write (the faults that act around a post act here); None if the
        transport refused it, which fails the request."""
        return self.post_noticed(s, peer, src, dst, runs, None)[0]

    def post_noticed(
        self,
        s: Sender,
        peer: DecodePeer,
        src: tuple[str, ...],
        dst: tuple[str, ...],
        runs: Runs,
        notice: ChunkDone | None,
    ) -> tuple[XferHandle | None, bool]:
        """:meth:`post`, with the chunk's ``notice`` carried by the write where the
        transport can (and no fault acts on notices): (the handle, whether it was)."""
        n = self.b.faults.posting()
        key = (peer.session, s.room)
        transport = self.b.transport
        try:
            handle = None
            if notice is not None and transport.carries_notices and not self.b.faults.on_notices:
                handle = transport.post_noticed(
                    peer.agent, src, dst, runs, key=key, notice=encode(notice)
                )
            carried = handle is not None
            if handle is None:
                handle = transport.post(peer.agent, src, dst, runs, key=key)
        except TransportError as e:
            self.fail(s, FailureKind.TRANSPORT, f"prefill rank {self.rank}: {e}")
            return None, False
        self.b.faults.posted(n)
        s.status.timeline.mark(Phase.POSTED)
        return handle, carried

    def finish(self, s: Sender, peer: DecodePeer, handle: XferHandle) -> bool:
        """Wait until a posted write ended and forget it; True if it is DONE and the request
        still live."""
        state = self.drain(s, handle)
        self.b.transport.release(handle)
        if state is XferState.FAILED:
            self.fail(
                s,
                FailureKind.TRANSPORT,
                f"prefill rank {self.rank} -> {peer.agent}: {handle.error}",
            )
        return state is XferState.DONE and not s.status.state.terminal

    def drain(self, s: Sender, handle: XferHandle) -> XferState:
        """Wait for the transfer to end, however long: this worker must never move on (to an
        acknowledgement, or to report) while a write may land. The transport ends a stuck
        transfer FAILED within its I/O budget, so this wait is bounded; past the request's
        deadline the request fails, but the wait goes on until the write has ended."""
        while True:
            state = self.b.transport.wait(handle, 0.05)
            if state is not XferState.PENDING:
                return state
            self.check_deadline(s, f"transfer to {handle.peer} still running")

    def check_deadline(self, s: Sender, what: str) -> None:
        if time.monotonic() > s.status.deadline:
            self.fail(s, FailureKind.DEADLINE, f"prefill rank {self.rank}: {what} at the deadline")
