"""TCP transport, sending side: the streams to one peer (see :mod:`.tcp` for the whole).

A :class:`Stream` is one connection slot to a peer: a queue of batches (:class:`Job`), a writer
thread that connects lazily, answers the peer's challenge and sends batches (the payload
straight from source memory, strided runs through a bounce buffer), and a reader thread per
connection (:class:`Conn`) that matches acknowledgements to batches in order. A batch fails on
a refusal, a lost connection or ``io_timeout`` seconds without an acknowledgement after its
last byte; a connection that breaks fails every batch in flight on it.

A small batch posted while the stream is connected and idle is written by the posting thread
itself, as much of it as the socket takes without waiting (the writer sends the rest, before
anything else): the writer, woken, would wait for the interpreter, which a polling engine
thread holds for up to its switch interval (5 ms).
"""

from __future__ import annotations

import collections
import contextlib
import enum
import queue
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbridge.errors import ProtocolError
from kvbridge.memory.location import HOST, Location
from kvbridge.transports import tcp_wire as wire
from kvbridge.transports.base import XferHandle
from kvbridge.transports.sockio import IOV_MAX, advance, recv_exact, send_all, send_now, views_of

_IDLE = 0.5  # tick at which idle threads check for close
_SEND_CHUNK = 16 << 20  # a sendall's timeout covers one chunk: io_timeout bounds a stall
_ONE_CALL_BYTES = 1 << 20  # a batch up to this goes in one sendmsg (the bounce's size, too)


@dataclass(frozen=True)
class Dial:
    """What every stream of an agent connects with: who it is, the token it proves it knows,
    its timeouts and socket buffer size, and where its memory is (device memory goes through
    a pinned bounce buffer)."""

    agent: str
    token: str = field(repr=False)
    connect_timeout: float
    io_timeout: float
    sockbuf: int
    location: Location = HOST


def _wait_readable(sock: socket.socket, timeout: float) -> bool:
    p = select.poll()  # not select(): descriptors past 1024 are fine
    p.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(p.poll(int(timeout * 1000)))


SourceRuns = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


@dataclass(eq=False)
class Job:
    handle: XferHandle
    seq: int
    frame: bytes  # prefix + header + run arrays
    src: SourceRuns  # src_region, src_offset, nbytes, count, src_stride
    views: list[Any]  # each source region's bytes: a host array or a device tensor
    sent_at: float | None = None

    @property
    def payload(self) -> int:
        """The batch's payload bytes."""
        return int((self.src[2] * self.src[3]).sum())


@dataclass(eq=False)
class Conn:
    """One established connection of a stream and the batches in flight on it."""

    sock: socket.socket
    inflight: collections.deque[Job] = field(default_factory=collections.deque)
    lock: threading.Lock = field(default_factory=threading.Lock)
    broken: str | None = None

    def push(self, job: Job) -> bool:
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


class _Wake(enum.Enum):
    REST = "rest"  # the writer has the rest of a batch a poster began to send


