"""Run plans against the reference re-shard and compare bytes (shared by the planner tests)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvbridge.memory.copy import execute as copy_runs
from kvbridge.planner.placement import Placement
from kvbridge.planner.plan import Pairing, Placements, Side
from kvbridge.planner.reference import LogicalCache, Pools, allocate, execute, fill, logical_cache
from kvbridge.planner.transferplan import TransferPlan
from kvbridge.staging import gather, scatter, segments
from kvbridge.staging.layout import extents

CANARY = 0xA5
MAX_SEGMENTS = 256  # a pair's staged segments in execute_staged, at most


def ones_like(cache: LogicalCache) -> LogicalCache:
    return LogicalCache(
        cache.tokens,
        {k: np.ones_like(v) for k, v in cache.token.items()},
        {k: np.ones_like(v) for k, v in cache.state.items()},
        np.ones_like(cache.aux),
    )


def execute_staged(
    plan: TransferPlan,
    src: Pools,
    dst: Pools,
    writes: dict[int, dict[str, np.ndarray]],
    segment_bytes: int,
) -> None:
    """Apply a plan the staged way: each pair's runs cut into segments, each segment moved
    into a staging slot (gathered, or written straight from its extents: the two ways a sender
    fills a slot, taken in turn) and scattered from it; ``writes`` counts scattered bytes.
    A pair's segments are at most MAX_SEGMENTS: each is copied here in Python, and a draw of
    1-byte segments for a plan of a few tens of kilobytes ran past pytest's 300 s (2026-11-29).
    Segments that small still cut every run of a pair of up to MAX_SEGMENTS bytes."""
    for pair in plan.pairs:
        src_names, dst_names, runs = pair.runs.restricted(plan.src_regions, plan.dst_regions)
        src_views = [src[pair.prefill_rank][n] for n in src_names]
        dst_views = [dst[pair.decode_rank][n] for n in dst_names]
        size = max(segment_bytes, -(-runs.total_bytes // MAX_SEGMENTS))
        for k, seg in enumerate(segments(runs, size)):
            assert seg.total_bytes <= size
            slot = np.full(size + 16, 0x3C, dtype=np.uint8)
            fill_slot = gather(seg, 8) if k % 2 else extents(gather(seg, 8))
            copy_runs(fill_slot, src_views, [slot])
            out = scatter(seg, 8)
            copy_runs(out, [slot], dst_views)
            flat = out.flat()
            for r, o, n in zip(
                flat.dst_region.tolist(),
                flat.dst_offset.tolist(),
                flat.nbytes.tolist(),
                strict=True,
            ):
                writes[pair.decode_rank][dst_names[r]][o : o + n] += 1


def check_bytes(
    prefill: Side,
    decode: Side,
    src: Placements,
    dst: Placements,
    chunks: Sequence[tuple[int, int]] | None = None,
    seed: int = 0,
    segment_bytes: int | None = None,
    layer_groups: Sequence[Sequence[range]] | None = None,
) -> Pairing:
    """Plan every chunk, execute it block by block (or staged, in segments of
    ``segment_bytes``), and require that each decode rank's pools equal the reference byte for
    byte, every destination byte written exactly once, and no other byte touched (canary).
    A placement per token shard, or one the shards share, on each side. ``layer_groups``:
    each chunk sent layer group by layer group, in the order given (a layer-wise prefill); the
    aux slot travels with the last group of the last chunk."""
    n = (src if isinstance(src, Placement) else src[0]).tokens
    chunks = chunks or [(0, n)]
    cache = logical_cache(prefill.spec, n, seed)
    src_pools = allocate(prefill, seed=seed + 1)  # garbage outside the request
    fill(prefill, src, cache, src_pools, decode=False)
    got = allocate(decode, fill_byte=CANARY)
    want = allocate(decode, fill_byte=CANARY)
    fill(decode, dst, cache, want, decode=True)
    mask = allocate(decode, fill_byte=0)
    fill(decode, dst, ones_like(cache), mask, decode=True)
    writes = {
        r: {k: np.zeros(len(v), dtype=np.int32) for k, v in regs.items()} for r, regs in got.items()
    }
    pairing = Pairing(prefill, decode)
    for i, (a, b) in enumerate(chunks):
        groups: Sequence[range | None] = [None] if layer_groups is None else layer_groups[i]
        for j, layers in enumerate(groups):
            plan = pairing.plan(src, dst, a, b, layers=layers, aux=j == len(groups) - 1)
            if segment_bytes is None:
                execute(plan, src_pools, got, writes)
            else:
                execute_staged(plan, src_pools, got, writes, segment_bytes)
    for rank, regions in got.items():
        for name, arr in regions.items():
            w = writes[rank][name]
            if not np.array_equal(w, mask[rank][name].astype(np.int32)):
                bad = np.flatnonzero(w != mask[rank][name])
                raise AssertionError(
                    f"decode rank {rank} region {name}: {len(bad)} bytes written "
                    f"{sorted(set(w[bad].tolist()))} times where the reference writes "
                    f"{sorted(set(mask[rank][name][bad].tolist()))} (first at byte {bad[0]})"
                )
            if not np.array_equal(arr, want[rank][name]):
                bad = np.flatnonzero(arr != want[rank][name])
                raise AssertionError(
                    f"decode rank {rank} region {name}: {len(bad)} bytes differ "
                    f"from the reference (first at byte {bad[0]})"
                )
    return pairing
