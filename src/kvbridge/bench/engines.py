"""Raw-engine baselines: the same bytes moved by NIXL, Mooncake or plain TCP alone, without
kvbridge.

A :class:`Workload` is what one transfer moves: the sizes of the source and destination
regions and the runs between them (from a kvbridge plan with :meth:`Workload.from_plan`, or
made up: :meth:`Workload.contiguous`, :meth:`Workload.sliced`). Each measurement spawns two
processes, a receiver that allocates pre-faulted destination pools and a sender that
allocates source pools filled with random bytes, and times ``warmup + repeat`` transfers:

* :func:`raw_nixl_write`: the flat descriptors as (address, length, device) arrays, then per
  round ``initialize_xfer`` + ``transfer`` + ``check_xfer_state`` until DONE + release, on
  agents configured as :mod:`kvbridge.transports.nixl` configures them (no progress thread;
  the receiver lets peers progress every millisecond).
* :func:`raw_mooncake_write`: per round ``batch_transfer_sync_write`` of the same descriptors
  (cut at the engine's queue limit, batches run one after another).
* :func:`raw_tcp_write`: the same bytes over plain sockets, as many as the tcp transport
  opens (:mod:`kvbridge.bench.rawtcp`).
* :func:`transport_write`: the same workload through a kvbridge transport (post + wait), so
  that the adapter's own cost shows next to the raw engine's; the whole stack (planning, the
  completion protocol) is what ``kvbridge bench transfer`` measures.

Each returns an :class:`EngineResult` (best and median GB/s over the repeats, 1 GB = 1e9
bytes). ``python -m kvbridge.bench.engines`` prints them for a 1 GiB contiguous and a sliced
workload.
"""

from __future__ import annotations

import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.bench import rawtcp
from kvbridge.deploy import shield
from kvbridge.errors import KVBridgeError
from kvbridge.planner.layout import Region
from kvbridge.planner.runs import FIELDS, Runs

GB = 1e9
WAIT = 300.0  # seconds a measurement may take before it is abandoned


@dataclass(frozen=True, eq=False)
class Workload:
    """Write ``runs`` from regions of ``src_sizes`` bytes into regions of ``dst_sizes``."""

    name: str
    src_sizes: tuple[int, ...]
    dst_sizes: tuple[int, ...]
    runs: Runs

    @property
    def nbytes(self) -> int:
        return self.runs.total_bytes

    @property
    def descriptors(self) -> int:
        return self.runs.descriptors

    @classmethod
    def contiguous(cls, nbytes: int) -> Workload:
        one = np.ones(1, dtype=np.int64)
        z = np.zeros(1, dtype=np.int64)
        return cls(
            f"{nbytes / 2**30:g} GiB contiguous",
            (nbytes,),
            (nbytes,),
            Runs(z, z, z, z, one * nbytes, one, z, z),
        )

    @classmethod
    def sliced(cls, nbytes: int, piece: int, ways: int = 4) -> Workload:
        """``ways`` sources interleaved into one destination ``piece`` bytes at a time (what
        P4 -> D1 writes: each prefill rank's heads of a token, or of a page)."""
        blocks = nbytes // (ways * piece)
        if blocks < 1:
            raise KVBridgeError(f"sliced workload: {nbytes} bytes hold no {ways} x {piece}")
        k = np.arange(ways, dtype=np.int64)
        one = np.ones(ways, dtype=np.int64)
        runs = Runs(
            k, 0 * k, 0 * k, k * piece, one * piece, one * blocks, one * piece, one * piece * ways
        )
        return cls(
            f"{blocks * ways * piece / 2**30:g} GiB sliced {piece} B x {ways}",
            (blocks * piece,) * ways,
            (blocks * piece * ways,),
            runs,
        )

    @classmethod
    def from_plan(
        cls, name: str, plan: Any, prefill: Any, decode: Any, decode_rank: int = 0
    ) -> Workload:
        """Every pair's runs into ``decode_rank`` of a kvbridge TransferPlan, from one source
        pool (the prefill ranks' regions have the same names; here one process holds them).
        ``prefill``/``decode`` are the plan's :class:`~kvbridge.planner.plan.Side` s."""

        def sizes(side: Any, names: Sequence[str]) -> tuple[int, ...]:
            by_name = {
                r.name: r.nbytes for r in side.memory.regions_of(range(side.spec.num_layers))
            }
            return tuple(by_name[n] for n in names)

        pairs = [p.runs for p in plan.pairs if p.decode_rank == decode_rank]
        return cls(
            name,
            sizes(prefill, plan.src_regions),
            sizes(decode, plan.dst_regions),
            Runs.concat(pairs),
        )


