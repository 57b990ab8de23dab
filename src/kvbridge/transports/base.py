"""The transport contract: what every transport does, and nothing else.

A transport moves bytes it is told to move; it never decides which (the planner does). The
life of a transfer follows NIXL's verbs::

    register(regions) -> metadata     this agent's memory, and the blob that lets peers use it
    add_peer(peer, metadata)          learn a peer's memory (validated)
    post(peer, src, dst, runs)        start writing local regions into the peer's; returns a
                                      handle at once
    poll(handle) / wait(handle, t)    PENDING -> DONE | FAILED (with handle.error)
    release(handle)                   forget a finished transfer
    remove_peer(peer) / close()

and, on the receiving side, fencing (see :class:`Fencing`)::

    admit(key)                        writes tagged ``key`` (one request on one link) may land
    fence(key, timeout) -> bool       none may land any more: True once that is certain

Guarantees every implementation keeps:

* ``post`` bounds-checks every run against the local source regions and the sizes the peer
  registered, before any byte moves, and raises :class:`~kvbridge.errors.TransportError`
  naming the run, the region and the bound. Every other failure is reported on the handle.
* ``DONE`` means every byte has landed in the peer's memory. A terminal state (DONE or
  FAILED) is reported only once every part of the transfer has ended on this side: nothing
  of it is still being sent or copied by this agent.
* No call blocks without a bound: ``wait`` returns PENDING when its timeout passes; a dead or
  stuck peer turns its transfers FAILED within the transport's I/O timeout.
* The source regions must not be changed, and the destination regions not reused, until
  the handle is terminal.

Each transport also says what a write costs it (:attr:`Transport.cost`, a
:class:`~kvbridge.staging.cost.CostModel`): from it, a sender chooses per pair whether to
write the planner's runs directly or to stage them (:mod:`kvbridge.staging`).
"""

from __future__ import annotations

import enum
import itertools
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from kvbridge.errors import TransportError
from kvbridge.memory.location import HOST, Location
from kvbridge.memory.pools import RegionMemory
from kvbridge.planner.runs import Runs
from kvbridge.staging.cost import CostModel

FenceKey = tuple[int, int]
"""``(session, room)``: one request on one control link. ``post`` tags its writes with it so
that a receiver that can fence knows which request a write belongs to."""


class Fencing(enum.Enum):
    """Whether the receiving agent can stop a peer's writes into its memory."""

    RECEIVER = "receiver"  # the receiver performs the writes (tcp): it refuses and cuts them
    NONE = "none"  # one-sided writes (shm, nixl, mooncake, inproc): only the writer can stop


class XferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


_ids = itertools.count(1)


