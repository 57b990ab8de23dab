"""The shm sender unmaps a peer's segment once the peer is gone: within a bound after
``remove_peer`` (at once when no copy into it is running, right after the copy when one is),
whether the peer was killed or is alive, while the sender keeps serving its other peers.

Receivers are real processes (a spawned :class:`ProcessAgent` owning a shared pool); the sender
is a transport in this process, so that its mappings are the lines of ``/proc/self/maps``.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvbridge.memory.copy import FLATTEN_BELOW
from kvbridge.memory.pools import SEGMENT_PREFIX, HostPool, unlink_segment
from kvbridge.planner.layout import Region
from kvbridge.planner.runs import Runs
from kvbridge.transports import Transport, XferHandle, create
from kvbridge.transports.shm import ShmTransport
from transport_agents import ProcessAgent

pytestmark = [
    pytest.mark.slow,  # starts processes: the fast tier's are in-process
    pytest.mark.timeout(120),
    pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux"),
]

CTX = multiprocessing.get_context("spawn")
UNMAP_BOUND = 1.0  # seconds from remove_peer (or from the end of a copy into the segment)
SIZE = 64 << 20


def z(*a: int) -> np.ndarray:
    return np.asarray(a, dtype=np.int64)


def whole(nbytes: int) -> Runs:
    """One flat run: source bytes [0, nbytes) to destination bytes [0, nbytes)."""
    return Runs(z(0), z(0), z(0), z(0), z(nbytes), z(1), z(0), z(0))


# Blocks of a slow run: as many as make a strided copy of its own (fewer are grouped with
# the flat runs into one fast fancy-indexed copy).
SLOW_BLOCKS = FLATTEN_BELOW
SPAN = 2 * SLOW_BLOCKS  # bytes of the region a slow run covers


def slow(n: int = 300_000) -> Runs:
    """``n`` strided runs of tiny blocks: a copy of ~1 s (one numpy call a run) into
    ``SPAN * n`` bytes."""
    i = np.arange(n, dtype=np.int64)
    one = np.ones(n, dtype=np.int64)
    return Runs(0 * i, SPAN * i, 0 * i, SPAN * i, one, SLOW_BLOCKS * one, 2 * one, 2 * one)


def mappings(segment: str) -> list[str]:
    with open("/proc/self/maps") as f:
        return [line.rstrip() for line in f if segment in line]


def unmapped_within(segment: str, bound: float) -> float:
    """Seconds until no line of /proc/self/maps names ``segment``; fails past ``bound``."""
    t0 = time.monotonic()
    while mappings(segment):
        if time.monotonic() - t0 > bound:
            pytest.fail(f"{segment} still mapped {bound} s later: {mappings(segment)}")
        time.sleep(0.01)
    return time.monotonic() - t0


class Receiver:
    """A receiving agent in a process of its own, with one shared pool (one segment)."""

    def __init__(self, tag: str, size: int = SIZE) -> None:
        self.agent = ProcessAgent(CTX, "shm", f"rx-{tag}")
        self.blob: bytes = self.agent.call("pool", [(f"d-{tag}", size)], True, fill=0)
        self.region = f"d-{tag}"
        self.pid: int = self.agent.call("pid")
        self.segment: str = self.agent.call("segments")[0]
        assert self.segment.startswith(SEGMENT_PREFIX)

    @property
    def name(self) -> str:
        return self.agent.agent

    def read(self, start: int, stop: int) -> bytes:
        return bytes(self.agent.call("read", self.region, start, stop))

    def kill(self) -> None:
        self.agent.kill()
        # A killed process cannot unlink its own segment.
        for name in os.listdir("/dev/shm"):
            if name.startswith(f"{SEGMENT_PREFIX}{self.pid}_"):
                unlink_segment(name)

    def close(self) -> None:
        if not self.agent.closed:
            self.agent.close()


@pytest.fixture
def sender() -> Iterator[ShmTransport]:
    t = create("shm", "tx-unmap", workers=2, allow_private=True)
    assert isinstance(t, ShmTransport)
    with HostPool([Region("s", SIZE)], shared=False) as pool:
        pool.view("s")[:] = np.arange(SIZE // 8, dtype=np.uint64).view(np.uint8)
        t.register(pool.regions())
        yield t
        t.close()


@pytest.fixture
def receivers() -> Iterator[list[Receiver]]:
    made: list[Receiver] = []
    yield made
    for r in made:
        r.close()


def connect(sender: Transport, receivers: list[Receiver], tag: str) -> Receiver:
    r = Receiver(tag)
    receivers.append(r)
    sender.add_peer(r.name, r.blob)
    assert mappings(r.segment), "add_peer maps the peer's segment"
    return r


def send(sender: Transport, r: Receiver, runs: Runs) -> XferHandle:
    return sender.post(r.name, ["s"], [r.region], runs)


def done(sender: Transport, h: XferHandle) -> None:
    assert sender.wait(h, 60.0).name == "DONE", h.error


def test_killed_peer_is_unmapped_after_remove_peer(
    sender: ShmTransport, receivers: list[Receiver]
) -> None:
    r = connect(sender, receivers, "killed")
    done(sender, send(sender, r, whole(SIZE)))
    r.kill()
    assert mappings(r.segment), "killing the peer alone leaves the segment mapped here"
    sender.remove_peer(r.name)
    unmapped_within(r.segment, UNMAP_BOUND)
    assert r.segment not in sender.mapped_segments()


def test_removed_live_peer_is_unmapped_after_a_completed_transfer(
    sender: Transport, receivers: list[Receiver]
) -> None:
    r = connect(sender, receivers, "alive")
    done(sender, send(sender, r, whole(SIZE)))
    sender.remove_peer(r.name)
    unmapped_within(r.segment, UNMAP_BOUND)
    # The receiver has its bytes and still maps its own pool; only the sender let go.
    assert r.read(SIZE - 8, SIZE) == np.arange(SIZE // 8 - 1, SIZE // 8, dtype=np.uint64).tobytes()


def test_peer_killed_mid_copy_is_unmapped_when_the_copy_ends(
    sender: Transport, receivers: list[Receiver]
) -> None:
    """A copy cannot be interrupted: the segment stays mapped while it runs, and goes the
    moment it ends (before the handle reports it), not on some later worker tick."""
    r = connect(sender, receivers, "midcopy")
    h = send(sender, r, slow())
    time.sleep(0.1)
    assert sender.poll(h).name == "PENDING", "the copy should still be running"
    r.kill()
    sender.remove_peer(r.name)
    assert sender.wait(h, 60.0).name != "PENDING"
    assert unmapped_within(r.segment, UNMAP_BOUND) < 0.2


def test_queued_transfers_of_a_removed_peer_fail_and_unmap_at_once(
    sender: Transport, receivers: list[Receiver]
) -> None:
    """Both workers busy with other peers: the removed peer's queued parts fail at once and
    drop their views, so its segment is unmapped while the other copies still run."""
    a = connect(sender, receivers, "busy-a")
    b = connect(sender, receivers, "busy-b")
    gone = connect(sender, receivers, "queued")
    # The scenario needs both workers busy for longer than the unmap bound; how long a copy
    # of n tiny runs takes depends on the host, so n is calibrated here for ~3 unmap bounds.
    t0 = time.monotonic()
    assert sender.wait(send(sender, a, slow(50_000)), 60.0).name == "DONE"
    n = min(SIZE // SPAN, int(50_000 * 3 * UNMAP_BOUND / max(time.monotonic() - t0, 1e-3)))
    busy = [send(sender, a, slow(n)), send(sender, b, slow(n))]
    queued = send(sender, gone, whole(SIZE))
    time.sleep(0.05)
    assert sender.poll(queued).name == "PENDING"
    gone.kill()
    sender.remove_peer(gone.name)
    assert sender.poll(queued).name == "FAILED" and "removed" in str(queued.error)
    unmapped_within(gone.segment, UNMAP_BOUND)
    assert [sender.poll(h).name for h in busy] == ["PENDING", "PENDING"]
    for h in busy:
        done(sender, h)
    assert mappings(a.segment) and mappings(b.segment)


def test_sender_keeps_working_with_another_peer(
    sender: Transport, receivers: list[Receiver]
) -> None:
    dead = connect(sender, receivers, "dead")
    other = connect(sender, receivers, "other")
    done(sender, send(sender, dead, whole(SIZE)))
    done(sender, send(sender, other, whole(4096)))
    dead.kill()
    sender.remove_peer(dead.name)
    unmapped_within(dead.segment, UNMAP_BOUND)
    assert mappings(other.segment), "the other peer's segment stays mapped"
    # A full transfer to the other peer still lands, every byte.
    done(sender, send(sender, other, whole(SIZE)))
    want = np.arange(SIZE // 8, dtype=np.uint64).view(np.uint8)
    for lo in (0, SIZE // 2, SIZE - 4096):
        assert other.read(lo, lo + 4096) == want[lo : lo + 4096].tobytes()
    sender.remove_peer(other.name)
    unmapped_within(other.segment, UNMAP_BOUND)


def test_close_unmaps_every_peer(receivers: list[Receiver]) -> None:
    t = create("shm", "tx-close", allow_private=True)
    with HostPool([Region("s", SIZE)], shared=False) as pool:
        t.register(pool.regions())
        rs = [connect(t, receivers, f"close-{i}") for i in range(2)]
        done(t, send(t, rs[0], whole(SIZE)))
        t.close()
    for r in rs:
        unmapped_within(r.segment, UNMAP_BOUND)
