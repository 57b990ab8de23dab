"""One contract suite for every transport: bytes land where the runs say, nothing else moves,
bad input is refused before any write, and no transfer waits forever.

inproc agents live in this process; every other transport's agents each live in a spawned
process (the receiver allocates its pool and sends its metadata back over a Pipe, the sender
posts), and the test compares the receiver's bytes with a plain Python reference copy.

nixl and mooncake run when their library loads here and are skipped, with the reason, when
it does not (``scripts/test.sh`` installs them).
"""

from __future__ import annotations

import gc
import itertools
import multiprocessing
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from kvbridge.errors import TransportError, TransportUnavailable
from kvbridge.memory.pools import SEGMENT_PREFIX, HostPool, unlink_segment
from kvbridge.planner.layout import Region
from kvbridge.planner.runs import FIELDS, Runs
from kvbridge.transports import create, unavailable
from kvbridge.transports import tcp_wire as wire
from kvbridge.transports._common import METADATA_VERSION
from transport_agents import LocalAgent, ProcessAgent, raw_connect, read_reply

TRANSPORTS = ["inproc", "shm", "tcp", "nixl", "mooncake"]
CANARY = 0xA5
CTX = multiprocessing.get_context("spawn")
_names = itertools.count()


@dataclass
class Pair:
    transport: str
    sender: Any
    receiver: Any

    @property
    def shared(self) -> bool:
        return self.transport == "shm"


def require(transport: str) -> None:
    """Skip, saying why, when the transport's library cannot load in this environment."""
    reason = unavailable(transport)
    if reason is not None:
        pytest.skip(f"{transport}: {reason}")


def _agents(
    transport: str,
    tag: str,
    sender_options: dict[str, Any] | None = None,
    receiver_options: dict[str, Any] | None = None,
) -> Pair:
    require(transport)
    s_opts = dict(sender_options or {})
    if transport == "shm":
        s_opts.setdefault("allow_private", True)  # the sender's sources are private memory
    if transport == "inproc":
        return Pair(
            transport,
            LocalAgent(transport, f"send-{tag}", s_opts),
            LocalAgent(transport, f"recv-{tag}", receiver_options),
        )
    return Pair(
        transport,
        ProcessAgent(CTX, transport, f"send-{tag}", s_opts),
        ProcessAgent(CTX, transport, f"recv-{tag}", receiver_options),
    )


# A pair is two agent processes but inproc's: their tests are out of the fast tier (in-process).
@pytest.fixture(
    scope="module",
    params=[pytest.param(t, marks=() if t == "inproc" else pytest.mark.slow) for t in TRANSPORTS],
)
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    p = _agents(request.param, request.param)
    yield p
    p.sender.close()
    p.receiver.close()


def _fields(runs: Runs) -> dict[str, np.ndarray]:
    return {f: getattr(runs, f) for f in FIELDS}


def _random_runs(
    rng: np.random.Generator,
    n: int,
    *,
    strided: float,
    src_sizes: list[int],
    n_dst: int,
    max_bytes: int = 3000,
) -> tuple[Runs, list[int]]:
    """``n`` runs (a fraction ``strided`` of them strided) from random source offsets into
    disjoint destination spans laid out in random order; returns the runs and the destination
    region sizes they need."""
    z = lambda a: np.asarray(a, dtype=np.int64)  # noqa: E731
    nbytes = rng.integers(1, max_bytes, n)
    multi = rng.random(n) < strided
    count = np.where(multi, rng.integers(2, 20, n), 1)
    nbytes = np.where(multi, np.minimum(nbytes, 600), nbytes)
    dst_stride = np.where(multi, nbytes + rng.integers(0, 500, n), 0)
    src_stride = np.where(multi, rng.integers(1, 2000, n), 0)
    src_region = rng.integers(0, len(src_sizes), n)
    src_span = (count - 1) * src_stride + nbytes
    src_offset = (rng.random(n) * (np.asarray(src_sizes)[src_region] - src_span)).astype(np.int64)
    dst_region = rng.integers(0, n_dst, n)
    dst_span = (count - 1) * dst_stride + nbytes
    dst_offset = np.zeros(n, dtype=np.int64)
    sizes = []
    for r in range(n_dst):
        idx = rng.permutation(np.flatnonzero(dst_region == r))
        gaps = rng.integers(0, 64, len(idx))
        ends = np.cumsum(dst_span[idx] + gaps)
        dst_offset[idx] = ends - dst_span[idx]
        sizes.append(int(ends[-1]) + 128 if len(idx) else 4096)
    runs = Runs(
        z(src_region),
        z(src_offset),
        z(dst_region),
        z(dst_offset),
        z(nbytes),
        z(count),
        z(src_stride),
        z(dst_stride),
    )
    return runs, sizes


