"""A control message read off the wire cannot be sent again: real ZeroMQ traffic between two
tokened control channels is captured from the loopback interface (a raw packet socket), its
ZMTP stream reassembled into the messages as they travelled (bytes and seal), and each is sent
again under the sender's own identity: to the same rank in the same session, after the sender
restarted, to another rank, and to the receiver restarted. Every replay is refused and counted;
no handler sees it. The seal's time window is checked without waiting five minutes.

The capture needs Linux and root (skipped, saying why); the window and sequence checks do not.
"""

from __future__ import annotations

import socket
import struct
import time
from types import SimpleNamespace

import numpy as np
import pytest
import zmq

from kvbridge.runtime import control
from kvbridge.runtime.control import ControlChannel, Seal, connection_identity
from kvbridge.transports.tcp_wire import ANSWER_MAGIC
from kvbridge.wire.protocol import Abort, Heartbeat, Message, decode
from test_control import wait_until
from wire import capture, stream_to

TOKEN = "s3cret"


def channel(name: str, got: list[Message]) -> ControlChannel:
    c = ControlChannel(
        name, host="127.0.0.1", token=TOKEN, on_message=got.append, on_tick=lambda now: None
    )
    c.start()
    return c


def zmtp_messages(stream: bytes) -> list[list[bytes]]:
    """The messages of a ZMTP 3 stream (after the 64-byte greeting; commands skipped)."""
    assert stream[:1] == b"\xff" and stream[9:10] == b"\x7f", "not a ZMTP greeting"
    at, out, parts = 64, [], []
    while at < len(stream):
        flags = stream[at]
        if flags & 0x02:  # long frame
            (size,) = struct.unpack("!Q", stream[at + 1 : at + 9])
            at += 9
        else:
            size, at = stream[at + 1], at + 2
        body, at = stream[at : at + size], at + size
        if flags & 0x04:  # a command (READY, ...)
            continue
        parts.append(body)
        if not flags & 0x01:  # the last frame of a message
            out.append(parts)
            parts = []
    return out


def replay(ctx: zmq.Context[zmq.Socket[bytes]], identity: bytes, endpoint: str, msgs: list) -> None:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(endpoint)
    for m in msgs:
        sock.send_multipart(m)
    sock.close(1000)


# Each wait ends as soon as its message is handled; the bound only says when to give up, and
# this machine stalls for tens of seconds under the suite's load (a 5 s bound failed once).
SETTLE = 60.0


def test_captured_control_messages_are_refused_when_sent_again() -> None:
    got: list[Message] = []
    rx = channel("decode-0", got)
    other_got: list[Message] = []
    other = channel("decode-1", other_got)
    port = int(rx.endpoint.rsplit(":", 1)[1])
    sent = [Abort(sender="prefill-0", session=1, room=r, decode_rank=0) for r in range(5)]
    with capture() as frames:
        tx = channel("prefill-0", [])
        for m in sent:
            tx.send("decode-0", rx.endpoint, m)
        assert wait_until(lambda: len(got) == len(sent), SETTLE)
        tx.close()  # the sender's connection ends: its identity is free to borrow
    wire = zmtp_messages(stream_to(frames, port))
    assert [decode(m[0]) for m in wire] == sent, "the capture is not what was sent"
    assert all(len(m) == 2 and len(m[1]) == 64 for m in wire)  # bytes and seal
    # The sender's identity, as its connection's handshake showed it on the wire.
    captured = connection_identity("prefill-0", TOKEN.encode(), rx.endpoint)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        # The same session, the sender's own identity: each message once.
        replay(ctx, captured, rx.endpoint, wire)
        assert wait_until(lambda: rx.refused == len(wire), SETTLE)
        # The sender restarted (a new connection, numbered from 1 again), then the old ones.
        tx = channel("prefill-0", [])
        tx.send("decode-0", rx.endpoint, Heartbeat(sender="prefill-0"))
        assert wait_until(lambda: len(got) == len(sent) + 1, SETTLE)
        tx.close()
        replay(ctx, captured, rx.endpoint, wire)
        assert wait_until(lambda: rx.refused == 2 * len(wire), SETTLE)
        # Another rank: sealed for decode-0's endpoint, not decode-1's.
        replay(ctx, captured, other.endpoint, wire)
        assert wait_until(lambda: other.refused == len(wire), SETTLE)
        # The receiver restarted (a fresh memory of what it saw, another endpoint).
        rx.close()
        rx = channel("decode-0", got)
        replay(ctx, captured, rx.endpoint, wire)
        assert wait_until(lambda: rx.refused == len(wire), SETTLE)
        time.sleep(0.2)
        assert len(got) == len(sent) + 1 and not other_got  # no replay reached a handler
    finally:
        ctx.term()
        rx.close()
        other.close()


