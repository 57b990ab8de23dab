"""The decode side: receivers, over links to prefill engines (:mod:`kvbridge.link`).

A :class:`Receiver` sends its placement to every prefill rank and completes when the
:class:`~kvbridge.status.Completion` says every expected sender delivered every part; it then
confirms (``Delivered``) to its writers, whose senders succeed only on that.

Fencing. When a request fails for any reason its pages are not reusable until no write of it
can land (:attr:`Receiver.release`): every writer acknowledged the abort after draining, or is
proven gone (same host, its process no longer exists), or the transport fenced the request
(tcp, where this rank does the writing). Heartbeat silence proves nothing: a stalled writer
resumes. Until then the request is HELD, and QUARANTINED (with a reason) once the abort
deadline passed; the abort is repeated until answered. A prefill rank declared dead fences its
whole link: its session's messages no longer count (an abort's acknowledgement excepted) and
are answered with ``Fenced``, so that a stalled rank that resumes learns it and fails.

Staged chunks (:mod:`kvbridge.staging.receive`) land through this rank's own scatter, which it
does only for a live request; a request is released only once no scatter of it is in progress,
and its staging slots are free again only once it is released.
"""

from __future__ import annotations

import enum
import functools
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

from kvbridge.bootstrap import BootstrapClient
from kvbridge.errors import FailureKind, KVBridgeError, ProtocolError
from kvbridge.groups import RoomResolver
from kvbridge.integrity import verify
from kvbridge.link import LinkState, PrefillLink
from kvbridge.placement import Placement
from kvbridge.plan import PartKind
from kvbridge.protocol import (
    Abort,
    AbortAck,
    ChunkDone,
    Delivered,
    Failure,
    Fenced,
    HelloReply,
    Message,
    RequestMeta,
    StageAsk,
    Staged,
    process_of,
)
from kvbridge.staging.receive import StagingArea
from kvbridge.status import Completion, KVPoll, RequestStatus
from kvbridge.transports.base import Fencing

if TYPE_CHECKING:
    from kvbridge.engine import Bridge

log = logging.getLogger("kvbridge.receiver")


class Release(enum.Enum):
    """Whether a request's destination pages may be reused."""

    HELD = "held"  # live, or failed and a writer may still write
    RELEASED = "released"  # no byte of the request can land any more
    QUARANTINED = "quarantined"  # failed; past the abort deadline a writer may still write