def _reference(runs: Runs, src: list[np.ndarray], dst: list[np.ndarray]) -> None:
    """The oracle: the plainest possible copy, one flat block at a time."""
    f = runs.flat()
    for i in range(len(f)):
        s, d, n = int(f.src_offset[i]), int(f.dst_offset[i]), int(f.nbytes[i])
        dst[int(f.dst_region[i])][d : d + n] = src[int(f.src_region[i])][s : s + n]


def _setup(
    pair: Pair,
    src_sizes: list[int],
    dst_sizes: list[int],
    dst_prefault: bool = True,
    canary: int | None = CANARY,
) -> tuple[list[str], list[str]]:
    k = next(_names)
    src = [f"s{k}.{i}" for i in range(len(src_sizes))]
    dst = [f"d{k}.{i}" for i in range(len(dst_sizes))]
    pair.sender.call("pool", list(zip(src, src_sizes, strict=True)), False, seed=k)
    blob = pair.receiver.call(
        "pool",
        list(zip(dst, dst_sizes, strict=True)),
        pair.shared,
        fill=canary,
        prefault=dst_prefault,
    )
    pair.sender.call("add_peer", pair.receiver.agent, blob)
    return src, dst


def _transfer_and_compare(
    pair: Pair, runs: Runs, src_sizes: list[int], dst_sizes: list[int]
) -> None:
    src, dst = _setup(pair, src_sizes, dst_sizes)
    _, state, error = pair.sender.call(
        "post", pair.receiver.agent, src, dst, _fields(runs), wait=60.0
    )
    assert (state, error) == ("DONE", None)
    src_bytes = [np.frombuffer(pair.sender.call("read", n), dtype=np.uint8) for n in src]
    want = [np.full(s, CANARY, dtype=np.uint8) for s in dst_sizes]
    _reference(runs, src_bytes, want)
    for name, w in zip(dst, want, strict=True):
        got = np.frombuffer(pair.receiver.call("read", name), dtype=np.uint8)
        bad = np.flatnonzero(got != w)
        assert not len(bad), (
            f"{pair.transport}: {len(bad)} wrong bytes in {name}, first at {bad[:5].tolist()}"
        )


# ---- bytes land exactly where the runs say ---------------------------------------------------


def test_flat_runs_land_exactly(pair: Pair) -> None:
    rng = np.random.default_rng(1)
    src_sizes = [1 << 20, 300_000]
    runs, dst_sizes = _random_runs(
        rng, 600, strided=0.0, src_sizes=src_sizes, n_dst=3, max_bytes=200_000
    )
    _transfer_and_compare(pair, runs, src_sizes, dst_sizes)


def test_strided_runs_land_exactly(pair: Pair) -> None:
    rng = np.random.default_rng(2)
    src_sizes = [1 << 20, 1 << 19]
    runs, dst_sizes = _random_runs(rng, 800, strided=0.6, src_sizes=src_sizes, n_dst=2)
    _transfer_and_compare(pair, runs, src_sizes, dst_sizes)


def test_bytes_outside_runs_untouched(pair: Pair) -> None:
    # Two runs in the middle of a canary-filled region: exactly their bytes change.
    z = lambda *a: np.asarray(a, dtype=np.int64)  # noqa: E731
    runs = Runs(
        z(0, 0), z(0, 5000), z(0, 0), z(100, 9000), z(1000, 64), z(1, 8), z(0, 100), z(0, 256)
    )
    _transfer_and_compare(pair, runs, [1 << 16], [1 << 16])


def test_ten_thousand_small_runs(pair: Pair) -> None:
    rng = np.random.default_rng(3)
    src_sizes = [1 << 20]
    runs, dst_sizes = _random_runs(
        rng, 10_000, strided=0.05, src_sizes=src_sizes, n_dst=2, max_bytes=256
    )
    _transfer_and_compare(pair, runs, src_sizes, dst_sizes)


