"""memcpy on this host by the size of each copy: one buffer copied whole, or in pieces of N
MiB, by one thread and by two (each half), private source memory into a mapped POSIX
shared-memory segment as shm's workers write. Shows where glibc's ``memcpy`` switches to
non-temporal stores (``GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=...`` moves it):
run it with and without the tunable to compare.

    python benchmarks/memcpy_pieces.py [--gib 1] [--pieces 1,8,64,512] [--repeat 6]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvbridge.memory.pools import HostPool, map_segment
from kvbridge.planner.layout import Region


def best(nbytes: int, fn: Callable[[], object], repeat: int) -> float:
    fn()
    fastest = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        fastest = min(fastest, time.perf_counter() - t0)
    return nbytes / fastest / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="bytes copied, GiB")
    ap.add_argument("--pieces", default="1,8,64,512", help="piece sizes, MiB, comma-separated")
    ap.add_argument("--repeat", type=int, default=6, help="timed copies (best is reported)")
    args = ap.parse_args()
    n = int(args.gib * (1 << 30)) // (2 << 20) * (2 << 20)
    with (
        HostPool([Region("src", n)], shared=False) as src_pool,
        HostPool([Region("dst", n)], shared=True) as dst_pool,
        ThreadPoolExecutor(2) as pool,
    ):
        src = src_pool.view("src")
        src.fill(0x5A)
        mm = map_segment(str(dst_pool.regions()[0].segment))
        try:
            table(src, np.frombuffer(mm, np.uint8, count=n), pool, args)
        finally:
            mm.close()


def table(
    src: np.ndarray, dst: np.ndarray, pool: ThreadPoolExecutor, args: argparse.Namespace
) -> None:
    """Print GB/s by piece size, one thread and two, ``src`` into ``dst``."""
    n = len(dst)

    def copier(piece: int, threads: int) -> Callable[[], object]:
        def part(k: int) -> None:
            end = (k + 1) * n // threads
            for o in range(k * n // threads, end, piece):
                np.copyto(dst[o : min(o + piece, end)], src[o : min(o + piece, end)])

        return lambda: list(pool.map(part, range(threads)))

    tunables = os.environ.get("GLIBC_TUNABLES", "(default)")
    print(f"GLIBC_TUNABLES={tunables}; {n / 2**30:.2f} GiB, best of {args.repeat}, GB/s")
    print(f"{'piece':>10} {'1 thread':>9} {'2 threads':>10}")
    for mib in [int(p) for p in args.pieces.split(",")] + [n >> 20]:
        piece = min(mib << 20, n)
        one, two = (best(n, copier(piece, t), args.repeat) for t in (1, 2))
        label = "whole" if piece == n else f"{mib} MiB"
        print(f"{label:>10} {one:9.1f} {two:10.1f}")


if __name__ == "__main__":
    main()
