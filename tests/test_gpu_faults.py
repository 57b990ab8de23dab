"""No write after release, no false success, on CUDA device memory: the fencing tests' faults
(a writer stopped mid-request, a writer killed, a decode rank killed, a decode rank paused)
made real on ranks whose Bridges move device pools (``bridge_ranks.DeviceCommands``: every
rank its own process on GPU 0). Skipped, saying why, where CUDA is not usable (CI, this
project's CPU hosts); ``scripts/gpu_check.sh`` runs it on a GPU machine.

What is proven beyond the host tests: a one-sided device writer (cudaipc, NIXL: the prefill's
copy engine writes into the decode's memory) keeps the pages quarantined until it answers or
is proven gone, and a killed one writes nothing once its process is gone; tcp's receiver
fences a stopped sender's device bytes; a peer's death never takes the other side's CUDA
context with it.
"""

from __future__ import annotations

import signal
import time

import pytest

from bridge_ranks import BIG, SMALL, DeviceCommands, deployment, job_of, until
from kvbridge.memory.device import cuda_unavailable
from kvbridge.transports import unavailable

WHY = cuda_unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY is not None, reason=f"needs CUDA: {WHY}")]

ONE_SIDED = ("cudaipc", "nixl")  # the writer's copy lands in the receiver's memory by itself


def _present(transport: str) -> None:
    why = unavailable(transport)
    if why is not None:
        pytest.skip(f"{transport}: {why} (scripts/gpu_check.sh nixl installs its wheel)")


@pytest.mark.parametrize("transport", ["cudaipc", "tcp", "nixl"])
def test_a_stalled_device_writer_never_lands_a_byte_after_release(transport: str) -> None:
    _present(transport)
    job = job_of(BIG, "tp=2,page=16", "tp=1,page=16", transport, tokens=2048)
    rooms = [1000]
    stall = {1: {"faults": "stop_after_post=1"}}
    with deployment(job, prefill_settings=stall, factory=DeviceCommands) as (prefill, decode, _):
        (d,) = decode
        d.call("receive", rooms)
        for p in prefill:
            p.start("send", rooms)
        assert until(prefill[1].stopped), "prefill rank 1 did not stall"
        state, why = d.call("wait", rooms, 10.0)[1000]
        assert state == "FAILED" and "heart-beating" in why, why
        if transport in ONE_SIDED:
            # The stopped rank's copy may still land: its pages stay quarantined, visibly.
            assert until(lambda: d.call("released", rooms)[1000] == "QUARANTINED", 5)
            time.sleep(0.5)
            assert d.call("released", rooms)[1000] == "QUARANTINED"
            assert d.call("reuse", rooms) == 0
        else:  # the receiver performs the writes: it fences them, released while it sleeps
            assert until(lambda: d.call("released", rooms)[1000] == "RELEASED", 5)
            assert d.call("reuse", rooms) > 0
        prefill[1].signal(signal.SIGCONT)
        assert until(lambda: d.call("released", rooms)[1000] == "RELEASED", 15)
        d.call("reuse", rooms)
        time.sleep(1.0)  # room for any late write to land
        assert d.call("landed_after_reuse", rooms) == 0
        for p in prefill:
            p.result()
            state, why = p.call("wait", rooms, 15.0)[1000]
            assert state == "FAILED", (p.name, why)
        assert until(lambda: d.call("active") == 0, 5)


def test_a_killed_device_writer_is_proven_gone_and_writes_nothing_after() -> None:
    """SIGKILL of a prefill rank stopped right after posting 32 MiB of device copies into the
    decode's pages over CUDA IPC: once its process is gone (pid and start time), the pages
    are released and reused, and nothing of the dead rank's copies lands after."""
    job = job_of(BIG, "tp=2,page=16", "tp=1,page=16", "cudaipc", tokens=2048)
    rooms = [1000]
    stall = {1: {"faults": "stop_after_post=1"}}
    with deployment(job, prefill_settings=stall, factory=DeviceCommands) as (prefill, decode, _):
        (d,) = decode
        d.call("receive", rooms)
        for p in prefill:
            p.start("send", rooms)
        assert until(prefill[1].stopped)
        prefill[1].signal(signal.SIGKILL)
        assert d.call("wait", rooms, 10.0)[1000][0] == "FAILED"
        assert until(lambda: d.call("released", rooms)[1000] == "RELEASED", 5)
        assert d.call("reuse", rooms) > 0
        time.sleep(1.0)
        assert d.call("landed_after_reuse", rooms) == 0
        prefill[0].result()
        assert prefill[0].call("wait", rooms, 10.0)[1000][0] == "FAILED"