def test_offsets_are_int64_end_to_end(pair: Pair) -> None:
    """A sparse destination past 4 GiB: runs at and across the 2**32 boundary land there."""
    big = (1 << 32) + (1 << 20)
    z = lambda *a: np.asarray(a, dtype=np.int64)  # noqa: E731
    runs = Runs(
        z(0, 0, 0),
        z(0, 4096, 50_000),
        z(0, 0, 0),
        z((1 << 32) + 12_345, (1 << 32) - 3000, (1 << 32) + 600_000),
        z(1000, 1000, 70_000),
        z(1, 4, 1),
        z(0, 2000, 0),
        z(0, 4096, 0),
    )
    # The shm sender maps the whole segment: without prefault only touched pages get memory.
    p = pair if pair.transport != "shm" else _agents("shm", "int64", {"prefault": False})
    try:
        # No canary fill: that would touch all 4 GiB. Untouched pages read as zeros.
        src, dst = _setup(p, [1 << 20], [big], dst_prefault=False, canary=None)
        _, state, error = p.sender.call(
            "post", p.receiver.agent, src, dst, _fields(runs), wait=60.0
        )
        assert (state, error) == ("DONE", None)
        src_bytes = np.frombuffer(p.sender.call("read", src[0]), dtype=np.uint8)
        lo, hi = (1 << 32) - 8192, (1 << 32) + 700_000
        window = np.frombuffer(p.receiver.call("read", dst[0], lo, hi), dtype=np.uint8)
        want = np.zeros(hi - lo, dtype=np.uint8)
        shifted = Runs(
            runs.src_region,
            runs.src_offset,
            runs.dst_region,
            runs.dst_offset - lo,
            runs.nbytes,
            runs.count,
            runs.src_stride,
            runs.dst_stride,
        )
        _reference(shifted, [src_bytes], [want])
        assert np.array_equal(window, want)
    finally:
        if p is not pair:
            p.sender.close()
            p.receiver.close()


# ---- refused before anything is written ------------------------------------------------------


def test_out_of_bounds_run_refused_before_any_write(pair: Pair) -> None:
    src, dst = _setup(pair, [1 << 16], [1 << 16])
    z = lambda *a: np.asarray(a, dtype=np.int64)  # noqa: E731
    # Three good runs, then one whose last block ends one byte past the peer's region.
    runs = Runs(
        z(0, 0, 0, 0),
        z(0, 100, 200, 0),
        z(0, 0, 0, 0),
        z(0, 1000, 2000, (1 << 16) - 3 * 512 - 511),
        z(10, 10, 10, 512),
        z(1, 1, 1, 4),
        z(0, 0, 0, 512),
        z(0, 0, 0, 512),
    )
    with pytest.raises(TransportError, match=rf"run 3: dst region 0 '{dst[0]}' of 65536 bytes"):
        pair.sender.call("post", pair.receiver.agent, src, dst, _fields(runs))
    # Past the local source, and an unknown destination region name.
    runs_src = Runs(*(z(0) for _ in range(4)), z(1), z(1), z(0), z(0))
    bad_src = Runs(z(0), z(1 << 16), *(z(0) for _ in range(2)), z(1), z(1), z(0), z(0))
    with pytest.raises(TransportError, match="run 0: src region 0"):
        pair.sender.call("post", pair.receiver.agent, src, dst, _fields(bad_src))
    with pytest.raises(TransportError, match="registered no region 'nope'"):
        pair.sender.call("post", pair.receiver.agent, src, ["nope"], _fields(runs_src))
    assert pair.receiver.call("read", dst[0]) == bytes([CANARY]) * (1 << 16)


def test_malformed_metadata_refused(pair: Pair) -> None:
    good = msgspec.json.decode(
        pair.receiver.call("pool", [(f"m{next(_names)}", 4096)], pair.shared)
    )
    peer = pair.receiver.agent

    def variant(**change: Any) -> bytes:
        return msgspec.json.encode({**good, **change})

    cases = {
        b"not json": "malformed metadata",
        b"[1, 2]": "malformed metadata",
        variant(version=99): "version 99",
        variant(transport="carrier-pigeon"): "is for transport 'carrier-pigeon'",
        variant(agent="someone-else"): "names agent 'someone-else'",
        variant(regions=[{"name": "r", "nbytes": -5}]): "malformed metadata",
        variant(regions=[{"name": "r", "nbytes": 8}, {"name": "r", "nbytes": 8}]): "repeats",
        variant(unexpected=1): "malformed metadata",
    }
    for blob, message in cases.items():
        with pytest.raises(TransportError, match=message):
            pair.sender.call("add_peer", peer, blob)
    # After all that the good blob still works.
    pair.sender.call("add_peer", peer, msgspec.json.encode(good))


