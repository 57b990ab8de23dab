"""Real processes, real ports: every request's bytes on every decode rank equal the reference
re-shard, for every topology the issue names, across both embedded cross-process transports
(each case direct on one and staged on the other) and, for a few, over NIXL and Mooncake."""

from __future__ import annotations

import pytest

from kvbridge.deploy.cluster import Job, run
from kvbridge.model.spec import CacheSpec
from kvbridge.staging import StagingMode
from kvbridge.transports import unavailable
from runtime_cases import DENSE6, DENSE8, GDN, MAMBA2, MLA, SWA
from runtime_cases import job as deployed

# These cases check bytes, not liveness (test_faults.py kills peers): a 10 s heartbeat window,
# not the 1 s one, so that a rank starved for a second on a loaded host is not declared dead
# (seen: the 100 staged requests on tcp failed peer_dead beside the engines' pytest worker).
PATIENT = {"heartbeat_misses": 50}


def job(*args: object, settings: dict[str, object] | None = None, **kw: object) -> Job:
    return deployed(*args, settings={**PATIENT, **(settings or {})}, **kw)  # type: ignore[arg-type]


# Every case starts a deployment of real processes: 2-5 s each, some 130 s in all.
pytestmark = pytest.mark.slow

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
    # Context parallel: each prefill CP group holds its own tokens (zig-zag halves), and
    # for a hybrid model only the group holding the last token has the state.
    "CP2-TP2": (DENSE8, "tp=2,cp=2,tokens=zigzag,page=4", "tp=2,page=8", {}),
    "Mamba2-CP2-TP2": (MAMBA2, "tp=1,cp=2,tokens=contiguous,page=4", "tp=2,page=4", {"chunks": 3}),
    # vLLM's decode context parallel: the two copies of the MLA latent split its tokens.
    "MLA-TP1-DCP2": (MLA, "tp=1,page=4", "tp=2,dcp=2,tokens=interleaved,interleave=4,page=4", {}),
    # Attention DP on both sides: 8 requests, every prefill group meets every decode group;
    # decode ranks are not told the prefill group, the bootstrap service is.
    "MLA-DP2xTP2-DP4xTP1": (MLA, "dp=2,tp=2,page=4", "dp=4,tp=1,page=4", {"requests": 8}),
    # Layer-wise sends: each chunk one layer at a time, in a random order, as a forward that
    # computes layer by layer would hand them over.
    "layerwise-PP2": (DENSE8, "tp=2,pp=2,page=4", "tp=1,page=8", {"layerwise": True, "chunks": 3}),
    "layerwise-Mamba2": (MAMBA2, "tp=2,page=4", "tp=4,page=4", {"layerwise": True, "chunks": 2}),
    # Decode prefix-cache hits: each request's decode placement starts past tokens it holds,
    # in pages every request shares (left as they were, canary, byte for byte); chunks
    # before the start carry no bytes.
    "prefix-hit-P2-D1": (
        DENSE8,
        "tp=2,page=4",
        "tp=1,page=16",
        {"held": 32, "requests": 4, "chunks": 3},
    ),
    "prefix-hit-unaligned-P2-D3": (
        DENSE6,
        "tp=2,page=4",
        "tp=3,page=8",
        {"held": 13, "requests": 3},
    ),
    "prefix-hit-Mamba2": (MAMBA2, "tp=2,page=4", "tp=4,page=4", {"held": 20, "requests": 2}),
    "prefix-hit-SWA": (
        SWA,
        "tp=2,page=4,swa=yes",
        "tp=1,page=8,swa=yes",
        {"tokens": 50, "held": 24},
    ),
}


# Staging forced, in segments of one page (4 KiB) so that every chunk is several segments.
STAGED = {"staging": StagingMode.ALWAYS, "staging_slot_bytes": 4096, "staging_slots": 4}


