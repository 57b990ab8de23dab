"""Integrity mode: a checksum per destination region of every (pair, chunk).

The sender hashes the source bytes of its runs, the receiver the bytes that landed, both in
one canonical order: destination region, then destination offset. That order depends only on
which destination bytes are written (the same set on both sides, each byte once), not on how
runs were coalesced, so the receiver can derive it from its own placement alone: it plans the
chunk against a stand-in prefill placement, whose source offsets it ignores.

It costs a Python step per flat descriptor, which is why it is off by default.
"""

from __future__ import annotations

import zlib

import numpy as np

from kvbridge.planner.placement import Placement
from kvbridge.planner.plan import Pairing
from kvbridge.planner.runs import Runs
from kvbridge.planner.transferplan import TransferPlan


def checksums(
    plan: TransferPlan, runs: Runs, views: dict[str, np.ndarray], *, source: bool
) -> dict[str, int]:
    """crc32 per destination region name, reading the source (sender) or destination
    (receiver) bytes of ``runs`` in canonical order."""
    flat = runs.flat()
    order = np.lexsort((flat.dst_offset, flat.dst_region))
    out: dict[str, int] = {}
    regions = plan.src_regions if source else plan.dst_regions
    for i in order.tolist():
        dname = plan.dst_regions[int(flat.dst_region[i])]
        if source:
            view = views[regions[int(flat.src_region[i])]]
            off = int(flat.src_offset[i])
        else:
            view = views[dname]
            off = int(flat.dst_offset[i])
        out[dname] = zlib.crc32(view[off : off + int(flat.nbytes[i])].data, out.get(dname, 0))
    return out


def stand_in_source(pairing: Pairing, tokens: int) -> Placement:
    """Any valid prefill placement: the receiver only needs the destination side of runs."""
    mem = pairing.prefill.memory
    pages: dict[str, np.ndarray] = {}
    for buf in mem.buffers.values():
        if buf.dim("page") is not None and buf.group not in pages:
            need = -(-tokens // buf.size("token"))
            pages[buf.group] = np.arange(need, dtype=np.int64) % buf.size("page")
    slots = {buf.group: 0 for buf in [*mem.buffers.values(), mem.aux] if buf.dim("slot")}
    return Placement(tokens, pages, slots)


def verify(
    pairing: Pairing,
    dst: Placement,
    start: int,
    stop: int,
    last: bool,
    prefill_rank: int,
    decode_rank: int,
    views: dict[str, np.ndarray],
    reported: dict[str, int],
    layers: range | None = None,
    aux: bool = True,
) -> str | None:
    """None if the landed bytes match the sender's checksums, else what differs."""
    plan = pairing.plan(
        stand_in_source(pairing, dst.tokens),
        dst,
        start,
        stop,
        last=last,
        prefill_rank=prefill_rank,
        decode_rank=decode_rank,
        layers=layers,
        aux=aux,
    )
    if not plan.pairs:
        return None if not reported else f"checksums for regions {sorted(reported)} not owed"
    got = checksums(plan, plan.pairs[0].runs, views, source=False)
    for region in sorted(set(got) | set(reported)):
        if got.get(region) != reported.get(region):
            return (
                f"region {region} (tokens [{start}, {stop})) from prefill rank "
                f"{prefill_rank}: checksum {got.get(region)} landed, sender reported "
                f"{reported.get(region)}"
            )
    return None