@dataclass(frozen=True)
class EngineResult:
    engine: str
    workload: str
    nbytes: int
    descriptors: int
    seconds: tuple[float, ...]  # one per measured round

    @property
    def gbps(self) -> float:
        return self.nbytes / min(self.seconds) / GB

    @property
    def gbps_median(self) -> float:
        return self.nbytes / statistics.median(self.seconds) / GB


# ---- the two processes -----------------------------------------------------------------------


def _pool(sizes: Sequence[int], prefix: str, fill: bool) -> Any:
    from kvbridge.memory.pools import HostPool

    pool = HostPool([Region(f"{prefix}{i}", s) for i, s in enumerate(sizes)], shared=False)
    if fill:
        rng = np.random.default_rng(0)
        for r in pool.regions():
            pool.view(r.name)[:] = np.frombuffer(rng.bytes(r.nbytes), dtype=np.uint8)
    return pool


def _receiver(conn: Any, engine: str, sizes: Sequence[int]) -> None:
    try:
        pool = _pool(sizes, "d", fill=False)
        serve_peers = _ENGINES[engine][0](conn, pool)
        while not conn.poll(0.001):
            serve_peers()  # NIXL without its progress thread: peers' connections need this
        conn.recv()
        conn.send(("ok", None))
    except BaseException as e:
        conn.send(("error", f"{e!r}\n{traceback.format_exc()}"))


def _sender(
    conn: Any, engine: str, sizes: Sequence[int], runs: dict[str, np.ndarray], rounds: int
) -> None:
    try:
        pool = _pool(sizes, "s", fill=True)
        peer = conn.recv()
        once = _ENGINES[engine][1](pool, Runs(*(runs[f] for f in FIELDS)), peer)
        seconds = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            once()
            seconds.append(time.perf_counter() - t0)
        conn.send(("ok", seconds))
    except BaseException as e:
        conn.send(("error", f"{e!r}\n{traceback.format_exc()}"))


def _measure(engine: str, w: Workload, repeat: int, warmup: int) -> EngineResult:
    ctx = shield.fork_context()
    rx, rx_child = ctx.Pipe()
    tx, tx_child = ctx.Pipe()
    procs = [
        ctx.Process(target=_receiver, args=(rx_child, engine, w.dst_sizes), daemon=True),
        ctx.Process(
            target=_sender,
            daemon=True,
            args=(
                tx_child,
                engine,
                w.src_sizes,
                {f: getattr(w.runs, f) for f in FIELDS},
                warmup + repeat,
            ),
        ),
    ]
    with shield.running(*procs):
        tx.send(_reply(rx, engine))  # the receiver's metadata, for the sender
        seconds = _reply(tx, engine)
        rx.send("stop")
        _reply(rx, engine)
    return EngineResult(engine, w.name, w.nbytes, w.descriptors, tuple(seconds[warmup:]))


def _reply(conn: Any, engine: str) -> Any:
    if not conn.poll(WAIT):
        raise KVBridgeError(f"{engine}: no answer from a bench process in {WAIT} s")
    status, value = conn.recv()
    if status != "ok":
        raise KVBridgeError(f"{engine}: a bench process failed: {value}")
    return value


