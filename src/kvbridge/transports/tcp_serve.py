"""TCP transport, receiving side: one selector thread, a bounded pool of receive workers and
the engine's polling thread, behind the gate that admits and fences requests (:mod:`.tcp_gate`).

Threads do not grow with connections. The selector thread owns the listener and every inbound
connection that is not being read:

* it accepts; past ``max_connections`` open ones, the oldest still in its handshake is closed
  to make room (sockets of peers without the token never keep a real one out) or, none being,
  the new one (either counted in ``over_limit``);
* it runs the handshake itself, non-blocking (a few dozen bytes and one HMAC), so that a peer
  that does not know the token never holds a worker; a wrong answer, or none within
  ``connect_timeout``, closes the connection without a byte written (counted in ``refused``);
* it hands an authenticated connection that turns readable to a worker (at most
  ``receive_workers``, started as needed), which reads one batch (:mod:`.tcp_batch`: checks,
  admission, payload straight into region memory, reply) and gives the connection back (or
  reads the next one first, if it is already there and no other connection waits); a small
  batch (up to 1 MiB) already there whole it reads itself: a worker's wake-up and hand-off
  cost a small request more than its bytes;
* it drains a connection whose batch was refused (the reply is sent, so the sender reads it
  rather than a reset) until the peer closes or ``io_timeout`` passes.

An engine thread that polls its requests reads too (:meth:`Server.progress`): each small batch
already here whole, off an idle connection it claims as a worker would (it holds the
interpreter the selector and the workers would wait for). Admission and fencing: :mod:`.tcp_gate`.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import heapq
import itertools
import logging
import queue
import select
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field

from kvbridge.errors import ProtocolError, TransportError
from kvbridge.memory.bounce import Bounce
from kvbridge.memory.location import HOST, Location
from kvbridge.transports import tcp_wire as wire
from kvbridge.transports._common import LocalRegions
from kvbridge.transports.sockio import HELD, send_now
from kvbridge.transports.tcp_batch import BatchReader, State, arrived
from kvbridge.transports.tcp_gate import Gate

log = logging.getLogger(__name__)
_IDLE = 0.5  # the selector's longest sleep: it also wakes on every event
_ACCEPTS_PER_WAKE = 64  # bounded work per wake: idle connections are served between bursts
_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_LATE = 1.0  # a loop turn this much longer than its wait means this process was paused
_LISTENER, _WAKE = "listener", "wake"  # selector keys that are not connections
_POLLED_BYTES = 1 << 20  # a poller reads batches up to this, all told (the bounce's size)
_POLL_EVERY = 50e-6  # a poller's looks at the connections, at most one in this long (s)


@dataclass(eq=False)
class _Inbound:
    sock: socket.socket
    nonce: bytes
    deadline: float  # of the handshake or the drain
    state: State = State.HANDSHAKE
    answer: bytearray = field(default_factory=bytearray)
    need: int = wire.ANSWER.size  # answer bytes wanted so far
    agent: str = ""  # the peer the handshake proved
    listed: bool = False  # registered with the selector (a poller takes only such IDLE ones)


# ---- the server -----------------------------------------------------------------------------


class Server:
    """The listener, the selector thread and the receive workers of one tcp agent."""

    def __init__(
        self,
        agent: str,
        local: LocalRegions,
        *,
        host: str,
        port: int,
        token: str,
        admission: bool,
        receive_workers: int,
        max_connections: int,
        io_timeout: float,
        connect_timeout: float,
        sockbuf: int,
        location: Location = HOST,
        selector_reads: bool = True,
    ) -> None:
        self.agent, self.local, self._token = agent, local, token
        self.location = location  # of the memory batches land in: the workers' bounce buffers
        self.receive_workers, self.max_connections = receive_workers, max_connections
        self.io_timeout, self.connect_timeout, self.sockbuf = io_timeout, connect_timeout, sockbuf
        self.gate = Gate(admission)
        self.reader = BatchReader(agent, local, self.gate)
        self.refused = 0  # connections closed for a wrong or missing handshake answer
        self.over_limit = 0  # connections closed past max_connections (the new or the oldest)
        self._lock = threading.Lock()
        self._polling = threading.Lock()  # one poller at a time, with its bounce buffer
        self._poll_bounce: Bounce | None = None  # made by the first poller that reads
        # The selector reads a small batch that arrived whole itself (host memory; the peeks
        # need sockio's calls; where taking its notice is quick), with a bounce of its own.
        self._reads_small = selector_reads and HELD and not location.is_device
        self._select_bounce: Bounce | None = None
        self._next_poll = 0.0  # a poller looks again from then on
        self._closed = False
        self._conns: set[_Inbound] = set()
        self._back: collections.deque[_Inbound] = collections.deque()  # from workers
        self._work: queue.SimpleQueue[_Inbound | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._pending = self._idle = 0  # connections queued for, and workers waiting on, work
        self._timers: list[tuple[float, int, _Inbound]] = []  # handshake and drain deadlines
        self._order = itertools.count()
        self._accept_after: float | None = None  # accepting paused (out of descriptors)
        try:
            self.listener = socket.create_server((host, port), backlog=1024)
        except OSError as e:
            raise TransportError(f"tcp agent {agent!r} cannot listen on {host}:{port}: {e}") from e
        self.listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.listener, selectors.EVENT_READ, _LISTENER)
        self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._thread = threading.Thread(
            target=self._run, daemon=True, name=f"kvbridge-tcp-{agent}-select"
        )
        self._thread.start()

    # ---- the selector thread --------------------------------------------------------------

    def _run(self) -> None:
        try:
            turn = time.monotonic()  # when deadlines were last judged
            while not self._closed:
                wait = self._next_wait()
                for key, _ in self._sel.select(wait):
                    if key.data is _LISTENER:
                        self._accept()
                    elif key.data is _WAKE:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    else:
                        self._ready(key.data)
                self._take_back()
                now = time.monotonic()
                if now - turn > wait + _LATE:  # at most ``wait`` too generous
                    self._postpone(now - turn)
                turn = now
                self._expire()
        except Exception:  # a bug: every inbound connection ends, senders see them lost
            log.exception("tcp agent %r: the receiving selector failed", self.agent)
        finally:
            self._shut()

    def _postpone(self, by: float) -> None:
        """This process did not run for ``by`` seconds (SIGSTOP, a frozen VM, a starved
        thread): the peers' handshakes and drains get that time back. Their bytes may not even
        be sent yet (a frozen VM froze the peer too), and judging them on a clock this
        process could not watch would refuse a peer that did nothing wrong."""
        log.info(
            "tcp agent %r: paused for %.1f s; pending deadlines move by as much", self.agent, by
        )
        live = {id(c): c for deadline, _, c in self._timers if c.deadline == deadline}
        self._timers = [(deadline + by, n, c) for deadline, n, c in self._timers]  # a heap yet
        for c in live.values():
            c.deadline += by

    def _next_wait(self) -> float:
        if not self._timers:
            return _IDLE
        return min(_IDLE, max(0.0, self._timers[0][0] - time.monotonic()))

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_WAKE):
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in _OUT_OF_RESOURCES:  # pause rather than spin on a ready listener
                    log.warning("tcp agent %r cannot accept: %s", self.agent, e)
                    self._sel.unregister(self.listener)
                    self._accept_after = time.monotonic() + _IDLE
                return
            with self._lock:
                full = len(self._conns) >= self.max_connections or self._closed
                waiting = [c for c in self._conns if c.state is State.HANDSHAKE] if full else []
            if full:
                self.over_limit += 1
                if self._closed or not waiting:
                    sock.close()
                    continue
                self._close(min(waiting, key=lambda c: c.deadline), registered=True)
            try:
                sock.setblocking(False)
                wire.tune(sock, self.sockbuf)
                nonce, hello = wire.challenge()
                if sock.send(hello) != len(hello):  # a fresh socket's buffer takes 38 bytes
                    raise OSError("challenge not sent whole")
            except OSError:
                sock.close()
                continue
            c = _Inbound(sock, nonce, time.monotonic() + self.connect_timeout, listed=True)
            self._sel.register(sock, selectors.EVENT_READ, c)
            with self._lock:
                self._conns.add(c)
            heapq.heappush(self._timers, (c.deadline, next(self._order), c))

    def _ready(self, c: _Inbound) -> None:
        try:
            if c.state is State.IDLE:
                if not self._claim(c):
                    return  # a poller took it
                if self._reads_small:
                    # A small batch here whole: read now, not through a worker's wake-up and
                    # hand-off (a thread more to wait for a core and the interpreter). One
                    # batch a wake: a peer that keeps sending goes to a worker, the others'
                    # accepts and handshakes wait for nothing more.
                    if self._select_bounce is None:
                        self._select_bounce = wire.bounce_for(self.location)
                    then, _ = self._read_arrived(c, self._select_bounce, most=1)
                    if then is not State.IDLE:
                        self._give_back(c, then)
                        return
                if _readable_now(c.sock):
                    self._submit(c)
                else:  # read already (a poller's, or the selector's own read above)
                    self._relist(c)
            elif c.state is State.HANDSHAKE:
                self._handshake(c)
            elif c.state is State.DRAIN and not c.sock.recv(1 << 16):
                self._close(c, registered=True)
        except (BlockingIOError, InterruptedError):
            pass
        except (OSError, ProtocolError) as e:
            if c.state is State.HANDSHAKE:
                self.refused += 1
                log.info("tcp agent %r: refused a connection: %s", self.agent, e)
            self._close(c, registered=True)
        except Exception:  # a bug: drop this connection, keep serving the others
            log.exception("tcp agent %r: dropping an inbound connection", self.agent)
            self._close(c, registered=True)

    def _handshake(self, c: _Inbound) -> None:
        """Read the answer as it comes (exactly its bytes: nothing past it is consumed)."""
        data = c.sock.recv(c.need - len(c.answer))
        if not data:
            raise ProtocolError("closed before answering the challenge")
        c.answer += data
        if len(c.answer) < c.need:
            return
        if c.need == wire.ANSWER.size:
            c.need = wire.answer_length(c.answer)
            return  # level-triggered: the selector reports the rest as soon as it is there
        c.agent = wire.check_answer(self._token, c.nonce, c.answer)
        if c.sock.send(wire.WELCOME_BYTES) != len(wire.WELCOME_BYTES):
            raise OSError("welcome not sent whole")
        c.sock.settimeout(self.io_timeout)  # for whoever reads its batches
        with self._lock:
            c.state, c.answer = State.IDLE, bytearray()

    def _take_back(self) -> None:
        while True:
            with self._lock:
                if not self._back:
                    return
                c = self._back.popleft()
            if c.state is State.DRAIN:
                c.sock.setblocking(False)
                c.deadline = time.monotonic() + self.io_timeout
                heapq.heappush(self._timers, (c.deadline, next(self._order), c))
            self._sel.register(c.sock, selectors.EVENT_READ, c)
            with self._lock:
                c.listed = True

    def _expire(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            deadline, _, c = heapq.heappop(self._timers)
            if c.deadline != deadline or c.state not in (State.HANDSHAKE, State.DRAIN):
                continue  # the handshake ended, or a later drain has its own deadline
            if c.state is State.HANDSHAKE:
                self.refused += 1
                log.info(
                    "tcp agent %r: a connection did not authenticate within %s s",
                    self.agent,
                    self.connect_timeout,
                )
            self._close(c, registered=True)
        if self._accept_after is not None and now >= self._accept_after:
            self._accept_after = None
            self._sel.register(self.listener, selectors.EVENT_READ, _LISTENER)

    def _shut(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.close()
        with self._lock:
            idle = [c for c in self._conns if c.state is not State.BUSY]
        for c in idle:
            self._close(c, registered=True)

    def _close(self, c: _Inbound, registered: bool) -> None:
        """``registered``: called by the selector thread (the only one that touches it)."""
        with self._lock:
            if c.state is State.CLOSED:
                return
            c.state = State.CLOSED  # close() shuts down only BUSY sockets: none races this
            c.listed = False
            self._conns.discard(c)
        if registered:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(c.sock)
        with contextlib.suppress(OSError):
            c.sock.close()

    # ---- the pollers ----------------------------------------------------------------------

    def _claim(self, c: _Inbound) -> bool:
        """Take an IDLE connection off the selector for one reader (first come)."""
        with self._lock:
            if c.state is not State.IDLE or not c.listed or self._closed:
                return False
            c.state, c.listed = State.BUSY, False
        with contextlib.suppress(KeyError, ValueError, OSError):  # its selector closed since
            self._sel.unregister(c.sock)
        return True

    def _relist(self, c: _Inbound) -> None:
        """Give a claimed connection back to the selector as IDLE (closed if it is gone)."""
        if not self._closed:  # closing: its selector may be closed already
            with contextlib.suppress(OSError, ValueError, KeyError):  # else the socket is gone
                self._sel.register(c.sock, selectors.EVENT_READ, c)
                with self._lock:
                    c.state, c.listed = State.IDLE, True
                return
        self._close(c, registered=False)

    def progress(self) -> int:
        """Read, on the calling thread, each small batch that is already here whole: called
        by an engine thread that polls its requests, which holds the interpreter the selector
        and the workers would have to wait for (up to its switch interval, 5 ms). Never
        waits: what is not all here is left to them. Returns the batches read."""
        now = time.monotonic()
        if not HELD or self.location.is_device or now < self._next_poll:
            return 0  # an engine polling many requests in a row looks once for them all
        if not self._polling.acquire(blocking=False):
            return 0
        self._next_poll = now + _POLL_EVERY
        try:
            with self._lock:
                idle = [c for c in self._conns if c.state is State.IDLE and c.listed]
            read = 0
            for c in idle:
                try:
                    ready = arrived(c.sock, _POLLED_BYTES)
                except (OSError, ValueError):  # closed since by the selector's thread or close()
                    continue
                if not ready or not self._claim(c):
                    continue
                if self._poll_bounce is None:
                    self._poll_bounce = wire.bounce_for(self.location)
                then, n = self._read_arrived(c, self._poll_bounce)
                read += n
                if then is State.IDLE:
                    self._relist(c)
                else:
                    self._give_back(c, then)
            return read
        finally:
            self._polling.release()

    def _read_arrived(
        self, c: _Inbound, bounce: Bounce, most: int | None = None
    ) -> tuple[State, int]:
        """Read each batch of claimed connection ``c`` already here whole (at most ``most``),
        on this thread: what the connection is then, and the batches read."""
        then, read = State.IDLE, 0
        try:
            while (
                then is State.IDLE
                and (most is None or read < most)
                and arrived(c.sock, _POLLED_BYTES)
            ):
                then = self.reader.read(c.sock, c.agent, bounce)
                read += 1
        except OSError:
            return State.CLOSED, read  # the peer went away, or we are closing
        except Exception:  # a bug: drop this connection unacknowledged
            log.exception("tcp agent %r: dropping an inbound connection", self.agent)
            return State.CLOSED, read
        return then, read

    # ---- the workers ----------------------------------------------------------------------

    def _submit(self, c: _Inbound) -> None:
        with self._lock:
            closing = self._closed
            if not closing:  # (close() snapshots the workers under this lock)
                c.state = State.BUSY
                self._pending += 1
                spawn = self._pending > self._idle and len(self._workers) < self.receive_workers
                if spawn:
                    t = threading.Thread(
                        target=self._work_loop, daemon=True, name=f"kvbridge-tcp-{self.agent}-recv"
                    )
                    self._workers.append(t)
                    t.start()
        if closing:
            self._close(c, registered=False)
        else:
            self._work.put(c)

    def _work_loop(self) -> None:
        bounce = wire.bounce_for(self.location)
        while True:
            with self._lock:
                self._idle += 1
            c = self._work.get()
            with self._lock:
                self._idle -= 1
                if c is not None:
                    self._pending -= 1
            if c is None:
                return
            then = State.CLOSED
            try:
                if not self._closed:
                    then = self.reader.read(c.sock, c.agent, bounce)
                    # The next batch is already here and no other connection waits for a
                    # worker: serve it now rather than pay the round trip through the
                    # selector (pipelined small batches). Any connection queued ends this.
                    while (
                        then is State.IDLE
                        and not self._pending
                        and not self._closed
                        and _readable_now(c.sock)
                    ):
                        then = self.reader.read(c.sock, c.agent, bounce)
            except OSError:
                pass  # the peer went away, or we are closing: nothing was acknowledged
            except Exception:  # a bug: drop this connection unacknowledged, keep the others
                log.exception("tcp agent %r: dropping an inbound connection", self.agent)
            self._give_back(c, then)

    def _give_back(self, c: _Inbound, then: State) -> None:
        """A connection read, to the selector as ``then`` (closed at once if CLOSED)."""
        if then is State.CLOSED:
            self._close(c, registered=False)
            return
        with self._lock:
            keep = not self._closed
            if keep:
                c.state = then
                self._back.append(c)
        if not keep:
            self._close(c, registered=False)
            return
        with contextlib.suppress(OSError):  # full: the selector has wakes to read anyway
            send_now(self._wake_w, [memoryview(b"\0")])

    # ---- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        """Stop accepting, close every connection; returns within about a second."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for c in self._conns:
                if c.state is State.BUSY:  # its worker's recv or send returns at once
                    with contextlib.suppress(OSError):
                        c.sock.shutdown(socket.SHUT_RDWR)
            workers = list(self._workers)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        end = time.monotonic() + 2 * _IDLE + 1
        self._thread.join(timeout=max(0.0, end - time.monotonic()))
        for _ in workers:
            self._work.put(None)
        for t in workers:
            t.join(timeout=max(0.0, end - time.monotonic()))
        if not self._thread.is_alive():
            self._sel.close()
        for s in (self._wake_r, self._wake_w):
            s.close()


def _readable_now(sock: socket.socket) -> bool:
    p = select.poll()
    p.register(sock, select.POLLIN)
    return bool(p.poll(0))
