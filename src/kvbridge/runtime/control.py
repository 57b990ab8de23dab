"""The control channel: validated messages between ranks over ZeroMQ, sent from any thread.

Each rank binds one ROUTER socket (everything it receives arrives there) and keeps one DEALER
per peer for what it sends. ZeroMQ sockets are not thread-safe: the ROUTER is the channel
thread's alone, and the DEALERs are used by whichever thread sends, one at a time under a lock
(which is also the memory barrier a socket needs to change threads). A message leaves on the
sender's own thread, ZeroMQ's I/O thread taking it from there: handing it to the channel's
thread instead would cost a wake-up, which waits for the interpreter where an engine's threads
keep it busy. The channel's thread receives, and calls ``on_tick`` every ``tick`` seconds,
where the engine checks deadlines and heartbeats. For the same reason an engine's polling
thread may receive too (:meth:`ControlChannel.progress`): what arrived is then handled on the
thread that holds the interpreter, rather than by the channel's thread once it gets it (up to
Python's switch interval, 5 ms, later). The ROUTER is then used by two threads, one at a time
under a lock; the channel's thread waits on the socket's file descriptor, which no other
thread's call can make unsafe, and both drain the socket until it is empty, so that the
descriptor signals again for whatever arrives next.

Every message travels as two frames, its bytes and, with a token, their seal (:class:`Seal`):
the sending connection's epoch (a random id), the message's sequence number on it and its time,
under an HMAC-SHA256 keyed by the token that also covers the receiver's endpoint. The token
itself never travels, and a message read off the wire is refused if sent again: on its own
connection (its number is not past the last), to another rank (another endpoint), or later
(its time is past :data:`WINDOW`). Without a token the second frame is empty.

The ROUTER sees each sender's connection identity (:func:`connection_identity`): without a
token the sending agent's name; with one, the name, a byte no name holds, and a MAC of the name
and the receiver's endpoint under the token. A ROUTER refuses a second connection presenting
an identity already connected, which keeps a connected peer's name its own; but a name alone
anyone could present first, and silence the peer (seen: none of its messages arrived). The MAC
is what a stranger without the token cannot present. A message whose ``sender`` is not the
agent of the connection it came on is refused, so one peer cannot speak for another. A message
that does not decode, has another protocol version, a wrong seal or a borrowed or unproven
identity is logged and counted in ``refused``; it never reaches a
handler. A message over ``max_message`` bytes never arrives: ZeroMQ drops the connection that
sent it. A handler that raises is logged and counted in ``handler_errors``; the channel keeps
serving.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import math
import os
import secrets
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from kvbridge.errors import KVBridgeError, ProtocolError
from kvbridge.wire.protocol import Message, decode, encode

log = logging.getLogger("kvbridge.control")

WINDOW = 300.0  # seconds a sealed message stays good: the hosts' clocks must agree within it
_SEALED = struct.Struct("!16sQQ")  # epoch, sequence number, time (ms)
_MAC = 32
_EPOCHS = 1024  # a sender's connections in one window that a receiver tracks, at most
LOOK = 50e-6  # seconds between an engine thread's looks at the socket (progress), at least
ENGINE_BATCH = 64  # messages an engine's thread handles in one look, at most
# A connection's identity with a token: the agent's name (UTF-8), then 0xff, which UTF-8 never
# holds (the first 0xff ends the name), then _TAG bytes of a MAC of the name and the endpoint.
_SEP = b"\xff"
_TAG = 16
_MAX_AGENT = 255 - len(_SEP) - _TAG  # ZeroMQ's identities are 255 bytes at most


def connection_identity(agent: str, key: bytes, endpoint: str) -> bytes:
    """The ZeroMQ identity ``agent``'s connection to ``endpoint`` presents: its name, and with
    a token (``key``) a proof of it, the same on every connection (so that while one is
    connected no other can take its name), which no one without the token can make."""
    name = agent.encode()
    return name + _SEP + _tag(key, name, endpoint) if key else name


def _tag(key: bytes, name: bytes, endpoint: str) -> bytes:
    mac = hmac.new(key, b"identity\0" + name + b"\0" + endpoint.encode(), hashlib.sha256)
    return mac.digest()[:_TAG]


@dataclass
class Seal:
    """One sending connection's seals: ``epoch`` names it, ``seq`` counts its messages."""

    key: bytes
    endpoint: str  # the receiver's
    epoch: bytes = field(default_factory=lambda: secrets.token_bytes(16))
    seq: int = 0

    def __call__(self, payload: bytes) -> bytes:
        self.seq += 1
        head = _SEALED.pack(self.epoch, self.seq, int(time.time() * 1000))
        return head + _mac(self.key, self.endpoint, head, payload)


def _mac(key: bytes, endpoint: str, head: bytes, payload: bytes) -> bytes:
    return hmac.new(key, endpoint.encode() + b"\0" + head + payload, hashlib.sha256).digest()


