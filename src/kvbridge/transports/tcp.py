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

Sending: ``streams`` connections per peer, each with a writer thread (connects lazily and
answers the peer's challenge, sends batches from a queue, the payload straight from source
memory) and a reader thread (matches acknowledgements to batches in order). ``post`` splits a
batch's runs over the streams by bytes. A part is DONE on its acknowledgement and FAILED on a
refusal, a lost connection or ``io_timeout`` seconds without progress; the handle ends when
all parts have.

Every blocking call has a timeout: ``connect_timeout`` to connect and authenticate,
``io_timeout`` for a send or receive to make progress (and for an acknowledgement after the
last byte), and a short idle tick at which waiting threads look whether the transport closed.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import queue
import select
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from kvbridge.copy import split
from kvbridge.errors import ProtocolError, TransportError
from kvbridge.memory import RegionMemory
from kvbridge.runs import Runs
from kvbridge.staging.cost import CostModel
from kvbridge.transports import tcp_wire as wire
from kvbridge.transports._common import (
    DEVICE_TRANSPORTS,
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

_IDLE = 0.5  # tick at which idle threads check for close
_SEND_CHUNK = 16 << 20  # a sendall's timeout covers one chunk: io_timeout bounds a stall
_MIN_STREAM_BYTES = 4 << 20  # below this a batch goes on one stream


def _wait_readable(sock: socket.socket, timeout: float) -> bool:
    p = select.poll()  # not select(): descriptors past 1024 are fine
    p.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(p.poll(int(timeout * 1000)))


_Side = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]

# ---- sending --------------------------------------------------------------------------------


@dataclass(eq=False)
class _Job:
    handle: XferHandle
    seq: int
    frame: bytes  # prefix + header + run arrays
    src: _Side  # src_region, src_offset, nbytes, count, src_stride
    views: list[np.ndarray]
    sent_at: float | None = None


@dataclass(eq=False)
class _Conn:
    """One established connection of a stream and the batches in flight on it."""

    sock: socket.socket
    inflight: collections.deque[_Job] = field(default_factory=collections.deque)
    lock: threading.Lock = field(default_factory=threading.Lock)
    broken: str | None = None

    def push(self, job: _Job) -> bool:
        with self.lock:
            if self.broken is None:
                self.inflight.append(job)
                return True
        job.handle.part_done(self.broken)
        return False

    def fail(self, reason: str) -> None:
        """Mark broken, wake both threads, fail every batch in flight on it."""
        with self.lock:
            if self.broken is not None:
                return
            self.broken = reason
            jobs = list(self.inflight)
            self.inflight.clear()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        for j in jobs:
            j.handle.part_done(reason)