def test_transport_specific_metadata_refused() -> None:
    shm = create("shm", "meta-shm")
    tcp = create("tcp", "meta-tcp")
    try:
        with HostPool([Region("r", 4096)], shared=True) as pool:
            blob = msgspec.json.decode(create("shm", "meta-shm-2").register(pool.regions()))
        gone = [{**blob["regions"][0], "segment": "kvb_no_such_segment"}]
        with pytest.raises(TransportError, match="cannot open shared-memory segment"):
            shm.add_peer("meta-shm-2", msgspec.json.encode({**blob, "regions": gone}))
        with pytest.raises(TransportError, match="another host"):
            shm.add_peer("meta-shm-2", msgspec.json.encode({**blob, "host_id": "elsewhere"}))
        no_address = {"version": METADATA_VERSION, "transport": "tcp", "agent": "x", "regions": []}
        with pytest.raises(TransportError, match="no address"):
            tcp.add_peer("x", msgspec.json.encode(no_address))
    finally:
        shm.close()
        tcp.close()


@pytest.mark.parametrize("transport", ["nixl", "mooncake"])
def test_engine_specific_metadata_refused(transport: str) -> None:
    """What an engine needs from a peer's blob (its own metadata, the engine's address, each
    region's address) is checked at add_peer."""
    require(transport)
    tx, rx = create(transport, f"meta-tx-{transport}"), create(transport, f"meta-rx-{transport}")
    try:
        with HostPool([Region("r", 4096)], shared=False) as pool:
            good = msgspec.json.decode(rx.register(pool.regions()))
            no_address = [{**good["regions"][0], "address": 0}]
            bad = [{**good, "regions": no_address}]
            if transport == "nixl":
                bad += [{**good, "engine": ""}, {**good, "engine": "not base64!"}]
                message = "agent metadata"
            else:
                bad += [{**good, "port": 0}, {**good, "host": ""}]
                message = "no engine address"
            for blob in bad:
                with pytest.raises(TransportError, match=f"{message}|region address"):
                    tx.add_peer(rx.agent, msgspec.json.encode(blob))
            tx.add_peer(rx.agent, msgspec.json.encode(good))
    finally:
        tx.close()
        rx.close()


# ---- never hangs -----------------------------------------------------------------------------


@pytest.mark.slow  # starts processes: the fast tier's are in-process
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_killed_peer_ends_the_transfer(transport: str) -> None:
    """The receiver is stopped mid-transfer, then killed: the handle ends within the timeout
    (FAILED on tcp; the shm copy may have already landed in the mapping), and nothing hangs."""
    p = _agents(
        transport, f"kill-{transport}", {"io_timeout": 20.0} if transport == "tcp" else None
    )
    try:
        size = 64 << 20
        src, dst = _setup(p, [size], [size])
        os.kill(p.receiver.proc.pid, signal.SIGSTOP)
        z = lambda *a: np.asarray(a, dtype=np.int64)  # noqa: E731
        runs = Runs(z(0), z(0), z(0), z(0), z(size), z(1), z(0), z(0))
        hid, state, _ = p.sender.call("post", p.receiver.agent, src, dst, _fields(runs))
        if transport == "tcp":
            # 64 MiB cannot fit in socket buffers of a process that is not reading.
            assert p.sender.call("wait", hid, 0.5)[0] == "PENDING"
        pid = p.receiver.proc.pid
        p.receiver.kill()
        state, error, elapsed = p.sender.call("wait", hid, 20.0)
        assert state != "PENDING" and elapsed < 20.0
        if transport == "tcp":
            assert state == "FAILED" and error and "lost" in error
        for name in os.listdir("/dev/shm"):  # the killed process could not unlink its own
            if name.startswith(f"{SEGMENT_PREFIX}{pid}_"):
                unlink_segment(name)
    finally:
        p.sender.close()