# ---- per engine: the receiver's setup (-> serve_peers) and the sender's round (-> once) ------


def _descriptors(pool: Any, runs: Runs, peer_addresses: Sequence[int]) -> tuple[np.ndarray, ...]:
    from kvbridge.transports._common import flat_descriptors

    src = np.array([r.address for r in pool.regions()], dtype=np.int64)
    return flat_descriptors(runs, src, np.asarray(peer_addresses, dtype=np.int64))


def _nixl_agent(name: str) -> Any:
    from kvbridge.transports.nixl import configure_ucx, load_api

    api = load_api()
    configure_ucx(None)
    return api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def _nixl_register(agent: Any, pool: Any) -> None:
    regs = [(r.address, r.nbytes, 0) for r in pool.regions()]
    agent.register_memory(np.array(regs, dtype=np.uint64), "DRAM")


def _nixl_receiver(conn: Any, pool: Any) -> Callable[[], Any]:
    agent = _nixl_agent("raw-rx")
    _nixl_register(agent, pool)
    conn.send(("ok", (agent.get_agent_metadata(), [r.address for r in pool.regions()])))
    return agent.get_new_notifs  # type: ignore[no-any-return]


def _nixl_sender(pool: Any, runs: Runs, peer: Any) -> Callable[[], None]:
    agent = _nixl_agent("raw-tx")
    _nixl_register(agent, pool)
    remote_name = agent.add_remote_agent(peer[0])
    laddr, raddr, nbytes = _descriptors(pool, runs, peer[1])
    zero = np.zeros(len(laddr), dtype=np.uint64)
    local = np.stack([laddr.astype(np.uint64), nbytes.astype(np.uint64), zero], axis=1)
    remote = np.stack([raddr.astype(np.uint64), nbytes.astype(np.uint64), zero], axis=1)

    def once() -> None:
        req = agent.initialize_xfer(
            "WRITE",
            agent.get_xfer_descs(local, "DRAM"),
            agent.get_xfer_descs(remote, "DRAM"),
            remote_name,
        )
        state = agent.transfer(req)
        while state == "PROC":
            state = agent.check_xfer_state(req)
        agent.release_xfer_handle(req)
        if state != "DONE":
            raise KVBridgeError(f"nixl transfer ended {state}")

    return once


def _mooncake_engine() -> Any:
    from kvbridge.transports.mooncake import load_api

    engine = load_api()()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise KVBridgeError("mooncake: the engine did not start")
    return engine


def _mooncake_receiver(conn: Any, pool: Any) -> Callable[[], Any]:
    engine = _mooncake_engine()
    for r in pool.regions():
        engine.register_memory(r.address, r.nbytes)
    conn.send(("ok", (f"127.0.0.1:{engine.get_rpc_port()}", [r.address for r in pool.regions()])))
    return lambda: engine  # the engine serves peers on its own threads


def _mooncake_sender(pool: Any, runs: Runs, peer: Any) -> Callable[[], None]:
    from kvbridge.transports.mooncake import queue_limit

    engine = _mooncake_engine()
    for r in pool.regions():
        engine.register_memory(r.address, r.nbytes)
    laddr, raddr, nbytes = _descriptors(pool, runs, peer[1])
    step = queue_limit()
    batches = [
        (laddr[k : k + step].tolist(), raddr[k : k + step].tolist(), nbytes[k : k + step].tolist())
        for k in range(0, len(laddr), step)
    ]

    def once() -> None:
        for src, dst, lengths in batches:
            rc = engine.batch_transfer_sync_write(peer[0], src, dst, lengths)
            if rc != 0:
                raise KVBridgeError(f"mooncake batch_transfer_sync_write returned {rc}")

    return once


