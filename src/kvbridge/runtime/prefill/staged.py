"""The prefill side of staged transfers: ask for slots, gather, write, report each segment
(the staging layout and ring it uses are :mod:`kvbridge.staging`'s, the region
:mod:`kvbridge.runtime.staging_pool`'s).

:meth:`StagedWriter.write` runs on the prefill rank's worker thread for one (decode rank,
chunk) whose path is staged. Segment after segment of the pair's runs
(:func:`~kvbridge.staging.layout.segments`):

1. it asks the decode rank for a slot of its staging region (``StageAsk``), up to as many asks
   ahead as it has local slots, so that grants arrive while earlier segments are written;
2. where the transport's cost model says so (:meth:`~kvbridge.staging.cost.CostModel.gathers`)
   it takes a local slot (waiting for its oldest write in flight when all are taken) and
   gathers the segment into it; a segment whose source bytes are a few contiguous extents (an
   NHD pool at prefill TP 4: one per head slice and layer) is not gathered;
3. it waits for the decode rank's grant (``StageGrant``) and posts one write into the granted
   slot: one descriptor from the local slot, or the segment's extents from the pools; while
   later segments are prepared, earlier writes end: each that ended DONE is reported
   (``Staged``, the first of a chunk with this rank's placement) and its local slot is free
   again.

While it waits (for a grant, or for a slot) it goes on reporting writes that ended, because
the decode rank frees its slots only on those reports: waiting never holds back what the wait
needs. A request that ended meanwhile (aborted, fenced, past its deadline) stops asking and
writing; whatever is in flight is still waited for before :meth:`write` returns (the worker
never moves on while a write may land). Grants it received and did not use stay the decode
rank's to free when the request is released.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvbridge.errors import FailureKind, KVBridgeError
from kvbridge.planner.runs import Runs
from kvbridge.planner.transferplan import TransferPlan
from kvbridge.runtime.contracts import Rank
from kvbridge.runtime.prefill.sender import Chunk, DecodePeer, Sender
from kvbridge.runtime.staging_pool import REGION, StagingPool
from kvbridge.staging.layout import extents, gather, segments
from kvbridge.staging.ring import SlotRing
from kvbridge.transports.base import XferHandle
from kvbridge.wire.protocol import StageAsk, Staged, StageGrant


class Posting(Protocol):
    """What the staged path needs of the chunk writer it works for."""

    rank: int

    def post(
        self, s: Sender, peer: DecodePeer, src: tuple[str, ...], dst: tuple[str, ...], runs: Runs
    ) -> XferHandle | None: ...
    def finish(self, s: Sender, peer: DecodePeer, handle: XferHandle) -> bool: ...
    def check_deadline(self, s: Sender, what: str) -> None: ...
    def fail(self, s: Sender, kind: FailureKind, reason: str) -> None: ...


_Mailbox = tuple[str, int, int]  # (decode agent, session, room)
# Grants, and None when a write in flight ended: the worker waits on both at once.
_Box = queue.SimpleQueue[StageGrant | None]
_WAIT = 0.05  # between looks at the request's end and deadline while waiting


@dataclass(frozen=True, eq=False)
class _Flight:
    """A segment written into the granted slot (from local slot ``local``, or straight from
    the pools), not yet reported."""

    handle: XferHandle
    local: int | None
    grant: StageGrant
    segment: int
    nbytes: int


class StagedWriter:
    def __init__(self, writer: Posting, rank: Rank, pool: StagingPool) -> None:
        self.w = writer
        self.b = rank
        self.pool = pool
        self.ring = SlotRing(pool.slots)  # local slots; only the worker takes them
        self._asks = itertools.count()
        self._mail: dict[_Mailbox, _Box] = {}
        self._lock = threading.Lock()

    def segment_bytes(self, peer: DecodePeer) -> int:
        """A segment fits a slot on both ranks."""
        return min(self.pool.slot_bytes, peer.staging_slot_bytes)

    # ---- the control thread -----------------------------------------------------------

    def on_grant(self, peer: DecodePeer, msg: StageGrant) -> None:
        """A grant (or refusal) from ``peer``: for the chunk being written to it, if any;
        one for a chunk that ended is dropped (its slot is freed when the request is)."""
        with self._lock:
            box = self._mail.get((peer.agent, peer.session, msg.room))
        if box is not None:
            box.put(msg)

    # ---- the worker thread --------------------------------------------------------------

    def write(
        self, s: Sender, peer: DecodePeer, plan: TransferPlan, runs: Runs, chunk: Chunk
    ) -> int | None:
        """Write one pair's chunk staged; the number of segments reported, or None if the
        request ended (failed here, or by the other side) before all were."""
        src_names, _, local_runs = runs.restricted(plan.src_regions, plan.dst_regions)
        t = self.segment_bytes(peer)
        segs = segments(local_runs, t)
        asks = [next(self._asks) for _ in segs]
        key = (peer.agent, peer.session, s.room)
        box: _Box = queue.SimpleQueue()
        with self._lock:
            self._mail[key] = box
        flights: deque[_Flight] = deque()
        state = _State(asks)
        try:
            for k, seg in enumerate(segs):
                self._ask_ahead(s, peer, state, k)
                while len(flights) >= self.ring.slots:  # as many in flight as asked ahead
                    self._land(s, peer, chunk, flights.popleft(), state, t)
                # Straight from the pools into the remote slot, or gathered here first.
                reach = extents(gather(seg, 0))
                local = None
                if self.b.transport.cost.gathers(reach):
                    local = self._local_slot(s, peer, chunk, flights, state)
                    if local is None:
                        break
                    g = self._faulty(gather(seg, self.pool.offset(local)), self.pool.nbytes)
                    try:
                        self.b.copier.copy(g, src_names, (REGION,))
                    except Exception:  # the worker fails the request; the slot stays free
                        self.ring.free([local])
                        raise
                grant = self._grant(s, peer, chunk, box, asks[k], flights, state)
                if grant is None:
                    self.ring.free([] if local is None else [local])
                    break
                remote = grant.slot * peer.staging_slot_bytes
                if local is None:
                    src, wire = (
                        src_names,
                        self._faulty(
                            _shifted(reach, remote), peer.staging_slots * peer.staging_slot_bytes
                        ),
                    )
                else:
                    one = np.ones(1, dtype=np.int64)
                    src, wire = (
                        (REGION,),
                        Runs(
                            0 * one,
                            self.pool.offset(local) * one,
                            0 * one,
                            remote * one,
                            seg.total_bytes * one,
                            one,
                            0 * one,
                            0 * one,
                        ),
                    )
                handle = self.w.post(s, peer, src, (REGION,), wire)
                if handle is None:
                    self.ring.free([] if local is None else [local])
                    break
                flights.append(_Flight(handle, local, grant, k, seg.total_bytes))
                handle.when_ended(lambda: box.put(None))
        finally:
            while flights:  # never return with a write in flight
                self._land(s, peer, chunk, flights.popleft(), state, t)
            with self._lock:
                self._mail.pop(key, None)
        if state.reported < len(segs) or s.status.state.terminal:
            return None
        return len(segs)

    def _faulty(self, runs: Runs, region_bytes: int) -> Runs:
        """The fault seam's ``landing``: the segment lands misplaced in its slot."""
        return self.b.faults.landing(runs, (REGION,), {REGION: region_bytes})

    def _ask_ahead(self, s: Sender, peer: DecodePeer, state: _State, k: int) -> None:
        """Keep up to a local ring's worth of asks ahead of the segment being written."""
        while state.asked < len(state.asks) and state.asked - k < self.ring.slots:
            self.b.send(
                peer.agent,
                StageAsk(
                    sender=self.b.agent,
                    session=peer.session,
                    room=s.room,
                    prefill_rank=self.w.rank,
                    ask=state.asks[state.asked],
                ),
            )
            state.asked += 1

    def _local_slot(
        self, s: Sender, peer: DecodePeer, chunk: Chunk, flights: deque[_Flight], state: _State
    ) -> int | None:
        """A local slot: the oldest write in flight is waited for while none is free."""
        while True:
            if s.status.state.terminal:
                return None
            slot = self.ring.take()
            if slot is not None:
                return slot
            if not flights:  # only this worker takes local slots, all for its flights
                raise KVBridgeError("staging: no local slot free and none in flight")
            self._land(s, peer, chunk, flights.popleft(), state, self.segment_bytes(peer))

    def _grant(
        self,
        s: Sender,
        peer: DecodePeer,
        chunk: Chunk,
        box: _Box,
        ask: int,
        flights: deque[_Flight],
        state: _State,
    ) -> StageGrant | None:
        """Wait for the grant of ``ask``, reporting writes that end meanwhile; None if the
        request ended (a refusal ends it)."""
        if s.status.state.terminal:  # a grant already here is not used for an ended request
            return None
        while ask not in state.grants:
            try:
                g = box.get(timeout=_WAIT)
            except queue.Empty:
                g = None
            while flights and flights[0].handle.wait_ended(0):  # in order: the first first
                self._land(s, peer, chunk, flights.popleft(), state, self.segment_bytes(peer))
            if g is not None:
                state.grants[g.ask] = g
                continue
            if s.status.state.terminal:
                return None
            self.w.check_deadline(s, f"waiting for a staging slot of {peer.agent}")
        grant = state.grants.pop(ask)
        if grant.refused or not 0 <= grant.slot < peer.staging_slots:
            why = grant.refused or f"slot {grant.slot} is not one of its {peer.staging_slots}"
            self.w.fail(
                s,
                FailureKind.RECEIVER_ERROR,
                f"decode agent {peer.agent} gave no staging slot: {why}",
            )
            return None
        return grant

    def _land(
        self,
        s: Sender,
        peer: DecodePeer,
        chunk: Chunk,
        f: _Flight,
        state: _State,
        segment_bytes: int,
    ) -> None:
        """Wait for one write to end; report it if DONE and the request is live."""
        ok = self.w.finish(s, peer, f.handle)
        self.ring.free([] if f.local is None else [f.local])
        if not ok or state.failed:
            state.failed = True  # a later segment is not reported after a lost one
            return
        first = f.segment == 0
        self.b.send(
            peer.agent,
            Staged(
                sender=self.b.agent,
                session=peer.session,
                room=s.room,
                prefill_rank=self.w.rank,
                ask=f.grant.ask,
                slot=f.grant.slot,
                start=chunk.start,
                stop=chunk.stop,
                last=chunk.last,
                segment=f.segment,
                segment_bytes=segment_bytes,
                nbytes=f.nbytes,
                tokens=chunk.placement.tokens if first else 0,
                pages={g: ids.tolist() for g, ids in chunk.placement.pages.items()}
                if first
                else {},
                slots=dict(chunk.placement.slots) if first else {},
                placement_start=chunk.placement.start if first else 0,
                layers=(chunk.layers.start, chunk.layers.stop),
                aux=chunk.completes,
            ),
        )
        state.reported += 1


def _shifted(runs: Runs, by: int) -> Runs:
    """``runs`` with their destinations ``by`` bytes further (into the granted slot)."""
    return Runs(
        runs.src_region,
        runs.src_offset,
        runs.dst_region,
        runs.dst_offset + by,
        runs.nbytes,
        runs.count,
        runs.src_stride,
        runs.dst_stride,
    )


class _State:
    """What one staged chunk has done so far (the worker's own bookkeeping)."""

    def __init__(self, asks: list[int]) -> None:
        self.asks = asks
        self.asked = 0
        self.grants: dict[int, StageGrant] = {}
        self.reported = 0
        self.failed = False
