"""The reference re-shard: the byte oracle for every plan (slow, simple, obviously correct).

It builds a request's full logical cache, writes each rank's shard into that rank's pools by
walking tokens, rows and units one by one (no planner code is used), and computes what every
decode rank's pools must hold afterwards. Tests, the runtime's multi-process checks and the demo
compare real bytes against it. Nothing here is vectorised on purpose: it must be easy to trust.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.model.spec import CacheSpec, Component, Scope
from kvbridge.planner.layout import BufferLayout
from kvbridge.planner.placement import Placement
from kvbridge.planner.plan import Side
from kvbridge.planner.runs import Runs
from kvbridge.planner.shard import held
from kvbridge.planner.transferplan import TransferPlan

Pools = dict[int, dict[str, np.ndarray]]  # engine rank -> region name -> uint8 bytes


@dataclass(frozen=True, eq=False)
class LogicalCache:
    """One request's cache before sharding: ``token[(layer, comp)]`` is
    ``[tokens, rows, axis_bytes]`` (``tokens // stride`` entries for a component of one entry
    every ``stride`` tokens), ``state[(layer, comp)]`` is ``[rows, axis_bytes]``."""

    tokens: int
    token: dict[tuple[int, str], np.ndarray]
    state: dict[tuple[int, str], np.ndarray]
    aux: np.ndarray


def logical_cache(spec: CacheSpec, tokens: int, seed: int = 0) -> LogicalCache:
    rng = np.random.default_rng(seed)
    tok, st = {}, {}
    for li, layer in enumerate(spec.layers):
        for c in layer.components:
            width = c.axis_elems * c.dtype.itemsize
            if c.scope is Scope.TOKEN:
                shape = (tokens // c.stride, c.rows, width)
                tok[(li, c.name)] = rng.integers(0, 256, shape, dtype=np.uint8)
            else:
                st[(li, c.name)] = rng.integers(0, 256, (c.rows, width), dtype=np.uint8)
    return LogicalCache(tokens, tok, st, rng.integers(0, 256, spec.aux_bytes, dtype=np.uint8))


def local_bytes(comp: Component, tp: int, tp_rank: int, logical: np.ndarray) -> np.ndarray:
    """The rank's local axis: its piece of each segment, concatenated in segment order."""
    isz = comp.dtype.itemsize
    pieces, seg_start = [], 0
    for seg in comp.segments:
        lo, hi = held(seg, tp, tp_rank)
        a = (seg_start + lo * seg.unit_size) * isz
        b = (seg_start + hi * seg.unit_size) * isz
        pieces.append(logical[..., a:b])
        seg_start += seg.elems
    return np.concatenate(pieces, axis=-1)


