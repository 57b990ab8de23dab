"""A whole deployment on this host: a bootstrap server and one real process per rank.

The multi-process tests, the fault suite, ``kvbridge bench transfer`` and the demo all run
through :func:`run`. Each prefill process fills its pools with its shard of every request's
logical cache (the reference re-shard), each decode process receives into canary-filled pools
and, when ``verify`` is on, compares every byte of its pools with the reference.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from kvbridge.config import Settings
from kvbridge.deploy import shield
from kvbridge.deploy.netns import Host, enter, inside
from kvbridge.errors import KVBridgeError
from kvbridge.model.spec import CacheSpec
from kvbridge.planner.placement import Placement
from kvbridge.planner.plan import Side
from kvbridge.planner.sidespec import SideOptions

if TYPE_CHECKING:
    from kvbridge.bootstrap import BootstrapServer
    from kvbridge.runtime import Bridge

CANARY = 0xA5


@dataclass(frozen=True)
class Job:
    spec: CacheSpec
    prefill: SideOptions
    decode: SideOptions
    transport: str = "shm"
    transport_options: dict[str, Any] = field(default_factory=dict)  # the transport's own
    tokens: int = 64
    requests: int = 1
    chunks: int = 1
    verify: bool = True
    seed: int = 0
    prefill_settings: dict[str, Any] = field(default_factory=dict)
    decode_settings: dict[str, Any] = field(default_factory=dict)
    kill_prefill: dict[int, float] = field(default_factory=dict)  # rank -> seconds after start
    kill_decode: dict[int, float] = field(default_factory=dict)
    bootstrap_down: bool = False  # decode ranks get an address nobody listens on
    prefill_sends: bool = True  # False: prefill ranks never create senders
    send_delay: float = 0.0  # prefill ranks wait this long before sending their chunks
    # decode ranks killed once every prefill sender has the request's metadata
    kill_decode_when_ready: tuple[int, ...] = ()
    # prefill ranks killed after the transfer: they drained and every decode rank reported
    kill_prefill_when_done: tuple[int, ...] = ()
    decode_spec: CacheSpec | None = None  # a decode side of another model (incompatibility)
    layerwise: bool = False  # prefill ranks send each chunk one layer at a time, shuffled
    # A decode prefix-cache hit: every request's decode placement starts at token ``held``,
    # its whole pages before it shared by all requests (as a prefix cache shares them).
    held: int = 0
    # Where the bootstrap service, the prefill ranks and the decode ranks run: a host each
    # (kvbridge.deploy.netns), their endpoints bound to its address; None: this host's loopback.
    hosts: tuple[Host, Host, Host] | None = None

    def settings(self, side: int) -> Settings:
        """The settings of a side's ranks (0 prefill, 1 decode): its own over the environment,
        bound to its host's address where it has one."""
        own = self.decode_settings if side else self.prefill_settings
        where = {"host": self.hosts[1 + side].address} if self.hosts else {}
        return Settings.from_env(**{**where, **own})

    def bridge(
        self, side: Side, rank: int, regions: Any, bootstrap: str, *, decode: bool, group: int = 0
    ) -> Bridge:
        """The bridge of engine rank ``rank`` of DP group ``group`` on one side, over
        ``regions``, as that side's rank process runs it (not started)."""
        from kvbridge.runtime import Bridge
        from kvbridge.wire.protocol import Role

        return Bridge(
            role=Role.DECODE if decode else Role.PREFILL,
            spec=side.spec,
            parallel=side.parallel,
            rank=rank,
            memory=side.memory,
            regions=regions,
            transport=self.transport,
            transport_options=self.transport_options,
            bootstrap=bootstrap,
            engine_id="decode" if decode else "prefill",
            settings=self.settings(int(decode)),
            dp=(self.decode if decode else self.prefill).dp,
            dp_rank=group,
        )

    def enter(self, side: int) -> None:
        """Move this (rank) process onto its side's host, if it has one."""
        if self.hosts:
            enter(self.hosts[1 + side].netns)


@dataclass(frozen=True)
class RankResult:
    role: str
    rank: int  # the process's index on its side: dp group * ranks a group + engine rank
    states: dict[int, str]  # room -> KVPoll name
    failures: dict[int, str]  # room -> reason
    bytes_ok: bool | None = None  # decode, when verified
    mismatch: str = ""
    released: bool = True
    active_rooms: int = 0
    scattered: int = 0  # decode: staged segments scattered
    seconds: float = 0.0
    error: str = ""  # the process raised