@pytest.mark.slow  # waits out three handshakes
def test_tcp_connects_to_a_peer_paused_past_two_handshakes_within_the_deadline() -> None:
    """The receiver is stopped before the sender's first connection, for three handshake
    timeouts (1 s each), then resumed: the sender tries the handshake again until its 20 s
    deadline, and the bytes land (a starved or frozen host is not a peer refusing us)."""
    p = _agents("tcp", "paused", {"io_timeout": 20.0, "connect_timeout": 1.0})
    try:
        size = 1 << 16
        src, dst = _setup(p, [size], [size])
        pid = p.receiver.proc.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            z = lambda *a: np.asarray(a, dtype=np.int64)  # noqa: E731
            runs = Runs(z(0), z(0), z(0), z(0), z(size), z(1), z(0), z(0))
            hid, _, _ = p.sender.call("post", p.receiver.agent, src, dst, _fields(runs))
            time.sleep(3.5)
            assert p.sender.call("wait", hid, 0.0)[0] == "PENDING"
        finally:
            os.kill(pid, signal.SIGCONT)
        state, error, _ = p.sender.call("wait", hid, 20.0)
        assert (state, error) == ("DONE", None)
        got = np.frombuffer(p.receiver.call("read", dst[0]), dtype=np.uint8)
        want = np.frombuffer(p.sender.call("read", src[0]), dtype=np.uint8)
        assert np.array_equal(got, want)
    finally:
        p.sender.close()
        p.receiver.close()


@pytest.mark.slow  # starts processes: the fast tier's are in-process
def test_mooncake_cuts_batches_to_its_limit_over_workers() -> None:
    """Runs cut into many batches (max_batch 256) over two workers still land exactly; the
    engine's per-peer queue limit is never crossed."""
    p = _agents("mooncake", "cut", {"workers": 2, "max_batch": 256})
    try:
        rng = np.random.default_rng(4)
        src_sizes = [1 << 20, 1 << 22]
        runs, dst_sizes = _random_runs(rng, 3000, strided=0.2, src_sizes=src_sizes, n_dst=2)
        _transfer_and_compare(p, runs, src_sizes, dst_sizes)
    finally:
        p.sender.close()
        p.receiver.close()


@pytest.mark.slow  # waits out the transport's 2 s budget, four times
@pytest.mark.parametrize("transport", ["mooncake", "nixl"])
@pytest.mark.parametrize("fate", ["killed", "stuck"])
def test_engine_batch_to_a_dead_or_stuck_peer_fails_in_time(transport: str, fate: str) -> None:
    """The receiver is stopped with a 64 MiB batch in flight, then killed (or left stopped):
    the handle ends FAILED, with the engine's reason, within the transport's budget. (NIXL is
    held to TCP here: its same-host cma write lands even in a stopped process.)"""
    io_timeout = 2.0
    options: dict[str, Any] = {"io_timeout": io_timeout}
    if transport == "nixl":
        options["ucx_tls"] = "tcp"
    p = _agents(transport, f"{fate}-{transport}", options)
    try:
        size = 64 << 20
        src, dst = _setup(p, [size], [size])
        z = lambda *a: np.asarray(a, dtype=np.int64)  # noqa: E731
        warm = Runs(z(0), z(0), z(0), z(0), z(4096), z(1), z(0), z(0))
        assert (
            p.sender.call("post", p.receiver.agent, src, dst, _fields(warm), wait=30.0)[1] == "DONE"
        )  # connected: what follows fails mid-batch, not while connecting
        os.kill(p.receiver.proc.pid, signal.SIGSTOP)
        runs = Runs(z(0), z(0), z(0), z(0), z(size), z(1), z(0), z(0))
        hid, _, _ = p.sender.call("post", p.receiver.agent, src, dst, _fields(runs))
        # 64 MiB over TCP cannot all land in a process that does not read.
        assert p.sender.call("wait", hid, 0.5)[0] == "PENDING"
        if fate == "killed":
            p.receiver.kill()
        budget = io_timeout + size / 100e6 + 2.0  # transfer_budget, plus a poll tick
        state, error, elapsed = p.sender.call("wait", hid, budget + 10.0)
        assert state == "FAILED" and elapsed < budget, (state, error, elapsed)
        assert error and p.receiver.agent in error, error
    finally:
        if not p.receiver.closed:
            p.receiver.kill()
        p.sender.close()


