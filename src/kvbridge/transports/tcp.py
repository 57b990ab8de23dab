"""TCP transport: any two hosts, plain sockets and threads.

Receiving: each agent listens (127.0.0.1, ephemeral port by default; the address is in its
metadata). A thread per inbound connection reads a batch's header, refuses it unless it is
addressed to this agent and every run lies inside a registered region (error reply, the
connection is dropped, the listener serves on), then receives the payload straight into region
memory and acknowledges.

Sending: ``streams`` connections per peer, each with a writer thread (connects lazily, sends
batches from a queue, the payload straight from source memory) and a reader thread (matches
acknowledgements to batches in order). ``post`` splits a batch's runs over the streams by
bytes. A part is DONE on its acknowledgement and FAILED on an error reply, a lost connection
or ``io_timeout`` seconds without progress; the handle ends when all parts have.

Every blocking call has a timeout: ``connect_timeout`` to connect, ``io_timeout`` for a send or
receive to make progress (and for an acknowledgement after the last byte), and a short idle
tick at which waiting threads look whether the transport closed.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import queue
import select
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from kvbridge.copy import check_side, split
from kvbridge.errors import ProtocolError, TransportError
from kvbridge.memory import RegionMemory
from kvbridge.runs import Runs
from kvbridge.transports import tcp_wire as wire
from kvbridge.transports._common import (
    METADATA_VERSION,
    AgentMetadata,
    LocalRegions,
    checked_sources,
    decode_metadata,
    encode_metadata,
    known_peer,
)
from kvbridge.transports.base import FenceKey, Transport, XferHandle

log = logging.getLogger(__name__)
_IDLE = 0.5  # tick at which idle threads check for close
_SEND_CHUNK = 16 << 20  # a sendall's timeout covers one chunk: io_timeout bounds a stall
_MIN_STREAM_BYTES = 4 << 20  # below this a batch goes on one stream


class _Closed(Exception):
    """The local side is shutting the connection down."""


def _wait_readable(sock: socket.socket, timeout: float) -> bool:
    p = select.poll()  # not select(): descriptors past 1024 are fine
    p.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(p.poll(int(timeout * 1000)))


def _recv_exact(sock: socket.socket, buf: memoryview) -> None:
    """Fill ``buf``; each recv is bounded by the socket's timeout. EOF -> ConnectionError."""
    pos, n = 0, len(buf)
    while pos < n:
        got = sock.recv_into(buf[pos:], n - pos)
        if got == 0:
            raise ConnectionError(f"connection closed after {pos} of {n} bytes")
        pos += got


