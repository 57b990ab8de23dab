"""TCP transport, receiving side: one inbound batch, read by a receive worker of
:mod:`.tcp_serve` (or its selector, or an engine thread polling, where a small batch arrived
whole) off a connection that authenticated.

A batch is refused (an error reply; the connection is then drained and closed) unless it
comes from the agent its connection authenticated as, is addressed to this agent, and every
run lies inside a registered region. The gate (:mod:`.tcp_gate`) may refuse its request (the
payload is read and dropped, the reply says DISCARDED and the connection goes on); otherwise
its payload goes straight into region memory, looking at the fence flag every few MiB, and it
is acknowledged only if its request was not fenced meanwhile.
"""

from __future__ import annotations

import enum
import logging
import socket
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from kvbridge.errors import ProtocolError, TransportError
from kvbridge.memory.bounce import Bounce
from kvbridge.memory.copy import check_side
from kvbridge.transports import tcp_wire as wire
from kvbridge.transports._common import LocalRegions
from kvbridge.transports.sockio import pending, recv_exact, recv_now, recv_some, send_all, views_of
from kvbridge.transports.tcp_gate import Batch, Gate

log = logging.getLogger(__name__)

_STEP = 4 << 20  # region bytes received between two looks at the fence flag


class State(enum.Enum):
    """Where an inbound connection is."""

    HANDSHAKE = "handshake"  # selector: waiting for the answer
    IDLE = "idle"  # selector: authenticated, waiting for a batch
    BUSY = "busy"  # a worker is reading a batch
    DRAIN = "drain"  # selector: a batch was refused; read until EOF, then close
    CLOSED = "closed"


class BatchReader:
    """Reads the batches addressed to agent ``agent``, into the regions of ``local``, through
    ``gate``."""

    def __init__(self, agent: str, local: LocalRegions, gate: Gate) -> None:
        self.agent, self.local, self.gate = agent, local, gate
        # The runtime's handler of the notices batches carry (Transport.on_notice).
        self.notices: Callable[[str, bytes], None] | None = None
        self.refused = 0  # notices the handler refused (ProtocolError)

    def read(self, sock: socket.socket, peer: str, bounce: Bounce) -> State:
        """Read one batch from ``sock``, a connection that authenticated as ``peer``; what the
        connection does next (IDLE, DRAIN or CLOSED)."""
        prefix = bytearray(wire.PREFIX.size)
        got = recv_some(sock, memoryview(prefix))
        if got == 0:
            return State.CLOSED  # the peer closed between batches
        recv_exact(sock, memoryview(prefix)[got:])
        seq = int.from_bytes(prefix[8:16], "little")
        try:
            seq, n, hlen = wire.decode_prefix(prefix)
            body = bytearray(hlen)
            recv_exact(sock, memoryview(body))
            header = wire.decode_header(body)
            arrays = np.empty(wire.RUN_FIELDS * n, dtype="<i8")
            recv_exact(sock, arrays.data.cast("B"))
            region, offset, nbytes, count, stride = arrays.reshape(wire.RUN_FIELDS, n)
            if header.sender != peer:
                raise TransportError(
                    f"batch from agent {header.sender!r} on a connection "
                    f"that authenticated as {peer!r}"
                )
            views = self._check(header, region, offset, nbytes, count, stride)
        except (ProtocolError, TransportError) as e:
            return self._refuse(sock, seq, str(e))
        entry = self.gate.enter(header.key, sock)
        if isinstance(entry, str):
            _discard(sock, header.nbytes, bounce.host)
            _reply(sock, seq, f"agent {self.agent!r}: {entry}", wire.Status.DISCARDED)
            return State.IDLE
        try:
            landed = _land(
                sock,
                entry,
                wire.pieces(region, offset, nbytes, count, stride, views, staged=bounce.nbytes),
                bounce,
            )
        finally:
            self.gate.leave(entry)
        if entry.fenced:  # even if every byte landed: a fenced writer never hears success
            _discard(sock, header.nbytes - landed, bounce.host)
            _reply(
                sock,
                seq,
                f"agent {self.agent!r}: request {entry.key} was fenced while its batch "
                f"was received",
                wire.Status.DISCARDED,
            )
            return State.IDLE
        why = None if header.notice is None else self._notice(peer, header.notice)
        if why is not None:  # the bytes are in, but the sender must not count on its notice
            _reply(sock, seq, f"agent {self.agent!r}: {why}", wire.Status.DISCARDED)
            return State.IDLE
        _reply(sock, seq)
        return State.IDLE

    def _notice(self, peer: str, notice: bytes) -> str | None:
        """Hand a landed batch's notice to the runtime before the batch is acknowledged, so
        that the sender's DONE means the receiver took it; why it could not, if so."""
        if self.notices is None:
            return "a notice came with the batch and nothing here takes notices"
        try:
            self.notices(peer, notice)
        except ProtocolError as e:
            self.refused += 1
            log.warning("%s: refused a notice from %s: %s", self.agent, peer, e)
            return f"its notice was refused: {e}"
        except Exception as e:
            log.exception("%s: the notice handler failed on a notice from %s", self.agent, peer)
            return f"its notice could not be taken: {type(e).__name__}: {e}"
        return None

    def _check(
        self,
        header: wire.BatchHeader,
        region: np.ndarray,
        offset: np.ndarray,
        nbytes: np.ndarray,
        count: np.ndarray,
        stride: np.ndarray,
    ) -> list[Any]:
        """The destination views of a batch (of device regions: their tensors), after checking
        it may be written at all."""
        if header.receiver != self.agent:
            raise TransportError(
                f"batch addressed to agent {header.receiver!r}, this is {self.agent!r}"
            )
        views = self.local.views(header.dst_regions, "destination")
        check_side(
            "dst",
            region,
            offset,
            nbytes,
            count,
            stride,
            [v.nbytes for v in views],
            header.dst_regions,
            writes=True,
        )
        per_run = nbytes * count  # each bounded by its region (checked above), not their sum
        if per_run.sum(dtype=np.float64) > 2.0**62:
            raise TransportError("batch runs carry more than 2**62 bytes")
        total = int(per_run.sum())
        if total != header.nbytes:
            raise TransportError(f"batch runs carry {total} bytes, header says {header.nbytes}")
        return views

    def _refuse(self, sock: socket.socket, seq: int, reason: str) -> State:
        """Reply with the reason; the selector then drains what the sender already sent (so
        that it reads the reply rather than a reset) and closes."""
        try:
            _reply(sock, seq, f"agent {self.agent!r}: {reason}")
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            return State.CLOSED
        return State.DRAIN