def _elem_offset(buf: BufferLayout, comp: Component, e: int) -> int:
    """Byte offset of local axis element ``e`` within one (token, row) of ``buf``."""
    es = buf.stride("elem")
    unit = buf.dim("unit")
    if unit is None:
        return e * es
    us = buf.size("elem")
    return (e // us) * unit.stride + (e % us) * es


def _write_item(
    region: np.ndarray, buf: BufferLayout, comp: Component, base: int, data: np.ndarray
) -> None:
    """Write one token's (or one slot's) local tensor ``[rows, local_axis_bytes]``."""
    isz = comp.dtype.itemsize
    n_elems = data.shape[-1] // isz
    if not buf.contiguous_elems:
        step = 1
    elif buf.dim("unit") is not None:
        step = buf.size("elem")
    else:
        step = n_elems
    for r in range(comp.rows):
        for e in range(0, n_elems, step):
            off = base + r * buf.stride("row") + _elem_offset(buf, comp, e)
            region[off : off + step * isz] = data[r, e * isz : (e + step) * isz]


def needed_tokens(spec: CacheSpec, layer: int, tokens: int, start: int = 0) -> range:
    """The tokens the decode side needs of a layer: all from ``start`` (those before it are
    held already), or the last ``window`` of them."""
    w = spec.layers[layer].window
    return range(start if w is None else max(start, tokens - w), tokens)


def fill(
    side: Side,
    placement: Placement | Sequence[Placement],
    cache: LogicalCache,
    pools: Pools,
    *,
    decode: bool,
    token_range: Iterable[int] | None = None,
    with_tail: bool = True,
    ranks: Iterable[int] | None = None,
    layers: Iterable[int] | None = None,
    with_aux: bool = True,
) -> None:
    """Write the rank shards of ``cache`` into ``pools`` as ``side`` holds them.

    ``placement``: one every token shard shares, or one per shard (its page tables index the
    shard's own tokens, in order). On the prefill side every token of the rank's shard whose
    page is allocated is written (``token_range`` narrows it); on the decode side only the
    needed tokens. ``with_tail`` writes state and aux: on the decode side on every rank; on the
    prefill side only where a real engine has them, the CP group holding the last token (and
    for aux its last stage, which holds the sampled token), so that a plan reading them
    anywhere else reads garbage. ``layers`` narrows it to those layers (a layer-wise prefill
    writes each as its forward computes it); ``with_aux=False`` leaves the aux slot (its value,
    the sampled token, comes after the last layer).
    """
    only = None if layers is None else set(layers)
    spec, par, mem = side.spec, side.parallel, side.memory
    n = cache.tokens
    holder = par.state_group(n)
    for rank in range(par.world) if ranks is None else ranks:
        stage, cp_rank, tp_rank = par.coords(rank)
        shard = par.shard(cp_rank, tp_rank)
        mine = placement if isinstance(placement, Placement) else placement[shard]
        tail = with_tail and (decode or cp_rank == holder)
        regions = pools[rank]
        for li in par.layers_of(rank):
            if only is not None and li not in only:
                continue
            for c in spec.layers[li].components:
                buf = mem.buffers[(li, c.name)]
                region = regions[buf.region]
                if c.scope is Scope.STATE:
                    if tail:
                        base = buf.offset + mine.slot(buf.group) * buf.stride("slot")
                        _write_item(
                            region,
                            buf,
                            c,
                            base,
                            local_bytes(c, par.tp, tp_rank, cache.state[(li, c.name)]),
                        )
                    continue
                ids = mine.page_ids(buf.group)
                ps = buf.size("token")
                toks = needed_tokens(spec, li, n, mine.start) if decode else range(mine.start, n)
                if token_range is not None:
                    toks = sorted(set(toks) & set(token_range))  # type: ignore[assignment]
                # One entry every `stride` tokens: those whose window's last token is written
                # (a strided component is never context parallel: the owner is trivial).
                r, count = c.stride, n // c.stride
                toks = [(t + 1) // r - 1 for t in toks if (t + 1) % r == 0]  # type: ignore[assignment]
                local = local_bytes(c, par.tp, tp_rank, cache.token[(li, c.name)])
                for t in toks:
                    if int(par.tokens.owner(np.array([t]), count)[0]) != shard:
                        continue
                    lt = int(par.tokens.local(np.array([t]), count)[0])
                    page = int(ids[lt // ps])
                    if page < 0:
                        continue
                    base = buf.offset + page * buf.stride("page") + (lt % ps) * buf.stride("token")
                    _write_item(region, buf, c, base, local[t])
        if tail and with_aux and (decode or stage == par.pp - 1):
            aux = mem.aux
            off = aux.offset + mine.slot(aux.group) * aux.stride("slot")
            regions[aux.region][off : off + spec.aux_bytes] = cache.aux


def allocate(side: Side, fill_byte: int | None = None, seed: int = 1) -> Pools:
    """Pools for every rank of a side: random garbage, or a constant canary byte."""
    rng = np.random.default_rng(seed)
    pools: Pools = {}
    for rank in range(side.parallel.world):
        pools[rank] = {}
        for r in side.memory.regions_of(side.parallel.layers_of(rank)):
            if fill_byte is None:
                pools[rank][r.name] = rng.integers(0, 256, r.nbytes, dtype=np.uint8)
            else:
                pools[rank][r.name] = np.full(r.nbytes, fill_byte, dtype=np.uint8)
    return pools


def execute(
    plan: TransferPlan,
    src: Pools,
    dst: Pools,
    writes: dict[int, dict[str, np.ndarray]] | None = None,
) -> None:
    """Apply a plan block by block. ``writes`` (same shape as ``dst``, int counters) counts
    how many times each destination byte is written. A run naming a region its rank does not
    hold raises KeyError."""
    for pair in plan.pairs:
        flat: Runs = pair.runs.flat()
        for i in range(len(flat)):
            sname = plan.src_regions[int(flat.src_region[i])]
            dname = plan.dst_regions[int(flat.dst_region[i])]
            so, do, n = int(flat.src_offset[i]), int(flat.dst_offset[i]), int(flat.nbytes[i])
            s = src[pair.prefill_rank][sname]
            d = dst[pair.decode_rank][dname]
            if so + n > len(s) or do + n > len(d):
                raise IndexError(
                    f"run {i} of pair {pair.prefill_rank}->{pair.decode_rank} "
                    f"overruns {sname} or {dname}"
                )
            d[do : do + n] = s[so : so + n]
            if writes is not None:
                writes[pair.decode_rank][dname][do : do + n] += 1