class Stream:
    """One connection slot to a peer: a queue, a writer thread, a reader per connection."""

    def __init__(self, dial: Dial, peer: str, address: tuple[str, int], index: int):
        self.dial, self.peer, self.address = dial, peer, address
        self.jobs: queue.Queue[Job | _Wake | None] = queue.Queue()
        self.conn: Conn | None = None
        self.stopped: str | None = None
        self.lock = threading.Lock()  # orders put() against stop()
        self._sending = threading.Lock()  # whoever writes to the connection (or replaces it)
        self._rest: tuple[Job, list[memoryview]] | None = None  # a batch begun by a poster
        self.bounce = wire.bounce_for(dial.location)
        self.thread = threading.Thread(
            target=self._write, daemon=True, name=f"kvbridge-tcp-{dial.agent}->{peer}-{index}"
        )
        self.thread.start()

    def put(self, job: Job) -> None:
        # Not under ``lock``: a failure calls the handle's callbacks, which may post again.
        if self.stopped is None and self._send_now(job):
            return
        with self.lock:
            if self.stopped is None:
                self.jobs.put(job)
                return
        job.handle.part_done(self.stopped)

    def _send_now(self, job: Job) -> bool:
        """Write a small ``job`` on this thread, where the stream is connected and nothing is
        queued or being written: what the socket takes without waiting, the rest left to the
        writer, which sends it before anything else. False (nothing done) otherwise."""
        conn = self.conn
        if (
            conn is None
            or conn.broken is not None
            or self.bounce.location.is_device
            or job.payload > _ONE_CALL_BYTES
            or job.handle.failing
            or not self.jobs.empty()
        ):
            return False
        if not self._sending.acquire(blocking=False):
            return False
        try:
            if self.conn is not conn or self._rest is not None or not self.jobs.empty():
                return False
            if not conn.push(job):
                return True  # broken meanwhile: the job failed with it
            views = self._small(job)
            try:
                rest = advance(views, send_now(conn.sock, views[:IOV_MAX]) or 0)
            except OSError as e:
                conn.fail(self._lost(e))
                return True
            if rest:
                self._rest = (job, rest)
                self.jobs.put(_Wake.REST)
            else:
                job.sent_at = time.monotonic()
            return True
        finally:
            self._sending.release()

    def _send_rest(self) -> None:
        """Send what a poster left of its batch (under ``_sending``)."""
        rest, self._rest = self._rest, None
        conn = self.conn
        if rest is None or conn is None or conn.broken is not None:
            return  # the batch failed with its connection
        job, views = rest
        try:
            send_all(conn.sock, views)
        except OSError as e:
            conn.fail(self._lost(e))
            return
        job.sent_at = time.monotonic()

    def _lost(self, e: OSError) -> str:
        return f"connection to peer {self.peer!r} at {self.address} lost while sending: {e}"

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
                if isinstance(job, Job):
                    job.handle.part_done(self.stopped)
                break
            with self._sending:
                self._send_rest()
                if isinstance(job, Job):
                    self._take(job)
        with self._sending:
            if self.conn is not None:  # its reader thread ends with it
                self.conn.fail(self.stopped or "stream stopped")
                self.conn.sock.close()
        # Drain: whatever is still queued ends FAILED.
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if isinstance(job, Job):
                job.handle.part_done(self.stopped or "stream stopped")

    def _take(self, job: Job) -> None:
        """Send one queued batch, connecting first where there is no connection."""
        if job.handle.failing:
            job.handle.part_done("another part of this transfer failed")
            return
        conn = self._connection(job)
        if conn is not None and conn.push(job):
            try:
                self._send(conn.sock, job)
            except OSError as e:
                conn.fail(self._lost(e))
            except Exception as e:  # a bug must fail the batch, not kill the stream
                conn.fail(f"sending to peer {self.peer!r} failed: {type(e).__name__}: {e}")

    def _connection(self, job: Job) -> Conn | None:
        if self.conn is not None:
            if self.conn.broken is None:
                return self.conn
            # The writer owns the socket: closed here, never under a send in progress.
            self.conn.sock.close()
            self.conn = None
        o = self.dial
        # Nothing is sent before the handshake ends, so a handshake cut short is safe to try
        # again: once after a lost connection (a peer over its max_connections; the next
        # refusal is its answer: another token, or it is gone), and after a timeout until
        # the transfer's own deadline (a peer starved or paused for seconds, a loaded host or
        # a frozen VM, is not a peer refusing us).
        start = time.monotonic()
        tries, first = 0, ""

        def again() -> str:  # what the earlier tries met, for a failure's reason
            return f" ({tries} tries in {time.monotonic() - start:.0f} s; the first: {first})"

        while True:
            tries += 1
            try:
                sock = socket.create_connection(self.address, timeout=o.connect_timeout)
            except OSError as e:
                why = f"cannot connect to peer {self.peer!r} at {self.address}: {e}"
                job.handle.part_done(why + (again() if first else ""))
                return None
            try:
                wire.tune(sock, o.sockbuf)
                self._authenticate(sock)
                sock.settimeout(o.io_timeout)
                break
            except (OSError, ProtocolError) as e:
                sock.close()
                first = first or str(e)
                again_ok = isinstance(e, TimeoutError) or (
                    isinstance(e, ConnectionError) and tries == 1
                )
                if again_ok and time.monotonic() - start + o.connect_timeout < o.io_timeout:
                    continue
                why = f"peer {self.peer!r} at {self.address}: {e}"
                job.handle.part_done(why + (again() if tries > 1 else ""))
                return None
        conn = self.conn = Conn(sock)
        threading.Thread(
            target=self._read, args=(conn,), daemon=True, name=f"{self.thread.name}-acks"
        ).start()
        return conn

    def _authenticate(self, sock: socket.socket) -> None:
        """Answer the peer's challenge with our proof of the token; wait for its welcome.
        Each read is bounded by ``connect_timeout`` (the socket's timeout here)."""
        o = self.dial
        head = bytearray(wire.CHALLENGE.size)
        try:
            recv_exact(sock, memoryview(head))
        except TimeoutError:
            raise TimeoutError(
                f"it did not acknowledge the connection (no challenge within {o.connect_timeout} s)"
            ) from None
        except ConnectionError as e:
            raise ConnectionError(
                f"connection lost before its challenge (it is gone, or over "
                f"its max_connections): {e}"
            ) from None
        sock.sendall(wire.encode_answer(o.token, wire.decode_challenge(head), o.agent))
        welcome = bytearray(wire.WELCOME.size)
        try:
            recv_exact(sock, memoryview(welcome))
        except ConnectionError as e:
            raise ConnectionError(
                f"connection lost at the handshake (its token differs from "
                f"ours, or it is gone): {e}"
            ) from None
        if welcome != wire.WELCOME_BYTES:
            raise ProtocolError(f"not a kvbridge welcome: {bytes(welcome)!r}")

    def _small(self, job: Job) -> list[memoryview]:
        """A small batch's bytes, to go in one call: each socket call gives the interpreter
        away, and getting it back from a busy engine thread costs more than these bytes."""
        bounce = self.bounce
        bufs: list[Any] = [job.frame]
        for piece in wire.pieces(*job.src, job.views, staged=bounce.nbytes):
            if isinstance(piece, wire.Direct):
                bufs.append(piece.buf.data)
            else:
                piece.gather(bounce)
                bufs.append(bounce.host[: piece.nbytes].tobytes())
        return views_of(bufs)

    def _send(self, sock: socket.socket, job: Job) -> None:
        bounce = self.bounce
        if not bounce.location.is_device and job.payload <= _ONE_CALL_BYTES:
            send_all(sock, self._small(job))
            job.sent_at = time.monotonic()
            return
        send_all(sock, views_of([job.frame]))
        for piece in wire.pieces(*job.src, job.views, staged=bounce.nbytes):
            if isinstance(piece, wire.Direct):
                buf = piece.buf
                for k in range(0, buf.nbytes, _SEND_CHUNK):
                    sock.sendall(buf[k : k + _SEND_CHUNK].data)
            else:
                piece.gather(bounce)
                sock.sendall(bounce.host[: piece.nbytes].data)
        job.sent_at = time.monotonic()

    def _read(self, conn: Conn) -> None:
        head = bytearray(wire.REPLY.size)
        timeout = self.dial.io_timeout
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
                recv_exact(conn.sock, memoryview(head))
                seq, status, mlen = wire.decode_reply(head)
                msg = bytearray(mlen)
                recv_exact(conn.sock, memoryview(msg))
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
