"""The raw TCP baseline of ``kvbridge bench`` (kvbridge.bench.rawtcp): its shares cover the
bytes once, and a round over real sockets lands the sources, read end to end, in the
destination, every round; the suite's tcp row is measured against it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbridge.bench import rawtcp
from kvbridge.bench.engines import Workload, raw_tcp_write
from kvbridge.errors import KVBridgeError
from kvbridge.memory.pools import HostPool
from kvbridge.planner.layout import Region


@given(st.integers(0, 10_000), st.integers(1, 8))
def test_shares_cover_every_byte_once_in_order(nbytes: int, streams: int) -> None:
    got = rawtcp.shares(nbytes, streams)
    assert len(got) == streams
    assert [s for s, _ in got] == list(np.cumsum([0] + [n for _, n in got[:-1]]))
    assert sum(n for _, n in got) == nbytes
    assert max(n for _, n in got) - min(n for _, n in got) <= 1


@given(st.lists(st.integers(0, 50), min_size=1, max_size=5), st.data())
def test_slices_read_the_regions_end_to_end_and_around(
    sizes: list[int], data: st.DataObject
) -> None:
    flat = np.arange(sum(sizes), dtype=np.uint8)
    bounds = np.cumsum([0, *sizes])
    views = [memoryview(flat[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    start = data.draw(st.integers(0, 3 * len(flat)))
    length = data.draw(st.integers(0, 3 * len(flat))) if len(flat) else 0
    got = b"".join(bytes(v) for v in rawtcp.slices(views, start, length))
    want = np.resize(flat, start + length + len(flat))[start : start + length] if length else b""
    assert got == bytes(want)


def test_bytes_of_empty_regions_are_refused() -> None:
    with pytest.raises(KVBridgeError, match="5 bytes of empty regions"):
        rawtcp.slices([memoryview(bytearray(0))], 0, 5)


class _Pipe:
    """The receiver's end of the bench's pipe: what it sends, kept."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, message: Any) -> None:
        self.sent.append(message)


def test_rounds_over_real_sockets_land_the_sources_in_order() -> None:
    w = Workload.sliced(3 * 4 * 4096, 4096, ways=4)  # three blocks of four sources
    src = HostPool([Region(f"s{i}", n) for i, n in enumerate(w.src_sizes)], shared=False)
    dst = HostPool([Region(f"d{i}", n) for i, n in enumerate(w.dst_sizes)], shared=False)
    rng = np.random.default_rng(7)
    with src, dst:
        pipe = _Pipe()
        rawtcp.receiver(pipe, dst)
        (status, address) = pipe.sent[0]
        assert status == "ok"
        once = rawtcp.sender(src, w.runs, address)
        for _ in range(3):  # new bytes each round, all of them landed when it returns
            for r in src.regions():
                src.view(r.name)[:] = rng.integers(0, 256, r.nbytes, dtype=np.uint8)
            once()
            sent = np.concatenate([src.view(r.name) for r in src.regions()])
            got = np.concatenate([dst.view(r.name) for r in dst.regions()])
            assert np.array_equal(got[: w.nbytes], sent[: w.nbytes])


@pytest.mark.slow  # starts processes: the fast tier's are in-process
def test_the_bench_measures_it_in_two_processes() -> None:
    res = raw_tcp_write(Workload.contiguous(8 << 20), repeat=2, warmup=1)
    assert res.engine == "tcp" and res.nbytes == 8 << 20
    assert len(res.seconds) == 2 and res.gbps > 0
