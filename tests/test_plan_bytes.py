"""Every plan, executed, leaves each decode rank's pools exactly as the reference re-shard says:
right bytes, each destination byte written once, nothing else touched."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge import DType, KVLayout, ParallelLayout, Placement, Side, build_memory
from kvbridge.spec import CacheSpec, attention_layer, gdn_layer, mamba2_layer, mla_layer
from oracle import check_bytes
from strategies import sides_and_placements


def side(spec: CacheSpec, tp: int, *, pp: int = 1, page: int = 4, pages: int = 64,
         layout: KVLayout = KVLayout.NHD, split: tuple[int, ...] | None = None) -> Side:
    par = ParallelLayout.from_split(tp, split) if split else \
        ParallelLayout.even(spec.num_layers, tp, pp)
    return Side(spec, par, build_memory(spec, par, page_size=page, num_pages=pages,
                                        kv_layout=layout))


def shuffled(n: int, page: int, pages: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(pages)[: -(-n // page)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sides_and_placements())
def test_every_layout_matches_the_reference(case) -> None:  # type: ignore[no-untyped-def]
    prefill, decode, src, dst, chunks = case
    check_bytes(prefill, decode, src, dst, chunks)


# Segments from one byte (every block cut) to more than a pair's whole chunk (one segment).
SEGMENT_BYTES = st.one_of(st.integers(1, 64), st.integers(65, 4096), st.just(1 << 20))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sides_and_placements(), SEGMENT_BYTES)
def test_every_layout_matches_the_reference_when_staged(  # type: ignore[no-untyped-def]
        case, segment_bytes: int) -> None:
    """The same grid with staging forced: gather (or write from extents) into a slot, then
    scatter, segment by segment."""
    prefill, decode, src, dst, chunks = case
    check_bytes(prefill, decode, src, dst, chunks, segment_bytes=segment_bytes)


DENSE = CacheSpec("dense", tuple(attention_layer(6, 8, DType.BFLOAT16) for _ in range(4)))
QWEN_LIKE = CacheSpec("gqa", tuple(attention_layer(8, 8, DType.BFLOAT16) for _ in range(4)))


@pytest.mark.parametrize(("tp_p", "tp_d", "spec"), [
    (4, 1, QWEN_LIKE), (1, 4, QWEN_LIKE), (2, 3, DENSE), (3, 2, DENSE), (8, 6, CacheSpec(
        "24h", tuple(attention_layer(24, 4, DType.BFLOAT16) for _ in range(2)))),
    (8, 1, CacheSpec("2h", tuple(attention_layer(2, 8, DType.BFLOAT16) for _ in range(4)))),
    (1, 8, CacheSpec("2h", tuple(attention_layer(2, 8, DType.BFLOAT16) for _ in range(4)))),
])
@pytest.mark.parametrize(("lp", "ld"), [(KVLayout.NHD, KVLayout.NHD), (KVLayout.NHD, KVLayout.HND),
                                        (KVLayout.HND, KVLayout.NHD), (KVLayout.HND, KVLayout.HND)])
@pytest.mark.parametrize("segment_bytes", [None, 100, 4096])
def test_tp_pairs_named_in_the_issue(tp_p: int, tp_d: int, spec: CacheSpec, lp: KVLayout,
                                     ld: KVLayout, segment_bytes: int | None) -> None:
    n = 45
    p, d = side(spec, tp_p, layout=lp, page=16), side(spec, tp_d, layout=ld, page=4)
    check_bytes(p, d, Placement.simple(n, shuffled(n, 16, 64, 1)),
                Placement.simple(n, shuffled(n, 4, 64, 2), aux_slot=5), [(0, 13), (13, 45)],
                segment_bytes=segment_bytes)


@pytest.mark.parametrize(("split_p", "split_d"), [((2, 2), (4,)), ((4,), (2, 2)),
                                                  ((1, 2, 3, 2), (5, 3)), ((3, 5), (1, 1, 6))])
def test_pipeline_splits_that_do_not_line_up(split_p: tuple[int, ...],
                                             split_d: tuple[int, ...]) -> None:
    spec = CacheSpec("pp", tuple(attention_layer(4, 4, DType.FLOAT16) for _ in range(sum(split_p))))
    n = 20
    p, d = side(spec, 2, split=split_p), side(spec, 4, split=split_d, page=8)
    check_bytes(p, d, Placement.simple(n, shuffled(n, 4, 64, 3)),
                Placement.simple(n, shuffled(n, 8, 64, 4)))


@pytest.mark.parametrize("segment_bytes", [None, 7, 512])
@pytest.mark.parametrize(("tp_p", "tp_d"), [(4, 2), (2, 4), (4, 1), (1, 4)])
def test_state_and_latent_models(tp_p: int, tp_d: int, segment_bytes: int | None) -> None:
    spec = CacheSpec("hybrid", (
        mla_layer(16, 4, DType.BFLOAT16, indexer_dim=6),
        mamba2_layer(8, 4, 2, 4, 4, conv_dtype=DType.BFLOAT16, ssm_dtype=DType.FLOAT32),
        gdn_layer(2, 8, 4, 4, 4, conv_dtype=DType.BFLOAT16, state_dtype=DType.FLOAT32),
        attention_layer(2, 8, DType.BFLOAT16, window=9),
    ))
    n = 33
    check_bytes(side(spec, tp_p, page=8), side(spec, tp_d, page=2, pages=80),
                Placement.simple(n, shuffled(n, 8, 64, 5), state_slot=7),
                Placement.simple(n, shuffled(n, 2, 80, 6), state_slot=1, aux_slot=2),
                [(0, 1), (1, 17), (17, 33)], segment_bytes=segment_bytes)
