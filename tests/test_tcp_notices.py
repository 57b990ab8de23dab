"""A tcp write can carry its notice (``Transport.post_noticed``): the receiver's handler takes
it once every byte of the write landed and before the sender hears DONE, and never for a write
that did not land (not admitted, fenced) or that travels in several parts.

Real agents in this process over loopback sockets, their receiving threads real; every check
is on the destination's bytes as the handler saw them.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvbridge.memory.pools import HostPool
from kvbridge.planner.layout import Region
from kvbridge.planner.runs import Runs
from kvbridge.transports import Transport, XferState, create
from kvbridge.transports import tcp_wire as wire
from transport_agents import raw_connect, read_reply

TOKEN = "notice-token"
CANARY = 0xA5
KIB, MIB = 1 << 10, 1 << 20
_names = itertools.count()


def _runs(nbytes: int, dst_offset: int = 0) -> Runs:
    z = lambda a: np.asarray([a], dtype=np.int64)  # noqa: E731
    return Runs(z(0), z(0), z(0), z(dst_offset), z(nbytes), z(1), z(0), z(0))


class Pair:
    """A sender and an admitting receiver (``size`` bytes each side), the receiver's handler
    recording each notice with a copy of the destination as it was when the notice came."""

    def __init__(self, size: int, **sender: Any) -> None:
        k = next(_names)
        self.tx: Transport = create("tcp", f"ntx{k}", token=TOKEN, **sender)
        self.rx: Transport = create("tcp", f"nrx{k}", token=TOKEN, admission=True)
        self.src = HostPool([Region("s", size)], shared=False)
        self.dst = HostPool([Region("d", size)], shared=False)
        self.src.view("s")[:] = np.random.default_rng(k).integers(0, 256, size, dtype=np.uint8)
        self.dst.view("d")[:] = CANARY
        self.tx.register(self.src.regions())
        self.tx.add_peer(self.rx.agent, self.rx.register(self.dst.regions()))
        self.seen: list[tuple[str, bytes, np.ndarray]] = []
        self.lock = threading.Lock()
        self.rx.on_notice(self._take)

    def _take(self, peer: str, notice: bytes) -> None:
        with self.lock:
            self.seen.append((peer, notice, self.dst.view("d").copy()))

    def post(self, nbytes: int, key: tuple[int, int], notice: bytes) -> XferState | None:
        h = self.tx.post_noticed(
            self.rx.agent, ("s",), ("d",), _runs(nbytes), key=key, notice=notice
        )
        return None if h is None else self.tx.wait(h, 30.0)

    def close(self) -> None:
        for t in (self.tx, self.rx):
            t.close()
        self.src.close()
        self.dst.close()


@pytest.fixture
def pairs() -> Iterator[list[Pair]]:
    made: list[Pair] = []
    yield made
    for p in made:
        p.close()


@pytest.mark.parametrize("nbytes", [64 * KIB, 3 * MIB], ids=["small", "megabytes"])
def test_a_notice_arrives_once_after_every_byte_and_before_done(
    pairs: list[Pair], nbytes: int
) -> None:
    p = Pair(4 * MIB)
    pairs.append(p)
    p.rx.admit((1, 1))
    assert p.post(nbytes, (1, 1), b"chunk 0 of room 1") is XferState.DONE
    # DONE came after the handler returned: it is there now, without waiting.
    assert [(peer, n) for peer, n, _ in p.seen] == [(p.tx.agent, b"chunk 0 of room 1")]
    landed = p.seen[0][2]
    assert np.array_equal(landed[:nbytes], p.src.view("s")[:nbytes])
    assert (landed[nbytes:] == CANARY).all()


def test_no_notice_for_a_write_that_did_not_land(pairs: list[Pair]) -> None:
    p = Pair(1 * MIB)
    pairs.append(p)
    assert p.post(64 * KIB, (2, 1), b"never admitted") is XferState.FAILED
    p.rx.admit((2, 2))
    assert p.rx.fence((2, 2), 5.0)
    assert p.post(64 * KIB, (2, 2), b"fenced") is XferState.FAILED
    assert p.seen == [] and (p.dst.view("d") == CANARY).all()


def test_a_write_in_several_parts_carries_no_notice_and_posts_nothing(pairs: list[Pair]) -> None:
    """Over two streams a large write is split, and its parts land in any order: none may
    say the write is in. The caller is told (None) before a byte moves."""
    p = Pair(16 * MIB, streams=2)
    pairs.append(p)
    p.rx.admit((3, 1))
    assert p.post(16 * MIB, (3, 1), b"too large to carry") is None
    assert (p.dst.view("d") == CANARY).all()
    assert p.post(2 * MIB, (3, 1), b"one part") is XferState.DONE
    assert [n for _, n, _ in p.seen] == [b"one part"]


def test_a_notice_the_handler_cannot_take_fails_the_write(pairs: list[Pair]) -> None:
    """The bytes are in, but the sender must not count on a notice that was lost: its write
    ends FAILED with the handler's reason, and the connection serves the next one."""
    p = Pair(1 * MIB)
    pairs.append(p)

    def broken(peer: str, notice: bytes) -> None:
        if notice == b"bad":
            raise ValueError("cannot parse it")
        p._take(peer, notice)

    p.rx.on_notice(broken)
    p.rx.admit((4, 1))
    h = p.tx.post_noticed(p.rx.agent, ("s",), ("d",), _runs(4 * KIB), key=(4, 1), notice=b"bad")
    assert h is not None and p.tx.wait(h, 30.0) is XferState.FAILED
    assert h.error and "its notice could not be taken: ValueError: cannot parse it" in h.error
    assert p.post(4 * KIB, (4, 1), b"good") is XferState.DONE
    assert [n for _, n, _ in p.seen] == [b"good"]


def test_a_notice_is_handed_over_with_the_peer_the_connection_proved(pairs: list[Pair]) -> None:
    """A hand-made batch whose header names another sender is refused before its payload
    is read: a notice always comes with the agent that authenticated (the runtime checks
    the notice names it too)."""
    p = Pair(1 * MIB)
    pairs.append(p)
    p.rx.admit((5, 1))
    header = wire.BatchHeader(p.tx.agent, p.rx.agent, ("d",), 4096, (5, 1), b"forged")
    runs = np.array([[0], [0], [4096], [1], [0]], dtype=np.int64)
    with raw_connect(p.rx.address, "intruder", TOKEN) as s:  # type: ignore[attr-defined]
        s.sendall(wire.encode_batch(1, header, runs) + b"\x01" * 4096)
        seq, status, msg = read_reply(s, 10.0)
    assert status is wire.Status.REFUSED and "authenticated as 'intruder'" in msg, msg
    header = wire.BatchHeader("intruder", p.rx.agent, ("d",), 4096, (5, 1), b"mine")
    with raw_connect(p.rx.address, "intruder", TOKEN) as s:  # type: ignore[attr-defined]
        s.sendall(wire.encode_batch(1, header, runs) + b"\x01" * 4096)
        assert read_reply(s, 10.0)[1] is wire.Status.OK
    assert [(peer, n) for peer, n, _ in p.seen] == [("intruder", b"mine")]


@pytest.mark.parametrize("transport", ["shm", "inproc"])
def test_one_sided_transports_carry_no_notice(transport: str) -> None:
    t = create(transport, f"one-sided-{transport}")
    try:
        assert not t.carries_notices
        h = t.post_noticed("anyone", ("s",), ("d",), _runs(1), key=None, notice=b"x")
        assert h is None
    finally:
        t.close()
