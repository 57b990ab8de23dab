"""Many runs between torch tensors in a few kernels: the cudaipc transport's copies, and the
device side of a host transport's bounce buffer (:mod:`kvbridge.memory.bounce`).

One ``copy_`` per run costs a launch from Python (~10 us): a fragmented plan (64 KiB pieces,
or 256-byte head slices between NHD and HND) would run at a few GB/s, or MB/s, on a device
that copies at over a TB/s. Instead, the runs between one pair of regions are cut into rows
of their common divisor (every offset and length is a multiple of it), and the rows are moved
by one gather (``index_select``) into a temporary and one scatter (``index_copy_``) out of
it, with their row indices built on the host by numpy. Where the divisor is under
:data:`MIN_ROW` bytes (the index would outweigh the data) or there are only a few runs, the
runs are copied one by one.

Pure torch: the same code runs on CPU tensors (the tests' oracle check) and CUDA ones (on
the caller's current stream).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvbridge.planner.runs import Runs

MIN_ROW = 16  # bytes: rows narrower than this cost more index than data
FEW = 8  # runs: up to this many, one copy each is cheaper than building indices

# Wider elements where the row and the tensor allow (uint8 rows index byte by byte).
_WIDTHS = ((8, "int64"), (4, "int32"), (2, "int16"))


def copy_runs(torch: Any, dst: Sequence[Any], src: Sequence[Any], runs: Runs) -> None:
    """Copy flat ``runs`` from uint8 tensors ``src`` into ``dst`` (indexed by the runs'
    region numbers). Destinations must not overlap (the planner's runs never do)."""
    f = runs.flat()
    pair = f.src_region * max(1, len(dst)) + f.dst_region
    for key in np.unique(pair):
        sel = np.flatnonzero(pair == key)
        s, d = divmod(int(key), max(1, len(dst)))
        copy_flat(torch, dst[d], src[s], f.dst_offset[sel], f.src_offset[sel], f.nbytes[sel])


def copy_flat(
    torch: Any,
    dst: Any,
    src: Any,
    dst_offset: np.ndarray,
    src_offset: np.ndarray,
    nbytes: np.ndarray,
) -> None:
    """Copy flat runs (``nbytes[i]`` bytes from ``src_offset[i]`` of uint8 tensor ``src`` to
    ``dst_offset[i]`` of ``dst``), both tensors on one device."""
    so, do, nb = src_offset, dst_offset, nbytes
    row = int(np.gcd.reduce(np.concatenate([so, do, nb])))
    if len(nb) <= FEW or row < MIN_ROW:
        for a, b, n in zip(so.tolist(), do.tolist(), nb.tolist(), strict=True):
            dst[b : b + n].copy_(src[a : a + n], non_blocking=True)
        return
    per = nb // row  # rows of each run
    within = np.arange(int(per.sum()), dtype=np.int64) - np.repeat(np.cumsum(per) - per, per)
    rows_in = _rows(torch, src, row)
    rows_out = _rows(torch, dst, row)
    take = torch.from_numpy(np.repeat(so // row, per) + within).to(rows_in.device)
    put = torch.from_numpy(np.repeat(do // row, per) + within).to(rows_out.device)
    rows_out.index_copy_(0, put, rows_in.index_select(0, take))


def _rows(torch: Any, t: Any, row: int) -> Any:
    """uint8 tensor ``t`` as a 2-D tensor of rows of ``row`` bytes (its tail cut off), of
    the widest element the row and the tensor's alignment allow."""
    flat = t[: t.numel() // row * row]
    for width, name in _WIDTHS:
        if row % width == 0 and flat.data_ptr() % width == 0:
            try:
                return flat.view(getattr(torch, name)).view(-1, row // width)
            except RuntimeError:  # a storage offset the view cannot take
                continue
    return flat.view(-1, row)
