"""The one sharding rule, for every axis of every component.

An axis is a list of segments. For TP size ``T`` each segment of ``units`` units is split on
its own:

* ``units >= T``: ``T`` must divide ``units``; rank ``r`` holds ``[r*units/T, (r+1)*units/T)``.
* ``units < T``: ``units`` must divide ``T``; rank ``r`` holds the one unit
  ``floor(r*units/T)``, a replica shared with ``T/units - 1`` other ranks.

A rank's local axis is the concatenation of its pieces of each segment, in segment order.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from kvbridge.errors import LayoutError
from kvbridge.model.spec import Segment


def check_segment(seg: Segment, tp: int, where: str = "") -> None:
    """Raise LayoutError unless ``seg`` can be sharded over ``tp`` ranks."""
    if tp < 1:
        raise LayoutError(f"TP size must be >= 1, got {tp}")
    if seg.units >= tp and seg.units % tp:
        raise LayoutError(
            f"{where}segment {seg.name!r} has {seg.units} units, not divisible by TP {tp}"
        )
    if seg.units < tp and tp % seg.units:
        raise LayoutError(
            f"{where}segment {seg.name!r} has {seg.units} units, fewer than TP {tp} and not a "
            f"divisor of it: replicas cannot be spread evenly"
        )


def check_dcp(seg: Segment, tp: int, dcp: int, where: str = "") -> None:
    """Raise LayoutError unless the copies of each unit of a per-token ``seg`` can split its
    tokens ``dcp`` ways (the ranks holding one unit must cover every DCP rank equally)."""
    if dcp > 1 and (seg.units >= tp or (tp // seg.units) % dcp):
        copies = max(1, tp // seg.units) if seg.units < tp else 1
        raise LayoutError(
            f"{where}segment {seg.name!r}: DCP {dcp} splits the tokens of each "
            f"unit over the TP ranks holding it, but at TP {tp} each of its "
            f"{seg.units} units has {copies} holder(s), not a multiple of {dcp}"
        )


def held(seg: Segment, tp: int, rank: int) -> tuple[int, int]:
    """The units ``[start, stop)`` of ``seg`` that TP rank ``rank`` holds."""
    if seg.units >= tp:
        per = seg.units // tp
        return rank * per, (rank + 1) * per
    u = rank * seg.units // tp
    return u, u + 1


def holders(seg: Segment, tp: int, unit: int) -> range:
    """The TP ranks that hold ``unit`` (one rank, or every replica of it)."""
    if seg.units >= tp:
        r = unit // (seg.units // tp)
        return range(r, r + 1)
    per = tp // seg.units
    return range(unit * per, (unit + 1) * per)


def local_units(seg: Segment, tp: int) -> int:
    """How many units of ``seg`` each rank holds (the same on every rank)."""
    return max(1, seg.units // tp)


def local_axis_elems(segments: tuple[Segment, ...], tp: int) -> int:
    return sum(local_units(s, tp) * s.unit_size for s in segments)


@dataclass(frozen=True)
class Block:
    """A run of whole units that one prefill rank sends to one decode rank.

    Offsets are in local units and local axis elements of each side.
    """

    writer: int  # prefill TP rank
    reader: int  # decode TP rank
    segment: str
    unit: int  # first global unit of the segment this block carries
    src_unit: int  # first local unit index on the prefill rank (over the concatenated axis)
    dst_unit: int
    src_elem: int  # first local axis element on the prefill rank
    dst_elem: int
    units: int
    unit_size: int


@lru_cache(maxsize=4096)
def blocks(
    segments: tuple[Segment, ...],
    tp_src: int,
    tp_dst: int,
    spread: int,
    dcp_src: int = 1,
    residue: int = 0,
) -> tuple[Block, ...]:
    """Every block of the axis, for every decode TP rank, with one writer per unit.

    Where a unit has several prefill replicas, decode rank ``d`` takes it from replica
    ``(d + spread) % replicas``: callers pass the layer index as ``spread``, so consecutive
    layers (and consecutive decode ranks) read from different replicas and the send load is
    spread. Only ``spread % tp_src`` matters, which keeps this cache small.

    With ``dcp_src > 1`` the prefill replicas of a unit hold different tokens: only those of
    DCP rank ``residue`` (``tp rank % dcp_src == residue``) hold the tokens in question.
    """
    out: list[Block] = []
    for d in range(tp_dst):
        src_unit_base = src_elem_base = dst_unit_base = dst_elem_base = 0
        for seg in segments:
            d_lo, d_hi = held(seg, tp_dst, d)
            # Walk the decode rank's units, grouping consecutive units with the same writer.
            u = d_lo
            while u < d_hi:
                reps = holders(seg, tp_src, u)
                if dcp_src > 1:
                    reps = reps[residue::dcp_src]  # holders are consecutive ranks
                w = reps[(d + spread) % len(reps)]
                w_lo, w_hi = held(seg, tp_src, w)
                stop = min(d_hi, w_hi)
                n = stop - u
                out.append(
                    Block(
                        writer=w,
                        reader=d,
                        segment=seg.name,
                        unit=u,
                        src_unit=src_unit_base + (u - w_lo),
                        dst_unit=dst_unit_base + (u - d_lo),
                        src_elem=src_elem_base + (u - w_lo) * seg.unit_size,
                        dst_elem=dst_elem_base + (u - d_lo) * seg.unit_size,
                        units=n,
                        unit_size=seg.unit_size,
                    )
                )
                u = stop
            n_src, n_dst = local_units(seg, tp_src), local_units(seg, tp_dst)
            src_unit_base += n_src
            dst_unit_base += n_dst
            src_elem_base += n_src * seg.unit_size
            dst_elem_base += n_dst * seg.unit_size
    return tuple(out)
