"""The bootstrap service is not a single point of silent failure: ``kvbridge bootstrap`` (a real
process, tokened) is killed with SIGKILL while a request is in flight and the request ends
served; a decode engine that links while it is gone fails its request within its deadline,
naming the service; restarted at the same address, the service learns the prefill rank again
by itself (no one re-registers it by hand) and a new decode engine's requests succeed. With two
services, either one alive is enough."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvbridge import CacheSpec, DType, ParallelLayout, Placement, build_memory
from kvbridge.bootstrap import BootstrapClient
from kvbridge.config import Settings
from kvbridge.memory.pools import HostPool
from kvbridge.model.spec import attention_layer
from kvbridge.runtime import Bridge
from kvbridge.runtime.prefill.registration import REFRESH
from kvbridge.runtime.status import FailureKind, KVPoll
from kvbridge.wire.protocol import Role

pytestmark = pytest.mark.slow  # a service killed and restarted, ~10 s

TOKEN = "s3cret"
SPEC = CacheSpec("m", tuple(attention_layer(2, 8, DType.BFLOAT16) for _ in range(2)))
SETTINGS = Settings(
    token=TOKEN,
    bootstrap_timeout=3,
    waiting_timeout=10,
    transfer_timeout=10,
    abort_timeout=2,
    heartbeat_interval=0.2,
    heartbeat_misses=5,
)
PAR = ParallelLayout.even(2, 1)
MEM = build_memory(SPEC, PAR, page_size=4, num_pages=16)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def service(port: int) -> subprocess.Popen[bytes]:
    """``kvbridge bootstrap`` as a user starts it, ready once its health answers."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbridge", "bootstrap", "--host", "127.0.0.1"]
        + ["--port", str(port), "--token", TOKEN],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    BootstrapClient(f"127.0.0.1:{port}", TOKEN, timeout=15).health()
    return proc


def bridge(role: Role, engine: str, pool: HostPool, address: str) -> Bridge:
    return Bridge(
        role=role,
        spec=SPEC,
        parallel=PAR,
        rank=0,
        memory=MEM,
        regions=pool,
        transport="inproc",
        bootstrap=address,
        engine_id=engine,
        settings=SETTINGS,
    ).start()


@pytest.fixture
def pools() -> Iterator[list[HostPool]]:
    made = [HostPool(MEM.regions, shared=False) for _ in range(3)]
    yield made
    for p in made:
        p.close()


def transfer(p: Bridge, d: Bridge, room: int, kill: subprocess.Popen[bytes] | None = None) -> None:
    r = d.receiver(room)
    r.init(Placement.simple(8, [5, 6], aux_slot=1))
    s = p.sender(room, Placement.simple(8, [3, 1]))
    s.send(4)
    if kill is not None:  # the service dies between the request's chunks
        kill.send_signal(signal.SIGKILL)
        kill.wait(10)
    s.send(8)
    assert r.wait(10) is KVPoll.SUCCESS and s.wait(10) is KVPoll.SUCCESS


def test_the_service_killed_and_restarted_with_requests_in_flight(pools: list[HostPool]) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    proc = service(port)
    p = bridge(Role.PREFILL, "p", pools[0], address)
    d1 = d2 = d3 = None
    try:
        p.views["L0.k"][:] = np.arange(len(p.views["L0.k"])) % 251
        d1 = bridge(Role.DECODE, "d1", pools[1], address)
        transfer(p, d1, 1)
        transfer(p, d1, 2, kill=proc)  # in flight as the service dies: served
        transfer(p, d1, 3)  # the link made before needs no service
        # A decode engine linking while the service is gone: failed within its deadline,
        # naming the service.
        d2 = bridge(Role.DECODE, "d2", pools[2], address)
        r = d2.receiver(4)
        start = time.monotonic()
        assert r.wait(SETTINGS.bootstrap_timeout + 5) is KVPoll.FAILED
        assert time.monotonic() - start < SETTINGS.bootstrap_timeout + 5
        failure = r.failure
        assert failure is not None and failure.kind is FailureKind.BOOTSTRAP, failure
        assert address in failure.detail and "could not be reached" in failure.detail, failure
        d2.close()
        d2 = None
        # Restarted at the same address: the prefill rank registers again by itself.
        proc = service(port)
        client = BootstrapClient(address, TOKEN, timeout=5)
        end = time.monotonic() + 3 * REFRESH + 5
        while time.monotonic() < end and not client.health()["prefill_engines"]:
            time.sleep(0.1)
        assert client.health()["prefill_engines"] == {"p": {"registered": 1, "world": 1}}
        d3 = bridge(Role.DECODE, "d3", pools[2], address)
        transfer(p, d3, 5)
        src = p.views["L0.k"][3 * 4 * 32 : 4 * 4 * 32]
        assert np.array_equal(d3.views["L0.k"][5 * 4 * 32 : 6 * 4 * 32], src)
    finally:
        for b in (d3, d2, d1, p):
            if b is not None:
                b.close()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_with_two_services_one_killed_a_new_decode_engine_links_through_the_other(
    pools: list[HostPool],
) -> None:
    """A bootstrap address may name several services: the prefill rank registers
    with both; the first is killed; a decode engine given both addresses links through the
    second (asking the dead one first) and its requests succeed."""
    ports = [free_port(), free_port()]
    procs = [service(port) for port in ports]
    both = ",".join(f"127.0.0.1:{port}" for port in ports)
    p = bridge(Role.PREFILL, "p", pools[0], both)
    d = None
    try:
        second = BootstrapClient(f"127.0.0.1:{ports[1]}", TOKEN, timeout=5)
        assert second.health()["prefill_engines"] == {"p": {"registered": 1, "world": 1}}
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].wait(10)
        d = bridge(Role.DECODE, "d", pools[1], both)
        transfer(p, d, 1)
        transfer(p, d, 2)
    finally:
        for b in (d, p):
            if b is not None:
                b.close()
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)


def test_a_data_parallel_groups_rooms_are_announced_again_to_a_restarted_service(
    pools: list[HostPool],
) -> None:
    """A decode engine finds a data-parallel request's prefill group by the room the group
    announced, and the service keeps rooms in memory: a room announced before it restarted was
    never announced again, and its request failed at the decode's bootstrap deadline with every
    rank healthy. A group's first rank now announces its rooms again after each registration."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    proc = service(port)
    groups = [
        Bridge(
            role=Role.PREFILL,
            spec=SPEC,
            parallel=PAR,
            rank=0,
            memory=MEM,
            regions=pools[g],
            transport="inproc",
            bootstrap=address,
            engine_id="p",
            settings=SETTINGS,
            dp=2,
            dp_rank=g,
        ).start()
        for g in range(2)
    ]
    d = bridge(Role.DECODE, "d", pools[2], address)
    try:
        s = groups[1].sender(31, Placement.simple(8, [3, 1]))
        client = BootstrapClient(address, TOKEN)
        end = time.monotonic() + 10
        while client.find_rooms([31], 0.2)[0] != {31: "p.dp1"}:
            assert time.monotonic() < end, "the room was never announced"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc = service(port)
        time.sleep(REFRESH + 1.0)  # every rank registered again by itself
        r = d.receiver(31)
        r.init(Placement.simple(8, [5, 6], aux_slot=1))
        s.send(8)
        assert r.wait(10) is KVPoll.SUCCESS, r.failure
        assert s.wait(10) is KVPoll.SUCCESS
    finally:
        d.close()
        for g in groups:
            g.close()
        proc.kill()
        proc.wait(10)