@pytest.mark.slow  # waits out a deadline
def test_wait_times_out_pending_and_a_silent_peer_fails() -> None:
    """A peer that accepts but never acknowledges: wait returns PENDING at its timeout, and the
    transfer fails once the handshake went unanswered (connect_timeout, tried twice); release
    of a pending handle is refused."""
    silent = socket.create_server(("127.0.0.1", 0))
    t = create("tcp", "to-silent", io_timeout=1.5, connect_timeout=0.75)
    try:
        with HostPool([Region("s", 4096)], shared=False) as pool:
            t.register(pool.regions())
            meta = {
                "version": METADATA_VERSION,
                "transport": "tcp",
                "agent": "silent",
                "host": "127.0.0.1",
                "port": silent.getsockname()[1],
                "regions": [{"name": "d", "nbytes": 4096}],
            }
            t.add_peer("silent", msgspec.json.encode(meta))
            z = lambda *a: np.asarray(a, dtype=np.int64)  # noqa: E731
            h = t.post(
                "silent", ["s"], ["d"], Runs(z(0), z(0), z(0), z(0), z(64), z(1), z(0), z(0))
            )
            t0 = time.monotonic()
            assert t.wait(h, 0.3).name == "PENDING"
            assert 0.25 < time.monotonic() - t0 < 2.0
            with pytest.raises(TransportError, match="still pending"):
                t.release(h)
            assert t.wait(h, 10.0).name == "FAILED"
            assert h.error is not None and "did not acknowledge" in h.error
            t.release(h)
            with pytest.raises(TransportError, match="released"):
                t.poll(h)
    finally:
        t.close()
        silent.close()


# ---- the tcp receiver survives bad senders ---------------------------------------------------


@pytest.fixture
def tcp_receiver() -> Iterator[tuple[Any, HostPool, tuple[str, int]]]:
    t = create("tcp", "rx", io_timeout=5.0)
    pool = HostPool([Region("d", 1 << 16)], shared=False)
    pool.view("d")[:] = CANARY
    t.register(pool.regions())
    yield t, pool, t.address  # type: ignore[attr-defined]
    t.close()
    pool.close()


def _raw_reply(sock: socket.socket) -> tuple[int, wire.Status, str]:
    return read_reply(sock, 5.0)


def _works(rx: tuple[Any, HostPool, tuple[str, int]]) -> None:
    """A well-behaved sender still gets through."""
    t, pool, _ = rx
    tx = create("tcp", f"tx{next(_names)}")
    try:
        with HostPool([Region("s", 4096)], shared=False) as src:
            src.view("s")[:] = 7
            tx.register(src.regions())
            tx.add_peer("rx", t.register([]))
            z = lambda *a: np.asarray(a, dtype=np.int64)  # noqa: E731
            h = tx.post("rx", ["s"], ["d"], Runs(z(0), z(0), z(0), z(100), z(50), z(1), z(0), z(0)))
            assert tx.wait(h, 10.0).name == "DONE", h.error
            assert (pool.view("d")[100:150] == 7).all()
    finally:
        tx.close()


def test_tcp_receiver_survives_malformed_header(tcp_receiver: Any) -> None:
    v = wire.WIRE_VERSION
    for junk in [
        b"GET / HTTP/1.1\r\n\r\n" + b"x" * 100,
        wire.PREFIX.pack(wire.BATCH_MAGIC, v, 0, 7, 1, 5) + b"{bad}",
        wire.PREFIX.pack(wire.BATCH_MAGIC, v, 0, 8, 1 << 40, 10),
    ]:
        with raw_connect(tcp_receiver[2], "junk") as s:
            s.sendall(junk)
            _, status, msg = _raw_reply(s)
            assert status is wire.Status.REFUSED and msg
    _works(tcp_receiver)


