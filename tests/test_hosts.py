"""Prefill and decode on separate network hosts: Linux network namespaces on one switch
(kvbridge.deploy.netns), each host with its own address in 198.18.0.0/15, every rank bound to its
host's address with ``KVBRIDGE_HOST`` and a token set, as docs/deployment.md tells users.

Every byte is compared with the reference re-shard, as in the loopback matrix, and the switch's
counters prove the bytes went over the network. The network's faults are the switch's: a host's
port taken down in the middle of a transfer (a partition: packets vanish, no end is told) and
brought back before or after the heartbeat deadline; a prefill process restarted on its host.

They skip, saying why, where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import pytest

from bridge_ranks import BIG, QUICK, NewerCommands, deployment, job_of, rank_process, until
from kvbridge.chaos.process import RankError, RankProcess
from kvbridge.deploy.cluster import Job, bootstrap_service, run
from kvbridge.deploy.netns import Network, unavailable
from kvbridge.model.spec import CacheSpec
from kvbridge.planner.reference import logical_cache
from kvbridge.planner.sidespec import SideOptions
from kvbridge.staging import StagingMode
from kvbridge.transports import unavailable as transport_unavailable
from kvbridge.wire.protocol import PROTOCOL_VERSION
from runtime_cases import DENSE8, GDN, MAMBA2, MLA

pytestmark = pytest.mark.slow  # real processes on three hosts

TOKEN = "cross-host-secret"
STAGED = {"staging": StagingMode.ALWAYS, "staging_slot_bytes": 4096, "staging_slots": 4}
DEADLINES = {
    "bootstrap_timeout": 15.0,
    "waiting_timeout": 15.0,
    "transfer_timeout": 20.0,
    "abort_timeout": 3.0,
}


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    with Network(["bootstrap", "prefill", "decode"]) as net:
        yield net


def hosts(net: Network) -> tuple:  # type: ignore[type-arg]
    return (net["bootstrap"], net["prefill"], net["decode"])


def request_bytes(spec: CacheSpec, tokens: int) -> int:
    """The bytes of one request's whole cache (every token's KV, every state, the aux)."""
    c = logical_cache(spec, tokens)
    return sum(a.nbytes for a in (*c.token.values(), *c.state.values())) + len(c.aux)


# (spec, prefill, decode, transport, tokens, settings): requests of 0.5-2 MiB where the
# switch's counters must tell the request's bytes from the control traffic (~0.2 MiB).
CASES: dict[str, tuple[CacheSpec, str, str, str, int, dict[str, object]]] = {
    "tcp-P2-D1-direct": (DENSE8, "tp=2,page=4", "tp=1,page=8", "tcp", 1024, {}),
    "tcp-Mamba2-P2-D4-staged": (MAMBA2, "tp=2,page=4", "tp=4,page=4", "tcp", 48, STAGED),
    "tcp-GDN-SD-DS": (GDN, "tp=2,page=4,conv=sd", "tp=1,page=4,conv=ds", "tcp", 48, {}),
    "mooncake-MLA-P4-D2": (MLA, "tp=4,page=4", "tp=2,page=2", "mooncake", 1024, {}),
    "nixl-P2-D1": (BIG, "tp=2,page=16", "tp=1,page=16", "nixl", 64, {}),
}


# The hosts share one kernel: UCX would copy between their processes with cross-memory attach
# (cma), past the network; pinned to its tcp transport, it goes over the link as between hosts.
OPTIONS = {"nixl": {"ucx_tls": "tcp"}}


@pytest.mark.parametrize("case", list(CASES))
def test_bytes_cross_hosts_exactly(network: Network, case: str) -> None:
    """Hetero TP, state models, staged and direct, over each transport between hosts: every
    request byte-exact on every decode rank, and at least every request's bytes crossed the
    decode host's link."""
    spec, prefill, decode, transport, tokens, extra = CASES[case]
    reason = transport_unavailable(transport)
    if reason:
        pytest.skip(reason)
    settings = {**DEADLINES, "token": TOKEN, **extra}
    job = Job(
        spec,
        SideOptions.parse(prefill),
        SideOptions.parse(decode),
        transport=transport,
        transport_options=OPTIONS.get(transport, {}),
        tokens=tokens,
        requests=3,
        prefill_settings=settings,
        decode_settings=settings,
        hosts=hosts(network),
    )
    before = network.traffic("decode")
    result = run(job, timeout=90)
    for r in result.ranks:
        assert not r.error, r.error
        assert set(r.states.values()) == {"SUCCESS"}, (r.role, r.rank, r.failures)
    assert all(r.bytes_ok for r in result.of("decode")), [r.mismatch for r in result.of("decode")]
    crossed = network.traffic("decode") - before
    assert crossed >= job.requests * request_bytes(spec, job.tokens), crossed
    if extra is STAGED:
        assert sum(r.scattered for r in result.of("decode")) > 0


