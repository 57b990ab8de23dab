"""How tcp walks runs of device memory (on CPU: the walk itself; the copies run on a GPU in
tests/test_gpu.py): every byte of a device region goes through the bounce buffer, in pieces
of at most its size, in the stream's order, beside host regions' pieces of the same batch."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.errors import DeviceError
from kvbridge.memory.bounce import Bounce
from kvbridge.memory.device import cuda_unavailable
from kvbridge.memory.location import cuda
from kvbridge.transports import create, tcp_wire
from kvbridge.transports.base import TransportOptions
from tiers import examples


class _DeviceBytes:
    """Stands for a device region's tensor in the walk: the walk never reads it (a Staged
    piece only names runs of it); this test reads the runs named, with numpy."""

    def __init__(self, data: np.ndarray) -> None:
        self.data = data


def _stream(views: list, region, offset, nbytes, count, stride) -> bytes:
    """The payload as the wire carries it: each run's blocks in order."""
    out = []
    for r, o, n, c, s in zip(region, offset, nbytes, count, stride, strict=True):
        v = views[r].data if isinstance(views[r], _DeviceBytes) else views[r]
        out += [v[o + j * s : o + j * s + n].tobytes() for j in range(c)]
    return b"".join(out)


def _walked(pieces, bounce: Bounce, most: int) -> tuple[bytes, list[str]]:
    """The payload as one side's pieces produce it (device pieces of at most ``most``
    bytes), and the kinds of the pieces."""
    out, kinds = [], []
    for p in pieces:
        kinds.append(type(p).__name__)
        if isinstance(p, tcp_wire.Direct):
            out.append(p.buf.tobytes())
        elif isinstance(p, tcp_wire.Staged):
            assert p.nbytes <= most
            data = p.tensor.data
            out += [data[o : o + n].tobytes() for o, n in zip(p.offsets, p.sizes, strict=True)]
        else:
            p.gather(bounce)
            out.append(bounce.host[: p.nbytes].tobytes())
    return b"".join(out), kinds


_RUN = st.tuples(
    st.integers(0, 3),  # which region
    st.integers(0, 4000),  # offset
    st.integers(1, 300),  # bytes a block
    st.integers(1, 4),  # blocks
    st.integers(0, 400),  # extra stride beyond the block
)


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(_RUN, min_size=1, max_size=40), st.integers(1, 700), st.integers(0, 15))
def test_a_batch_over_host_and_device_regions_walks_the_stream_in_order(
    runs: list[tuple[int, int, int, int, int]], bounce_bytes: int, on_device: int
) -> None:
    rng = np.random.default_rng(len(runs))
    regions = [rng.integers(0, 256, 8000, dtype=np.uint8) for _ in range(4)]
    views = [
        _DeviceBytes(r) if on_device >> i & 1 else r for i, r in enumerate(regions)
    ]  # bit i: region i is device memory
    columns = zip(*runs, strict=True)
    region, offset, nbytes, count, extra = (np.array(c, dtype=np.int64) for c in columns)
    stride = np.where(count > 1, nbytes + extra, 0)
    bounce = Bounce(max(bounce_bytes, 300))  # a host piece holds one block at least
    got, kinds = _walked(
        tcp_wire.pieces(region, offset, nbytes, count, stride, views, bounce_bytes),
        bounce,
        bounce_bytes,
    )
    assert got == _stream(views, region, offset, nbytes, count, stride)
    device_runs = sum(on_device >> int(r) & 1 for r in region)
    assert ("Staged" in kinds) == (device_runs > 0)


def test_scattered_pages_of_a_key_and_a_value_gather_in_one_copy() -> None:
    """A request on scattered single-token pages: each page's key and value, a strided run of
    two blocks, would be a strided copy of its own; as flat runs of one size in one region
    they gather in one fancy-indexed copy, the stream's bytes unchanged."""
    rng = np.random.default_rng(7)
    view = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    pages = rng.choice(1024, 64, replace=False)
    offset = pages.astype(np.int64) * 1024  # a page: its key (256 B), a gap, its value
    n = len(pages)
    region, nbytes = np.zeros(n, np.int64), np.full(n, 256, np.int64)
    count, stride = np.full(n, 2, np.int64), np.full(n, 512, np.int64)
    got, kinds = _walked(
        tcp_wire.pieces(region, offset, nbytes, count, stride, [view]), Bounce(1 << 20), 0
    )
    assert got == _stream([view], region, offset, nbytes, count, stride)
    assert kinds == ["Group"]