class Receiver:
    """One request on one decode rank: :meth:`init` with the destination, then :meth:`poll`.
    ``link`` is None until the prefill engine holding the room is known."""

    def __init__(self, role: DecodeRole, room: int, address: str) -> None:
        self.room = room
        self.address = address
        self.link: PrefillLink | None = None
        now = time.monotonic()
        self.status = RequestStatus(room, now + role.b.settings.bootstrap_timeout)
        self.placement: Placement | None = None
        self.completion: Completion | None = None
        self.received_bytes = 0  # as the senders' chunk notices count them
        self._role = role
        self._lock = threading.Lock()
        self._started = False
        self._release = Release.HELD
        self._pending: set[str] = set()  # writers not yet acknowledged nor proven gone
        self._scattering = 0  # staged segments this rank is scattering into the pages now
        self._abort_deadline = 0.0
        self._next_abort = 0.0
        self.quarantine_reason = ""
        self._released = threading.Event()

    def init(self, placement: Placement) -> None:
        """Give the destination placement (pages, slots). Raises PlacementError at once if it
        does not fit this rank's pools."""
        self._role.b.check_open()
        pairing = self.link.pairing if self.link is not None else None
        if pairing is not None:
            pairing.check_placement(placement, "decode", rank=self._role.rank)
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
    def linked(self) -> PrefillLink:
        """The link of a request that has one (every request that sent its metadata does)."""
        if self.link is None:
            raise KVBridgeError(f"room {self.room}: not linked to a prefill engine yet")
        return self.link

    @property
    def release(self) -> Release:
        return self._release

    @property
    def released(self) -> bool:
        """True when no prefill write for this request can still land: the pages may be
        reused (after success, or after a failure once every writer is fenced)."""
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
        self._links: dict[tuple[str, str], PrefillLink] = {}  # (address, engine) -> link
        self._resolvers: dict[str, RoomResolver] = {}  # address -> where its rooms are
        self._sessions: dict[int, PrefillLink] = {}  # every link that may still speak
        self._requests: dict[tuple[str, int], Receiver] = {}
        self._lock = threading.Lock()
        self._fences: queue.SimpleQueue[Receiver | None] = queue.SimpleQueue()
        self._fencer = threading.Thread(
            target=self._fence_loop, daemon=True, name=f"kvbridge-fence-{bridge.agent}"
        )
        self._told: dict[str, float] = {}  # agent -> when it was last told it is fenced
        self.refused = 0
        self.staging = StagingArea(self, bridge.staging) if bridge.staging else None

    def start(self) -> None:
        self._fencer.start()
        if self.staging is not None:
            self.staging.start()

    def close(self) -> None:
        """Fail every open request (``closed``) and wait, within the abort deadline, for its
        writers to be fenced."""
        with self._lock:
            receivers = list(self._requests.values())
        for r in receivers:
            self.fail(r, FailureKind.CLOSED, f"decode rank {self.rank} was closed")
        end = time.monotonic() + self.settings.abort_timeout
        for r in receivers:
            r.wait_released(max(0.0, end - time.monotonic()))

    def closed(self) -> None:
        """The transport is closed. One that fences (tcp) writes nothing any more; with a
        one-sided transport, requests whose writers never answered stay quarantined."""
        self._fences.put(None)
        for resolver in list(self._resolvers.values()):
            resolver.close()
        if self.staging is not None:
            self.staging.stop()
        if self.b.transport.fencing is Fencing.RECEIVER:
            with self._lock:
                receivers = list(self._requests.values())
            for r in receivers:
                with r._lock:
                    r._pending.clear()
                self.maybe_release(r)

    def active_rooms(self) -> int:
        with self._lock:
            return len(self._requests)

    # ---- links ---------------------------------------------------------------------------

    def receiver(self, room: int, address: str | None, engine: str | None = None) -> Receiver:
        """A receiver of ``room`` from the prefill deployment at ``address``: from prefill
        engine ``engine`` (its DP group), or from whichever the bootstrap service says holds
        the room."""
        if not address:
            raise KVBridgeError("a receiver needs the prefill engine's bootstrap address")
        with self._lock:
            if (address, room) in self._requests:
                raise KVBridgeError(f"room {room} from {address} already has a receiver")
            r = self._requests[(address, room)] = Receiver(self, room, address)
            if engine is None:
                resolver = self._resolvers.get(address)
                if resolver is None:
                    resolver = self._resolvers[address] = RoomResolver(
                        BootstrapClient(
                            address,
                            self.settings.token or None,
                            timeout=self.settings.bootstrap_timeout,
                        ),
                        functools.partial(self._resolved, address),
                    )
                    resolver.start()
                engine = resolver.resolve(room)
        if engine is not None:
            self._attach(r, engine)
        return r

    def _resolved(self, address: str, room: int, engine: str) -> None:
        with self._lock:
            r = self._requests.get((address, room))
        if r is not None:
            self._attach(r, engine)

    def _attach(self, r: Receiver, engine: str) -> None:
        """The room lives in prefill engine ``engine``: link to it (or use the link there is)."""
        with self._lock:
            if r.link is not None or r.status.state.terminal:
                return
            link = self._links.get((r.address, engine))
            if link is None or link.state is LinkState.FAILED:
                link = self._links[(r.address, engine)] = PrefillLink(self, r.address, engine)
                self._sessions[link.session] = link
                link.start()
            r.link = link
        if link.state is LinkState.READY:
            r.status.advance(
                KVPoll.WAITING_FOR_INPUT, time.monotonic() + self.settings.waiting_timeout
            )
            self.start_request(r)
        elif link.state is LinkState.FAILED and link.failure:  # failed between the two locks
            self.fail(r, *link.failure)

    def link_ready(self, link: PrefillLink) -> None:
        for r in self._of(link):
            r.status.advance(
                KVPoll.WAITING_FOR_INPUT, time.monotonic() + self.settings.waiting_timeout
            )
            self.start_request(r)

    def link_failed(self, link: PrefillLink, kind: FailureKind, reason: str) -> None:
        if link.state is LinkState.FAILED:
            return
        link.state, link.failure = LinkState.FAILED, (kind, reason)
        log.warning(
            "%s: link to %s at %s failed: %s", self.b.agent, link.engine, link.address, reason
        )
        resolver = self._resolvers.get(link.address)
        if resolver is not None and resolver.single == link.engine:
            resolver.single = None  # it may come back as something else: ask again
        for r in self._of(link):
            self.fail(r, kind, reason)

    def _of(self, link: PrefillLink) -> list[Receiver]:
        with self._lock:
            return [r for r in self._requests.values() if r.link is link]

    # ---- requests ------------------------------------------------------------------------

    def start_request(self, r: Receiver) -> None:
        """Once both the link is ready and the placement known: send the metadata."""
        link = r.link
        pairing = link.pairing if link is not None else None
        with r._lock:
            if (
                r._started
                or r.placement is None
                or link is None
                or pairing is None
                or link.state is not LinkState.READY
                or r.status.state.terminal
            ):
                return
            r._started = True
            placement = r.placement
        try:
            pairing.check_placement(placement, "decode", rank=self.rank)
        except KVBridgeError as e:
            self.fail(r, FailureKind.BAD_INPUT, str(e))
            return
        senders = pairing.senders_of(self.rank, placement.tokens)
        r.completion = Completion(
            placement.tokens,
            senders,
            {p: pairing.stage_layers(p) for p in senders},
            start=placement.start,
        )
        pages = {g: ids.tolist() for g, ids in placement.pages.items()}
        if self.b.faults.bad_pages:
            g = next(iter(pages))
            pages[g][-1] = 1 << 40
        # Writes of this request may land from now on, and only those of this link's session.
        self.b.transport.admit((link.session, r.room))
        r.status.advance(KVPoll.TRANSFERRING, time.monotonic() + self.settings.transfer_timeout)
        for agent in link.agents:
            if self.b.faults.malformed:
                self.b.channel.send_raw(
                    agent, link.infos[link.ranks[agent]].control, b"\x81\xa4type\xa7unknown"
                )
            self.b.send(
                agent,
                RequestMeta(
                    sender=self.b.agent,
                    session=link.session,
                    room=r.room,
                    decode_rank=self.rank,
                    tokens=placement.tokens,
                    pages=pages,
                    slots=dict(placement.slots),
                    start=placement.start,
                ),
            )

    def fail(self, r: Receiver, kind: FailureKind, reason: str) -> None:
        """Fail, then fence every prefill rank that may still write into the pages."""
        if not r.status.fail(kind, reason):
            return
        resolver = self._resolvers.get(r.address)
        if resolver is not None:
            resolver.discard(r.room)
        if self.staging is not None:
            self.staging.ended(r)
        with r._lock:
            started = r._started
            if started and r.completion is not None:
                infos, ranks = r.linked.infos, r.linked.ranks
                r._pending = {infos[p].agent for p in r.completion.expected}
                r._pending = {
                    a for a in r._pending if not process_of(infos[ranks[a]]).proven_gone()
                }
            now = time.monotonic()
            r._abort_deadline = now + self.settings.abort_timeout
            r._next_abort = now + self.settings.heartbeat_interval
        if started:
            self._abort(r, r.linked.agents)  # non-writers hold the request too: they end it
            if r._pending and self.b.transport.fencing is Fencing.RECEIVER:
                self._fences.put(r)
        self.maybe_release(r)

    def _abort(self, r: Receiver, agents: list[str] | set[str]) -> None:
        link = r.linked
        for agent in agents:
            info = link.infos[link.ranks[agent]]
            self.b.send_to(
                agent,
                info.control,
                Abort(
                    sender=self.b.agent, session=link.session, room=r.room, decode_rank=self.rank
                ),
            )

    def _fence_loop(self) -> None:
        """The transport fences requests here, off the control thread: cutting off a write
        in progress may take a moment."""
        while True:
            r = self._fences.get()
            if r is None:
                return
            if self.b.transport.fence((r.linked.session, r.room), self.settings.abort_timeout):
                with r._lock:
                    r._pending.clear()
                self.maybe_release(r)

    def maybe_release(self, r: Receiver) -> None:
        with r._lock:
            state = r.status.state
            if state is KVPoll.SUCCESS or (
                state is KVPoll.FAILED and not r._pending and not r._scattering
            ):
                r._release = Release.RELEASED
            elif (
                state is KVPoll.FAILED
                and time.monotonic() > r._abort_deadline
                and r._release is Release.HELD
            ):
                r._release = Release.QUARANTINED
                r.quarantine_reason = (
                    f"room {r.room}: prefill agents {sorted(r._pending)} neither acknowledged "
                    f"the abort within {self.settings.abort_timeout} s nor can be proven gone; "
                    f"its pages stay quarantined until they do"
                )
                log.warning("%s: %s", self.b.agent, r.quarantine_reason)
            released = r._release is Release.RELEASED
        if released and not r._released.is_set():
            if self.staging is not None:  # before anyone may reuse what it freed
                self.staging.released(r)
            r._released.set()
            with self._lock:
                self._requests.pop((r.address, r.room), None)

    # ---- messages ------------------------------------------------------------------------

    def on_message(self, msg: Message) -> None:
        link = self._sessions.get(getattr(msg, "session", -1))
        rank = link.ranks.get(msg.sender) if link is not None else None
        if link is None or rank is None:
            self._refuse(msg, "no link of this agent has that session")
            return
        if link.state is LinkState.FAILED and not isinstance(msg, AbortAck):
            self._tell_fenced(link, msg.sender)
            self._refuse(msg, f"its link to {link.address} is fenced")
            return
        if isinstance(msg, HelloReply):
            link.on_reply(rank, msg)
            return
        room = getattr(msg, "room", None)
        with self._lock:
            r = self._requests.get((link.address, room)) if room is not None else None
        if r is not None and r.link is not link:
            r = None
        if isinstance(msg, StageAsk):
            if self.staging is None:
                self._refuse(msg, "this rank has no staging region")
            else:
                self.staging.ask(r, link.session, rank, msg)
            return
        if r is None:
            log.debug("%s: %s for unknown room %s", self.b.agent, type(msg).__name__, room)
            return
        if isinstance(msg, ChunkDone):
            if self.staging is not None:  # after the staged segments that came before it
                self.staging.later(functools.partial(self._chunk_done, r, rank, msg))
            else:
                self._chunk_done(r, rank, msg)
        elif isinstance(msg, Staged):
            if self.staging is None:
                self._refuse(msg, "this rank has no staging region")
            else:
                self.staging.staged(r, rank, msg)
        elif isinstance(msg, Failure):
            # A prefill rank reports a failure only once nothing of the room is in flight
            # from it, and never writes it again: as good as an acknowledgement.
            self.fail(r, msg.kind, f"prefill rank {msg.rank}: {msg.reason}")
            with r._lock:
                r._pending.discard(msg.sender)
            self.maybe_release(r)
        elif isinstance(msg, AbortAck):
            with r._lock:
                r._pending.discard(msg.sender)
            self.maybe_release(r)
        else:
            self._refuse(msg, "not a message a decode rank takes")

    def _refuse(self, msg: Message, why: str) -> None:
        self.refused += 1
        log.warning("%s: refused %s from %s: %s", self.b.agent, type(msg).__name__, msg.sender, why)

    def _tell_fenced(self, link: PrefillLink, agent: str) -> None:
        """Tell a fenced agent so, at most once per heartbeat interval."""
        now = time.monotonic()
        if now - self._told.get(agent, 0.0) < self.settings.heartbeat_interval:
            return
        self._told[agent] = now
        info = link.infos[link.ranks[agent]]
        reason = link.failure[1] if link.failure else "link failed"
        self.b.send_to(
            agent, info.control, Fenced(sender=self.b.agent, session=link.session, reason=reason)
        )

    def _chunk_done(self, r: Receiver, rank: int, msg: ChunkDone) -> None:
        completion, placement, pairing = r.completion, r.placement, r.linked.pairing
        if completion is None or placement is None or pairing is None:
            log.warning(
                "%s: chunk notice for room %d before its metadata; ignored", self.b.agent, r.room
            )
            return
        if msg.prefill_rank != rank:
            self._refuse(msg, f"it claims prefill rank {msg.prefill_rank}, its rank is {rank}")
            return
        if msg.staged:
            why = (
                self.staging.unscattered(r, rank, msg)
                if self.staging is not None
                else "this rank has no staging region"
            )
            if why is not None:
                self.fail(r, FailureKind.RECEIVER_ERROR, why)
                return
        try:
            parts = [PartKind(p) for p in msg.parts]
            if self.settings.integrity:
                last = PartKind.AUX in parts or PartKind.STATE in parts
                bad = verify(
                    pairing,
                    placement,
                    msg.start,
                    msg.stop,
                    last,
                    rank,
                    self.rank,
                    self.b.views,
                    msg.checksums,
                    msg.layer_range(),
                    PartKind.AUX in parts,
                )
                if bad:
                    self.fail(r, FailureKind.INTEGRITY, bad)
                    return
            completion.record(rank, msg.start, msg.stop, parts, msg.layer_range())
        except (ValueError, ProtocolError) as e:
            self._refuse(msg, f"bad chunk notice: {e}")
            return
        r.received_bytes += max(0, msg.nbytes)
        if completion.done and r.status.succeed():
            self._succeeded(r, completion)

    def _succeeded(self, r: Receiver, completion: Completion) -> None:
        # Every writer reported after its writes ended: nothing is in flight. Close the
        # admission, and let the writers' senders succeed.
        link = r.linked
        self.b.transport.fence((link.session, r.room), 0.0)
        for p in completion.expected:
            self.b.send(
                link.infos[p].agent,
                Delivered(
                    sender=self.b.agent, session=link.session, room=r.room, decode_rank=self.rank
                ),
            )
        self.maybe_release(r)

    # ---- liveness and deadlines ----------------------------------------------------------

    def on_peer_dead(self, agent: str) -> None:
        with self._lock:
            links = [
                ln
                for ln in self._sessions.values()
                if agent in ln.ranks and ln.state is not LinkState.FAILED
            ]
        for link in links:
            self.link_failed(
                link,
                FailureKind.PEER_DEAD,
                f"prefill rank {link.ranks[agent]} ({agent}) stopped heart-beating",
            )

    def on_tick(self, now: float) -> None:
        with self._lock:
            receivers = list(self._requests.values())
            live = {r.link.session for r in receivers if r.link is not None} | {
                ln.session for ln in self._links.values()
            }
            for session in [s for s in self._sessions if s not in live]:
                del self._sessions[session]  # nothing of it can matter any more
        for r in receivers:
            if r.status.state.terminal:
                if now >= r._next_abort:
                    self._fence_pending(r, now)
                self.maybe_release(r)
            elif now >= r.status.deadline and r.status.state is KVPoll.BOOTSTRAPPING:
                self.fail(r, FailureKind.BOOTSTRAP, self._unlinked(r))
            elif now >= r.status.deadline:
                owed = ""
                if r.completion is not None:
                    owed = "; still owed: " + "; ".join(
                        f"prefill rank {p}: {w}" for p, w in sorted(r.completion.missing().items())
                    )
                self.fail(
                    r,
                    FailureKind.DEADLINE,
                    f"room {r.room}: deadline passed while {r.status.state.name}{owed}",
                )

    def _unlinked(self, r: Receiver) -> str:
        """Why a request still bootstraps at its deadline."""
        what = f"room {r.room}: bootstrap deadline passed"
        if r.link is not None:
            return f"{what} while linking to prefill engine {r.link.engine} at {r.address}"
        resolver = self._resolvers.get(r.address)
        error = resolver.last_error if resolver is not None else ""
        return f"{what}: no prefill engine at {r.address} announced the room" + (
            f"; last lookup: {error}" if error else ""
        )

    def _fence_pending(self, r: Receiver, now: float) -> None:
        """Once per heartbeat interval: writers proven gone are fenced; the others are asked
        again (an abort may have been lost to a stall)."""
        with r._lock:
            r._next_abort = now + self.settings.heartbeat_interval
            if not r._pending:
                return
            infos, ranks = r.linked.infos, r.linked.ranks
            r._pending = {a for a in r._pending if not process_of(infos[ranks[a]]).proven_gone()}
            pending = set(r._pending)
        if pending:
            log.debug("%s: room %d: abort again to %s", self.b.agent, r.room, sorted(pending))
            self._abort(r, pending)
