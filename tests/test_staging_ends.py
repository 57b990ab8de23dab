"""Staged requests that end while their slots are asked for or held: the slots go back to the
ring, and the next request is written (both found by attacking the staged path, 2026-11-30;
docs/faults.md)."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from bridges import bridge
from kvbridge import CacheSpec, DType, ParallelLayout, Placement, build_memory
from kvbridge.bootstrap import BootstrapServer
from kvbridge.config import Settings
from kvbridge.memory.pools import HostPool
from kvbridge.model.spec import attention_layer
from kvbridge.runtime import Bridge
from kvbridge.runtime.status import KVPoll
from kvbridge.staging import StagingMode
from kvbridge.wire.protocol import Role

pytestmark = pytest.mark.slow  # real Bridges, and a failure would wait out a deadline

# 2 KiB a token per K and per V and layer: a 64-token request is 1 MiB, 256 segments of 4 KiB
SPEC = CacheSpec("m", tuple(attention_layer(8, 128, DType.BFLOAT16) for _ in range(4)))
PAGE = 16


def settings(**kw: Any) -> Settings:
    return Settings(
        waiting_timeout=20,
        transfer_timeout=4,
        abort_timeout=1,
        heartbeat_interval=0.2,
        heartbeat_misses=25,
        staging=StagingMode.ALWAYS,
        staging_slot_bytes=4096,
        **{"staging_slots": 2, **kw},
    )


@contextlib.contextmanager
def pair(transport: str, decode: Settings | None = None) -> Iterator[tuple[Bridge, Bridge]]:
    mem = build_memory(SPEC, ParallelLayout.even(SPEC.num_layers, 1), page_size=PAGE, num_pages=32)
    pools = [HostPool(mem.regions, shared=transport == "shm") for _ in range(2)]
    with BootstrapServer() as server:
        p, d = (
            bridge(
                role, name, mem, pool, server.address, spec=SPEC, transport=transport, settings=s
            )
            for role, name, pool, s in (
                (Role.PREFILL, "p", pools[0], settings()),
                (Role.DECODE, "d", pools[1], decode or settings()),
            )
        )
        p.start()
        d.start()
        try:
            yield p, d
        finally:
            d.close()
            p.close()
            for pool in pools:
                pool.close()


def place(first_page: int, tokens: int = 64) -> Placement:
    return Placement.simple(tokens, list(range(first_page, first_page + -(-tokens // PAGE))))


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    assert cond()


def asked(p: Bridge, d: Bridge, room: int, first_page: int) -> tuple[Any, Any]:
    r = d.receiver(room)
    wait_for(lambda: r.poll() is KVPoll.WAITING_FOR_INPUT)
    r.init(place(first_page))
    s = p.sender(room, place(first_page))
    wait_for(lambda: s.poll() is KVPoll.WAITING_FOR_INPUT)
    return s, r


def held_at_first_post(b: Bridge, room: int) -> tuple[threading.Event, threading.Event]:
    """Hold ``b``'s first transport post for ``room`` until the gate opens: the worker is then
    inside that request's write, its first slots granted."""
    gate, reached = threading.Event(), threading.Event()
    post = b.transport.post

    def held(agent: str, src: Any, dst: Any, runs: Any, *, key: Any = None, **kw: Any) -> Any:
        if key is not None and key[1] == room and not reached.is_set():
            reached.set()
            gate.wait(30)
        return post(agent, src, dst, runs, key=key, **kw)

    b.transport.post = held  # type: ignore[method-assign]
    return gate, reached


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("ended_by", ["decode", "prefill"])
def test_a_request_ended_mid_write_frees_its_slots_for_the_write_queued_behind(
    transport: str, ended_by: str
) -> None:
    """B's write holds both decode slots when B ends; A's write was queued before B's failure
    notice (or abort acknowledgement). The decode frees B's slots only once told, and A's
    write waited for them: A failed at its deadline, the worker held all along (every other
    request of the rank stalled too). Notices now go before queued writes."""
    with pair(transport) as (p, d):
        sb, rb = asked(p, d, 1, 0)
        sa, ra = asked(p, d, 2, 8)
        gate, reached = held_at_first_post(p, 1)
        sb.send(64)
        assert reached.wait(5)
        sa.send(64)  # A's write queued behind B's
        time.sleep(0.2)
        (rb if ended_by == "decode" else sb).abort("the engine's")
        time.sleep(0.3)  # the abort reached the prefill: B's notice queued after A's write
        gate.set()
        assert ra.wait(15) is KVPoll.SUCCESS, ra.failure
        assert sa.wait(5) is KVPoll.SUCCESS, sa.failure
        assert rb.wait_released(5)


class _ReleasedOnEntry:
    """The staging area's lock: on the first entry from ``ask``, the engine aborts the request
    and its release runs to its end first (the interleaving of a release racing the ask)."""

    def __init__(self, release: Callable[[], None]) -> None:
        self.lock, self.release, self.fired = threading.Lock(), release, False

    def __enter__(self) -> _ReleasedOnEntry:
        if not self.fired and sys._getframe(1).f_code.co_name == "ask":
            self.fired = True
            self.release()
        self.lock.acquire()
        return self

    def __exit__(self, *_: Any) -> None:
        self.lock.release()


def test_a_request_released_as_its_ask_is_taken_leaves_no_slot_held() -> None:
    """A decode rank of one slot: the request whose ask is being taken is aborted and released
    in between (tcp's fence releases it at once). The slot was granted to it anyway and never
    freed, and the next request waited out its deadline for it."""
    with pair("tcp", decode=settings(staging_slots=1)) as (p, d):
        sb, rb = asked(p, d, 1, 0)
        area = d._decode.staging
        assert area is not None

        def released() -> None:
            rb.abort("the engine's")
            assert rb.wait_released(5)

        area._lock = _ReleasedOnEntry(released)  # type: ignore[assignment]
        sb.send(64)
        assert sb.wait(8) is KVPoll.FAILED
        assert area._lock.fired
        wait_for(lambda: area.ring.held() == 0 and not area._rooms)
        sa, ra = asked(p, d, 2, 8)
        sa.send(64)
        assert ra.wait(10) is KVPoll.SUCCESS, ra.failure
