"""The bytes of one (layer, component) item, cut into runs: the planner's arithmetic.

* :func:`token_pieces`: per (writer TP rank, reader TP rank), the (src, dst, nbytes) pieces of
  one token (or state slot) of an item, from the sharding blocks and both memory layouts;
* :func:`page_cuts`, :func:`page_offsets`: where pages end and where tokens sit in a buffer,
  bounds-checked against the placement (:func:`check_pages`: the check alone);
  :func:`segments`: the tokens two token shards share, cut where a page ends on either side
  and merged where both sides continue;
* :func:`template`: one item's coalesced runs over a stretch of tokens; a :class:`Repeat` of
  it over the layers that plan alike, and :func:`assemble` of a pair's repeats into its runs.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from kvbridge.errors import PlacementError
from kvbridge.model.spec import Component
from kvbridge.planner.layout import BufferLayout
from kvbridge.planner.placement import Placement
from kvbridge.planner.runs import FIELDS, Runs, coalesce, coalesce_blocks
from kvbridge.planner.shard import Block
from kvbridge.planner.tokenmap import TokenMap, shared_runs

# (dims, group of both buffers, token range, shards) -> a segments() result
SegCache = dict[tuple[object, ...], "tuple[np.ndarray, ...] | None"]


def page_cuts(local: np.ndarray, lens: np.ndarray, page: int) -> tuple[np.ndarray, np.ndarray]:
    """Where a page ends inside each run ``[local, local + lens)``: (run index, offset into
    the run) of every page start strictly inside a run."""
    first = (local // page + 1) * page
    count = np.maximum(0, -(-(local + lens - first) // page))
    idx = np.repeat(np.arange(len(local), dtype=np.int64), count)
    before = np.repeat(np.cumsum(count) - count, count)
    step = np.arange(int(count.sum()), dtype=np.int64) - before
    return idx, np.repeat(first - local, count) + step * page


def page_offsets(
    buf: BufferLayout,
    placement: Placement,
    tokens: np.ndarray,
    last: int,
    side: str,
    stride: int = 1,
) -> np.ndarray:
    """Byte offset, relative to the buffer, of each token in ``tokens`` (segment starts; every
    page up to token ``last`` holds one), bounds-checked. (For a component of one entry every
    few tokens, these are its entries, and the errors say so.)"""
    psize = buf.size("token")
    pages = _page_table(buf, placement, last, side, stride)[tokens // psize]
    _check_ids(pages, tokens, buf, side, stride)
    offsets: np.ndarray = pages * buf.stride("page") + (tokens % psize) * buf.stride("token")
    return offsets


def check_pages(
    buf: BufferLayout, placement: Placement, first: int, last: int, side: str, stride: int = 1
) -> None:
    """Bounds-check the ids of the pages holding tokens ``first`` to ``last`` (entries, for a
    component of one every few tokens), as :func:`page_offsets` would, without offsets."""
    psize = buf.size("token")
    pages = _page_table(buf, placement, last, side, stride)[first // psize : last // psize + 1]
    if pages.size and (int(pages.min()) < 0 or int(pages.max()) >= buf.size("page")):
        starts = np.arange(first // psize, last // psize + 1, dtype=np.int64) * psize
        _check_ids(pages, np.maximum(starts, first), buf, side, stride)


def _unit(stride: int) -> str:
    return "token" if stride == 1 else f"entry (one every {stride} tokens)"


def _page_table(
    buf: BufferLayout, placement: Placement, last: int, side: str, stride: int
) -> np.ndarray:
    """The placement's page ids of ``buf``'s group, or PlacementError if too few hold ``last``."""
    psize = buf.size("token")
    ids = placement.page_ids(buf.group)
    need = last // psize + 1
    if len(ids) < need:
        raise PlacementError(
            f"{side} page group {buf.group!r}: {_unit(stride)} {last} needs page "
            f"index {need - 1} (page size {psize}) but only {len(ids)} page ids "
            f"were given"
        )
    return ids


def _check_ids(
    pages: np.ndarray, tokens: np.ndarray, buf: BufferLayout, side: str, stride: int
) -> None:
    """PlacementError naming the first of ``pages`` (those of ``tokens``) not in the pool."""
    bad = (pages < 0) | (pages >= buf.size("page"))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        pid = int(pages[i])
        what = "is not allocated (-1)" if pid < 0 else f"is out of range [0, {buf.size('page')})"
        raise PlacementError(
            f"{side} page group {buf.group!r}: page id {pid} for {_unit(stride)} "
            f"{int(tokens[i])} {what}"
        )


def segments(
    src_map: TokenMap,
    dst_map: TokenMap,
    sb: BufferLayout,
    db: BufferLayout,
    src: Placement,
    dst: Placement,
    lo: int,
    hi: int,
    ks: int,
    kd: int,
    cache: SegCache,
    stride: int = 1,
) -> tuple[np.ndarray, ...] | None:
    """The tokens of ``[lo, hi)`` held by prefill shard ``ks`` (of ``src_map``) and decode
    shard ``kd`` (of ``dst_map``), split where a page ends on either side, then merged where
    neighbours continue with the token stride on both sides. Returns the start offsets (bytes
    relative to the buffer) on each side and the token count of each segment; None when there
    is no such token. (For a component of one entry every ``stride`` tokens, ``[lo, hi)`` and
    what the buffers' pages hold are its entries.)"""
    key = (sb.dims, sb.group, db.dims, db.group, lo, hi, ks, kd, stride)
    if key in cache:
        return cache[key]
    n = src.tokens // stride
    g, ls, ld, lens = shared_runs(src_map, ks, dst_map, kd, lo, hi, n)
    if not len(g):
        cache[key] = None
        return None
    ps, pd = sb.size("token"), db.size("token")
    if len(g) == 1:  # one run: its page ends on either side, as offsets into it
        cut_s = np.arange(ps - ls[0] % ps, lens[0], ps, dtype=np.int64)
        same = ps == pd and ls[0] % ps == ld[0] % pd  # the usual case: one set of cuts
        starts = (
            cut_s
            if same
            else np.union1d(cut_s, np.arange(pd - ld[0] % pd, lens[0], pd, dtype=np.int64))
        )
        starts = np.concatenate((np.zeros(1, dtype=np.int64), starts))
        seg_len = np.diff(np.append(starts, lens[0]))
        s_loc, d_loc = ls[0] + starts, ld[0] + starts
    else:
        rs, os_ = page_cuts(ls, lens, ps)
        rd, od = page_cuts(ld, lens, pd)
        cut = np.union1d(g, np.union1d(g[rs] + os_, g[rd] + od))
        run = np.searchsorted(g, cut, side="right") - 1
        end = np.minimum(np.append(cut[1:], hi), g[run] + lens[run])
        seg_len = end - cut
        s_loc, d_loc = ls[run] + cut - g[run], ld[run] + cut - g[run]
    last_s = int(s_loc[-1] + seg_len[-1] - 1)
    last_d = int(d_loc[-1] + seg_len[-1] - 1)
    s_off = page_offsets(sb, src, s_loc, last_s, "prefill", stride)
    d_off = page_offsets(db, dst, d_loc, last_d, "decode", stride)
    ts, td = sb.stride("token"), db.stride("token")
    if len(s_off) > 1:
        cont = (s_off[1:] == s_off[:-1] + seg_len[:-1] * ts) & (
            d_off[1:] == d_off[:-1] + seg_len[:-1] * td
        )
        keep = np.flatnonzero(np.concatenate(([True], ~cont)))
        seg_len = np.add.reduceat(seg_len, keep)
        s_off, d_off = s_off[keep], d_off[keep]
    out = (s_off, d_off, seg_len)
    cache[key] = out
    return out


def check_slot(placement: Placement, buf: BufferLayout, side: str) -> int:
    slot = placement.slot(buf.group)
    if not 0 <= slot < buf.size("slot"):
        raise PlacementError(
            f"{side} {buf.group} slot {slot} is out of range [0, {buf.size('slot')})"
        )
    return slot


def token_pieces(
    comp: Component, sb: BufferLayout, db: BufferLayout, bl: tuple[Block, ...]
) -> dict[tuple[int, int], tuple[tuple[int, int, int], ...]]:
    """Per (writer TP rank, reader TP rank): the (src, dst, nbytes) pieces of one token (or one
    state slot), relative to the item's start, in the order that lets them coalesce."""
    isz = comp.dtype.itemsize
    su, du = sb.dim("unit"), db.dim("unit")
    rs, rd = sb.stride("row"), db.stride("row")
    es, ed = sb.stride("elem"), db.stride("elem")
    out: dict[tuple[int, int], list[tuple[int, int, int]]] = defaultdict(list)
    for b in bl:
        ub = b.unit_size * isz
        if su is None and du is None and sb.contiguous_elems and db.contiguous_elems:
            runs = [(b.src_elem * isz, b.dst_elem * isz, b.units * ub)]
        elif sb.contiguous_elems and db.contiguous_elems:
            # one side strides between units (HND): one piece per unit
            runs = [
                (
                    (b.src_unit + i) * (su.stride if su else ub),
                    (b.dst_unit + i) * (du.stride if du else ub),
                    ub,
                )
                for i in range(b.units)
            ]
        else:  # a transposed side: one piece per element (they merge across tokens)
            runs = [
                (
                    _elem_at(sb, b.src_elem + e, b.unit_size, es),
                    _elem_at(db, b.dst_elem + e, b.unit_size, ed),
                    isz,
                )
                for e in range(b.units * b.unit_size)
            ]
        for row in range(comp.rows):
            out[(b.writer, b.reader)] += [(s + row * rs, d + row * rd, n) for s, d, n in runs]
    return {k: tuple(v) for k, v in out.items()}


def _elem_at(buf: BufferLayout, e: int, unit_size: int, stride: int) -> int:
    """Byte offset of local-axis element ``e`` within one token of ``buf``."""
    unit = buf.dim("unit")
    if unit is None:
        return e * stride
    return (e // unit_size) * unit.stride + (e % unit_size) * stride


def template(
    pieces: tuple[tuple[int, int, int], ...],
    segs: tuple[np.ndarray, ...] | None,
    sb: BufferLayout,
    db: BufferLayout,
) -> Runs:
    """Coalesced runs of one item relative to its buffer (regions 0): segment-major,
    piece-minor, so that neighbours merge."""
    p = np.array(pieces, dtype=np.int64)
    ps, pdst, pn = p[:, 0], p[:, 1], p[:, 2]
    if segs is None:  # a state slot: one flat run per piece
        # A conv state stored [dim, state_len] (DS) is planned one element at a time; in
        # source (or destination) order its pieces are adjacent again, or step evenly, and
        # merge into whole blocks or strided runs: whichever order gives fewer runs.
        z = np.zeros(len(p), dtype=np.int64)
        return min(
            (
                coalesce(Runs(z, ps[o], z, pdst[o], pn[o], z + 1, z, z))
                for o in (np.lexsort((pdst, ps)), np.lexsort((ps, pdst)))
            ),
            key=len,
        )
    s_off, d_off, lens = segs
    ts, td = sb.stride("token"), db.stride("token")
    src = np.add.outer(s_off, ps).ravel()
    dst = np.add.outer(d_off, pdst).ravel()
    seg_len = np.repeat(lens, len(p))
    piece = np.tile(pn, len(lens))
    # A piece that fills the whole token stride on both sides is contiguous across tokens.
    contiguous = (piece == ts) & (piece == td)
    nbytes = np.where(contiguous, piece * seg_len, piece)
    count = np.where(contiguous, 1, seg_len)
    s_stride = np.where(contiguous, 0, ts)
    d_stride = np.where(contiguous, 0, td)
    z = np.zeros(len(src), dtype=np.int64)
    return coalesce(Runs(z, src, z, dst, nbytes, count, s_stride, d_stride))


@dataclass(frozen=True, eq=False)
class Repeat:
    """A template repeated for each member layer (layer-major): the template's offsets
    shifted by each member's base, in each member's regions."""

    template: Runs
    src_reg: np.ndarray
    src_base: np.ndarray
    dst_reg: np.ndarray
    dst_base: np.ndarray

    def __len__(self) -> int:
        return len(self.template) * len(self.src_base)


def assemble(parts: list[Repeat]) -> Runs:
    """The runs of ``parts`` one after the other, coalesced. Each repeat is written straight
    into the result (a large plan's arrays are made once, not once a part and again joined);
    its blocks (a member each) are coalesced already, so only their junctions are looked at
    (:func:`~kvbridge.planner.runs.coalesce_blocks`)."""
    n = sum(len(p) for p in parts)
    out = [np.empty(n, dtype=np.int64) for _ in FIELDS]
    starts, at = [], 0
    for p in parts:
        t, m = p.template, len(p.src_base)
        k = len(t)
        block = [o[at : at + k * m].reshape(m, k) for o in out]
        block[0][:] = p.src_reg[:, None]
        np.add(p.src_base[:, None], t.src_offset[None, :], out=block[1])
        block[2][:] = p.dst_reg[:, None]
        np.add(p.dst_base[:, None], t.dst_offset[None, :], out=block[3])
        for o, f in zip(block[4:], FIELDS[4:], strict=True):
            o[:] = getattr(t, f)[None, :]
        starts.append(np.arange(at, at + k * m, max(k, 1), dtype=np.int64))
        at += k * m
    return coalesce_blocks(Runs(*out), np.concatenate(starts) if starts else np.zeros(0, np.int64))
