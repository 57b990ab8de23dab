"""Device memory checked and measured: what ``kvbridge bench --device cuda`` and
``tests/test_gpu.py`` run on a GPU.

* :func:`byte_grid`: for each transport that moves device memory and loads here, and each case
  of :data:`CASES` (TP pairs, NHD/HND, a hybrid spec with MLA, Mamba2 and sliding-window
  layers, chunked), the planner's runs move every prefill rank's pools (on the GPU, in this
  process) into every decode rank's pools (on the GPU, in a spawned process) through the
  transport; the receiver copies its pools back to the host and compares them byte for byte
  with :mod:`kvbridge.planner.reference`'s re-shard (canary bytes outside the request must survive).
* :func:`limits_and_transports`: the device's own limits measured in the same run
  (device-to-device copy, pinned device-to-host, pinned host-to-device) beside each transport
  between device pools, contiguous and fragmented (tcp between host pools too: what its
  pinned bounce buffers cost it).

Both sides are one transport agent each (region names prefixed with the rank), so one process
pair serves every rank; real deployments have one agent per rank (same code path).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvbridge.memory.device import DevicePool, cuda_unavailable, require_cuda
from kvbridge.memory.location import HOST, Location
from kvbridge.memory.pools import HostPool
from kvbridge.model.spec import CacheSpec, DType, attention_layer, mamba2_layer, mla_layer
from kvbridge.planner.layout import ConvLayout, KVLayout, Region, build_memory
from kvbridge.planner.parallel import ParallelLayout
from kvbridge.planner.placement import Placement
from kvbridge.planner.plan import Pairing, Side
from kvbridge.planner.reference import Pools, allocate, fill, logical_cache
from kvbridge.planner.runs import Runs
from kvbridge.transports import create, unavailable
from kvbridge.transports.base import TransportOptions, XferState

DEVICE_TRANSPORTS = ("cudaipc", "tcp", "nixl", "mooncake")  # those that move device memory
HOST_TOO = ("tcp",)  # benched between host pools too: what its pinned bounce buffers cost
CANARY = 0xA5
_CTX = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
_TIMEOUT = 120.0


@dataclass(frozen=True)
class GridCase:
    name: str
    tp_p: int
    tp_d: int
    kv_p: KVLayout = KVLayout.NHD
    kv_d: KVLayout = KVLayout.NHD
    hybrid: bool = False


CASES = (
    GridCase("tp1-tp1", 1, 1),
    GridCase("tp2-tp1 nhd-hnd", 2, 1, KVLayout.NHD, KVLayout.HND),
    GridCase("tp1-tp4", 1, 4),
    GridCase("tp4-tp2 hnd-nhd", 4, 2, KVLayout.HND, KVLayout.NHD),
    GridCase("hybrid tp2-tp1", 2, 1, hybrid=True),
)
_TOKENS = 37
_CHUNKS = ((0, 1), (1, 20), (20, _TOKENS))


def _case(c: GridCase) -> tuple[Side, Side, Placement, Placement]:
    layers = [attention_layer(8, 16, DType.BFLOAT16), attention_layer(4, 32, DType.FLOAT16)]
    if c.hybrid:
        layers = [
            mla_layer(16, 4, DType.BFLOAT16, indexer_dim=6),
            mamba2_layer(8, 4, 2, 4, 4, conv_dtype=DType.BFLOAT16, ssm_dtype=DType.FLOAT32),
            attention_layer(2, 8, DType.BFLOAT16, window=9),
        ]
    spec = CacheSpec("device-grid", tuple(layers))

    def side(tp: int, kv: KVLayout, page: int, pages: int) -> Side:
        par = ParallelLayout.even(spec.num_layers, tp, 1)
        mem = build_memory(
            spec, par, page_size=page, num_pages=pages, kv_layout=kv, conv_layout=ConvLayout.SD
        )
        return Side(spec, par, mem)

    rng = np.random.default_rng(7)
    src = Placement.simple(_TOKENS, rng.permutation(40)[: -(-_TOKENS // 4)], state_slot=3)
    dst = Placement.simple(
        _TOKENS, rng.permutation(80)[: -(-_TOKENS // 2)], state_slot=1, aux_slot=2
    )
    return side(c.tp_p, c.kv_p, 4, 40), side(c.tp_d, c.kv_d, 2, 80), src, dst


def _filled_pools(pools: Pools, prefix: str, location: Location) -> list[Any]:
    """``pools``' bytes in DevicePools on ``location`` (in HostPools where it is the host:
    the bench's baseline for a transport that moves both)."""
    torch = require_cuda()
    out = []
    for rank, regions in pools.items():
        named = [Region(f"{prefix}{rank}.{n}", a.nbytes) for n, a in regions.items()]
        pool = _pool(named, location)
        for n, a in regions.items():
            view = pool.view(f"{prefix}{rank}.{n}")
            view[:] = torch.from_numpy(a) if location.is_device else a
        out.append(pool)
    torch.cuda.synchronize()
    return out