def _tune(sock: socket.socket, sockbuf: int) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # header and ack are small
    if sockbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sockbuf)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sockbuf)


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
        self.thread = threading.Thread(target=self._write, daemon=True,
                                       name=f"kvbridge-tcp-{owner.agent}->{peer}-{index}")
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
                    conn.fail(f"connection to peer {self.peer!r} at {self.address} lost while "
                              f"sending: {e}")
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
        try:
            sock = socket.create_connection(self.address, timeout=o.connect_timeout)
            _tune(sock, o.sockbuf)
            sock.settimeout(o.io_timeout)
        except OSError as e:
            job.handle.part_done(f"cannot connect to peer {self.peer!r} at {self.address}: {e}")
            return None
        conn = self.conn = _Conn(sock)
        threading.Thread(target=self._read, args=(conn,), daemon=True,
                         name=f"{self.thread.name}-acks").start()
        return conn

    def _send(self, sock: socket.socket, job: _Job) -> None:
        sock.sendall(job.frame)
        bounce = self.bounce
        for piece in wire.pieces(*job.src, job.views):
            if isinstance(piece, wire.Direct):
                buf = piece.buf
                for k in range(0, buf.nbytes, _SEND_CHUNK):
                    sock.sendall(buf[k:k + _SEND_CHUNK].data)
            else:
                piece.gather(bounce)
                sock.sendall(bounce[:piece.nbytes].data)
        job.sent_at = time.monotonic()

    def _read(self, conn: _Conn) -> None:
        head = bytearray(wire.REPLY.size)
        timeout = self.owner.io_timeout
        while conn.broken is None:
            try:
                if not _wait_readable(conn.sock, _IDLE):
                    with conn.lock:
                        first = conn.inflight[0] if conn.inflight else None
                    if first is not None and first.sent_at is not None and \
                            time.monotonic() - first.sent_at > timeout:
                        conn.fail(f"peer {self.peer!r} did not acknowledge within {timeout} s")
                    continue
                _recv_exact(conn.sock, memoryview(head))
                seq, status, mlen = wire.decode_reply(head)
                msg = bytearray(mlen)
                _recv_exact(conn.sock, memoryview(msg))
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
                    job.handle.part_done(f"peer {self.peer!r} acknowledged batch {seq}, "
                                         f"expected {job.seq}")
                conn.fail(f"peer {self.peer!r} sent an acknowledgement out of order")
                break
            if status is wire.Status.OK:
                job.handle.part_done()
            else:
                text = msg.decode("utf-8", "replace")
                job.handle.part_done(f"peer {self.peer!r} refused the batch: {text}")
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
    in seconds; ``sockbuf`` socket buffer bytes (0: the system's)."""

    name: ClassVar[str] = "tcp"

    def __init__(self, agent: str, *, host: str = "127.0.0.1", port: int = 0,
                 advertise: str | None = None, streams: int = 2, io_timeout: float = 30.0,
                 connect_timeout: float = 5.0, sockbuf: int = 4 << 20) -> None:
        super().__init__(agent)
        if streams < 1 or io_timeout <= 0 or connect_timeout <= 0 or sockbuf < 0:
            raise TransportError(f"tcp: need streams >= 1, timeouts > 0, sockbuf >= 0; got "
                                 f"streams={streams}, io_timeout={io_timeout}, "
                                 f"connect_timeout={connect_timeout}, sockbuf={sockbuf}")
        self.streams, self.io_timeout = streams, io_timeout
        self.connect_timeout, self.sockbuf = connect_timeout, sockbuf
        self._local = LocalRegions()
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._seq = itertools.count(1)
        try:
            self._listener = socket.create_server((host, port), backlog=128)
        except OSError as e:
            raise TransportError(f"tcp agent {agent!r} cannot listen on {host}:{port}: {e}") from e
        self._listener.settimeout(_IDLE)
        bound = self._listener.getsockname()
        self.address: tuple[str, int] = (advertise or bound[0], bound[1])
        self._inbound: set[socket.socket] = set()
        self._accepter = threading.Thread(target=self._accept, daemon=True,
                                          name=f"kvbridge-tcp-{agent}-listen")
        self._accepter.start()

    # ---- memory and peers -----------------------------------------------------------------

    def register(self, regions: Sequence[RegionMemory]) -> bytes:
        self._check_open()
        self._local.add(regions)
        return encode_metadata(AgentMetadata(METADATA_VERSION, self.name, self.agent,
                                             self._local.infos(), host=self.address[0],
                                             port=self.address[1]))

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

    def post(self, peer: str, src_regions: Sequence[str], dst_regions: Sequence[str],
             runs: Runs, *, key: FenceKey | None = None) -> XferHandle:
        self._check_open()
        p = known_peer(self._peers, self._lock, peer)
        views = checked_sources(self._local, p.meta, peer, src_regions, dst_regions, runs)
        parts = [part for big in split(runs, self.streams, _MIN_STREAM_BYTES)
                 for part in _limit_runs(big)]
        handle = XferHandle(self, peer, runs.total_bytes, len(parts))
        first = next(p.next)
        for k, part in enumerate(parts):
            order = wire.stream_order(part.src_region, part.dst_region, part.nbytes, part.count,
                                      part.src_offset)
            part = Runs(*(getattr(part, f)[order] for f in _FIELDS))
            seq = next(self._seq)
            header = wire.BatchHeader(self.agent, peer, tuple(dst_regions), part.total_bytes)
            frame = wire.encode_batch(seq, header, np.stack(
                [part.dst_region, part.dst_offset, part.nbytes, part.count, part.dst_stride]))
            src: _Side = (part.src_region, part.src_offset, part.nbytes, part.count,
                          part.src_stride)
            p.streams[(first + k) % len(p.streams)].put(_Job(handle, seq, frame, src, views))
        return handle

    # ---- receiving ------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break  # the listener was closed
            with self._lock:
                if self._closed:
                    sock.close()
                    break
                self._inbound.add(sock)
            threading.Thread(target=self._serve, args=(sock,), daemon=True,
                             name=f"kvbridge-tcp-{self.agent}-serve").start()

    def _serve(self, sock: socket.socket) -> None:
        """Serve one inbound connection until it closes, fails or is refused."""
        try:
            _tune(sock, self.sockbuf)
            sock.settimeout(self.io_timeout)
            bounce = np.empty(wire.BOUNCE_BYTES, dtype=np.uint8)
            while self._receive_batch(sock, bounce):
                pass
        except (OSError, _Closed):
            pass  # the peer went away or we are closing: nothing was acknowledged
        except Exception:  # a bug: drop this connection unacknowledged, keep the listener
            log.exception("tcp agent %r: dropping an inbound connection", self.agent)
        finally:
            with self._lock:
                self._inbound.discard(sock)
            with contextlib.suppress(OSError):
                sock.close()

    def _receive_batch(self, sock: socket.socket, bounce: np.ndarray) -> bool:
        """One batch; False when the connection should end (EOF at a batch boundary, or a
        refused batch)."""
        while not _wait_readable(sock, _IDLE):
            if self._closed:
                raise _Closed
        prefix = bytearray(wire.PREFIX.size)
        got = sock.recv_into(prefix)
        if got == 0:
            return False  # the peer closed between batches
        _recv_exact(sock, memoryview(prefix)[got:])
        seq = int.from_bytes(prefix[8:16], "little")
        try:
            seq, n, hlen = wire.decode_prefix(prefix)
            body = bytearray(hlen)
            _recv_exact(sock, memoryview(body))
            header = wire.decode_header(body)
            arrays = np.empty(wire.RUN_FIELDS * n, dtype="<i8")
            _recv_exact(sock, arrays.data.cast("B"))
            region, offset, nbytes, count, stride = arrays.reshape(wire.RUN_FIELDS, n)
            views = self._accept_runs(header, region, offset, nbytes, count, stride)
        except (ProtocolError, TransportError) as e:
            self._refuse(sock, seq, str(e))
            return False
        for piece in wire.pieces(region, offset, nbytes, count, stride, views):
            if isinstance(piece, wire.Direct):
                _recv_exact(sock, piece.buf.data)  # straight into region memory
            else:
                _recv_exact(sock, bounce[:piece.nbytes].data)
                piece.scatter(bounce)
        sock.sendall(wire.encode_reply(seq))
        return True

    def _accept_runs(self, header: wire.BatchHeader, region: np.ndarray, offset: np.ndarray,
                     nbytes: np.ndarray, count: np.ndarray,
                     stride: np.ndarray) -> list[np.ndarray]:
        """The destination views of a batch, after checking it may be written at all."""
        if header.receiver != self.agent:
            raise TransportError(f"batch addressed to agent {header.receiver!r}, this is "
                                 f"{self.agent!r}")
        views = self._local.views(header.dst_regions, "destination")
        check_side("dst", region, offset, nbytes, count, stride, [v.nbytes for v in views],
                   header.dst_regions, writes=True)
        per_run = nbytes * count  # each bounded by its region (checked above), not their sum
        if per_run.sum(dtype=np.float64) > 2.0 ** 62:
            raise TransportError("batch runs carry more than 2**62 bytes")
        total = int(per_run.sum())
        if total != header.nbytes:
            raise TransportError(f"batch runs carry {total} bytes, header says {header.nbytes}")
        return views

    def _refuse(self, sock: socket.socket, seq: int, reason: str) -> None:
        """Reply with the reason, then drain what the sender already sent (so that it reads
        the reply rather than a reset) until it closes or io_timeout passes."""
        with contextlib.suppress(OSError):
            sock.sendall(wire.encode_reply(seq, f"agent {self.agent!r}: {reason}"))
            sock.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + self.io_timeout
            scratch = bytearray(1 << 16)
            while time.monotonic() < deadline and not self._closed:
                if _wait_readable(sock, _IDLE) and sock.recv_into(scratch) == 0:
                    break

    # ---- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers = list(self._peers.values())
            self._peers.clear()
            inbound = list(self._inbound)
        for p in peers:
            for s in p.streams:
                s.stop(f"tcp agent {self.agent!r} closed")
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() on Linux
        with contextlib.suppress(OSError):
            self._listener.close()
        for sock in inbound:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._accepter.join(timeout=2 * _IDLE + 1)
        for p in peers:
            for s in p.streams:
                s.thread.join(timeout=self.io_timeout)
        self._local.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"tcp agent {self.agent!r} is closed")


_FIELDS = ("src_region", "src_offset", "dst_region", "dst_offset", "nbytes", "count",
           "src_stride", "dst_stride")


def _limit_runs(r: Runs) -> list[Runs]:
    """Cut a part into batches of at most MAX_RUNS runs (what a receiver accepts)."""
    if len(r) <= wire.MAX_RUNS:
        return [r]
    return [Runs(*(getattr(r, f)[k:k + wire.MAX_RUNS] for f in _FIELDS))
            for k in range(0, len(r), wire.MAX_RUNS)]
