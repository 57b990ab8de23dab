"""The tcp receiver decides what lands in its memory: only admitted requests, only from peers
that know the token, never after a fence; and many idle connections cost it no thread.

Agents live in spawned processes (``ProcessAgent``) and talk over real loopback sockets; the
forged clients are plain sockets in this process. Every check is on bytes: the receiver's
regions are filled with canary bytes and read back. Admission and the fence are checked on
device memory too where CUDA is usable (its bytes through the agents' pinned bounce buffers).
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvbridge.memory.device import cuda_unavailable
from kvbridge.memory.location import HOST, Location
from kvbridge.memory.pools import HostPool
from kvbridge.planner.layout import Region
from kvbridge.planner.runs import FIELDS, Runs
from kvbridge.transports import create, tcp_gate
from kvbridge.transports import tcp_wire as wire
from transport_agents import ProcessAgent, raw_connect, read_reply, recv_exact

CTX = multiprocessing.get_context("spawn")
TOKEN = "s3cret-for-tests"
CANARY, FRESH = 0xA5, 0x5A
KIB, MIB = 1 << 10, 1 << 20
_names = itertools.count()
NO_CUDA = cuda_unavailable()
# Where the agents' regions are: host memory, and a GPU's where there is one.
WHERE = [
    pytest.param(None, id="host"),
    pytest.param(
        "cuda:0",
        id="cuda",
        marks=pytest.mark.skipif(NO_CUDA is not None, reason=f"device memory: {NO_CUDA}"),
    ),
]


def _runs(dst_offset: int, nbytes: int, src_offset: int = 0) -> dict[str, np.ndarray]:
    z = lambda a: np.asarray([a], dtype=np.int64)  # noqa: E731
    runs = Runs(z(0), z(src_offset), z(0), z(dst_offset), z(nbytes), z(1), z(0), z(0))
    return {f: getattr(runs, f) for f in FIELDS}


class Link:
    """A sender agent and a receiver agent, each in its own process, with one source region
    (random bytes) and one destination region (canaries)."""

    def __init__(
        self,
        size: int,
        sender: dict[str, Any] | None = None,
        receiver: dict[str, Any] | None = None,
        device: str | None = None,
    ) -> None:
        k = next(_names)
        on = {"token": TOKEN, "device": HOST if device is None else Location.parse(device)}
        self.sender = ProcessAgent(CTX, "tcp", f"tx{k}", {**on, **(sender or {})})
        self.receiver = ProcessAgent(CTX, "tcp", f"rx{k}", {**on, **(receiver or {})})
        self.src, self.dst, self.size = f"s{k}", f"d{k}", size
        self.sender.call("pool", [(self.src, size)], False, seed=k, device=device)
        self.blob = self.receiver.call(
            "pool", [(self.dst, size)], False, fill=CANARY, device=device
        )
        self.sender.call("add_peer", self.receiver.agent, self.blob)
        self.source = np.frombuffer(self.sender.call("read", self.src), dtype=np.uint8)

    def post(
        self, dst_offset: int, nbytes: int, key: tuple[int, int] | None, wait: float | None = 30.0
    ) -> tuple[int, str, str | None]:
        result: tuple[int, str, str | None] = self.sender.call(
            "post",
            self.receiver.agent,
            [self.src],
            [self.dst],
            _runs(dst_offset, nbytes),
            wait=wait,
            key=key,
        )
        return result

    def dst_bytes(self) -> np.ndarray:
        return np.frombuffer(self.receiver.call("read", self.dst), dtype=np.uint8)

    def close(self) -> None:
        for agent in (self.sender, self.receiver):
            with contextlib.suppress(Exception):
                agent.close()


@pytest.fixture
def links() -> Iterator[list[Link]]:
    made: list[Link] = []
    yield made
    for link in made:
        link.close()


def _expect(
    dst: np.ndarray, landed: list[tuple[int, int]], source: np.ndarray, canary: int = CANARY
) -> None:
    """``dst`` holds the source's bytes at each (offset, nbytes) in ``landed`` (the runs copy
    source offset 0), and the canary everywhere else."""
    want = np.full(len(dst), canary, dtype=np.uint8)
    for off, n in landed:
        want[off : off + n] = source[:n]
    bad = np.flatnonzero(dst != want)
    assert not len(bad), f"{len(bad)} wrong bytes, first at {bad[:5].tolist()}"


def _leftover(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """What the peer still sends before it closes (b"" for a connection closed at once)."""
    sock.settimeout(timeout)
    got = b""
    with contextlib.suppress(ConnectionResetError, BrokenPipeError):
        while chunk := sock.recv(1 << 16):
            got += chunk
    return got


def _closed_after_challenge(sock: socket.socket) -> bool:
    """Whether the receiver, having sent ``sock`` its challenge, closed it (within 0.5 s)."""
    _challenge(sock)
    sock.settimeout(0.5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _challenge(sock: socket.socket) -> bytes:
    sock.settimeout(10.0)
    return wire.decode_challenge(recv_exact(sock, wire.CHALLENGE.size, "its challenge"))


def _reply(sock: socket.socket) -> tuple[int, wire.Status, str]:
    return read_reply(sock, 10.0)


def _batch(
    seq: int,
    sender: str,
    receiver: str,
    region: str,
    offset: int,
    nbytes: int,
    key: tuple[int, int] | None,
) -> bytes:
    header = wire.BatchHeader(sender, receiver, (region,), nbytes, key)
    runs = np.array([[0], [offset], [nbytes], [1], [0]], dtype=np.int64)
    return wire.encode_batch(seq, header, runs)


# ---- (a) admission ----------------------------------------------------------------------------


@pytest.mark.slow  # starts processes: the fast tier's are in-process
@pytest.mark.parametrize("device", WHERE)
def test_only_admitted_requests_land(links: list[Link], device: str | None) -> None:
    """Admitted key: lands. Never admitted, fenced, or no key: FAILED with the reason, and
    not one byte of it lands; the connection stays up for the admitted request after."""
    link = Link(1 * MIB, receiver={"admission": True}, device=device)
    links.append(link)
    rx = link.receiver
    rx.call("admit", (1, 1))
    assert link.post(0, 64 * KIB, (1, 1))[1:] == ("DONE", None)

    _, state, error = link.post(64 * KIB, 64 * KIB, (1, 2))
    assert state == "FAILED" and error and "request (1, 2) was not admitted" in error, error
    rx.call("admit", (1, 3))
    assert rx.call("fence", (1, 3), 5.0) is True
    _, state, error = link.post(128 * KIB, 64 * KIB, (1, 3))
    assert state == "FAILED" and error and "request (1, 3) was fenced" in error, error
    _, state, error = link.post(192 * KIB, 64 * KIB, None)
    assert state == "FAILED" and error and "names no request" in error, error
    # A large refused batch (its payload is read and dropped, not written).
    _, state, error = link.post(0, 1 * MIB, (1, 4))
    assert state == "FAILED" and error and "not admitted" in error, error

    assert link.post(256 * KIB, 64 * KIB, (1, 1))[1:] == ("DONE", None)
    _expect(link.dst_bytes(), [(0, 64 * KIB), (256 * KIB, 64 * KIB)], link.source)
    assert rx.call("attr", "refused") == 0


def test_a_refused_batch_keeps_the_connection() -> None:
    """On one authenticated connection: a batch of a key not admitted is answered DISCARDED
    (nothing written), and the next batch, admitted, lands on the same connection."""
    rx = create("tcp", "rx-keep", token=TOKEN, admission=True)
    pool = HostPool([Region("d", 64 * KIB)], shared=False)
    try:
        pool.view("d")[:] = CANARY
        rx.register(pool.regions())
        rx.admit((5, 1))
        with raw_connect(rx.address, "tx-keep", TOKEN) as s:  # type: ignore[attr-defined]
            s.sendall(_batch(1, "tx-keep", "rx-keep", "d", 0, 4096, (5, 2)) + b"\x01" * 4096)
            seq, status, msg = _reply(s)
            assert (seq, status) == (1, wire.Status.DISCARDED) and "not admitted" in msg
            assert (pool.view("d") == CANARY).all()
            s.sendall(_batch(2, "tx-keep", "rx-keep", "d", 100, 4096, (5, 1)) + b"\x02" * 4096)
            assert _reply(s)[:2] == (2, wire.Status.OK)
        d = pool.view("d")
        assert (d[100:4196] == 2).all() and (d[:100] == CANARY).all() and (d[4196:] == CANARY).all()
    finally:
        rx.close()
        pool.close()


# ---- (b) authentication -----------------------------------------------------------------------


@pytest.mark.slow  # waits out a silent peer's handshake deadline
def test_clients_without_the_token_cannot_write_a_byte(links: list[Link]) -> None:
    """Forged clients: a well-formed batch without answering the challenge, a well-formed
    answer with a wrong HMAC, an answer replayed from another nonce, and a peer that never
    answers: each connection is closed without a byte sent back, and nothing lands. A real
    peer's transfer beside them succeeds, and a real agent with the wrong token fails with a
    reason."""
    link = Link(256 * KIB, receiver={"connect_timeout": 2.0})
    links.append(link)
    rx, address = link.receiver, tuple(link.receiver.call("attr", "address"))
    batch = _batch(1, link.sender.agent, rx.agent, link.dst, 0, 4096, None) + b"\x01" * 4096
    forged = []
    # 1. No handshake: the batch right away (the challenge is ignored).
    s = socket.create_connection(address, timeout=10)
    _challenge(s)
    s.sendall(batch)
    forged.append(s)
    # 2. A well-formed answer under the wrong token, then the batch.
    s = socket.create_connection(address, timeout=10)
    s.sendall(wire.encode_answer("not-the-token", _challenge(s), link.sender.agent) + batch)
    forged.append(s)
    # 3. The right token's answer, but to another nonce (a replayed answer).
    s = socket.create_connection(address, timeout=10)
    _challenge(s)
    s.sendall(wire.encode_answer(TOKEN, secrets.token_bytes(32), link.sender.agent) + batch)
    forged.append(s)
    # 4. Half an answer, then silence: it holds no worker, and is dropped at connect_timeout.
    stalled = socket.create_connection(address, timeout=10)
    stalled.sendall(wire.encode_answer(TOKEN, _challenge(stalled), "x")[:10])

    assert link.post(8 * KIB, 8 * KIB, None)[1:] == ("DONE", None)  # beside them
    for s in [*forged, stalled]:
        assert _leftover(s) == b""
        s.close()
    wrong = ProcessAgent(CTX, "tcp", "tx-wrong", {"token": "wrong"})
    try:
        wrong.call("pool", [("w", 4096)], False, fill=1)
        wrong.call("add_peer", rx.agent, link.blob)
        _, state, error = wrong.call("post", rx.agent, ["w"], [link.dst], _runs(0, 4096), wait=30.0)
        assert state == "FAILED" and error and "token" in error, error
    finally:
        wrong.close()
    _expect(link.dst_bytes(), [(8 * KIB, 8 * KIB)], link.source)
    # 4 forged connections, and the wrong-token agent's 2 (it tries a failed handshake twice)
    assert rx.call("attr", "refused") == 6


@pytest.mark.slow  # a receiver stopped for 2.5 s
def test_a_pause_of_the_receiver_is_not_charged_to_a_peer_mid_handshake(links: list[Link]) -> None:
    """A frozen host (here: the receiver stopped, the client answering only after it
    resumed) must not cost a peer its connection: the receiver gets the deadline back for
    the time it did not run. A peer that never answers is still dropped after that."""
    # 2 s to answer: the challenges come and the receiver stops within it on a loaded machine
    # (with 1 s, a CI run's receiver dropped the late peer before it was stopped).
    link = Link(64 * KIB, receiver={"connect_timeout": 2.0})
    links.append(link)
    rx, address = link.receiver, tuple(link.receiver.call("attr", "address"))
    pid = rx.call("pid")
    late = socket.create_connection(address, timeout=10)
    silent = socket.create_connection(address, timeout=10)
    nonce = _challenge(late)
    _challenge(silent)
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(4.0)  # both handshakes' deadlines pass while the receiver cannot run
    finally:
        os.kill(pid, signal.SIGCONT)
    time.sleep(0.3)  # it runs again before the answer comes, as after a frozen VM
    late.sendall(wire.encode_answer(TOKEN, nonce, link.sender.agent))
    assert recv_exact(late, wire.WELCOME.size, "the welcome") == wire.WELCOME_BYTES
    t0 = time.monotonic()
    assert _leftover(silent) == b""  # dropped, a connect_timeout after the pause
    assert time.monotonic() - t0 < 5.0
    assert rx.call("attr", "refused") == 1
    late.close()
    silent.close()


@pytest.mark.slow  # starts processes: the fast tier's are in-process
def test_an_authenticated_peer_cannot_write_as_another(links: list[Link]) -> None:
    """The handshake proves one agent id; a batch that names another sender is refused."""
    link = Link(64 * KIB)
    links.append(link)
    address = tuple(link.receiver.call("attr", "address"))
    with raw_connect(address, "mallory", TOKEN) as s:  # type: ignore[arg-type]
        s.sendall(
            _batch(1, link.sender.agent, link.receiver.agent, link.dst, 0, 4096, None)
            + b"\x01" * 4096
        )
        seq, status, msg = _reply(s)
    assert (seq, status) == (1, wire.Status.REFUSED)
    assert "authenticated as 'mallory'" in msg
    _expect(link.dst_bytes(), [], link.source)


# ---- (c) fencing a batch in progress ----------------------------------------------------------


@pytest.mark.slow  # a 128 MiB batch, the receiver stopped
@pytest.mark.parametrize("device", WHERE)
def test_fence_cuts_off_a_stopped_sender_mid_batch(links: list[Link], device: str | None) -> None:
    """The sender is stopped (SIGSTOP) with a 128 MiB batch half-received. fence returns
    True; fresh canaries written after it stay intact when the sender resumes, and the
    sender's handle ends FAILED. The receiver serves the next request."""
    size = 128 * MIB
    link = Link(size, sender={"streams": 1}, receiver={"admission": True}, device=device)
    links.append(link)
    tx, rx = link.sender, link.receiver
    rx.call("admit", (7, 0))
    assert link.post(0, 4096, (7, 0))[1:] == ("DONE", None)  # connected and authenticated
    rx.call("admit", (7, 1))
    untouched = rx.call("count", link.dst, CANARY)
    os.kill(rx.proc.pid, signal.SIGSTOP)
    try:
        hid, _, _ = link.post(0, size, (7, 1), wait=None)
        assert tx.call("wait", hid, 0.5)[0] == "PENDING"  # 128 MiB cannot all be buffered
        os.kill(tx.proc.pid, signal.SIGSTOP)
    finally:
        os.kill(rx.proc.pid, signal.SIGCONT)
    try:
        # The receiver takes what the sockets buffered (the stopped sender's kernel still
        # sends what it had queued), then waits in recv for the stopped sender.
        end, last = time.monotonic() + 30, untouched
        while True:
            now = rx.call("count", link.dst, CANARY)
            if now < untouched and now == last:
                break
            assert time.monotonic() < end, "the batch never started, or never stalled"
            last = now
            time.sleep(0.3)
        assert rx.call("fence", (7, 1), 5.0) is True
        rx.call("fill", link.dst, FRESH)
    finally:
        os.kill(tx.proc.pid, signal.SIGCONT)
    state, error, _ = tx.call("wait", hid, 60.0)
    assert state == "FAILED" and error, (state, error)
    _expect(link.dst_bytes(), [], link.source, canary=FRESH)
    rx.call("admit", (7, 2))
    assert link.post(8192, 4096, (7, 2))[1:] == ("DONE", None)
    _expect(link.dst_bytes(), [(8192, 4096)], link.source, canary=FRESH)