def _pool(regions: list[Region], location: Location) -> Any:
    return DevicePool(regions, location) if location.is_device else HostPool(regions, False)


def _receiver(conn: Connection, transport: str, location: Location) -> None:
    """The decode side (a spawned process): commands over ``conn`` until ``close``."""
    t: Any = None
    pools: list[Any] = []
    try:
        while True:
            cmd, args = conn.recv()
            if cmd == "close":
                return
            try:
                if cmd == "open":  # (case index or None, region sizes for the bench)
                    case, sizes = args
                    for p in pools:
                        p.close()
                    if t is not None:
                        t.close()
                    t = _agent(transport, "decode", location)
                    if case is not None:
                        _, decode, _, _ = _case(CASES[case])
                        host = allocate(decode, fill_byte=CANARY)
                    else:
                        host = {0: {n: np.zeros(s, np.uint8) for n, s in sizes}}
                    pools = _filled_pools(host, "d", location)
                    regions = [r for p in pools for r in p.regions()]
                    conn.send(("ok", t.register(regions)))
                elif cmd == "peer":
                    t.add_peer("prefill", args)
                    conn.send(("ok", None))
                elif cmd == "check":
                    conn.send(("ok", _compare(CASES[args], pools)))
            except Exception as e:
                conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        if t is not None:
            t.close()


def _compare(case: GridCase, pools: list[DevicePool]) -> list[str]:
    """What differs between the decode pools and the reference re-shard (empty: exact)."""
    prefill, decode, src, dst = _case(case)
    cache = logical_cache(prefill.spec, _TOKENS, 11)
    want = allocate(decode, fill_byte=CANARY)
    fill(decode, dst, cache, want, decode=True)
    got = {r.name: p.view(r.name).cpu().numpy() for p in pools for r in p.regions()}
    bad = []
    for rank, regions in want.items():
        for name, arr in regions.items():
            g = got[f"d{rank}.{name}"]
            if not np.array_equal(g, arr):
                diff = np.flatnonzero(g != arr)
                bad.append(f"decode rank {rank} {name}: {len(diff)} bytes differ (first {diff[0]})")
    return bad


