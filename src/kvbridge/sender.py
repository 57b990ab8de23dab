"""The prefill side: senders, and the worker that executes their plans.

A :class:`Sender` collects chunks as the engine produces them. Decode ranks send their
placement of the request (``RequestMeta``) to every prefill rank; the planner says which decode
ranks this rank owes what (``Pairing.receivers_of``). Each (decode rank, chunk) becomes a job
for the one worker thread, which plans, writes (directly or staged), waits until the writes
ended (never past a write still in flight) and only then reports the chunk (``ChunkDone``;
see :mod:`kvbridge.writer`). One
synchronous worker means that when it picks up an abort or a failure notice, no write of any
request is in flight: draining is free, and an acknowledgement is the truth.

A sender succeeds only once every decode rank it owes confirmed the request (``Delivered``):
success means the bytes are there, not that they were sent. A sender whose decode peer was
declared dead, or fenced this rank, or never confirmed, ends FAILED.

Hellos (building a pairing, mapping a peer's memory) run on a setup thread of their own, so
that the control thread keeps answering and heart-beating.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from kvbridge.bootstrap import BootstrapClient
from kvbridge.errors import (
    FailureKind,
    KVBridgeError,
    PlacementError,
    TransferFailed,
    TransportError,
)
from kvbridge.groups import RoomAnnouncer
from kvbridge.placement import Placement
from kvbridge.plan import Pairing, PartKind
from kvbridge.protocol import (
    Abort,
    AbortAck,
    Delivered,
    Failure,
    Fenced,
    Hello,
    HelloReply,
    Message,
    RankInfo,
    RequestMeta,
    StageGrant,
    side_from_info,
)
from kvbridge.status import KVPoll, RequestStatus, ranges_text
from kvbridge.writer import ChunkWriter

if TYPE_CHECKING:
    from kvbridge.engine import Bridge

log = logging.getLogger("kvbridge.sender")


_ENDED_MAX = 1 << 16  # ended rooms remembered, to answer late metadata at once


@dataclass(frozen=True)
class _DecodePeer:
    """A decode rank in the session its last hello opened."""

    agent: str
    engine: str
    rank: int
    session: int
    endpoint: str
    staging_slots: int = 0  # its staging region (kvbridge.staging), if it has one
    staging_slot_bytes: int = 0


@dataclass(frozen=True, eq=False)
class _Chunk:
    """What one :meth:`Sender.send` hands over: tokens ``[start, stop)`` of ``layers``.
    ``completes``: no layer of those tokens is left to send (the aux slot travels with it)."""

    start: int
    stop: int
    last: bool
    placement: Placement
    layers: range
    completes: bool = True


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
        self._left: set[int] = set()  # layers of the open chunk not sent yet
        self._engine: str | None = None  # the decode engine serving the request
        self._pairing: Pairing | None = None
        self._needed: dict[int, frozenset[PartKind]] = {}
        self._metas: dict[int, Placement] = {}
        self._peers: dict[int, _DecodePeer] = {}  # every decode rank that sent metadata
        self._delivered: set[int] = set()
        self._scheduled: dict[int, int] = defaultdict(int)
        self._completed: dict[int, int] = defaultdict(int)
        # time.monotonic() when the last chunk's writes were DONE (CLOCK_MONOTONIC is
        # system-wide, so the decode side's Success time can be compared with it).
        self.writes_done_at: float | None = None
        self.sent_bytes = 0  # written by this rank's worker, to every decode rank

    def send(
        self,
        stop: int,
        *,
        layers: range | None = None,
        placement: Placement | None = None,
        last: bool | None = None,
    ) -> None:
        """Tokens ``[previous stop, stop)`` are in the pools now, for ``layers`` of this rank
        (a prefill whose forward computes layer by layer sends each layer group as soon as it
        is computed, in any order; by default, every layer of these tokens not sent yet); send
        them. The next tokens can be sent once every layer of these was. ``placement``
        replaces the request's page table (chunked prefill allocates as it goes). On a
        request that already ended this does nothing: the engine learns why from poll()."""
        self._role.b.check_open()
        if self.status.state.terminal:
            return
        mine = self._role.b.side.parallel.layers_of(self._role.rank)
        with self._lock:
            left = self._left
            if left and stop == self._chunks[-1].stop:  # more layers of the open chunk
                start, last = self._chunks[-1].start, self._chunks[-1].last
            else:
                if self._left:
                    raise PlacementError(
                        f"room {self.room}: tokens [{self._chunks[-1].start}, "
                        f"{self._chunks[-1].stop}) still miss layers {ranges_text(self._left)}: "
                        f"send them before tokens past {self._chunks[-1].stop}"
                    )
                start = self._chunks[-1].stop if self._chunks else 0
                if self._chunks and self._chunks[-1].last:
                    raise KVBridgeError(f"room {self.room}: the last chunk was already sent")
                if not start < stop <= self.tokens:
                    raise PlacementError(
                        f"room {self.room}: chunk [{start}, {stop}) must be "
                        f"non-empty and end within the request's "
                        f"{self.tokens} tokens"
                    )
                last = stop == self.tokens if last is None else last
                if last and stop != self.tokens:
                    raise PlacementError(
                        f"room {self.room}: the last chunk must end at token "
                        f"{self.tokens}, got {stop}"
                    )
                left = set(mine)  # a new chunk: every layer of this rank to send
            want = set(left) if layers is None else set(layers)
            if not want or not want <= left or (layers is not None and layers.step != 1):
                raise PlacementError(
                    f"room {self.room}: layers {layers} of tokens [{start}, "
                    f"{stop}): expected a non-empty range of this rank's "
                    f"layers not sent yet ({ranges_text(left)})"
                )
            if placement is not None:
                if placement.tokens != self.tokens:
                    raise PlacementError(
                        f"room {self.room}: new placement has "
                        f"{placement.tokens} tokens, the request {self.tokens}"
                    )
                self._placement = placement
            self._left = left - want
            runs = _runs(want)  # the default may leave gaps: one piece per run of layers
            for i, group in enumerate(runs):
                self._chunks.append(
                    _Chunk(
                        start,
                        stop,
                        last,
                        self._placement,
                        group,
                        completes=not self._left and i == len(runs) - 1,
                    )
                )
        self._role.pump(self)

    def poll(self) -> KVPoll:
        return self.status.state

    def unsent(self) -> str:
        """What the engine has not handed over yet, in words ("" if it sent every token)."""
        with self._lock:
            stop = self._chunks[-1].stop if self._chunks else 0
            if self._left:
                return (
                    f"the engine has not sent layers {ranges_text(self._left)} of tokens "
                    f"[{self._chunks[-1].start}, {stop})"
                )
            if stop < self.tokens:
                return f"the engine has sent tokens [0, {stop}) of {self.tokens}"
            return ""

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
        self._early: dict[int, list[RequestMeta]] = {}
        self._early_at: dict[int, float] = {}
        # Rooms that ended here (None: success), so that late metadata is answered at once
        # instead of parked; and failures that came before the engine made a sender.
        self._ended: OrderedDict[int, tuple[float, TransferFailed | None]] = OrderedDict()
        self._pairings: dict[str, tuple[RankInfo, Pairing]] = {}  # decode engine -> pairing
        self._peers: dict[str, _DecodePeer] = {}  # live decode agents, current session
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[str, Sender | None, object]] = queue.SimpleQueue()
        self._hellos: queue.SimpleQueue[Hello | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._worker = threading.Thread(
            target=self._work, daemon=True, name=f"kvbridge-worker-{bridge.agent}"
        )
        self._setup = threading.Thread(
            target=self._setup_loop, daemon=True, name=f"kvbridge-setup-{bridge.agent}"
        )
        self.writer = ChunkWriter(self)
        self.refused = 0  # link messages refused: stale session, foreign room, unknown peer
        # A DP group's first rank tells the bootstrap service which rooms the group holds.
        self.announcer = (
            RoomAnnouncer(
                BootstrapClient(
                    bridge.bootstrap,
                    self.settings.token or None,
                    timeout=self.settings.bootstrap_timeout,
                ),
                bridge.engine_id,
                self._unannounced,
            )
            if bridge.dp > 1 and bridge.rank == 0 and bridge.bootstrap
            else None
        )

    # ---- life ----------------------------------------------------------------------------

    def start(self) -> None:
        self._worker.start()
        self._setup.start()
        if self.announcer is not None:
            self.announcer.start()
        if self.b.bootstrap:
            BootstrapClient(
                self.b.bootstrap,
                self.settings.token or None,
                timeout=self.settings.bootstrap_timeout,
            ).register_prefill(self.b.info)

    def close(self) -> None:
        """Fail every open request (its decode ranks are told), then let the worker drain."""
        with self._lock:
            senders = list(self.requests.values())
        for s in senders:
            self.fail(s, FailureKind.CLOSED, f"prefill rank {self.rank} was closed")
        self._stop.set()
        self._jobs.put(("stop", None, None))
        self._hellos.put(None)
        if self.announcer is not None:
            self.announcer.close()
        self._worker.join(self.settings.abort_timeout)

    def closed(self) -> None:
        # The transport is closed: a write the worker still waited for has ended FAILED.
        self._worker.join(self.settings.abort_timeout)
        self._setup.join(self.settings.abort_timeout)

    def active_rooms(self) -> int:
        with self._lock:
            return len(self.requests) + len(self._early)

    def sender(self, room: int, placement: Placement) -> Sender:
        with self._lock:
            if room in self.requests:
                raise KVBridgeError(f"room {room} already has a sender on rank {self.rank}")
            s = self.requests[room] = Sender(self, room, placement)
            early = self._early.pop(room, [])
            self._early_at.pop(room, None)
            ended = self._ended.pop(room, None)
        if ended is not None and ended[1] is not None:  # aborted before the engine got here
            self.fail(s, ended[1].kind, ended[1].detail)
        if self.announcer is not None:
            self.announcer.add(room)
        for meta in early:
            self._bind(s, meta)
        return s

    def _unannounced(self, room: int, reason: str) -> None:
        """The bootstrap service did not take this group's room: no decode rank can find it."""
        with self._lock:
            s = self.requests.get(room)
        if s is not None:
            self.fail(s, FailureKind.BAD_INPUT, f"prefill engine {self.b.engine_id}: {reason}")

    # ---- messages ------------------------------------------------------------------------

    def on_message(self, msg: Message) -> None:
        if isinstance(msg, Hello):
            self._hellos.put(msg)  # pairing and mapping happen off the control thread
            return
        peer = self._peers.get(msg.sender)
        session = getattr(msg, "session", None)
        if peer is None or session != peer.session:
            if isinstance(msg, Abort):  # a fenced session's abort still wants its answer
                self._abort(msg, None)
                return
            self._refuse(
                msg,
                "no live session"
                if peer is None
                else f"session {session}, the live one is {peer.session}",
            )
            return
        if isinstance(msg, RequestMeta):
            self._meta(peer, msg)
        elif isinstance(msg, Abort):
            self._abort(msg, peer)
        elif isinstance(msg, Delivered):
            self._delivered(peer, msg)
        elif isinstance(msg, StageGrant):
            if self.writer.staged is None or msg.decode_rank != peer.rank:
                self._refuse(msg, "no staging here, or not this agent's rank")
            else:
                self.writer.staged.on_grant(peer, msg)
        elif isinstance(msg, Fenced):
            self._lost(
                msg.sender,
                FailureKind.FENCED,
                f"decode agent {msg.sender} fenced this rank: {msg.reason}",
            )
        else:
            self._refuse(msg, "not a message a prefill rank takes")

    def _refuse(self, msg: Message, why: str) -> None:
        self.refused += 1
        log.warning("%s: refused %s from %s: %s", self.b.agent, type(msg).__name__, msg.sender, why)

    def _setup_loop(self) -> None:
        while True:
            msg = self._hellos.get()
            if msg is None:
                return
            try:
                self._hello(msg)
            except Exception:  # a bug here must not stop later hellos
                log.exception("%s: hello from %s", self.b.agent, msg.sender)

    def _hello(self, msg: Hello) -> None:
        info = msg.info
        if info.agent != msg.sender:
            self._refuse(msg, f"it describes {info.agent}")
            return
        old = self._peers.get(info.agent)
        if old is not None and old.session != msg.session:
            # It came back (or re-linked): every request of the old session ends, here too.
            self._lost(
                info.agent,
                FailureKind.FENCED,
                f"decode agent {info.agent} opened a "
                f"new session; requests of session {old.session} end",
            )
        try:
            known = self._pairings.get(info.engine_id)
            if known is None or _side_key(known[0]) != _side_key(info):
                pairing = Pairing(self.b.side, side_from_info(info))
                self._pairings[info.engine_id] = (info, pairing)
            self.b.transport.add_peer(info.agent, info.transport_meta)
        except Exception as e:  # whatever went wrong, the decode rank must hear why, now
            log.warning("%s: refused hello from %s: %s", self.b.agent, info.agent, e)
            self.b.send_to(
                info.agent,
                info.control,
                HelloReply(sender=self.b.agent, session=msg.session, refused=str(e)),
            )
            return
        self.b.add_peer(info.agent, info.control)
        with self._lock:
            self._peers[info.agent] = _DecodePeer(
                info.agent,
                info.engine_id,
                info.engine_rank,
                msg.session,
                info.control,
                info.staging_slots,
                info.staging_slot_bytes,
            )
        self.b.send(
            info.agent, HelloReply(sender=self.b.agent, session=msg.session, info=self.b.info)
        )

    def _meta(self, peer: _DecodePeer, msg: RequestMeta) -> None:
        with self._lock:
            s = self.requests.get(msg.room)
            ended = self._ended.get(msg.room) if s is None else None
            if s is None and ended is None:
                parked = sum(len(v) for v in self._early.values())
                if parked < self.settings.max_parked:
                    self._early.setdefault(msg.room, []).append(msg)
                    self._early_at.setdefault(msg.room, time.monotonic())
                    return
        if s is not None:
            self._bind(s, msg)
            return
        if ended is None:
            why = TransferFailed(
                FailureKind.BAD_INPUT,
                f"prefill rank {self.rank} holds "
                f"{self.settings.max_parked} requests' metadata with no "
                f"sender yet (max_parked); refused",
            )
        elif ended[1] is None:
            return  # it succeeded, and this decode rank was owed nothing by this rank
        else:
            why = ended[1]
        self.b.send(
            peer.agent,
            Failure(
                sender=self.b.agent,
                session=peer.session,
                room=msg.room,
                rank=self.rank,
                kind=why.kind,
                reason=why.detail,
            ),
        )

    def _bind(self, s: Sender, msg: RequestMeta) -> None:
        peer = self._peers.get(msg.sender)
        if peer is None or peer.session != msg.session:  # kept from before its rank died
            self.fail(
                s,
                FailureKind.PEER_DEAD,
                f"decode agent {msg.sender} asked for this request and is gone",
            )
            return
        info, pairing = self._pairings[peer.engine]
        d = peer.rank
        with s._lock:
            s._peers[d] = peer
            late = s.status.state is KVPoll.FAILED
            if s._engine is None:
                s._engine, s._pairing = peer.engine, pairing
                s._needed = pairing.receivers_of(self.rank, s.tokens)
            elif s._engine != peer.engine:
                del s._peers[d]
                reason = f"room {s.room} is already served by decode engine {s._engine!r}"
                self.b.send(
                    msg.sender,
                    Failure(
                        sender=self.b.agent,
                        session=peer.session,
                        room=s.room,
                        rank=self.rank,
                        kind=FailureKind.BAD_INPUT,
                        reason=reason,
                    ),
                )
                return
        if late:  # failed before this decode rank spoke: tell it (after any drain)
            self._jobs.put(("notify", s, None))
            return
        try:
            placement = msg.placement()
            pairing.check_placement(placement, "decode", rank=d)
            if placement.tokens != s.tokens:
                raise PlacementError(
                    f"decode placement has {placement.tokens} tokens, the "
                    f"prefill request {s.tokens}"
                )
        except KVBridgeError as e:
            self.fail(s, FailureKind.BAD_INPUT, f"decode rank {d} sent a bad placement: {e}")
            return
        with s._lock:
            s._metas[d] = placement
            ready = all(r in s._metas for r in s._needed)
        if ready:
            s.status.advance(
                KVPoll.WAITING_FOR_INPUT, time.monotonic() + self.settings.waiting_timeout
            )
        self.pump(s)

    def _abort(self, msg: Abort, peer: _DecodePeer | None) -> None:
        """Fail the room, and acknowledge once nothing of it is in flight. The room must be
        the asking decode rank's (a foreign room is refused); an abort of a fenced session is
        answered too, since its decode rank waits for exactly that before reusing pages."""
        with self._lock:
            s = self.requests.get(msg.room)
        if s is not None:
            with s._lock:
                mine = s._peers.get(msg.decode_rank)
                foreign = bool(s._peers) and (
                    mine is None or mine.agent != msg.sender or mine.session != msg.session
                )
            if foreign:
                self._refuse(msg, f"room {msg.room} is not this agent's in session {msg.session}")
                return
            self.fail(s, FailureKind.ABORTED, f"aborted by decode rank {msg.decode_rank}")
        elif peer is not None:
            with self._lock:
                dropped = self._early.pop(msg.room, None)
                self._early_at.pop(msg.room, None)
                if dropped is not None or msg.room not in self._ended:
                    self._remember(
                        msg.room,
                        TransferFailed(
                            FailureKind.ABORTED,
                            f"aborted by decode rank {msg.decode_rank} "
                            f"before this rank had a sender",
                        ),
                    )
        endpoint = peer.endpoint if peer is not None else self.b.known_endpoint(msg.sender)
        log.debug(
            "%s: abort of room %d from %s: acknowledge at %s",
            self.b.agent,
            msg.room,
            msg.sender,
            endpoint,
        )
        if endpoint:
            # Queued behind every job already taken: when it runs, nothing of ours is in flight.
            self._jobs.put(("ack", None, (msg, endpoint)))

    def _delivered(self, peer: _DecodePeer, msg: Delivered) -> None:
        with self._lock:
            s = self.requests.get(msg.room)
        if s is None:
            return
        with s._lock:
            mine = s._peers.get(msg.decode_rank)
            if mine is None or mine.agent != peer.agent:
                mine = None
            else:
                s._delivered.add(msg.decode_rank)
        if mine is None:
            self._refuse(msg, f"room {msg.room} is not this agent's")
            return
        self.maybe_succeed(s)

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
            s.status.advance(KVPoll.TRANSFERRING, time.monotonic() + self.settings.transfer_timeout)
        self.maybe_succeed(s)

    def maybe_succeed(self, s: Sender) -> None:
        with s._lock:
            done = (
                bool(s._chunks)
                and s._chunks[-1].last
                and s._chunks[-1].completes
                and s._engine is not None
                and all(s._completed[d] == len(s._chunks) and d in s._delivered for d in s._needed)
            )
        if done and s.status.succeed():
            with self._lock:
                self.requests.pop(s.room, None)
                self._remember(s.room, None)

    def fail(self, s: Sender, kind: FailureKind, reason: str) -> None:
        if s.status.fail(kind, reason):
            log.info("%s: room %d failed: %s", self.b.agent, s.room, reason)
            self._jobs.put(("notify", s, None))

    def _remember(self, room: int, failure: TransferFailed | None) -> None:
        """Record an ended room (the caller holds ``_lock``); the oldest are forgotten."""
        self._ended[room] = (time.monotonic(), failure)
        self._ended.move_to_end(room)
        while len(self._ended) > _ENDED_MAX:
            self._ended.popitem(last=False)

    # ---- the worker ----------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            kind, s, arg = self._jobs.get()
            if kind == "stop":
                return
            try:
                if kind == "chunk" and s is not None:
                    d, index = cast(tuple[int, int], arg)
                    self.writer.transfer(s, d, index)
                elif kind == "notify" and s is not None:
                    self._notify(s)
                elif kind == "ack":
                    msg, endpoint = cast(tuple[Abort, str], arg)
                    self.b.send_to(
                        msg.sender,
                        endpoint,
                        AbortAck(
                            sender=self.b.agent,
                            session=msg.session,
                            room=msg.room,
                            prefill_rank=self.rank,
                        ),
                    )
            except Exception as e:  # a bug here must fail the request, never the rank
                log.exception("%s: worker error", self.b.agent)
                if s is not None:
                    self.fail(s, FailureKind.SENDER_ERROR, f"prefill rank {self.rank}: {e!r}")

    def _notify(self, s: Sender) -> None:
        """Tell every decode rank of a failed request why, once nothing of it is in flight."""
        failure = s.status.failure
        with s._lock:
            peers = list(s._peers.values())
        for peer in peers:
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
        with self._lock:
            self.requests.pop(s.room, None)
            self._remember(s.room, failure)

    # ---- liveness and deadlines ----------------------------------------------------------

    def on_peer_dead(self, agent: str) -> None:
        self._lost(agent, FailureKind.PEER_DEAD, f"decode agent {agent} stopped heart-beating")

    def _lost(self, agent: str, kind: FailureKind, reason: str) -> None:
        """A decode agent's session ended (dead, fenced us, or a new hello): its requests
        fail here and its memory is unmapped."""
        with self._lock:
            peer = self._peers.pop(agent, None)
            senders = list(self.requests.values())
        if peer is None:
            return
        self.b.drop_peer(agent)
        with contextlib.suppress(TransportError):  # already gone is what we want
            self.b.transport.remove_peer(agent)
        for s in senders:
            with s._lock:
                involved = any(p.agent == agent for p in s._peers.values())
            if involved:
                self.fail(s, kind, reason)

    def on_tick(self, now: float) -> None:
        with self._lock:
            senders = list(self.requests.values())
            for room in [
                r for r, t in self._early_at.items() if now - t > self.settings.waiting_timeout
            ]:
                del self._early[room], self._early_at[room]
            while (
                self._ended
                and now - next(iter(self._ended.values()))[0] > self.settings.waiting_timeout
            ):
                self._ended.popitem(last=False)
        for s in senders:
            if s.status.check_deadline(now, s.unsent()):
                self._jobs.put(("notify", s, None))


def _runs(layers: set[int]) -> list[range]:
    """Sorted layer indices as ranges of consecutive ones."""
    out: list[range] = []
    for li in sorted(layers):
        if out and out[-1].stop == li:
            out[-1] = range(out[-1].start, li + 1)
        else:
            out.append(range(li, li + 1))
    return out


def _side_key(info: RankInfo) -> tuple[object, ...]:
    return (info.fingerprint, info.parallel(), info.memory)