def test_fence_mid_payload_drops_the_rest_and_keeps_the_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A live sender's batch is fenced after 1 MiB of 8 landed: the rest is read and dropped
    (fresh canaries written after fence returns stay intact), the batch is answered
    DISCARDED (fenced), and the same connection carries the next admitted batch."""
    monkeypatch.setattr(tcp_gate, "_FENCE_GRACE", 60.0)  # the worker must leave by itself
    rx = create("tcp", "rx-mid", token=TOKEN, admission=True)
    pool = HostPool([Region("d", 8 * MIB)], shared=False)
    gate = rx._server.gate  # type: ignore[attr-defined]
    try:
        d = pool.view("d")
        d[:] = CANARY
        rx.register(pool.regions())
        rx.admit((9, 1))
        rx.admit((9, 2))
        with raw_connect(rx.address, "tx-mid", TOKEN) as s:  # type: ignore[attr-defined]
            s.sendall(_batch(1, "tx-mid", "rx-mid", "d", 0, 8 * MIB, (9, 1)) + b"\x01" * MIB)
            end = time.monotonic() + 30
            while d[MIB - 1] != 1:
                assert time.monotonic() < end, "the first MiB never landed"
                time.sleep(0.01)
            result: list[bool] = []
            fencer = threading.Thread(target=lambda: result.append(rx.fence((9, 1), 90.0)))
            fencer.start()
            # Flagged (or already left by itself, between two receive steps): either way
            # the worker writes no more region memory once fence has returned.
            while not result and not any(b.fenced for b in gate._active.get((9, 1), ())):
                time.sleep(0.01)
            s.sendall(b"\x02" * (7 * MIB))  # the sender goes on: the worker sees the flag
            fencer.join(60)
            assert result == [True]
            d[:] = FRESH
            seq, status, msg = _reply(s)
            assert (seq, status) == (1, wire.Status.DISCARDED) and "fenced" in msg, msg
            assert (d == FRESH).all()
            s.sendall(_batch(2, "tx-mid", "rx-mid", "d", 0, 4096, (9, 2)) + b"\x03" * 4096)
            assert _reply(s)[:2] == (2, wire.Status.OK)
        assert (d[:4096] == 3).all() and (d[4096:] == FRESH).all()
    finally:
        rx.close()
        pool.close()


def test_fence_without_admission_cuts_off_a_stalled_batch() -> None:
    """Admission off (the default): a batch whose sender stalls after 1 MiB of 8 is cut off
    by fence (its connection shut down); nothing it sends later lands, and later batches of
    the same key still land, as before fencing existed."""
    rx = create("tcp", "rx-noadm", token=TOKEN)
    pool = HostPool([Region("d", 8 * MIB)], shared=False)
    try:
        d = pool.view("d")
        d[:] = CANARY
        rx.register(pool.regions())
        assert rx.fence((3, 0), 0.0) is True  # nothing in flight: at once
        with raw_connect(rx.address, "tx-noadm", TOKEN) as s:  # type: ignore[attr-defined]
            s.sendall(_batch(1, "tx-noadm", "rx-noadm", "d", 0, 8 * MIB, (3, 1)) + b"\x01" * MIB)
            end = time.monotonic() + 30
            while d[MIB - 1] != 1:
                assert time.monotonic() < end, "the first MiB never landed"
                time.sleep(0.01)
            assert rx.fence((3, 1), 5.0) is True
            d[:] = FRESH
            with contextlib.suppress(OSError):
                s.sendall(b"\x02" * (7 * MIB))
            # Shut down while blocked in recv (no reply), or, if fence caught the worker
            # between two receive steps, the rest dropped and the batch answered "fenced".
            s.settimeout(10.0)
            try:
                first = s.recv(1)
            except ConnectionResetError:
                first = b""
            if first:
                s.setblocking(True)
                head = first + s.recv(wire.REPLY.size - 1, socket.MSG_WAITALL)
                _, status, mlen = wire.decode_reply(head)
                msg = s.recv(mlen, socket.MSG_WAITALL).decode()
                assert status is wire.Status.DISCARDED and "fenced" in msg, msg
        assert (d == FRESH).all()
        with raw_connect(rx.address, "tx-noadm", TOKEN) as s:  # type: ignore[attr-defined]
            s.sendall(_batch(2, "tx-noadm", "rx-noadm", "d", 0, 4096, (3, 1)) + b"\x03" * 4096)
            assert _reply(s)[:2] == (2, wire.Status.OK)
        assert (d[:4096] == 3).all() and (d[4096:] == FRESH).all()
    finally:
        rx.close()
        pool.close()


# ---- (d) idle connections cost no thread -----------------------------------------------------


def test_sockets_held_without_the_token_never_keep_a_peer_out() -> None:
    """Anyone who reaches the port can open sockets and say nothing: they counted against
    max_connections with the authenticated ones, and enough of them (opened again every
    connect_timeout) turned a real peer's new connection away. The oldest still in its
    handshake now gives way to a new connection."""
    rx = create("tcp", "rx-slots", token=TOKEN, max_connections=16, connect_timeout=30.0)
    held = [socket.create_connection(rx.address, timeout=10) for _ in range(16)]
    try:
        for sock in held:
            _challenge(sock)  # all accepted: the receiver is full
        with raw_connect(rx.address, "honest", TOKEN):  # type: ignore[arg-type]
            assert _leftover(held[0], timeout=5.0) == b""  # the oldest, closed for it
            held[1].settimeout(0.3)
            with pytest.raises(TimeoutError):  # the next one still waits for its answer
                held[1].recv(1)
        assert rx.over_limit == 1
    finally:
        for sock in held:
            sock.close()
        rx.close()


@pytest.mark.slow  # 500 connections
def test_idle_connections_leave_threads_bounded(links: list[Link]) -> None:
    """500 idle authenticated connections: the receiving process's thread count does not
    move, transfers (over an old connection and a new one) still land, past max_connections
    a connection still in its handshake gives way to the next (an authenticated one never),
    and close() closes them all."""
    link = Link(1 * MIB, sender={"streams": 1}, receiver={"max_connections": 510})
    links.append(link)
    rx = link.receiver
    address = tuple(rx.call("attr", "address"))
    assert link.post(0, 64 * KIB, None)[1:] == ("DONE", None)  # 1 connection
    before = rx.call("threads")
    idle = [raw_connect(address, f"idle{i}", TOKEN) for i in range(500)]  # type: ignore[arg-type]
    try:
        during = rx.call("threads")
        assert during[0] <= before[0] + 1 and during[1] <= before[1] + 1, (before, during)
        assert link.post(64 * KIB, 64 * KIB, None)[1:] == ("DONE", None)
        late = ProcessAgent(CTX, "tcp", "tx-late", {"token": TOKEN, "streams": 1})
        try:
            late.call("pool", [("l", 4096)], False, fill=9)
            late.call("add_peer", rx.agent, link.blob)
            assert late.call(
                "post", rx.agent, ["l"], [link.dst], _runs(512 * KIB, 4096), wait=30.0
            )[1:] == ("DONE", None)  # connection 502
            over = [socket.create_connection(address, timeout=10) for _ in range(30)]
            time.sleep(0.5)  # all accepted
            # 502 + 8 = max_connections: each of the 30 got its challenge, and the 22 oldest
            # of them, silent in their handshake, were closed for the ones after them.
            open_ = [not _closed_after_challenge(s) for s in over]
            assert open_ == [False] * 22 + [True] * 8, open_
            for s in over:
                s.close()
            assert rx.call("attr", "over_limit") == 22
            after = rx.call("threads")
            assert after[1] <= before[1] + 8, (before, after)  # at most the receive workers
        finally:
            late.close()
        want = np.full(link.size, CANARY, dtype=np.uint8)
        want[: 64 * KIB] = want[64 * KIB : 128 * KIB] = link.source[: 64 * KIB]
        want[512 * KIB : 512 * KIB + 4096] = 9
        assert np.array_equal(link.dst_bytes(), want)
        rx.call("close_transport")  # the process stays: its sockets close only if close() does
        assert all(_leftover(s) == b"" for s in idle)
    finally:
        for s in idle:
            s.close()
