"""No write after release, no false success: every rank in its own process, faults made real
(SIGSTOP/SIGCONT, SIGKILL, a rogue process on the host), bytes and states asserted.

The decode engine here behaves as a real one must: it reuses a request's pages only once the
receiver says ``released``, and then fills them with fresh bytes (REUSED). A write that lands
after release would overwrite them; the tests count such bytes and require zero.
"""

from __future__ import annotations

import signal
import time

import pytest

from bridge_ranks import BIG, SMALL, Commands, DeviceCommands, deployment, job_of, until
from kvbridge.memory.device import cuda_unavailable
from kvbridge.staging import StagingMode
from kvbridge.transports import unavailable

# Every chunk staged in 1 MiB segments (32 a prefill rank here); the decode rank has more slots
# than a stalled writer can hold (it asks two ahead), so the other writer goes on meanwhile.
STAGED = {"staging": StagingMode.ALWAYS, "staging_slot_bytes": 1 << 20, "staging_slots": 2}
STAGED_DECODE = {**STAGED, "staging_slots": 8}

# Real processes stalled, stopped and killed, each waited out: some 50 s in all.
pytestmark = pytest.mark.slow

# Where the ranks' pools are: "host", or "cuda" (every rank's Bridge moves device memory on
# GPU 0: bridge_ranks.DeviceCommands; skipped, saying why, without CUDA; scripts/gpu_check.sh
# runs those cases on a GPU machine).
NO_CUDA = cuda_unavailable()
FACTORY = {"host": Commands, "cuda": DeviceCommands}
ONE_SIDED = ("shm", "cudaipc", "nixl")  # the writer's copy lands in the receiver's memory


def on(transport: str, place: str = "host", *extra: object, tag: str = "") -> object:
    """A case on ``transport`` with pools in ``place`` (and ``extra`` arguments, named by
    ``tag``), skipped where that cannot run here."""
    marks = []
    if place == "cuda":
        marks.append(pytest.mark.skipif(NO_CUDA is not None, reason=f"device memory: {NO_CUDA}"))
    name = "-".join(x for x in (transport, place, tag) if x)
    return pytest.param(transport, place, *extra, id=name, marks=marks)


def present(transport: str) -> None:
    why = unavailable(transport)
    if why is not None:
        pytest.skip(f"{transport}: {why}")