def test_tcp_receiver_refuses_out_of_bounds_batch(tcp_receiver: Any) -> None:
    """A sender that skips its own checks: the receiver refuses before writing anything."""
    arrays = np.array([[0, 0], [0, (1 << 16) - 10], [100, 20], [1, 1], [0, 0]], dtype=np.int64)
    header = wire.BatchHeader("evil", "rx", ("d",), 120)
    with raw_connect(tcp_receiver[2], "evil") as s:
        s.sendall(wire.encode_batch(3, header, arrays) + b"\x01" * 120)
        seq, status, msg = _raw_reply(s)
    assert (seq, status) == (3, wire.Status.REFUSED)
    assert "run 1: dst region 0 'd' of 65536 bytes" in msg
    assert (tcp_receiver[1].view("d") == CANARY).all()
    wrong = wire.BatchHeader("evil", "someone-else", ("d",), 10)
    one = np.array([[0], [0], [10], [1], [0]], dtype=np.int64)
    with raw_connect(tcp_receiver[2], "evil") as s:
        s.sendall(wire.encode_batch(4, wrong, one) + b"\x01" * 10)
        assert "addressed to agent 'someone-else'" in _raw_reply(s)[2]
    _works(tcp_receiver)


def test_tcp_receiver_survives_disconnect_mid_payload(tcp_receiver: Any) -> None:
    arrays = np.array([[0], [0], [4096], [1], [0]], dtype=np.int64)
    header = wire.BatchHeader("flaky", "rx", ("d",), 4096)
    with raw_connect(tcp_receiver[2], "flaky") as s:
        s.sendall(wire.encode_batch(1, header, arrays) + b"\x02" * 1000)
    _works(tcp_receiver)


# ---- names, options, shared memory -----------------------------------------------------------


def test_unknown_transport_name_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TransportError, match="unknown transport 'carrier-pigeon'; known: inproc"):
        create("carrier-pigeon", "a")
    # An engine's library missing (None in sys.modules makes its import fail): the error, and
    # unavailable(), name the extra that installs it.
    for module in (
        "nixl_cu12",
        "nixl_cu12._api",
        "nixl_cu13",
        "nixl_cu13._api",
        "nixl",
        "nixl._api",
        "mooncake",
        "mooncake.engine",
    ):
        monkeypatch.setitem(sys.modules, module, None)
    for engine in ("nixl", "mooncake"):
        with pytest.raises(TransportUnavailable, match=rf"pip install 'kvbridge\[{engine}\]'"):
            create(engine, "a")
        assert f"kvbridge[{engine}]" in str(unavailable(engine))
    with pytest.raises(TransportError, match="its options are"):
        create("tcp", "a", stream=3)


@pytest.mark.parametrize(
    ("given", "device", "hooks"),
    [
        (None, False, "none"),  # kvbridge's host default, tcp,cma: no registration cache
        ("tcp,posix,self", False, "none"),
        ("tcp,cma", True, None),  # a device agent: UCX's defaults
        ("tcp,sm,self", False, None),  # sm holds knem and xpmem, which register memory
        ("rc,tcp", False, None),  # RDMA registers host memory: its cache needs the hooks
        ("^cuda_ipc", False, None),  # "all but": may be RDMA
    ],
)
def test_ucx_memory_hooks_are_off_only_for_host_transports(
    monkeypatch: pytest.MonkeyPatch, given: str | None, device: bool, hooks: str | None
) -> None:
    """UCX installs its memory hooks (patching mmap's code: 0.43 s of CPU a process, measured)
    for its registration cache, which tcp and shared memory do not use: kvbridge turns them off
    there, and only there; a user's own setting is kept."""
    from kvbridge.transports import nixl

    for name in ("UCX_TLS", "UCX_MODULES", "UCX_MEM_MMAP_HOOK_MODE"):
        monkeypatch.setenv(name, "")  # (restored, or removed again, after the test)
        monkeypatch.delenv(name)
    monkeypatch.setattr(nixl, "_SET_HERE", set())
    nixl.configure_ucx(given, device)
    assert os.environ.get("UCX_MEM_MMAP_HOOK_MODE") == hooks
    monkeypatch.setenv("UCX_MEM_MMAP_HOOK_MODE", "reloc")
    nixl.configure_ucx(given, device)
    assert os.environ["UCX_MEM_MMAP_HOOK_MODE"] == "reloc"