class _Unsealer:
    """The receiver's side: a seal's MAC, time and number, each message once."""

    def __init__(self, key: bytes, endpoint: str) -> None:
        self._key, self._endpoint = key, endpoint
        # sending agent -> epoch -> (last number, the latest time sealed in it)
        self._last: dict[bytes, dict[bytes, tuple[int, float]]] = {}

    def check(self, agent: bytes, payload: bytes, seal: bytes) -> str | None:
        """Why the message from ``agent``'s connection is refused, or None."""
        if len(seal) != _SEALED.size + _MAC:
            return f"a seal of {len(seal)} bytes, expected {_SEALED.size + _MAC}"
        head, mac = seal[: _SEALED.size], seal[_SEALED.size :]
        if not hmac.compare_digest(mac, _mac(self._key, self._endpoint, head, payload)):
            return "wrong MAC: not signed with this deployment's token, or not for this rank"
        epoch, seq, ms = _SEALED.unpack(head)
        now = time.time()
        if abs(ms / 1000 - now) > WINDOW:
            return f"sealed {ms / 1000 - now:+.0f} s from this rank's clock (window {WINDOW:.0f} s)"
        epochs = self._last.setdefault(agent, {})
        last, latest = epochs.get(epoch, (0, 0.0))
        if seq <= last:
            return f"a replay: message {seq} of its connection, after {last}"
        if epoch not in epochs:
            # An epoch whose every message is sealed before the window is forgotten: sent
            # again, they are refused by their time (by the sender's clock, not by when they
            # came, so that a sender whose clock runs ahead gains nothing).
            for old in [e for e, (_, t) in epochs.items() if now - t > WINDOW]:
                del epochs[old]
            if len(epochs) >= _EPOCHS:
                return f"more than {_EPOCHS} connections from one sender in {WINDOW:.0f} s"
        epochs[epoch] = (seq, max(latest, ms / 1000))
        return None