@pytest.mark.parametrize(
    ("transport", "place", "staged"),
    [
        on("shm", "host", False, tag="direct"),
        on("shm", "host", True, tag="staged"),
        on("tcp", "host", False, tag="direct"),
        on("tcp", "host", True, tag="staged"),
        on("cudaipc", "cuda", False),
        on("tcp", "cuda", False),
        on("nixl", "cuda", False, tag="direct"),
        on("nixl", "cuda", True, tag="staged"),  # gathered and scattered on the device
    ],
)
def test_a_stalled_writer_never_lands_a_byte_after_release_and_never_succeeds(
    transport: str, place: str, staged: bool
) -> None:
    present(transport)
    job = job_of(BIG, "tp=2,page=16", "tp=1,page=16", transport, tokens=2048)
    rooms = [1000]
    stall = {
        1: {"faults": "stop_after_post=1", **(STAGED if staged else {})},
        0: STAGED if staged else {},
    }
    with deployment(
        job,
        settings=STAGED_DECODE if staged else None,
        prefill_settings=stall,
        factory=FACTORY[place],
    ) as (prefill, decode, _):
        (d,) = decode
        d.call("receive", rooms)
        for p in prefill:
            p.start("send", rooms)
        assert until(prefill[1].stopped), "prefill rank 1 did not stall"
        # The decode side declares it dead and fails the request...
        states = d.call("wait", rooms, 10.0)
        assert states[1000][0] == "FAILED" and "heart-beating" in states[1000][1], states
        if transport in ONE_SIDED:
            # ... but cannot stop a one-sided writer: the pages stay quarantined, visibly.
            assert until(lambda: d.call("released", rooms)[1000] == "QUARANTINED", 5)
            time.sleep(0.5)
            assert d.call("released", rooms)[1000] == "QUARANTINED"
        else:
            # ... and, writing itself, fences the request: released while the writer sleeps.
            assert until(lambda: d.call("released", rooms)[1000] == "RELEASED", 5)
        reused_before = d.call("reuse", rooms)
        assert (reused_before > 0) == (transport not in ONE_SIDED)
        prefill[1].signal(signal.SIGCONT)
        # The writer resumes, drains, learns it was fenced and acknowledges: only then
        # (one-sided) are the pages released and reused.
        assert until(lambda: d.call("released", rooms)[1000] == "RELEASED", 15)
        d.call("reuse", rooms)
        time.sleep(1.0)  # room for any late write to land
        assert d.call("landed_after_reuse", rooms) == 0
        for p in prefill:
            p.result()  # the send command
            state, why = p.call("wait", rooms, 15.0)[1000]
            assert state == "FAILED", (p.name, why)
        assert until(lambda: d.call("active") == 0, 5)
        assert (d.call("staged")[0] > 0) == staged


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_an_aborted_staged_request_never_scatters_after_release(transport: str) -> None:
    """The decode engine aborts a staged request while one writer is stopped right before
    posting its third segment (into a slot it was granted) and the other goes on writing. No
    byte of it lands in the pages once they were released and reused: what the writers still
    write lands in staging slots, which stay held until the request is released, and the
    decode rank does not scatter for a request that ended."""
    job = job_of(BIG, "tp=2,page=16", "tp=1,page=16", transport, tokens=2048)
    rooms = [1000]
    # The stall must not look like a death here: the abort is what ends the request.
    settings = {**STAGED_DECODE, "heartbeat_misses": 300}
    stall = {1: {**STAGED, "faults": "stop_before_post=3"}, 0: STAGED}
    with deployment(job, settings=settings, prefill_settings=stall) as (prefill, decode, _):
        (d,) = decode
        d.call("receive", rooms)
        for p in prefill:
            p.start("send", rooms)
        assert until(prefill[1].stopped), "prefill rank 1 did not stall"
        assert until(lambda: d.call("staged")[0] >= 2), "nothing was scattered"
        d.call("abort", rooms)
        state, why = d.call("wait", rooms, 5.0)[1000]
        assert state == "FAILED" and "aborted" in why, why
        if transport == "tcp":  # this rank receives the writes: it fences them, released
            assert until(lambda: d.call("released", rooms)[1000] == "RELEASED", 5)
        else:  # the stalled writer has not acknowledged: quarantined
            assert until(lambda: d.call("released", rooms)[1000] == "QUARANTINED", 5)
        d.call("reuse", rooms)
        prefill[1].signal(signal.SIGCONT)  # it posts its third segment, then learns
        assert until(lambda: d.call("released", rooms)[1000] == "RELEASED", 15)
        d.call("reuse", rooms)
        time.sleep(1.0)  # room for any late write or scatter to land
        assert d.call("landed_after_reuse", rooms) == 0
        for p in prefill:
            p.result()
            state, why = p.call("wait", rooms, 15.0)[1000]
            assert state == "FAILED", (p.name, why)
        assert until(lambda: d.call("active") == 0, 5)


@pytest.mark.parametrize(("transport", "place"), [on("shm"), on("cudaipc", "cuda")])
def test_a_killed_writer_is_proven_gone_and_its_pages_released_at_once(
    transport: str, place: str
) -> None:
    """SIGKILL of a prefill rank stopped right after posting its writes (over cudaipc: 32 MiB
    of device copies into the decode's pages): once its process is gone (pid and start time),
    the pages are released and reused, and nothing of the dead rank's writes lands after."""
    job = job_of(BIG, "tp=2,page=16", "tp=1,page=16", transport, tokens=2048)
    rooms = [1000]
    stall = {1: {"faults": "stop_after_post=1"}}
    with deployment(job, prefill_settings=stall, factory=FACTORY[place]) as (
        prefill,
        decode,
        _,
    ):
        (d,) = decode
        d.call("receive", rooms)
        for p in prefill:
            p.start("send", rooms)
        assert until(prefill[1].stopped)
        prefill[1].signal(signal.SIGKILL)
        states = d.call("wait", rooms, 10.0)
        assert states[1000][0] == "FAILED"
        assert until(lambda: d.call("released", rooms)[1000] == "RELEASED", 5)
        assert d.call("reuse", rooms) > 0
        time.sleep(1.0)
        assert d.call("landed_after_reuse", rooms) == 0
        prefill[0].result()
        assert prefill[0].call("wait", rooms, 10.0)[1000][0] == "FAILED"


