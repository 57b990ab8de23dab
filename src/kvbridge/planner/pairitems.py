"""What a pairing plans over, found once when two sides meet (request-independent).

* :class:`Item`: one (layer, component) as both sides hold it (stages, buffers, regions,
  window), with its pieces of one token or state slot per (writer, reader) TP rank pair;
* the links that carry it: (writer stage, writer TP rank, reader stage, reader TP rank), KV
  ones per (writer DCP rank, reader DCP rank), state ones, and what units each link carries;
* :func:`placement_checks`: what a side's placements are checked against (a model's layers
  mostly share one pool layout: each distinct one once).

Which CP groups pair up, and which holds the state, depends on the request's length: the
planner (:mod:`kvbridge.planner.plan`) decides that per request.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from kvbridge.model.spec import Component, Scope
from kvbridge.planner.layout import BufferLayout
from kvbridge.planner.pieces import token_pieces
from kvbridge.planner.shard import blocks
from kvbridge.planner.side import Side

Link = tuple[int, int, int, int]  # (writer stage, writer TP rank, reader stage, reader TP rank)


@dataclass(frozen=True)
class Item:
    """One (layer, component) as both sides hold it."""

    layer: int
    comp: Component
    src_stage: int
    dst_stage: int
    src: BufferLayout
    dst: BufferLayout
    src_region: int
    dst_region: int
    window: int | None
    # Per DCP rank of the writers (one entry where the prefill side has no DCP, and for
    # state): (writer TP rank, reader TP rank) -> (src, dst, nbytes) pieces of one token or
    # state slot.
    pieces: tuple[dict[tuple[int, int], tuple[tuple[int, int, int], ...]], ...] = field(
        repr=False, hash=False
    )


@dataclass(frozen=True)
class PairItems:
    """Every item of a pairing, and the links that carry them."""

    items: tuple[Item, ...]
    # (writer DCP rank, reader DCP rank) -> the links carrying KV for those tokens
    kv_links: dict[tuple[int, int], tuple[Link, ...]]
    state_links: tuple[Link, ...]
    # link -> ("layers", "") -> layer indices; (component, segment) -> the global units
    carried: dict[Link, dict[tuple[str, str], frozenset[int]]]


def pair_items(
    prefill: Side, decode: Side, src_idx: dict[str, int], dst_idx: dict[str, int]
) -> PairItems:
    """The items of two sides that fit together; ``src_idx``/``dst_idx``: each side's region
    index by name."""
    pp, dp = prefill.parallel, decode.parallel
    items: list[Item] = []
    # Who sends what to whom, per TP rank and PP stage: (writer stage, writer TP rank,
    # reader stage, reader TP rank). A KV link holds for the tokens of writer DCP rank js
    # and reader DCP rank jd; which CP groups pair up depends on the request (its length
    # decides which token shards share tokens), and so does the CP group with the state.
    kv: dict[tuple[int, int], set[Link]] = defaultdict(set)
    state: set[Link] = set()
    carried: dict[Link, dict[tuple[str, str], set[int]]] = defaultdict(lambda: defaultdict(set))
    for li, layer in enumerate(prefill.spec.layers):
        s_stage, d_stage = pp.stage_of_layer(li), dp.stage_of_layer(li)
        for comp in layer.components:
            sb = prefill.memory.buffers[(li, comp.name)]
            db = decode.memory.buffers[(li, comp.name)]
            token = comp.scope is Scope.TOKEN
            per_residue = tuple(
                blocks(comp.segments, pp.tp, dp.tp, li % pp.tp, pp.dcp if token else 1, j)
                for j in range(pp.dcp if token else 1)
            )
            items.append(
                Item(
                    li,
                    comp,
                    s_stage,
                    d_stage,
                    sb,
                    db,
                    src_idx[sb.region],
                    dst_idx[db.region],
                    layer.window,
                    tuple(token_pieces(comp, sb, db, bl) for bl in per_residue),
                )
            )
            for js, bl in enumerate(per_residue):
                for b in bl:
                    link = (s_stage, b.writer, d_stage, b.reader)
                    if token:
                        kv[(js, b.reader % dp.dcp)].add(link)
                    else:
                        state.add(link)
                    carried[link][("layers", "")].add(li)
                    carried[link][(comp.name, b.segment)].update(range(b.unit, b.unit + b.units))
    return PairItems(
        tuple(items),
        {k: tuple(sorted(v)) for k, v in kv.items()},
        tuple(sorted(state)),
        {link: {k: frozenset(v) for k, v in c.items()} for link, c in carried.items()},
    )


@dataclass(frozen=True)
class PageCheck:
    """A paged buffer a placement's page ids are checked against, for the tokens its
    component keeps (the last ``window`` where it slides; one entry every ``comp.stride``)."""

    buf: BufferLayout
    window: int | None
    comp: Component


def placement_checks(
    items: tuple[Item, ...], prefill: bool
) -> tuple[tuple[PageCheck, ...], tuple[BufferLayout, ...]]:
    """What a placement on one side is checked against: the paged buffers that differ in what
    a page id may be (their group, page size and count, the tokens they keep), and the slotted
    buffers that differ in their group or slot count."""
    paged: dict[tuple[object, ...], PageCheck] = {}
    slotted: dict[tuple[object, ...], BufferLayout] = {}
    for it in items:
        buf = it.src if prefill else it.dst
        if it.comp.scope is Scope.STATE:
            slotted.setdefault((buf.group, buf.size("slot")), buf)
        else:
            key = (buf.group, buf.size("token"), buf.size("page"), it.window, it.comp.stride)
            paged.setdefault(key, PageCheck(buf, it.window, it.comp))
    return tuple(paged.values()), tuple(slotted.values())
