"""What a request names its bootstrap service by: a second name for a linked prefill engine is
refused at once and breaks nothing, a malformed name leaves nothing behind, an ask on a session
the prefill ended is answered, and a resolver's thread ends when idle (found by attacking the
bootstrap path, 2026-11-30; docs/faults.md)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from bridges import SPEC, bridge
from kvbridge import (
    KVBridgeError,
    ParallelLayout,
    Placement,
    build_memory,
)
from kvbridge.bootstrap import BootstrapServer, groups
from kvbridge.config import Settings
from kvbridge.memory.pools import HostPool
from kvbridge.runtime import Bridge, Receiver
from kvbridge.runtime.status import KVPoll
from kvbridge.wire.protocol import Failure, Message, RequestMeta, Role

SETTINGS = Settings(
    bootstrap_timeout=4,
    waiting_timeout=4,
    transfer_timeout=4,
    abort_timeout=2,
    heartbeat_interval=0.2,
    heartbeat_misses=5,
)


@contextlib.contextmanager
def deployment() -> Iterator[tuple[Bridge, Bridge, int]]:
    """A prefill and a decode rank over inproc, and their bootstrap service's port."""
    mem = build_memory(SPEC, ParallelLayout.even(2, 1), page_size=4, num_pages=16)
    pools = [HostPool(mem.regions, shared=False) for _ in range(2)]
    with BootstrapServer() as server:
        p = bridge(Role.PREFILL, "p", mem, pools[0], server.address, settings=SETTINGS).start()
        d = bridge(Role.DECODE, "d", mem, pools[1], server.address, settings=SETTINGS).start()
        try:
            yield p, d, server.port
        finally:
            d.close()
            p.close()
            for pool in pools:
                pool.close()


def linked(r: Receiver) -> None:
    end = time.monotonic() + 5
    while r.poll() is not KVPoll.WAITING_FOR_INPUT and time.monotonic() < end:
        time.sleep(0.01)
    assert r.poll() is KVPoll.WAITING_FOR_INPUT


def request(p: Bridge, d: Bridge, room: int, address: str) -> tuple[KVPoll, object]:
    pages = [2 * room, 2 * room + 1]
    r = d.receiver(room, bootstrap=address)
    r.init(Placement.simple(8, pages, aux_slot=room))
    p.sender(room, Placement.simple(8, pages)).send(8)
    return r.wait(8), r.failure


@pytest.mark.slow  # a failure waits out a deadline
def test_a_second_name_of_a_linked_service_is_refused_at_once_and_breaks_nothing() -> None:
    """Requests naming the service 127.0.0.1:P and localhost:P each opened a link to the same
    prefill agents, whose second session ended the first's requests there; later requests on
    the first link were dropped by the prefill unanswered and waited out their deadline. An
    engine has one link, made through one address: a request naming another fails at once,
    saying which, and the requests through the first go on (a link looks its engine up at its
    own address, never at one another request named)."""
    with deployment() as (p, d, port):
        one, other = f"127.0.0.1:{port}", f"localhost:{port}"
        assert request(p, d, 1, one) == (KVPoll.SUCCESS, None)
        r = d.receiver(2, bootstrap=other)
        assert r.wait(2) is KVPoll.FAILED
        assert f"linked through bootstrap address {one}; this request names {other}" in str(
            r.failure
        )
        assert request(p, d, 3, one) == (KVPoll.SUCCESS, None)
        assert p._prefill is not None and p._prefill.refused == 0


def test_a_malformed_address_leaves_no_receiver_behind() -> None:
    with deployment() as (_, d, port):
        with pytest.raises(KVBridgeError, match="host:port"):
            d.receiver(7, bootstrap="no-port-here")
        assert d.active_rooms() == 0
        d.receiver(7, bootstrap=f"127.0.0.1:{port}")  # the room is free
        assert d.active_rooms() == 1


def test_an_ask_on_a_session_the_prefill_ended_is_answered_with_the_reason() -> None:
    """A decode agent's ask under a session the prefill rank does not hold (another than its
    live one) was dropped there with no answer, its request left to its deadline."""
    with deployment() as (p, d, port):
        r = d.receiver(1, bootstrap=f"127.0.0.1:{port}")
        p.sender(1, Placement.simple(8, [0, 1]))
        linked(r)
        prefill = p._prefill
        assert prefill is not None
        peer = prefill._peers[d.agent]
        sent: list[tuple[str, Message]] = []
        send = p.send
        p.send = lambda agent, msg, **kw: (sent.append((agent, msg)), send(agent, msg, **kw))  # type: ignore[assignment,method-assign,func-returns-value]
        stale = RequestMeta(
            sender=d.agent,
            session=peer.session + 1,
            room=9,
            decode_rank=0,
            tokens=8,
            pages={"kv": [4, 5]},
            slots={},
        )
        prefill.on_message(stale)
        assert prefill.refused == 1
        [(agent, answer)] = sent
        assert agent == d.agent and isinstance(answer, Failure)
        assert (answer.session, answer.room) == (peer.session + 1, 9)
        assert f"the live one is {peer.session}" in answer.reason


def resolving() -> int:
    return sum(t.name.startswith("kvbridge-resolve-") for t in threading.enumerate())


def test_a_resolvers_thread_ends_when_idle_and_comes_back_for_the_next_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A decode rank keeps one room resolver per bootstrap address its requests named, and a
    client names the address: each kept a thread for the Bridge's life (40 addresses, 40
    threads). A thread now ends once it has had nothing to look up for a while."""
    monkeypatch.setattr(groups, "IDLE_EXIT", 0.3)
    with deployment() as (_, d, _port):
        before = resolving()
        for room in range(10):  # nothing listens there: the lookups fail and retry
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                nowhere = f"127.0.0.1:{s.getsockname()[1]}"
            d.receiver(room, bootstrap=nowhere).abort("the engine's")
        assert resolving() >= before + 1
        end = time.monotonic() + 10
        while resolving() > before and time.monotonic() < end:
            time.sleep(0.05)
        assert resolving() == before
        # An idle resolver whose thread ended looks up the next room on a thread anew.
        again = d.receiver(20, bootstrap=nowhere)
        assert resolving() == before + 1
        again.abort("the engine's")