def test_a_seal_is_good_once_for_its_rank_within_its_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    unsealer = control._Unsealer(TOKEN.encode(), "tcp://127.0.0.1:1")
    seal = Seal(TOKEN.encode(), "tcp://127.0.0.1:1")
    first, second = seal(b"a"), seal(b"b")
    assert unsealer.check(b"p", b"b", second) is None
    assert "replay: message 1 of its connection, after 2" in str(unsealer.check(b"p", b"a", first))
    assert "wrong MAC" in str(unsealer.check(b"p", b"c", seal(b"b")))  # another payload
    elsewhere = Seal(TOKEN.encode(), "tcp://127.0.0.1:2")
    assert "wrong MAC" in str(unsealer.check(b"p", b"x", elsewhere(b"x")))
    assert "a seal of 3 bytes" in str(unsealer.check(b"p", b"x", b"abc"))
    late = Seal(TOKEN.encode(), "tcp://127.0.0.1:1")(b"x")
    monkeypatch.setattr(control, "WINDOW", 0.05)
    time.sleep(0.1)
    assert "from this rank's clock" in str(unsealer.check(b"p", b"x", late))


@pytest.mark.slow  # starts processes: the fast tier's are in-process
def test_a_captured_tcp_data_connection_sent_again_writes_nothing() -> None:
    """The ``tcp`` data port: a connection's bytes (its answer to the challenge, then its
    batches) captured and sent again on a new connection are refused at the handshake, since
    each connection is challenged with a fresh nonce: the connection is closed without a byte
    back, and not one byte of the receiver's memory changes."""
    from test_tcp_fencing import KIB, Link, _challenge, _expect, _leftover

    link = Link(64 * KIB)
    try:
        address = tuple(link.receiver.call("attr", "address"))
        with capture() as frames:
            assert link.post(4 * KIB, 8 * KIB, None)[1:] == ("DONE", None)
        stream = stream_to(frames, address[1])
        assert stream[:4] == ANSWER_MAGIC and len(stream) > 8 * KIB, "not the whole connection"
        before = link.dst_bytes().copy()
        refused = link.receiver.call("attr", "refused")
        s = socket.create_connection(address, timeout=10)
        _challenge(s)  # a fresh nonce, which the captured answer does not prove
        s.sendall(stream)
        assert _leftover(s) == b""
        s.close()
        assert link.receiver.call("attr", "refused") == refused + 1
        np.testing.assert_array_equal(link.dst_bytes(), before)
        _expect(before, [(4 * KIB, 8 * KIB)], link.source)
    finally:
        link.close()


def test_a_connection_is_forgotten_only_once_its_messages_are_too_old(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """By the time sealed in its messages, not by when they came: a sender whose clock runs
    ahead must not get a message accepted twice once the receiver forgets its connection."""
    clock = [1000.0]
    monkeypatch.setattr(control, "time", SimpleNamespace(time=lambda: clock[0]))
    monkeypatch.setattr(control, "WINDOW", 10.0)
    key, endpoint = TOKEN.encode(), "tcp://127.0.0.1:1"
    unsealer = control._Unsealer(key, endpoint)
    clock[0] += 8  # the sender's clock: 8 s ahead
    early = Seal(key, endpoint)(b"x")
    clock[0] -= 8
    assert unsealer.check(b"p", b"x", early) is None
    clock[0] += 11  # 11 s after it came, 3 s after the time sealed in it
    assert unsealer.check(b"p", b"y", Seal(key, endpoint)(b"y")) is None  # a new connection
    assert "replay" in str(unsealer.check(b"p", b"x", early))
    clock[0] += 8  # now too old by its own time: forgotten, and refused by the clock
    assert unsealer.check(b"p", b"z", Seal(key, endpoint)(b"z")) is None
    assert "from this rank's clock" in str(unsealer.check(b"p", b"x", early))