def check_success(j: Job, staged: bool = False) -> None:
    """Every request succeeded, byte-exact; ``staged``: whether segments were scattered."""
    result = run(j, timeout=90)
    for r in result.ranks:
        assert not r.error, r.error
        assert set(r.states.values()) == {"SUCCESS"}, (r.role, r.rank, r.failures)
        assert r.active_rooms == 0, (r.role, r.rank, "rooms left held")
    for r in result.of("decode"):
        assert r.bytes_ok, r.mismatch
        assert r.released
        assert (r.scattered > 0) == staged, ("staged segments scattered", r.scattered)
    # every request ended on the decode ranks of its DP group (every rank, without DP)
    rooms = [set(r.states) for r in result.of("decode")]
    assert set().union(*rooms) == {1000 + i for i in range(j.requests)}
    assert sum(map(len, rooms)) == j.requests * j.decode.parallel(j.spec.num_layers).world


# Each case crosses both transports: direct on one, staged on the other (in turn). The
# planner does not know the transport, and the transport contract suite drives every
# transport with arbitrary runs; what a case adds is its runs end to end across processes.
DIRECT = [(case, ("shm", "tcp")[i % 2]) for i, case in enumerate(CASES)]
STAGED_ON = [(case, ("tcp", "shm")[i % 2]) for i, case in enumerate(CASES)]


@pytest.mark.parametrize(("case", "transport"), DIRECT)
def test_topology(case: str, transport: str) -> None:
    spec, prefill, decode, extra = CASES[case]
    check_success(job(spec, prefill, decode, transport, **{"tokens": 37, **extra}))


@pytest.mark.parametrize(("case", "transport"), STAGED_ON)
def test_topology_staged(case: str, transport: str) -> None:
    """The same matrix with every chunk staged: gathered (or written from its extents) into a
    slot the decode rank granted, scattered by the decode rank."""
    spec, prefill, decode, extra = CASES[case]
    check_success(
        job(spec, prefill, decode, transport, **{"tokens": 37, **extra}, settings=STAGED),
        staged=True,
    )


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_staging_ring_exhaustion_with_100_concurrent_requests_completes(transport: str) -> None:
    """One decode slot for two prefill ranks that each ask two ahead, 100 requests of five
    segments each in flight together: asks wait their turn, none fails, none deadlocks."""
    check_success(
        job(
            DENSE8,
            "tp=2,page=4",
            "tp=1,page=4",
            transport,
            tokens=37,
            requests=100,
            settings=STAGED,
            prefill_settings={"staging_slots": 2},
            decode_settings={"staging_slots": 1},
        ),
        staged=True,
    )


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_integrity_mode_passes_on_clean_transfers(staged: bool) -> None:
    settings: dict[str, object] = {"integrity": True, **(STAGED if staged else {})}
    check_success(
        job(DENSE6, "tp=2,page=4", "tp=3,page=8", "tcp", tokens=29, chunks=3, settings=settings),
        staged=staged,
    )


ENGINE_CASES = ["P4-D1", "Mamba2-P2-D4", "NHD-HND"]


@pytest.mark.parametrize("transport", ["nixl", "mooncake"])
@pytest.mark.parametrize("case", ENGINE_CASES)
def test_topology_over_engines(case: str, transport: str) -> None:
    """The same plans and protocol over NIXL and Mooncake, written directly (their cost models
    would stage some of these pairs: the staged path has a test of its own); skipped, with the
    reason, where the engine's library cannot load."""
    reason = unavailable(transport)
    if reason is not None:
        pytest.skip(f"{transport}: {reason}")
    spec, prefill, decode, extra = CASES[case]
    check_success(
        job(
            spec,
            prefill,
            decode,
            transport,
            **{"tokens": 37, **extra},
            settings={"staging": StagingMode.NEVER},
        )
    )


@pytest.mark.parametrize("transport", ["nixl", "mooncake"])
@pytest.mark.parametrize("case", ENGINE_CASES)
def test_topology_staged_over_engines(case: str, transport: str) -> None:
    reason = unavailable(transport)
    if reason is not None:
        pytest.skip(f"{transport}: {reason}")
    spec, prefill, decode, extra = CASES[case]
    check_success(
        job(spec, prefill, decode, transport, **{"tokens": 37, **extra}, settings=STAGED),
        staged=True,
    )
