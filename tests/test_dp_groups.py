"""Attention data parallelism: each DP group is an engine of its own, the prefill side announces
which group holds a room, and a decode rank asks instead of guessing."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvbridge import CacheSpec, DType, KVBridgeError, ParallelLayout, Placement, build_memory
from kvbridge.bootstrap import BootstrapClient, BootstrapServer
from kvbridge.bootstrap.groups import RoomAnnouncer, group_engine_id
from kvbridge.bootstrap.rooms import RoomTable
from kvbridge.config import Settings
from kvbridge.errors import BootstrapError, FailureKind
from kvbridge.memory.pools import HostPool
from kvbridge.model.spec import mla_layer
from kvbridge.planner.plan import Side
from kvbridge.runtime import Bridge
from kvbridge.runtime.status import KVPoll
from kvbridge.wire.protocol import Role, rank_info

SPEC = CacheSpec("mla", tuple(mla_layer(16, 4, DType.BFLOAT16) for _ in range(2)))
SETTINGS = Settings(
    bootstrap_timeout=4,
    waiting_timeout=10,
    transfer_timeout=10,
    abort_timeout=2,
    heartbeat_interval=0.2,
    heartbeat_misses=5,
)


# ---- the room table ---------------------------------------------------------------------------


def test_a_room_belongs_to_the_engine_that_announced_it_first() -> None:
    t = RoomTable(ttl=10, capacity=100)
    assert t.announce("p.dp0", [1, 2], now=0.0) == {}
    assert t.announce("p.dp0", [2, 3], now=1.0) == {}  # again by its own engine: fine
    assert t.announce("p.dp1", [3, 4], now=1.0) == {3: "p.dp0"}  # held: refused, not moved
    assert t.find([1, 3, 4, 9], now=2.0) == {1: "p.dp0", 3: "p.dp0", 4: "p.dp1"}


def test_rooms_are_forgotten_after_their_ttl_and_when_their_engine_leaves() -> None:
    t = RoomTable(ttl=10, capacity=100)
    t.announce("a", [1], now=0.0)
    t.announce("b", [2], now=5.0)
    assert t.find([1, 2], now=12.0) == {2: "b"}
    t.forget_engine("b")
    assert t.find([2], now=12.0) == {} and len(t) == 0


def test_a_full_room_table_refuses_and_records_nothing() -> None:
    t = RoomTable(ttl=10, capacity=3)
    t.announce("a", [1, 2], now=0.0)
    with pytest.raises(BootstrapError, match="holds 2 rooms of at most 3.*2 more do not fit"):
        t.announce("a", [3, 4], now=1.0)
    assert t.find([3, 4], now=1.0) == {}
    assert t.announce("a", [2, 3], now=1.0) == {}  # one new room fits


def test_group_engine_ids() -> None:
    assert group_engine_id("prefill", 1, 0) == "prefill"
    assert group_engine_id("prefill", 4, 3) == "prefill.dp3"
    with pytest.raises(KVBridgeError, match=r"dp_rank must be in \[0, 2\)"):
        group_engine_id("prefill", 2, 2)
    with pytest.raises(KVBridgeError, match="dp .* must be an integer"):
        group_engine_id("prefill", 0, 0)


# ---- the bootstrap service --------------------------------------------------------------------


def side() -> Side:
    par = ParallelLayout.even(2, 1)
    return Side(SPEC, par, build_memory(SPEC, par, page_size=4, num_pages=16))


def register(client: BootstrapClient, engine: str, dp: int, dp_rank: int) -> None:
    client.register_prefill(
        rank_info(
            engine, Role.PREFILL, 0, "tcp://127.0.0.1:1", side(), "tcp", b"", dp=(dp, dp_rank)
        )
    )


def test_a_lookup_waits_for_the_announcement_and_names_the_group() -> None:
    with BootstrapServer() as s:
        c = BootstrapClient(s.address, timeout=10)
        for g in range(2):
            register(c, f"p.dp{g}", 2, g)
        assert c.find_rooms([7], wait=0.0) == ({}, None)  # DP engines: no room is implied
        threading.Timer(0.3, lambda: c.announce_rooms("p.dp1", [7])).start()
        t0 = time.monotonic()
        assert c.find_rooms([7, 8], wait=8.0) == ({7: "p.dp1"}, None)
        assert time.monotonic() - t0 < 6.0  # the announcement woke it, long before its wait
        assert c.announce_rooms("p.dp0", [7, 9]) == {7: "p.dp1"}
        assert c.health()["rooms"] == 2


def test_a_room_announced_once_is_not_failed_by_a_service_down_when_announced_again() -> None:
    """A DP group's rooms are announced again after each registration (a restarted service
    lost them). A service that cannot take them then fails none of the requests it took
    before (their links may be long made); a room it never took still fails, saying why."""
    refused: dict[int, str] = {}
    held = [7]
    with BootstrapServer() as s:
        c = BootstrapClient(s.address, timeout=1)
        register(c, "p.dp0", 2, 0)
        announcer = RoomAnnouncer(c, "p.dp0", refused.__setitem__, lambda: list(held))
        announcer.start()
        try:
            announcer.add(7)
            end = time.monotonic() + 10
            while c.find_rooms([7], wait=0.0)[0] != {7: "p.dp0"}:
                assert time.monotonic() < end
            s.stop()  # the service goes down
            held.append(8)  # a room the service never took
            announcer.again()
            end = time.monotonic() + 10
            while 8 not in refused:
                assert time.monotonic() < end, refused
                time.sleep(0.05)
            time.sleep(0.2)
            assert list(refused) == [8] and "could not announce" in refused[8]
        finally:
            announcer.close()


def test_a_single_engine_without_dp_holds_every_room() -> None:
    with BootstrapServer() as s:
        c = BootstrapClient(s.address, timeout=10)
        register(c, "p", 1, 0)
        assert c.find_rooms([1, 2], wait=0.0) == ({}, "p")


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "words"),
    [
        ("POST", "/v1/rooms?engine=nobody", b'{"rooms": [1]}', 404, "not registered"),
        ("POST", "/v1/rooms?engine=p.dp0", b'{"rooms": "1"}', 400, "expected"),
        ("POST", "/v1/rooms?engine=p.dp0", b'{"rooms": [-1]}', 400, "an integer in [0, 2**63)"),
        ("POST", "/v1/rooms?engine=p.dp0", b'{"rooms": []}', 400, "name 1 to 256 rooms"),
        ("GET", "/v1/rooms?rooms=" + ",".join(map(str, range(300))), None, 400, "got 300"),
        ("GET", "/v1/rooms?rooms=1,x", None, 400, "integers"),
        ("GET", "/v1/rooms?rooms=1&wait=60", None, 400, "wait must be in [0, 10]"),
    ],
)
def test_bad_room_calls_say_what_was_expected(
    method: str, path: str, body: bytes | None, status: int, words: str
) -> None:
    from test_bootstrap import raw

    with BootstrapServer() as s:
        register(BootstrapClient(s.address), "p.dp0", 2, 0)
        got, answer = raw(s, method, path, body)
        assert got == status and words in answer["error"], answer


# ---- bridges ---------------------------------------------------------------------------------


@pytest.fixture
def groups() -> Iterator[tuple[list[Bridge], Bridge, list[HostPool]]]:
    """Two prefill DP groups (TP1 each) and one decode rank, in one process (inproc)."""
    par = ParallelLayout.even(2, 1)
    mem = build_memory(SPEC, par, page_size=4, num_pages=16)
    pools = [HostPool(mem.regions, shared=False) for _ in range(3)]
    with BootstrapServer() as server:
        prefill = [
            Bridge(
                role=Role.PREFILL,
                spec=SPEC,
                parallel=par,
                rank=0,
                memory=mem,
                regions=pools[g],
                transport="inproc",
                bootstrap=server.address,
                engine_id="p",
                settings=SETTINGS,
                dp=2,
                dp_rank=g,
            ).start()
            for g in range(2)
        ]
        decode = Bridge(
            role=Role.DECODE,
            spec=SPEC,
            parallel=par,
            rank=0,
            memory=mem,
            regions=pools[2],
            transport="inproc",
            bootstrap=server.address,
            engine_id="d",
            settings=SETTINGS,
        ).start()
        try:
            yield prefill, decode, pools
        finally:
            decode.close()
            for b in prefill:
                b.close()
            for pool in pools:
                pool.close()


def test_each_room_comes_from_the_group_that_holds_it(
    groups: tuple[list[Bridge], Bridge, list[HostPool]],
) -> None:
    prefill, decode, pools = groups
    for g, b in enumerate(prefill):  # a different byte in each group's pools
        for r in b.side.memory.regions:
            pools[g].view(r.name)[:] = 0x10 + g
    place = Placement.simple(8, np.arange(2))
    receivers = {room: decode.receiver(room) for room in (11, 12)}
    senders = {11: prefill[1].sender(11, place), 12: prefill[0].sender(12, place)}
    for room, r in receivers.items():
        r.init(Placement.simple(8, np.arange(2) + 2 * (room - 11), aux_slot=room - 11))
        senders[room].send(8)
    for room, r in receivers.items():
        assert r.wait(15) is KVPoll.SUCCESS, r.failure
        assert senders[room].wait(15) is KVPoll.SUCCESS
    assert {r.link.engine for r in receivers.values() if r.link} == {"p.dp0", "p.dp1"}
    kv = decode.side.memory.buffers[(0, "latent")]
    view = pools[2].view(kv.region)
    page = kv.stride("page")
    assert set(view[kv.offset : kv.offset + 2 * page].tolist()) >= {0x11}  # room 11: group 1
    assert set(view[kv.offset + 2 * page : kv.offset + 4 * page].tolist()) >= {0x10}


def test_a_room_two_groups_claim_fails_in_the_second_with_the_holder_named(
    groups: tuple[list[Bridge], Bridge, list[HostPool]],
) -> None:
    prefill, _, _ = groups
    place = Placement.simple(8, np.arange(2))
    first = prefill[0].sender(21, place)
    assert BootstrapClient(str(prefill[0].bootstrap)).find_rooms([21], 8.0)[0] == {21: "p.dp0"}
    second = prefill[1].sender(21, place)
    assert second.wait(10) is KVPoll.FAILED
    assert second.failure is not None and second.failure.kind is FailureKind.BAD_INPUT
    assert "room 21 is held by prefill engine 'p.dp0'" in str(second.failure)
    assert first.poll() is not KVPoll.FAILED


@pytest.mark.slow  # waits out a deadline
def test_a_room_no_group_announces_fails_at_the_bootstrap_deadline_saying_so(
    groups: tuple[list[Bridge], Bridge, list[HostPool]],
) -> None:
    _, decode, _ = groups
    r = decode.receiver(99)
    r.init(Placement.simple(8, np.arange(2)))
    assert r.wait(SETTINGS.bootstrap_timeout + 5) is KVPoll.FAILED
    assert r.failure is not None and r.failure.kind is FailureKind.BOOTSTRAP
    assert "no prefill engine at" in str(r.failure) and "announced the room" in str(r.failure)
    assert r.wait_released(1)
