"""Copy runs: the only thing a transport executes.

A run copies ``count`` blocks of ``nbytes`` from a source region to a destination region;
block ``i`` starts at ``offset + i * stride`` on each side. A flat run has ``count == 1``
and both strides 0. Strided runs let one descriptor carry, say, one KV head of 32k tokens in an
NHD pool; transports that only take flat descriptors call :meth:`Runs.flat`.

Everything is int64 so that pools past 4 GiB work; runs are arrays, never Python objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

FIELDS = (
    "src_region",
    "src_offset",
    "dst_region",
    "dst_offset",
    "nbytes",
    "count",
    "src_stride",
    "dst_stride",
)


@dataclass(frozen=True, eq=False)
class Runs:
    src_region: np.ndarray
    src_offset: np.ndarray
    dst_region: np.ndarray
    dst_offset: np.ndarray
    nbytes: np.ndarray
    count: np.ndarray
    src_stride: np.ndarray
    dst_stride: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.src_region)
        for name in FIELDS:
            arr = getattr(self, name)
            if arr.dtype != np.int64 or arr.ndim != 1 or len(arr) != n:
                raise ValueError(
                    f"Runs.{name} must be a 1-D int64 array of length {n}, got "
                    f"{arr.dtype} shape {arr.shape}"
                )
        if n and (
            self.nbytes.min() < 1
            or self.count.min() < 1
            or self.src_offset.min() < 0
            or self.dst_offset.min() < 0
        ):
            raise ValueError("runs need nbytes >= 1, count >= 1 and non-negative offsets")

    @classmethod
    def empty(cls) -> Runs:
        z = np.zeros(0, dtype=np.int64)
        return cls(*(z for _ in FIELDS))

    @classmethod
    def concat(cls, parts: list[Runs]) -> Runs:
        if not parts:
            return cls.empty()
        if len(parts) == 1:
            return parts[0]
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in FIELDS))

    def __len__(self) -> int:
        return len(self.src_region)

    @property
    def total_bytes(self) -> int:
        return int((self.nbytes * self.count).sum())

    @property
    def descriptors(self) -> int:
        """How many flat descriptors these runs expand to."""
        return int(self.count.sum())

    def select(self, mask: np.ndarray) -> Runs:
        return Runs(*(getattr(self, f)[mask] for f in FIELDS))

    def restricted(
        self, src: tuple[str, ...], dst: tuple[str, ...]
    ) -> tuple[tuple[str, ...], tuple[str, ...], Runs]:
        """Name only the regions these runs use (``src``/``dst`` are the tables their region
        fields index): a plan's tables list every region of the side, of other PP stages too,
        which one rank's transport does not hold."""
        s_names, s_idx = _renumbered(self.src_region, src)
        d_names, d_idx = _renumbered(self.dst_region, dst)
        return (
            s_names,
            d_names,
            Runs(
                s_idx,
                self.src_offset,
                d_idx,
                self.dst_offset,
                self.nbytes,
                self.count,
                self.src_stride,
                self.dst_stride,
            ),
        )

    def flat(self) -> Runs:
        """The same copies with every strided run expanded into ``count`` flat runs."""
        if not len(self) or int(self.count.max()) == 1:
            return self
        idx, (so, do) = each_block(
            np.arange(len(self)),
            self.count,
            (self.src_offset, self.dst_offset),
            (self.src_stride, self.dst_stride),
        )
        z = np.zeros(len(idx), dtype=np.int64)
        return Runs(
            self.src_region[idx], so, self.dst_region[idx], do, self.nbytes[idx], z + 1, z, z.copy()
        )


