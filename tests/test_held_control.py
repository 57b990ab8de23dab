"""A rank whose control thread is held up (a handler or a C call that does not return) still
ends its requests: the engine's own polling takes its peers' messages (Bridge.progress), so a
request still succeeds, and fails each one past the latest its deadline can be, while the
held thread neither ticks nor handles a message.

In one process (inproc transport, a real bootstrap service and control channels); the hold
is the ``hold_control`` fault, switched on in a running rank as users switch faults (a faults
file, ``Settings.faults = "@PATH"``) once a first request has linked the two sides."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from bridge_ranks import until
from kvbridge import CacheSpec, DType, ParallelLayout, Placement, build_memory
from kvbridge.bootstrap import BootstrapServer
from kvbridge.config import Settings
from kvbridge.errors import FailureKind
from kvbridge.memory.pools import HostPool
from kvbridge.model.spec import attention_layer
from kvbridge.runtime import Bridge, Receiver, Sender
from kvbridge.runtime.status import KVPoll, each
from kvbridge.wire.protocol import Role

SPEC = CacheSpec("m", tuple(attention_layer(2, 8, DType.BFLOAT16) for _ in range(2)))
DEADLINE = 1.0
HOLD = 60  # far past any deadline here: a request ended before it ended by the engine's poll
SETTINGS = Settings(
    bootstrap_timeout=20,  # the link's look-ups, before the hold: never the test's clock
    waiting_timeout=DEADLINE,
    transfer_timeout=DEADLINE,
    abort_timeout=0.5,
    heartbeat_interval=0.1,
    heartbeat_misses=5,
)


@contextmanager
def pair(held: Role, faults: Path) -> Iterator[tuple[Bridge, Bridge]]:
    """A prefill and a decode Bridge; the ``held`` one reads its faults from the file
    ``faults`` (at each request's start, as users switch a running engine's faults)."""
    par = ParallelLayout.even(2, 1)
    mem = build_memory(SPEC, par, page_size=4, num_pages=16)
    with ExitStack() as stack, BootstrapServer() as server:
        bridges = []
        for role, name in ((Role.PREFILL, "p"), (Role.DECODE, "d")):
            pool = HostPool(mem.regions, shared=False)
            stack.callback(pool.close)
            b = Bridge(
                role=role,
                spec=SPEC,
                parallel=par,
                rank=0,
                memory=mem,
                regions=pool,
                transport="inproc",
                bootstrap=server.address,
                engine_id=name,
                # The other side's deadlines, and its patience with the held side's silence,
                # are longer: what ends a request first is the held side's own deadline.
                settings=dataclasses.replace(SETTINGS, faults=f"@{faults}")
                if role is held
                else dataclasses.replace(
                    SETTINGS,
                    waiting_timeout=4 * DEADLINE,
                    transfer_timeout=4 * DEADLINE,
                    heartbeat_misses=40,
                ),
            )
            stack.callback(b.close)  # closing releases the held thread
            bridges.append(b.start())
        yield bridges[0], bridges[1]


@contextmanager
def held_request(held: Role, tmp_path: Path) -> Iterator[tuple[Sender, Receiver]]:
    """A request's sender and receiver, begun with the ``held`` side's control thread held."""
    faults = tmp_path / "faults"
    faults.write_text("")
    with pair(held, faults) as (p, d):
        # A first request links the two sides (its bootstrap look-ups done) before the hold.
        p.sender(1, Placement.simple(8, [3, 1]))
        first = d.receiver(1)
        first.init(Placement.simple(8, [5, 6]))
        assert until(lambda: first.poll() is not KVPoll.BOOTSTRAPPING, 30, 0.02), first.failure
        faults.write_text(f"hold_control={HOLD}")  # read at the next request's start
        s = p.sender(7, Placement.simple(8, [7, 9]))
        r = d.receiver(7)
        r.init(Placement.simple(8, [10, 11]))
        yield s, r


def polled(request: object, within: float) -> float:
    """Poll ``request`` as an engine does until it ends; how long that took."""
    t0 = time.monotonic()
    while not request.poll().terminal:  # type: ignore[attr-defined]
        assert time.monotonic() - t0 < within, "the request outlived the latest deadline"
        time.sleep(0.02)
    return time.monotonic() - t0


@pytest.mark.slow  # waits out a deadline on each side
@pytest.mark.parametrize("held", [Role.DECODE, Role.PREFILL], ids=lambda r: r.value)
def test_a_request_ends_by_its_deadline_while_its_ranks_control_thread_is_held(
    held: Role, tmp_path: Path
) -> None:
    with held_request(held, tmp_path) as (s, r):
        mine = r if held is Role.DECODE else s
        # At most twice its deadline (a held thread is indistinguishable from a paused rank,
        # whose deadlines move back by as much again), never the hold's 60 s.
        took = polled(mine, within=HOLD / 2)
        assert mine.poll() is KVPoll.FAILED
        assert mine.failure is not None
        assert mine.failure.kind is FailureKind.DEADLINE, mine.failure
        assert "deadline passed" in str(mine.failure), mine.failure
        assert took >= DEADLINE, f"ended after {took:.2f} s, before its deadline"


@pytest.mark.parametrize("held", [Role.DECODE, Role.PREFILL], ids=lambda r: r.value)
def test_a_request_succeeds_while_its_ranks_control_thread_is_held(
    held: Role, tmp_path: Path
) -> None:
    with held_request(held, tmp_path) as (s, r):
        # The decode's ask reaches the prefill, and its acknowledgement too, through the
        # engines' polls alone where the prefill's control thread sleeps.
        assert until(lambda: s.poll() is KVPoll.WAITING_FOR_INPUT, 2 * DEADLINE / 3, 0.01)
        s.send(8)
        polled(r, within=HOLD / 2)
        polled(s, within=HOLD / 2)
        assert (r.poll(), s.poll()) == (KVPoll.SUCCESS, KVPoll.SUCCESS), (r.failure, s.failure)


def test_one_request_whose_tick_raises_does_not_keep_the_others_from_theirs() -> None:
    seen: list[int] = []

    def tick(room: int) -> None:
        seen.append(room)
        if room == 1:
            raise ValueError("room 1's bug")

    with pytest.raises(ValueError, match="room 1's bug"):
        each([1, 2, 3], tick)
    assert seen == [1, 2, 3]
