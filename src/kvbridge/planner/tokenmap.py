"""TokenMap: which context-parallel shard holds each token of a request, and where.

Context parallelism splits a request's tokens over ``shards`` token shards; each shard keeps
only its tokens' KV, in its own pages, in order: a token's *local index* on its shard is the
number of the shard's tokens before it, and the shard's page table maps local indices to
pages (local index ``l`` lives in page ``pages[l // page_size]``, slot ``l % page_size``).

Three splits, as engines store them:

* ``CONTIGUOUS``: ``shards`` ranges of ``ceil(n / shards)`` tokens, shard ``s`` the ``s``-th
  (an engine that pads the prompt to a multiple of the shard count, then cuts it evenly).
* ``ZIGZAG``: ``2 * shards`` ranges of ``ceil(n / (2 * shards))`` tokens; shard ``s`` holds
  ranges ``s`` and ``2 * shards - 1 - s`` (load-balanced causal attention, "DualChunkSwap").
* ``INTERLEAVED``: token ``t`` on shard ``(t // interleave) % shards`` (vLLM's decode and
  prefill context parallel store KV this way, ``cp_kv_cache_interleave_size``; SGLang's
  round-robin split is ``interleave=1``).

Ranges past the request's end are empty: a short request may leave a shard without tokens.
Everything is vectorised over int64 token arrays; nothing here depends on the model.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numpy as np

from kvbridge.errors import LayoutError

# A deployment shards a request over at most as many ranks as it has (see parallel.MAX_TP).
MAX_SHARDS = 1024
MAX_INTERLEAVE = 1 << 20


class TokenSplit(enum.Enum):
    CONTIGUOUS = "contiguous"
    ZIGZAG = "zigzag"
    INTERLEAVED = "interleaved"


@dataclass(frozen=True)
class TokenMap:
    shards: int = 1
    split: TokenSplit = TokenSplit.INTERLEAVED
    interleave: int = 1  # tokens per turn, INTERLEAVED only

    def __post_init__(self) -> None:
        if (
            isinstance(self.shards, bool)
            or not isinstance(self.shards, int)
            or not 1 <= self.shards <= MAX_SHARDS
        ):
            raise LayoutError(
                f"token shards (context-parallel ranks) must be an integer in "
                f"[1, {MAX_SHARDS}], got {self.shards!r}"
            )
        if not isinstance(self.split, TokenSplit):
            raise LayoutError(
                f"token split must be one of "
                f"{', '.join(s.value for s in TokenSplit)}, got {self.split!r}"
            )
        if (
            isinstance(self.interleave, bool)
            or not isinstance(self.interleave, int)
            or not 1 <= self.interleave <= MAX_INTERLEAVE
        ):
            raise LayoutError(
                f"interleave must be an integer in [1, {MAX_INTERLEAVE}] "
                f"(tokens per turn), got {self.interleave!r}"
            )
        if self.interleave != 1 and self.split is not TokenSplit.INTERLEAVED:
            raise LayoutError(
                f"interleave applies to the interleaved split only; the "
                f"{self.split.value} split got interleave={self.interleave}"
            )

    @property
    def trivial(self) -> bool:
        """One shard: every token on it, at its own index."""
        return self.shards == 1

    def describe(self) -> str:
        if self.split is TokenSplit.INTERLEAVED:
            return f"interleaved by {self.interleave}"
        return str(self.split.value)

    # ---- the ranges of a shard ----------------------------------------------------------

    def _ranges(self, shard: int, n: int) -> tuple[tuple[int, int], ...]:
        """CONTIGUOUS and ZIGZAG: the shard's global ranges, in local order."""
        k = self.shards if self.split is TokenSplit.CONTIGUOUS else 2 * self.shards
        size = -(-n // k)
        picks = (shard,) if self.split is TokenSplit.CONTIGUOUS else (shard, k - 1 - shard)
        return tuple((min(n, i * size), min(n, (i + 1) * size)) for i in picks)

    def count(self, shard: int, n: int) -> int:
        """How many of a request's ``n`` tokens the shard holds."""
        self._check_shard(shard)
        if self.trivial:
            return n
        if self.split is TokenSplit.INTERLEAVED:
            per = self.interleave * self.shards
            full, rest = divmod(n, per)
            return full * self.interleave + min(
                self.interleave, max(0, rest - shard * self.interleave)
            )
        return sum(b - a for a, b in self._ranges(shard, n))

    def owner(self, tokens: np.ndarray, n: int) -> np.ndarray:
        """The shard of each token of a request of ``n`` tokens."""
        t = np.asarray(tokens, dtype=np.int64)
        if self.trivial:
            return np.zeros_like(t)
        if self.split is TokenSplit.INTERLEAVED:
            out: np.ndarray = (t // self.interleave) % self.shards
            return out
        k = self.shards if self.split is TokenSplit.CONTIGUOUS else 2 * self.shards
        piece = t // -(-n // k)
        if self.split is TokenSplit.CONTIGUOUS:
            return piece
        return np.where(piece < self.shards, piece, k - 1 - piece)

    def local(self, tokens: np.ndarray, n: int) -> np.ndarray:
        """Each token's index among its shard's tokens."""
        t = np.asarray(tokens, dtype=np.int64)
        if self.trivial:
            return t
        if self.split is TokenSplit.INTERLEAVED:
            i = self.interleave
            out: np.ndarray = (t // (i * self.shards)) * i + t % i
            return out
        k = self.shards if self.split is TokenSplit.CONTIGUOUS else 2 * self.shards
        size = -(-n // k)
        piece, within = np.divmod(t, size)
        if self.split is TokenSplit.CONTIGUOUS:
            return within
        # ZIGZAG: the second range of shard s follows its first (which is full whenever a
        # second range holds anything, since ranges fill in order).
        return np.where(piece < self.shards, within, size + within)

    def pieces(self, n: int) -> list[tuple[int, int, int]]:
        """The request's tokens as maximal runs held by one shard, in token order:
        ``(start, stop, shard)``."""
        out = [
            (int(g), int(g + ln), k)
            for k in range(self.shards)
            for g, _, ln in zip(*self.runs(k, 0, n, n), strict=True)
        ]
        return sorted(out)

    def holder(self, n: int) -> int:
        """The shard holding the request's last token."""
        return int(self.owner(np.array([n - 1]), n)[0])

    def runs(
        self, shard: int, lo: int, hi: int, n: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The shard's tokens within ``[lo, hi)`` as maximal runs of consecutive tokens, in
        order: (global start, local start, length) arrays."""
        self._check_shard(shard)
        if self.trivial:
            if lo >= hi:
                return _empty3()
            return (
                np.array([lo], dtype=np.int64),
                np.array([lo], dtype=np.int64),
                np.array([hi - lo], dtype=np.int64),
            )
        if self.split is TokenSplit.INTERLEAVED:
            i, k = self.interleave, self.shards
            first = (lo // i) // k * k + shard  # the shard's turn in the cycle holding lo
            turns = np.arange(first, (hi - 1) // i + 1 if hi > lo else first, k, dtype=np.int64)
            starts = np.maximum(turns * i, lo)
            stops = np.minimum((turns + 1) * i, hi)
            keep = starts < stops
            starts, stops, turns = starts[keep], stops[keep], turns[keep]
            local = (turns // k) * i + (starts - turns * i)
            return starts, local, stops - starts
        g: list[int] = []
        loc: list[int] = []
        ln: list[int] = []
        before = 0
        for a, b in self._ranges(shard, n):
            s, e = max(a, lo), min(b, hi)
            if s < e and g and g[-1] + ln[-1] == s:  # zig-zag's middle shard: one run
                ln[-1] += e - s
            elif s < e:
                g.append(s)
                loc.append(before + s - a)
                ln.append(e - s)
            before += b - a
        return (
            np.array(g, dtype=np.int64),
            np.array(loc, dtype=np.int64),
            np.array(ln, dtype=np.int64),
        )

    def _check_shard(self, shard: int) -> None:
        if not 0 <= shard < self.shards:
            raise LayoutError(f"token shard {shard} out of range [0, {self.shards})")


def _empty3() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    z = np.zeros(0, dtype=np.int64)
    return z, z, z


def shared_runs(
    a: TokenMap, sa: int, b: TokenMap, sb: int, lo: int, hi: int, n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The tokens of ``[lo, hi)`` held by shard ``sa`` of ``a`` and shard ``sb`` of ``b``, as
    maximal runs consecutive on both: (global start, local start in a, local start in b,
    length)."""
    ga, la, na = a.runs(sa, lo, hi, n)
    gb, lb, nb = b.runs(sb, lo, hi, n)
    if not len(ga) or not len(gb):
        z = np.zeros(0, dtype=np.int64)
        return z, z, z, z
    if len(ga) == 1 and len(gb) == 1:  # the common case: one run a side (no CP on one)
        s, e = max(int(ga[0]), int(gb[0])), min(int(ga[0] + na[0]), int(gb[0] + nb[0]))
        if s >= e:
            z = np.zeros(0, dtype=np.int64)
            return z, z, z, z
        one = np.ones(1, dtype=np.int64)
        return (one * s, one * (la[0] + s - ga[0]), one * (lb[0] + s - gb[0]), one * (e - s))
    # Every run start of either side cuts; keep the pieces both sides hold.
    cuts = np.union1d(np.union1d(ga, ga + na), np.union1d(gb, gb + nb))
    starts, stops = cuts[:-1], cuts[1:]
    ia = np.searchsorted(ga, starts, side="right") - 1
    ib = np.searchsorted(gb, starts, side="right") - 1
    inside = (ia >= 0) & (ib >= 0)
    ia, ib = np.maximum(ia, 0), np.maximum(ib, 0)
    inside &= (starts < ga[ia] + na[ia]) & (starts < gb[ib] + nb[ib])
    starts, stops, ia, ib = starts[inside], stops[inside], ia[inside], ib[inside]
    loc_a = la[ia] + starts - ga[ia]
    loc_b = lb[ib] + starts - gb[ib]
    lens = stops - starts
    # Neighbours that continue on both sides merge back (a cut only one side needed).
    if len(starts) > 1:
        cont = (
            (starts[1:] == stops[:-1])
            & (loc_a[1:] == loc_a[:-1] + lens[:-1])
            & (loc_b[1:] == loc_b[:-1] + lens[:-1])
        )
        keep = np.flatnonzero(np.concatenate(([True], ~cont)))
        lens = np.add.reduceat(lens, keep)
        starts, loc_a, loc_b = starts[keep], loc_a[keep], loc_b[keep]
    return starts, loc_a, loc_b, lens


def co_shards(a: TokenMap, b: TokenMap, n: int) -> np.ndarray:
    """``[a.shards, b.shards]`` booleans: which shard of ``a`` and which of ``b`` hold a token
    of a request of ``n`` tokens in common. Interleaved maps repeat every ``interleave *
    shards`` tokens, so a stretch that long holds all their shards; only shorter stretches are
    looked at token by token."""
    out = np.zeros((a.shards, b.shards), dtype=bool)
    if n < 1:
        return out
    ra, rb = _stretches(a, n), _stretches(b, n)
    if ra is None and rb is None:  # both periodic: one common period says everything
        t = np.arange(min(n, math.lcm(_period(a), _period(b))), dtype=np.int64)
        out[a.owner(t, n), b.owner(t, n)] = True
        return out
    if ra is not None and rb is not None:
        for s, e, ka in ra:
            for s2, e2, kb in rb:
                if max(s, s2) < min(e, e2):
                    out[ka, kb] = True
        return out
    flip = ra is None  # then b has the ranges and a repeats
    periodic = a if flip else b
    for s, e, k in (rb if flip else ra) or ():
        if e - s >= _period(periodic):
            seen = np.ones(periodic.shards, dtype=bool)
        else:
            seen = np.zeros(periodic.shards, dtype=bool)
            seen[periodic.owner(np.arange(s, e, dtype=np.int64), n)] = True
        if flip:
            out[seen, k] = True
        else:
            out[k, seen] = True
    return out


def _period(m: TokenMap) -> int:
    return m.interleave * m.shards


def _stretches(m: TokenMap, n: int) -> list[tuple[int, int, int]] | None:
    """A CONTIGUOUS or ZIGZAG map's non-empty ranges as (start, stop, shard); None for a
    periodic (interleaved, or one-shard) map."""
    if m.trivial or m.split is TokenSplit.INTERLEAVED:
        return None
    return [(s, e, k) for k in range(m.shards) for s, e in m._ranges(k, n) if s < e]
