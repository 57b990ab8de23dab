"""Where a pair's bytes sit in staging: the gather and scatter orders, from the planner's runs.

A pair's runs, packed end to end in their order (run after run, block after block), form its
*stream*. Segment ``k`` is bytes ``[k * T, (k + 1) * T)`` of the stream (``T`` the segment
size; the last segment may be shorter): :func:`segments` cuts the runs at those boundaries,
a strided run between two blocks, or through a block (the block's two parts then become flat
runs). Nothing here decides which bytes go where; it only renumbers the planner's runs, so the
prefill rank (gathering) and the decode rank (scattering) derive the same segments from the
same plan, each on its own.

:func:`gather` writes a segment into a staging slot (the runs' destinations become the slot,
packed); :func:`scatter` reads it back into the destinations (the runs' sources become the
slot). Both return :class:`~kvbridge.planner.runs.Runs` for :func:`kvbridge.memory.copy.execute`, or
for a transport: a segment whose source bytes are a few contiguous extents is written by the
transport straight from them into the remote slot, :func:`extents` of its gather, with no local
copy.
"""

from __future__ import annotations

import numpy as np

from kvbridge.planner.runs import FIELDS, Runs, coalesce


def segments(runs: Runs, segment_bytes: int) -> tuple[Runs, ...]:
    """The runs cut into segments of ``segment_bytes`` of their packed stream (see the module
    doc). Deterministic: the same runs and size give the same segments on every rank."""
    if segment_bytes < 1:
        raise ValueError(f"segment_bytes must be >= 1, got {segment_bytes}")
    if not len(runs):
        return ()
    t = segment_bytes
    size = runs.nbytes * runs.count
    start = np.cumsum(size) - size  # each run's first byte in the stream
    # Pieces of each run between segment boundaries: [lo, hi) relative to the run.
    first_seg = start // t
    pieces = -(-(start + size) // t) - first_seg
    idx = np.repeat(np.arange(len(runs)), pieces)
    k = np.arange(len(idx), dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    seg = first_seg[idx] + k
    lo = np.maximum(seg * t - start[idx], 0)
    hi = np.minimum((seg + 1) * t - start[idx], size[idx])
    n = runs.nbytes[idx]
    # A piece is a partial block at its head, whole blocks, a partial block at its tail.
    j1 = -(-lo // n)  # first whole block
    j2 = hi // n  # end of the whole blocks
    head_block = lo // n
    head_len = np.minimum(j1 * n, hi) - lo
    body = np.maximum(j2 - j1, 0)
    tail_len = np.where(j2 >= j1, hi - j2 * n, 0)
    so, do = runs.src_offset[idx], runs.dst_offset[idx]
    ss, ds = runs.src_stride[idx], runs.dst_stride[idx]
    sr, dr = runs.src_region[idx], runs.dst_region[idx]
    z = np.zeros(len(idx), dtype=np.int64)
    into = lo - head_block * n
    parts = (
        # head: the end of block head_block (flat)
        (sr, so + head_block * ss + into, dr, do + head_block * ds + into, head_len, z + 1, z, z),
        # body: whole blocks [j1, j2) with the run's strides
        (sr, so + j1 * ss, dr, do + j1 * ds, n, body, ss, ds),
        # tail: the start of block j2 (flat)
        (sr, so + j2 * ss, dr, do + j2 * ds, tail_len, z + 1, z, z),
    )
    keep = np.stack([head_len > 0, body > 0, tail_len > 0], axis=1).ravel()
    cols = [np.stack([p[f] for p in parts], axis=1).ravel()[keep] for f in range(len(FIELDS))]
    out = Runs(*(c.astype(np.int64, copy=False) for c in cols))
    # A body of one block is a flat run: strides mean nothing there (keeps coalescing rules).
    single = out.count == 1
    if single.any():
        out = Runs(
            out.src_region,
            out.src_offset,
            out.dst_region,
            out.dst_offset,
            out.nbytes,
            out.count,
            np.where(single, 0, out.src_stride),
            np.where(single, 0, out.dst_stride),
        )
    seg_of = np.repeat(seg, 3)[keep]
    cuts = np.flatnonzero(seg_of[1:] != seg_of[:-1]) + 1
    edges = np.concatenate(([0], cuts, [len(seg_of)])).tolist()
    return tuple(
        Runs(*(getattr(out, f)[a:b] for f in FIELDS))
        for a, b in zip(edges[:-1], edges[1:], strict=True)
    )


def _packed(segment: Runs, base: int) -> np.ndarray:
    size = segment.nbytes * segment.count
    out: np.ndarray = base + np.cumsum(size) - size
    return out


def _block_stride(segment: Runs) -> np.ndarray:
    out: np.ndarray = np.where(segment.count > 1, segment.nbytes, 0)
    return out


def gather(segment: Runs, base: int, region: int = 0) -> Runs:
    """Runs that copy a segment's source bytes into staging region ``region``, packed from
    byte ``base`` (a slot's start)."""
    return Runs(
        segment.src_region,
        segment.src_offset,
        np.full(len(segment), region, dtype=np.int64),
        _packed(segment, base),
        segment.nbytes,
        segment.count,
        segment.src_stride,
        _block_stride(segment),
    )


def scatter(segment: Runs, base: int, region: int = 0) -> Runs:
    """Runs that copy a segment, packed from byte ``base`` of staging region ``region``, into
    its destinations."""
    return Runs(
        np.full(len(segment), region, dtype=np.int64),
        _packed(segment, base),
        segment.dst_region,
        segment.dst_offset,
        segment.nbytes,
        segment.count,
        _block_stride(segment),
        segment.dst_stride,
    )


def extents(runs: Runs) -> Runs:
    """The same copies as few contiguous extents: a strided run whose blocks abut on both
    sides is one flat run, and flat runs that continue each other merge (a gather from an
    NHD pool at prefill TP 4 is one extent per head slice of a layer, not one per token)."""
    abut = (runs.count > 1) & (runs.src_stride == runs.nbytes) & (runs.dst_stride == runs.nbytes)
    if not abut.any():
        return coalesce(runs)
    return coalesce(
        Runs(
            runs.src_region,
            runs.src_offset,
            runs.dst_region,
            runs.dst_offset,
            np.where(abut, runs.nbytes * runs.count, runs.nbytes),
            np.where(abut, 1, runs.count),
            np.where(abut, 0, runs.src_stride),
            np.where(abut, 0, runs.dst_stride),
        )
    )
