"""``kvbridge bench transfer``: one real request between real processes, next to memcpy.

For each case (P1 -> D1 contiguous; P4 -> D1 sliced, NHD and HND) and each transport, the
parent runs a bootstrap server and spawns one process per prefill rank and one per decode
rank. Pools are pre-faulted :class:`~kvbridge.memory.HostPool` s; prefill pools hold random
bytes (no reference fill: the tests prove correctness, this measures speed).

A round (one request, a new room) is timed like this:

1. the decode rank creates its receiver and gives it the placement; its metadata reaches
   every prefill rank, whose sender then says WAITING_FOR_INPUT;
2. the prefill ranks meet at a barrier, note ``t0 = time.monotonic()`` and send the whole
   request as one chunk;
3. ``seconds`` = the decode rank's Success time minus the earliest ``t0``; GB/s = request
   bytes / seconds (1 GB = 1e9 bytes). The completion latency is the decode Success time minus
   the last prefill rank's "writes DONE" time (CLOCK_MONOTONIC is system-wide on Linux).

GB/s is the best round, latency the median round. memcpy is ``np.copyto`` of the same number
of bytes in the parent (one thread), measured before every case while no rank process runs;
the best figure of the run is kept (this host is shared: noise only ever slows a copy down).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import statistics
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvbridge import shield
from kvbridge.cluster import Job, bootstrap_service, build_side
from kvbridge.errors import KVBridgeError
from kvbridge.layout import KVLayout, Region
from kvbridge.placement import Placement
from kvbridge.plan import Pairing
from kvbridge.sidespec import SideOptions
from kvbridge.spec import CacheSpec

GB = 1e9
POOL_BUDGET = 3 << 29  # 1.5 GiB: what one side's pools may take when --layers is not given
SLICE, SLICE_STRIDE = 512, 2048  # P4 -> D1 NHD: 2 of 8 KV heads x 128 x bf16 in a 2 KiB token
ROOM0 = 1000
WAIT = 120.0  # seconds any one step of a round may take before the bench gives up
MAX_ROUNDS = 1000  # --repeat and --warmup: more rounds only narrow a figure already stable


@dataclass(frozen=True)
class Case:
    name: str
    prefill_tp: int
    layout: KVLayout
    sliced: bool  # compared with the sliced memcpy (else the contiguous one)


CASES = (
    Case("P1->D1 contiguous", 1, KVLayout.NHD, False),
    Case("P4->D1 NHD sliced", 4, KVLayout.NHD, True),
    Case("P4->D1 HND sliced", 4, KVLayout.HND, True),
)


@dataclass(frozen=True)
class Round:
    seconds: float  # earliest prefill start -> decode Success
    latency: float  # last prefill "writes DONE" -> decode Success
    tail: float = float("nan")  # last prefill layer computed -> decode Success
    # Rank 0's phases on each side ("prefill", "decode"): kvbridge.timeline's durations.
    phases: Mapping[str, Mapping[str, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class Forward:
    """A prefill forward the bench simulates before (or while) sending: ``layer_seconds`` of
    compute a layer, each layer handed over as soon as computed when ``layerwise``."""

    layer_seconds: float = 0.0
    layerwise: bool = False


# ---- shapes ----------------------------------------------------------------------------------


def first_layers(spec: CacheSpec, layers: int) -> CacheSpec:
    """The spec of the model's first ``layers`` layers (the whole spec if that is all)."""
    if not 1 <= layers <= spec.num_layers:
        raise KVBridgeError(f"--layers must be in [1, {spec.num_layers}], got {layers}")
    if layers == spec.num_layers:
        return spec
    return CacheSpec(f"{spec.model}[:{layers}]", spec.layers[:layers], spec.aux_bytes)