class _Peer:
    """The receiver process and its pipe."""

    def __init__(self, transport: str, location: Location) -> None:
        self.conn, child = _CTX.Pipe()
        self.proc = _CTX.Process(target=_receiver, args=(child, transport, location), daemon=True)
        self.proc.start()

    def call(self, cmd: str, args: Any = None) -> Any:
        self.conn.send((cmd, args))
        if not self.conn.poll(_TIMEOUT):
            raise TimeoutError(f"the receiver did not answer {cmd!r} in {_TIMEOUT:.0f} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"receiver: {value}")
        return value

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(("close", None))
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def _agent(transport: str, agent: str, location: Location) -> Any:
    # Through the runtime's options, as a Bridge makes it: each transport takes what applies.
    return create(transport, agent, TransportOptions(device=location))


def _wait(t: Any, handle: Any) -> None:
    state = t.wait(handle, _TIMEOUT)
    if state is XferState.PENDING:
        raise RuntimeError(f"transfer still pending after {_TIMEOUT:.0f} s")
    t.release(handle)
    if state is not XferState.DONE:
        raise RuntimeError(f"transfer {state.name}: {handle.error}")


@dataclass(frozen=True)
class GridRow:
    transport: str
    case: str
    ok: bool
    detail: str


def byte_grid(transports: Sequence[str], location: Location) -> list[GridRow]:
    """Every case over every transport that loads here (one row each; skipped ones say why)."""
    require_cuda(location)
    rows = []
    for name in transports:
        why = unavailable(name)
        if why is not None:
            rows.append(GridRow(name, "-", True, f"SKIP: {why}"))
            continue
        peer = _Peer(name, location)
        try:
            for i, case in enumerate(CASES):
                rows.append(_grid_case(name, i, case, peer, location))
        finally:
            peer.close()
    return rows


def _grid_case(name: str, i: int, case: GridCase, peer: _Peer, location: Location) -> GridRow:
    prefill, decode, src, dst = _case(case)
    cache = logical_cache(prefill.spec, _TOKENS, 11)
    host = allocate(prefill, seed=12)  # garbage outside the request
    fill(prefill, src, cache, host, decode=False)
    pools = _filled_pools(host, "p", location)
    t = _agent(name, "prefill", location)
    try:
        t.register([r for p in pools for r in p.regions()])
        t.add_peer("decode", peer.call("open", (i, None)))
        peer.call("peer", t.register([]))
        pairing = Pairing(prefill, decode)
        moved = 0
        for a, b in _CHUNKS:
            plan = pairing.plan(src, dst, a, b)
            for pair in plan.pairs:
                s, d, runs = pair.runs.restricted(plan.src_regions, plan.dst_regions)
                if not len(runs):
                    continue
                sn = tuple(f"p{pair.prefill_rank}.{n}" for n in s)
                dn = tuple(f"d{pair.decode_rank}.{n}" for n in d)
                _wait(t, t.post("decode", sn, dn, runs))
                moved += runs.total_bytes
        bad = peer.call("check", i)
        return GridRow(name, case.name, not bad, "; ".join(bad[:3]) or f"{moved} bytes exact")
    except Exception as e:
        return GridRow(name, case.name, False, f"{type(e).__name__}: {e}")
    finally:
        t.close()
        for p in pools:
            p.close()


def _runs(n: int, piece: int, shuffle: bool) -> Runs:
    """``n // piece`` runs of ``piece`` bytes, region 0 to region 0, destinations shuffled."""
    k = n // piece
    src = np.arange(k, dtype=np.int64) * piece
    dst = np.random.default_rng(3).permutation(src) if shuffle else src.copy()
    zeros, ones = np.zeros(k, np.int64), np.ones(k, np.int64)
    return Runs(
        zeros, src, zeros.copy(), dst, np.full(k, piece, np.int64), ones, zeros.copy(), zeros.copy()
    )


def _timed(fn: Any, torch: Any, repeat: int) -> float:
    fn()  # warm-up
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def _limits(torch: Any, dev: str, nbytes: int, repeat: int) -> dict[str, float]:
    """Seconds the device takes to copy ``nbytes`` on itself and to and from pinned memory."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return {
        "device-to-device copy": _timed(lambda: b.copy_(a), torch, repeat),
        "pinned device-to-host": _timed(lambda: host.copy_(a, non_blocking=True), torch, repeat),
        "pinned host-to-device": _timed(lambda: a.copy_(host, non_blocking=True), torch, repeat),
    }


def limits_and_transports(
    transports: Sequence[str], location: Location, nbytes: int = 256 << 20, repeat: int = 3
) -> list[dict[str, Any]]:
    """Rows (what, GB/s of bytes moved, ratio to the device's own copy), measured now."""
    torch = require_cuda(location)
    torch.cuda.set_device(location.device)
    limits = _limits(torch, str(location), nbytes, repeat)
    d2d = nbytes / limits["device-to-device copy"]
    rows: list[dict[str, Any]] = [
        {"what": k, "gbps": nbytes / v / 1e9, "vs_d2d": nbytes / v / d2d} for k, v in limits.items()
    ]
    for name in transports:
        why = unavailable(name)
        if why is not None:
            rows.append({"what": name, "gbps": None, "vs_d2d": None, "skip": why})
            continue
        rows += _between_pools(name, location, nbytes, repeat, d2d)
        if name in HOST_TOO:  # the same transport between host pools, in the same run
            rows += _between_pools(name, HOST, nbytes, repeat, d2d)
    return rows


def _between_pools(
    name: str, location: Location, nbytes: int, repeat: int, d2d: float
) -> list[dict[str, Any]]:
    """``name`` between two processes' pools on ``location``: contiguous and fragmented."""
    torch = require_cuda()
    where = "" if location.is_device else " (host memory)"
    rows: list[dict[str, Any]] = []
    peer = _Peer(name, location)
    src = _pool([Region("p0.buf", nbytes)], location)
    t = _agent(name, "prefill", location)
    try:
        t.register(src.regions())
        t.add_peer("decode", peer.call("open", (None, [("buf", nbytes)])))
        peer.call("peer", t.register([]))
        for label, runs in (
            ("contiguous", _runs(nbytes, nbytes, False)),
            ("fragmented 64 KiB", _runs(nbytes, 64 << 10, True)),
        ):
            secs = _timed(
                lambda r=runs, t=t: _wait(t, t.post("decode", ("p0.buf",), ("d0.buf",), r)),
                torch,
                repeat,
            )
            gbps = nbytes / secs / 1e9
            what = f"{name} {label}{where}"
            rows.append({"what": what, "gbps": gbps, "vs_d2d": gbps * 1e9 / d2d})
    except Exception as e:
        rows.append(
            {"what": name + where, "gbps": None, "vs_d2d": None, "skip": f"{type(e).__name__}: {e}"}
        )
    finally:
        t.close()
        src.close()
        peer.close()
    return rows


def check_device_option(device: str) -> Location | None:
    """``--device``: None for cpu; the CUDA location, or DeviceError saying why not here."""
    from kvbridge.errors import DeviceError

    where = Location.parse(device)
    if not where.is_device:
        return None
    why = cuda_unavailable()
    if why is not None:
        raise DeviceError(f"{device} asked for, but {why}")
    require_cuda(where)
    return where


def print_bench(rows: Sequence[dict[str, Any]]) -> None:
    for r in rows:
        if r.get("gbps") is None:
            print(f"{r['what']:34} SKIP {r.get('skip', '')}")
        else:
            print(f"{r['what']:34} {r['gbps']:9.2f} GB/s  {r['vs_d2d']:7.3f} x d2d copy")