def arrived(sock: socket.socket, limit: int) -> bool:
    """Whether a whole batch of at most ``limit`` bytes, all told, waits in ``sock``'s buffer,
    so that reading it cannot wait: its prefix and header peeked at, its length compared with
    what the socket holds. A malformed one counts as arrived (reading it refuses it at once)."""
    have = pending(sock)
    prefix = bytearray(wire.PREFIX.size)
    if have < len(prefix) or recv_now(sock, memoryview(prefix), peek=True) != len(prefix):
        return False
    try:
        _, n, hlen = wire.decode_prefix(prefix)
        fixed = len(prefix) + hlen + wire.RUN_FIELDS * 8 * n
        if fixed > min(have, limit):
            return False
        head = bytearray(len(prefix) + hlen)
        if recv_now(sock, memoryview(head), peek=True) != len(head):
            return False
        total = fixed + wire.decode_header(head[len(prefix) :]).nbytes
    except ProtocolError:
        return True
    return total <= min(have, limit)


def _reply(sock: socket.socket, seq: int, *args: Any) -> None:
    """Answer batch ``seq`` (:func:`.tcp_wire.encode_reply`'s message and status)."""
    send_all(sock, views_of([wire.encode_reply(seq, *args)]))


def _land(sock: socket.socket, batch: Batch, pieces: Iterator[wire.Piece], bounce: Bounce) -> int:
    """Receive a batch's pieces, in place into region memory, until the end or until it is
    fenced; returns the payload bytes consumed."""
    got = 0
    for piece in pieces:
        if batch.fenced:
            return got
        if isinstance(piece, wire.Direct):
            buf = piece.buf.data  # region memory: no copy
            pos, n = 0, len(buf)
            while pos < n:
                k = recv_some(sock, buf[pos : pos + _STEP])
                if k == 0:
                    raise ConnectionError(f"connection closed after {got + pos} payload bytes")
                pos += k
                if batch.fenced:
                    return got + pos
            got += n
        else:
            recv_exact(sock, bounce.host[: piece.nbytes].data)
            got += piece.nbytes
            if batch.fenced:
                return got
            piece.scatter(bounce)
    return got


def _discard(sock: socket.socket, n: int, scratch: np.ndarray) -> None:
    """Read ``n`` payload bytes into scratch: the stream stays framed, region memory is not
    touched."""
    view = scratch.data
    while n > 0:
        k = recv_some(sock, view[:n])
        if k == 0:
            raise ConnectionError(f"connection closed with {n} payload bytes to discard")
        n -= k
