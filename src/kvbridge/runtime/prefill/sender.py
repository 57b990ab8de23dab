"""The sending request: one request on one prefill rank, and everything it knows.

A :class:`Sender` is what a prefill engine holds per request: it calls :meth:`Sender.send` as
chunks (or layer groups of a chunk) are computed, and polls. The sender owns the request's
state: the chunks handed over, the decode ranks that asked for it and their placements, what
was queued, written and delivered. Its role (:mod:`.role`) and writer (:mod:`.writer`) change
that state only through the methods below the engine's, each under the sender's lock.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from kvbridge.errors import FailureKind, KVBridgeError, PlacementError
from kvbridge.planner.placement import Placement
from kvbridge.planner.plan import Pairing
from kvbridge.planner.transferplan import PartKind
from kvbridge.runtime.status import KVPoll, RequestStatus, ranges_text
from kvbridge.runtime.timeline import Phase


@dataclass(frozen=True)
class DecodePeer:
    """A decode rank in the session its last hello opened."""

    agent: str
    engine: str
    rank: int
    session: int
    endpoint: str
    staging_slots: int = 0  # its staging region (kvbridge.staging), if it has one
    staging_slot_bytes: int = 0


@dataclass(frozen=True, eq=False)
class Chunk:
    """What one :meth:`Sender.send` hands over: tokens ``[start, stop)`` of ``layers``.
    ``completes``: no layer of those tokens is left to send (the aux slot travels with it).
    ``ready``: CUDA events the engine recorded after writing these bytes (its forward's), that
    the worker waits for before reading them; empty for host memory."""

    start: int
    stop: int
    last: bool
    placement: Placement
    layers: range
    completes: bool = True
    ready: tuple[Any, ...] = ()

    def continued_by(self, b: Chunk) -> bool:
        """Whether layer group ``b`` continues this one: the same tokens and placement, the
        layers right after these."""
        return (b.start, b.stop, b.placement) == (
            self.start,
            self.stop,
            self.placement,
        ) and b.layers.start == self.layers.stop


@dataclass(frozen=True, eq=False)
class Write:
    """One write the worker makes for a decode rank: ``chunk`` (queued layer groups that
    continue each other merged into it), the decode rank's placement and peer, and how many
    queued chunks it covers."""

    chunk: Chunk
    dst: Placement
    peer: DecodePeer
    pairing: Pairing
    index: int  # of the first chunk it covers
    taken: int


class Owner(Protocol):
    """What a sender needs of its role."""

    def check_open(self) -> None: ...
    def progress(self) -> bool: ...
    def pump(self, s: Sender) -> None: ...
    def fail(self, request: Sender, kind: FailureKind, reason: str) -> None: ...
    def expire(self, s: Sender, now: float) -> None: ...


class Sender:
    """One request on one prefill rank. Engines call :meth:`send` as chunks are computed."""

    def __init__(
        self,
        owner: Owner,
        room: int,
        placement: Placement,
        layers: range,
        deadline: float,
        on_end: Callable[[RequestStatus], None] | None = None,
        fingerprint: bytes = b"",
    ) -> None:
        self.room = room
        self.tokens = placement.tokens
        self.fingerprint = fingerprint
        self.status = RequestStatus(room, deadline, on_end)
        self._owner = owner
        self._mine = layers  # this rank's layers (its PP stage)
        self._lock = threading.Lock()
        self._placement = placement
        self._chunks: list[Chunk] = []
        self._left: set[int] = set()  # layers of the open chunk not sent yet
        self._engine: str | None = None  # the decode engine serving the request
        self._pairing: Pairing | None = None
        self._needed: dict[int, frozenset[PartKind]] = {}
        self._metas: dict[int, Placement] = {}
        self._peers: dict[int, DecodePeer] = {}  # every decode rank that sent metadata
        self._refused: set[tuple[str, int]] = set()  # askers of other tokens: (agent, session)
        self._delivered: set[int] = set()
        self._scheduled: dict[int, int] = defaultdict(int)
        self._completed: dict[int, int] = defaultdict(int)
        self.sent_bytes = 0  # written by this rank's worker, to every decode rank
        self._drained = threading.Event()  # failed, and no write of it reads the pages any more

    @property
    def writes_done_at(self) -> float | None:
        """time.monotonic() when the last chunk's writes were DONE (CLOCK_MONOTONIC is
        system-wide, so the decode side's Success time can be compared with it)."""
        return self.status.timeline.at(Phase.WRITTEN)

    # ---- the engine's ----------------------------------------------------------------

    def send(
        self,
        stop: int,
        *,
        layers: range | None = None,
        placement: Placement | None = None,
        last: bool | None = None,
        wait_event: Any = None,
    ) -> None:
        """Tokens ``[previous stop, stop)`` are in the pools now, for ``layers`` of this rank
        (a prefill whose forward computes layer by layer sends each layer group as soon as it
        is computed, in any order; by default, every layer of these tokens not sent yet); send
        them. The next tokens can be sent once every layer of these was. ``placement``
        replaces the request's page table (chunked prefill allocates as it goes).
        ``wait_event``: a CUDA event (``torch.cuda.Event``) recorded on the stream that wrote
        these tokens' KV, where the forward may still be running: nothing of them is read
        before it completed (within the request's deadline). On a request that already ended
        this does nothing: the engine learns why from poll()."""
        self._owner.check_open()
        if self.status.state.terminal:
            return
        self.status.timeline.mark(Phase.READY)
        with self._lock:
            start, last, left = self._open(stop, last)
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
                    Chunk(
                        start,
                        stop,
                        last,
                        self._placement,
                        group,
                        completes=not self._left and i == len(runs) - 1,
                        ready=() if wait_event is None else (wait_event,),
                    )
                )
        self._owner.pump(self)

    def _open(self, stop: int, last: bool | None) -> tuple[int, bool, set[int]]:
        """The chunk ``send(stop)`` adds layers to: (start, last, its layers not sent yet)."""
        if self._left and stop == self._chunks[-1].stop:  # more layers of the open chunk
            return self._chunks[-1].start, self._chunks[-1].last, self._left
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
                f"room {self.room}: the last chunk must end at token {self.tokens}, got {stop}"
            )
        return start, last, set(self._mine)  # a new chunk: every layer of this rank to send

    def poll(self) -> KVPoll:
        """The request's state. Until it ends, the engine's polling thread first takes its
        peers' messages that arrived (Bridge.progress: the decode's ask, its acknowledgement).
        Past the latest its deadline can be, it fails here (the control thread's tick fails
        it at the deadline itself, unless held up)."""
        state = self.status.state
        if not state.terminal and self._owner.progress():
            state = self.status.state
        if not state.terminal and (now := time.monotonic()) >= self.status.latest:
            self._owner.expire(self, now)
            state = self.status.state
        return state

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

    @property
    def released(self) -> bool:
        """Whether the engine may reuse the request's pages: it succeeded (every decode rank
        confirmed its bytes), or it failed and the worker, past every write of it, told its
        decode ranks. A request fails at once, its writes may still be reading the pages
        (a tcp write stalled on its socket, say): until then they are not the engine's."""
        return self.status.state is KVPoll.SUCCESS or self._drained.is_set()

    def drained(self) -> None:
        """The role's, once the worker told the decode ranks of the failure."""
        self._drained.set()

    def wait(self, timeout: float) -> KVPoll:
        return self.status.wait(timeout)

    def abort(self, reason: str = "aborted by the prefill engine") -> None:
        """Fail the request here and, at once, on every decode rank that asked for it."""
        self._owner.fail(self, FailureKind.ABORTED, reason)

    # ---- the role's: decode ranks asking, confirming --------------------------------------

    def attach(self, peer: DecodePeer, pairing: Pairing, rank: int) -> str | None:
        """Decode rank ``peer`` asked for this request: its engine serves it from now on
        (what each of its ranks is owed comes from ``pairing``). A refusal's reason, where
        another decode engine already does."""
        with self._lock:
            if self._engine is None:
                self._engine, self._pairing = peer.engine, pairing
                self._needed = pairing.receivers_of(rank, self.tokens)
            elif self._engine != peer.engine:
                return f"room {self.room} is already served by decode engine {self._engine!r}"
            self._peers[peer.rank] = peer
            return None

    def place(self, decode_rank: int, placement: Placement) -> bool:
        """A decode rank's checked placement; whether every decode rank owed has sent one."""
        with self._lock:
            self._metas[decode_rank] = placement
            return all(r in self._metas for r in self._needed)

    def refuse(self, peer: DecodePeer) -> None:
        """``peer`` asked for other tokens under this room (its fingerprint differs): it is
        refused, and its abort is not this request's."""
        with self._lock:
            self._refused.add((peer.agent, peer.session))

    def refused(self, agent: str, session: int) -> bool:
        with self._lock:
            return (agent, session) in self._refused

    def foreign(self, decode_rank: int, agent: str, session: int) -> bool:
        """Whether a message naming ``decode_rank`` comes from someone else than the agent
        (and session) that asked for the request as that rank."""
        with self._lock:
            mine = self._peers.get(decode_rank)
            return bool(self._peers) and (
                mine is None or mine.agent != agent or mine.session != session
            )

    def deliver(self, decode_rank: int, agent: str) -> bool:
        """``agent`` confirmed it holds every byte as ``decode_rank``; False where that rank
        is not its."""
        with self._lock:
            mine = self._peers.get(decode_rank)
            if mine is None or mine.agent != agent:
                return False
            self._delivered.add(decode_rank)
            return True

    def peers(self) -> list[DecodePeer]:
        with self._lock:
            return list(self._peers.values())

    def involves(self, agent: str) -> bool:
        with self._lock:
            return any(p.agent == agent for p in self._peers.values())

    def done(self) -> bool:
        """Every chunk was handed over, written to and confirmed by every decode rank owed."""
        with self._lock:
            return (
                bool(self._chunks)
                and self._chunks[-1].last
                and self._chunks[-1].completes
                and self._engine is not None
                and all(
                    self._completed[d] == len(self._chunks) and d in self._delivered
                    for d in self._needed
                )
            )

    # ---- the role's and the writer's: what to write ---------------------------------------

    def ready(self) -> tuple[list[tuple[int, int]], bool]:
        """(decode rank, chunk index) of every write not queued yet whose decode rank sent its
        placement, now counted as queued; and whether writing has started."""
        with self._lock:
            out = []
            for d in self._needed:
                if d not in self._metas:
                    continue
                while self._scheduled[d] < len(self._chunks):
                    out.append((d, self._scheduled[d]))
                    self._scheduled[d] += 1
            return out, bool(self._chunks) and self._engine is not None

    def write(self, decode_rank: int, index: int) -> Write | None:
        """The write that chunk ``index`` for a decode rank is due in: from the first chunk
        not yet written to it, with the queued layer groups that continue it (a forward that
        outruns the transfer hands over more meanwhile: they go in the same plan and write);
        None where it ended or chunk ``index`` was written already. Writes go in chunk order
        whatever the order their jobs come in (two threads queue them: the engine's at
        ``send()`` and the one that takes the decode's ask), since :meth:`written` counts
        chunks from the first: a later chunk written first would count an earlier one, never
        sent, as written."""
        with self._lock:
            if self.status.state.terminal or index < self._completed[decode_rank]:
                return None
            index = self._completed[decode_rank]
            pairing = self._pairing
            if pairing is None:  # cannot happen: writes are queued only once attached
                raise KVBridgeError(f"room {self.room}: no pairing")
            chunk, taken = self._chunks[index], 1
            while index + taken < len(self._chunks) and chunk.continued_by(
                self._chunks[index + taken]
            ):
                nxt = self._chunks[index + taken]
                chunk = replace(
                    chunk,
                    layers=range(chunk.layers.start, nxt.layers.stop),
                    completes=nxt.completes,
                    ready=chunk.ready + nxt.ready,
                )
                taken += 1
            return Write(
                chunk, self._metas[decode_rank], self._peers[decode_rank], pairing, index, taken
            )

    def describe(self) -> str:
        """The request's state in a line, for a diagnosis (a request that never ends): the
        chunks handed over (``~``: its tokens miss layers yet), and for each decode rank owed
        whether it placed, the chunks queued and written to it, and its confirmation."""
        with self._lock:
            chunks = " ".join(
                f"[{c.start},{c.stop})L{c.layers.start}-{c.layers.stop}{'' if c.completes else '~'}"
                for c in self._chunks
            )
            ranks = "; ".join(
                f"decode rank {d} {'placed' if d in self._metas else 'not placed'}, queued "
                f"{self._scheduled.get(d, 0)}, written {self._completed.get(d, 0)}"
                f"{', confirmed' if d in self._delivered else ''}"
                for d in sorted(self._needed)
            )
        return (
            f"room {self.room} {self.status.state.name}: chunks {chunks or 'none'}; "
            f"{ranks or 'no decode engine attached'}"
        )

    def next_unwritten(self, decode_rank: int) -> int:
        """The index of the first chunk not yet written to (and reported to) a decode rank."""
        with self._lock:
            return self._completed[decode_rank]

    def written(self, decode_rank: int, taken: int) -> None:
        """``taken`` more chunks were written to (and reported to) a decode rank."""
        with self._lock:
            self._completed[decode_rank] += taken


def _runs(layers: set[int]) -> list[range]:
    """Sorted layer indices as ranges of consecutive ones."""
    out: list[range] = []
    for li in sorted(layers):
        if out and out[-1].stop == li:
            out[-1] = range(out[-1].start, li + 1)
        else:
            out.append(range(li, li + 1))
    return out


MISMATCH = "two requests were given one room, or one request's two legs different prompts"


def other_tokens(room: int, rank: int, held: str) -> str:
    """Why a decode rank's ask for ``room`` is refused: the request that ``held`` (holds, or
    held) the room on prefill rank ``rank`` has other tokens than the asker's."""
    return (
        f"room {room} on prefill rank {rank} {held} other tokens (their fingerprints differ): "
        f"{MISMATCH}"
    )
