"""The prefill side: senders, and the worker that executes their plans.

A :class:`Sender` collects chunks as the engine produces them. Decode ranks send their
placement of the request (``RequestMeta``) to every prefill rank; the planner says which decode
ranks this rank owes what (``Pairing.receivers_of``). Each (decode rank, chunk) becomes a job
for the one worker thread, which plans, posts to the transport, waits for DONE and only then
reports the chunk (``ChunkDone``). One synchronous worker means that when it picks up an abort
or a failure notice, no write of any request is in flight: draining is free.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

from kvbridge.bootstrap import BootstrapClient
from kvbridge.errors import FailureKind, KVBridgeError, PlacementError, TransportError
from kvbridge.integrity import checksums
from kvbridge.placement import Placement
from kvbridge.plan import Pairing, PartKind
from kvbridge.protocol import (
    Abort,
    AbortAck,
    ChunkDone,
    Failure,
    Hello,
    HelloReply,
    Message,
    RankInfo,
    RequestMeta,
    side_from_info,
)
from kvbridge.runs import Runs
from kvbridge.status import KVPoll, RequestStatus
from kvbridge.transports.base import XferState

if TYPE_CHECKING:
    from kvbridge.engine import Bridge

log = logging.getLogger("kvbridge.sender")


@dataclass(frozen=True, eq=False)
class _Chunk:
    start: int
    stop: int
    last: bool
    placement: Placement


class Sender:
    """One request on one prefill rank. Engines call :meth:`send` as chunks are computed."""

    def __init__(self, role: PrefillRole, room: int, placement: Placement) -> None:
        self.room = room
        self.tokens = placement.tokens
        self.status = RequestStatus(room, time.monotonic() + role.settings.waiting_timeout)
        self._role = role
        self._lock = threading.Lock()
        self._placement = placement
        self._chunks: list[_Chunk] = []
        self._engine: str | None = None  # the decode engine serving the request
        self._pairing: Pairing | None = None
        self._needed: dict[int, frozenset[PartKind]] = {}
        self._metas: dict[int, Placement] = {}
        self._agents: dict[int, str] = {}  # every decode rank that sent metadata
        self._scheduled: dict[int, int] = defaultdict(int)
        self._completed: dict[int, int] = defaultdict(int)
        # time.monotonic() when the last chunk's writes were DONE (CLOCK_MONOTONIC is
        # system-wide, so the decode side's Success time can be compared with it).
        self.writes_done_at: float | None = None

    def send(self, stop: int, *, placement: Placement | None = None,
             last: bool | None = None) -> None:
        """Tokens ``[previous stop, stop)`` are in the pools now; send them. ``placement``
        replaces the request's page table (chunked prefill allocates as it goes). On a
        request that already ended this does nothing: the engine learns why from poll()."""
        if self.status.state.terminal:
            return
        with self._lock:
            start = self._chunks[-1].stop if self._chunks else 0
            if self._chunks and self._chunks[-1].last:
                raise KVBridgeError(f"room {self.room}: the last chunk was already sent")
            if not start < stop <= self.tokens:
                raise PlacementError(f"room {self.room}: chunk [{start}, {stop}) must be "
                                     f"non-empty and end within the request's {self.tokens} "
                                     f"tokens")
            if placement is not None:
                if placement.tokens != self.tokens:
                    raise PlacementError(f"room {self.room}: new placement has "
                                         f"{placement.tokens} tokens, the request {self.tokens}")
                self._placement = placement
            last = stop == self.tokens if last is None else last
            if last and stop != self.tokens:
                raise PlacementError(f"room {self.room}: the last chunk must end at token "
                                     f"{self.tokens}, got {stop}")
            self._chunks.append(_Chunk(start, stop, last, self._placement))
        self._role.pump(self)

    def poll(self) -> KVPoll:
        return self.status.state

    @property
    def failure(self) -> KVBridgeError | None:
        return self.status.failure

    def wait(self, timeout: float) -> KVPoll:
        return self.status.wait(timeout)

    def abort(self, reason: str = "aborted by the prefill engine") -> None:
        """Fail the request here and, at once, on every decode rank that asked for it."""
        self._role.fail(self, FailureKind.ABORTED, reason)


class PrefillRole:
    def __init__(self, bridge: Bridge) -> None:
        self.b = bridge
        self.settings = bridge.settings
        self.rank = bridge.rank
        self.requests: dict[int, Sender] = {}
        self._early: dict[int, list[tuple[float, RequestMeta]]] = defaultdict(list)
        # Rooms that failed here, kept for a while so that metadata arriving late (from a
        # decode rank slower than the failure) is answered at once instead of waiting.
        self._failed: dict[int, tuple[float, FailureKind, str]] = {}
        self._pairings: dict[str, tuple[RankInfo, Pairing]] = {}  # decode engine -> pairing
        self._decode: dict[str, tuple[str, int]] = {}  # decode agent -> (engine, rank)
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[str, Sender | None, object]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._worker = threading.Thread(target=self._work, daemon=True,
                                        name=f"kvbridge-worker-{bridge.agent}")

    # ---- life ----------------------------------------------------------------------------

    def start(self) -> None:
        self._worker.start()
        if self.b.bootstrap:
            BootstrapClient(self.b.bootstrap, self.settings.token or None,
                            timeout=self.settings.bootstrap_timeout).register_prefill(self.b.info)

    def close(self) -> None:
        self._stop.set()
        self._jobs.put(("stop", None, None))
        self._worker.join(self.settings.abort_timeout)

    def active_rooms(self) -> int:
        with self._lock:
            return len(self.requests) + len(self._early)

    def sender(self, room: int, placement: Placement) -> Sender:
        with self._lock:
            if room in self.requests:
                raise KVBridgeError(f"room {room} already has a sender on rank {self.rank}")
            s = self.requests[room] = Sender(self, room, placement)
            early = self._early.pop(room, [])
        for _, meta in early:
            self._bind(s, meta)
        return s

    # ---- messages ------------------------------------------------------------------------

    def on_message(self, msg: Message) -> None:
        if isinstance(msg, Hello):
            self._hello(msg)
        elif isinstance(msg, RequestMeta):
            self._meta(msg)
        elif isinstance(msg, Abort):
            self._abort(msg)
        else:
            log.warning("%s: unexpected %s from %s", self.b.agent, type(msg).__name__, msg.sender)

    def _hello(self, msg: Hello) -> None:
        info = msg.info
        if info.agent != msg.sender:
            log.warning("%s: hello from %s describes %s; refused", self.b.agent, msg.sender,
                        info.agent)
            return
        self.b.add_peer(info.agent, info.control)
        try:
            known = self._pairings.get(info.engine_id)
            if known is None or _side_key(known[0]) != _side_key(info):
                pairing = Pairing(self.b.side, side_from_info(info))
                self._pairings[info.engine_id] = (info, pairing)
            self.b.transport.add_peer(info.agent, info.transport_meta)
        except Exception as e:  # whatever went wrong, the decode rank must hear why, now
            log.warning("%s: refused hello from %s: %s", self.b.agent, info.agent, e)
            self.b.send(info.agent, HelloReply(sender=self.b.agent, token=self.settings.token,
                                               refused=str(e)))
            self.b.drop_peer(info.agent)
            return
        self._decode[info.agent] = (info.engine_id, info.engine_rank)
        self.b.send(info.agent, HelloReply(sender=self.b.agent, token=self.settings.token,
                                           info=self.b.info))

    def _meta(self, msg: RequestMeta) -> None:
        if msg.sender not in self._decode:
            log.warning("%s: request metadata from %s, which never said hello; refused",
                        self.b.agent, msg.sender)
            return
        with self._lock:
            s = self.requests.get(msg.room)
            failed = self._failed.get(msg.room)
            if s is None and failed is None:
                self._early[msg.room].append((time.monotonic(), msg))
                return
        if s is None and failed is not None:
            _, kind, reason = failed
            self.b.send(msg.sender, Failure(sender=self.b.agent, token=self.settings.token,
                                            room=msg.room, rank=self.rank, kind=kind,
                                            reason=reason))
            return
        if s is not None:
            self._bind(s, msg)

    def _bind(self, s: Sender, msg: RequestMeta) -> None:
        found = self._decode.get(msg.sender)
        if found is None:  # metadata kept from before its decode rank died
            self.fail(s, FailureKind.PEER_DEAD, f"decode agent {msg.sender} asked for this "
                      f"request and is gone")
            return
        engine, d = found
        info, pairing = self._pairings[engine]
        with s._lock:
            s._agents[d] = msg.sender
            late = s.status.state is KVPoll.FAILED
            if s._engine is None:
                s._engine, s._pairing = engine, pairing
                s._needed = pairing.receivers_of(self.rank)
            elif s._engine != engine:
                reason = f"room {s.room} is already served by decode engine {s._engine!r}"
                self.b.send(msg.sender, Failure(sender=self.b.agent, token=self.settings.token,
                                                room=s.room, rank=self.rank,
                                                kind=FailureKind.BAD_INPUT, reason=reason))
                return
        if late:  # failed before this decode rank spoke: tell it (after any drain)
            self._jobs.put(("notify", s, None))
            return
        try:
            placement = msg.placement()
            pairing.check_placement(placement, "decode")
            if placement.tokens != s.tokens:
                raise PlacementError(f"decode placement has {placement.tokens} tokens, the "
                                     f"prefill request {s.tokens}")
        except KVBridgeError as e:
            self.fail(s, FailureKind.BAD_INPUT, f"decode rank {d} sent a bad placement: {e}")
            return
        with s._lock:
            s._metas[d] = placement
            ready = all(r in s._metas for r in s._needed)
        if ready:
            s.status.advance(KVPoll.WAITING_FOR_INPUT,
                             time.monotonic() + self.settings.waiting_timeout)
        self.pump(s)

    def _abort(self, msg: Abort) -> None:
        with self._lock:
            s = self.requests.get(msg.room)
        if s is not None:
            self.fail(s, FailureKind.ABORTED, f"aborted by decode rank {msg.decode_rank}")
        # Queued behind every job already taken: when it runs, nothing of ours is in flight.
        self._jobs.put(("ack", None, (msg.sender, msg.room)))

    # ---- scheduling ----------------------------------------------------------------------

    def pump(self, s: Sender) -> None:
        """Queue every (decode rank, chunk) that is ready and not yet queued."""
        with s._lock:
            if s.status.state.terminal:
                return
            for d in s._needed:
                if d not in s._metas:
                    continue
                while s._scheduled[d] < len(s._chunks):
                    self._jobs.put(("chunk", s, (d, s._scheduled[d])))
                    s._scheduled[d] += 1
            started = bool(s._chunks) and s._engine is not None
        if started:
            s.status.advance(KVPoll.TRANSFERRING,
                             time.monotonic() + self.settings.transfer_timeout)
        self._maybe_succeed(s)

    def _maybe_succeed(self, s: Sender) -> None:
        with s._lock:
            done = (bool(s._chunks) and s._chunks[-1].last and s._engine is not None
                    and all(s._completed[d] == len(s._chunks) for d in s._needed))
        if done and s.status.succeed():
            for agent, held in self.b.faults.flush_held():
                self.b.send(agent, held, faults=False)
            with self._lock:
                self.requests.pop(s.room, None)

    def fail(self, s: Sender, kind: FailureKind, reason: str) -> None:
        if s.status.fail(kind, reason):
            log.info("%s: room %d failed: %s", self.b.agent, s.room, reason)
            self._jobs.put(("notify", s, None))

    # ---- the worker ----------------------------------------------------------------------

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                kind, s, arg = self._jobs.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                if kind == "chunk" and s is not None:
                    self._transfer(s, *arg)  # type: ignore[misc]
                elif kind == "notify" and s is not None:
                    self._notify(s)
                elif kind == "ack":
                    agent, room = cast(tuple[str, int], arg)
                    self.b.send(agent, AbortAck(sender=self.b.agent, token=self.settings.token,
                                                room=room, prefill_rank=self.rank))
            except Exception as e:  # a bug here must fail the request, never the rank
                log.exception("%s: worker error", self.b.agent)
                if s is not None:
                    self.fail(s, FailureKind.SENDER_ERROR, f"prefill rank {self.rank}: {e!r}")

    def _transfer(self, s: Sender, d: int, index: int) -> None:
        with s._lock:
            if s.status.state.terminal:
                return
            chunk, dst, agent = s._chunks[index], s._metas[d], s._agents[d]
            pairing = s._pairing
        if pairing is None:  # cannot happen: jobs are queued only once bound
            raise KVBridgeError(f"room {s.room}: no pairing")
        faults = self.b.faults
        if faults.sender_raise and index == 0:
            raise RuntimeError("injected fault: the sender raised inside its worker")
        try:
            plan = pairing.plan(chunk.placement, dst, chunk.start, chunk.stop, last=chunk.last,
                                prefill_rank=self.rank, decode_rank=d)
        except PlacementError as e:
            self.fail(s, FailureKind.BAD_INPUT, f"prefill rank {self.rank}: {e}")
            return
        if plan.pairs:
            pair = plan.pairs[0]
            runs = Runs.empty() if faults.skip_chunk == index else pair.runs
            sums = checksums(plan, runs, self.b.views, source=True) \
                if self.settings.integrity else {}
            if faults.corrupt and len(runs):
                view = self.b.views[plan.src_regions[int(runs.src_region[0])]]
                view[int(runs.src_offset[0])] ^= 0xFF
            if faults.shift_bytes:
                runs = _shift(runs, faults.shift_bytes, plan.dst_regions, dict(
                    (r.name, r.nbytes) for r in pairing.decode.memory.regions))
            if len(runs):
                src_names, dst_names, runs = _compact(plan.src_regions, plan.dst_regions, runs)
                if not self._post(s, agent, src_names, dst_names, runs):
                    return
            if chunk.last:
                s.writes_done_at = time.monotonic()
            self.b.send(agent, ChunkDone(sender=self.b.agent, token=self.settings.token,
                                         room=s.room, prefill_rank=self.rank, start=chunk.start,
                                         stop=chunk.stop, parts=[p.kind.value for p in pair.parts],
                                         checksums=sums))
        with s._lock:
            s._completed[d] += 1
        self._maybe_succeed(s)

    def _post(self, s: Sender, agent: str, src: tuple[str, ...], dst: tuple[str, ...],
              runs: Runs) -> bool:
        """Post and wait for DONE; False (and the request failed) otherwise."""
        try:
            handle = self.b.transport.post(agent, src, dst, runs)
        except TransportError as e:
            self.fail(s, FailureKind.TRANSPORT, f"prefill rank {self.rank}: {e}")
            return False
        n = self.b.faults.exit_after_post
        if n and self.b.faults.count_post() == n:
            os._exit(3)  # the fault: this process dies with the write in flight
        # Wait past the request's deadline only to drain: a write must end before we go on.
        drain_end = s.status.deadline + self.settings.abort_timeout
        state = XferState.PENDING
        while state is XferState.PENDING and not self._stop.is_set():
            now = time.monotonic()
            if now > drain_end:
                break
            if now > s.status.deadline:
                self.fail(s, FailureKind.DEADLINE, f"prefill rank {self.rank}: transfer to "
                          f"{agent} still running at the deadline")
            state = self.b.transport.wait(handle, 0.05)
        if state is XferState.DONE:
            self.b.transport.release(handle)
            return not s.status.state.terminal
        reason = handle.error if state is XferState.FAILED else "transfer did not end in time"
        self.fail(s, FailureKind.TRANSPORT, f"prefill rank {self.rank} -> {agent}: {reason}")
        if state is not XferState.PENDING:
            self.b.transport.release(handle)
        return False

    def _notify(self, s: Sender) -> None:
        """Tell every decode rank of a failed request why, once nothing of it is in flight."""
        failure = s.status.failure
        with s._lock:
            agents = set(s._agents.values())
        for agent in agents:
            self.b.send(agent, Failure(sender=self.b.agent, token=self.settings.token,
                                       room=s.room, rank=self.rank,
                                       kind=failure.kind if failure else FailureKind.SENDER_ERROR,
                                       reason=failure.detail if failure else "failed"))
        with self._lock:
            self.requests.pop(s.room, None)
            if failure is not None:
                self._failed[s.room] = (time.monotonic(), failure.kind, failure.detail)

    # ---- liveness and deadlines ----------------------------------------------------------

    def on_peer_dead(self, agent: str) -> None:
        self._decode.pop(agent, None)
        with contextlib.suppress(TransportError):  # already gone is what we want
            self.b.transport.remove_peer(agent)
        with self._lock:
            senders = list(self.requests.values())
        for s in senders:
            with s._lock:
                involved = agent in s._agents.values()
            if involved:
                self.fail(s, FailureKind.PEER_DEAD, f"decode agent {agent} stopped heart-beating")

    def on_tick(self, now: float) -> None:
        with self._lock:
            senders = list(self.requests.values())
            stale = [room for room, metas in self._early.items()
                     if now - metas[0][0] > self.settings.waiting_timeout]
            for room in stale:
                del self._early[room]
            for room in [r for r, (t, _, _) in self._failed.items()
                         if now - t > self.settings.waiting_timeout]:
                del self._failed[room]
        for s in senders:
            if s.status.check_deadline(now):
                self._jobs.put(("notify", s, None))


def _side_key(info: RankInfo) -> tuple[object, ...]:
    return (info.fingerprint, info.tp, tuple(map(tuple, info.layer_ranges)), info.memory)


def _shift(runs: Runs, by: int, dst_regions: tuple[str, ...], sizes: dict[str, int]) -> Runs:
    """Fault: move every destination by ``by`` bytes where it stays inside its region."""
    limit = np.array([sizes[dst_regions[int(r)]] for r in runs.dst_region], dtype=np.int64)
    end = runs.dst_offset + by + (runs.count - 1) * runs.dst_stride + runs.nbytes
    off = np.where(end <= limit, runs.dst_offset + by, runs.dst_offset)
    return Runs(runs.src_region, runs.src_offset, runs.dst_region, off, runs.nbytes, runs.count,
                runs.src_stride, runs.dst_stride)


def _compact(src: tuple[str, ...], dst: tuple[str, ...], runs: Runs
             ) -> tuple[tuple[str, ...], tuple[str, ...], Runs]:
    """Name only the regions the runs use: the plan's tables list every region of the side,
    of other PP stages too, which this rank's transport does not hold."""
    s_used, s_idx = np.unique(runs.src_region, return_inverse=True)
    d_used, d_idx = np.unique(runs.dst_region, return_inverse=True)
    return (tuple(src[i] for i in s_used.tolist()), tuple(dst[i] for i in d_used.tolist()),
            Runs(s_idx.astype(np.int64), runs.src_offset, d_idx.astype(np.int64),
                 runs.dst_offset, runs.nbytes, runs.count, runs.src_stride, runs.dst_stride))
