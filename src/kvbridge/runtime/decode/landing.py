"""The decode side of staged transfers: grant slots, scatter for live requests, free slots
(the staging layout and ring it uses are :mod:`kvbridge.staging`'s, the region
:mod:`kvbridge.runtime.staging_pool`'s).

A :class:`StagingArea` holds the decode rank's staging ring (:class:`~kvbridge.staging.ring.
SlotRing`) and one *landing thread*:

* a ``StageAsk`` (control thread) is granted a slot at once, or waits its turn in the ring;
  an ask for a request that is not live is refused;
* a ``Staged`` notice is scattered on the landing thread: the slot must be the one granted
  to that ask; the chunk is planned here, by the same planner, from the sender's placement
  (carried by its first segment) and this rank's own, so the scatter writes only into this
  request's pages; the segment's bytes go there, the slot is free again, the next ask in line
  gets it;
* every ``ChunkDone`` is handled on the same thread, after the notices that came before it:
  a chunk staged in ``n`` segments counts only once ``n`` were scattered.

Fencing. The scatter is this rank's own write, so it simply does not happen for a request that
is no longer live: the receiver's live state is checked and a scatter counted in progress under
the receiver's lock (:meth:`~.receiver.Receiver.begin_scatter`), and the request's pages are
released only once no scatter of it is in progress. A slot granted to a request is reused only
once its bytes were scattered, or once the request is released (no writer can write into it
any more); a request held or quarantined keeps its slots.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Protocol

from kvbridge.errors import FailureKind, KVBridgeError, ProtocolError
from kvbridge.planner.runs import Runs
from kvbridge.runtime.contracts import Rank
from kvbridge.runtime.decode.receiver import Receiver
from kvbridge.runtime.staging_pool import REGION, StagingPool
from kvbridge.staging.layout import scatter, segments
from kvbridge.staging.ring import Grant, SlotRing
from kvbridge.wire.protocol import ChunkDone, StageAsk, Staged, StageGrant

log = logging.getLogger("kvbridge.staging")


@dataclass(frozen=True)
class _Ask:
    """A slot's owner: one ask of one prefill agent for one request of one link session."""

    session: int
    room: int
    agent: str
    ask: int


@dataclass(frozen=True, eq=False)
class _Chunk:
    segments: tuple[Runs, ...]
    dst_regions: tuple[str, ...]


@dataclass(eq=False)
class _Room:
    """A request that asked for slots; its chunk plans and scatter counts (landing thread)."""

    r: Receiver
    # (prefill rank, start, stop, layers, last, aux, segment bytes) -> its planned segments
    chunks: dict[tuple[object, ...], _Chunk] = field(default_factory=dict)
    # (prefill rank, start, stop, layers) -> segments scattered
    scattered: dict[tuple[object, ...], int] = field(default_factory=dict)


class Releasing(Protocol):
    """What the landing needs of the decode role: ending a request, releasing it."""

    rank: int

    def fail(self, request: Receiver, kind: FailureKind, reason: str) -> None: ...
    def maybe_release(self, r: Receiver) -> None: ...


