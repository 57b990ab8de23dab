"""Every plan, executed, leaves each decode rank's pools exactly as the reference re-shard says:
right bytes, each destination byte written once, nothing else touched."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from kvbridge import DType, KVLayout, ParallelLayout, Placement, Side, build_memory
from kvbridge.model.spec import (
    CacheSpec,
    LayerKind,
    attention_layer,
    gdn_layer,
    kda_layer,
    mamba1_layer,
    mamba2_layer,
    mla_layer,
    short_conv_layer,
)
from kvbridge.model.states import lightning_layer, mlstm_layer, rglru_layer, rwkv_layer
from kvbridge.planner.layout import ConvLayout
from kvbridge.planner.reference import allocate, fill, local_bytes, logical_cache
from oracle import check_bytes
from strategies import KINDS, layers, sides_and_placements
from tiers import examples


def side(
    spec: CacheSpec,
    tp: int,
    *,
    pp: int = 1,
    page: int = 4,
    pages: int = 64,
    layout: KVLayout = KVLayout.NHD,
    split: tuple[int, ...] | None = None,
    conv: ConvLayout = ConvLayout.SD,
) -> Side:
    par = (
        ParallelLayout.from_split(tp, split)
        if split
        else ParallelLayout.even(spec.num_layers, tp, pp)
    )
    return Side(
        spec,
        par,
        build_memory(
            spec, par, page_size=page, num_pages=pages, kv_layout=layout, conv_layout=conv
        ),
    )


def shuffled(n: int, page: int, pages: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(pages)[: -(-n // page)]


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sides_and_placements())
def test_every_layout_matches_the_reference(case) -> None:  # type: ignore[no-untyped-def]
    prefill, decode, src, dst, chunks = case
    check_bytes(prefill, decode, src, dst, chunks)


@st.composite
def layer_groups(draw: st.DrawFn, layers: int, chunks: int) -> list[list[range]]:
    """Per chunk, the model's layers cut into ranges, sent in a random order."""
    out = []
    for _ in range(chunks):
        cuts = sorted(draw(st.sets(st.integers(1, max(1, layers - 1)), max_size=layers - 1)))
        bounds = [0, *[c for c in cuts if c < layers], layers]
        groups = [range(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        out.append(draw(st.permutations(groups)))
    return out


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sides_and_placements(), st.data())
def test_layer_wise_sends_in_any_order_match_the_reference(case, data) -> None:  # type: ignore[no-untyped-def]
    """Each chunk sent layer group by layer group as a forward computes them, the groups in
    any order: every destination byte still written exactly once, right."""
    prefill, decode, src, dst, chunks = case
    groups = data.draw(layer_groups(prefill.spec.num_layers, len(chunks)))
    check_bytes(prefill, decode, src, dst, chunks, layer_groups=groups)


# Segments from one byte (every block cut) to more than a pair's whole chunk (one segment).
SEGMENT_BYTES = st.one_of(st.integers(1, 64), st.integers(65, 4096), st.just(1 << 20))


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sides_and_placements(), SEGMENT_BYTES)
def test_every_layout_matches_the_reference_when_staged(  # type: ignore[no-untyped-def]
    case, segment_bytes: int
) -> None:
    """The same grid with staging forced: gather (or write from extents) into a slot, then
    scatter, segment by segment."""
    prefill, decode, src, dst, chunks = case
    check_bytes(prefill, decode, src, dst, chunks, segment_bytes=segment_bytes)


DENSE = CacheSpec("dense", tuple(attention_layer(6, 8, DType.BFLOAT16) for _ in range(4)))
QWEN_LIKE = CacheSpec("gqa", tuple(attention_layer(8, 8, DType.BFLOAT16) for _ in range(4)))


