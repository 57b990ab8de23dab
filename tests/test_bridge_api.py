"""The engine-facing API in one process (inproc transport, tcp where a test is about it; real
bootstrap and control channel): the life of a request, aborts from either side, and misuse."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from bridges import SETTINGS, SPEC, bridge
from kvbridge import (
    CacheSpec,
    DType,
    KVBridgeError,
    ParallelLayout,
    Placement,
    PlacementError,
    build_memory,
)
from kvbridge.bootstrap import BootstrapServer
from kvbridge.config import Settings, SettingsError
from kvbridge.memory.pools import HostPool, Pool, RegionMemory
from kvbridge.model.spec import attention_layer
from kvbridge.planner.layout import Region
from kvbridge.runtime import Bridge
from kvbridge.runtime.decode.receiver import Receiver
from kvbridge.runtime.prefill.sender import Sender
from kvbridge.runtime.prefill.writer import ChunkWriter
from kvbridge.runtime.status import KVPoll
from kvbridge.runtime.timeline import Phase
from kvbridge.wire.protocol import Hello, Role


class EnginePool(Pool):
    """A pool an engine allocated itself (as a DevicePool is one): not a HostPool."""

    def __init__(self, regions: Sequence[Region]) -> None:
        self._host = HostPool(regions, shared=False)

    def regions(self) -> tuple[RegionMemory, ...]:
        return self._host.regions()

    def view(self, name: str) -> np.ndarray:
        return self._host.view(name)

    def close(self) -> None:
        self._host.close()


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Bridge, Bridge]]:
    """A prefill and a decode Bridge; the param names the transport, and "+engine" makes
    their pools EnginePools."""
    transport, _, kind = getattr(request, "param", "inproc").partition("+")
    par = ParallelLayout.even(2, 1)
    mem = build_memory(SPEC, par, page_size=4, num_pages=16)
    pools: list[Pool] = [
        EnginePool(mem.regions) if kind else HostPool(mem.regions, shared=transport == "shm")
        for _ in range(2)
    ]
    with BootstrapServer() as server:
        p = bridge(Role.PREFILL, "p", mem, pools[0], server.address, transport=transport).start()
        d = bridge(Role.DECODE, "d", mem, pools[1], server.address, transport=transport).start()
        try:
            yield p, d
        finally:
            d.close()
            p.close()
            for pool in pools:
                pool.close()


def wait_for(cond: object, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:  # type: ignore[operator]
        time.sleep(0.01)
    assert cond(), "condition not reached"  # type: ignore[operator]


def test_a_request_goes_through_every_state(pair: tuple[Bridge, Bridge]) -> None:
    p, d = pair
    places = Placement.simple(10, [3, 1, 2])
    r = d.receiver(1)
    wait_for(lambda: r.poll() is KVPoll.WAITING_FOR_INPUT)
    s = p.sender(1, places)
    assert s.poll() is KVPoll.BOOTSTRAPPING  # no decode rank has asked for it yet
    r.init(Placement.simple(10, [5, 6, 7], aux_slot=2))
    assert r.poll() is KVPoll.TRANSFERRING
    wait_for(lambda: s.poll() is KVPoll.WAITING_FOR_INPUT)
    s.send(4)
    s.send(10)
    assert r.wait(10) is KVPoll.SUCCESS and s.wait(10) is KVPoll.SUCCESS
    assert r.released and d.active_rooms() == 0
    wait_for(lambda: p.active_rooms() == 0)
    src = p.views["L1.v"][3 * 4 * 32 : (3 + 1) * 4 * 32]  # page 3 of prefill holds tokens 0-3
    dst = d.views["L1.v"][5 * 4 * 32 : (5 + 1) * 4 * 32]
    assert np.array_equal(src, dst)


@pytest.mark.parametrize("pair", ["inproc+engine"], indirect=True)
def test_a_bridge_takes_a_pool_of_any_kind_whole(pair: tuple[Bridge, Bridge]) -> None:
    """Any Pool (a DevicePool, an engine's own) is taken as the Bridge's regions, as a
    HostPool is: a DevicePool once raised "not iterable" here."""
    test_a_request_goes_through_every_state(pair)


@pytest.mark.parametrize("pair", ["tcp"], indirect=True)
def test_over_tcp_send_posts_the_write_from_the_engines_thread(
    pair: tuple[Bridge, Bridge],
) -> None:
    """Where the decode already asked and the worker is idle, the engine's send() plans and
    posts the chunk itself (no hand-off to the worker before the bytes leave): the write is
    posted when send() returns; the worker lands it, and the bytes are the prefill's."""
    p, d = pair
    s, r = waiting(pair, 1)
    s.send(4)
    assert s.status.timeline.at(Phase.POSTED) is not None, "send() posted nothing"
    s.send(8)
    assert r.wait(10) is KVPoll.SUCCESS, r.failure
    assert s.wait(10) is KVPoll.SUCCESS, s.failure
    for src_page, dst_page in ((3, 5), (1, 6)):
        src = p.views["L1.v"][src_page * 4 * 32 : (src_page + 1) * 4 * 32]
        dst = d.views["L1.v"][dst_page * 4 * 32 : (dst_page + 1) * 4 * 32]
        assert np.array_equal(src, dst)


def waiting(pair: tuple[Bridge, Bridge], room: int) -> tuple[Sender, Receiver]:
    """A request of 8 tokens in ``room``, both sides waiting for the prefill's ``send()``."""
    p, d = pair
    r = d.receiver(room)
    wait_for(lambda: r.poll() is KVPoll.WAITING_FOR_INPUT)
    s = p.sender(room, Placement.simple(8, [3, 1]))
    r.init(Placement.simple(8, [5, 6], aux_slot=2))
    wait_for(lambda: s.poll() is KVPoll.WAITING_FOR_INPUT)
    return s, r


@contextlib.contextmanager
def interpreter_kept() -> Iterator[None]:
    """The switch interval set past the block (60 s): no other thread can have the interpreter
    meanwhile unless this one gives it away."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        # A thread waiting already waits with the interval it began with: these 20 ms let
        # each such one have the interpreter and wait anew with the new one.
        time.sleep(0.02)
        yield
    finally:
        sys.setswitchinterval(interval)


def handoffs(calls: Iterator[object]) -> list[int]:
    """For each of ``calls``: how often another thread ran while this one made it, which it
    can only where this thread gave the interpreter away (the switch interval, which would
    take it, is set past the calls)."""
    ran = [0]
    stop = threading.Event()

    def other() -> None:
        while not stop.is_set():
            ran[0] += 1
            time.sleep(0)  # gives the interpreter back at once: wants it again at once

    t = threading.Thread(target=other, daemon=True)
    t.start()
    try:
        while ran[0] < 10:  # it runs, and waits for the interpreter from now on
            time.sleep(0.001)
        with interpreter_kept():
            marks = [ran[0]]
            for _ in calls:
                marks.append(ran[0])
        return [b - a for a, b in zip(marks, marks[1:], strict=False)]
    finally:
        stop.set()
        t.join()


@pytest.mark.parametrize("pair", ["tcp", "shm"], indirect=True)
def test_an_engine_polling_a_waiting_request_never_gives_the_interpreter_away(
    pair: tuple[Bridge, Bridge], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine's polls take what arrived on its own thread (Bridge.progress). With nothing
    there, a poll must not give the interpreter away: on a busy core the engine's thread then
    waits for the switch interval (5 ms) behind whichever thread took it, every poll. pyzmq's
    receive gives it away even on an empty socket; the looks ask the socket first. (A poll
    that takes a message may give it away: receiving it, answering it.)"""
    p, d = pair
    test_a_request_goes_through_every_state(pair)  # the transport's connections are up
    monkeypatch.setattr("kvbridge.runtime.control.LOOK", 0.0)  # every poll looks
    monkeypatch.setattr("kvbridge.transports.tcp_serve._POLL_EVERY", 0.0)
    took: list[bool] = []
    for b in (p, d):

        def progress(progress: Callable[[], bool] = b.progress) -> bool:
            took.append(progress())
            return took[-1]

        monkeypatch.setattr(b, "progress", progress)
    s, r = waiting(pair, 2)
    for poll in (s.poll, r.poll, lambda: p.asked(3)):
        took.clear()
        gave = handoffs(poll() for _ in range(500))
        assert len(took) == len(gave)
        idle = [g for g, t in zip(gave, took, strict=True) if not t]
        assert len(idle) > 400 and sum(idle) == 0, f"gave it away in {sum(idle)} empty polls"
    s.send(8)  # the request still ends well
    assert r.wait(10) is KVPoll.SUCCESS, r.failure


@pytest.mark.parametrize("pair", ["tcp", "shm"], indirect=True)
def test_a_small_request_ends_on_a_polling_engine_thread_without_another_thread(
    pair: tuple[Bridge, Bridge],
) -> None:
    """An engine's loop that never blocks keeps the interpreter; any thread of kvbridge's that
    must run for a request waits for it up to the switch interval (5 ms) at each step. A small
    request needs none: the engine's ``send()`` writes it (shm copies a small batch at the
    post; tcp writes what the socket takes) and reports it, and the decode's poll takes the
    bytes and the notice itself. With the switch interval set past the test, so that no other
    thread can have the interpreter unless this one gives it away, the request still ends
    while this thread polls (before shm copied at the post, it waited for a copy thread)."""
    test_a_request_goes_through_every_state(pair)  # the transport's connections are up
    s, r = waiting(pair, 2)
    with interpreter_kept():
        s.send(8)
        end, state = time.monotonic() + 5.0, r.poll()
        while state is KVPoll.TRANSFERRING and time.monotonic() < end:
            state = r.poll()
    assert state is KVPoll.SUCCESS, (state, r.failure)
    assert s.wait(10) is KVPoll.SUCCESS, s.failure


@pytest.mark.parametrize("pair", ["tcp", "shm"], indirect=True)
def test_an_ask_that_comes_last_is_written_by_the_thread_that_took_it(
    pair: tuple[Bridge, Bridge], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM one leg after the other: the prefill computed and sent the whole request before
    the decode asks. The thread that takes the ask (the control thread, or an engine's poll)
    plans and posts the write itself where the worker is idle, as the engine's ``send()``
    does where the ask came first: the worker thread, a hand-off more on a core the engine
    keeps busy, never plans it."""
    test_a_request_goes_through_every_state(pair)  # the transport's connections are up
    p, d = pair
    planned_on: list[str] = []
    begin = ChunkWriter.begin

    def recorded(self: ChunkWriter, s: Sender, dr: int, job: Any) -> Any:
        planned_on.append(threading.current_thread().name)
        return begin(self, s, dr, job)

    monkeypatch.setattr(ChunkWriter, "begin", recorded)
    for room in (2, 3, 4):
        r = d.receiver(room)
        wait_for(lambda r=r: r.poll() is KVPoll.WAITING_FOR_INPUT)
        s = p.sender(room, Placement.simple(8, [3, 1]))
        s.send(8)  # nobody asked yet: nothing to write
        assert not planned_on
        r.init(Placement.simple(8, [5, 6], aux_slot=2))
        assert r.wait(10) is KVPoll.SUCCESS and s.wait(10) is KVPoll.SUCCESS, r.failure
        assert len(planned_on) == 1, planned_on
        assert not planned_on.pop().startswith("kvbridge-worker"), "the worker planned it"


def test_a_decode_prefix_hit_receives_only_the_tokens_past_it(pair: tuple[Bridge, Bridge]) -> None:
    """The decode holds tokens 0-7 (pages 5 and 6, shared with other requests): only tokens
    8-9 travel, into page 7; the shared pages are never written, and the byte counts say
    so on both sides."""
    p, d = pair
    page = 4 * 32  # 4 tokens of 2 heads x 8 bf16
    for name in ("L0.k", "L0.v", "L1.k", "L1.v"):
        p.views[name][:] = np.arange(len(p.views[name])) % 251
        d.views[name][:] = 0xA5
    r = d.receiver(8)
    r.init(Placement.simple(10, [5, 6, 7], aux_slot=1, start=8))
    s = p.sender(8, Placement.simple(10, [3, 1, 2]))
    s.send(4)  # a chunk wholly before the start: reported, no bytes
    s.send(10)
    assert r.wait(10) is KVPoll.SUCCESS and s.wait(10) is KVPoll.SUCCESS
    for name in ("L0.k", "L0.v", "L1.k", "L1.v"):
        src, dst = p.views[name], d.views[name]
        assert (dst[5 * page : 7 * page] == 0xA5).all(), name  # the shared pages: untouched
        assert np.array_equal(dst[7 * page : 7 * page + 64], src[2 * page : 2 * page + 64])
        assert (dst[7 * page + 64 : 8 * page] == 0xA5).all(), name  # past the request's end
    # 2 tokens x 4 tensors x 32 bytes, and the aux slot
    assert s.sent_bytes == r.received_bytes == 2 * 4 * 32 + SPEC.aux_bytes
    with pytest.raises(PlacementError, match=r"start 10 must be in \[0, 10\)"):
        Placement.simple(10, [5, 6, 7], start=10)


def test_decode_abort_is_acknowledged_after_the_sender_drained(pair: tuple[Bridge, Bridge]) -> None:
    p, d = pair
    r = d.receiver(2)
    r.init(Placement.simple(10, [0, 1, 2]))
    s = p.sender(2, Placement.simple(10, [0, 1, 2]))
    wait_for(lambda: s.poll() is KVPoll.WAITING_FOR_INPUT)
    r.abort("user cancelled")
    assert r.poll() is KVPoll.FAILED and "user cancelled" in str(r.failure)
    assert r.wait_released(5)  # the prefill rank acknowledged
    wait_for(lambda: s.poll() is KVPoll.FAILED)
    assert "aborted by decode rank 0" in str(s.failure)
    s.send(10)  # harmless on an ended request: the engine learns the outcome from poll()
    assert s.poll() is KVPoll.FAILED
    wait_for(lambda: d.active_rooms() == 0 and p.active_rooms() == 0)


def test_prefill_abort_fails_the_receiver_at_once(pair: tuple[Bridge, Bridge]) -> None:
    p, d = pair
    r = d.receiver(3)
    r.init(Placement.simple(10, [0, 1, 2]))
    s = p.sender(3, Placement.simple(10, [0, 1, 2]))
    wait_for(lambda: s.poll() is KVPoll.WAITING_FOR_INPUT)
    t0 = time.monotonic()
    s.abort("prefill preempted it")
    assert r.wait(5) is KVPoll.FAILED
    assert time.monotonic() - t0 < 2  # no timeout involved
    assert "prefill preempted it" in str(r.failure) and "aborted" in str(r.failure)


def test_two_requests_given_one_room_never_cross(pair: tuple[Bridge, Bridge]) -> None:
    """The engines gave two requests one room: a decode rank asks for it with its tokens'
    fingerprint, the prefill rank's sender has another. The ask is refused at once with the
    reason, and no byte reaches its pages; the prefill's sender keeps waiting for its own (the
    refused rank's abort is acknowledged, and fails nothing here), and an ask for other tokens
    once the room's request succeeded is refused at once, not left to its deadline."""
    p, d = pair
    places = Placement.simple(10, [3, 1, 2])
    before = d.views["L0.k"].copy()
    theirs = d.receiver(7)
    wait_for(lambda: theirs.poll() is KVPoll.WAITING_FOR_INPUT)
    theirs.init(Placement.simple(10, [5, 6, 7]), fingerprint=b"B" * 16)
    wait_for(lambda: p.asked(7) is not None)
    asked = p.asked(7)
    assert asked is not None and asked.fingerprint == b"B" * 16 and not p.holds(7)
    s = p.sender(7, places, fingerprint=b"A" * 16)
    assert p.holds(7)
    assert theirs.wait(10) is KVPoll.FAILED
    assert "two requests were given one room" in str(theirs.failure), theirs.failure
    # Its abort reached the prefill rank and was acknowledged; it is not this request's.
    assert theirs.wait_released(10)
    s.send(10)
    assert s.poll() is KVPoll.BOOTSTRAPPING, s.failure  # no decode rank of its own asked
    assert np.array_equal(d.views["L0.k"], before)
    s.abort()
    # The same fingerprints on both sides (or none on one) are one request: served.
    r = d.receiver(8)
    wait_for(lambda: r.poll() is KVPoll.WAITING_FOR_INPUT)
    s = p.sender(8, places, fingerprint=b"A" * 16)
    r.init(Placement.simple(10, [5, 6, 7]), fingerprint=b"A" * 16)
    s.send(10)
    assert r.wait(10) is KVPoll.SUCCESS and s.wait(10) is KVPoll.SUCCESS
    # Another request asking for that room once it ended is refused at once too.
    wait_for(lambda: p.active_rooms() == 0)
    assert p.ended_with(8) == b"A" * 16 and p.ended_with(99) is None
    late = d.receiver(8)
    wait_for(lambda: late.poll() is KVPoll.WAITING_FOR_INPUT)
    late.init(Placement.simple(10, [5, 6, 7]), fingerprint=b"B" * 16)
    assert late.wait(10) is KVPoll.FAILED
    assert "held other tokens" in str(late.failure), late.failure
    with pytest.raises(KVBridgeError, match="at most 64 bytes"):
        p.sender(9, places, fingerprint=bytes(65))


def test_misuse_is_refused_clearly(pair: tuple[Bridge, Bridge]) -> None:
    p, d = pair
    r = d.receiver(4)
    wait_for(lambda: r.poll() is KVPoll.WAITING_FOR_INPUT)
    with pytest.raises(PlacementError, match="page id 99"):
        r.init(Placement.simple(10, [0, 99, 2]))
    with pytest.raises(KVBridgeError, match="already has a receiver"):
        d.receiver(4)
    with pytest.raises(KVBridgeError, match="for decode bridges"):
        p.receiver(5)
    s = p.sender(6, Placement.simple(10, [0, 1, 2]))
    with pytest.raises(PlacementError, match=r"chunk \[0, 11\)"):
        s.send(11)
    with pytest.raises(KVBridgeError, match="already has a sender"):
        p.sender(6, Placement.simple(10, [0, 1, 2]))
    s.abort()


@pytest.mark.slow  # waits out a deadline
def test_a_decode_rank_without_the_shared_token_is_refused() -> None:
    par = ParallelLayout.even(2, 1)
    mem = build_memory(SPEC, par, page_size=4, num_pages=16)
    with (
        BootstrapServer(token="s3cret") as server,
        HostPool(mem.regions, shared=False) as pool_p,
        HostPool(mem.regions, shared=False) as pool_d,
    ):
        secure = Settings(**{**SETTINGS.__dict__, "token": "s3cret"})
        wrong = Settings(**{**SETTINGS.__dict__, "token": "guess", "bootstrap_timeout": 2})
        with (
            bridge(Role.PREFILL, "p", mem, pool_p, server.address, settings=secure),
            bridge(Role.DECODE, "d", mem, pool_d, server.address, settings=wrong) as d,
        ):
            r = d.receiver(1)
            assert r.wait(10) is KVPoll.FAILED
            assert "token" in str(r.failure)


def test_close_ends_every_open_request_releases_and_refuses_later_calls(
    pair: tuple[Bridge, Bridge],
) -> None:
    from kvbridge.errors import ClosedError, FailureKind

    p, d = pair
    receivers = [d.receiver(room) for room in (1, 2, 3)]
    for i, r in enumerate(receivers):
        r.init(Placement.simple(10, [3 * i, 3 * i + 1, 3 * i + 2], aux_slot=i))
    senders = [p.sender(room, Placement.simple(10, [0, 1, 2])) for room in (1, 2, 3)]
    senders[0].send(4)  # one request part-way, the others not started
    wait_for(lambda: all(s.poll() is not KVPoll.BOOTSTRAPPING for s in senders))
    d.close()
    for r in receivers:
        assert r.poll() is KVPoll.FAILED
        assert r.failure is not None and r.failure.kind is FailureKind.CLOSED  # type: ignore[attr-defined]
        assert r.released  # the live prefill rank acknowledged after draining
    assert d.active_rooms() == 0
    with pytest.raises(ClosedError):
        d.receiver(9)
    # The prefill side learns the requests ended (the decode side aborted them).
    for s in senders:
        assert s.wait(10) is KVPoll.FAILED
    p.close()
    with pytest.raises(ClosedError):
        p.sender(7, Placement.simple(10, [0, 1, 2]))
    with pytest.raises(ClosedError):
        senders[1].send(10)


def test_closing_the_prefill_side_fails_its_requests_with_a_reason(
    pair: tuple[Bridge, Bridge],
) -> None:
    from kvbridge.errors import FailureKind

    p, d = pair
    r = d.receiver(1)
    r.init(Placement.simple(10, [5, 6, 7]))
    s = p.sender(1, Placement.simple(10, [0, 1, 2]))
    wait_for(lambda: s.poll() is KVPoll.WAITING_FOR_INPUT)
    p.close()
    assert s.poll() is KVPoll.FAILED and s.failure.kind is FailureKind.CLOSED  # type: ignore[union-attr]
    assert r.wait(10) is KVPoll.FAILED and "closed" in str(r.failure)
    assert r.wait_released(10)


def test_a_rank_bound_to_every_interface_needs_an_address_to_advertise() -> None:
    """KVBRIDGE_HOST=0.0.0.0 names no address a peer can reach: refused without
    KVBRIDGE_ADVERTISE, which is then what peers are told."""
    with pytest.raises(SettingsError, match="KVBRIDGE_ADVERTISE"):
        Settings.from_env({"KVBRIDGE_HOST": "0.0.0.0"})
    s = Settings.from_env({"KVBRIDGE_HOST": "0.0.0.0", "KVBRIDGE_ADVERTISE": "198.18.0.9"})
    assert (s.host, s.advertise) == ("0.0.0.0", "198.18.0.9")
    with pytest.raises(SettingsError, match="host name or IP address"):
        Settings.from_env({"KVBRIDGE_HOST": "0.0.0.0", "KVBRIDGE_ADVERTISE": "a b"})


def test_a_hello_from_a_decode_of_another_model_is_refused_and_answered_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A decode rank checks the pairing before it says hello; one that did not (another
    version, or a rank that skipped it) still never becomes the prefill's peer: the prefill
    answers its hello with the incompatibility, at once, to the endpoint the hello named."""
    other = CacheSpec("m", tuple(attention_layer(4, 8, DType.BFLOAT16) for _ in range(2)))
    par = ParallelLayout.even(2, 1)
    mems = [build_memory(s, par, page_size=4, num_pages=16) for s in (SPEC, other)]
    with (
        BootstrapServer() as server,
        HostPool(mems[0].regions, shared=False) as pool_p,
        HostPool(mems[1].regions, shared=False) as pool_d,
        bridge(Role.PREFILL, "p", mems[0], pool_p, server.address) as p,
        bridge(Role.DECODE, "d", mems[1], pool_d, server.address, spec=other) as d,
    ):
        caplog.set_level("WARNING", logger="kvbridge")
        d.send_to(p.agent, p.info.control, Hello(sender=d.agent, session=7, info=d.info))
        wait_for(lambda: "refused HelloReply" in caplog.text)
        refusal = [r.getMessage() for r in caplog.records if "refused hello" in r.getMessage()]
        assert len(refusal) == 1 and d.agent in refusal[0], caplog.text
        assert "head" in refusal[0], refusal[0]  # the incompatibility, in words
        assert d.agent not in p.live_peers()
