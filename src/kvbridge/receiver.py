"""The decode side: links to prefill engines, and receivers.

A :class:`PrefillLink` connects this decode rank to one prefill engine: it looks the prefill
ranks up in the bootstrap service, has the service check that the two sides fit (refused with
what differs, before any request), builds the :class:`~kvbridge.plan.Pairing`, and says hello
to every prefill rank. From the pairing it knows which prefill ranks owe this rank what.

A :class:`Receiver` sends its placement to every prefill rank and completes when the
:class:`~kvbridge.status.Completion` says every expected sender delivered every part. When it
fails for any reason it aborts on every prefill rank, and its pages are reusable
(:attr:`Receiver.released`) only once they all acknowledged the abort (they drained their
writes) or the abort deadline passed.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from typing import TYPE_CHECKING

from kvbridge.bootstrap import BootstrapClient
from kvbridge.errors import FailureKind, IncompatibleError, KVBridgeError, ProtocolError
from kvbridge.integrity import verify
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
from kvbridge.status import Completion, KVPoll, RequestStatus

if TYPE_CHECKING:
    from kvbridge.engine import Bridge

log = logging.getLogger("kvbridge.receiver")


class LinkState(enum.Enum):
    CONNECTING = "connecting"
    READY = "ready"
    FAILED = "failed"


class PrefillLink:
    def __init__(self, role: DecodeRole, address: str) -> None:
        self.role = role
        self.address = address
        self.state = LinkState.CONNECTING
        self.failure: tuple[FailureKind, str] | None = None
        self.infos: dict[int, RankInfo] = {}
        self.pairing: Pairing | None = None
        self._replies: set[int] = set()
        self._thread = threading.Thread(target=self._connect, daemon=True,
                                        name=f"kvbridge-link-{address}")

    def start(self) -> None:
        self._thread.start()

    @property
    def agents(self) -> list[str]:
        return [i.agent for i in self.infos.values()]

    def _connect(self) -> None:
        b = self.role.b
        settings = b.settings
        try:
            client = BootstrapClient(self.address, settings.token or None,
                                     timeout=settings.bootstrap_timeout)
            deadline = time.monotonic() + settings.bootstrap_timeout
            infos = client.prefill_ranks(wait_for_world=True, deadline=deadline)
            client.register_decode(b.info, engine=infos[0].engine_id)
            self.pairing = Pairing(side_from_info(infos[0]), b.side)
        except IncompatibleError as e:
            self.role.link_failed(self, FailureKind.INCOMPATIBLE, str(e))
            return
        except (KVBridgeError, OSError) as e:
            self.role.link_failed(self, FailureKind.BOOTSTRAP, f"{self.address}: {e}")
            return
        self.infos = {i.engine_rank: i for i in infos}
        for info in infos:
            self.role.adopt(info.agent, self, info.engine_rank)
            b.add_peer(info.agent, info.control)
            b.send(info.agent, Hello(sender=b.agent, token=settings.token, info=b.info))

    def on_reply(self, rank: int, msg: HelloReply) -> None:
        if msg.refused:
            self.role.link_failed(self, FailureKind.INCOMPATIBLE,
                                  f"prefill rank {rank} refused: {msg.refused}")
            return
        self._replies.add(rank)
        if self.state is LinkState.CONNECTING and len(self._replies) == len(self.infos):
            self.state = LinkState.READY
            self.role.link_ready(self)


class Receiver:
    """One request on one decode rank: :meth:`init` with the destination, then :meth:`poll`."""

    def __init__(self, role: DecodeRole, room: int, link: PrefillLink) -> None:
        self.room = room
        self.link = link
        now = time.monotonic()
        self.status = RequestStatus(room, now + role.b.settings.bootstrap_timeout)
        self.placement: Placement | None = None
        self.completion: Completion | None = None
        self._role = role
        self._lock = threading.Lock()
        self._started = False
        self._acks: set[str] = set()
        self._abort_deadline = 0.0
        self._released = threading.Event()

    def init(self, placement: Placement) -> None:
        """Give the destination placement (pages, slots). Raises PlacementError at once if it
        does not fit this rank's pools."""
        pairing = self.link.pairing
        if pairing is not None:
            pairing.check_placement(placement, "decode")
        with self._lock:
            if self.placement is not None:
                raise KVBridgeError(f"room {self.room}: init was already called")
            self.placement = placement
        self._role.start_request(self)

    def poll(self) -> KVPoll:
        return self.status.state

    @property
    def failure(self) -> KVBridgeError | None:
        return self.status.failure

    def wait(self, timeout: float) -> KVPoll:
        return self.status.wait(timeout)

    @property
    def released(self) -> bool:
        """True when no prefill write for this request can still land: the pages may be
        reused (after success, or after a failure once every sender drained)."""
        return self._released.is_set()

    def wait_released(self, timeout: float) -> bool:
        return self._released.wait(timeout)

    def abort(self, reason: str = "aborted by the decode engine") -> None:
        self._role.fail(self, FailureKind.ABORTED, reason)


