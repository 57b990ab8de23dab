"""The control channel refuses what it must and keeps serving."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import zmq

from kvbridge.errors import ProtocolError
from kvbridge.runtime.control import ENGINE_BATCH, ControlChannel, Seal, connection_identity
from kvbridge.wire.protocol import Abort, Heartbeat, Message, RequestMeta, decode, encode


def channel(name: str, token: str, got: list[Message]) -> ControlChannel:
    return ControlChannel(
        name, host="127.0.0.1", token=token, on_message=got.append, on_tick=lambda now: None
    )


def wait_until(cond: object, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_wrong_token_malformed_unknown_and_borrowed_identity_are_refused() -> None:
    got: list[Message] = []
    rx = channel("rx", "secret", got)
    stranger = channel("tx", "", [])  # no token: its MAC is empty
    peer = channel("tx2", "secret", [])  # has the token, speaks for someone else
    rx.start()
    stranger.start()
    peer.start()
    try:
        stranger.send("rx", rx.endpoint, Heartbeat(sender="tx"))
        stranger.send("rx", rx.endpoint, Abort(sender="tx", session=1, room=5, decode_rank=0))
        peer.send_raw("rx", rx.endpoint, b"\x00\x01garbage")
        peer.send_raw(
            "rx", rx.endpoint, encode(Heartbeat(sender="tx2")).replace(b"heartbeat", b"heartbeaT")
        )
        peer.send("rx", rx.endpoint, Abort(sender="tx", session=1, room=6, decode_rank=0))
        peer.send("rx", rx.endpoint, Abort(sender="tx2", session=1, room=7, decode_rank=0))
        assert wait_until(lambda: len(got) == 1)
        assert isinstance(got[0], Abort) and got[0].room == 7
        assert wait_until(lambda: rx.refused == 5)
        assert rx.handler_errors == 0
    finally:
        for c in (stranger, peer, rx):
            c.close()


def _dealer(
    ctx: zmq.Context[zmq.Socket[bytes]], identity: bytes, endpoint: str
) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(endpoint)
    return sock


def test_a_stranger_connected_first_under_a_peers_name_cannot_silence_it() -> None:
    """A ROUTER refuses a second connection presenting an identity already connected. While a
    connection's identity was the agent's name, a stranger without the token who connected
    first under it silenced the peer: none of its messages arrived. With a token a channel's
    identity carries a MAC of the name, which the stranger cannot make: squatting the name,
    or the name with a guessed MAC, takes nothing from the peer."""
    got: list[Message] = []
    rx = channel("decode/decode/0", "secret", got)
    tx = channel("p/prefill/0", "secret", [])
    rx.start()
    tx.start()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    squatters = [
        _dealer(ctx, b"p/prefill/0", rx.endpoint),  # the name alone
        _dealer(ctx, b"p/prefill/0\xff" + bytes(16), rx.endpoint),  # a guessed MAC
    ]
    try:
        for sock in squatters:
            sock.send_multipart([encode(Heartbeat(sender="p/prefill/0")), b""])
        assert wait_until(lambda: rx.refused == 2)  # both connected before the peer
        for _ in range(20):
            tx.send("decode/decode/0", rx.endpoint, Heartbeat(sender="p/prefill/0"))
        assert wait_until(lambda: len(got) == 20), f"{len(got)} of 20 arrived"
        assert rx.refused == 2 and rx.handler_errors == 0
    finally:
        for sock in squatters:
            sock.close(0)
        ctx.term()
        tx.close()
        rx.close()


def test_an_identity_not_made_with_the_token_is_refused_and_the_channel_serves_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    got: list[Message] = []
    rx = channel("rx", "secret", got)
    tx = channel("tx", "secret", [])
    rx.start()
    tx.start()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    proven = connection_identity("tx", b"secret", rx.endpoint)
    identities = [
        b"tx",  # no MAC
        proven[2:],  # no name
        b"tx\xff",  # no MAC after the separator
        b"tx\xff" + bytes(16),  # a wrong one
        connection_identity("tx", b"other", rx.endpoint),  # under another token
        connection_identity("tx", b"secret", tx.endpoint),  # for another endpoint
        connection_identity("ty", b"secret", rx.endpoint),  # a good one, for another agent
    ]
    socks = [_dealer(ctx, i, rx.endpoint) for i in identities]
    try:
        with caplog.at_level("WARNING", logger="kvbridge.control"):
            for sock in socks:  # each sealed with the token: only its identity is wrong
                payload = encode(Heartbeat(sender="tx"))
                sock.send_multipart([payload, Seal(b"secret", rx.endpoint)(payload)])
            assert wait_until(lambda: rx.refused == len(identities))
        unproven = "an identity not proven with this deployment's token"
        assert sum(unproven in r.message for r in caplog.records) == 6
        assert sum("claiming to be from 'tx'" in r.message for r in caplog.records) == 1
        tx.send("rx", rx.endpoint, Heartbeat(sender="tx"))
        assert wait_until(lambda: len(got) == 1)
        assert rx.refused == len(identities) and rx.handler_errors == 0
    finally:
        for sock in socks:
            sock.close(0)
        ctx.term()
        tx.close()
        rx.close()


def test_a_message_over_the_size_bound_never_arrives_and_the_channel_serves_on() -> None:
    got: list[Message] = []
    rx = channel("rx", "", got)
    rx.limit(64 << 10)
    tx = channel("tx", "", [])
    rx.start()
    tx.start()
    try:
        tx.send_raw("rx", rx.endpoint, b"x" * (100 << 20))  # 100 MB, in ZeroMQ's hands now
        other = channel("tx3", "", [])
        other.start()
        other.send("rx", rx.endpoint, Abort(sender="tx3", session=1, room=8, decode_rank=0))
        assert wait_until(lambda: len(got) == 1)
        assert isinstance(got[0], Abort) and got[0].room == 8
        other.close()
    finally:
        tx.close()
        rx.close()


def test_a_handler_that_raises_does_not_stop_the_channel() -> None:
    calls: list[Message] = []
    lock = threading.Lock()

    def handler(msg: Message) -> None:
        with lock:
            calls.append(msg)
        if len(calls) == 1:
            raise RuntimeError("bug in a handler")

    rx = ControlChannel(
        "rx", host="127.0.0.1", token="", on_message=handler, on_tick=lambda now: None
    )
    tx = channel("tx", "", [])
    rx.start()
    tx.start()
    try:
        for room in (1, 2):
            tx.send("rx", rx.endpoint, Abort(sender="tx", session=1, room=room, decode_rank=0))
        assert wait_until(lambda: len(calls) == 2)
        assert wait_until(lambda: rx.handler_errors == 1)
    finally:
        tx.close()
        rx.close()


def test_threads_sending_at_once_each_deliver_every_message_sealed_in_order() -> None:
    """Messages leave on the sending threads (no hand-off to the channel's thread): four
    threads sending to one peer at once, with a token, deliver every message exactly once,
    none refused (each connection's seals count up in the order the messages left), and a
    channel closed right after sending still delivers what it sent."""
    got: list[Message] = []
    rx = channel("rx", "secret", got)
    tx = channel("tx", "secret", [])
    rx.start()
    tx.start()
    try:

        def burst(t: int) -> None:
            for i in range(200):
                tx.send("rx", rx.endpoint, Abort(sender="tx", session=t, room=i, decode_rank=0))

        threads = [threading.Thread(target=burst, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        tx.close()
        assert wait_until(lambda: len(got) == 800, 10.0), len(got)
        assert rx.refused == 0 and rx.handler_errors == 0
        rooms = {(m.session, m.room) for m in got if isinstance(m, Abort)}
        assert rooms == {(t, i) for t in range(4) for i in range(200)}
        for t in range(4):  # one thread's messages arrive in the order it sent them
            assert [m.room for m in got if isinstance(m, Abort) and m.session == t] == list(
                range(200)
            )
    finally:
        rx.close()


def test_an_engine_thread_takes_what_arrived_itself_each_message_once_and_in_order() -> None:
    """ControlChannel.progress: a polling thread takes messages on its own thread, beside the
    channel's thread and without it; the two never hand a message to the handler twice, nor
    out of the order it was sent in, nor lose one."""
    handled: list[tuple[int, str]] = []
    rx = ControlChannel(
        "rx",
        host="127.0.0.1",
        token="secret",
        on_message=lambda m: handled.append((m.room, threading.current_thread().name)),  # type: ignore[attr-defined]
        on_tick=lambda now: None,
    )
    tx = channel("tx", "secret", [])
    try:
        # Its thread not started: only progress() can take the message.
        tx.send("rx", rx.endpoint, Abort(sender="tx", session=1, room=-1, decode_rank=0))
        assert wait_until(lambda: rx.progress() or bool(handled))
        assert handled == [(-1, threading.current_thread().name)]
        handled.clear()
        rx.start()
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():  # an engine's loop, which does other work between
                rx.progress()
                time.sleep(50e-6)

        engine = threading.Thread(target=poll, name="engine")
        engine.start()
        for i in range(2000):
            tx.send("rx", rx.endpoint, Abort(sender="tx", session=1, room=i, decode_rank=0))
            if i % 100 == 0:
                time.sleep(0.005)  # the socket empties now and then: both threads wake again
        assert wait_until(lambda: len(handled) >= 2000, 20.0), len(handled)
        stop.set()
        engine.join()
        time.sleep(0.1)
        assert [room for room, _ in handled] == list(range(2000))
        takers = {name for _, name in handled}
        assert takers == {"engine", "kvbridge-control-rx"}, takers
        assert rx.refused == 0 and rx.handler_errors == 0
    finally:
        tx.close()
        rx.close()


def test_a_request_fingerprint_past_its_bound_is_refused_on_decoding() -> None:
    def meta(size: int) -> RequestMeta:
        return RequestMeta(
            sender="d",
            session=1,
            room=1,
            decode_rank=0,
            tokens=4,
            pages={"g": [0]},
            slots={},
            fingerprint=bytes(range(size)),
        )

    assert decode(encode(meta(64))) == meta(64)
    with pytest.raises(ProtocolError, match="fingerprint"):
        decode(encode(meta(65)))


class _ClosedAfterRelease:
    """A channel's receive lock after whose release by the engine's thread another thread
    closes the channel to its end, then opens a pipe (the interleaving of an engine thread
    preempted there while the engine shuts down): the pipe may get the closed one's numbers."""

    def __init__(self, ch: ControlChannel) -> None:
        self.lock, self.ch, self.opened = threading.Lock(), ch, (-1, -1)

    def acquire(self, blocking: bool = True) -> bool:
        return self.lock.acquire(blocking)

    def __enter__(self) -> _ClosedAfterRelease:
        self.lock.acquire()
        return self

    def __exit__(self, *_: Any) -> None:
        self.lock.release()

    def release(self) -> None:
        self.lock.release()
        if threading.current_thread().name == "engine" and self.opened == (-1, -1):

            def closer() -> None:
                self.ch.close()
                self.opened = os.pipe()

            t = threading.Thread(target=closer)
            t.start()
            t.join()


def test_an_engine_thread_taking_messages_as_the_channel_closes_touches_nothing_closed() -> None:
    """With more messages waiting than an engine's look takes, the look wakes the channel's
    thread for the rest. Done after the look let go of the socket, a close() in between had shut
    the wake pipe: the engine's poll raised EBADF, or wrote into whatever file got its number."""
    rx = channel("rx", "s", [])
    tx = channel("tx", "s", [])
    lock = rx._receiving = _ClosedAfterRelease(rx)  # type: ignore[assignment]
    try:
        for room in range(ENGINE_BATCH + 10):
            tx.send("rx", rx.endpoint, Abort(sender="tx", session=1, room=room, decode_rank=0))
        assert wait_until(lambda: rx._router.getsockopt(zmq.EVENTS) & zmq.POLLIN)
        time.sleep(0.5)  # all of them (over loopback, in well under that)
        out: list[object] = []
        engine = threading.Thread(target=lambda: out.append(rx.progress()), name="engine")
        engine.start()
        engine.join()
        assert out == [True]  # it took messages, raised nothing
        r, w = lock.opened
        os.set_blocking(r, False)
        with pytest.raises(BlockingIOError):  # nothing was written into the new pipe
            os.read(r, 16)
        os.close(r)
        os.close(w)
    finally:
        tx.close()