class XferHandle:
    """One posted transfer. Made by a transport, which completes its ``parts`` one by one
    (a batch may be split over worker threads or connections).

    ``state`` and ``error`` are readable from any thread; ``error`` is the reason of a FAILED
    transfer (the first part's that failed).
    """

    def __init__(self, owner: object, peer: str, nbytes: int, parts: int) -> None:
        self.id = next(_ids)
        self.peer = peer
        self.nbytes = nbytes
        self._owner = owner
        self._left = parts
        self._error: str | None = None
        self._released = False
        self._lock = threading.Lock()
        self._ended = threading.Event()
        self._callbacks: list[Callable[[], None]] = []
        if parts == 0:
            self._ended.set()

    def __repr__(self) -> str:
        return (
            f"XferHandle(id={self.id}, peer={self.peer!r}, nbytes={self.nbytes}, "
            f"state={self.state.name})"
        )

    @property
    def state(self) -> XferState:
        if not self._ended.is_set():
            return XferState.PENDING
        return XferState.FAILED if self._error is not None else XferState.DONE

    @property
    def error(self) -> str | None:
        return self._error if self._ended.is_set() else None

    @property
    def failing(self) -> bool:
        """A part has failed: parts not yet started may be skipped."""
        return self._error is not None

    def part_done(self, error: str | None = None) -> None:
        """Called by the transport when one part ended, with the reason if it failed."""
        with self._lock:
            if self._left <= 0:
                return
            if error is not None and self._error is None:
                self._error = error
            self._left -= 1
            if self._left:
                return
            self._ended.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()

    def when_ended(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` (on the transport's thread, so it must be quick) once the transfer
        has ended; at once if it already has. Lets a waiter wait on several things at once."""
        with self._lock:
            if not self._ended.is_set():
                self._callbacks.append(fn)
                return
        fn()

    def wait_ended(self, timeout: float) -> bool:
        return self._ended.wait(max(0.0, timeout))


@dataclass(frozen=True)
class TransportOptions:
    """What the runtime asks of every rank's transport; each transport takes what applies to
    it (:meth:`Transport.options`), and a transport's own options come on top."""

    io_timeout: float = 30.0  # a stuck transfer fails within it (the request's deadline)
    token: str = ""  # the data path requires the token as the control path does
    max_connections: int = 256  # inbound data connections accepted at once
    # Decode ranks: only writes of requests this rank asked for, on live links, may land.
    admission: bool = False
    # Prefill ranks: their pools are only read by their own transport (peers never write
    # them), so private memory (an engine's own pool tensors) is fine there.
    allow_private: bool = False
    # Where a network transport's endpoint binds, and the address peers reach it at ("":
    # host): the rank's KVBRIDGE_HOST and KVBRIDGE_ADVERTISE.
    host: str = "127.0.0.1"
    advertise: str = ""
    # The device the rank's memory is on (HOST for host memory): a transport that moves
    # device memory sets itself up for it before its first registration (NIXL's UCX
    # transports, a CUDA context in its threads).
    device: Location = HOST
    # Whether taking a notice a write carries is quick: not in integrity mode, whose check
    # reads the whole chunk. Then a transport's thread that must stay responsive (tcp's
    # selector) may take a small batch, notice and all, itself.
    quick_notices: bool = True

    def __post_init__(self) -> None:
        if not self.io_timeout > 0 or self.max_connections < 1:
            raise TransportError(
                f"transport options: io_timeout must be > 0 and max_connections >= 1, got "
                f"{self.io_timeout} and {self.max_connections}"
            )


class Transport(ABC):
    """One agent (one rank's endpoint) of a transport. ``agent`` is its id among peers."""

    name: ClassVar[str]
    fencing: ClassVar[Fencing] = Fencing.NONE
    # Copies in this process's memory: strided runs as they are, at memcpy speed.
    cost: ClassVar[CostModel] = CostModel(per_descriptor=1e-6, bandwidth=10e9, strided=True)

    def __init__(self, agent: str) -> None:
        if not agent:
            raise TransportError("a transport needs a non-empty agent id")
        self.agent = agent

    @classmethod
    def options(cls, given: TransportOptions) -> dict[str, Any]:
        """The runtime's options this transport applies, as its constructor's arguments."""
        return {}

    @abstractmethod
    def register(self, regions: Sequence[RegionMemory]) -> bytes:
        """Register local memory (adds to what is registered; names must be new) and return
        this agent's metadata: a versioned JSON blob describing all its regions and how to
        reach it, to hand to peers' :meth:`add_peer`. Refuses memory this transport cannot
        serve with a TransportError."""

    @abstractmethod
    def add_peer(self, peer: str, metadata: bytes) -> None:
        """Learn peer ``peer`` from its metadata blob. Raises TransportError if the blob is
        malformed, of another version or transport, or names another agent. Adding a known
        peer again with the same blob changes nothing; with a new blob (it re-registered or
        restarted) it replaces what was known, and its transfers not yet done end FAILED."""

    @abstractmethod
    def remove_peer(self, peer: str) -> None:
        """Forget a peer; its pending transfers end FAILED."""

    # Whether a post can carry the runtime's notice of it (:meth:`post_noticed`).
    carries_notices: ClassVar[bool] = False
    # Whether a post only checks its batches and returns, never waiting on the caller's
    # thread (it may write there what the socket takes at once, or copy a small batch): an
    # engine's thread may then post at send() (runtime/prefill/worker.py).
    posts_at_once: ClassVar[bool] = False

    def post_noticed(
        self,
        peer: str,
        src_regions: Sequence[str],
        dst_regions: Sequence[str],
        runs: Runs,
        *,
        key: FenceKey | None,
        notice: bytes,
    ) -> XferHandle | None:
        """:meth:`post`, with ``notice`` delivered to the peer's notice handler
        (:meth:`on_notice`) once every byte of the post landed there, and before the post
        ends DONE here: the peer learns that the bytes are in when they are, without a message
        of its own on the control channel (a round of thread hand-offs on both sides). None,
        with nothing posted, where this transport cannot (it writes one-sidedly, or this post
        would travel in several parts); the caller then posts and tells the peer itself."""
        return None

    def on_notice(self, handler: Callable[[str, bytes], None]) -> None:  # noqa: B027
        """Receiving side: ``handler(peer, notice)`` takes the notices posts carry, on the
        thread that landed the bytes (:meth:`post_noticed`). A transport that carries none
        never calls it."""

    @abstractmethod
    def post(
        self,
        peer: str,
        src_regions: Sequence[str],
        dst_regions: Sequence[str],
        runs: Runs,
        *,
        key: FenceKey | None = None,
    ) -> XferHandle:
        """Write local ``src_regions`` into the peer's ``dst_regions`` as ``runs`` say (run
        region fields index these two name lists), tagged with ``key``. Returns at once.
        Raises TransportError, before any byte moves, for an unknown peer or region or a run
        out of bounds."""

    def progress(self) -> int:
        """Receiving side: land, on the calling thread and without waiting, writes that have
        arrived whole. An engine's thread that polls its requests holds the interpreter that
        the transport's own threads would wait for (up to its switch interval, 5 ms, each
        time they wake). Returns the writes landed: 0 where the transport's threads, or the
        peer writing one-sidedly, do it all."""
        return 0

    def admit(self, key: FenceKey) -> None:  # noqa: B027 - a no-op where writes are one-sided
        """Receiving side: writes tagged ``key`` may land from now on. A transport that can
        fence and was asked to (its ``admission`` option) refuses every write whose key was
        not admitted, or was fenced since. Others ignore this."""

    def fence(self, key: FenceKey, timeout: float) -> bool:
        """Receiving side: no write tagged ``key`` may land any more. Returns True once no
        byte of one can still land (writes in progress were cut off or ended), False if this
        transport cannot promise that (:attr:`fencing` is NONE) or could not within
        ``timeout`` seconds."""
        return False

    def poll(self, handle: XferHandle) -> XferState:
        """The handle's state; FAILED carries ``handle.error``."""
        self._own(handle)
        return handle.state

    def wait(self, handle: XferHandle, timeout: float) -> XferState:
        """Poll until the transfer ends or ``timeout`` seconds pass (then PENDING)."""
        self._own(handle)
        handle.wait_ended(timeout)
        return handle.state

    def release(self, handle: XferHandle) -> None:
        """Forget a finished transfer. Releasing a PENDING one is an error: its bytes may
        still be moving."""
        self._own(handle)
        if handle.state is XferState.PENDING:
            raise TransportError(f"{handle!r} is still pending; wait for it before release")
        handle._released = True

    @abstractmethod
    def close(self) -> None:
        """Stop, fail every pending transfer, drop mappings and connections. Idempotent."""

    def _own(self, handle: XferHandle) -> None:
        if handle._owner is not self:
            raise TransportError(f"{handle!r} was posted on another transport")
        if handle._released:
            raise TransportError(f"{handle!r} was released")

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