class DecodeRole:
    def __init__(self, bridge: Bridge) -> None:
        self.b = bridge
        self.settings = bridge.settings
        self.rank = bridge.rank
        self._links: dict[str, PrefillLink] = {}
        self._agents: dict[str, tuple[PrefillLink, int]] = {}
        self._requests: dict[tuple[str, int], Receiver] = {}
        self._lock = threading.Lock()

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def active_rooms(self) -> int:
        with self._lock:
            return len(self._requests)

    # ---- links ---------------------------------------------------------------------------

    def receiver(self, room: int, address: str | None) -> Receiver:
        if not address:
            raise KVBridgeError("a receiver needs the prefill engine's bootstrap address")
        with self._lock:
            link = self._links.get(address)
            if link is None or link.state is LinkState.FAILED:
                link = self._links[address] = PrefillLink(self, address)
                link.start()
            if (address, room) in self._requests:
                raise KVBridgeError(f"room {room} from {address} already has a receiver")
            r = self._requests[(address, room)] = Receiver(self, room, link)
        if link.state is LinkState.READY:
            r.status.advance(KVPoll.WAITING_FOR_INPUT,
                             time.monotonic() + self.settings.waiting_timeout)
        elif link.state is LinkState.FAILED and link.failure:  # failed between the two locks
            self.fail(r, *link.failure)
        return r

    def adopt(self, agent: str, link: PrefillLink, rank: int) -> None:
        with self._lock:
            self._agents[agent] = (link, rank)

    def link_ready(self, link: PrefillLink) -> None:
        for r in self._of(link):
            r.status.advance(KVPoll.WAITING_FOR_INPUT,
                             time.monotonic() + self.settings.waiting_timeout)
            self.start_request(r)

    def link_failed(self, link: PrefillLink, kind: FailureKind, reason: str) -> None:
        if link.state is LinkState.FAILED:
            return
        link.state, link.failure = LinkState.FAILED, (kind, reason)
        log.warning("%s: link to %s failed: %s", self.b.agent, link.address, reason)
        for r in self._of(link):
            self.fail(r, kind, reason)

    def _of(self, link: PrefillLink) -> list[Receiver]:
        with self._lock:
            return [r for r in self._requests.values() if r.link is link]

    # ---- requests ------------------------------------------------------------------------

    def start_request(self, r: Receiver) -> None:
        """Once both the link is ready and the placement known: send the metadata."""
        link, pairing = r.link, r.link.pairing
        with r._lock:
            if r._started or r.placement is None or link.state is not LinkState.READY \
                    or pairing is None or r.status.state.terminal:
                return
            r._started = True
            placement = r.placement
        try:
            pairing.check_placement(placement, "decode")
        except KVBridgeError as e:
            self.fail(r, FailureKind.BAD_INPUT, str(e))
            return
        r.completion = Completion(placement.tokens, pairing.senders_of(self.rank))
        pages = {g: ids.tolist() for g, ids in placement.pages.items()}
        if self.b.faults.bad_pages:
            g = next(iter(pages))
            pages[g][-1] = 1 << 40
        r.status.advance(KVPoll.TRANSFERRING, time.monotonic() + self.settings.transfer_timeout)
        for agent in link.agents:
            if self.b.faults.malformed:
                self.b.channel.send_raw(agent, link.infos[self._agents[agent][1]].control,
                                        b"\x81\xa4type\xa7unknown")
            self.b.send(agent, RequestMeta(sender=self.b.agent, token=self.settings.token,
                                           room=r.room, decode_rank=self.rank,
                                           tokens=placement.tokens, pages=pages,
                                           slots=dict(placement.slots)))

    def fail(self, r: Receiver, kind: FailureKind, reason: str) -> None:
        """Fail, then abort on every prefill rank that may still write into the pages."""
        if not r.status.fail(kind, reason):
            return
        with r._lock:
            started = r._started
        alive = self.b.live_peers() & set(r.link.agents) if started else set()
        with r._lock:
            r._acks = alive
            r._abort_deadline = time.monotonic() + self.settings.abort_timeout
        for agent in alive:
            self.b.send(agent, Abort(sender=self.b.agent, token=self.settings.token,
                                     room=r.room, decode_rank=self.rank))
        self._maybe_release(r)

    def _maybe_release(self, r: Receiver) -> None:
        with r._lock:
            done = r.status.state is KVPoll.SUCCESS or (
                r.status.state is KVPoll.FAILED
                and (not r._acks or time.monotonic() > r._abort_deadline))
        if done:
            r._released.set()
            with self._lock:
                self._requests.pop((r.link.address, r.room), None)

    # ---- messages ------------------------------------------------------------------------

    def on_message(self, msg: Message) -> None:
        found = self._agents.get(msg.sender)
        if found is None:
            log.warning("%s: %s from unknown agent %s; refused", self.b.agent,
                        type(msg).__name__, msg.sender)
            return
        link, rank = found
        if isinstance(msg, HelloReply):
            link.on_reply(rank, msg)
            return
        room = getattr(msg, "room", None)
        with self._lock:
            r = self._requests.get((link.address, room)) if room is not None else None
        if r is None:
            log.debug("%s: %s for unknown room %s", self.b.agent, type(msg).__name__, room)
            return
        if isinstance(msg, ChunkDone):
            self._chunk_done(r, rank, msg)
        elif isinstance(msg, Failure):
            self.fail(r, msg.kind, f"prefill rank {msg.rank}: {msg.reason}")
        elif isinstance(msg, AbortAck):
            with r._lock:
                r._acks.discard(msg.sender)
            self._maybe_release(r)

    def _chunk_done(self, r: Receiver, rank: int, msg: ChunkDone) -> None:
        completion, placement, pairing = r.completion, r.placement, r.link.pairing
        if completion is None or placement is None or pairing is None:
            log.warning("%s: chunk notice for room %d before its metadata; ignored",
                        self.b.agent, r.room)
            return
        if msg.prefill_rank != rank:
            log.warning("%s: %s claims prefill rank %d; refused", self.b.agent, msg.sender,
                        msg.prefill_rank)
            return
        try:
            parts = [PartKind(p) for p in msg.parts]
            if self.settings.integrity:
                last = PartKind.AUX in parts or PartKind.STATE in parts
                bad = verify(pairing, placement, msg.start, msg.stop, last, rank, self.rank,
                             self.b.views, msg.checksums)
                if bad:
                    self.fail(r, FailureKind.INTEGRITY, bad)
                    return
            completion.record(rank, msg.start, msg.stop, parts)
        except (ValueError, ProtocolError) as e:
            log.warning("%s: bad chunk notice from %s: %s", self.b.agent, msg.sender, e)
            return
        if completion.done and r.status.succeed():
            self._maybe_release(r)

    # ---- liveness and deadlines ----------------------------------------------------------

    def on_peer_dead(self, agent: str) -> None:
        found = self._agents.get(agent)
        if found is None:
            return
        link, rank = found
        reason = f"prefill rank {rank} ({agent}) stopped heart-beating"
        for r in self._of(link):
            with r._lock:
                r._acks.discard(agent)
            self.fail(r, FailureKind.PEER_DEAD, reason)
            self._maybe_release(r)
        self.link_failed(link, FailureKind.PEER_DEAD, reason)

    def on_tick(self, now: float) -> None:
        with self._lock:
            receivers = list(self._requests.values())
        for r in receivers:
            if r.status.state.terminal:
                self._maybe_release(r)  # its abort deadline may have passed
            elif now >= r.status.deadline:
                owed = ""
                if r.completion is not None:
                    owed = "; still owed: " + "; ".join(
                        f"prefill rank {p}: {w}" for p, w in sorted(r.completion.missing().items()))
                self.fail(r, FailureKind.DEADLINE, f"room {r.room}: deadline passed while "
                          f"{r.status.state.name}{owed}")
