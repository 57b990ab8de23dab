"""The planner: which bytes go from which prefill rank to which decode rank.

One pure, vectorised function of both sides (spec, parallel layout, memory layout) and the
request's placements. Every transport executes its output; no transport slices anything.

* :class:`Side` (:mod:`kvbridge.planner.side`) validates one side on its own; :class:`Pairing`
  validates the two together, once, when a decode side meets a prefill side (at registration),
  and finds what it plans over (:mod:`kvbridge.planner.pairitems`).
* :meth:`Pairing.routes` says, for every (prefill rank, decode rank) pair, which parts the pair
  carries: KV, state, aux. It depends on the request only through its length, and only where
  the prefill side is context parallel (the CP group holding the last token has the state and
  the sampled token), so both sides derive the same expected senders from it. A KV pair
  reports every chunk (even one that carries no bytes: a sliding-window layer's early tokens,
  or tokens held by another context-parallel shard), so a decode rank's KV from a sender is
  complete when the reported token ranges cover the request.
* :meth:`Pairing.plan` plans one chunk ``[start, stop)`` of a request. State and aux travel on
  the last chunk.

A placement describes a request on one token shard (:mod:`kvbridge.planner.tokenmap`): its page
tables index the shard's own tokens. Where a side is context parallel, :meth:`Pairing.plan`
takes one placement per shard, or one that every shard shares (vLLM's block tables are the
same on every DCP rank).

A decode placement whose ``start`` is past 0 holds the tokens before it already (a prefix-cache
hit): the planner moves only tokens ``[start, stop)`` and never touches its pages before them.
Chunks before the start still pair up and report (without bytes), as a window's early tokens do.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict

import numpy as np

from kvbridge.errors import IncompatibleError, PlacementError
from kvbridge.model.spec import Scope
from kvbridge.planner.pairitems import Item, pair_items, placement_checks
from kvbridge.planner.pieces import (
    Repeat,
    SegCache,
    assemble,
    check_pages,
    check_slot,
    segments,
    template,
)
from kvbridge.planner.placement import Placement, Placements, common_start, per_shard
from kvbridge.planner.runs import Runs
from kvbridge.planner.side import Side
from kvbridge.planner.tokenmap import co_shards
from kvbridge.planner.transferplan import PairPlan, Part, PartKind, TransferPlan

__all__ = ["Pairing", "Placements", "Side", "plan"]  # Side and Placements: re-exported

_TmplCache = dict[tuple[object, ...], Runs]
_SIDES = ("prefill", "decode")


class Pairing:
    """A prefill side and a decode side that have been checked to fit together."""

    def __init__(self, prefill: Side, decode: Side) -> None:
        diff = prefill.spec.describe_difference(decode.spec)
        if diff is not None:
            raise IncompatibleError(f"prefill and decode caches differ: {diff}")
        self.prefill, self.decode = prefill, decode
        self.spec = prefill.spec
        self.src_regions = tuple(r.name for r in prefill.memory.regions)
        self.dst_regions = tuple(r.name for r in decode.memory.regions)
        src_idx = {n: i for i, n in enumerate(self.src_regions)}
        dst_idx = {n: i for i, n in enumerate(self.dst_regions)}
        self._aux_regions = (src_idx[prefill.memory.aux.region], dst_idx[decode.memory.aux.region])
        z = np.zeros(1, dtype=np.int64)  # the aux slot's one run, relative to the slots
        self._aux_run = Runs(z, z, z, z, z + self.spec.aux_bytes, z + 1, z, z)

        found = pair_items(prefill, decode, src_idx, dst_idx)
        self._items = found.items
        strided = sorted({it.comp.name for it in found.items if it.comp.stride > 1})
        cp = (prefill.parallel.tokens, decode.parallel.tokens)
        if strided and not all(m.trivial for m in cp):
            raise IncompatibleError(
                f"components {strided} keep one entry every few tokens, which a context-parallel "
                f"side ({prefill.parallel.describe()} -> {decode.parallel.describe()}) would "
                f"split between shards in no way the planner describes"
            )
        # Items that plan alike (same component, shapes, strides, spread and stages) share a
        # number: a plan groups them by it and the chunk's tokens, never hashing the layouts.
        alike: dict[tuple[object, ...], int] = {}
        self._alike = tuple(
            alike.setdefault(
                (
                    it.comp,
                    it.src.dims,
                    it.src.group,
                    it.dst.dims,
                    it.dst.group,
                    it.layer % prefill.parallel.tp,
                    it.src_stage,
                    it.dst_stage,
                ),
                len(alike),
            )
            for it in self._items
        )
        self._kv_links = found.kv_links
        self._state_links = found.state_links
        self._carried = found.carried
        # Per request only what its placement changes is checked and derived: the layouts'
        # checks (a model's layers mostly share one pool layout) and each prefill rank's
        # layers are found here, once (a decode engine's scheduler pays for each request).
        self._checks = {side: placement_checks(self._items, side == "prefill") for side in _SIDES}
        self._stage_layers = tuple(self._layers_reported(r) for r in range(prefill.parallel.world))
        self._route_cache: dict[tuple[bytes, int], dict[tuple[int, int], frozenset[PartKind]]] = {}
        self._memo: weakref.WeakKeyDictionary[
            Placement, weakref.WeakKeyDictionary[Placement, tuple[SegCache, _TmplCache]]
        ] = weakref.WeakKeyDictionary()
        self._memo_lock = threading.Lock()

    # ---- routing: what completion waits for ----------------------------------------------

    def stage_layers(self, prefill_rank: int) -> tuple[frozenset[int], frozenset[int]]:
        """The layers a prefill rank reports: those of its PP stage with per-token components
        (KV), and those with state."""
        if not 0 <= prefill_rank < len(self._stage_layers):
            self.prefill.parallel.coords(prefill_rank)  # raises, saying the range
        return self._stage_layers[prefill_rank]

    def _layers_reported(self, prefill_rank: int) -> tuple[frozenset[int], frozenset[int]]:
        mine = self.prefill.parallel.layers_of(prefill_rank)
        return (
            frozenset(li for li in mine if self.spec.layers[li].per_token),
            frozenset(li for li in mine if self.spec.layers[li].stateful),
        )

    def _context(self, tokens: int | None) -> tuple[np.ndarray, int]:
        """Which prefill and decode token shards share tokens, and the prefill CP group
        holding the last token (its state and sampled token), for a request of ``tokens``."""
        pp, dp = self.prefill.parallel, self.decode.parallel
        if pp.tokens.trivial and dp.tokens.trivial:
            return np.ones((1, 1), dtype=bool), 0
        if tokens is None:
            raise ValueError(
                f"a context-parallel side ({pp.describe()} -> {dp.describe()}): "
                f"which ranks exchange what depends on the request's length; "
                f"pass tokens"
            )
        return co_shards(pp.tokens, dp.tokens, tokens), pp.state_group(tokens)

    def _aux_writer(self, decode_rank: int, group: int) -> int:
        pp = self.prefill.parallel
        return pp.engine_rank(pp.pp - 1, decode_rank % pp.tp, group)

    def aux_writer(self, decode_rank: int, tokens: int | None = None) -> int:
        """The prefill rank that writes a decode rank's aux slot: one of the last PP stage (it
        holds the sampled token) and of the CP group holding the last token, spread over its
        TP ranks."""
        return self._aux_writer(decode_rank, self._context(tokens)[1])

    def routes(self, tokens: int | None = None) -> dict[tuple[int, int], frozenset[PartKind]]:
        """``{(prefill_rank, decode_rank): parts}`` for every pair that carries anything, for
        a request of ``tokens`` tokens (needed only where a side is context parallel: then the
        request's length decides which shards share tokens and which CP group has the state).
        A KV pair is owed every chunk, even where the request's window leaves it no bytes."""
        co, holder = self._context(tokens)
        key = (np.packbits(co).tobytes(), holder)
        hit = self._route_cache.get(key)
        if hit is not None:
            return dict(hit)
        pp, dp = self.prefill.parallel, self.decode.parallel
        out: dict[tuple[int, int], set[PartKind]] = defaultdict(set)
        for ks, kd in zip(*np.nonzero(co), strict=True):
            cs, js = divmod(int(ks), pp.dcp)
            cd, jd = divmod(int(kd), dp.dcp)
            for s_stage, w, d_stage, r in self._kv_links.get((js, jd), ()):
                out[(pp.engine_rank(s_stage, w, cs), dp.engine_rank(d_stage, r, cd))].add(
                    PartKind.KV
                )
        for s_stage, w, d_stage, r in self._state_links:
            for cd in range(dp.cp):
                out[(pp.engine_rank(s_stage, w, holder), dp.engine_rank(d_stage, r, cd))].add(
                    PartKind.STATE
                )
        for d in range(dp.world):
            out[(self._aux_writer(d, holder), d)].add(PartKind.AUX)
        routes = {k: frozenset(v) for k, v in sorted(out.items())}
        if len(self._route_cache) < 1024:
            self._route_cache[key] = routes
        return dict(routes)

    def carried(self, prefill_rank: int, decode_rank: int) -> dict[tuple[str, str], frozenset[int]]:
        """What a pair carries, for people: ``("layers", "")`` -> layer indices, and
        ``(component, segment)`` -> the global units (heads, groups...) it carries, of the
        tokens (and state) the two ranks share."""
        ps, _, w = self.prefill.parallel.coords(prefill_rank)
        ds, _, r = self.decode.parallel.coords(decode_rank)
        return dict(self._carried.get((ps, w, ds, r), {}))

    def senders_of(
        self, decode_rank: int, tokens: int | None = None
    ) -> dict[int, frozenset[PartKind]]:
        """The prefill ranks a decode rank must hear from, and what each owes it."""
        return {p: k for (p, d), k in self.routes(tokens).items() if d == decode_rank}

    def receivers_of(
        self, prefill_rank: int, tokens: int | None = None
    ) -> dict[int, frozenset[PartKind]]:
        """The decode ranks a prefill rank must serve, and what it owes each."""
        return {d: k for (p, d), k in self.routes(tokens).items() if p == prefill_rank}

    def check_placement(self, placement: Placement, side: str, rank: int | None = None) -> None:
        """Bounds-check a request's placement on ``side`` ("prefill" or "decode") before
        anything is planned: every needed page id in its pool (from the placement's start),
        every slot in range. ``rank``:
        the placement is that rank's (its token shard's tokens); None: every shard's."""
        if side not in _SIDES:
            raise ValueError(f"side must be 'prefill' or 'decode', got {side!r}")
        me = self.prefill if side == "prefill" else self.decode
        par, mem = me.parallel, me.memory
        shards = range(par.tokens.shards) if rank is None else (par.shard_of(rank),)
        n = placement.tokens
        paged, slotted = self._checks[side]
        for buf in slotted:
            check_slot(placement, buf, side)
        for c in paged:
            lo = placement.start if c.window is None else max(placement.start, n - c.window)
            lo, hi = c.comp.entries(lo, n)
            for k in shards:
                _, local, lens = par.tokens.runs(k, lo, hi, hi)
                if len(local):  # every page from the shard's first token to its last
                    last = int(local[-1] + lens[-1] - 1)
                    check_pages(c.buf, placement, int(local[0]), last, side, c.comp.stride)
        check_slot(placement, mem.aux, side)

    # ---- planning -------------------------------------------------------------------------

    def plan(
        self,
        src: Placements,
        dst: Placements,
        start: int = 0,
        stop: int | None = None,
        *,
        last: bool | None = None,
        prefill_rank: int | None = None,
        decode_rank: int | None = None,
        layers: range | None = None,
        aux: bool = True,
    ) -> TransferPlan:
        """Plan tokens ``[start, stop)`` of a request (the whole request by default).

        ``last`` defaults to ``stop == tokens``; state and aux travel with the last chunk.
        ``prefill_rank``/``decode_rank`` restrict the plan to the pairs of one rank; then a
        single placement is that rank's. ``layers`` restricts it to those layers (a layer-wise
        send: the layers a prefill forward has computed so far); ``aux``: whether the aux slot
        travels with it (on the last chunk, with the send that completes it).
        """
        if layers is not None and (
            layers.step != 1 or not 0 <= layers.start < layers.stop <= self.spec.num_layers
        ):
            raise PlacementError(
                f"layers must be a non-empty range of step 1 within the "
                f"model's {self.spec.num_layers} layers, got {layers}"
            )
        pp, dp = self.prefill.parallel, self.decode.parallel
        src_of = per_shard(src, pp.tokens.shards, "prefill")
        dst_of = per_shard(dst, dp.tokens.shards, "decode")
        n = src_of(0).tokens
        for k in range(dp.tokens.shards):
            if dst_of(k).tokens != n:
                raise PlacementError(
                    f"prefill placement has {n} tokens, decode placement has "
                    f"{dst_of(k).tokens}: they must describe the same request"
                )
        stop = n if stop is None else stop
        if not 0 <= start < stop <= n:
            raise PlacementError(
                f"chunk [{start}, {stop}) is not a non-empty range inside the request's {n} tokens"
            )
        # Tokens before the decode side's start are held there already (a prefix hit).
        held = common_start(dst_of, dp.tokens.shards, "decode")
        have = common_start(src_of, pp.tokens.shards, "prefill")
        if have > held:
            raise PlacementError(
                f"the prefill placement starts at token {have}, after the "
                f"decode placement's start {held}: tokens [{held}, {have}) "
                f"are on neither side"
            )
        last = (stop == n) if last is None else last
        if last and stop != n:
            raise PlacementError(
                f"the last chunk must end at the request's end ({n}), got stop={stop}"
            )
        routes = self.routes(n)
        holder = self._context(n)[1]
        src_shards = range(pp.tokens.shards)
        dst_shards = range(dp.tokens.shards)
        if prefill_rank is not None:
            src_shards = range(pp.shard_of(prefill_rank), pp.shard_of(prefill_rank) + 1)
        if decode_rank is not None:
            dst_shards = range(dp.shard_of(decode_rank), dp.shard_of(decode_rank) + 1)

        def wanted(p: int, d: int) -> bool:
            return (prefill_rank is None or p == prefill_rank) and (
                decode_rank is None or d == decode_rank
            )

        # Group items that plan identically (same shapes, strides, window and spread) so the
        # template of runs is computed once and broadcast over their layers.
        groups: dict[tuple[int, int, int], list[Item]] = defaultdict(list)
        for it, alike in zip(self._items, self._alike, strict=True):
            if it.comp.scope is Scope.STATE and not last:
                continue
            if layers is not None and it.layer not in layers:
                continue
            lo, hi = max(start, held), stop
            if it.window is not None:
                lo = max(lo, n - it.window)
            lo, hi = it.comp.entries(lo, hi)  # (the tokens, for one entry a token)
            if it.comp.scope is Scope.TOKEN and lo >= hi:
                continue
            groups[(alike, lo, hi)].append(it)

        per_pair: dict[tuple[int, int], list[Repeat]] = defaultdict(list)
        seg_cache, tmpl_cache = self._caches(src, dst)

        def emit(
            members: list[Item],
            p: int,
            d: int,
            pieces: tuple[tuple[int, int, int], ...],
            segs: tuple[np.ndarray, ...] | None,
            src_base: np.ndarray,
            dst_base: np.ndarray,
        ) -> None:
            first = members[0]
            # K and V (and layers of another spread) often share a template.
            tkey = (pieces, first.src.dims, first.dst.dims, id(segs))
            tmpl = tmpl_cache.get(tkey)
            if tmpl is None:
                tmpl = tmpl_cache[tkey] = template(pieces, segs, first.src, first.dst)
            per_pair[(p, d)].append(
                Repeat(
                    tmpl,
                    np.array([m.src_region for m in members], dtype=np.int64),
                    src_base,
                    np.array([m.dst_region for m in members], dtype=np.int64),
                    dst_base,
                )
            )

        for group_key, members in groups.items():
            first = members[0]
            _, lo, hi = group_key
            if first.comp.scope is Scope.TOKEN:
                src_base = np.array([m.src.offset for m in members], dtype=np.int64)
                dst_base = np.array([m.dst.offset for m in members], dtype=np.int64)
                for ks in src_shards:
                    cs, js = divmod(ks, pp.dcp)
                    for kd in dst_shards:
                        cd, jd = divmod(kd, dp.dcp)
                        segs = segments(
                            pp.tokens,
                            dp.tokens,
                            first.src,
                            first.dst,
                            src_of(ks),
                            dst_of(kd),
                            lo,
                            hi,
                            ks,
                            kd,
                            seg_cache,
                            first.comp.stride,
                        )
                        if segs is None:
                            continue  # no token of [lo, hi) on both shards
                        for (w, r), pieces in first.pieces[js].items():
                            if r % dp.dcp != jd:
                                continue
                            p = pp.engine_rank(first.src_stage, w, cs)
                            d = dp.engine_rank(first.dst_stage, r, cd)
                            if wanted(p, d):
                                emit(members, p, d, pieces, segs, src_base, dst_base)
                continue
            for (w, r), pieces in first.pieces[0].items():
                p = pp.engine_rank(first.src_stage, w, holder)
                for cd in range(dp.cp):
                    d = dp.engine_rank(first.dst_stage, r, cd)
                    if not wanted(p, d):
                        continue
                    s_slot = check_slot(src_of(pp.shard_of(p)), first.src, "prefill")
                    d_slot = check_slot(dst_of(dp.shard_of(d)), first.dst, "decode")
                    emit(
                        members,
                        p,
                        d,
                        pieces,
                        None,
                        np.array(
                            [m.src.offset + s_slot * m.src.stride("slot") for m in members],
                            dtype=np.int64,
                        ),
                        np.array(
                            [m.dst.offset + d_slot * m.dst.stride("slot") for m in members],
                            dtype=np.int64,
                        ),
                    )

        if last and aux:
            sa, da = self.prefill.memory.aux, self.decode.memory.aux
            for d in range(dp.world):
                p = self._aux_writer(d, holder)
                if wanted(p, d):
                    aux_src = check_slot(src_of(pp.shard_of(p)), sa, "prefill")
                    aux_dst = check_slot(dst_of(dp.shard_of(d)), da, "decode")
                    per_pair[(p, d)].append(
                        Repeat(
                            self._aux_run,
                            np.array([self._aux_regions[0]], dtype=np.int64),
                            np.array([sa.offset + aux_src * sa.stride("slot")], dtype=np.int64),
                            np.array([self._aux_regions[1]], dtype=np.int64),
                            np.array([da.offset + aux_dst * da.stride("slot")], dtype=np.int64),
                        )
                    )

        pairs = []
        for (p, d), kinds in routes.items():
            if not wanted(p, d):
                continue
            parts = []
            if PartKind.KV in kinds:
                parts.append(Part(PartKind.KV, start, stop))
            if last:
                parts += [
                    Part(k)
                    for k in (PartKind.STATE, PartKind.AUX)
                    if k in kinds and (aux or k is not PartKind.AUX)
                ]
            if parts:
                pairs.append(PairPlan(p, d, tuple(parts), assemble(per_pair[(p, d)])))
        return TransferPlan(start, stop, last, self.src_regions, self.dst_regions, tuple(pairs))

    def _caches(self, src: Placements, dst: Placements) -> tuple[SegCache, _TmplCache]:
        """Where a plan keeps the token segments and run templates it computed. They depend
        only on the two placements (and keys): a layer-wise prefill plans the same chunk once
        per layer group, so they are kept for as long as both placements live."""
        if not (isinstance(src, Placement) and isinstance(dst, Placement)):
            return {}, {}
        with self._memo_lock:
            per_src = self._memo.setdefault(src, weakref.WeakKeyDictionary())
            got = per_src.get(dst)
            if got is None:
                got = per_src[dst] = ({}, {})
            return got


def plan(
    prefill: Side,
    decode: Side,
    src: Placements,
    dst: Placements,
    start: int = 0,
    stop: int | None = None,
    *,
    last: bool | None = None,
) -> TransferPlan:
    """Plan one chunk between two sides (a one-shot :class:`Pairing`)."""
    return Pairing(prefill, decode).plan(src, dst, start, stop, last=last)
