"""The decode half's role: receivers, their links to prefill engines, messages, fencing.

A :class:`~.receiver.Receiver` sends its placement to every prefill rank of its link
(:mod:`.link`) and completes when the :class:`~kvbridge.runtime.status.Completion` says every
expected sender delivered every part (the chunk notices: :mod:`.notices`); it then confirms
(``Delivered``) to its writers, whose senders succeed only on that.

A failed request is fenced (see :mod:`.receiver`): its writers are told to abort, the abort is
repeated until answered, and its pages are released only once no write of it can land. A
prefill rank declared dead fences its whole link: its session's messages no longer count (an
abort's acknowledgement excepted) and are answered with ``Fenced``, so that a stalled rank
that resumes learns it and fails.

Staged chunks (:mod:`.landing`) land through this rank's own scatter, which it does only for a
live request; a request is released only once no scatter of it is in progress, and its
staging slots are free again only once it is released.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time

from kvbridge.bootstrap import BootstrapClient
from kvbridge.bootstrap.groups import RoomResolver
from kvbridge.errors import FailureKind, KVBridgeError
from kvbridge.planner.placement import Placement
from kvbridge.planner.plan import Pairing
from kvbridge.runtime.contracts import Rank
from kvbridge.runtime.decode.landing import StagingArea
from kvbridge.runtime.decode.link import LinkState, PrefillLink
from kvbridge.runtime.decode.notices import ChunkNotices
from kvbridge.runtime.decode.receiver import Receiver, Release
from kvbridge.runtime.metrics import ended, trace
from kvbridge.runtime.status import Completion, KVPoll, RequestStatus, each
from kvbridge.runtime.timeline import Phase
from kvbridge.transports.base import Fencing
from kvbridge.wire.protocol import (
    Abort,
    AbortAck,
    ChunkDone,
    Failure,
    Fenced,
    HelloReply,
    Message,
    RequestMeta,
    StageAsk,
    Staged,
)

log = logging.getLogger("kvbridge.receiver")


class DecodeRole:
    """The decode half of one rank: its receivers, its links, fencing and release."""

    def __init__(self, bridge: Rank) -> None:
        self.b = bridge
        self.settings = bridge.settings
        self.rank = bridge.rank
        # engine -> its link: one (two links to one engine's agents would each fence the
        # other's session there), made through the first request's bootstrap address.
        self._links: dict[str, PrefillLink] = {}
        self._linked: dict[tuple[int, int], Receiver] = {}  # (session, room): as its link knows it
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
        self.staging = StagingArea(self, bridge, bridge.staging) if bridge.staging else None
        self.notices = ChunkNotices(bridge, self, self.staging)

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
                r.acknowledged()
                self.maybe_release(r)

    def sessions(self) -> list[int]:
        with self._lock:
            return [ln.session for ln in self._links.values()]

    def receivers(self) -> list[Receiver]:
        with self._lock:
            return list(self._requests.values())

    def progress(self) -> bool:
        """Take what arrived, on the engine's polling thread (Receiver.poll)."""
        return self.b.progress()

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
        self.b.faults.refresh()
        with self._lock:
            if (address, room) in self._requests:
                raise KVBridgeError(f"room {room} from {address} already has a receiver")
            r = self._requests[(address, room)] = Receiver(
                self,
                room,
                address,
                time.monotonic() + self.settings.bootstrap_timeout,
                self._ended_request,
            )
            if engine is None:
                resolver = self._resolvers.get(address)
                if resolver is None:
                    try:
                        client = BootstrapClient(
                            address,
                            self.settings.token or None,
                            timeout=self.settings.bootstrap_timeout,
                        )
                    except KVBridgeError:  # a malformed address: no receiver is left behind
                        del self._requests[(address, room)]
                        raise
                    resolver = self._resolvers[address] = RoomResolver(
                        client, functools.partial(self._resolved, address)
                    )
                    resolver.start()
                engine = resolver.resolve(room)
        if engine is not None:
            self._attach(r, engine)
        return r

    def _ended_request(self, status: RequestStatus) -> None:
        self.b.metrics.ended(status)
        ended(status, "decode", self.rank)

    def _resolved(self, address: str, room: int, engine: str) -> None:
        with self._lock:
            r = self._requests.get((address, room))
        if r is not None:
            self._attach(r, engine)

    def _attach(self, r: Receiver, engine: str) -> None:
        """The room lives in prefill engine ``engine``: link to it (or use the link there is)."""
        why = ""
        with self._lock:
            if r.link is not None or r.status.state.terminal:
                return
            link = self._links.get(engine)
            if link is None or link.state is LinkState.FAILED:
                link = self._links[engine] = PrefillLink(self.b, self, r.address, engine)
                self._sessions[link.session] = link
                link.start()
            if link.address != r.address:
                # A second link would open a second session with the same prefill agents,
                # which ends the first's requests there; and where a link looks its engine up
                # is its address's, never another request's.
                why = (
                    f"prefill engine {engine} is linked through bootstrap address "
                    f"{link.address}; this request names {r.address}: name it one way"
                )
            else:  # (one receiver an address and room: one a session and room, then)
                self._linked[(link.session, r.room)] = r
                r.link = link
        if why:
            self.fail(r, FailureKind.BAD_INPUT, why)
        elif link.state is LinkState.READY:
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
        if not link.fail(kind, reason):
            return
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

        def completion(placement: Placement, pairing: Pairing) -> Completion:
            if pairing is not r.checked_by:  # (init checked it where the link was ready)
                pairing.check_placement(placement, "decode", rank=self.rank)
            senders = pairing.senders_of(self.rank, placement.tokens)
            return Completion(
                placement.tokens,
                senders,
                {p: pairing.stage_layers(p) for p in senders},
                start=placement.start,
            )

        try:
            claimed = r.claim_start(completion)
        except KVBridgeError as e:  # nothing was sent: no prefill rank holds the request
            self.fail(r, FailureKind.BAD_INPUT, str(e))
            return
        if claimed is None or r.completion is None:
            return
        placement, senders, link = claimed, r.completion.expected, r.linked
        pages = self.b.faults.request_pages({g: ids.tolist() for g, ids in placement.pages.items()})
        trace(
            r.room,
            "receive",
            role="decode",
            rank=self.rank,
            tokens=placement.tokens,
            start=placement.start,
            prefill=link.engine,
            senders=sorted(senders),
        )
        if r.status.state.terminal:  # failed meanwhile: its writers were told to abort
            return
        # Writes of this request may land from now on, and only those of this link's session.
        self.b.transport.admit((link.session, r.room))
        r.status.advance(KVPoll.TRANSFERRING, time.monotonic() + self.settings.transfer_timeout)
        for agent in link.agents:
            stray = self.b.faults.stray_message()
            if stray is not None:
                self.b.send_raw(agent, link.infos[link.ranks[agent]].control, stray)
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
                    fingerprint=r.fingerprint,
                ),
            )
        r.status.timeline.mark(Phase.ASKED)

    def check_open(self) -> None:
        self.b.check_open()

    def fail(self, request: Receiver, kind: FailureKind, reason: str) -> None:
        """Fail, then fence every prefill rank that may still write into the pages."""
        r = request
        if not r.status.fail(kind, reason):
            return
        resolver = self._resolvers.get(r.address)
        if resolver is not None:
            resolver.discard(r.room)
        if self.staging is not None:
            self.staging.ended(r)
        started = r.fence_writers(
            time.monotonic(), self.settings.abort_timeout, self.settings.heartbeat_interval
        )
        if started:
            self._abort(r, r.linked.agents)  # non-writers hold the request too: they end it
            if r.pending() and self.b.transport.fencing is Fencing.RECEIVER:
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
                r.acknowledged()
                self.maybe_release(r)

    def maybe_release(self, r: Receiver) -> None:
        moved = r.settle(time.monotonic(), self.settings.abort_timeout)
        if moved is Release.QUARANTINED:
            log.warning("%s: %s", self.b.agent, r.quarantine_reason)
        elif moved is Release.RELEASED:
            if self.staging is not None:  # before anyone may reuse what it freed
                self.staging.released(r)
            r.mark_released()
            with self._lock:
                self._requests.pop((r.address, r.room), None)
                if r.link is not None:
                    self._linked.pop((r.link.session, r.room), None)

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
            r = self._linked.get((link.session, room)) if room is not None else None
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
            self.b.faults.noticed()
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
            r.acknowledged(msg.sender)
            self.maybe_release(r)
        elif isinstance(msg, AbortAck):
            r.acknowledged(msg.sender)
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
        why = self.notices.take(r, rank, msg)
        if why is not None:
            self._refuse(msg, why)

    # ---- liveness and deadlines ----------------------------------------------------------

    def on_peer_dead(self, agent: str, why: str) -> None:
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
                f"prefill rank {link.ranks[agent]} ({agent}) {why}",
            )

    def on_tick(self, now: float) -> None:
        with self._lock:
            receivers = list(self._requests.values())
            live = {r.link.session for r in receivers if r.link is not None} | {
                ln.session for ln in self._links.values()
            }
            for session in [s for s in self._sessions if s not in live]:
                del self._sessions[session]  # nothing of it can matter any more
        each(
            receivers,
            lambda r: self._tend(r, now) if r.status.state.terminal else self.expire(r, now),
        )

    def _tend(self, r: Receiver, now: float) -> None:
        """An ended request still held: its abort asked again where due, released once no
        write of it can land."""
        pending = r.abort_due(now, self.settings.heartbeat_interval)
        if pending:
            log.debug("%s: room %d: abort again to %s", self.b.agent, r.room, sorted(pending))
            self._abort(r, pending)
        self.maybe_release(r)

    def expire(self, r: Receiver, now: float) -> None:
        """Fail ``r`` if its deadline passed: the tick asks for every open request, the
        engine's poll past the latest the deadline can be (Receiver.poll)."""
        state = r.status.state
        if state.terminal or now < r.status.deadline:
            return
        if state is KVPoll.BOOTSTRAPPING:
            hint = self.settings.hint("bootstrap_timeout")
            self.fail(r, FailureKind.BOOTSTRAP, f"{self._unlinked(r)}; {hint}")
            return
        owed = ""
        if r.completion is not None:
            owed = "; still owed: " + "; ".join(
                f"prefill rank {p}: {w}" for p, w in sorted(r.completion.missing().items())
            )
        setting = "transfer_timeout" if state is KVPoll.TRANSFERRING else "waiting_timeout"
        self.fail(
            r,
            FailureKind.DEADLINE,
            f"room {r.room}: deadline passed while {state.name}{owed}; "
            f"{self.settings.hint(setting)}{r.status.paused_note()}",
        )

    def on_paused(self, seconds: float) -> None:
        """This rank was paused ``seconds``: its requests' deadlines move back as much (within
        bounds: :meth:`RequestStatus.extend`)."""
        with self._lock:
            receivers = list(self._requests.values())
        for r in receivers:
            r.status.extend(seconds)

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