class StagingArea:
    def __init__(self, role: Releasing, rank: Rank, pool: StagingPool) -> None:
        self.role = role
        self.b = rank
        self.pool = pool
        self.ring = SlotRing(pool.slots)
        self._rooms: dict[tuple[int, int], _Room] = {}
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, daemon=True, name=f"kvbridge-landing-{self.b.agent}"
        )
        self.scatters = 0  # segments scattered
        self.refused = 0  # segments not scattered: their request was no longer live

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(self.b.settings.abort_timeout)

    def later(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the landing thread, after everything queued before it."""
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # a bug here must not stop later scatters and notices
                log.exception("%s: landing thread", self.b.agent)

    # ---- asks (control thread) ---------------------------------------------------------

    def ask(self, r: Receiver | None, session: int, rank: int, msg: StageAsk) -> None:
        why = None
        if r is None:
            why = f"room {msg.room} is not a request of this rank"
        elif msg.prefill_rank != rank:
            why = f"it claims prefill rank {msg.prefill_rank}, its rank is {rank}"
        else:
            with self._lock:  # live under the lock: a request released since added no room
                if r.status.state.terminal or r.placement is None:
                    why = f"room {msg.room} is not live ({r.status.state.name})"
                else:
                    self._rooms.setdefault((session, r.room), _Room(r))
        if why is None and r is not None:
            key = _Ask(session, r.room, msg.sender, msg.ask)
            grant = self.ring.ask(key)
            if grant is None or self._live(key):
                self._deliver([] if grant is None else [grant])
                return
            # It ended since, and its release may have come before this grant: free the slot.
            self._deliver(self.ring.release(lambda k: k == key, self._live))
            why = f"room {msg.room} ended ({r.status.state.name})"
        self.b.send(
            msg.sender,
            StageGrant(
                sender=self.b.agent,
                session=session,
                room=msg.room,
                decode_rank=self.role.rank,
                ask=msg.ask,
                refused=why or "no request",
            ),
        )

    def _deliver(self, grants: list[Grant]) -> None:
        for g in grants:
            k = g.key
            if isinstance(k, _Ask):
                self.b.send(
                    k.agent,
                    StageGrant(
                        sender=self.b.agent,
                        session=k.session,
                        room=k.room,
                        decode_rank=self.role.rank,
                        ask=k.ask,
                        slot=g.slot,
                    ),
                )

    def _live(self, key: Hashable) -> bool:
        if not isinstance(key, _Ask):
            return False
        with self._lock:
            room = self._rooms.get((key.session, key.room))
        return room is not None and not room.r.status.state.terminal

    # ---- the end of a request (any thread) -----------------------------------------------

    def ended(self, r: Receiver) -> None:
        """``r`` failed: its asks not yet granted never will be (no writer holds them)."""
        if r.link is None:  # failed before it was linked: it never asked for a slot
            return
        session = r.link.session
        self.ring.drop_waiting(
            lambda k: isinstance(k, _Ask) and (k.session, k.room) == (session, r.room)
        )

    def released(self, r: Receiver) -> None:
        """No write of ``r`` can land any more: its slots are free for others."""
        if r.link is None:
            return
        session = r.link.session
        with self._lock:
            known = self._rooms.pop((session, r.room), None) is not None
        if known:
            self._deliver(
                self.ring.release(
                    lambda k: isinstance(k, _Ask) and (k.session, k.room) == (session, r.room),
                    self._live,
                )
            )

    # ---- scatter (landing thread) ----------------------------------------------------------

    def staged(self, r: Receiver, rank: int, msg: Staged) -> None:
        self.later(lambda: self._scatter(r, rank, msg))

    def _scatter(self, r: Receiver, rank: int, msg: Staged) -> None:
        key = _Ask(r.linked.session, r.room, msg.sender, msg.ask)
        with self._lock:
            room = self._rooms.get((key.session, key.room))
        if room is None or r.status.state.terminal:  # released, or ended: nothing to do
            self.refused += 1
            return
        if (
            not 0 <= msg.slot < self.pool.slots
            or self.ring.holder(msg.slot) != key
            or msg.prefill_rank != rank
        ):
            self.role.fail(
                r,
                FailureKind.BAD_INPUT,
                f"prefill rank {rank}: staged segment "
                f"{msg.segment} names slot {msg.slot}, not granted to its ask "
                f"{msg.ask}",
            )
            return
        if not r.begin_scatter():  # never a byte into the pages of an ended request
            self.refused += 1
            return
        try:
            chunk = self._chunk(room, rank, msg)
            seg = chunk.segments[msg.segment]
            if seg.total_bytes != msg.nbytes:
                raise ProtocolError(
                    f"segment {msg.segment} carries {msg.nbytes} bytes; the "
                    f"plan says {seg.total_bytes}"
                )
            runs = scatter(seg, self.pool.offset(msg.slot))
            _, names, runs = runs.restricted((REGION,), chunk.dst_regions)
            self.b.copier.copy(runs, (REGION,), names)
        except (KVBridgeError, KeyError, IndexError) as e:
            self.role.fail(
                r,
                FailureKind.BAD_INPUT,
                f"prefill rank {rank}: staged segment "
                f"{msg.segment} of [{msg.start}, {msg.stop}) refused: {e}",
            )
            return
        except Exception as e:  # the copy itself (a device's error, out of memory): this
            self.role.fail(  # request fails now, its slot with it, not at its deadline
                r,
                FailureKind.RECEIVER_ERROR,
                f"scattering staged segment {msg.segment} of [{msg.start}, {msg.stop}) from "
                f"prefill rank {rank} failed: {type(e).__name__}: {e}",
            )
            return
        finally:
            r.end_scatter()
            self.role.maybe_release(r)  # it may have failed meanwhile
        self.scatters += 1
        self.b.metrics.scattered()
        done = (rank, msg.start, msg.stop, msg.layers)
        room.scattered[done] = room.scattered.get(done, 0) + 1
        self._deliver(self.ring.free([msg.slot], self._live))

    def _chunk(self, room: _Room, rank: int, msg: Staged) -> _Chunk:
        """The chunk's segments, planned at its first segment by the same planner the sender
        used, from the sender's placement and this rank's."""
        if msg.segment_bytes > self.pool.slot_bytes:
            raise ProtocolError(
                f"segments of {msg.segment_bytes} bytes exceed this rank's "
                f"{self.pool.slot_bytes}-byte slots"
            )
        key = (rank, msg.start, msg.stop, msg.layers, msg.last, msg.aux, msg.segment_bytes)
        chunk = room.chunks.get(key)
        if chunk is None:
            pairing, dst = room.r.linked.pairing, room.r.placement
            if msg.segment != 0 or pairing is None or dst is None:
                raise ProtocolError(f"segment {msg.segment} before the chunk's first")
            plan = pairing.plan(
                msg.placement(),
                dst,
                msg.start,
                msg.stop,
                last=msg.last,
                prefill_rank=rank,
                decode_rank=self.role.rank,
                layers=msg.layer_range(),
                aux=msg.aux,
            )
            if not plan.pairs:
                raise ProtocolError("the plan owes this rank nothing from that prefill rank")
            chunk = room.chunks[key] = _Chunk(
                segments(plan.pairs[0].runs, msg.segment_bytes), plan.dst_regions
            )
        if not 0 <= msg.segment < len(chunk.segments):
            raise ProtocolError(f"segment {msg.segment} of a chunk of {len(chunk.segments)}")
        return chunk

    def unscattered(self, r: Receiver, rank: int, msg: ChunkDone) -> str | None:
        """Landing thread, for a chunk reported staged: why it cannot count yet (segments
        missing), or None when every one of its segments was scattered."""
        with self._lock:
            room = self._rooms.get((r.linked.session, r.room))
        piece = (rank, msg.start, msg.stop, msg.layers)
        got = 0 if room is None else room.scattered.get(piece, 0)
        if got == msg.staged:
            if room is not None:  # its plans are not needed any more
                for key in [k for k in room.chunks if k[:4] == piece]:
                    del room.chunks[key]
            return None
        return (
            f"prefill rank {rank} reported tokens [{msg.start}, {msg.stop}) staged in "
            f"{msg.staged} segments; {got} were scattered"
        )
