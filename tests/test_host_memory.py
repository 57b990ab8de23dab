"""kvbridge.memory.pools: pools are zero-copy, writable, pre-faulted, and leave nothing in /dev/shm;
caller-owned memory can be described; the shm transport refuses what it cannot write."""

from __future__ import annotations

from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import pytest

from kvbridge.errors import LayoutError
from kvbridge.memory.pools import (
    HostPool,
    map_segment,
    wrap_address,
    wrap_array,
    wrap_shared_memory,
)
from kvbridge.planner.layout import Region


@pytest.mark.parametrize("shared", [False, True])
def test_pool_views_are_the_registered_memory(shared: bool) -> None:
    with HostPool([Region("a", 10_000), Region("b", 3)], shared=shared) as pool:
        a, b = pool.regions()
        assert (a.name, a.nbytes, b.nbytes) == ("a", 10_000, 3)
        assert a.shared is shared and (a.segment == pool.segment)
        v = pool.view("a")
        assert int(v.ctypes.data) == a.address and v.flags.writeable
        v[:] = 9
        assert (a.view() == 9).all()  # same bytes through the RegionMemory
        assert b.address % 4096 == 0  # regions are page-aligned
        with pytest.raises(LayoutError, match="no region 'c'"):
            pool.view("c")
        if shared:
            mm = map_segment(str(pool.segment))  # another mapping of the same bytes
            assert np.frombuffer(mm, np.uint8)[b.segment_offset - 4096] == 9
            del mm


def test_shared_pool_is_unlinked_on_close_even_with_live_views() -> None:
    pool = HostPool([Region("a", 4096)], shared=True)
    path = Path("/dev/shm") / str(pool.segment)
    view = pool.view("a")
    assert path.exists()
    pool.close()
    assert not path.exists()
    view[:] = 1  # the mapping outlives the name: no crash
    pool.close()  # idempotent


def test_wrapped_memory() -> None:
    arr = np.zeros((4, 8), dtype=np.float32)
    r = wrap_array("arr", arr)
    assert (r.address, r.nbytes, r.shared) == (arr.ctypes.data, 128, False)
    r.view()[:4] = 255
    assert arr.view(np.uint8)[0, :4].tolist() == [255] * 4
    raw = wrap_address("raw", arr.ctypes.data, 128)
    assert raw.view()[0] == 255
    with pytest.raises(LayoutError, match="C-contiguous"):
        wrap_array("t", arr.T)
    shm = shared_memory.SharedMemory(create=True, size=8192)
    try:
        s = wrap_shared_memory("s", shm, offset=4096, nbytes=100)
        assert (s.segment, s.segment_offset, s.nbytes) == (shm.name, 4096, 100)
        s.view()[:] = 3
        assert shm.buf[4096] == 3
        del s  # releases its view of shm.buf, so that close() can unmap
    finally:
        shm.close()
        shm.unlink()
