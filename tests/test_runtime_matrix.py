"""Real processes, real ports: every request's bytes on every decode rank equal the reference
re-shard, for every topology the issue names, on both embedded cross-process transports."""

from __future__ import annotations

import pytest

from kvbridge.cluster import Job, run
from kvbridge.spec import CacheSpec
from kvbridge.transports import unavailable
from runtime_cases import DENSE6, DENSE8, GDN, MAMBA2, MLA, SWA, job

CASES: dict[str, tuple[CacheSpec, str, str, dict[str, object]]] = {
    "P4-D1": (DENSE8, "tp=4,page=4", "tp=1,page=4", {}),
    "P1-D4": (DENSE8, "tp=1,page=4", "tp=4,page=4", {}),
    "P2-D3": (DENSE6, "tp=2,page=4", "tp=3,page=8", {}),
    "PP2-PP1": (DENSE8, "tp=1,pp=2,page=4", "tp=2,page=4", {}),
    "MLA-P4-D2": (MLA, "tp=4,page=4", "tp=2,page=2", {}),
    "Mamba2-P2-D4": (MAMBA2, "tp=2,page=4", "tp=4,page=4", {}),
    "GDN-P2-D4": (GDN, "tp=2,page=4", "tp=4,page=4", {}),
    # Conv states [state_len, dim] (vLLM's default, SGLang) -> [dim, state_len], and back.
    "Mamba2-SD-DS": (MAMBA2, "tp=2,page=4,conv=sd", "tp=1,page=4,conv=ds", {}),
    "GDN-DS-SD": (GDN, "tp=1,page=4,conv=ds", "tp=2,page=4,conv=sd", {}),
    "SWA-P4-D1": (SWA, "tp=4,page=4,swa=yes", "tp=1,page=8,swa=yes", {"tokens": 50}),
    "page64-16": (DENSE8, "tp=2,page=64", "tp=1,page=16", {"tokens": 150}),
    "NHD-HND": (DENSE8, "tp=2,page=8,layout=nhd", "tp=4,page=4,layout=hnd", {}),
    "chunked8": (DENSE8, "tp=2,page=4", "tp=1,page=16", {"chunks": 8, "tokens": 70}),
    "100-requests": (DENSE8, "tp=2,page=4", "tp=1,page=4", {"requests": 100, "tokens": 9}),
}


def check_success(j: Job) -> None:
    result = run(j, timeout=90)
    for r in result.ranks:
        assert not r.error, r.error
        assert set(r.states.values()) == {"SUCCESS"}, (r.role, r.rank, r.failures)
        assert r.active_rooms == 0, (r.role, r.rank, "rooms left held")
    for r in result.of("decode"):
        assert r.bytes_ok, r.mismatch
        assert r.released
    assert len(result.of("decode")[0].states) == j.requests


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("case", list(CASES))
def test_topology(case: str, transport: str) -> None:
    spec, prefill, decode, extra = CASES[case]
    check_success(job(spec, prefill, decode, transport, **{"tokens": 37, **extra}))


def test_integrity_mode_passes_on_clean_transfers() -> None:
    check_success(job(DENSE6, "tp=2,page=4", "tp=3,page=8", "tcp", tokens=29, chunks=3,
                      settings={"integrity": True}))


ENGINE_CASES = ["P4-D1", "Mamba2-P2-D4", "NHD-HND"]


@pytest.mark.parametrize("transport", ["nixl", "mooncake"])
@pytest.mark.parametrize("case", ENGINE_CASES)
def test_topology_over_engines(case: str, transport: str) -> None:
    """The same plans and protocol over NIXL and Mooncake; skipped, with the reason, where the
    engine's library cannot load."""
    reason = unavailable(transport)
    if reason is not None:
        pytest.skip(f"{transport}: {reason}")
    spec, prefill, decode, extra = CASES[case]
    check_success(job(spec, prefill, decode, transport, **{"tokens": 37, **extra}))