@pytest.mark.parametrize(
    ("transport", "place"), [on("shm"), on("cudaipc", "cuda"), on("tcp", "cuda")]
)
def test_a_killed_decode_rank_fails_every_sender_and_leaves_nothing_behind(
    transport: str, place: str
) -> None:
    """The decode rank (whose memory shm and cudaipc writers have mapped) is killed once its
    rooms' metadata reached the prefill ranks: every send fails within the deadlines, shm's
    mapping of the dead rank's segment goes, and the prefill ranks live on (with device pools:
    their device usable and their own pools intact)."""
    job = job_of(BIG, "tp=2,page=16", "tp=1,page=16", transport, tokens=512, requests=2)
    rooms = [1000, 1001]
    with deployment(job, factory=FACTORY[place]) as (prefill, decode, _):
        (d,) = decode
        segments = d.call("segments")
        d.call("receive", rooms)
        for p in prefill:  # mapped at hello; the rooms' metadata here before the decode dies
            for segment in segments:
                assert until(lambda p=p, s=segment: p.call("maps", s) > 0, 10), p.name
            assert until(lambda p=p: p.call("asked", rooms) == len(rooms), 10), p.name
        d.signal(signal.SIGKILL)
        t0 = time.monotonic()
        for p in prefill:
            p.call("send", rooms)
        for p in prefill:
            states = p.call("wait", rooms, 10.0)
            # Its writes went into the dead rank's memory: never a success.
            assert {s for s, _ in states.values()} == {"FAILED"}, states
        assert time.monotonic() - t0 < 10
        for p in prefill:
            for segment in segments:
                assert until(lambda p=p, s=segment: p.call("maps", s) == 0, 5), p.name
            assert until(lambda p=p: p.call("active") == 0, 5)
            if place == "cuda":
                assert p.call("device_intact"), p.name


@pytest.mark.parametrize(
    ("transport", "place"), [on("shm"), on("cudaipc", "cuda"), on("tcp", "cuda")]
)
def test_rooms_are_released_on_every_rank_right_after_success(transport: str, place: str) -> None:
    # 2 KV heads at decode TP 4: each decode rank is owed by one prefill rank, and each
    # prefill rank gets metadata from decode ranks it owes nothing.
    job = job_of(SMALL, "tp=2,page=4", "tp=4,page=4", transport, tokens=40, requests=30)
    rooms = [1000 + i for i in range(30)]
    with deployment(job, factory=FACTORY[place]) as (prefill, decode, _):
        for d in decode:
            d.call("receive", rooms)
        for p in prefill:
            p.call("send", rooms)
        for rank in [*decode, *prefill]:
            states = rank.call("wait", rooms, 20.0)
            failed = {room: st for room, st in states.items() if st[0] != "SUCCESS"}
            assert not failed, (rank.name, failed)
        assert all(d.call("verify", rooms) for d in decode)
        t0 = time.monotonic()
        for rank in [*decode, *prefill]:
            assert until(lambda rank=rank: rank.call("active") == 0, 1.0, 0.01), rank.name
        assert time.monotonic() - t0 < 1.0


@pytest.mark.parametrize(
    ("transport", "place", "stop", "served"),
    [
        on("tcp", "host", 4.0, True, tag="1.3x"),
        on("tcp", "host", 7.0, False, tag="2.3x"),
        on("tcp", "cuda", 4.0, True, tag="1.3x"),
    ],
)
def test_a_rank_paused_past_its_deadline_is_forgiven_the_pause_up_to_its_timeout(
    transport: str, place: str, stop: float, served: bool
) -> None:
    """A decode rank stopped (SIGSTOP) past its request's 3 s transfer deadline, the prefill
    alive and patient. Its own pause moves the deadline back, at most as far again as the
    timeout: stopped 4 s, the request completes once the prefill sends; stopped 7 s, past
    twice the deadline, it fails at once on resuming and says it was paused. A slow rank is
    not a dead one, and a rank starved without end still ends its requests."""
    job = job_of(SMALL, "tp=1,page=4", "tp=1,page=4", transport, tokens=16)
    rooms = [1000]
    patient = {0: {"heartbeat_misses": 100}}  # the prefill waits out the decode's pause
    with deployment(
        job,
        settings={"transfer_timeout": 3.0},
        prefill_settings=patient,
        factory=FACTORY[place],
    ) as ((p,), (d,), _):
        d.call("receive", rooms)
        assert until(lambda: d.call("wait", rooms, 0.0)[1000][0] == "TRANSFERRING")
        d.signal(signal.SIGSTOP)  # its 3 s to the deadline start now
        time.sleep(stop)
        d.signal(signal.SIGCONT)
        time.sleep(0.5)  # its first ticks: the pause is seen, the deadline moved back
        if served:
            p.call("send", rooms)
            assert d.call("wait", rooms, 10.0)[1000] == ("SUCCESS", "")
            assert d.call("verify", rooms)
        else:
            state, reason = d.call("wait", rooms, 1.0)[1000]
            assert state == "FAILED", (state, reason)
            assert "deadline passed while TRANSFERRING" in reason, reason
            assert "this rank was paused 7." in reason, reason
            assert "moved the deadline back 3.0 s" in reason, reason