class ControlChannel:
    def __init__(
        self,
        agent: str,
        *,
        host: str,
        advertise: str = "",
        token: str,
        on_message: Callable[[Message], None],
        on_tick: Callable[[float], None],
        tick: float = 0.02,
        max_message: int = 64 << 20,
        outgoing: Callable[[str, Message], list[Message]] | None = None,
    ) -> None:
        self.agent = agent
        if not 0 < len(agent.encode()) <= _MAX_AGENT:
            raise KVBridgeError(f"agent name {agent!r}: 1 to {_MAX_AGENT} bytes (UTF-8) expected")
        self._key = token.encode()
        self._on_message = on_message
        self._on_tick = on_tick
        self._tick = tick
        self._outgoing = outgoing
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.RCVHWM, 100_000)
        self._router.setsockopt(zmq.MAXMSGSIZE, max_message)
        port = self._router.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{advertise or host}:{port}"
        # One DEALER per (peer, endpoint): a peer that restarts elsewhere gets a new socket,
        # and one declared dead keeps its own, so that what is queued for it (an abort it
        # must answer if it was only stalled) is delivered when it resumes. Reconnecting with
        # a new socket instead would present the same identity while the stalled peer still
        # holds the old connection, and its ROUTER refuses a duplicate identity.
        self._peers: dict[tuple[str, str], tuple[zmq.Socket[bytes], Seal | None]] = {}
        self._sending = threading.Lock()  # the DEALERs, their seals, and closing them
        self._closed = False
        self._unsealer = _Unsealer(self._key, self.endpoint) if self._key else None
        self.max_message = max_message
        # The ROUTER's: the channel's thread, or an engine's polling thread (progress).
        self._receiving = threading.Lock()
        self._router_fd = self._router.getsockopt(zmq.FD)
        self._next_look = 0.0  # progress looks at most once every LOOK seconds
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"kvbridge-control-{agent}", daemon=True
        )
        self.refused = 0
        self.handler_errors = 0

    def start(self) -> None:
        self._thread.start()

    def limit(self, max_message: int) -> None:
        """Refuse messages over ``max_message`` bytes from now on (before :meth:`start`)."""
        self.max_message = max_message
        self._router.setsockopt(zmq.MAXMSGSIZE, max_message)

    def close(self, timeout: float = 2.0) -> None:
        """Stop, but let what was sent be delivered (a final chunk notice must not be lost to
        a clean shutdown), waiting at most ``timeout`` for peers to take it."""
        self._stop.set()
        self._wake()
        if self._thread.ident is not None:  # (started)
            self._thread.join(timeout)
        with self._sending:
            self._closed = True
            for sock, _ in self._peers.values():
                sock.close(int(timeout * 1000))
        with self._receiving:  # an engine's progress() may be receiving, or waking the thread
            self._router.close(0)
            os.close(self._wake_r)
            os.close(self._wake_w)
        self._ctx.term()

    def send(self, peer: str, endpoint: str, msg: Message, *, faults: bool = True) -> None:
        """Send ``msg`` to ``peer`` (connecting to ``endpoint`` on first use; ZeroMQ delivers
        it once connected). Thread-safe. ``faults=False`` bypasses test fault injection."""
        msgs = self._outgoing(peer, msg) if self._outgoing and faults else [msg]
        for m in msgs:
            self._deliver(peer, endpoint, encode(m))

    def send_raw(self, peer: str, endpoint: str, payload: bytes) -> None:
        """Send bytes as they are (fault injection: malformed messages)."""
        self._deliver(peer, endpoint, payload)

    def _deliver(self, peer: str, endpoint: str, payload: bytes) -> None:
        with self._sending:
            if self._closed:
                log.debug("%s: closed; a message to %s not sent", self.agent, peer)
                return
            if (peer, endpoint) not in self._peers:
                sock = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 100_000)
                sock.setsockopt(zmq.IDENTITY, connection_identity(self.agent, self._key, endpoint))
                sock.connect(endpoint)
                self._peers[(peer, endpoint)] = (
                    sock,
                    Seal(self._key, endpoint) if self._key else None,
                )
            sock, seal = self._peers[(peer, endpoint)]
            try:
                sock.send_multipart([payload, seal(payload) if seal else b""], zmq.NOBLOCK)
            except zmq.Again:
                # The peer stopped reading for 100k messages: it is dead or stuck. Heartbeats
                # will fail its requests; dropping here keeps this rank responsive.
                log.warning("%s: dropped a message to %s (send queue full)", self.agent, peer)

    def _wake(self) -> None:
        # A full pipe means the loop is already due to wake.
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")

    def progress(self) -> bool:
        """Receive and handle what arrived, on the calling thread (an engine's, polling a
        request that waits for a peer's message). Never waits: while the channel's thread
        receives, or within LOOK seconds of the last look, it returns at once. True when it
        handled a message."""
        now = time.monotonic()
        if now < self._next_look or not self._receiving.acquire(blocking=False):
            return False
        try:
            self._next_look = now + LOOK
            if self._stop.is_set():
                return False
            taken, emptied = self._receive(ENGINE_BATCH)
            if not emptied:  # the descriptor will not signal for what is left: the thread must
                self._wake()  # (under the lock: close() shuts the pipe under it)
        finally:
            self._receiving.release()
        return taken > 0

    def _run(self) -> None:
        # The descriptor, not the socket: zmq_poll on the ROUTER would use the socket while
        # an engine's thread receives on it.
        poller = zmq.Poller()
        poller.register(self._router_fd, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_tick = time.monotonic()
        emptied = True
        while not self._stop.is_set():
            wait_ms = math.ceil(max(0.0, next_tick - time.monotonic()) * 1000) if emptied else 0
            events = dict(poller.poll(wait_ms))
            if self._wake_r in events:
                os.read(self._wake_r, 4096)
            # Drained every time round (not only when the descriptor signals): it signals
            # once for what arrives while the socket is not empty, and another thread's call
            # may have taken the signal of what it did not take.
            with self._receiving:
                _, emptied = self._receive(10_000)  # bounded: ticks keep their rhythm
            now = time.monotonic()
            if now >= next_tick:
                self._guarded(self._on_tick, now)
                next_tick = now + self._tick

    def _receive(self, most: int) -> tuple[int, bool]:
        """Handle up to ``most`` messages (under ``_receiving``): how many came, and whether
        the socket was left empty."""
        for taken in range(most):
            # Asked first, since pyzmq's receive gives the interpreter away even when nothing
            # is there, and an engine's thread that polls then waits for it (up to the switch
            # interval) behind whichever thread took it; asking keeps it.
            if not int(self._router.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                return taken, True
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return taken, True
            if len(frames) != 3:
                self._refuse(frames[0], f"{len(frames) - 1} frames, expected 2 (message, mac)")
                continue
            identity, payload, seal = frames
            agent = self._agent_of(identity)
            if agent is None:  # a stranger's, or another version's
                self._refuse(identity, "an identity not proven with this deployment's token")
                continue
            why = (
                self._unsealer.check(agent, payload, seal)
                if self._unsealer
                else (
                    f"a seal of {len(seal)} bytes: this deployment has no token" if seal else None
                )
            )
            if why is not None:
                self._refuse(identity, why)
                continue
            try:
                msg = decode(payload)
            except ProtocolError as e:
                self._refuse(identity, str(e))
                continue
            if msg.sender.encode() != agent:
                self._refuse(
                    identity,
                    f"a {type(msg).__name__} claiming to be from "
                    f"{msg.sender!r} on another agent's connection",
                )
                continue
            self._guarded(self._on_message, msg)
        return most, False

    def _agent_of(self, identity: bytes) -> bytes | None:
        """The sending agent's name in a connection's identity; None where it is not one
        :func:`connection_identity` makes with this channel's token and endpoint."""
        if not self._key:
            return identity or None
        name, sep, tag = identity.partition(_SEP)
        good = hmac.compare_digest(tag, _tag(self._key, name, self.endpoint))
        return name if name and sep and good else None

    def _refuse(self, identity: bytes, why: str) -> None:
        self.refused += 1
        log.warning("%s: refused a message from connection %r: %s", self.agent, identity[:64], why)

    def _guarded(self, fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except Exception:
            self.handler_errors += 1
            log.exception("%s: handler error", self.agent)
