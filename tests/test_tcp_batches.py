"""A small tcp batch leaves in as few socket calls as it can (its frame and payload pieces in
``sendmsg`` calls): its bytes still land exactly, whatever the number of pieces and however
little the socket takes per call.

Real agents in this process over loopback sockets; every check is on the destination's bytes.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvbridge.memory.pools import HostPool
from kvbridge.planner.layout import Region
from kvbridge.planner.runs import Runs
from kvbridge.transports import XferState, create

CANARY = 0xA5
_names = itertools.count()


@pytest.mark.parametrize("sockbuf", [0, 4096], ids=["default-buffers", "4-KiB-buffers"])
def test_many_pieces_of_a_small_batch_land_exactly(sockbuf: int) -> None:
    """600 flat runs of 600 distinct sizes: each size is a piece of its own (past the 512
    buffers a sendmsg is given at once), under 1 MiB in all; with 4 KiB socket buffers each
    call takes a part of a buffer, and the rest follows."""
    k = next(_names)
    sizes = np.arange(1, 601, dtype=np.int64)
    src_off = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    dst_off = src_off * 2 + 7  # gaps between the runs stay canaries
    total = int(sizes.sum())
    tx = create("tcp", f"btx{k}", sockbuf=sockbuf)
    rx = create("tcp", f"brx{k}", sockbuf=sockbuf)
    src = HostPool([Region("s", total)], shared=False)
    dst = HostPool([Region("d", 2 * total + 8)], shared=False)
    try:
        source = np.random.default_rng(k).integers(0, 256, total, dtype=np.uint8)
        src.view("s")[:] = source
        dst.view("d")[:] = CANARY
        tx.register(src.regions())
        tx.add_peer(rx.agent, rx.register(dst.regions()))
        z = np.zeros(len(sizes), dtype=np.int64)
        runs = Runs(z, src_off, z.copy(), dst_off, sizes, z + 1, z.copy(), z.copy())
        h = tx.post(rx.agent, ("s",), ("d",), runs)
        assert tx.wait(h, 30.0) is XferState.DONE, h.error
        want = np.full(2 * total + 8, CANARY, dtype=np.uint8)
        for s, d, n in zip(src_off, dst_off, sizes, strict=True):
            want[d : d + n] = source[s : s + n]
        bad = np.flatnonzero(dst.view("d") != want)
        assert not len(bad), f"{len(bad)} wrong bytes, first at {bad[:5].tolist()}"
    finally:
        tx.close()
        rx.close()
        src.close()
        dst.close()
