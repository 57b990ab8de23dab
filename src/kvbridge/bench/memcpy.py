"""The memcpy baseline of the transfer benches: one thread's ``np.copyto`` of a request's bytes,
flat or as the pieces a sliced case writes, between two pre-faulted host buffers."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from kvbridge.planner.layout import Region

GB = 1e9  # every GB/s of the benches: 1e9 bytes a second
SLICE, SLICE_STRIDE = 512, 2048  # P4 -> D1 NHD: 2 of 8 KV heads x 128 x bf16 in a 2 KiB token


class Memcpy:
    """The memcpy baseline over ``nbytes``: one ``np.copyto`` between two pre-faulted buffers,
    and the same bytes as 512-byte pieces written at a 2 KiB stride (4 sources interleaved
    into one destination, as P4 -> D1 NHD writes them). :meth:`measure` may be called between
    cases; ``flat``/``sliced`` keep the best GB/s seen (the host is shared: noise only slows)."""

    def __init__(self, nbytes: int) -> None:
        from kvbridge.memory.pools import HostPool

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
