"""Metrics and traces as operators see them: Prometheus text served where KVBRIDGE_METRICS_PORT
says, counts that match what the requests moved, and JSON trace lines tying both sides."""

from __future__ import annotations

import json
import logging
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvbridge import CacheSpec, DType, ParallelLayout, Placement, build_memory
from kvbridge.bootstrap import BootstrapServer
from kvbridge.integrations.vllm.launch import free_port
from kvbridge.memory.pools import HostPool
from kvbridge.model.spec import attention_layer
from kvbridge.runtime import Bridge
from kvbridge.runtime.status import KVPoll
from kvbridge.wire.protocol import Role

SPEC = CacheSpec("m", tuple(attention_layer(2, 8, DType.BFLOAT16) for _ in range(2)))
ENV = {
    "KVBRIDGE_BOOTSTRAP_TIMEOUT": "10",
    "KVBRIDGE_WAITING_TIMEOUT": "10",
    "KVBRIDGE_TRANSFER_TIMEOUT": "10",
    "KVBRIDGE_ABORT_TIMEOUT": "2",
}


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Bridge, Bridge, int]]:
    """A prefill and a decode bridge configured as the README says: from the environment,
    KVBRIDGE_METRICS_PORT included."""
    port = free_port()
    for k, v in {**ENV, "KVBRIDGE_METRICS_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    par = ParallelLayout.even(2, 1)
    mem = build_memory(SPEC, par, page_size=4, num_pages=16)
    pools = [HostPool(mem.regions, shared=False) for _ in range(2)]
    with BootstrapServer() as server:
        common = dict(
            spec=SPEC,
            parallel=par,
            rank=0,
            memory=mem,
            transport="inproc",
            bootstrap=server.address,
        )
        p = Bridge(role=Role.PREFILL, regions=pools[0], engine_id="mp", **common).start()  # type: ignore[arg-type]
        d = Bridge(role=Role.DECODE, regions=pools[1], engine_id="md", **common).start()  # type: ignore[arg-type]
        try:
            yield p, d, port
        finally:
            d.close()
            p.close()
            for pool in pools:
                pool.close()


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the metrics page, by (name, labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def sample(
    got: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    hits = [v for (n, lb), v in got.items() if n == name and labels.items() <= dict(lb).items()]
    assert len(hits) == 1, (name, labels, sorted(k for k in got if k[0] == name))
    return hits[0]


def test_the_metrics_page_counts_what_requests_moved_and_how_they_ended(
    served: tuple[Bridge, Bridge, int], caplog: pytest.LogCaptureFixture
) -> None:
    p, d, port = served
    caplog.set_level(logging.DEBUG, logger="kvbridge.trace")
    r = d.receiver(21)
    r.init(Placement.simple(10, [5, 6, 7], aux_slot=1, start=4))  # a prefix hit: 6 tokens
    s = p.sender(21, Placement.simple(10, [3, 1, 2]))
    s.send(10)
    assert r.wait(10) is KVPoll.SUCCESS and s.wait(10) is KVPoll.SUCCESS
    failed = d.receiver(22)
    failed.init(Placement.simple(10, [8, 9, 10], aux_slot=2))
    failed.abort("the engine gave up")
    assert failed.wait_released(10)

    got = scrape(port)
    pre = {"role": "prefill", "engine": "mp"}
    dec = {"role": "decode", "engine": "md"}
    sent = sample(got, "kvbridge_bytes_sent_total", path="direct", **pre)
    assert sent == s.sent_bytes == 6 * 4 * 32 + SPEC.aux_bytes
    assert sample(got, "kvbridge_bytes_received_total", path="direct", **dec) == sent
    assert sample(got, "kvbridge_descriptors_posted_total", **pre) >= 1
    assert sample(got, "kvbridge_requests_total", outcome="success", kind="", **dec) == 1
    assert sample(got, "kvbridge_requests_total", outcome="failed", kind="aborted", **dec) == 1
    assert sample(got, "kvbridge_requests_total", outcome="success", kind="", **pre) == 1
    assert sample(got, "kvbridge_transfer_seconds_count", **dec) == 2
    assert sample(got, "kvbridge_request_seconds_count", **dec) == 2
    assert sample(got, "kvbridge_request_seconds_count", **pre) == 1

    # Both sides' trace lines of room 21 carry one id; the decode's says what it asked for.
    lines = [json.loads(rec.getMessage()) for rec in caplog.records if rec.name == "kvbridge.trace"]
    mine = [ln for ln in lines if ln["trace"] == f"{21:016x}"]
    assert {ln["role"] for ln in mine} == {"prefill", "decode"}
    (asked,) = [ln for ln in mine if ln["event"] == "receive"]
    assert (asked["start"], asked["tokens"]) == (4, 10)
    assert {(ln["role"], ln["outcome"]) for ln in mine if ln["event"] == "end"} == {
        ("prefill", "success"),
        ("decode", "success"),
    }
    assert (
        sum(ln["bytes"] for ln in mine if ln["event"] == "chunk" and ln["role"] == "prefill")
        == sent
    )
    # Where the request's time went on each side (issue 30's budget): every phase each side
    # goes through, in the order it happened, adding up to the request's time.
    ends = {ln["role"]: ln for ln in mine if ln["event"] == "end"}
    assert set(ends["decode"]["phases"]) == {"ask", "first_write", "end"}
    assert set(ends["prefill"]["phases"]) == {"told", "ready", "post", "writes", "notice", "end"}
    for ln in ends.values():
        assert sum(ln["phases"].values()) == pytest.approx(ln["seconds"], abs=1e-5)
    assert list(ends["decode"]["phases"])[-1] == "end"
    assert sample(got, "kvbridge_phase_seconds_count", phase="first_write", **dec) == 1
    assert sample(got, "kvbridge_phase_seconds_count", phase="post", **pre) == 1
    # The request the engine gave up on ended before any write: its phases say so.
    assert sample(got, "kvbridge_phase_seconds_count", phase="end", **dec) == 2


def test_drain_reports_each_change_once() -> None:
    from kvbridge.runtime.metrics import Metrics
    from kvbridge.staging.cost import Path

    m = Metrics(Role.PREFILL, 0, "e", "tcp")
    m.sent(100, Path.DIRECT, 3)
    m.sent(50, Path.STAGED, 2)
    first = m.drain()
    assert first["counters"] == {
        "bytes_sent|direct": 100,
        "bytes_sent|staged": 50,
        "descriptors|": 5,
    }
    assert m.drain() == {"counters": {}, "observations": {}}
    m.sent(7, Path.DIRECT, 1)
    assert m.drain()["counters"] == {"bytes_sent|direct": 7, "descriptors|": 1}
    assert np.isclose(sum(first["counters"].values()), 155)
