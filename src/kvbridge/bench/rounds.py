"""Timed rounds of the transfer benches: one request at a time between real rank processes.

For a job, the parent runs a bootstrap server and starts one process per prefill rank and one
per decode rank, forked from kvbridge's fork server (:func:`kvbridge.deploy.shield.fork_context`:
kvbridge imported once, not by each rank). Pools are pre-faulted
:class:`~kvbridge.memory.pools.HostPool` s; prefill pools hold random bytes (no reference
fill: the tests prove correctness, this measures speed).

A round (one request, a new room) is timed like this:

1. the decode rank creates its receiver and gives it the placement; its metadata reaches
   every prefill rank, whose sender then says WAITING_FOR_INPUT;
2. the prefill ranks meet at a barrier, note ``t0 = time.monotonic()`` and send the whole
   request as one chunk (or, behind a simulated forward, layer after layer: :class:`Forward`);
3. ``seconds`` = the decode rank's Success time minus the earliest ``t0``; the completion
   latency is the decode Success time minus the last prefill rank's "writes DONE" time
   (CLOCK_MONOTONIC is system-wide on Linux).
"""

from __future__ import annotations

import queue
import time
import traceback
from collections.abc import Callable, Mapping
from contextlib import closing
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from kvbridge.deploy import shield
from kvbridge.deploy.cluster import Job, bootstrap_service, build_side
from kvbridge.errors import KVBridgeError
from kvbridge.planner.placement import Placement
from kvbridge.planner.sidespec import SideOptions

ROOM0 = 1000
WAIT = 120.0  # seconds any one step of a round may take before the bench gives up
TICK = 0.5  # how often a waiting rank looks whether its bench is still there