class _Stream:
    """One connection slot to a peer: a queue, a writer thread, a reader per connection."""

    def __init__(self, owner: TcpTransport, peer: str, address: tuple[str, int], index: int):
        self.owner, self.peer, self.address = owner, peer, address
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.conn: _Conn | None = None
        self.stopped: str | None = None
        self.lock = threading.Lock()  # orders put() against stop()
        self.bounce = np.empty(wire.BOUNCE_BYTES, dtype=np.uint8)
        self.thread = threading.Thread(
            target=self._write, daemon=True, name=f"kvbridge-tcp-{owner.agent}->{peer}-{index}"
        )
        self.thread.start()

    def put(self, job: _Job) -> None:
        with self.lock:
            if self.stopped is None:
                self.jobs.put(job)
                return
        job.handle.part_done(self.stopped)

    def stop(self, reason: str) -> None:
        with self.lock:
            if self.stopped is not None:
                return
            self.stopped = reason
            self.jobs.put(None)
        conn = self.conn
        if conn is not None:
            conn.fail(reason)

    def _write(self) -> None:
        while True:
            try:
                job = self.jobs.get(timeout=_IDLE)
            except queue.Empty:
                if self.stopped is not None:
                    break
                continue
            if job is None or self.stopped is not None:
                if job is not None:
                    job.handle.part_done(self.stopped)
                break
            if job.handle.failing:
                job.handle.part_done("another part of this transfer failed")
                continue
            conn = self._connection(job)
            if conn is not None and conn.push(job):
                try:
                    self._send(conn.sock, job)
                except OSError as e:
                    conn.fail(
                        f"connection to peer {self.peer!r} at {self.address} lost while "
                        f"sending: {e}"
                    )
                except Exception as e:  # a bug must fail the batch, not kill the stream
                    conn.fail(f"sending to peer {self.peer!r} failed: {type(e).__name__}: {e}")
        if self.conn is not None:  # its reader thread ends with it
            self.conn.fail(self.stopped or "stream stopped")
            self.conn.sock.close()
        # Drain: whatever is still queued ends FAILED.
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.handle.part_done(self.stopped or "stream stopped")

    def _connection(self, job: _Job) -> _Conn | None:
        if self.conn is not None:
            if self.conn.broken is None:
                return self.conn
            # The writer owns the socket: closed here, never under a send in progress.
            self.conn.sock.close()
            self.conn = None
        o = self.owner
        first = ""  # why the first try failed, if there was a second
        while True:
            try:
                sock = socket.create_connection(self.address, timeout=o.connect_timeout)
            except OSError as e:
                job.handle.part_done(
                    f"cannot connect to peer {self.peer!r} at {self.address}: {e}{first}"
                )
                return None
            try:
                wire.tune(sock, o.sockbuf)
                self._authenticate(sock)
                sock.settimeout(o.io_timeout)
                break
            except (OSError, ProtocolError) as e:
                sock.close()
                # Nothing was sent yet, so one more try is safe: a handshake cut short by a
                # pause of either process (a frozen VM) is not the peer refusing us.
                if not first and isinstance(e, (TimeoutError, ConnectionError)):
                    first = f" (a first try: {e})"
                    continue
                job.handle.part_done(f"peer {self.peer!r} at {self.address}: {e}{first}")
                return None
        conn = self.conn = _Conn(sock)
        threading.Thread(
            target=self._read, args=(conn,), daemon=True, name=f"{self.thread.name}-acks"
        ).start()
        return conn

    def _authenticate(self, sock: socket.socket) -> None:
        """Answer the peer's challenge with our proof of the token; wait for its welcome.
        Each read is bounded by ``connect_timeout`` (the socket's timeout here)."""
        o = self.owner
        head = bytearray(wire.CHALLENGE.size)
        try:
            wire.recv_exact(sock, memoryview(head))
        except TimeoutError:
            raise TimeoutError(
                f"it did not acknowledge the connection (no challenge within {o.connect_timeout} s)"
            ) from None
        except ConnectionError as e:
            raise ConnectionError(
                f"connection lost before its challenge (it is gone, or over "
                f"its max_connections): {e}"
            ) from None
        sock.sendall(wire.encode_answer(o._token, wire.decode_challenge(head), o.agent))
        welcome = bytearray(wire.WELCOME.size)
        try:
            wire.recv_exact(sock, memoryview(welcome))
        except ConnectionError as e:
            raise ConnectionError(
                f"connection lost at the handshake (its token differs from "
                f"ours, or it is gone): {e}"
            ) from None
        if welcome != wire.WELCOME_BYTES:
            raise ProtocolError(f"not a kvbridge welcome: {bytes(welcome)!r}")

    def _send(self, sock: socket.socket, job: _Job) -> None:
        sock.sendall(job.frame)
        bounce = self.bounce
        for piece in wire.pieces(*job.src, job.views):
            if isinstance(piece, wire.Direct):
                buf = piece.buf
                for k in range(0, buf.nbytes, _SEND_CHUNK):
                    sock.sendall(buf[k : k + _SEND_CHUNK].data)
            else:
                piece.gather(bounce)
                sock.sendall(bounce[: piece.nbytes].data)
        job.sent_at = time.monotonic()

    def _read(self, conn: _Conn) -> None:
        head = bytearray(wire.REPLY.size)
        timeout = self.owner.io_timeout
        while conn.broken is None:
            try:
                if not _wait_readable(conn.sock, _IDLE):
                    with conn.lock:
                        first = conn.inflight[0] if conn.inflight else None
                    if (
                        first is not None
                        and first.sent_at is not None
                        and time.monotonic() - first.sent_at > timeout
                    ):
                        conn.fail(f"peer {self.peer!r} did not acknowledge within {timeout} s")
                    continue
                wire.recv_exact(conn.sock, memoryview(head))
                seq, status, mlen = wire.decode_reply(head)
                msg = bytearray(mlen)
                wire.recv_exact(conn.sock, memoryview(msg))
            except (OSError, ProtocolError) as e:
                conn.fail(f"connection to peer {self.peer!r} at {self.address} lost: {e}")
                break
            except Exception as e:  # a bug must fail the batches, not leave them pending
                conn.fail(f"reading from peer {self.peer!r} failed: {type(e).__name__}: {e}")
                break
            with conn.lock:
                job = conn.inflight.popleft() if conn.inflight else None
            if job is None or job.seq != seq:
                if job is not None:
                    job.handle.part_done(
                        f"peer {self.peer!r} acknowledged batch {seq}, expected {job.seq}"
                    )
                conn.fail(f"peer {self.peer!r} sent an acknowledgement out of order")
                break
            if status is wire.Status.OK:
                job.handle.part_done()
                continue
            text = msg.decode("utf-8", "replace")
            job.handle.part_done(f"peer {self.peer!r} refused the batch: {text}")
            if status is wire.Status.REFUSED:  # DISCARDED: the connection goes on
                conn.fail(f"peer {self.peer!r} refused an earlier batch: {text}")