def _transport_receiver(name: str) -> Callable[[Any, Any], Callable[[], Any]]:
    def setup(conn: Any, pool: Any) -> Callable[[], Any]:
        from kvbridge.transports import create

        t = create(name, "kvb-rx")
        conn.send(("ok", (t.register(pool.regions()), [r.name for r in pool.regions()])))
        return lambda: t  # the transport serves peers on its own threads

    return setup


def _transport_sender(name: str) -> Callable[[Any, Runs, Any], Callable[[], None]]:
    def setup(pool: Any, runs: Runs, peer: Any) -> Callable[[], None]:
        from kvbridge.transports import XferState, create

        t = create(name, "kvb-tx")
        t.register(pool.regions())
        t.add_peer("kvb-rx", peer[0])
        src = [r.name for r in pool.regions()]

        def once() -> None:
            h = t.post("kvb-rx", src, peer[1], runs)
            if t.wait(h, WAIT) is not XferState.DONE:
                raise KVBridgeError(f"kvbridge {name}: {h.state.name}: {h.error}")
            t.release(h)

        return once

    return setup


_ENGINES: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "nixl": (_nixl_receiver, _nixl_sender),
    "mooncake": (_mooncake_receiver, _mooncake_sender),
    "tcp": (rawtcp.receiver, rawtcp.sender),
    **{
        f"kvbridge-{n}": (_transport_receiver(n), _transport_sender(n))
        for n in ("nixl", "mooncake", "tcp")
    },
}


# ---- the API -------------------------------------------------------------------------------


def raw_nixl_write(workload: Workload, *, repeat: int = 5, warmup: int = 1) -> EngineResult:
    """``workload`` moved by NIXL alone (see the module doc)."""
    return _measure("nixl", workload, repeat, warmup)


def raw_mooncake_write(workload: Workload, *, repeat: int = 5, warmup: int = 1) -> EngineResult:
    """``workload`` moved by Mooncake's transfer engine alone (see the module doc)."""
    return _measure("mooncake", workload, repeat, warmup)


def raw_tcp_write(workload: Workload, *, repeat: int = 5, warmup: int = 1) -> EngineResult:
    """``workload``'s bytes over plain TCP connections (see :mod:`kvbridge.bench.rawtcp`)."""
    return _measure("tcp", workload, repeat, warmup)


def transport_write(
    transport: str, workload: Workload, *, repeat: int = 5, warmup: int = 1
) -> EngineResult:
    """``workload`` through kvbridge transport ``transport`` (nixl, mooncake or tcp)."""
    if f"kvbridge-{transport}" not in _ENGINES:
        raise KVBridgeError(f"transport_write: {transport!r} is not one of nixl, mooncake, tcp")
    return _measure(f"kvbridge-{transport}", workload, repeat, warmup)


RAW = {"nixl": raw_nixl_write, "mooncake": raw_mooncake_write, "tcp": raw_tcp_write}


def main(argv: Sequence[str] = ()) -> None:
    """Print raw engine vs kvbridge transport for a 1 GiB contiguous and a sliced workload
    (``engines`` defaults to all three; pass names to choose)."""
    from kvbridge.transports import unavailable

    workloads = [
        Workload.contiguous(1 << 30),
        Workload.sliced(1 << 30, 32 << 10),
        Workload.sliced(64 << 20, 512),
    ]
    for engine in list(argv) or ["nixl", "mooncake", "tcp"]:
        reason = unavailable(engine)
        if reason is not None:
            print(f"{engine}: skipped: {reason}")
            continue
        for w in workloads:
            raw = RAW[engine](w)
            ours = transport_write(engine, w)
            print(
                f"{engine:9} {w.name:32} {w.descriptors:>9} desc  raw {raw.gbps:6.2f} GB/s  "
                f"kvbridge {ours.gbps:6.2f} GB/s  ratio {ours.gbps / raw.gbps:.2f}  "
                f"(medians {raw.gbps_median:.2f} / {ours.gbps_median:.2f})",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1:])
