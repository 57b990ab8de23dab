"""Writes held across an end: a decode rank restarted under its old name while a prefill rank is
writing to its old process (no write of the old session lands in the new process's memory), and
a prefill request failed with a write still to read its pages (they are not the engine's until
it did). Suspected or found by attackers, 2026-11-30; docs/faults.md."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from bridges import SETTINGS as SHORT
from bridges import SPEC, bridge
from kvbridge import ParallelLayout, Placement, build_memory
from kvbridge.bootstrap import BootstrapServer
from kvbridge.config import Settings
from kvbridge.memory.pools import HostPool
from kvbridge.runtime import Bridge
from kvbridge.runtime.status import KVPoll
from kvbridge.transports import tcp_stream
from kvbridge.wire.protocol import Role

pytestmark = pytest.mark.slow  # three real Bridges

MEM = build_memory(SPEC, ParallelLayout.even(2, 1), page_size=4, num_pages=16)
SETTINGS = dataclasses.replace(SHORT, heartbeat_misses=100)  # 20 s: a starved rank lives


def wait_for(cond: Callable[[], bool], timeout: float = 10.0, must: bool = True) -> None:
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    assert cond() or not must


def started(
    role: Role,
    name: str,
    pool: HostPool,
    address: str,
    transport: str,
    settings: Settings = SETTINGS,
) -> Bridge:
    return bridge(role, name, MEM, pool, address, transport=transport, settings=settings).start()


class _Noting:
    """The prefill rank's queue of hellos, noting when one comes."""

    def __init__(self, queue: Any, came: threading.Event) -> None:
        self.queue, self.came = queue, came

    def put(self, msg: Any) -> None:
        self.queue.put(msg)
        self.came.set()

    def get(self) -> Any:
        return self.queue.get()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_write_held_across_the_decodes_restart_never_lands_in_the_new_process(
    transport: str,
) -> None:
    """The prefill rank posts a write to decode rank "d" and is held there (a thread preempted
    between its check that the request is live and the copy); "d" restarts (its old process
    closes, a new one says hello under the same name, new shared memory). The hello ended the
    old session's requests and mapped the new process's memory as the peer's at once, so the
    held write, let go, copied into the new process's pages. The hello now waits for the
    worker: the write goes where it was planned, and the new process's memory is untouched.
    (On tcp the hello need not wait: the new process refuses a write of another session.)"""
    pools = [HostPool(MEM.regions, shared=transport == "shm") for _ in range(3)]
    with BootstrapServer() as server:
        p = started(Role.PREFILL, "p", pools[0], server.address, transport)
        old = started(Role.DECODE, "d", pools[1], server.address, transport)
        new = None
        try:
            r = old.receiver(1)
            r.init(Placement.simple(8, [0, 1], aux_slot=0))
            s = p.sender(1, Placement.simple(8, [2, 3]))
            while s.poll() is not KVPoll.WAITING_FOR_INPUT:  # the decode's ask came
                threading.Event().wait(0.01)
            gate, held = threading.Event(), threading.Event()

            def holding(post: Any) -> Any:
                def held_there(*args: Any, **kw: Any) -> Any:
                    held.set()
                    gate.wait(30)
                    return post(*args, **kw)

                return held_there

            # (tcp posts a write with its notice, post_noticed: both held)
            p.transport.post = holding(p.transport.post)  # type: ignore[method-assign]
            p.transport.post_noticed = holding(p.transport.post_noticed)  # type: ignore[method-assign]
            prefill = p._prefill
            assert prefill is not None
            hellos = threading.Event()
            prefill._hellos = _Noting(prefill._hellos, hellos)  # type: ignore[assignment]
            sending = threading.Thread(target=s.send, args=(8,))
            sending.start()  # the engine's thread posts the small write itself, and is held
            assert held.wait(10)
            agent, session = old.agent, prefill._peers[old.agent].session
            old.close()
            for name in (g.name for g in MEM.regions):
                pools[2].view(name)[:] = 0xA5  # the new process's memory, a canary
            new = started(Role.DECODE, "d", pools[2], server.address, transport)
            assert new.agent == old.agent
            new.receiver(2)  # it links: its hello reaches the prefill rank
            assert hellos.wait(30)
            # The old session ends there; the new process becomes the peer at once, unless its
            # hello waits for the worker.
            wait_for(lambda: getattr(prefill._peers.get(agent), "session", 0) != session)
            wait_for(lambda: agent in prefill._peers, timeout=1.0, must=False)
            gate.set()
            sending.join(10)
            assert s.wait(10) is KVPoll.FAILED
            for name in (g.name for g in MEM.regions):
                assert np.all(pools[2].view(name) == 0xA5), f"a write landed in {name}"
        finally:
            gate.set()
            if new is not None:
                new.close()
            old.close()
            p.close()
            for pool in pools:
                pool.close()


def test_a_failed_senders_pages_are_not_the_engines_while_a_write_reads_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prefill request fails at its deadline with its tcp write still queued on a stalled
    stream. It was reported ended at once, and the engine reused its pages (vLLM frees the
    blocks of a request its connector reports finished sending); the write then read the new
    request's bytes, its notice with them, and the decode rank succeeded with another request's
    KV (an attacker's find, 2026-11-30). `Sender.released` says when the pages are the engine's
    again: once the worker, past every write of the request, told the decode ranks."""
    gate, held = threading.Event(), threading.Event()
    send = tcp_stream.Stream._send

    def stalled(self: Any, sock: Any, job: Any) -> Any:
        if job.payload:
            held.set()
            gate.wait(30)
        return send(self, sock, job)

    monkeypatch.setattr(tcp_stream.Stream, "_send", stalled)
    monkeypatch.setattr(tcp_stream.Stream, "_send_now", lambda self, job: False)
    pools = [HostPool(MEM.regions, shared=False) for _ in range(2)]
    quick = dataclasses.replace(SETTINGS, transfer_timeout=1.0)
    with BootstrapServer() as server:
        p = started(Role.PREFILL, "p", pools[0], server.address, "tcp", quick)
        d = started(Role.DECODE, "d", pools[1], server.address, "tcp")
        try:
            r = d.receiver(1)
            r.init(Placement.simple(8, [0, 1], aux_slot=0))
            s = p.sender(1, Placement.simple(8, [2, 3]))
            s.send(8)
            assert held.wait(10)
            assert s.wait(10) is KVPoll.FAILED  # its deadline, the write still queued
            time.sleep(0.5)
            assert not s.released  # the write has not read the pages yet
            gate.set()
            wait_for(lambda: s.released)
        finally:
            gate.set()
            d.close()
            p.close()
            for pool in pools:
                pool.close()