@pytest.mark.parametrize("transport", ["tcp", "mooncake"])
def test_bytes_cross_a_shaped_link_exactly(network: Network, transport: str) -> None:
    """The link to the decode host capped at 200 Mbit/s (a token bucket on its switch port),
    5 ms each way (a 10 ms round trip), and 0.5% of what the decode host receives dropped:
    TCP retransmits, the stream stalls and resumes, and every byte arrives."""
    reason = transport_unavailable(transport)
    if reason:
        pytest.skip(reason)
    if shutil.which("iptables") is None:  # scripts/test.sh installs it where it can (apt)
        pytest.skip("no iptables here: delay and loss are iptables rules")
    settings = {**DEADLINES, "token": TOKEN}
    job = replace(
        job_of(DENSE8, "tp=2,page=4", "tp=1,page=8", transport, tokens=1024, requests=3),
        prefill_settings=settings,
        decode_settings=settings,
        hosts=hosts(network),
    )
    network.cap("decode", 200)
    for h in ("prefill", "decode"):
        network.delay(h, 5)
    network.loss("decode", 0.5)
    try:
        result = run(job, timeout=120)
    finally:
        network.cap("decode", None)
        network.loss("decode", 0)
        for h in ("prefill", "decode"):
            network.delay(h, 0)
    for r in result.ranks:
        assert not r.error and set(r.states.values()) == {"SUCCESS"}, (r.role, r.failures)
    assert all(r.bytes_ok for r in result.of("decode"))


def cross(job: Job, net: Network) -> Job:
    return replace(job, hosts=hosts(net))


def mid_transfer(net: Network, before: int, at_least: int = 8 << 20) -> bool:
    """Wait until ``at_least`` bytes more than ``before`` crossed the decode host's link."""
    return bool(until(lambda: net.traffic("decode") - before > at_least, 20, 0.01))


@contextmanager
def cut_mid_transfer(
    network: Network, heartbeat: tuple[float, int], requests: int = 1
) -> Iterator[tuple[list[RankProcess], RankProcess]]:
    """Room 1000, 64 MiB, under way from two prefill ranks to the decode host over a link
    capped at 400 Mbit/s (so that it lasts over a second), then the decode host cut off: yields
    the prefill ranks and the decode rank; the link is healed and uncapped when the block
    ends. ``heartbeat``: interval and misses."""
    job = cross(
        job_of(BIG, "tp=2,page=16", "tp=1,page=16", "tcp", tokens=2048, requests=requests),
        network,
    )
    interval, misses = heartbeat
    settings = {
        **DEADLINES,
        "token": TOKEN,
        "heartbeat_interval": interval,
        "heartbeat_misses": misses,
    }
    network.cap("decode", 400)
    try:
        with deployment(job, settings=settings) as (prefill, decode, _):
            (d,) = decode
            d.call("receive", [1000])
            before = network.traffic("decode")
            for p in prefill:
                p.start("send", [1000])
            assert mid_transfer(network, before)
            network.partition("decode")
            yield prefill, d
    finally:
        network.heal("decode")
        network.cap("decode", None)


