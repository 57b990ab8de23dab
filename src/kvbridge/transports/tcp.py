"""TCP transport: any two hosts, plain sockets and threads.

Receiving (:mod:`.tcp_serve`): each agent listens (127.0.0.1, ephemeral port by default; the
address is in its metadata). One selector thread holds every inbound connection and runs the
handshake (only a peer that proves it knows ``token`` gets a batch read); a bounded pool of
``receive_workers`` threads reads batches: a batch is refused (error reply, the connection is
dropped) unless it is addressed to this agent by the agent that authenticated and every run
lies inside a registered region; with ``admission`` on it is also refused (its payload read
and dropped, the connection kept) unless its request key was admitted and not fenced; then its
payload goes straight into region memory and it is acknowledged. ``fence`` cuts off batches of
a key mid-payload (see :class:`~kvbridge.transports.tcp_gate.Gate`).

Sending (:mod:`.tcp_stream`): ``streams`` connections per peer, each with a writer thread
(connects lazily and answers the peer's challenge, sends batches from a queue, the payload
straight from source memory) and a reader thread (matches acknowledgements to batches in
order). ``post`` splits a batch's runs over the streams by bytes. A part is DONE on its
acknowledgement and FAILED on a refusal, a lost connection or ``io_timeout`` seconds without
progress; the handle ends when all parts have.

Every blocking call has a timeout: ``connect_timeout`` to connect and authenticate (a
handshake cut short is tried again, nothing being sent yet, until ``io_timeout`` has passed:
a peer starved or paused for seconds is not a peer refusing us), ``io_timeout`` for a send or
receive to make progress (and for an acknowledgement after the
last byte), and a short idle tick at which waiting threads look whether the transport closed.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from kvbridge.errors import TransportError
from kvbridge.memory.copy import split
from kvbridge.memory.device import require_cuda
from kvbridge.memory.location import HOST, Location
from kvbridge.memory.pools import RegionMemory
from kvbridge.planner.runs import Runs
from kvbridge.staging.cost import CostModel
from kvbridge.transports import tcp_wire as wire
from kvbridge.transports._common import (
    METADATA_VERSION,
    AgentMetadata,
    LocalRegions,
    checked_sources,
    decode_metadata,
    encode_metadata,
    known_peer,
    refuse_device,
)
from kvbridge.transports.base import FenceKey, Fencing, Transport, TransportOptions, XferHandle
from kvbridge.transports.tcp_serve import Server
from kvbridge.transports.tcp_stream import Dial, Job, SourceRuns, Stream

_MIN_STREAM_BYTES = 4 << 20  # below this a batch goes on one stream
_SET_UP_FOR_DEVICE = (
    "tcp made with device=<its device> (a Bridge does this itself, from its regions), or "
    "nixl, mooncake or cudaipc"
)


@dataclass(eq=False)
class _Peer:
    meta: AgentMetadata
    streams: list[Stream]
    next: itertools.count[int] = field(default_factory=itertools.count)


# ---- the transport --------------------------------------------------------------------------


class TcpTransport(Transport):
    """Options: ``host``/``port`` to listen on (``advertise``: the host peers connect to, if
    not ``host``); ``streams`` connections per peer; ``io_timeout`` and ``connect_timeout``
    in seconds; ``sockbuf`` socket buffer bytes (0: the system's); ``token``, the secret every
    connection proves it knows (the same on every agent; "" still runs the handshake);
    ``admission``: refuse batches of requests not :meth:`admit`-ted (or fenced since);
    ``receive_workers`` threads that read inbound batches; ``max_connections`` inbound
    connections held at once (more are closed at once); ``device``, where the agent's memory
    is (HOST, or the CUDA device of its device regions, whose runs then travel through pinned
    bounce buffers on streams of the agent's own: :mod:`kvbridge.memory.bounce`).

    Counters: ``refused``, connections closed for a wrong or missing handshake answer;
    ``over_limit``, connections closed past ``max_connections``."""

    name: ClassVar[str] = "tcp"
    fencing: ClassVar[Fencing] = Fencing.RECEIVER
    carries_notices: ClassVar[bool] = True
    posts_at_once: ClassVar[bool] = True  # its streams' threads write
    # Runs travel as they are (strided ones too) and are gathered and scattered through a
    # bounce buffer at memcpy speed: a fragmented plan costs what a contiguous one does.
    cost: ClassVar[CostModel] = CostModel(per_descriptor=1e-6, bandwidth=3e9, strided=True)

    @classmethod
    def options(cls, given: TransportOptions) -> dict[str, Any]:
        return {
            "io_timeout": given.io_timeout,
            "token": given.token,
            "max_connections": given.max_connections,
            "admission": given.admission,
            "host": given.host,
            "advertise": given.advertise or None,
            "device": given.device,
            "selector_reads": given.quick_notices,
        }

    def __init__(
        self,
        agent: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise: str | None = None,
        streams: int = 2,
        io_timeout: float = 30.0,
        connect_timeout: float = 5.0,
        sockbuf: int = 4 << 20,
        token: str = "",
        admission: bool = False,
        receive_workers: int = 8,
        max_connections: int = 256,
        device: Location = HOST,
        selector_reads: bool = True,
    ) -> None:
        super().__init__(agent)
        if (
            streams < 1
            or io_timeout <= 0
            or connect_timeout <= 0
            or sockbuf < 0
            or receive_workers < 1
            or max_connections < 1
        ):
            raise TransportError(
                f"tcp: need streams, receive_workers, max_connections >= 1, "
                f"timeouts > 0, sockbuf >= 0; got streams={streams}, "
                f"receive_workers={receive_workers}, max_connections="
                f"{max_connections}, io_timeout={io_timeout}, "
                f"connect_timeout={connect_timeout}, sockbuf={sockbuf}"
            )
        if not isinstance(token, str):
            raise TransportError(f"tcp: token must be a str, got {type(token).__name__}")
        if len(agent.encode()) > wire.MAX_AGENT:
            raise TransportError(f"tcp: agent id longer than {wire.MAX_AGENT} bytes")
        self.streams, self.io_timeout = streams, io_timeout
        self.connect_timeout, self.sockbuf = connect_timeout, sockbuf
        if device.is_device:
            require_cuda(device)
        self.device = device
        self._dial = Dial(agent, token, connect_timeout, io_timeout, sockbuf, device)
        self._local = LocalRegions()
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._seq = itertools.count(1)
        self._server = Server(
            agent,
            self._local,
            host=host,
            port=port,
            token=token,
            admission=admission,
            receive_workers=receive_workers,
            max_connections=max_connections,
            io_timeout=io_timeout,
            connect_timeout=connect_timeout,
            sockbuf=sockbuf,
            location=device,
            selector_reads=selector_reads,
        )
        bound = self._server.listener.getsockname()
        self.address: tuple[str, int] = (advertise or bound[0], bound[1])

    @property
    def refused(self) -> int:
        """Connections closed for a wrong or missing handshake, and notices refused."""
        return self._server.refused + self._server.reader.refused

    @property
    def over_limit(self) -> int:
        return self._server.over_limit

    # ---- memory and peers -----------------------------------------------------------------

    def register(self, regions: Sequence[RegionMemory]) -> bytes:
        self._check_open()
        refuse_device(self.name, regions, _SET_UP_FOR_DEVICE, self.device)
        self._local.add(regions)
        return encode_metadata(
            AgentMetadata(
                METADATA_VERSION,
                self.name,
                self.agent,
                self._local.infos(),
                host=self.address[0],
                port=self.address[1],
            )
        )

    def add_peer(self, peer: str, metadata: bytes) -> None:
        self._check_open()
        meta = decode_metadata(metadata, self.name, peer)
        if not meta.host or not meta.port:
            raise TransportError(f"metadata of tcp peer {peer!r} has no address")
        with self._lock:
            known = self._peers.get(peer)
            if known is not None and known.meta == meta:
                return  # a repeated hello: keep the connections and what is in flight
        streams = [Stream(self._dial, peer, (meta.host, meta.port), i) for i in range(self.streams)]
        with self._lock:
            old = self._peers.get(peer)
            self._peers[peer] = _Peer(meta, streams)
        if old is not None:
            for s in old.streams:
                s.stop(f"peer {peer!r} was re-added")

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            old = self._peers.pop(peer, None)
        if old is not None:
            for s in old.streams:
                s.stop(f"peer {peer!r} was removed")

    # ---- sending --------------------------------------------------------------------------

    def post(
        self,
        peer: str,
        src_regions: Sequence[str],
        dst_regions: Sequence[str],
        runs: Runs,
        *,
        key: FenceKey | None = None,
    ) -> XferHandle:
        p, views, parts = self._split(peer, src_regions, dst_regions, runs)
        return self._queue(p, views, parts, dst_regions, runs, key, None)

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
        # Parts land in any order: none of them may say the post is in. A post large enough to
        # split over the streams (memory.copy.split's rule) goes to post() unchecked here: a
        # large post's check takes milliseconds, and post() makes it.
        if len(notice) > wire.MAX_NOTICE or len(runs) > wire.MAX_RUNS:
            return None
        if self.streams > 1 and runs.total_bytes > _MIN_STREAM_BYTES:
            return None
        p, views, parts = self._split(peer, src_regions, dst_regions, runs)
        if len(parts) != 1:
            return None
        return self._queue(p, views, parts, dst_regions, runs, key, notice)

    def _split(
        self, peer: str, src_regions: Sequence[str], dst_regions: Sequence[str], runs: Runs
    ) -> tuple[_Peer, list[Any], list[Runs]]:
        """Check a post (before any byte moves) and cut it into the batches it travels as."""
        self._check_open()
        p = known_peer(self._peers, self._lock, peer)
        views = checked_sources(self._local, p.meta, peer, src_regions, dst_regions, runs)
        parts = [
            part
            for big in split(runs, self.streams, _MIN_STREAM_BYTES)
            for part in _limit_runs(big)
        ]
        return p, views, parts

    def _queue(
        self,
        p: _Peer,
        views: list[Any],
        parts: list[Runs],
        dst_regions: Sequence[str],
        runs: Runs,
        key: FenceKey | None,
        notice: bytes | None,
    ) -> XferHandle:
        """Queue the batches over the peer's streams (a ``notice`` rides in the header of
        the one batch it comes with)."""
        peer = p.meta.agent
        handle = XferHandle(self, peer, runs.total_bytes, len(parts))
        first = next(p.next)
        for k, part in enumerate(parts):
            order = wire.stream_order(part.src_region, part.dst_region, part.nbytes, part.count)
            part = Runs(*(getattr(part, f)[order] for f in _FIELDS))
            seq = next(self._seq)
            header = wire.BatchHeader(
                self.agent,
                peer,
                tuple(dst_regions),
                part.total_bytes,
                None if key is None else (int(key[0]), int(key[1])),
                notice,
            )
            frame = wire.encode_batch(
                seq,
                header,
                np.stack(
                    [part.dst_region, part.dst_offset, part.nbytes, part.count, part.dst_stride]
                ),
            )
            src: SourceRuns = (
                part.src_region,
                part.src_offset,
                part.nbytes,
                part.count,
                part.src_stride,
            )
            p.streams[(first + k) % len(p.streams)].put(Job(handle, seq, frame, src, views))
        return handle

    # ---- receiving ------------------------------------------------------------------------

    def on_notice(self, handler: Callable[[str, bytes], None]) -> None:
        self._server.reader.notices = handler

    def progress(self) -> int:
        return self._server.progress()

    def admit(self, key: FenceKey) -> None:
        self._server.gate.admit(key)

    def fence(self, key: FenceKey, timeout: float) -> bool:
        return self._server.gate.fence(key, timeout)

    # ---- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers = list(self._peers.values())
            self._peers.clear()
        for p in peers:
            for s in p.streams:
                s.stop(f"tcp agent {self.agent!r} closed")
        self._server.close()
        for p in peers:
            for s in p.streams:
                s.thread.join(timeout=self.io_timeout)
        self._local.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"tcp agent {self.agent!r} is closed")


_FIELDS = (
    "src_region",
    "src_offset",
    "dst_region",
    "dst_offset",
    "nbytes",
    "count",
    "src_stride",
    "dst_stride",
)


def _limit_runs(r: Runs) -> list[Runs]:
    """Cut a part into batches of at most MAX_RUNS runs (what a receiver accepts)."""
    if len(r) <= wire.MAX_RUNS:
        return [r]
    return [
        Runs(*(getattr(r, f)[k : k + wire.MAX_RUNS] for f in _FIELDS))
        for k in range(0, len(r), wire.MAX_RUNS)
    ]