def auto_layers(spec: CacheSpec, tokens: int, page: int, budget: int = POOL_BUDGET) -> int:
    """All layers if one side's pools fit ``budget``, else the largest power of two that does."""
    side = build_side(_job(spec, CASES[0], "shm", tokens, page), SideOptions(page=page))
    per_layer = sum(r.nbytes for r in side.memory.regions) / spec.num_layers
    fit = int(budget // per_layer)
    if fit >= spec.num_layers:
        return spec.num_layers
    if fit < 1:
        raise KVBridgeError(
            f"--tokens: one layer of {tokens} tokens needs "
            f"{per_layer / 2**30:.1f} GiB, past the {budget / 2**30:.1f} GiB "
            f"budget; use fewer tokens"
        )
    return 1 << (fit.bit_length() - 1)


def check_rounds(repeat: int, warmup: int) -> None:
    if not 1 <= repeat <= MAX_ROUNDS or not 0 <= warmup <= MAX_ROUNDS:
        raise KVBridgeError(
            f"need --repeat in [1, {MAX_ROUNDS}] and --warmup in "
            f"[0, {MAX_ROUNDS}], got {repeat}, {warmup}"
        )


def check_memory(spec: CacheSpec, tokens: int, page: int) -> None:
    """Refuse, before allocating anything, a shape whose pools and memcpy buffers (each side's
    pools, twice the request for memcpy) do not fit this host's memory."""
    side = build_side(_job(spec, CASES[0], "shm", tokens, page), SideOptions(page=page))
    need = 4 * sum(r.nbytes for r in side.memory.regions)
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise KVBridgeError(
            f"--tokens {tokens} over {spec.num_layers} layers (--layers) needs "
            f"~{need / 2**30:.1f} GiB of pools and buffers; this host has "
            f"{have / 2**30:.1f} GiB"
        )


def _job(spec: CacheSpec, case: Case, transport: str, tokens: int, page: int) -> Job:
    return Job(
        spec=spec,
        transport=transport,
        tokens=tokens,
        verify=False,
        prefill=SideOptions(tp=case.prefill_tp, page=page, layout=case.layout),
        decode=SideOptions(tp=1, page=page, layout=case.layout),
    )


def _placement(job: Job, opts: SideOptions, shuffled: bool, seed: int) -> Placement:
    need = -(-job.tokens // opts.page)
    ids = np.random.default_rng(seed).permutation(need + 3)[:need] if shuffled else np.arange(need)
    return Placement(job.tokens, {"kv": ids, "swa": ids}, {"state": 0, "aux": 0})


# ---- memcpy baseline -------------------------------------------------------------------------


class Memcpy:
    """The memcpy baseline over ``nbytes``: one ``np.copyto`` between two pre-faulted buffers,
    and the same bytes as 512-byte pieces written at a 2 KiB stride (4 sources interleaved
    into one destination, as P4 -> D1 NHD writes them). :meth:`measure` may be called between
    cases; ``flat``/``sliced`` keep the best GB/s seen (the host is shared: noise only slows)."""

    def __init__(self, nbytes: int) -> None:
        from kvbridge.memory import HostPool

        self.nbytes = nbytes // SLICE_STRIDE * SLICE_STRIDE
        self._pool = HostPool(
            [Region("src", self.nbytes), Region("dst", self.nbytes)], shared=False
        )
        self._pool.view("src").fill(0x5A)
        self.flat = self.sliced = 0.0

    def measure(self, repeat: int) -> None:
        src, dst = self._pool.view("src"), self._pool.view("dst")
        ways = SLICE_STRIDE // SLICE
        src3, dst3 = src.reshape(ways, -1, SLICE), dst.reshape(-1, ways, SLICE)

        def sliced() -> None:
            for r in range(ways):
                np.copyto(dst3[:, r], src3[r])

        self.flat = max(self.flat, self.nbytes / _best(lambda: np.copyto(dst, src), repeat) / GB)
        self.sliced = max(self.sliced, self.nbytes / _best(sliced, repeat) / GB)

    def close(self) -> None:
        self._pool.close()


def _best(fn: Callable[[], None], repeat: int) -> float:
    fn()  # warm
    best = float("inf")
    for _ in range(max(3, repeat)):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


# ---- rank processes --------------------------------------------------------------------------


def _prefill_main(
    job: Job,
    rank: int,
    rounds: int,
    shuffled: bool,
    bootstrap: str,
    barrier: Any,
    done: Any,
    out: Any,
    forward: Forward = Forward(),
) -> None:
    from kvbridge.memory import HostPool
    from kvbridge.protocol import Role
    from kvbridge.runtime import Bridge
    from kvbridge.status import KVPoll

    job.enter(0)
    side = build_side(job, job.prefill)
    pool = HostPool(side.memory.regions_of(side.parallel.layers_of(rank)), shared=False)
    try:
        rng = np.random.default_rng(rank)
        for r in pool.regions():
            v = pool.view(r.name)
            v[:] = np.frombuffer(rng.bytes(len(v)), dtype=np.uint8)
        place = _placement(job, job.prefill, shuffled, 0)
        with Bridge(
            role=Role.PREFILL,
            spec=job.spec,
            parallel=side.parallel,
            rank=rank,
            memory=side.memory,
            regions=pool,
            transport=job.transport,
            transport_options=job.transport_options,
            bootstrap=bootstrap,
            engine_id="prefill",
            settings=job.settings(0),
        ) as bridge:
            for i in range(rounds):
                s = bridge.sender(ROOM0 + i, place)
                state = s.status.wait(WAIT, until=(KVPoll.WAITING_FOR_INPUT, KVPoll.FAILED))
                if state is not KVPoll.WAITING_FOR_INPUT:
                    raise KVBridgeError(f"room {s.room}: {state.name} before sending: {s.failure}")
                barrier.wait(WAIT)
                t0 = time.monotonic()
                computed = _forward(s, job.tokens, side.parallel.layers_of(rank), forward)
                if s.wait(WAIT) is not KVPoll.SUCCESS:
                    raise KVBridgeError(f"room {s.room}: {s.poll().name}: {s.failure}")
                phases = s.status.timeline.durations()
                out.put(("prefill", rank, i, t0, s.writes_done_at, computed, phases))
            done.wait(WAIT)  # keep answering until the decode side is done
    except BaseException as e:  # report, never hang the parent or the other ranks
        barrier.abort()
        out.put(("error", f"prefill rank {rank}", f"{e!r}\n{traceback.format_exc()}"))
    finally:
        pool.close()


def _forward(s: Any, tokens: int, layers: range, forward: Forward) -> float:
    """Send the request as ``forward`` says; returns when its last layer was computed. The
    compute is simulated: a sleep of ``layer_seconds`` a layer, during which a GPU engine's
    CPU (and its transfers) would run free too."""
    end = time.monotonic()
    for li in layers if forward.layer_seconds or forward.layerwise else ():
        end += forward.layer_seconds
        time.sleep(max(0.0, end - time.monotonic()))  # on schedule, whatever a send took
        if forward.layerwise:
            s.send(tokens, layers=range(li, li + 1))
    computed = time.monotonic()
    if not forward.layerwise:
        s.send(tokens)
    return computed


def _decode_main(
    job: Job, rank: int, rounds: int, shuffled: bool, bootstrap: str, done: Any, out: Any
) -> None:
    from kvbridge.memory import HostPool
    from kvbridge.protocol import Role
    from kvbridge.runtime import Bridge
    from kvbridge.status import KVPoll

    job.enter(1)
    side = build_side(job, job.decode)
    pool = HostPool(
        side.memory.regions_of(side.parallel.layers_of(rank)), shared=job.transport == "shm"
    )
    try:
        place = _placement(job, job.decode, shuffled, 1)
        with Bridge(
            role=Role.DECODE,
            spec=job.spec,
            parallel=side.parallel,
            rank=rank,
            memory=side.memory,
            regions=pool,
            transport=job.transport,
            transport_options=job.transport_options,
            bootstrap=bootstrap,
            engine_id="decode",
            settings=job.settings(1),
        ) as bridge:
            for i in range(rounds):
                r = bridge.receiver(ROOM0 + i)
                r.init(place)
                if r.wait(3 * WAIT) is not KVPoll.SUCCESS:
                    raise KVBridgeError(f"room {r.room}: {r.poll().name}: {r.failure}")
                out.put(("decode", rank, i, r.status.ended_at, r.status.timeline.durations()))
            done.wait(WAIT)
    except BaseException as e:
        out.put(("error", f"decode rank {rank}", f"{e!r}\n{traceback.format_exc()}"))
    finally:
        pool.close()


def measure(
    job: Job,
    rounds: int,
    *,
    shuffled: bool = False,
    on_round: Callable[[], None] = lambda: None,
    forward: Forward = Forward(),
) -> list[Round]:
    """Run ``rounds`` requests of ``job`` between freshly spawned rank processes (on the job's
    hosts, where it has them)."""
    if job.transport == "inproc":
        raise KVBridgeError(
            "the inproc transport moves bytes inside one process; this bench "
            "runs every rank in a process of its own (use shm or tcp)"
        )
    ctx = mp.get_context("spawn")
    pw = job.prefill.parallel(job.spec.num_layers).world
    dw = job.decode.parallel(job.spec.num_layers).world
    barrier, done, out = ctx.Barrier(pw), ctx.Event(), ctx.Queue()
    starts: dict[int, list[float]] = {i: [] for i in range(rounds)}
    writes: dict[int, list[float]] = {i: [] for i in range(rounds)}
    computed: dict[int, list[float]] = {i: [] for i in range(rounds)}
    ends: dict[int, list[float]] = {i: [] for i in range(rounds)}
    phases: dict[int, dict[str, Mapping[str, float]]] = {i: {} for i in range(rounds)}
    with bootstrap_service(job, job.prefill_settings.get("token")) as server:
        procs = [
            ctx.Process(
                target=_prefill_main,
                daemon=True,
                args=(job, r, rounds, shuffled, server.address, barrier, done, out, forward),
            )
            for r in range(pw)
        ]
        procs += [
            ctx.Process(
                target=_decode_main,
                daemon=True,
                args=(job, r, rounds, shuffled, server.address, done, out),
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


# ---- the bench -------------------------------------------------------------------------------


def run_transfer_bench(
    *,
    model: str = "qwen3-32b",
    tokens: Sequence[int] = (4096, 32768),
    layers: int | None = None,
    transports: Sequence[str] = ("shm", "tcp"),
    repeat: int = 5,
    warmup: int = 1,
    page: int = 64,
    shuffled: bool = False,
    cases: Sequence[Case] = CASES,
    console: Console | None = None,
    as_json: bool = False,
) -> list[dict[str, Any]]:
    """Measure every (tokens, case, transport); print a table per token count (unless
    ``as_json``: the caller prints the rows) and return the rows."""
    from kvbridge.hf import load_spec

    check_rounds(repeat, warmup)
    console = console or Console()
    full = load_spec(model)
    shapes = [(n, first_layers(full, layers or auto_layers(full, n, page))) for n in tokens]
    for n, spec in shapes:
        check_memory(spec, n, page)
    rounds = warmup + repeat
    runs = len(cases) * len(transports)
    rows: list[dict[str, Any]] = []
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} rounds"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as progress:
        bar = progress.add_task("", total=len(shapes) * runs * rounds)
        for n, spec in shapes:
            measured: list[tuple[Case, str, int, int, list[Round]]] = []
            memcpy = Memcpy(_request_bytes(_job(spec, cases[0], transports[0], n, page)))
            try:
                for case in cases:
                    for transport in transports:
                        progress.update(bar, description=f"{n} tokens: memcpy")
                        memcpy.measure(repeat)
                        progress.update(bar, description=f"{n} tokens: {case.name}, {transport}")
                        job = _job(spec, case, transport, n, page)
                        pairing = Pairing(build_side(job, job.prefill), build_side(job, job.decode))
                        plan = pairing.plan(
                            _placement(job, job.prefill, shuffled, 0),
                            _placement(job, job.decode, shuffled, 1),
                        )
                        got = measure(
                            job, rounds, shuffled=shuffled, on_round=lambda: progress.advance(bar)
                        )[warmup:]
                        measured.append((case, transport, plan.total_bytes, plan.total_runs, got))
            finally:
                memcpy.close()
            table = _table(full, spec, n, repeat, page, shuffled)
            for case, transport, nbytes, nruns, got in measured:
                base = memcpy.sliced if case.sliced else memcpy.flat
                gbps = nbytes / min(r.seconds for r in got) / GB
                row = {
                    "model": full.model,
                    "tokens": n,
                    "layers": spec.num_layers,
                    "case": case.name,
                    "transport": transport,
                    "page": page,
                    "pages": "shuffled" if shuffled else "contiguous",
                    "bytes": nbytes,
                    "runs": nruns,
                    "gbps": gbps,
                    "gbps_median": nbytes / statistics.median(r.seconds for r in got) / GB,
                    "memcpy_gbps": base,
                    "memcpy": "sliced" if case.sliced else "flat",
                    "memcpy_flat_gbps": memcpy.flat,
                    "memcpy_sliced_gbps": memcpy.sliced,
                    "ratio": gbps / base,
                    "latency_ms": statistics.median(r.latency for r in got) * 1e3,
                    "latency_ms_max": max(r.latency for r in got) * 1e3,
                    "repeats": len(got),
                }
                rows.append(row)
                table.add_row(
                    case.name,
                    transport,
                    f"{nbytes / 2**30:.3f} GiB",
                    f"{gbps:.2f}",
                    f"{base:.2f} {row['memcpy']}",
                    f"{row['ratio']:.2f}",
                    f"{row['latency_ms']:.2f}",
                )
            if not as_json:
                console.print(table)
    return rows


def _request_bytes(job: Job) -> int:
    side = build_side(job, job.decode)
    return (
        Pairing(side, side)
        .plan(_placement(job, job.decode, False, 0), _placement(job, job.decode, False, 1))
        .total_bytes
    )


def _table(
    full: CacheSpec, spec: CacheSpec, tokens: int, repeat: int, page: int, shuffled: bool
) -> Table:
    subset = (
        ""
        if spec is full
        else f", only the first {spec.num_layers} of {full.num_layers} layers (memory)"
    )
    table = Table(
        title=f"{full.model}: {tokens} tokens{subset}; page {page}, "
        f"{'shuffled' if shuffled else 'contiguous'} pages",
        caption=f"GB/s = 1e9 B/s, best of {repeat} rounds. completion = decode Success "
        f"- last prefill writes DONE, median. memcpy = best one-thread "
        f"np.copyto in this run, flat or as {SLICE} B pieces at a "
        f"{SLICE_STRIDE // 1024} KiB stride.",
    )
    for col in ("case", "transport", "bytes", "GB/s", "memcpy GB/s", "x memcpy", "completion ms"):
        table.add_column(col, justify="left" if col in ("case", "transport") else "right")
    return table