def test_flattening_short_runs_never_makes_more_runs_than_a_header_may_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A header of MAX_RUNS short strided runs (15 blocks of a byte each) was flattened into
    15 times as many runs, in Python lists, before a byte of payload came (2 GiB from a 40 MiB
    header). Flattening stops at MAX_RUNS flat runs; the stream is the same either way."""
    monkeypatch.setattr(tcp_wire, "MAX_RUNS", 100)
    view = np.arange(1 << 16, dtype=np.int64).astype(np.uint8)
    for runs, flattened in ((30, True), (40, False)):  # 90 flat runs, then 120
        region, nbytes = np.zeros(runs, np.int64), np.ones(runs, np.int64)
        offset = np.arange(runs, dtype=np.int64) * 64
        count, stride = np.full(runs, 3, np.int64), np.full(runs, 7, np.int64)
        out = tcp_wire._flattened(region, offset, nbytes, count, stride)
        assert len(out[0]) == (3 * runs if flattened else runs)
        got, _ = _walked(
            tcp_wire.pieces(region, offset, nbytes, count, stride, [view]), Bounce(1 << 20), 0
        )
        assert got == _stream([view], region, offset, nbytes, count, stride)


@settings(max_examples=examples(200), deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 5000), st.integers(1, 5)), min_size=1),
    st.integers(1, 9000),
)
def test_device_runs_are_cut_into_full_pieces_of_the_bounce_but_the_last(
    runs: list[tuple[int, int, int]], bounce: int
) -> None:
    offset, nbytes, count = (np.array(c, dtype=np.int64) for c in zip(*runs, strict=True))
    stride = nbytes + 7
    cut = list(tcp_wire.staged_runs(offset, nbytes, count, stride, bounce))
    sizes = [int(s.sum()) for _, s in cut]
    assert sum(sizes) == int((nbytes * count).sum())
    assert all(s == bounce for s in sizes[:-1]) and 0 < sizes[-1] <= bounce
    flat = [
        (o + j * s + k)
        for o, n, c, s in zip(offset, nbytes, count, stride, strict=True)
        for j in range(c)
        for k in (0, n - 1)
    ]  # the first and last byte of every block, in stream order
    ends = [
        b for offs, lens in cut for o, n in zip(offs, lens, strict=True) for b in (o, o + n - 1)
    ]
    assert ends[0] == flat[0] and ends[-1] == flat[-1]
    assert set(flat) <= set(ends)  # every block's first and last byte starts or ends a cut run


def test_a_host_bounce_buffer_refuses_device_runs() -> None:
    piece = tcp_wire.Staged(object(), np.array([0]), np.array([8]))
    with pytest.raises(DeviceError, match="made for host memory"):
        piece.gather(Bounce(64))


@pytest.mark.skipif(cuda_unavailable() is None, reason="CUDA is usable here")
def test_tcp_for_device_memory_needs_cuda_saying_so() -> None:
    with pytest.raises(DeviceError, match="CUDA"):
        create("tcp", "a", TransportOptions(device=cuda(0)))


@settings(max_examples=examples(200), deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 70),  # source region
            st.integers(0, 70),  # destination region
            st.sampled_from([512, 2048, 4096, tcp_wire.DIRECT_MIN, 1 << 20]),
            st.integers(1, 3),  # blocks
        ),
        max_size=300,
    )
)
def test_a_batch_is_sent_grouped_and_in_plan_order_within_a_group(runs: list) -> None:
    """The sender's order puts the small flat runs of one (source region, destination region,
    size) in one stretch, so that each side moves them in one copy, and keeps the plan's order
    within it (a layer's tokens in turn)."""
    sr, dr, nb, count = (np.array([r[i] for r in runs], dtype=np.int64) for i in range(4))
    order = tcp_wire.stream_order(sr, dr, nb, count)
    assert sorted(order.tolist()) == list(range(len(runs)))
    small = (count == 1) & (nb < tcp_wire.DIRECT_MIN)
    keys = list(
        zip(
            small[order].tolist(),
            sr[order].tolist(),
            dr[order].tolist(),
            nb[order].tolist(),
            strict=True,
        )
    )
    stretches = [k for i, k in enumerate(keys) if i == 0 or keys[i - 1] != k]
    assert len(stretches) == len(set(stretches))  # each key in one stretch
    for key in set(keys):
        members = [int(i) for i, k in zip(order, keys, strict=True) if k == key]
        assert members == sorted(members)
