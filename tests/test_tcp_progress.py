"""The engine's polling thread reads what arrived whole (Transport.progress): tcp's receiving
side, with its selector and workers starved of the interpreter as a polling engine starves
them; and the test a poller makes before it reads, that a whole batch is there to read."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvbridge.memory.pools import HostPool
from kvbridge.planner.layout import Region
from kvbridge.transports import TransportOptions, create
from kvbridge.transports import tcp_wire as wire
from kvbridge.transports.sockio import HELD
from kvbridge.transports.tcp_batch import BatchReader, State, arrived
from transport_agents import raw_connect, read_reply

TOKEN = "progress-token"
KIB = 1024

pytestmark = pytest.mark.skipif(not HELD, reason="libc's socket calls are Linux's")


def _batch(seq: int, sender: str, receiver: str, offset: int, payload: bytes) -> bytes:
    header = wire.BatchHeader(sender, receiver, ("d",), len(payload), None)
    runs = np.array([[0], [offset], [len(payload)], [1], [0]], dtype=np.int64)
    return wire.encode_batch(seq, header, runs) + payload


def _idle_connections(t: Any) -> int:
    server = t._server
    with server._lock:
        return sum(1 for c in server._conns if c.state is State.IDLE and c.listed)


def until(check: Any, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_a_poller_reads_only_a_batch_that_arrived_whole(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    tx, rx = pair
    data = _batch(1, "a", "b", 0, bytes(range(256)) * 16)
    assert not arrived(rx, 1 << 20)  # nothing yet
    for cut in (5, wire.PREFIX.size + 3, len(data) - 4096, len(data) - 1):
        tx.sendall(data[:cut])
        assert not arrived(rx, 1 << 20), cut  # the prefix, the header or the payload short
        rx.recv(cut)  # peeking consumed nothing: take it back out for the next cut
    tx.sendall(data)
    assert arrived(rx, 1 << 20)
    assert not arrived(rx, len(data) - 1)  # whole, but over the poller's limit: a worker's
    assert rx.recv(len(data) + 1) == data  # still all there, nothing consumed
    tx.sendall(b"GARBAGE!" * 8)  # not a batch: read (and refused) at once, never waited on
    assert arrived(rx, 1 << 20)


def test_the_polling_thread_reads_a_batch_its_selector_could_not() -> None:
    """A polling loop that never gives the interpreter away (the switch interval raised to
    10 s): the agent's selector thread, woken by the batch, cannot run; the poller reads the
    batch itself, lands its bytes and acknowledges it."""
    t = create("tcp", "rx-poll", token=TOKEN)
    pool = HostPool([Region("d", 64 * KIB)], shared=False)
    interval = sys.getswitchinterval()
    try:
        pool.view("d")[:] = 0xEE
        t.register(pool.regions())
        payload = np.random.default_rng(3).integers(0, 256, 8 * KIB, dtype=np.uint8).tobytes()
        with raw_connect(t.address, "tx-poll", TOKEN) as s:  # type: ignore[attr-defined]
            # The selector ends the handshake after the welcome went out: only then is the
            # connection idle, and a poller's to take (else it would wait 10 s for it).
            idle = until(lambda: _idle_connections(t) == 1)
            assert idle, "the handshake never ended"
            sys.setswitchinterval(10.0)
            child = os.fork()
            if child == 0:  # the sender, once the parent polls
                time.sleep(0.3)
                s.sendall(_batch(7, "tx-poll", "rx-poll", 4 * KIB, payload))
                os._exit(0)
            read, end = 0, time.monotonic() + 5.0
            while not read and time.monotonic() < end:
                read = t.progress()
            sys.setswitchinterval(interval)
            os.waitpid(child, 0)
            assert read == 1
            assert read_reply(s, 10.0) == (7, wire.Status.OK, "")
        got = pool.view("d")
        assert got[4 * KIB : 12 * KIB].tobytes() == payload
        assert (got[: 4 * KIB] == 0xEE).all() and (got[12 * KIB :] == 0xEE).all()
    finally:
        sys.setswitchinterval(interval)
        t.close()
        pool.close()


@pytest.mark.parametrize("quick", [True, False])
def test_the_selector_reads_a_small_batch_itself_unless_notices_are_slow(
    quick: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small batch that arrived whole is read by the selector thread that saw it, not
    handed to a receive worker (whose wake-up and hand-off cost a small request more than its
    bytes); one whose first bytes woke the selector before the rest came goes to a worker, so
    of ten batches some, not all, may. In integrity mode (the runtime's ``quick_notices`` off:
    a notice's check reads its whole chunk) workers read them all: the selector stays free."""
    readers: list[str] = []
    read = BatchReader.read

    def noted(self: BatchReader, *args: Any) -> State:
        readers.append(threading.current_thread().name)
        return read(self, *args)

    monkeypatch.setattr(BatchReader, "read", noted)
    agent = f"rx-select-{quick}"
    t = create("tcp", agent, TransportOptions(token=TOKEN, quick_notices=quick))
    pool = HostPool([Region("d", 64 * KIB)], shared=False)
    try:
        t.register(pool.regions())
        payload = bytes(range(256)) * 4
        with raw_connect(t.address, "tx-select", TOKEN) as s:  # type: ignore[attr-defined]
            for seq in range(1, 11):
                s.sendall(_batch(seq, "tx-select", agent, 0, payload))
                assert read_reply(s, 10.0) == (seq, wire.Status.OK, "")
        assert pool.view("d")[: len(payload)].tobytes() == payload
        assert len(readers) >= 10  # a batch whose bytes came in pieces is read in calls
        by_selector = readers.count(f"kvbridge-tcp-{agent}-select")
        assert by_selector > 0 if quick else by_selector == 0, readers
    finally:
        t.close()
        pool.close()


@pytest.mark.skipif(not HELD, reason="no libc calls that keep the interpreter here")
def test_only_small_socket_calls_keep_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy of more than HELD_MAX bytes between the kernel and user memory gives the
    interpreter away (tcp's two workers and two streams copy at once); a small one keeps it
    (an engine thread reading a small batch never waits for the interpreter)."""
    from kvbridge.transports import sockio

    kept: list[int] = []
    recv_now, send_now = sockio.recv_now, sockio.send_now
    monkeypatch.setattr(
        sockio, "recv_now", lambda s, v, peek=False: kept.append(len(v)) or recv_now(s, v, peek)
    )
    monkeypatch.setattr(
        sockio, "send_now", lambda s, vs: kept.append(sum(map(len, vs))) or send_now(s, vs)
    )
    small, big = 1024, sockio.HELD_MAX + 1
    a, b = socket.socketpair()
    with a, b:
        for n in (small, big):
            payload = os.urandom(n)
            kept.clear()
            sending = threading.Thread(target=sockio.send_all, args=(a, sockio.views_of([payload])))
            sending.start()  # more than the pair's buffers hold: it waits for the reads
            got = bytearray(n)
            sockio.recv_exact(b, memoryview(got))
            sending.join(10)
            assert got == payload
            if n == small:
                assert kept == [n, n]  # one held send, one held read
            else:  # what is left of it once under HELD_MAX may be held, never more
                assert all(k <= sockio.HELD_MAX for k in kept), kept