@pytest.mark.parametrize(
    ("tp_p", "tp_d", "spec"),
    [
        (4, 1, QWEN_LIKE),
        (1, 4, QWEN_LIKE),
        (2, 3, DENSE),
        (3, 2, DENSE),
        (8, 6, CacheSpec("24h", tuple(attention_layer(24, 4, DType.BFLOAT16) for _ in range(2)))),
        (8, 1, CacheSpec("2h", tuple(attention_layer(2, 8, DType.BFLOAT16) for _ in range(4)))),
        (1, 8, CacheSpec("2h", tuple(attention_layer(2, 8, DType.BFLOAT16) for _ in range(4)))),
    ],
)
# The fast tier runs every pair once, NHD -> HND and direct; the other 77 cases are slow.
@pytest.mark.parametrize(
    ("lp", "ld"),
    [
        pytest.param(KVLayout.NHD, KVLayout.NHD, marks=pytest.mark.slow),
        (KVLayout.NHD, KVLayout.HND),
        pytest.param(KVLayout.HND, KVLayout.NHD, marks=pytest.mark.slow),
        pytest.param(KVLayout.HND, KVLayout.HND, marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize(
    "segment_bytes",
    [None, pytest.param(100, marks=pytest.mark.slow), pytest.param(4096, marks=pytest.mark.slow)],
)
def test_tp_pairs_named_in_the_issue(
    tp_p: int, tp_d: int, spec: CacheSpec, lp: KVLayout, ld: KVLayout, segment_bytes: int | None
) -> None:
    n = 45
    p, d = side(spec, tp_p, layout=lp, page=16), side(spec, tp_d, layout=ld, page=4)
    check_bytes(
        p,
        d,
        Placement.simple(n, shuffled(n, 16, 64, 1)),
        Placement.simple(n, shuffled(n, 4, 64, 2), aux_slot=5),
        [(0, 13), (13, 45)],
        segment_bytes=segment_bytes,
    )


@pytest.mark.parametrize(
    ("split_p", "split_d"),
    [((2, 2), (4,)), ((4,), (2, 2)), ((1, 2, 3, 2), (5, 3)), ((3, 5), (1, 1, 6))],
)
def test_pipeline_splits_that_do_not_line_up(
    split_p: tuple[int, ...], split_d: tuple[int, ...]
) -> None:
    spec = CacheSpec("pp", tuple(attention_layer(4, 4, DType.FLOAT16) for _ in range(sum(split_p))))
    n = 20
    p, d = side(spec, 2, split=split_p), side(spec, 4, split=split_d, page=8)
    check_bytes(
        p, d, Placement.simple(n, shuffled(n, 4, 64, 3)), Placement.simple(n, shuffled(n, 8, 64, 4))
    )


HYBRID = CacheSpec(
    "hybrid",
    (
        mla_layer(16, 4, DType.BFLOAT16, indexer_dim=6),
        mamba2_layer(8, 4, 2, 4, 4, conv_dtype=DType.BFLOAT16, ssm_dtype=DType.FLOAT32),
        gdn_layer(2, 8, 4, 4, 4, conv_dtype=DType.BFLOAT16, state_dtype=DType.FLOAT32),
        attention_layer(2, 8, DType.BFLOAT16, window=9),
    ),
)
# Issue 33's families: KDA, Zamba1's multi-head Mamba1, MiniMax's lightning attention, xLSTM,
# RecurrentGemma's RG-LRU, RWKV-4 (its previous tokens replicated, its recurrence by channel),
# dots3's sliding MLA, and layers with a head size of their own (Gemma 4's global layers: twice
# the sliding layers').
FAMILIES = CacheSpec(
    "issue 33",
    (
        kda_layer(4, 4, 4, conv_dtype=DType.BFLOAT16, state_dtype=DType.FLOAT32),
        mamba1_layer(16, 4, 4, conv_dtype=DType.BFLOAT16, ssm_dtype=DType.FLOAT32, heads=4),
        lightning_layer(4, 4, DType.BFLOAT16),
        mlstm_layer(4, 2, 4, DType.FLOAT32),
        rglru_layer(8, 4, 4, conv_dtype=DType.BFLOAT16, state_dtype=DType.FLOAT32),
        rwkv_layer(16, shift_dtype=DType.BFLOAT16, state_dtype=DType.FLOAT32),
        mla_layer(16, 4, DType.BFLOAT16, window=9),
        attention_layer(4, 16, DType.BFLOAT16),
        attention_layer(4, 8, DType.BFLOAT16, window=9),
    ),
)


@pytest.mark.parametrize("spec", [HYBRID, FAMILIES], ids=["hybrid", "issue-33"])
@pytest.mark.parametrize("segment_bytes", [None, 7, 512])
@pytest.mark.parametrize(("tp_p", "tp_d"), [(4, 2), (2, 4), (4, 1), (1, 4)])
def test_state_and_latent_models(
    spec: CacheSpec, tp_p: int, tp_d: int, segment_bytes: int | None
) -> None:
    n = 33
    check_bytes(
        side(spec, tp_p, page=8),
        side(spec, tp_d, page=2, pages=80),
        Placement.simple(n, shuffled(n, 8, 64, 5), state_slot=7),
        Placement.simple(n, shuffled(n, 2, 80, 6), state_slot=1, aux_slot=2),
        [(0, 1), (1, 17), (17, 33)],
        segment_bytes=segment_bytes,
    )


@pytest.mark.slow  # some 4 s of CPU here: past the fast tier's budget
def test_the_grid_draws_every_kind_of_layer() -> None:
    """A kind the grid above never drew would never be checked byte for byte."""
    assert {find(layers(kind), lambda _: True).kind for kind in KINDS} == set(LayerKind)


def test_zamba1s_mamba1_is_sharded_by_head_not_by_channel() -> None:
    """Two heads of 8 channels over TP 4: each head is held by two ranks whole (a head's state
    comes from its own projections), not cut into four quarters of channels."""
    by_head = mamba1_layer(16, 4, 4, conv_dtype=DType.FLOAT32, ssm_dtype=DType.FLOAT32, heads=2)
    by_channel = mamba1_layer(16, 4, 4, conv_dtype=DType.FLOAT32, ssm_dtype=DType.FLOAT32)
    conv = np.arange(16 * 4)  # one step's bytes: 16 float32 channels
    assert local_bytes(by_head.components[0], 4, 1, conv).tolist() == list(range(32))
    assert local_bytes(by_channel.components[0], 4, 1, conv).tolist() == list(range(16, 32))


CONV = CacheSpec(
    "conv",
    (
        mamba2_layer(8, 4, 2, 4, 4, conv_dtype=DType.BFLOAT16, ssm_dtype=DType.FLOAT32),
        gdn_layer(2, 4, 4, 8, 3, conv_dtype=DType.FLOAT32, state_dtype=DType.FLOAT32),
        mamba1_layer(16, 4, 4, conv_dtype=DType.BFLOAT16, ssm_dtype=DType.FLOAT32),
        short_conv_layer(8, 2, dtype=DType.FLOAT16),
    ),
)


@pytest.mark.parametrize(("cp", "cd"), list(itertools.product(ConvLayout, repeat=2)))
@pytest.mark.parametrize(("tp_p", "tp_d"), [(2, 1), (1, 4), (4, 2), (2, 2)])
def test_conv_states_between_either_order_on_either_side(
    cp: ConvLayout, cd: ConvLayout, tp_p: int, tp_d: int
) -> None:
    """x|B|C (q|k|v) channels land on the right channels whatever the TP sizes and each side's
    conv-state order: one side [state_len, dim], the other [dim, state_len] included."""
    n = 11
    check_bytes(
        side(CONV, tp_p, conv=cp),
        side(CONV, tp_d, conv=cd, page=2),
        Placement.simple(n, shuffled(n, 4, 64, 7), state_slot=3),
        Placement.simple(n, shuffled(n, 2, 64, 8), state_slot=5),
        [(0, 5), (5, 11)],
    )


@pytest.mark.parametrize("tp", [1, 2])
def test_conv_layouts_are_the_shapes_engines_allocate(tp: int) -> None:
    """vLLM allocates a rank's conv state as (state_len, dim) (SD, its default) or
    (dim, state_len) (DS); SGLang's pools are SD. A rank's pools, viewed in those shapes,
    hold one state and its transpose, with this rank's x|B|C channels in order."""
    cache = logical_cache(CONV, 4, seed=9)
    place = Placement.simple(4, np.arange(1), state_slot=0)
    views = {}
    for conv in ConvLayout:
        s = side(CONV, tp, conv=conv)
        pools = allocate(s)
        fill(s, place, cache, pools, decode=False)
        views[conv] = (s, pools[0])
    for li, layer in enumerate(CONV.layers):
        comp = layer.component("conv")
        sd_side, sd_pools = views[ConvLayout.SD]
        buf = sd_side.memory.buffers[(li, "conv")]
        dim = buf.size("elem")
        dt = np.dtype(f"u{comp.dtype.itemsize}")
        sd = sd_pools[buf.region][: buf.stride("slot")].view(dt).reshape(comp.rows, dim)
        ds_side, ds_pools = views[ConvLayout.DS]
        ds_buf = ds_side.memory.buffers[(li, "conv")]
        ds = ds_pools[ds_buf.region][: ds_buf.stride("slot")].view(dt).reshape(dim, comp.rows)
        assert np.array_equal(sd, ds.T)
        # Rank 0's channels: the first 1/tp of each segment, segments in order.
        full = cache.state[(li, "conv")].view(dt).reshape(comp.rows, comp.axis_elems)
        start, want = 0, []
        for seg in comp.segments:
            share = seg.elems // tp if seg.units >= tp else seg.elems
            want.append(full[:, start : start + share])
            start += seg.elems
        assert np.array_equal(sd, np.concatenate(want, axis=1))
