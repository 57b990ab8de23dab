"""Run plans against the reference re-shard and compare bytes (shared by the planner tests)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvbridge.placement import Placement
from kvbridge.plan import Pairing, Side
from kvbridge.reference import LogicalCache, allocate, execute, fill, logical_cache

CANARY = 0xA5


def ones_like(cache: LogicalCache) -> LogicalCache:
    return LogicalCache(cache.tokens, {k: np.ones_like(v) for k, v in cache.token.items()},
                        {k: np.ones_like(v) for k, v in cache.state.items()},
                        np.ones_like(cache.aux))


def check_bytes(prefill: Side, decode: Side, src: Placement, dst: Placement,
                chunks: Sequence[tuple[int, int]] | None = None, seed: int = 0) -> Pairing:
    """Plan every chunk, execute it block by block, and require that each decode rank's pools
    equal the reference byte for byte, every destination byte written exactly once, and no
    other byte touched (canary)."""
    n = src.tokens
    chunks = chunks or [(0, n)]
    cache = logical_cache(prefill.spec, n, seed)
    src_pools = allocate(prefill, seed=seed + 1)  # garbage outside the request
    fill(prefill, src, cache, src_pools, decode=False)
    got = allocate(decode, fill_byte=CANARY)
    want = allocate(decode, fill_byte=CANARY)
    fill(decode, dst, cache, want, decode=True)
    mask = allocate(decode, fill_byte=0)
    fill(decode, dst, ones_like(cache), mask, decode=True)
    writes = {r: {k: np.zeros(len(v), dtype=np.int32) for k, v in regs.items()}
              for r, regs in got.items()}
    pairing = Pairing(prefill, decode)
    for a, b in chunks:
        execute(pairing.plan(src, dst, a, b), src_pools, got, writes)
    for rank, regions in got.items():
        for name, arr in regions.items():
            w = writes[rank][name]
            if not np.array_equal(w, mask[rank][name].astype(np.int32)):
                bad = np.flatnonzero(w != mask[rank][name])
                raise AssertionError(
                    f"decode rank {rank} region {name}: {len(bad)} bytes written "
                    f"{sorted(set(w[bad].tolist()))} times where the reference writes "
                    f"{sorted(set(mask[rank][name][bad].tolist()))} (first at byte {bad[0]})")
            if not np.array_equal(arr, want[rank][name]):
                bad = np.flatnonzero(arr != want[rank][name])
                raise AssertionError(f"decode rank {rank} region {name}: {len(bad)} bytes differ "
                                     f"from the reference (first at byte {bad[0]})")
    return pairing
