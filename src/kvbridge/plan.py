"""The planner: which bytes go from which prefill rank to which decode rank.

One pure, vectorised function of both sides (spec, parallel layout, memory layout) and the
request's placements. Every transport executes its output; no transport slices anything.

* :class:`Side` validates one side on its own; :class:`Pairing` validates the two together,
  once, when a decode side meets a prefill side (at registration).
* :meth:`Pairing.routes` says, for every (prefill rank, decode rank) pair, which parts the pair
  carries: KV, state, aux. It does not depend on the request, so both sides derive the same
  expected senders from it. A KV pair reports every chunk (even one that carries no bytes for a
  sliding-window layer), so a decode rank's KV from a sender is complete when the reported
  token ranges cover the request.
* :meth:`Pairing.plan` plans one chunk ``[start, stop)`` of a request. State and aux travel on
  the last chunk.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from kvbridge.errors import IncompatibleError, LayoutError, PlacementError
from kvbridge.layout import BufferLayout, SideMemory, check_buffer
from kvbridge.parallel import ParallelLayout
from kvbridge.placement import Placement
from kvbridge.runs import Runs, coalesce
from kvbridge.shard import Block, blocks, check_segment
from kvbridge.spec import CacheSpec, Component, Scope


class PartKind(enum.Enum):
    KV = "kv"
    STATE = "state"
    AUX = "aux"


@dataclass(frozen=True)
class Part:
    """What a pair delivers: KV of tokens ``[start, stop)``, or the state, or the aux slot."""

    kind: PartKind
    start: int = 0
    stop: int = 0

    def __post_init__(self) -> None:
        if self.kind is PartKind.KV and not 0 <= self.start < self.stop:
            raise ValueError(f"a KV part needs 0 <= start < stop, got [{self.start}, {self.stop})")
        if self.kind is not PartKind.KV and (self.start, self.stop) != (0, 0):
            raise ValueError(f"a {self.kind.value} part has no token range")

    def __str__(self) -> str:
        return f"kv[{self.start}:{self.stop}]" if self.kind is PartKind.KV else self.kind.value


@dataclass(frozen=True, eq=False)
class PairPlan:
    prefill_rank: int
    decode_rank: int
    parts: tuple[Part, ...]
    runs: Runs


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """The plan of one chunk. Run region indices point into ``src_regions``/``dst_regions``."""

    start: int
    stop: int
    last: bool
    src_regions: tuple[str, ...]
    dst_regions: tuple[str, ...]
    pairs: tuple[PairPlan, ...]

    @property
    def total_bytes(self) -> int:
        return sum(p.runs.total_bytes for p in self.pairs)

    @property
    def total_runs(self) -> int:
        return sum(len(p.runs) for p in self.pairs)

    def pair(self, prefill_rank: int, decode_rank: int) -> PairPlan | None:
        for p in self.pairs:
            if (p.prefill_rank, p.decode_rank) == (prefill_rank, decode_rank):
                return p
        return None


@dataclass(frozen=True)
class Side:
    """One side of a deployment. Validates that its memory can hold its spec at its layout."""

    spec: CacheSpec
    parallel: ParallelLayout
    memory: SideMemory

    def __post_init__(self) -> None:
        if self.parallel.num_layers != self.spec.num_layers:
            raise LayoutError(f"the PP stages cover {self.parallel.num_layers} layers; the model "
                              f"{self.spec.model!r} has {self.spec.num_layers}")
        for li, layer in enumerate(self.spec.layers):
            for comp in layer.components:
                where = f"layer {li} {comp.name}: "
                for seg in comp.segments:
                    check_segment(seg, self.parallel.tp, where)
                buf = self.memory.buffers.get((li, comp.name))
                if buf is None:
                    raise LayoutError(f"{where}no buffer in the memory layout")
                check_buffer(buf, comp, self.parallel.tp, where.rstrip(": "))
        aux = self.memory.aux
        if aux.dim("slot") is None or aux.size("elem") * aux.stride("elem") != self.spec.aux_bytes:
            raise LayoutError(f"aux buffer must be [slot, elem] with {self.spec.aux_bytes} bytes "
                              f"a slot, got dims {aux.dims}")


@dataclass(frozen=True)
class _Item:
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
    # (writer TP rank, reader TP rank) -> (src, dst, nbytes) pieces of one token or state slot
    pieces: dict[tuple[int, int], tuple[tuple[int, int, int], ...]] = field(repr=False, hash=False)


class Pairing:
    """A prefill side and a decode side that have been checked to fit together."""

    def __init__(self, prefill: Side, decode: Side) -> None:
        diff = prefill.spec.describe_difference(decode.spec)
        if diff is not None:
            raise IncompatibleError(f"prefill and decode caches differ: {diff}")
        self.prefill, self.decode = prefill, decode
        self.spec = prefill.spec
        pp, dp = prefill.parallel, decode.parallel
        self.src_regions = tuple(r.name for r in prefill.memory.regions)
        self.dst_regions = tuple(r.name for r in decode.memory.regions)
        src_idx = {n: i for i, n in enumerate(self.src_regions)}
        dst_idx = {n: i for i, n in enumerate(self.dst_regions)}
        self._aux_regions = (src_idx[prefill.memory.aux.region], dst_idx[decode.memory.aux.region])

        items: list[_Item] = []
        routes: dict[tuple[int, int], set[PartKind]] = defaultdict(set)
        carried: dict[tuple[int, int], dict[tuple[str, str], set[int]]] = defaultdict(
            lambda: defaultdict(set))
        for li, layer in enumerate(self.spec.layers):
            s_stage, d_stage = pp.stage_of_layer(li), dp.stage_of_layer(li)
            for comp in layer.components:
                sb = prefill.memory.buffers[(li, comp.name)]
                db = decode.memory.buffers[(li, comp.name)]
                bl = blocks(comp.segments, pp.tp, dp.tp, li % pp.tp)
                items.append(_Item(li, comp, s_stage, d_stage, sb, db, src_idx[sb.region],
                                   dst_idx[db.region], layer.window, _pieces(comp, sb, db, bl)))
                kind = PartKind.KV if comp.scope is Scope.TOKEN else PartKind.STATE
                for b in bl:
                    pair = (pp.engine_rank(s_stage, b.writer), dp.engine_rank(d_stage, b.reader))
                    routes[pair].add(kind)
                    carried[pair][("layers", "")].add(li)
                    carried[pair][(comp.name, b.segment)].update(range(b.unit, b.unit + b.units))
        for d in range(dp.world):
            routes[(self.aux_writer(d), d)].add(PartKind.AUX)
        self._items = tuple(items)
        self._routes = {k: frozenset(v) for k, v in sorted(routes.items())}
        self._carried = {pair: {k: frozenset(v) for k, v in c.items()}
                         for pair, c in carried.items()}

    # ---- routing: what completion waits for ----------------------------------------------

    def aux_writer(self, decode_rank: int) -> int:
        """The prefill rank that writes a decode rank's aux slot: one of the last PP stage (it
        holds the sampled token), spread over its TP ranks."""
        pp = self.prefill.parallel
        return pp.engine_rank(pp.pp - 1, decode_rank % pp.tp)

    @property
    def routes(self) -> dict[tuple[int, int], frozenset[PartKind]]:
        """``{(prefill_rank, decode_rank): parts}`` for every pair that carries anything."""
        return dict(self._routes)

    def carried(self, prefill_rank: int, decode_rank: int) -> dict[tuple[str, str], frozenset[int]]:
        """What a pair carries, for people: ``("layers", "")`` -> layer indices, and
        ``(component, segment)`` -> the global units (heads, groups...) it carries."""
        return dict(self._carried.get((prefill_rank, decode_rank), {}))

    def senders_of(self, decode_rank: int) -> dict[int, frozenset[PartKind]]:
        """The prefill ranks a decode rank must hear from, and what each owes it."""
        return {p: k for (p, d), k in self._routes.items() if d == decode_rank}

    def receivers_of(self, prefill_rank: int) -> dict[int, frozenset[PartKind]]:
        """The decode ranks a prefill rank must serve, and what it owes each."""
        return {d: k for (p, d), k in self._routes.items() if p == prefill_rank}

    def check_placement(self, placement: Placement, side: str) -> None:
        """Bounds-check a whole request's placement on ``side`` ("prefill" or "decode")
        before anything is planned: every needed page id in its pool, every slot in range."""
        if side not in ("prefill", "decode"):
            raise ValueError(f"side must be 'prefill' or 'decode', got {side!r}")
        mem = (self.prefill if side == "prefill" else self.decode).memory
        n = placement.tokens
        seen: set[tuple[object, ...]] = set()
        for it in self._items:
            buf = it.src if side == "prefill" else it.dst
            if it.comp.scope is Scope.STATE:
                _check_slot(placement, buf, side)
                continue
            lo = 0 if it.window is None else max(0, n - it.window)
            key = (buf.group, buf.size("token"), buf.size("page"), lo)
            if key not in seen:
                seen.add(key)
                ps = buf.size("token")
                starts = np.arange(lo - lo % ps, n, ps, dtype=np.int64)
                starts[0] = lo
                _page_offsets(buf, placement, starts, n - 1, side)
        _check_slot(placement, mem.aux, side)

    # ---- planning -------------------------------------------------------------------------

    def plan(self, src: Placement, dst: Placement, start: int = 0, stop: int | None = None, *,
             last: bool | None = None, prefill_rank: int | None = None,
             decode_rank: int | None = None) -> TransferPlan:
        """Plan tokens ``[start, stop)`` of a request (the whole request by default).

        ``last`` defaults to ``stop == tokens``; state and aux travel with the last chunk.
        ``prefill_rank``/``decode_rank`` restrict the plan to the pairs of one rank.
        """
        n = src.tokens
        if dst.tokens != n:
            raise PlacementError(f"prefill placement has {n} tokens, decode placement has "
                                 f"{dst.tokens}: they must describe the same request")
        stop = n if stop is None else stop
        if not 0 <= start < stop <= n:
            raise PlacementError(f"chunk [{start}, {stop}) is not a non-empty range inside the "
                                 f"request's {n} tokens")
        last = (stop == n) if last is None else last
        if last and stop != n:
            raise PlacementError(f"the last chunk must end at the request's end ({n}), "
                                 f"got stop={stop}")
        pp, dp = self.prefill.parallel, self.decode.parallel
        if prefill_rank is not None:
            pp.split_rank(prefill_rank)
        if decode_rank is not None:
            dp.split_rank(decode_rank)

        def wanted(p: int, d: int) -> bool:
            return (prefill_rank is None or p == prefill_rank) and \
                   (decode_rank is None or d == decode_rank)

        # Group items that plan identically (same shapes, strides, window and spread) so the
        # template of runs is computed once and broadcast over their layers.
        groups: dict[tuple[object, ...], list[_Item]] = defaultdict(list)
        for it in self._items:
            if it.comp.scope is Scope.STATE and not last:
                continue
            lo, hi = start, stop
            if it.window is not None:
                lo = max(lo, n - it.window)
            if it.comp.scope is Scope.TOKEN and lo >= hi:
                continue
            key = (it.comp, it.src.dims, it.src.group, it.dst.dims, it.dst.group,
                   it.layer % pp.tp, it.src_stage, it.dst_stage, lo, hi)
            groups[key].append(it)

        per_pair: dict[tuple[int, int], list[Runs]] = defaultdict(list)
        seg_cache: dict[tuple[object, ...], tuple[np.ndarray, ...]] = {}
        tmpl_cache: dict[tuple[object, ...], Runs] = {}
        for group_key, members in groups.items():
            first = members[0]
            lo, hi = cast(int, group_key[-2]), cast(int, group_key[-1])
            if first.comp.scope is Scope.TOKEN:
                segs = self._segments(first.src, first.dst, src, dst, lo, hi, seg_cache)
                src_base = np.array([m.src.offset for m in members], dtype=np.int64)
                dst_base = np.array([m.dst.offset for m in members], dtype=np.int64)
            else:
                s_slot = _check_slot(src, first.src, "prefill")
                d_slot = _check_slot(dst, first.dst, "decode")
                segs = None
                src_base = np.array([m.src.offset + s_slot * m.src.stride("slot")
                                     for m in members], dtype=np.int64)
                dst_base = np.array([m.dst.offset + d_slot * m.dst.stride("slot")
                                     for m in members], dtype=np.int64)
            src_reg = np.array([m.src_region for m in members], dtype=np.int64)
            dst_reg = np.array([m.dst_region for m in members], dtype=np.int64)
            for (w, r), pieces in first.pieces.items():
                p = pp.engine_rank(first.src_stage, w)
                d = dp.engine_rank(first.dst_stage, r)
                if not wanted(p, d):
                    continue
                # K and V (and layers of another spread) often share a template.
                tkey = (pieces, first.src.dims, first.dst.dims, id(segs))
                tmpl = tmpl_cache.get(tkey)
                if tmpl is None:
                    tmpl = tmpl_cache[tkey] = _template(pieces, segs, first.src, first.dst)
                per_pair[(p, d)].append(_broadcast(tmpl, src_reg, src_base, dst_reg, dst_base))

        if last:
            aux_src = _check_slot(src, self.prefill.memory.aux, "prefill")
            aux_dst = _check_slot(dst, self.decode.memory.aux, "decode")
            sa, da = self.prefill.memory.aux, self.decode.memory.aux
            for d in range(dp.world):
                p = self.aux_writer(d)
                if wanted(p, d):
                    one = np.ones(1, dtype=np.int64)
                    per_pair[(p, d)].append(Runs(
                        one * self._aux_regions[0], one * (sa.offset + aux_src * sa.stride("slot")),
                        one * self._aux_regions[1], one * (da.offset + aux_dst * da.stride("slot")),
                        one * self.spec.aux_bytes, one, one * 0, one * 0))

        pairs = []
        for (p, d), kinds in self._routes.items():
            if not wanted(p, d):
                continue
            parts = []
            if PartKind.KV in kinds:
                parts.append(Part(PartKind.KV, start, stop))
            if last:
                parts += [Part(k) for k in (PartKind.STATE, PartKind.AUX) if k in kinds]
            if parts:
                pairs.append(PairPlan(p, d, tuple(parts), coalesce(Runs.concat(per_pair[(p, d)]))))
        return TransferPlan(start, stop, last, self.src_regions, self.dst_regions, tuple(pairs))

    def _segments(self, sb: BufferLayout, db: BufferLayout, src: Placement, dst: Placement,
                  lo: int, hi: int, cache: dict[tuple[object, ...], tuple[np.ndarray, ...]]
                  ) -> tuple[np.ndarray, ...]:
        """Split tokens ``[lo, hi)`` where a page ends on either side, then merge neighbours
        that continue with the token stride on both sides. Returns the start offsets (bytes
        relative to the buffer) on each side and the token count of each segment."""
        key = (sb.dims, sb.group, db.dims, db.group, lo, hi)
        hit = cache.get(key)
        if hit is not None:
            return hit
        ps, pd = sb.size("token"), db.size("token")
        starts = np.union1d(np.arange((lo // ps + 1) * ps, hi, ps, dtype=np.int64),
                            np.arange((lo // pd + 1) * pd, hi, pd, dtype=np.int64))
        starts = np.concatenate((np.array([lo], dtype=np.int64), starts))
        lens = np.diff(np.append(starts, hi))
        s_off = _page_offsets(sb, src, starts, hi - 1, "prefill")
        d_off = _page_offsets(db, dst, starts, hi - 1, "decode")
        ts, td = sb.stride("token"), db.stride("token")
        if len(starts) > 1:
            cont = (s_off[1:] == s_off[:-1] + lens[:-1] * ts) & \
                   (d_off[1:] == d_off[:-1] + lens[:-1] * td)
            keep = np.flatnonzero(np.concatenate(([True], ~cont)))
            lens = np.add.reduceat(lens, keep)
            s_off, d_off = s_off[keep], d_off[keep]
        out = (s_off, d_off, lens)
        cache[key] = out
        return out


def _page_offsets(buf: BufferLayout, placement: Placement, tokens: np.ndarray, last: int,
                  side: str) -> np.ndarray:
    """Byte offset, relative to the buffer, of each token in ``tokens`` (segment starts; every
    page up to token ``last`` holds one), bounds-checked."""
    psize = buf.size("token")
    ids = placement.page_ids(buf.group)
    need = last // psize + 1
    if len(ids) < need:
        raise PlacementError(f"{side} page group {buf.group!r}: token {last} needs page "
                             f"index {need - 1} (page size {psize}) but only {len(ids)} page ids "
                             f"were given")
    pages = ids[tokens // psize]
    bad = (pages < 0) | (pages >= buf.size("page"))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        pid = int(pages[i])
        what = "is not allocated (-1)" if pid < 0 else \
            f"is out of range [0, {buf.size('page')})"
        raise PlacementError(f"{side} page group {buf.group!r}: page id {pid} for token "
                             f"{int(tokens[i])} {what}")
    offsets: np.ndarray = pages * buf.stride("page") + (tokens % psize) * buf.stride("token")
    return offsets


def _check_slot(placement: Placement, buf: BufferLayout, side: str) -> int:
    slot = placement.slot(buf.group)
    if not 0 <= slot < buf.size("slot"):
        raise PlacementError(f"{side} {buf.group} slot {slot} is out of range "
                             f"[0, {buf.size('slot')})")
    return slot


def _pieces(comp: Component, sb: BufferLayout, db: BufferLayout, bl: tuple[Block, ...]
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
            runs = [((b.src_unit + i) * (su.stride if su else ub),
                     (b.dst_unit + i) * (du.stride if du else ub), ub) for i in range(b.units)]
        else:  # a transposed side: one piece per element (they merge across tokens)
            runs = [(_elem_at(sb, b.src_elem + e, b.unit_size, es),
                     _elem_at(db, b.dst_elem + e, b.unit_size, ed), isz)
                    for e in range(b.units * b.unit_size)]
        for row in range(comp.rows):
            out[(b.writer, b.reader)] += [(s + row * rs, d + row * rd, n) for s, d, n in runs]
    return {k: tuple(v) for k, v in out.items()}


def _elem_at(buf: BufferLayout, e: int, unit_size: int, stride: int) -> int:
    """Byte offset of local-axis element ``e`` within one token of ``buf``."""
    unit = buf.dim("unit")
    if unit is None:
        return e * stride
    return (e // unit_size) * unit.stride + (e % unit_size) * stride


def _template(pieces: tuple[tuple[int, int, int], ...], segs: tuple[np.ndarray, ...] | None,
              sb: BufferLayout, db: BufferLayout) -> Runs:
    """Coalesced runs of one item relative to its buffer (regions 0): segment-major,
    piece-minor, so that neighbours merge."""
    p = np.array(pieces, dtype=np.int64)
    ps, pdst, pn = p[:, 0], p[:, 1], p[:, 2]
    if segs is None:  # a state slot: one flat run per piece
        # A conv state stored [dim, state_len] (DS) is planned one element at a time; in
        # source (or destination) order its pieces are adjacent again, or step evenly, and
        # merge into whole blocks or strided runs: whichever order gives fewer runs.
        z = np.zeros(len(p), dtype=np.int64)
        return min((coalesce(Runs(z, ps[o], z, pdst[o], pn[o], z + 1, z, z))
                    for o in (np.lexsort((pdst, ps)), np.lexsort((ps, pdst)))), key=len)
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


def _broadcast(t: Runs, src_reg: np.ndarray, src_base: np.ndarray, dst_reg: np.ndarray,
               dst_base: np.ndarray) -> Runs:
    """The template repeated for each member layer (layer-major)."""
    k, m = len(t), len(src_base)
    return Runs(np.repeat(src_reg, k), np.add.outer(src_base, t.src_offset).ravel(),
                np.repeat(dst_reg, k), np.add.outer(dst_base, t.dst_offset).ravel(),
                np.tile(t.nbytes, m), np.tile(t.count, m), np.tile(t.src_stride, m),
                np.tile(t.dst_stride, m))


def plan(prefill: Side, decode: Side, src: Placement, dst: Placement, start: int = 0,
         stop: int | None = None, *, last: bool | None = None) -> TransferPlan:
    """Plan one chunk between two sides (a one-shot :class:`Pairing`)."""
    return Pairing(prefill, decode).plan(src, dst, start, stop, last=last)

