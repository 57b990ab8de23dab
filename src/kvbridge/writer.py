"""The prefill worker's writes: one (decode rank, chunk) job, planned, written, reported.

:class:`ChunkWriter` runs on the prefill rank's one worker thread (:mod:`kvbridge.sender`). For
a job it plans the chunk for this pair (``Pairing.plan``), chooses the path from the
transport's cost model (:func:`kvbridge.staging.choose`: direct, or staged where the pair's
plan is fragmented and the transport pays per descriptor), writes, waits until every write has
ended (never past a write still in flight: an acknowledgement the worker sends next is the
truth), and only then reports the chunk (``ChunkDone``). A chunk that could not be written
fails its request and is not reported.

The test-only faults that act on writes (``skip_chunk``, ``shift_bytes``, ``corrupt``, the
stalls and exits around a post) live here, at the one place every write passes.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from kvbridge.errors import FailureKind, KVBridgeError, PlacementError, TransportError
from kvbridge.faults import stall_here
from kvbridge.integrity import checksums
from kvbridge.protocol import ChunkDone
from kvbridge.runs import Runs
from kvbridge.staging.cost import Path, choose
from kvbridge.staging.send import StagedWriter
from kvbridge.transports.base import XferHandle, XferState

if TYPE_CHECKING:
    from kvbridge.sender import PrefillRole, Sender, _Chunk, _DecodePeer


def _continues(a: _Chunk, b: _Chunk) -> bool:
    """Whether layer group ``b`` continues ``a``: the same tokens, placement and the layers
    right after."""
    return (
        (b.start, b.stop, b.placement) == (a.start, a.stop, a.placement)
        and b.layers.start == a.layers.stop
        and not a.completes
    )


class ChunkWriter:
    """Writes for one prefill rank (used by its worker thread only)."""

    def __init__(self, role: PrefillRole) -> None:
        self.role = role
        self.b = role.b
        self.rank = role.rank
        self.staged = StagedWriter(self, self.b.staging) if self.b.staging else None

    def path(self, peer: _DecodePeer, runs: Runs) -> Path:
        """Direct or staged for this pair's chunk: staged needs a staging region on both
        ranks; then the setting, or the transport's cost model, decides."""
        if self.staged is None or not peer.staging_slots:
            return Path.DIRECT
        return choose(
            runs, self.b.transport.cost, self.b.settings.staging, self.staged.segment_bytes(peer)
        )

    def transfer(self, s: Sender, d: int, index: int) -> None:
        with s._lock:
            if s.status.state.terminal or index < s._completed[d]:
                return  # ended, or written already with the layer group before it
            chunk, dst, peer = s._chunks[index], s._metas[d], s._peers[d]
            pairing = s._pairing
            # A forward that outruns the transfer has handed over more layer groups of this
            # chunk meanwhile: those that continue it go in the same plan and write.
            taken = 1
            while index + taken < len(s._chunks) and _continues(chunk, s._chunks[index + taken]):
                nxt = s._chunks[index + taken]
                chunk = replace(
                    chunk,
                    layers=range(chunk.layers.start, nxt.layers.stop),
                    completes=nxt.completes,
                )
                taken += 1
        if pairing is None:  # cannot happen: jobs are queued only once bound
            raise KVBridgeError(f"room {s.room}: no pairing")
        faults = self.b.faults
        if faults.sender_raise and index == 0:
            raise RuntimeError("injected fault: the sender raised inside its worker")
        try:
            plan = pairing.plan(
                chunk.placement,
                dst,
                chunk.start,
                chunk.stop,
                last=chunk.last,
                prefill_rank=self.rank,
                decode_rank=d,
                layers=chunk.layers,
                aux=chunk.completes,
            )
        except PlacementError as e:
            self.role.fail(s, FailureKind.BAD_INPUT, f"prefill rank {self.rank}: {e}")
            return
        if plan.pairs:
            pair = plan.pairs[0]
            # The fault names a job as handed over; a write may carry several of them.
            skipped = index <= faults.skip_chunk < index + taken
            runs = Runs.empty() if skipped else pair.runs
            sums = (
                checksums(plan, runs, self.b.views, source=True)
                if self.b.settings.integrity
                else {}
            )
            if faults.corrupt and len(runs):
                view = self.b.views[plan.src_regions[int(runs.src_region[0])]]
                view[int(runs.src_offset[0])] ^= 0xFF
            staged = 0
            if self.staged is not None and self.path(peer, runs) is Path.STAGED:
                written = self.staged.write(s, peer, plan, runs, chunk)
                if written is None:
                    return
                staged = written
            elif len(runs):
                if faults.shift_bytes:
                    runs = faults.shifted(
                        runs,
                        plan.dst_regions,
                        dict((r.name, r.nbytes) for r in pairing.decode.memory.regions),
                    )
                src_names, dst_names, runs = runs.restricted(plan.src_regions, plan.dst_regions)
                handle = self.post(s, peer, src_names, dst_names, runs)
                if handle is None or not self.finish(s, peer, handle):
                    return
            if chunk.last and chunk.completes:
                s.writes_done_at = time.monotonic()
            self.b.send(
                peer.agent,
                ChunkDone(
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
                ),
            )
            s.sent_bytes += runs.total_bytes
            if chunk.last and chunk.completes:  # a notice a fault held back must not wait
                for agent, held in faults.flush_held():
                    self.b.send(agent, held, faults=False)
        with s._lock:
            s._completed[d] += taken
        self.role.maybe_succeed(s)

    def post(
        self, s: Sender, peer: _DecodePeer, src: tuple[str, ...], dst: tuple[str, ...], runs: Runs
    ) -> XferHandle | None:
        """Post one write (the faults that act around a post act here); None if the
        transport refused it, which fails the request."""
        faults = self.b.faults
        n = faults.count_post() if faults.counts_posts else 0
        if n and n == faults.stop_before_post:
            stall_here()  # the fault: a stall, a write about to start
        try:
            handle = self.b.transport.post(peer.agent, src, dst, runs, key=(peer.session, s.room))
        except TransportError as e:
            self.role.fail(s, FailureKind.TRANSPORT, f"prefill rank {self.rank}: {e}")
            return None
        if n and n == faults.exit_after_post:
            os._exit(3)  # the fault: this process dies with the write in flight
        if n and n == faults.stop_after_post:
            stall_here()  # the fault: a stall, write in flight
        return handle

    def finish(self, s: Sender, peer: _DecodePeer, handle: XferHandle) -> bool:
        """Wait until a posted write ended and forget it; True if it is DONE and the request
        still live."""
        state = self.drain(s, handle)
        self.b.transport.release(handle)
        if state is XferState.FAILED:
            self.role.fail(
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
            self.role.fail(
                s, FailureKind.DEADLINE, f"prefill rank {self.rank}: {what} at the deadline"
            )