@dataclass(eq=False)
class _Peer:
    meta: AgentMetadata
    streams: list[_Stream]
    next: itertools.count[int] = field(default_factory=itertools.count)


# ---- the transport --------------------------------------------------------------------------


class TcpTransport(Transport):
    """Options: ``host``/``port`` to listen on (``advertise``: the host peers connect to, if
    not ``host``); ``streams`` connections per peer; ``io_timeout`` and ``connect_timeout``
    in seconds; ``sockbuf`` socket buffer bytes (0: the system's); ``token``, the secret every
    connection proves it knows (the same on every agent; "" still runs the handshake);
    ``admission``: refuse batches of requests not :meth:`admit`-ted (or fenced since);
    ``receive_workers`` threads that read inbound batches; ``max_connections`` inbound
    connections held at once (more are closed at once).

    Counters: ``refused``, connections closed for a wrong or missing handshake answer;
    ``over_limit``, connections closed past ``max_connections``."""

    name: ClassVar[str] = "tcp"
    fencing: ClassVar[Fencing] = Fencing.RECEIVER
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
        self.connect_timeout, self.sockbuf, self._token = connect_timeout, sockbuf, token
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
        )
        bound = self._server.listener.getsockname()
        self.address: tuple[str, int] = (advertise or bound[0], bound[1])

    @property
    def refused(self) -> int:
        return self._server.refused

    @property
    def over_limit(self) -> int:
        return self._server.over_limit

    # ---- memory and peers -----------------------------------------------------------------

    def register(self, regions: Sequence[RegionMemory]) -> bytes:
        self._check_open()
        refuse_device(self.name, regions, DEVICE_TRANSPORTS)
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
        streams = [_Stream(self, peer, (meta.host, meta.port), i) for i in range(self.streams)]
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
        self._check_open()
        p = known_peer(self._peers, self._lock, peer)
        views = checked_sources(self._local, p.meta, peer, src_regions, dst_regions, runs)
        parts = [
            part
            for big in split(runs, self.streams, _MIN_STREAM_BYTES)
            for part in _limit_runs(big)
        ]
        handle = XferHandle(self, peer, runs.total_bytes, len(parts))
        first = next(p.next)
        for k, part in enumerate(parts):
            order = wire.stream_order(
                part.src_region, part.dst_region, part.nbytes, part.count, part.src_offset
            )
            part = Runs(*(getattr(part, f)[order] for f in _FIELDS))
            seq = next(self._seq)
            header = wire.BatchHeader(
                self.agent,
                peer,
                tuple(dst_regions),
                part.total_bytes,
                None if key is None else (int(key[0]), int(key[1])),
            )
            frame = wire.encode_batch(
                seq,
                header,
                np.stack(
                    [part.dst_region, part.dst_offset, part.nbytes, part.count, part.dst_stride]
                ),
            )
            src: _Side = (
                part.src_region,
                part.src_offset,
                part.nbytes,
                part.count,
                part.src_stride,
            )
            p.streams[(first + k) % len(p.streams)].put(_Job(handle, seq, frame, src, views))
        return handle

    # ---- receiving ------------------------------------------------------------------------

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