@dataclass(frozen=True)
class Result:
    ranks: list[RankResult]

    def of(self, role: str) -> list[RankResult]:
        return [r for r in self.ranks if r.role == role]


def placements(job: Job, opts: SideOptions, side_index: int) -> list[Placement]:
    """Request ``i`` lives in its own shuffled pages and in state/aux slot ``i``; on the
    decode side with ``held`` tokens, the whole pages before them are the same for every
    request."""
    need = -(-job.tokens // opts.page)
    rng = np.random.default_rng(job.seed * 7 + side_index)
    perm = rng.permutation(job.requests * need + 3)
    start = job.held if side_index else 0
    shared = start // opts.page
    out = []
    for i in range(job.requests):
        own = shared + i * (need - shared)
        ids = np.concatenate((perm[:shared], perm[own : own + need - shared]))
        out.append(Placement(job.tokens, {"kv": ids, "swa": ids}, {"state": i, "aux": i}, start))
    return out


def build_side(job: Job, opts: SideOptions, spec: CacheSpec | None = None) -> Side:
    from kvbridge.planner.layout import build_memory, default_group, window_pool_group

    spec = spec or job.spec
    pages = job.requests * -(-job.tokens // opts.page) + 3
    par = opts.parallel(spec.num_layers)
    mem = build_memory(
        spec,
        par,
        page_size=opts.page,
        num_pages=pages,
        kv_layout=opts.layout,
        conv_layout=opts.conv,
        state_slots=max(1, job.requests),
        aux_slots=max(1, job.requests),
        group_of=window_pool_group if opts.swa else default_group,
    )
    return Side(spec, par, mem)


def _rooms(job: Job) -> list[int]:
    return [1000 + i for i in range(job.requests)]


def group_of(job: Job, request: int, decode: bool) -> int:
    """The DP group a request lives in on a side: spread so that, given enough requests,
    every prefill group meets every decode group."""
    if decode:
        return (request // job.prefill.dp) % job.decode.dp
    return request % job.prefill.dp


def _mine(job: Job, group: int, decode: bool) -> list[tuple[int, int]]:
    """(request index, room) of the requests of one DP group."""
    return [(i, room) for i, room in enumerate(_rooms(job)) if group_of(job, i, decode) == group]


def _prefill_main(job: Job, index: int, bootstrap: str, out: Connection, stop_file: str) -> None:
    from kvbridge.memory.pools import HostPool
    from kvbridge.planner.reference import fill, logical_cache
    from kvbridge.runtime.status import KVPoll

    t0 = time.monotonic()
    job.enter(0)
    side = build_side(job, job.prefill)
    group, rank = divmod(index, side.parallel.world)
    pool = HostPool(side.memory.regions_of(side.parallel.layers_of(rank)), shared=False)
    try:
        places = placements(job, job.prefill, 0)
        views = {rank: {r.name: pool.view(r.name) for r in pool.regions()}}
        for v in views[rank].values():
            v[:] = np.random.default_rng(rank).integers(0, 256, len(v), dtype=np.uint8)
        if job.verify:
            for i, p in enumerate(places):
                fill(
                    side,
                    p,
                    logical_cache(job.spec, job.tokens, job.seed + i),
                    views,
                    decode=False,
                    ranks=[rank],
                )
        with job.bridge(side, rank, pool, bootstrap, decode=False, group=group) as bridge:
            settings = bridge.settings
            senders = {}
            if job.prefill_sends:
                cuts = np.linspace(0, job.tokens, job.chunks + 1).astype(int)[1:]
                for i, room in _mine(job, group, decode=False):
                    senders[room] = bridge.sender(room, places[i])
                if job.kill_decode_when_ready:
                    for s in senders.values():
                        s.status.wait(
                            settings.waiting_timeout,
                            until=(KVPoll.WAITING_FOR_INPUT, KVPoll.FAILED),
                        )
                    out.send(("ready", index))
                time.sleep(job.send_delay)  # the fault scenario: the engine is still computing
                order = np.random.default_rng(job.seed + index)
                for stop in cuts:
                    for s in senders.values():
                        groups = (
                            [None]
                            if not job.layerwise
                            else [
                                range(li, li + 1)
                                for li in order.permutation(
                                    list(side.parallel.layers_of(rank))
                                ).tolist()
                            ]
                        )
                        for layers in groups:
                            if not s.poll().terminal:
                                s.send(int(stop), layers=layers)
            deadline = time.monotonic() + settings.waiting_timeout + settings.transfer_timeout
            for s in senders.values():
                s.wait(max(0.0, deadline - time.monotonic()))
            # Stay up (answering aborts and heart-beating) until the decode side is done.
            out.send(
                RankResult(
                    "prefill",
                    index,
                    {r: s.poll().name for r, s in senders.items()},
                    {r: str(s.failure) for r, s in senders.items() if s.failure},
                    seconds=time.monotonic() - t0,
                )
            )
            end = time.monotonic() + settings.abort_timeout + 2 * settings.dead_after
            while bridge.active_rooms() and time.monotonic() < end:
                time.sleep(0.02)
            out.send(("prefill_active", index, bridge.active_rooms()))
            _linger(stop_file)
    except BaseException as e:  # report, never hang the parent
        out.send(RankResult("prefill", index, {}, {}, error=f"{e!r}\n{traceback.format_exc()}"))
    finally:
        pool.close()


def _linger(stop_file: str) -> None:
    """Keep heart-beating until the parent says stop (it reads every rank first)."""
    end = time.monotonic() + 120
    while time.monotonic() < end and not (stop_file and os.path.exists(stop_file)):
        time.sleep(0.02)


def _decode_main(job: Job, index: int, bootstrap: str, out: Connection, stop_file: str) -> None:
    from kvbridge.memory.pools import HostPool
    from kvbridge.planner.reference import fill, logical_cache

    t0 = time.monotonic()
    job.enter(1)
    side = build_side(job, job.decode, job.decode_spec)
    group, rank = divmod(index, side.parallel.world)
    pool = HostPool(
        side.memory.regions_of(side.parallel.layers_of(rank)), shared=job.transport == "shm"
    )
    try:
        views = {r.name: pool.view(r.name) for r in pool.regions()}
        for v in views.values():
            v[:] = CANARY
        places = placements(job, job.decode, 1)
        with job.bridge(side, rank, pool, bootstrap, decode=True, group=group) as bridge:
            settings = bridge.settings
            mine = _mine(job, group, decode=True)
            # The prefill DP group of each room is the bootstrap service's to say.
            receivers = {room: bridge.receiver(room) for _, room in mine}
            for r, (i, _) in zip(receivers.values(), mine, strict=True):
                try:
                    r.init(places[i])
                except KVBridgeError as e:
                    r.abort(f"init refused: {e}")
            deadline = (
                time.monotonic()
                + settings.bootstrap_timeout
                + settings.waiting_timeout
                + settings.transfer_timeout
            )
            for r in receivers.values():
                r.wait(max(0.0, deadline - time.monotonic()))
            released = all(r.wait_released(settings.abort_timeout + 1) for r in receivers.values())
            elapsed = time.monotonic() - t0
            ok, mismatch = None, ""
            if job.verify:
                want = {
                    rank: {n: np.full(len(v), CANARY, dtype=np.uint8) for n, v in views.items()}
                }
                for (i, _), r in zip(mine, receivers.values(), strict=True):
                    if r.poll().name == "SUCCESS":
                        fill(
                            side,
                            places[i],
                            logical_cache(job.spec, job.tokens, job.seed + i),
                            want,
                            decode=True,
                            ranks=[rank],
                        )
                ok, mismatch = True, ""
                for n, v in views.items():
                    if not np.array_equal(v, want[rank][n]):
                        bad = np.flatnonzero(v != want[rank][n])
                        ok, mismatch = (
                            False,
                            f"region {n}: {len(bad)} bytes differ, first at {bad[0]}",
                        )
                        break
            out.send(
                RankResult(
                    "decode",
                    index,
                    {rm: r.poll().name for rm, r in receivers.items()},
                    {rm: str(r.failure) for rm, r in receivers.items() if r.failure},
                    bytes_ok=ok,
                    mismatch=mismatch,
                    released=released,
                    active_rooms=bridge.active_rooms(),
                    scattered=bridge.staged_segments()[0],
                    seconds=elapsed,
                )
            )
            _linger(stop_file)
    except BaseException as e:
        out.send(RankResult("decode", index, {}, {}, error=f"{e!r}\n{traceback.format_exc()}"))
    finally:
        pool.close()


@contextlib.contextmanager
def bootstrap_service(job: Job, token: str | None) -> Iterator[BootstrapServer]:
    """The job's bootstrap service, on its host if it has one."""
    from kvbridge.bootstrap import BootstrapServer

    server = BootstrapServer(host=job.hosts[0].address if job.hosts else "127.0.0.1", token=token)
    with inside(job.hosts[0].netns) if job.hosts else contextlib.nullcontext():
        server.start()  # its sockets and threads stay on its host
    try:
        yield server
    finally:
        server.stop()


def run(job: Job, timeout: float = 120.0) -> Result:
    """Run ``job``; every rank's result, or an error naming the ranks that did not answer."""
    # Ranks fork from a server that has kvbridge imported already (a spawned rank spent about
    # half a second importing it; a test run starts hundreds); the server holds no threads.
    # What a rank needs comes in its arguments: the server's environment is from its start.
    ctx = shield.fork_context()
    # One pipe per rank, not one shared queue: a rank killed while writing can then break
    # only its own channel (a shared Queue's write lock would stay held for every rank).
    pipes: dict[tuple[str, int], tuple[Connection, Connection]] = {}
    token = job.prefill_settings.get("token") or None
    stop_file = f"/tmp/kvbridge-cluster-{os.getpid()}-{time.monotonic_ns()}"
    procs: dict[tuple[str, int], Any] = {}
    with bootstrap_service(job, token) as server:
        addr = server.address
        dead_addr = "127.0.0.1:1"
        pw = job.prefill.dp * job.prefill.parallel(job.spec.num_layers).world
        dw = job.decode.dp * job.decode.parallel(job.spec.num_layers).world
        for r in range(pw):
            pipes[("prefill", r)] = ctx.Pipe(duplex=False)
            procs[("prefill", r)] = ctx.Process(
                target=_prefill_main, args=(job, r, addr, pipes[("prefill", r)][1], stop_file)
            )
        for r in range(dw):
            pipes[("decode", r)] = ctx.Pipe(duplex=False)
            procs[("decode", r)] = ctx.Process(
                target=_decode_main,
                args=(
                    job,
                    r,
                    dead_addr if job.bootstrap_down else addr,
                    pipes[("decode", r)][1],
                    stop_file,
                ),
            )
        t0 = time.monotonic()
        kills = {("prefill", r): t for r, t in job.kill_prefill.items()}
        kills.update({("decode", r): t for r, t in job.kill_decode.items()})
        killed: set[tuple[str, int]] = set()
        results: dict[tuple[str, int], RankResult] = {}
        ready: set[int] = set()
        drained: set[tuple[str, int]] = set()  # prefill ranks that reported no room held
        end = t0 + timeout
        try:
            for key, p in procs.items():
                shield.start(p)
                pipes[key][1].close()  # the child holds the write end; EOF: it exited
                if kills.get(key) == 0.0:  # killed before it did anything (forked in a moment)
                    p.kill()
                    killed.add(key)
            while time.monotonic() < end:
                for key, at in kills.items():
                    if key not in killed and time.monotonic() - t0 >= at:
                        procs[key].kill()
                        killed.add(key)
                readers = {pipes[k][0]: k for k in procs if k not in killed}
                for conn in cast(list[Connection], wait(list(readers), timeout=0.05)):
                    key = readers[conn]
                    try:
                        item = conn.recv()
                    except (EOFError, OSError):  # it exited: nothing more will come from it
                        killed.add(key)
                        continue
                    if isinstance(item, RankResult):
                        results[key] = item
                    elif item[0] == "ready":
                        ready.add(item[1])
                        if len(ready) == pw:
                            for r in job.kill_decode_when_ready:
                                procs[("decode", r)].kill()
                                killed.add(("decode", r))
                    elif item[0] == "prefill_active":
                        if key in results:
                            results[key] = replace(results[key], active_rooms=item[2])
                        drained.add(key)
                decode_done = all(k in results or k in killed for k in procs if k[0] == "decode")
                for r in job.kill_prefill_when_done:
                    key = ("prefill", r)
                    if decode_done and key in drained and key not in killed:
                        procs[key].kill()  # after the transfer: the decode side is done too
                        killed.add(key)
                want = {
                    k for k in procs if k not in killed and (k[0] == "decode" or k not in results)
                }
                if all(k in results for k in want) and all(
                    k in drained or k in killed or k[0] != "prefill" or not procs[k].is_alive()
                    for k in procs
                ):
                    break
        except BaseException:  # Ctrl-C included: nothing the ranks do is wanted any more
            for p in procs.values():
                if p.pid is not None:
                    p.kill()
            raise
        finally:
            open(stop_file, "w").close()
            for p in procs.values():
                if p.pid is None:  # never started
                    continue
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join(5)
            os.unlink(stop_file)
    missing = [k for k in procs if k not in results and k not in killed]
    if missing:
        raise TimeoutError(f"ranks {missing} did not report within {timeout} s")
    return Result(sorted(results.values(), key=lambda r: (r.role, r.rank)))