def test_a_short_partition_mid_transfer_heals_and_every_byte_arrives(network: Network) -> None:
    """The decode host cut off for 1 s in the middle of a 64 MiB transfer, less than the
    heartbeat window (0.5 s x 6): TCP retransmits once the port is back, and the request
    succeeds, byte-exact."""
    with cut_mid_transfer(network, (0.5, 6)) as (_, d):
        time.sleep(1.0)
        network.heal("decode")
        state, why = d.call("wait", [1000], 30.0)[1000]
        assert state == "SUCCESS", why
        assert d.call("verify", [1000])


def test_a_partition_past_the_deadline_fails_naming_the_peer_and_lands_nothing_late(
    network: Network,
) -> None:
    """The decode host cut off in the middle of a transfer for longer than the heartbeat
    window (0.2 s x 5): the request fails on both sides with a reason naming the silent peer;
    the decode rank releases the pages (its tcp endpoint fences the request), the engine reuses
    them, and when the link comes back nothing that was in flight lands in them. Then a request
    succeeds, byte-exact, over the healed link."""
    with cut_mid_transfer(network, (0.2, 5), requests=4) as (prefill, d):
        state, why = d.call("wait", [1000], 10.0)[1000]
        assert state == "FAILED" and "prefill" in why, why
        assert until(lambda: d.call("released", [1000])[1000] == "RELEASED", 5)
        assert d.call("reuse", [1000]) > 0
        for p in prefill:
            p.result()  # the send command
            state, why = p.call("wait", [1000], 10.0)[1000]
            assert state == "FAILED" and "decode" in why, (p.name, why)
        network.heal("decode")
        network.cap("decode", None)
        time.sleep(2.0)  # retransmissions of what was in flight arrive now, if at all
        assert d.call("landed_after_reuse", [1000]) == 0
        # The control channel keeps its connections across a peer's death (what is queued for
        # a peer only stalled reaches it when it resumes), so after a partition its messages
        # wait for TCP's next retransmission, backed off over the cut (seconds): a request
        # started before that fails naming the silent peer, and a later one succeeds.
        failed = []
        for room in (1001, 1002, 1003):
            d.call("receive", [room])
            for p in prefill:
                p.call("send", [room])
            state, why = d.call("wait", [room], 30.0)[room]
            if state == "SUCCESS":
                assert d.call("verify", [room])
                break
            assert state == "FAILED" and "heart-beating" in why, why
            failed.append(why)
        else:
            raise AssertionError(f"no request succeeded over the healed link: {failed}")


def test_a_prefill_restarted_on_its_host_is_a_new_peer(network: Network) -> None:
    """A prefill rank killed with a request in flight and started again on its host (same
    address, new process, new memory): the decode rank fails what was in flight naming it,
    and serves the next request from the new process byte-exact (a registration or a
    connection of the old one would land other bytes, or none)."""
    job = cross(job_of(DENSE8, "tp=2,page=4", "tp=1,page=8", "tcp", tokens=64, requests=3), network)
    settings = {**DEADLINES, "token": TOKEN, "heartbeat_interval": 0.2, "heartbeat_misses": 5}
    with deployment(job, settings=settings) as (prefill, decode, server):
        (d,) = decode
        d.call("receive", [1000])
        for p in prefill:
            p.call("send", [1000])
        assert d.call("wait", [1000], 20.0)[1000][0] == "SUCCESS"
        d.call("receive", [1001])
        prefill[1].call("send", [1001])  # rank 0 dies before it sends its share
        prefill[0].signal(signal.SIGKILL)
        state, why = d.call("wait", [1001], 10.0)[1001]
        assert state == "FAILED" and "prefill" in why, why
        prefill[0] = rank_process(job, "prefill", 0, server.address, settings).started()
        d.call("receive", [1002])
        for p in prefill:
            p.call("send", [1002])
        state, why = d.call("wait", [1002], 30.0)[1002]
        assert state == "SUCCESS", why
        assert d.call("verify", [1000, 1002])