@dataclass(frozen=True)
class Round:
    seconds: float  # earliest prefill start -> decode Success
    latency: float  # last prefill "writes DONE" -> decode Success
    tail: float = float("nan")  # last prefill layer computed -> decode Success
    # Rank 0's phases on each side ("prefill", "decode"): kvbridge.runtime.timeline's durations.
    phases: Mapping[str, Mapping[str, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class Forward:
    """A prefill forward the bench simulates before (or while) sending: ``layer_seconds`` of
    compute a layer, each layer handed over as soon as computed when ``layerwise``."""

    layer_seconds: float = 0.0
    layerwise: bool = False


def placement(job: Job, opts: SideOptions, shuffled: bool, seed: int) -> Placement:
    """The placement of a bench request on one side: its pages in order, or ``shuffled``
    (seeded by ``seed``) among a few more."""
    need = -(-job.tokens // opts.page)
    ids = np.random.default_rng(seed).permutation(need + 3)[:need] if shuffled else np.arange(need)
    return Placement(job.tokens, {"kv": ids, "swa": ids}, {"state": 0, "aux": 0})


def _orphaned(bench: Any, out: Any) -> None:
    """Raise where the bench that started this rank is gone (``bench``, the read end of a pipe
    only the bench writes to, is at its end): its rounds are for nobody, and its exit must not
    wait for ``out`` to be read (a bench killed mid-run once left its ranks blocked at exit on a
    full queue, for good). Not the parent's pid: a rank's parent is the fork server, which
    outlives the bench while the ranks hold its pipe."""
    if bench.poll():
        out.cancel_join_thread()
        raise KVBridgeError("the bench that started this rank is gone")


def _report(bench: Any, out: Any, error: tuple[str, str, str]) -> None:
    """Put a rank's ``error`` for the bench; where the bench is gone, without waiting at exit
    for it to be read (a request failed as its peer left for the bench's end: nobody reads)."""
    if bench.poll():
        out.cancel_join_thread()
    out.put(error)


def _await(
    wait: Callable[[float], Any], until: tuple[Any, ...], timeout: float, bench: Any, out: Any
) -> Any:
    """``wait(timeout)`` until it says one of ``until``, looking every :data:`TICK` whether
    the bench is gone (:func:`_orphaned`): a rank whose peer saw the bench gone first and left
    would otherwise wait its whole ``timeout`` for that peer (a killed bench's rank outlived it
    by 30 s)."""
    end = time.monotonic() + timeout
    while True:
        state = wait(max(0.0, min(TICK, end - time.monotonic())))
        if state in until or time.monotonic() >= end:
            return state
        _orphaned(bench, out)


def _prefill_main(
    job: Job,
    rank: int,
    rounds: int,
    shuffled: bool,
    bootstrap: str,
    barrier: Any,
    done: Any,
    out: Any,
    bench: Any,
    forward: Forward = Forward(),
    busy: bool = False,
) -> None:
    from kvbridge.memory.pools import HostPool
    from kvbridge.runtime.status import KVPoll

    job.enter(0)
    side = build_side(job, job.prefill)
    pool = HostPool(side.memory.regions_of(side.parallel.layers_of(rank)), shared=False)
    try:
        rng = np.random.default_rng(rank)
        for r in pool.regions():
            v = pool.view(r.name)
            v[:] = np.frombuffer(rng.bytes(len(v)), dtype=np.uint8)
        place = placement(job, job.prefill, shuffled, 0)
        ready = (KVPoll.WAITING_FOR_INPUT, KVPoll.FAILED)
        with job.bridge(side, rank, pool, bootstrap, decode=False) as bridge:
            for i in range(rounds):
                _orphaned(bench, out)
                s = bridge.sender(ROOM0 + i, place)
                state = _await(partial(s.status.wait, until=ready), ready, WAIT, bench, out)
                if state is not KVPoll.WAITING_FOR_INPUT:
                    raise KVBridgeError(f"room {s.room}: {state.name} before sending: {s.failure}")
                barrier.wait(WAIT)
                t0 = time.monotonic()
                computed = _forward(s, job.tokens, side.parallel.layers_of(rank), forward)
                if _ended(s, busy, WAIT, bench, out) is not KVPoll.SUCCESS:
                    raise KVBridgeError(f"room {s.room}: {s.poll().name}: {s.failure}")
                phases = s.status.timeline.durations()
                out.put(("prefill", rank, i, t0, s.writes_done_at, computed, phases))
            _await(done.wait, (True,), WAIT, bench, out)  # keep answering until the decode is done
    except BaseException as e:  # report, never hang the parent or the other ranks
        barrier.abort()
        _report(bench, out, ("error", f"prefill rank {rank}", f"{e!r}\n{traceback.format_exc()}"))
    finally:
        pool.close()


def _forward(s: Any, tokens: int, layers: range, forward: Forward) -> float:
    """Send the request as ``forward`` says; returns when its last layer was computed. The
    compute is simulated: a sleep of ``layer_seconds`` a layer, during which a GPU engine's
    CPU (and its transfers) would run free too."""
    end = computed = time.monotonic()
    for li in layers if forward.layer_seconds or forward.layerwise else ():
        end += forward.layer_seconds
        time.sleep(max(0.0, end - time.monotonic()))  # on schedule, whatever a send took
        # Computed before its send: a send may move the bytes itself (shm's small batches),
        # and the decode may succeed before that send returns.
        computed = time.monotonic()
        if forward.layerwise:
            s.send(tokens, layers=range(li, li + 1))
    if not forward.layerwise:
        s.send(tokens)
    return computed


def _ended(request: Any, busy: bool, timeout: float, bench: Any, out: Any) -> Any:
    """The request's end state: waited for (the GIL free meanwhile) or, ``busy``, polled in a
    Python loop as an engine's scheduler loop polls its transfers: the interpreter is then
    busy, and kvbridge's own threads wait their turn for it after every blocking call."""
    from kvbridge.runtime.status import KVPoll

    ends = (KVPoll.SUCCESS, KVPoll.FAILED)
    end = time.monotonic() + timeout
    if busy:
        look = time.monotonic() + TICK
        while request.poll() not in ends and (now := time.monotonic()) < end:
            if now > look:  # now and then, not at every poll
                _orphaned(bench, out)
                look = now + TICK
    return _await(request.wait, ends, max(0.0, end - time.monotonic()), bench, out)


def _decode_main(
    job: Job,
    rank: int,
    rounds: int,
    shuffled: bool,
    bootstrap: str,
    done: Any,
    out: Any,
    bench: Any,
    busy: bool = False,
) -> None:
    from kvbridge.memory.pools import HostPool
    from kvbridge.runtime.status import KVPoll

    job.enter(1)
    side = build_side(job, job.decode)
    pool = HostPool(
        side.memory.regions_of(side.parallel.layers_of(rank)), shared=job.transport == "shm"
    )
    try:
        place = placement(job, job.decode, shuffled, 1)
        with job.bridge(side, rank, pool, bootstrap, decode=True) as bridge:
            for i in range(rounds):
                _orphaned(bench, out)
                r = bridge.receiver(ROOM0 + i)
                r.init(place)
                if _ended(r, busy, 3 * WAIT, bench, out) is not KVPoll.SUCCESS:
                    raise KVBridgeError(f"room {r.room}: {r.poll().name}: {r.failure}")
                out.put(("decode", rank, i, r.status.ended_at, r.status.timeline.durations()))
            _await(done.wait, (True,), WAIT, bench, out)
    except BaseException as e:
        _report(bench, out, ("error", f"decode rank {rank}", f"{e!r}\n{traceback.format_exc()}"))
    finally:
        pool.close()


def measure(
    job: Job,
    rounds: int,
    *,
    shuffled: bool = False,
    on_round: Callable[[], None] = lambda: None,
    forward: Forward = Forward(),
    busy: bool = False,
) -> list[Round]:
    """Run ``rounds`` requests of ``job`` between freshly started rank processes (on the job's
    hosts, where it has them); ``busy``: each rank's engine thread polls its request in a
    Python loop rather than blocking (see :func:`_ended`)."""
    if job.transport == "inproc":
        raise KVBridgeError(
            "the inproc transport moves bytes inside one process; this bench "
            "runs every rank in a process of its own (use shm or tcp)"
        )
    ctx = shield.fork_context()  # ranks forked from a server with kvbridge imported
    pw = job.prefill.parallel(job.spec.num_layers).world
    dw = job.decode.parallel(job.spec.num_layers).world
    barrier, done, out = ctx.Barrier(pw), ctx.Event(), ctx.Queue()
    starts: dict[int, list[float]] = {i: [] for i in range(rounds)}
    writes: dict[int, list[float]] = {i: [] for i in range(rounds)}
    computed: dict[int, list[float]] = {i: [] for i in range(rounds)}
    ends: dict[int, list[float]] = {i: [] for i in range(rounds)}
    phases: dict[int, dict[str, Mapping[str, float]]] = {i: {} for i in range(rounds)}
    # The ranks watch ``watch`` for the end of the bench (``held`` closed: this process gone).
    watch, held = ctx.Pipe(duplex=False)
    with (
        closing(watch),
        closing(held),
        bootstrap_service(job, job.prefill_settings.get("token")) as server,
    ):
        procs = [
            ctx.Process(
                target=_prefill_main,
                daemon=True,
                args=(
                    job,
                    r,
                    rounds,
                    shuffled,
                    server.address,
                    barrier,
                    done,
                    out,
                    watch,
                    forward,
                    busy,
                ),
            )
            for r in range(pw)
        ]
        procs += [
            ctx.Process(
                target=_decode_main,
                daemon=True,
                args=(job, r, rounds, shuffled, server.address, done, out, watch, busy),
            )
            for r in range(dw)
        ]
        with shield.running(*procs):
            try:
                deadline = time.monotonic() + 60 + 3 * WAIT * rounds
                left = (pw + dw) * rounds
                while left:
                    if time.monotonic() > deadline:
                        raise KVBridgeError(f"{job.transport}: rounds did not finish in time")
                    try:
                        item = out.get(timeout=0.5)
                    except queue.Empty:
                        dead = [p.pid for p in procs if not p.is_alive()]
                        if dead:
                            raise KVBridgeError(
                                f"rank processes {dead} exited without a result"
                            ) from None
                        continue
                    if item[0] == "error":
                        raise KVBridgeError(f"{job.transport}: {item[1]} failed: {item[2]}")
                    role, rank, i, *times = item
                    if rank == 0:
                        phases[i][role] = times[-1]
                    if role == "prefill":
                        starts[i].append(times[0])
                        computed[i].append(times[2])
                        if times[1] is not None:  # None: this rank owed the decode side nothing
                            writes[i].append(times[1])
                    else:
                        ends[i].append(times[0])
                        on_round()
                    left -= 1
            finally:
                done.set()
    return [
        Round(
            max(ends[i]) - min(starts[i]),
            max(ends[i]) - max(writes[i]) if writes[i] else float("nan"),
            max(ends[i]) - max(computed[i]),
            phases[i],
        )
        for i in range(rounds)
    ]
