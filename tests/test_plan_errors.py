"""Bad input never reaches a plan: each case raises a typed error naming what was expected
and what came."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge import (
    CacheSpec,
    DType,
    IncompatibleError,
    KVBridgeError,
    LayoutError,
    Pairing,
    ParallelLayout,
    Placement,
    PlacementError,
    Side,
    SpecError,
    build_memory,
)
from kvbridge.model.spec import attention_layer, mamba2_layer
from kvbridge.planner.layout import BufferLayout, Dim, Region, SideMemory
from strategies import sides_and_placements
from tiers import examples


def spec(
    heads: int = 8,
    head_dim: int = 16,
    dtype: DType = DType.BFLOAT16,
    layers: int = 4,
    model: str = "m",
) -> CacheSpec:
    return CacheSpec(model, tuple(attention_layer(heads, head_dim, dtype) for _ in range(layers)))


def side(s: CacheSpec, tp: int = 1, page: int = 4, pages: int = 16) -> Side:
    par = ParallelLayout.even(s.num_layers, tp)
    return Side(s, par, build_memory(s, par, page_size=page, num_pages=pages))


@pytest.mark.parametrize(
    ("other", "words"),
    [
        (spec(head_dim=32), ["layer 0", "16", "32"]),
        (spec(dtype=DType.FLOAT16), ["bfloat16", "float16"]),
        (spec(layers=5), ["layer count", "4", "5"]),
        (spec(model="other"), ["model", "'m'", "'other'"]),
        (spec(heads=4), ["layer 0", "heads=8x16", "heads=4x16"]),
    ],
)
def test_mismatched_specs_are_refused_with_the_difference(
    other: CacheSpec, words: list[str]
) -> None:
    with pytest.raises(IncompatibleError) as e:
        Pairing(side(spec()), side(other))
    for w in words:
        assert w in str(e.value)


def test_heads_not_divisible_on_a_side() -> None:
    with pytest.raises(LayoutError, match=r"8 units, not divisible by TP 3"):
        side(spec(), tp=3)
    with pytest.raises(LayoutError, match=r"3 units, fewer than TP 4"):
        side(spec(heads=3), tp=4)


def test_mamba_groups_not_dividing_tp() -> None:
    s = CacheSpec(
        "mamba", (mamba2_layer(8, 4, 3, 4, 4, conv_dtype=DType.BFLOAT16, ssm_dtype=DType.FLOAT32),)
    )
    with pytest.raises(LayoutError, match=r"segment 'B' has 3 units"):
        side(s, tp=2)


def test_layer_ranges_must_cover_the_model() -> None:
    with pytest.raises(LayoutError, match=r"cover 3 layers; the model 'm' has 4"):
        s = spec()
        par = ParallelLayout(1, ((0, 2), (2, 3)))
        Side(s, par, build_memory(s, par, page_size=4, num_pages=4))
    with pytest.raises(LayoutError, match=r"PP stage 1 covers layers \[3, 4\); expected .* 2"):
        ParallelLayout(1, ((0, 2), (3, 4)))


def test_page_ids_out_of_range_or_too_few() -> None:
    s = spec()
    pr = Pairing(side(s), side(s))
    good = Placement.simple(10, [0, 1, 2])
    with pytest.raises(
        PlacementError,
        match=r"decode page group 'kv': page id 16 for token 4 is "
        r"out of range \[0, 16\)",
    ):
        pr.plan(good, Placement.simple(10, [0, 16, 2]))
    with pytest.raises(PlacementError, match=r"token 9 needs page index 2 .* only 2 page ids"):
        pr.plan(good, Placement.simple(10, [0, 1]))
    with pytest.raises(
        PlacementError,
        match=r"prefill page group 'kv': page id -1 for token 0 "
        r"is not allocated",
    ):
        pr.plan(Placement.simple(10, [-1, 1, 2]), good)
    with pytest.raises(PlacementError, match=r"only -1"):
        Placement.simple(10, [0, -2, 1])


def _planned(pairing: Pairing, src: object, dst: object, chunks: list[tuple[int, int]]) -> bool:
    """Whether every chunk of the request plans; False where one raises PlacementError."""
    try:
        for a, b in chunks:
            pairing.plan(src, dst, a, b)  # type: ignore[arg-type]
    except PlacementError:
        return False
    return True


def _checked(pairing: Pairing, placement: object, side: str) -> bool:
    places = placement if isinstance(placement, list) else [placement]
    par = pairing.prefill.parallel if side == "prefill" else pairing.decode.parallel
    try:
        if len(places) == 1:  # one table every token shard shares
            pairing.check_placement(places[0], side)
        else:  # one table a shard: each rank's own
            for rank in range(par.world):
                pairing.check_placement(places[par.shard_of(rank)], side, rank=rank)
    except PlacementError:
        return False
    return True


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sides_and_placements(), st.data())
def test_a_placement_checked_at_init_is_one_the_planner_takes(case, data) -> None:  # type: ignore[no-untyped-def]
    """What ``check_placement`` refuses when a request starts, before anything is planned or
    sent, is what planning it would refuse: one page id of the decode side's tables put out
    of its pool (or unallocated), anywhere, over the whole grid of layouts. (On the prefill
    side it checks from the prefill's own start, which may hold tokens the decode has: it
    refuses at least what planning refuses.)"""
    prefill, decode, src, dst, chunks = case
    pairing = Pairing(prefill, decode)
    assert _checked(pairing, src, "prefill") and _checked(pairing, dst, "decode")
    side = data.draw(st.sampled_from(["prefill", "decode"]))
    places = src if side == "prefill" else dst
    one = data.draw(st.sampled_from(places)) if isinstance(places, list) else places
    group = data.draw(st.sampled_from(sorted(one.pages)))
    ids = one.pages[group]
    if not len(ids):
        return
    i = data.draw(st.integers(0, len(ids) - 1))
    ids[i] = data.draw(st.sampled_from([-1, 1 << 40]))
    planned = _planned(pairing, src, dst, chunks)
    checked = _checked(pairing, places, side)
    if side == "decode":
        assert checked == planned
    else:
        assert planned or not checked


def test_slots_and_chunks_out_of_range() -> None:
    s = spec()
    pr = Pairing(side(s), side(s))
    p = Placement.simple(10, [0, 1, 2])
    with pytest.raises(PlacementError, match=r"decode aux slot 8 is out of range \[0, 8\)"):
        pr.plan(p, Placement.simple(10, [0, 1, 2], aux_slot=8))
    with pytest.raises(PlacementError, match=r"chunk \[4, 12\)"):
        pr.plan(p, p, 4, 12)
    with pytest.raises(PlacementError, match=r"prefill placement has 10 tokens, decode .* 9"):
        pr.plan(p, Placement.simple(9, [0, 1, 2]))
    with pytest.raises(PlacementError, match=r"the last chunk must end"):
        pr.plan(p, p, 0, 5, last=True)


def test_memory_that_does_not_fit_the_spec() -> None:
    s = spec(layers=1)
    par = ParallelLayout.even(1, 2)
    mem = build_memory(s, par, page_size=4, num_pages=4)
    # Claim the rank holds all 8 heads although at TP 2 it holds 4.
    wrong = dict(mem.buffers)
    k = wrong[(0, "k")]
    wrong[(0, "k")] = BufferLayout(
        k.region, 0, (Dim("page", 1, 256), Dim("token", 4, 64), Dim("elem", 32, 2)), "kv"
    )
    with pytest.raises(LayoutError, match=r"elem dim has 32 elements; at TP 2 a rank holds 64"):
        Side(s, par, SideMemory(mem.regions, wrong, mem.aux))
    with pytest.raises(LayoutError, match=r"past the end of region"):
        SideMemory(
            (Region("r", 10),),
            {},
            BufferLayout("r", 0, (Dim("slot", 2, 8), Dim("elem", 8, 1)), "aux"),
        )
    with pytest.raises(LayoutError, match=r"stride > 0"):
        Dim("token", 4, 0)


def test_bad_specs() -> None:
    with pytest.raises(SpecError, match=r"window is required for sliding layers"):
        from kvbridge.model.spec import LayerKind, LayerSpec

        LayerSpec(LayerKind.SLIDING, attention_layer(1, 1, DType.BFLOAT16).components)
    with pytest.raises(SpecError, match=r"unknown dtype 'float7'"):
        DType.parse("float7")
    with pytest.raises(SpecError, match=r"units and unit_size must be >= 1"):
        attention_layer(0, 8, DType.BFLOAT16)


def test_every_error_is_a_kvbridge_error() -> None:
    for cls in (SpecError, LayoutError, IncompatibleError, PlacementError):
        assert issubclass(cls, KVBridgeError) and issubclass(cls, ValueError)


def test_offsets_past_4_gib_are_exact() -> None:
    # 2**17 pages of 64 KiB per layer: a 8 GiB pool. The planner only describes it.
    s = spec(heads=8, head_dim=64, layers=1)
    par = ParallelLayout.even(1, 1)
    big = Side(s, par, build_memory(s, par, page_size=64, num_pages=2**17))
    pr = Pairing(big, big)
    ids = np.array([2**17 - 1, 5, 2**16 + 3])
    pl = pr.plan(Placement.simple(130, ids), Placement.simple(130, ids[::-1].copy()))
    runs = pl.pairs[0].runs
    page_bytes = 64 * 8 * 64 * 2
    assert int(runs.src_offset.max()) == (2**17 - 1) * page_bytes
    assert int(runs.src_offset.max()) > 2**32
    assert runs.src_offset.dtype == np.int64