def test_a_rank_of_another_protocol_version_is_refused_naming_both(network: Network) -> None:
    """A prefill rank of a newer release (the next protocol version) registering, from its
    host, with this release's bootstrap service: refused at once, the rank's start-up error
    naming both versions (not a decode that waits for a hello it cannot read)."""
    job = cross(job_of(DENSE8, "tp=1,page=4", "tp=1,page=4", "tcp", tokens=16), network)
    with bootstrap_service(job, TOKEN) as server:
        settings = {**QUICK, "token": TOKEN}
        newer = rank_process(job, "prefill", 0, server.address, settings, NewerCommands)
        try:
            want = (
                f"speaks protocol version {PROTOCOL_VERSION + 1}; "
                f"this side speaks {PROTOCOL_VERSION}"
            )
            with pytest.raises(RankError, match=want):
                newer.started()
        finally:
            newer.close()


def test_a_decode_bound_to_every_interface_is_reached_at_its_advertised_address(
    network: Network,
) -> None:
    """Decode ranks with KVBRIDGE_HOST=0.0.0.0 and KVBRIDGE_ADVERTISE set to their host's
    address: the prefill ranks reach them there, and every byte arrives."""
    decode = {
        **DEADLINES,
        "token": TOKEN,
        "host": "0.0.0.0",
        "advertise": network["decode"].address,
    }
    job = replace(
        job_of(DENSE8, "tp=2,page=4", "tp=1,page=8", "tcp", tokens=48, requests=2),
        prefill_settings={**DEADLINES, "token": TOKEN},
        decode_settings=decode,
        hosts=hosts(network),
    )
    result = run(job, timeout=60)
    for r in result.ranks:
        assert not r.error and set(r.states.values()) == {"SUCCESS"}, (r.role, r.failures)
    assert all(r.bytes_ok for r in result.of("decode"))


def test_a_decode_restarted_on_its_host_is_a_new_peer(network: Network) -> None:
    """A decode rank killed while the prefill ranks hold a request it asked for (each stopped
    right before writing it), and started again on its host with new memory: the prefill ranks,
    resumed, fail that request naming the dead peer, and the next request, asked for by the new
    process, arrives in its memory byte-exact."""
    job = cross(job_of(DENSE8, "tp=2,page=4", "tp=1,page=8", "tcp", tokens=64, requests=3), network)
    settings = {**DEADLINES, "token": TOKEN, "heartbeat_interval": 0.2, "heartbeat_misses": 5}
    stall = {r: {"faults": "stop_before_post=2"} for r in range(2)}  # before room 1001's write
    with deployment(job, settings=settings, prefill_settings=stall) as (prefill, decode, server):
        decode[0].call("receive", [1000])
        for p in prefill:
            p.call("send", [1000])
        assert decode[0].call("wait", [1000], 20.0)[1000][0] == "SUCCESS"
        decode[0].call("receive", [1001])
        for p in prefill:
            p.start("send", [1001])
        assert until(lambda: all(p.stopped() for p in prefill)), "the prefill ranks did not stop"
        decode[0].signal(signal.SIGKILL)
        for p in prefill:
            p.signal(signal.SIGCONT)
        for p in prefill:
            p.result()
            state, why = p.call("wait", [1001], 10.0)[1001]
            assert state == "FAILED" and "decode" in why, (p.name, why)
        decode[0] = rank_process(job, "decode", 0, server.address, settings).started()
        decode[0].call("receive", [1002])
        for p in prefill:
            p.call("send", [1002])
        state, why = decode[0].call("wait", [1002], 30.0)[1002]
        assert state == "SUCCESS", why
        assert decode[0].call("verify", [1002])
