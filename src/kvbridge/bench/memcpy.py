"""The memcpy baselines of the transfer benches: ``np.copyto`` of a request's bytes, flat or as
the pieces a sliced case writes, between two pre-faulted host buffers, by one thread and by two
(the host's limit where one thread cannot fill its memory bandwidth; shm copies with two).

Flat, the bytes are copied in one call a thread, or in ``piece``-byte calls: a request's KV is
one tensor a layer and K or V, which no transport can copy in one call, and glibc's memcpy
streams past the cache with non-temporal stores only above a threshold (3/4 of the last-level
cache: 240 MiB on the machines these figures come from) that a 1 GiB call crosses and a layer's
tensor does not: the same bytes copy at ~20 GB/s in one call and ~14 in 8 MiB calls there."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvbridge.planner.layout import Region

GB = 1e9  # every GB/s of the benches: 1e9 bytes a second
SLICE, SLICE_STRIDE = 512, 2048  # P4 -> D1 NHD: 2 of 8 KV heads x 128 x bf16 in a 2 KiB token
THREADS = 2  # the second baseline's threads: as many as shm's copy workers by default


class Memcpy:
    """The memcpy baselines over ``nbytes``: ``np.copyto`` between two pre-faulted buffers (in
    ``piece``-byte calls, or one), and the same bytes as 512-byte pieces written at a 2 KiB
    stride (4 sources interleaved into one destination, as P4 -> D1 NHD writes them); each by
    one thread (``flat``, ``sliced``) and by :data:`THREADS` threads copying a share each
    (``flat2``, ``sliced2``; ``np.copyto`` lets go of the interpreter). :meth:`measure` may
    be called between cases; each figure keeps the best GB/s seen (the host is shared: noise
    only slows)."""

    def __init__(self, nbytes: int, piece: int | None = None) -> None:
        from kvbridge.memory.pools import HostPool

        if piece is not None and piece < 1:
            raise ValueError(f"piece must be >= 1 byte, got {piece}")
        unit = SLICE_STRIDE * THREADS  # each thread's share a whole number of tokens
        self.nbytes = nbytes // unit * unit
        self.piece = piece  # flat copies in calls of this many bytes (None: one a thread)
        self._pool = HostPool(
            [Region("src", self.nbytes), Region("dst", self.nbytes)], shared=False
        )
        self._pool.view("src").fill(0x5A)
        self.flat = self.sliced = self.flat2 = self.sliced2 = 0.0

    def limit(self, sliced: bool) -> float:
        """The host's memcpy limit for a case: the better of one thread and two."""
        return max(self.sliced, self.sliced2) if sliced else max(self.flat, self.flat2)

    def measure(self, repeat: int) -> None:
        with ThreadPoolExecutor(THREADS, thread_name_prefix="kvbridge-memcpy") as pool:

            def rate(sliced: bool, threads: int) -> float:
                return self.nbytes / _best(lambda: self.copy(sliced, threads, pool), repeat) / GB

            self.flat = max(self.flat, rate(False, 1))
            self.sliced = max(self.sliced, rate(True, 1))
            self.flat2 = max(self.flat2, rate(False, THREADS))
            self.sliced2 = max(self.sliced2, rate(True, THREADS))

    def copy(self, sliced: bool, threads: int, pool: ThreadPoolExecutor) -> None:
        """One copy of the whole buffer, flat or sliced, each of ``threads`` threads of
        ``pool`` copying its share of the tokens."""
        src, dst = self._pool.view("src"), self._pool.view("dst")
        ways = SLICE_STRIDE // SLICE
        src3, dst3 = src.reshape(ways, -1, SLICE), dst.reshape(-1, ways, SLICE)
        tokens = dst3.shape[0]

        def share(k: int) -> None:
            if sliced:
                mine = slice(k * tokens // threads, (k + 1) * tokens // threads)
                for r in range(ways):
                    np.copyto(dst3[mine, r], src3[r, mine])
            else:
                lo, hi = k * self.nbytes // threads, (k + 1) * self.nbytes // threads
                step = self.piece or max(hi - lo, 1)
                for at in range(lo, hi, step):
                    np.copyto(dst[at : at + step], src[at : at + step])

        list(pool.map(share, range(threads)))

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