def each_block(
    at: np.ndarray,
    count: np.ndarray,
    offsets: Sequence[np.ndarray],
    strides: Sequence[np.ndarray],
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Runs as their blocks, one after the other in run order: for runs at positions ``at``
    with ``count`` blocks, each offset array's blocks (``offset + j * stride``), and the
    position of each block's run."""
    idx = np.repeat(np.arange(len(count)), count)
    within = np.arange(len(idx)) - np.repeat(np.cumsum(count) - count, count)
    return at[idx], [o[idx] + within * st[idx] for o, st in zip(offsets, strides, strict=True)]


def _renumbered(region: np.ndarray, names: tuple[str, ...]) -> tuple[tuple[str, ...], np.ndarray]:
    """The names ``region`` uses, in table order, and ``region`` renumbered into them. Linear
    in the runs (a plan of scattered pages has a run a page, layer and K or V: sorting them to
    find the few regions they use cost more than planning them)."""
    if len(region) and (int(region.min()) < 0 or int(region.max()) >= len(names)):
        raise IndexError(
            f"region indices [{region.min()}, {region.max()}] out of range for a table of "
            f"{len(names)} regions"
        )
    used = np.zeros(len(names), dtype=bool)
    used[region] = True
    index = np.cumsum(used, dtype=np.int64) - 1  # a used region's position among those used
    return tuple(names[i] for i in np.flatnonzero(used).tolist()), index[region]


def coalesce(r: Runs) -> Runs:
    """Merge neighbouring runs into the fewest runs that copy the same bytes.

    First, flat runs adjacent on both sides become one, and strided runs that continue each
    other's progression become one. Then chains of equal-size flat runs that step by the same
    strides on both sides (one HND page after another, say) become one strided run. Order is
    kept, so callers emit runs in the order that makes neighbours mergeable.
    """
    merged = _merge_adjacent(r)
    chained = _chain_strided(merged)
    # A new chain may continue a strided run after it: merged once more (no new chain can
    # come of that), so that coalescing what is coalesced changes nothing.
    return merged if chained is merged else _merge_adjacent(chained)


def coalesce_blocks(r: Runs, starts: np.ndarray) -> Runs:
    """:func:`coalesce` of runs made of blocks that start at ``starts`` (ascending, from 0),
    each block coalesced already and within one pair of regions (a template repeated over
    layers: a block a layer). Runs merge or chain only within one pair of regions, so where
    every junction between two blocks changes region on one side the runs are coalesced
    already, and the pass over every run (most of a large plan's time: a request of
    scattered pages has a run a page and layer) is skipped."""
    j = starts[1:]
    if not np.any(
        (r.src_region[j] == r.src_region[j - 1]) & (r.dst_region[j] == r.dst_region[j - 1])
    ):
        return r
    return coalesce(r)


def _merge_adjacent(r: Runs) -> Runs:
    if len(r) < 2:
        return r
    same = (r.src_region[1:] == r.src_region[:-1]) & (r.dst_region[1:] == r.dst_region[:-1])
    flat = r.count == 1
    # A flat run and its successor: adjacent on both sides.
    both_flat = flat[1:] & flat[:-1] & (r.src_stride[1:] == 0) & (r.src_stride[:-1] == 0)
    adj = (r.src_offset[:-1] + r.nbytes[:-1] == r.src_offset[1:]) & (
        r.dst_offset[:-1] + r.nbytes[:-1] == r.dst_offset[1:]
    )
    # Strided runs (count may be 1 for a lone token of a strided piece): progression continues.
    strided = (
        (r.src_stride[1:] != 0)
        & (r.src_stride[:-1] != 0)
        & (r.src_stride[1:] == r.src_stride[:-1])
        & (r.dst_stride[1:] == r.dst_stride[:-1])
        & (r.nbytes[1:] == r.nbytes[:-1])
    )
    cont = (r.src_offset[:-1] + r.count[:-1] * r.src_stride[:-1] == r.src_offset[1:]) & (
        r.dst_offset[:-1] + r.count[:-1] * r.dst_stride[:-1] == r.dst_offset[1:]
    )
    merge = same & ((both_flat & adj) | (strided & cont))
    if not merge.any():
        return r
    starts = np.flatnonzero(np.concatenate(([True], ~merge)))
    is_flat = r.src_stride[starts] == 0
    nbytes = np.where(is_flat, np.add.reduceat(r.nbytes, starts), r.nbytes[starts])
    count = np.where(is_flat, 1, np.add.reduceat(r.count, starts)).astype(np.int64)
    return Runs(
        r.src_region[starts],
        r.src_offset[starts],
        r.dst_region[starts],
        r.dst_offset[starts],
        nbytes,
        count,
        r.src_stride[starts],
        r.dst_stride[starts],
    )


def _links(cand: np.ndarray, same: np.ndarray) -> np.ndarray:
    """Which neighbours (run i, run i + 1) join one chain, greedily from the front: a
    linkable pair (``cand``) links unless the pair before it linked with another step
    (``same[i - 1]``: pair i steps as pair i - 1). As a recurrence, ``link[i] = cand[i] and
    (not link[i - 1] or same[i - 1])``; solved without a loop: a pair that steps as the one
    before links, and the pairs that start a new step alternate from the first of a stretch
    of them (linked where it follows no link, not after a chain of two runs or more)."""
    prev = np.concatenate(([False], cand[:-1]))
    same = np.concatenate(([False], same))
    fresh = cand & ~(prev & same)  # pairs that start a new step (or follow no pair)
    if not (fresh & prev).any():  # no step changes within a stretch: every linkable pair links
        return cand
    first = fresh & ~np.concatenate(([False], fresh[:-1]))  # the first of a stretch of them
    s = np.flatnonzero(first)[np.maximum(np.cumsum(first) - 1, 0)]  # each pair's stretch's first
    odd = (np.arange(len(cand)) - s) % 2 == 1
    return np.where(fresh, ~prev[s] ^ odd, cand)


def _chain_strided(r: Runs) -> Runs:
    flat = r.src_stride == 0
    if int(flat.sum()) < 2:
        return r
    ds = np.diff(r.src_offset)
    dd = np.diff(r.dst_offset)
    # Linkable neighbours: both flat, same regions and size, non-overlapping forward steps.
    cand = (
        flat[1:]
        & flat[:-1]
        & (r.nbytes[1:] == r.nbytes[:-1])
        & (r.src_region[1:] == r.src_region[:-1])
        & (r.dst_region[1:] == r.dst_region[:-1])
        & (ds >= r.nbytes[:-1])
        & (dd >= r.nbytes[:-1])
    )
    link = _links(cand, (ds[1:] == ds[:-1]) & (dd[1:] == dd[:-1]))
    # Only what links decides, never how many do elsewhere: a run's result is the same in
    # any list around it that it cannot link with (:func:`coalesce_blocks` counts on it).
    if not link.any():
        return r
    starts = np.flatnonzero(np.concatenate(([True], ~link)))
    count = np.diff(np.append(starts, len(r)))
    chained = count > 1
    first_step = np.minimum(starts, len(ds) - 1)
    return Runs(
        r.src_region[starts],
        r.src_offset[starts],
        r.dst_region[starts],
        r.dst_offset[starts],
        r.nbytes[starts],
        np.where(chained, count, r.count[starts]).astype(np.int64),
        np.where(chained, ds[first_step], r.src_stride[starts]),
        np.where(chained, dd[first_step], r.dst_stride[starts]),
    )
