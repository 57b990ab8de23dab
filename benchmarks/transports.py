"""Throughput of each transport between two processes, next to memcpy and a raw socket.

    python benchmarks/transports.py [--gib 1] [--repeat 5] [--streams 1,2,4] [--workers 1,2]

Patterns (the sender's and the receiver's pools are each ``--gib`` GiB):

* contiguous: the whole pool, one flat run;
* sliced, strided: 512-byte pieces at a 2 KiB stride (one KV head of four in an NHD pool), one
  strided run: a quarter of the pool moves;
* sliced, flat: the same pieces as separate flat runs (what a planner that does not fold
  strides would emit).

References, measured in the same repetitions as the transport (cases are interleaved, so a
busy machine slows all of them alike): memcpy is ``np.copyto`` of the same bytes within this
process; "raw socket" sends the pool over one loopback connection with ``sendall`` into
``recv_into`` in the receiver process. GB/s are payload bytes per second, best (median) of
``--repeat``; "x ref" divides by memcpy of the same pattern (shm) or by the raw socket (tcp).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from collections.abc import Callable
from multiprocessing import get_context
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvbridge.memory.copy import strided
from kvbridge.memory.pools import HostPool
from kvbridge.planner.layout import Region
from kvbridge.planner.runs import Runs
from kvbridge.transports import Transport, create

PIECE, STRIDE = 512, 2048
PATTERNS = ("contiguous", "sliced, strided", "sliced, flat")


def runs_for(pattern: str, size: int) -> Runs:
    def z(a: Any) -> np.ndarray:
        return np.asarray(a, dtype=np.int64)

    if pattern == "contiguous":
        return Runs(z([0]), z([0]), z([0]), z([0]), z([size]), z([1]), z([0]), z([0]))
    count = size // STRIDE
    if pattern == "sliced, strided":
        return Runs(
            z([0]), z([0]), z([0]), z([0]), z([PIECE]), z([count]), z([STRIDE]), z([STRIDE])
        )
    off = np.arange(count, dtype=np.int64) * STRIDE
    zero, one = np.zeros(count, np.int64), np.ones(count, np.int64)
    return Runs(zero, off, zero.copy(), off.copy(), one * PIECE, one, zero.copy(), zero.copy())


def receiver(conn: Connection, transport: str, size: int, options: dict[str, Any]) -> None:
    t = create(transport, "rx", **options)
    pool = HostPool([Region("dst", size)], shared=transport == "shm")
    conn.send(t.register(pool.regions()))
    while True:
        cmd = conn.recv()
        if cmd == "raw":  # a plain socket into the same pool memory, for comparison
            with socket.create_server(("127.0.0.1", 0)) as srv:
                conn.send(srv.getsockname()[1])
                c, _ = srv.accept()
                with c:
                    view, pos = pool.view("dst").data, 0
                    while pos < size:
                        pos += c.recv_into(view[pos:], size - pos)
                    c.sendall(b"k")
        elif cmd == "check":
            conn.send(int(pool.view("dst")[::4096].astype(np.int64).sum()))
        else:
            break
    t.close()
    pool.close()


def _timed(fn: Callable[[], object]) -> Callable[[], float]:
    def once() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return once


def _post(t: Transport, runs: Runs, label: str) -> Callable[[], None]:
    def run() -> None:
        h = t.post("rx", ["src"], ["dst"], runs)
        state = t.wait(h, 120.0)
        if state.name != "DONE":
            raise RuntimeError(f"{label}: {state.name} {h.error}")
        t.release(h)

    return run


def _raw(here: Connection, src: np.ndarray) -> Callable[[], None]:
    def run() -> None:
        here.send("raw")
        with socket.create_connection(("127.0.0.1", here.recv())) as s:
            s.sendall(src.data)
            s.recv(1)

    return run


def _copy(src: np.ndarray, dst: np.ndarray, sliced: bool) -> Callable[[], None]:
    if sliced:
        count = len(src) // STRIDE
        src, dst = strided(src, 0, PIECE, count, STRIDE), strided(dst, 0, PIECE, count, STRIDE)
    return lambda: np.copyto(dst, src)


def bench(
    transport: str, options: dict[str, Any], src_pool: HostPool, scratch: np.ndarray, repeat: int
) -> list[tuple[str, float, float, float]]:
    """``(case, best GB/s, median GB/s, best / reference)`` for one transport configuration."""
    size = scratch.nbytes
    src = src_pool.view("src")
    ctx = get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(there, transport, size, options), daemon=True)
    proc.start()
    t = create(
        transport, "tx", **({"allow_private": True} if transport == "shm" else {}), **options
    )
    sliced_bytes = size // STRIDE * PIECE
    cases: dict[str, tuple[Callable[[], float], int]] = {
        "memcpy contiguous": (_timed(_copy(src, scratch, False)), size),
        "memcpy sliced": (_timed(_copy(src, scratch, True)), sliced_bytes),
    }
    try:
        t.register(src_pool.regions())
        t.add_peer("rx", here.recv())
        for p in PATTERNS:
            runs = runs_for(p, size)
            cases[p] = (_timed(_post(t, runs, f"{transport} {p}")), runs.total_bytes)
        if transport == "tcp":
            cases["raw socket"] = (_timed(_raw(here, src)), size)
        times: dict[str, list[float]] = {c: [] for c in cases}
        for rep in range(repeat + 1):  # the first round warms up (connections, page tables)
            for case, (once, _) in cases.items():
                dt = once()
                if rep:
                    times[case].append(dt)
        here.send("check")
        if here.recv() != int(src[::4096].astype(np.int64).sum()):
            raise RuntimeError(f"{transport}: the receiver's bytes differ from the source")
    finally:
        t.close()
        here.send("stop")
        proc.join(30)
    rate = {
        c: (cases[c][1] / min(ts) / 1e9, cases[c][1] / statistics.median(ts) / 1e9)
        for c, ts in times.items()
    }
    out = []
    for c, (lo, med) in rate.items():
        if c.startswith(("memcpy", "raw")):
            ref = lo
        elif transport == "tcp":
            ref = rate["raw socket"][0]
        else:
            ref = rate["memcpy contiguous" if c == "contiguous" else "memcpy sliced"][0]
        out.append((c, lo, med, lo / ref))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--streams", default="1,2,4", help="tcp stream counts to measure")
    ap.add_argument("--workers", default="1,2", help="shm worker counts to measure")
    args = ap.parse_args()
    size = int(args.gib * (1 << 30)) // STRIDE * STRIDE
    src_pool = HostPool([Region("src", size)], shared=False)
    src_pool.view("src")[:] = np.arange(size, dtype=np.uint64).astype(np.uint8)
    scratch_pool = HostPool([Region("scratch", size)], shared=False)
    configs = [("shm", {"workers": int(w)}) for w in args.workers.split(",")] + [
        ("tcp", {"streams": int(s)}) for s in args.streams.split(",")
    ]
    print(
        f"{size / (1 << 30):.2f} GiB pools; sliced = {PIECE} B at {STRIDE} B stride "
        f"({size // STRIDE * PIECE / (1 << 20):.0f} MiB moved); best (median) of "
        f"{args.repeat}, cases interleaved\n"
    )
    print(f"{'config':16} {'case':20} {'GB/s best (median)':>20} {'x ref':>7}")
    for transport, options in configs:
        label = f"{transport} " + " ".join(f"{k}={v}" for k, v in options.items())
        for case, lo, med, ratio in bench(
            transport, options, src_pool, scratch_pool.view("scratch"), args.repeat
        ):
            print(f"{label:16} {case:20} {lo:12.2f} ({med:5.2f}) {ratio:7.2f}", flush=True)
    src_pool.close()
    scratch_pool.close()


if __name__ == "__main__":
    main()