@pytest.mark.parametrize("transport", ["cudaipc", "tcp"])
def test_a_killed_decode_rank_fails_every_sender_and_spares_their_gpu(transport: str) -> None:
    """The decode rank (whose memory cudaipc's writers have mapped) is killed once its
    metadata reached the prefill ranks: every send fails within the deadlines, and the prefill
    processes live on with their device usable and their own pools intact."""
    job = job_of(BIG, "tp=2,page=16", "tp=1,page=16", transport, tokens=512, requests=2)
    rooms = [1000, 1001]
    with deployment(job, factory=DeviceCommands) as (prefill, decode, _):
        (d,) = decode
        d.call("receive", rooms)
        for p in prefill:
            assert until(lambda p=p: p.call("asked", rooms) == len(rooms), 10), p.name
        d.signal(signal.SIGKILL)
        t0 = time.monotonic()
        for p in prefill:
            p.call("send", rooms)
        for p in prefill:
            states = p.call("wait", rooms, 10.0)
            assert {s for s, _ in states.values()} == {"FAILED"}, states
        assert time.monotonic() - t0 < 10
        for p in prefill:
            assert until(lambda p=p: p.call("active") == 0, 5), p.name
            assert p.call("device_intact"), p.name


@pytest.mark.parametrize("transport", ["cudaipc", "tcp"])
def test_device_requests_succeed_and_are_released_on_every_rank(transport: str) -> None:
    """30 requests, prefill TP 2 -> decode TP 4 (each decode rank owed by one prefill rank):
    every request exact on every decode rank's device pool, and released on every rank."""
    job = job_of(SMALL, "tp=2,page=4", "tp=4,page=4", transport, tokens=40, requests=30)
    rooms = [1000 + i for i in range(30)]
    with deployment(job, factory=DeviceCommands) as (prefill, decode, _):
        for d in decode:
            d.call("receive", rooms)
        for p in prefill:
            p.call("send", rooms)
        for rank in [*decode, *prefill]:
            states = rank.call("wait", rooms, 20.0)
            failed = {room: st for room, st in states.items() if st[0] != "SUCCESS"}
            assert not failed, (rank.name, failed)
        assert all(d.call("verify", rooms) for d in decode)
        for rank in [*decode, *prefill]:
            assert until(lambda rank=rank: rank.call("active") == 0, 5), rank.name


def test_a_decode_rank_paused_past_its_deadline_is_served_on_device_memory() -> None:
    """A decode rank with device pools stopped 1.3x its 3 s transfer deadline: its pause is
    forgiven (up to the timeout again) and the request lands exact over tcp's bounce
    buffers once the prefill sends."""
    job = job_of(SMALL, "tp=1,page=4", "tp=1,page=4", "tcp", tokens=16)
    rooms = [1000]
    patient = {0: {"heartbeat_misses": 100}}
    with deployment(
        job, settings={"transfer_timeout": 3.0}, prefill_settings=patient, factory=DeviceCommands
    ) as ((p,), (d,), _):
        d.call("receive", rooms)
        assert until(lambda: d.call("wait", rooms, 0.0)[1000][0] == "TRANSFERRING")
        d.signal(signal.SIGSTOP)
        time.sleep(4.0)
        d.signal(signal.SIGCONT)
        time.sleep(0.5)
        p.call("send", rooms)
        assert d.call("wait", rooms, 10.0)[1000] == ("SUCCESS", "")
        assert d.call("verify", rooms)