def test_shm_refuses_private_destination_memory() -> None:
    t = create("shm", "private")
    try:
        with (
            HostPool([Region("r", 4096)], shared=False) as pool,
            pytest.raises(TransportError, match=r"HostPool\(shared=True\)"),
        ):
            t.register(pool.regions())
    finally:
        t.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_shm_copies_only_a_small_batch_on_the_posting_thread(workers: int) -> None:
    """A batch of at most 8 MiB and few runs is copied by ``post`` itself (the engine's thread
    at ``send()``): done, its bytes there, when ``post`` returns. A larger one goes to the copy
    threads whatever their number: with each of them held by a slow fragmented copy, a 16 MiB
    post returns pending (with one worker it once made one part, and was copied in place)."""
    size = 32 << 20
    tx = create("shm", f"inline-tx-{workers}", workers=workers)
    rx = create("shm", f"inline-rx-{workers}")
    one = np.ones(1, dtype=np.int64)

    def flat(nbytes: int) -> Runs:
        return Runs(0 * one, 0 * one, 0 * one, 0 * one, nbytes * one, one, 0 * one, 0 * one)

    i = np.arange(300_000, dtype=np.int64)  # ~1 s of strided copies, one numpy call each
    slow = Runs(0 * i, 4 * i, 0 * i, 4 * i, i * 0 + 1, i * 0 + 2, i * 0 + 2, i * 0 + 2)
    try:
        with (
            HostPool([Region("s", size)], shared=True) as src,
            HostPool([Region("d", size)], shared=True) as dst,
        ):
            src.view("s")[:] = np.arange(size // 8, dtype=np.uint64).view(np.uint8)
            tx.register(src.regions())
            tx.add_peer(rx.agent, rx.register(dst.regions()))
            small = tx.post(rx.agent, ["s"], ["d"], flat(1 << 20))
            assert tx.poll(small).name == "DONE"
            assert np.array_equal(dst.view("d")[: 1 << 20], src.view("s")[: 1 << 20])
            held = [tx.post(rx.agent, ["s"], ["d"], slow) for _ in range(workers)]
            big = tx.post(rx.agent, ["s"], ["d"], flat(16 << 20))
            assert tx.poll(big).name == "PENDING"
            for h in (*held, big):
                assert tx.wait(h, 60.0).name == "DONE"
    finally:
        tx.close()
        rx.close()


def _segments(pids: list[int]) -> list[str]:
    return [
        n
        for n in os.listdir("/dev/shm")
        if any(n.startswith(f"{SEGMENT_PREFIX}{pid}_") for pid in pids)
    ]


@pytest.mark.slow  # starts processes: the fast tier's are in-process
def test_dev_shm_clean_after_close() -> None:
    p = _agents("shm", "clean")
    pids = [p.sender.call("pid"), p.receiver.call("pid")]
    _transfer_and_compare(
        p,
        Runs(
            *(np.zeros(1, dtype=np.int64) for _ in range(4)),
            np.array([100], dtype=np.int64),
            np.ones(1, dtype=np.int64),
            np.zeros(1, dtype=np.int64),
            np.zeros(1, dtype=np.int64),
        ),
        [4096],
        [4096],
    )
    assert _segments(pids), "the receiver's pool should be a shared segment"
    p.sender.close()
    p.receiver.close()
    assert _segments(pids) == []
    # A pool dropped without close() is unlinked by its finalizer.
    pool = HostPool([Region("r", 4096)], shared=True)
    path = Path("/dev/shm") / str(pool.segment)
    assert path.exists()
    del pool
    gc.collect()
    assert not path.exists()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_repeating_add_peer_keeps_transfers_in_flight(transport: str) -> None:
    """A peer's repeated hello (same metadata) must not disturb its transfers."""
    require(transport)
    tx = create(
        transport,
        f"again-tx-{transport}",
        **({"allow_private": True} if transport == "shm" else {}),
    )
    rx = create(transport, f"again-rx-{transport}")
    size = 64 << 20
    try:
        with (
            HostPool([Region("s", size)], shared=False) as src,
            HostPool([Region("d", size)], shared=transport == "shm") as dst,
        ):
            src.view("s")[:] = 3
            tx.register(src.regions())
            blob = rx.register(dst.regions())
            tx.add_peer(rx.agent, blob)
            z = lambda *a: np.asarray(a, dtype=np.int64)  # noqa: E731
            h = tx.post(
                rx.agent, ["s"], ["d"], Runs(z(0), z(0), z(0), z(0), z(size), z(1), z(0), z(0))
            )
            tx.add_peer(rx.agent, blob)
            assert tx.wait(h, 30.0).name == "DONE", h.error
            assert (dst.view("d")[::4096] == 3).all()
    finally:
        tx.close()
        rx.close()
