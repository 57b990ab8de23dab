"""The prefill half's role: decode ranks' hellos and messages, scheduling, the worker.

Decode ranks send their placement of a request (``RequestMeta``) to every prefill rank; the
planner says which decode ranks this rank owes what (``Pairing.receivers_of``). Metadata that
comes before the engine made the room's sender is parked (:mod:`.parked`). Each (decode rank,
chunk) becomes a job (:mod:`.jobs`) for the one worker thread (:mod:`.worker`), which plans,
writes (directly or staged), waits until the writes ended (never past a write still in
flight) and only then reports the chunk (``ChunkDone``; see :mod:`.writer`). One synchronous
worker means that when it picks up an abort or a failure notice, no write of any request is in
flight: draining is free, and an acknowledgement is the truth.

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

from kvbridge.bootstrap import BootstrapClient
from kvbridge.bootstrap.groups import RoomAnnouncer
from kvbridge.errors import (
    FailureKind,
    KVBridgeError,
    PlacementError,
    TransferFailed,
    TransportError,
)
from kvbridge.planner.placement import Placement
from kvbridge.planner.plan import Pairing
from kvbridge.runtime.contracts import Rank
from kvbridge.runtime.metrics import ended, trace
from kvbridge.runtime.prefill.jobs import Ack, Notify, Stop, WriteChunk
from kvbridge.runtime.prefill.parked import Asked, Parked
from kvbridge.runtime.prefill.registration import Registration
from kvbridge.runtime.prefill.sender import DecodePeer, Sender, other_tokens
from kvbridge.runtime.prefill.worker import Worker, tell
from kvbridge.runtime.prefill.writer import ChunkWriter
from kvbridge.runtime.status import KVPoll, RequestStatus, each
from kvbridge.runtime.timeline import Phase
from kvbridge.transports.base import Fencing
from kvbridge.wire.protocol import (
    Abort,
    Delivered,
    Fenced,
    Hello,
    HelloReply,
    Message,
    RankInfo,
    RequestMeta,
    StageGrant,
    fingerprint_of,
    process_of,
    side_from_info,
)

__all__ = ["Asked", "PrefillRole"]  # Asked: re-exported

log = logging.getLogger("kvbridge.sender")


class PrefillRole:
    """The prefill half of one rank: its senders, the decode ranks it serves, its worker."""

    def __init__(self, bridge: Rank) -> None:
        self.b = bridge
        self.settings = bridge.settings
        self.rank = bridge.rank
        self.requests: dict[int, Sender] = {}
        self._parked = Parked()  # metadata before its sender; rooms that ended
        self._pairings: dict[str, tuple[RankInfo, Pairing]] = {}  # decode engine -> pairing
        self._peers: dict[str, DecodePeer] = {}  # live decode agents, current session
        self._lock = threading.Lock()
        self._hellos: queue.SimpleQueue[Hello | None] = queue.SimpleQueue()
        self._setup = threading.Thread(
            target=self._setup_loop, daemon=True, name=f"kvbridge-setup-{bridge.agent}"
        )
        self.writer = ChunkWriter(bridge, self)
        self.worker = Worker(bridge, self, self.writer)
        self.refused = 0  # link messages refused: stale session, foreign room, unknown peer
        client = (
            BootstrapClient(
                bridge.bootstrap,
                self.settings.token or None,
                timeout=self.settings.bootstrap_timeout,
            )
            if bridge.bootstrap
            else None
        )
        # A DP group's first rank tells the bootstrap service which rooms the group holds, as
        # they come and again after each registration (a restarted service lost them).
        self.announcer = (
            RoomAnnouncer(client, bridge.engine_id, self._unannounced, self._rooms)
            if client is not None and bridge.dp > 1 and bridge.rank == 0
            else None
        )
        again = self.announcer.again if self.announcer is not None else lambda: None
        self.registration = None if client is None else Registration(client, bridge.info, again)
        self._helpers = [h for h in (self.announcer, self.registration) if h is not None]

    # ---- life ----------------------------------------------------------------------------

    def start(self) -> None:
        self.worker.start()
        self._setup.start()
        for helper in self._helpers:
            helper.start()

    def close(self) -> None:
        """Fail every open request (its decode ranks are told), then let the worker drain."""
        with self._lock:
            senders = list(self.requests.values())
        for s in senders:
            self.fail(s, FailureKind.CLOSED, f"prefill rank {self.rank} was closed")
        self.worker.put(Stop())
        self._hellos.put(None)
        for helper in self._helpers:
            helper.close()
        self.worker.join(self.settings.abort_timeout)

    def closed(self) -> None:
        # The transport is closed: a write the worker still waited for has ended FAILED.
        self.worker.join(self.settings.abort_timeout)
        self._setup.join(self.settings.abort_timeout)

    def _rooms(self) -> list[int]:
        with self._lock:
            return list(self.requests)

    def active_rooms(self) -> int:
        with self._lock:
            return len(self.requests) + self._parked.rooms()

    def sender(self, room: int, placement: Placement, fingerprint: bytes = b"") -> Sender:
        self.b.faults.refresh()
        fingerprint = fingerprint_of(room, fingerprint)
        with self._lock:
            if room in self.requests:
                raise KVBridgeError(f"room {room} already has a sender on rank {self.rank}")
            s = self.requests[room] = Sender(
                self,
                room,
                placement,
                self.b.side.parallel.layers_of(self.rank),
                time.monotonic() + self.settings.waiting_timeout,
                self._ended_request,
                fingerprint,
            )
            early, failure = self._parked.claim(room)
        if failure is not None:  # aborted before the engine got here
            self.fail(s, failure.kind, failure.detail)
        trace(room, "send", role="prefill", rank=self.rank, tokens=placement.tokens)
        if self.announcer is not None:
            self.announcer.add(room)
        for meta in early:
            self._bind(s, meta)
        return s

    def asked(self, room: int) -> Asked | None:
        """What a decode engine asked of ``room`` before this rank made its sender (None:
        nothing yet). An engine that learns a request's length or the decode side's prefix
        hit from the decode side (SGLang's prefill does) reads them here first."""
        with self._lock:
            return self._parked.asked(room)

    def holds(self, room: int) -> bool:
        """Whether this rank has a sender for ``room`` now."""
        with self._lock:
            return room in self.requests

    def ended_with(self, room: int) -> bytes | None:
        """The fingerprint of the request whose ``room`` ended here (None: none did)."""
        with self._lock:
            ended = self._parked.ended(room)
        return None if ended is None else ended.fingerprint

    def _ended_request(self, status: RequestStatus) -> None:
        self.b.metrics.ended(status)
        ended(status, "prefill", self.rank)

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
            why = (
                "no live session"
                if peer is None
                else f"session {session}, the live one is {peer.session}"
            )
            self._refuse(msg, why)
            if isinstance(msg, RequestMeta) and peer is not None:
                # An ask on a session this rank ended fails now, not at its deadline.
                tell(self.b, peer.agent, msg.session, msg.room, FailureKind.FENCED, why)
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
                f"decode agent {info.agent} opened a new session; requests of session "
                f"{old.session} end",
            )
        try:
            known = self._pairings.get(info.engine_id)
            if known is None or _side_key(known[0]) != _side_key(info):
                pairing = Pairing(self.b.side, side_from_info(info))
                self._pairings[info.engine_id] = (info, pairing)
            # A write past its check that its request is live, held since, must not post into
            # a process that took the agent's name (its old one's requests failed above, so
            # the worker lets go soon); tcp's receiver refuses another session's writes itself.
            one_sided = self.b.transport.fencing is not Fencing.RECEIVER
            with self.worker.held() if one_sided else contextlib.nullcontext():
                self.b.transport.add_peer(info.agent, info.transport_meta)
        except Exception as e:  # whatever went wrong, the decode rank must hear why, now
            log.warning("%s: refused hello from %s: %s", self.b.agent, info.agent, e)
            self.b.send_to(
                info.agent,
                info.control,
                HelloReply(sender=self.b.agent, session=msg.session, refused=str(e)),
            )
            return
        self.b.add_peer(info.agent, info.control, process_of(info))
        with self._lock:
            self._peers[info.agent] = DecodePeer(
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

    def _meta(self, peer: DecodePeer, msg: RequestMeta) -> None:
        with self._lock:
            s = self.requests.get(msg.room)
            ended = self._parked.ended(msg.room) if s is None else None
            if s is None and ended is None and self._parked.park(msg, self.settings.max_parked):
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
        elif ended.other_tokens(msg.fingerprint):  # another request's room, ended here
            why = TransferFailed(FailureKind.BAD_INPUT, other_tokens(msg.room, self.rank, "held"))
        elif ended.failure is None:
            return  # it succeeded, and this decode rank was owed nothing by this rank
        else:
            why = ended.failure
        tell(self.b, peer.agent, peer.session, msg.room, why.kind, why.detail)

    def _bind(self, s: Sender, msg: RequestMeta) -> None:
        peer = self._peers.get(msg.sender)
        if peer is None or peer.session != msg.session:  # kept from before its rank died
            self.fail(
                s,
                FailureKind.PEER_DEAD,
                f"decode agent {msg.sender} asked for this request and is gone",
            )
            return
        _, pairing = self._pairings[peer.engine]
        d = peer.rank
        if s.fingerprint and msg.fingerprint and msg.fingerprint != s.fingerprint:
            # The decode's ask is for other tokens: its pages must never get this request's
            # KV. This room is taken here, so no sender of its own can come: it fails now
            # rather than at its deadline.
            refused: str | None = other_tokens(s.room, self.rank, "holds")
            s.refuse(peer)
        else:
            refused = s.attach(peer, pairing, self.rank)
        if refused is not None:
            tell(self.b, msg.sender, peer.session, s.room, FailureKind.BAD_INPUT, refused)
            return
        if s.status.state is KVPoll.FAILED:  # failed before this decode rank spoke: tell it
            self.worker.put(Notify(s))  # (after any drain)
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
        s.status.timeline.mark(Phase.TOLD)
        if s.place(d, placement):
            s.status.advance(
                KVPoll.WAITING_FOR_INPUT, time.monotonic() + self.settings.waiting_timeout
            )
        self.pump(s, asked=True)

    def _abort(self, msg: Abort, peer: DecodePeer | None) -> None:
        """Fail the room, and acknowledge once nothing of it is in flight. The room must be
        the asking decode rank's (a foreign room is refused); an abort of a fenced session is
        answered too, since its decode rank waits for exactly that before reusing pages."""
        with self._lock:
            s = self.requests.get(msg.room)
        if s is not None:
            if s.refused(msg.sender, msg.session):
                pass  # its ask was refused: nothing of this request goes to it (acknowledged)
            elif s.foreign(msg.decode_rank, msg.sender, msg.session):
                self._refuse(msg, f"room {msg.room} is not this agent's in session {msg.session}")
                return
            else:
                self.fail(s, FailureKind.ABORTED, f"aborted by decode rank {msg.decode_rank}")
        elif peer is not None:
            with self._lock:
                self._parked.abort(
                    msg.room,
                    TransferFailed(
                        FailureKind.ABORTED,
                        f"aborted by decode rank {msg.decode_rank} before this rank had a sender",
                    ),
                )
        endpoint = peer.endpoint if peer is not None else self.b.known_endpoint(msg.sender)
        log.debug(
            "%s: abort of room %d from %s: ack to %s", self.b.agent, msg.room, msg.sender, endpoint
        )
        if endpoint:
            # Queued behind every job already taken: when it runs, nothing of ours is in flight.
            self.worker.put(Ack(msg, endpoint))

    def _delivered(self, peer: DecodePeer, msg: Delivered) -> None:
        with self._lock:
            s = self.requests.get(msg.room)
        if s is None:
            return
        if not s.deliver(msg.decode_rank, peer.agent):
            self._refuse(msg, f"room {msg.room} is not this agent's")
            return
        self.maybe_succeed(s)

    # ---- scheduling ----------------------------------------------------------------------

    def check_open(self) -> None:
        self.b.check_open()

    def progress(self) -> bool:
        """Take what arrived, on the engine's polling thread (Sender.poll)."""
        return self.b.progress()

    def pump(self, s: Sender, *, asked: bool = False) -> None:
        """Post every (decode rank, chunk) ready and not queued yet on the calling thread
        where the worker is idle (a hand-off less), and queue the rest. ``asked``: by the
        thread that took the decode's ask, which never checksums a chunk (integrity mode)."""
        if s.status.state.terminal:
            return
        ready, started = s.ready()
        if started:
            s.status.advance(KVPoll.TRANSFERRING, time.monotonic() + self.settings.transfer_timeout)
        if self.b.transport.posts_at_once and not (asked and self.settings.integrity):
            ready = self.worker.post_now(s, ready)
        for d, index in ready:
            self.worker.put(WriteChunk(s, d, index))
        self.maybe_succeed(s)

    def maybe_succeed(self, s: Sender) -> None:
        if s.done() and s.status.succeed():
            with self._lock:
                self.requests.pop(s.room, None)
                self._parked.remember(s.room, None, s.fingerprint)

    def fail(self, request: Sender, kind: FailureKind, reason: str) -> None:
        if request.status.fail(kind, reason):
            log.info("%s: room %d failed: %s", self.b.agent, request.room, reason)
            self.worker.put(Notify(request))

    def notified(self, s: Sender, failure: TransferFailed | None) -> None:
        """Every decode rank of failed request ``s`` was told: the room ends here."""
        with self._lock:
            self.requests.pop(s.room, None)
            self._parked.remember(s.room, failure, s.fingerprint)
        s.drained()

    # ---- liveness and deadlines ----------------------------------------------------------

    def on_peer_dead(self, agent: str, why: str) -> None:
        self._lost(agent, FailureKind.PEER_DEAD, f"decode agent {agent} {why}")

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
            if s.involves(agent):
                self.fail(s, kind, reason)

    def on_tick(self, now: float) -> None:
        with self._lock:
            senders = list(self.requests.values())
            self._parked.expire(now, self.settings.waiting_timeout)
        each(senders, lambda s: self.expire(s, now))

    def expire(self, s: Sender, now: float) -> None:
        """Fail ``s`` past its deadline (each tick asks, and Sender.poll past the latest)."""
        if now >= s.status.deadline:
            late = "transfer" if s.status.state is KVPoll.TRANSFERRING else "waiting"
            hint = self.settings.hint(f"{late}_timeout")
            if s.status.check_deadline(now, "; ".join(filter(None, (s.unsent(), hint)))):
                self.worker.put(Notify(s))

    def on_paused(self, seconds: float) -> None:
        """This rank was paused ``seconds``: its requests' deadlines move back as much (within
        bounds: :meth:`RequestStatus.extend`)."""
        with self._lock:
            senders = list(self.requests.values())
            self._parked.postpone(seconds)  # parked metadata waits as long again
        for s in senders:
            s.status.extend(seconds)


def _side_key(info: RankInfo) -> tuple[object, ...]:
    return (info.fingerprint, info.parallel(), info.memory)
