"""Components of one entry every few tokens (DeepSeek V4's compressed attention): a request
of ``n`` tokens has ``n // stride`` of them, entry ``e`` travels with the chunk holding token
``(e + 1) * stride - 1``, a page holds ``page_size // stride``; byte for byte against the
reference re-shard (which walks tokens and keeps those that close a window, no planner code),
and every way of getting it wrong refused in one line. The hypothesis grid draws the kind too
(``tests/strategies.py``: ``"compressed"``)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kvbridge import (
    CacheSpec,
    DType,
    IncompatibleError,
    LayoutError,
    Pairing,
    ParallelLayout,
    Placement,
    PlacementError,
    Side,
    SpecError,
    build_memory,
)
from kvbridge.model.spec import Component, LayerKind, LayerSpec, Scope, Segment, attention_layer
from kvbridge.model.states import compressed_layer
from kvbridge.planner.layout import KVLayout, token_dims
from oracle import check_bytes

RATE = 4


def spec() -> CacheSpec:
    """A sliding window's attention and the compressed entries beside it (with the indexer's
    keys in one layer), as a DeepSeek V4 layer is described, and a full attention layer."""
    return CacheSpec(
        "v4-like",
        (
            attention_layer(1, 8, DType.BFLOAT16, window=6),
            compressed_layer(RATE, 8, DType.BFLOAT16, indexer_dim=4),
            attention_layer(2, 4, DType.BFLOAT16),
            compressed_layer(RATE, 8, DType.BFLOAT16),
        ),
    )


def side(tp: int = 1, page: int = 8, pages: int = 16, **parallel: object) -> Side:
    s = spec()
    par = ParallelLayout.even(s.num_layers, tp, **parallel)  # type: ignore[arg-type]
    return Side(s, par, build_memory(s, par, page_size=page, num_pages=pages))


@pytest.mark.parametrize(
    ("ptp", "dtp", "pages", "chunks", "held"),
    [
        (1, 1, (8, 8), [(0, 23)], 0),
        (2, 1, (8, 4), [(0, 6), (6, 13), (13, 17), (17, 23)], 0),
        (1, 2, (4, 16), [(0, 3), (3, 4), (4, 23)], 0),
        (2, 2, (16, 8), [(0, 11), (11, 23)], 9),  # a prefix of 9 held: entries 0 and 1
    ],
)
def test_entries_land_byte_for_byte_across_tp_pages_chunks_and_prefixes(
    ptp: int, dtp: int, pages: tuple[int, int], chunks: list[tuple[int, int]], held: int
) -> None:
    n = 23  # 5 entries of 4 tokens; tokens 20-22 close none
    p, d = side(ptp, pages[0]), side(dtp, pages[1])
    src = Placement.simple(n, np.arange(3, 3 + -(-n // pages[0])))
    ids = np.arange(5, 5 + -(-n // pages[1]))
    dst = Placement(n, {"kv": ids}, {"state": 0, "aux": 0}, held)
    check_bytes(p, d, src, dst, chunks)


def test_a_chunk_carries_the_entries_its_tokens_close_and_no_other() -> None:
    """Chunks [0, 6), [6, 13), [13, 23) of 23 tokens close entries [0, 1), [1, 3), [3, 5):
    the bytes of each chunk's plan for the compressed entries are exactly those entries' (the
    unclosed window's buffers and the overlap, state, travel with the last chunk)."""
    pairing = Pairing(side(), side())
    src = Placement.simple(23, np.arange(3))
    dst = Placement.simple(23, np.arange(4, 7))
    entry = {1: 8 * 2 + 4 * 2, 3: 8 * 2}  # kv (+ index_k) bytes of one entry, by layer
    for (a, b), closed in zip([(0, 6), (6, 13), (13, 23)], [1, 2, 2], strict=True):
        for li, nbytes in entry.items():
            plan = pairing.plan(src, dst, a, b, last=False, layers=range(li, li + 1))
            assert sum(pp.runs.total_bytes for pp in plan.pairs) == closed * nbytes, (a, b, li)
    assert sum(p.runs.total_bytes for p in pairing.plan(src, dst, 20, 23, last=False).pairs) == (
        3 * (8 * 2) * 2 + 3 * (2 * 4 * 2) * 2  # tokens 20-22 of the attention layers' K and V
    )


def test_a_page_of_tokens_must_hold_whole_entries() -> None:
    with pytest.raises(LayoutError, match=r"a page of 6 tokens holds no whole number .* every 4"):
        side(page=6)


def test_a_context_parallel_side_is_refused_with_compressed_entries() -> None:
    with pytest.raises(IncompatibleError, match=r"\['index_k', 'kv'\] keep one entry every"):
        Pairing(side(cp=2), side())


def test_a_stride_is_for_per_token_components_outside_windows() -> None:
    kv = (Segment("kv", 1, 8),)
    with pytest.raises(SpecError, match="stride must be >= 1, and 1 for a state component"):
        Component("tail", Scope.STATE, kv, DType.BFLOAT16, stride=4)
    with pytest.raises(SpecError, match="stride must be >= 1"):
        Component("kv", Scope.TOKEN, kv, DType.BFLOAT16, stride=0)
    strided = Component("kv", Scope.TOKEN, kv, DType.BFLOAT16, stride=4)
    with pytest.raises(SpecError, match=r"components \['kv'\] of one entry every few tokens"):
        LayerSpec(LayerKind.SLIDING, (strided,), window=8)


def test_the_stride_travels_in_the_spec_and_a_difference_is_named() -> None:
    s = spec()
    assert CacheSpec.from_dict(s.to_dict()) == s
    plain = CacheSpec("m", (attention_layer(2, 4, DType.BFLOAT16),))
    assert "stride" not in str(plain.to_dict())  # specs of one entry a token read as before
    other = CacheSpec("v4-like", (*s.layers[:3], compressed_layer(RATE * 2, 8, DType.BFLOAT16)))
    assert s.describe_difference(other) == (
        "layer 3 component 'kv': kv[token every 4 tokens rows=1 kv=1x8 bfloat16] vs "
        "kv[token every 8 tokens rows=1 kv=1x8 bfloat16]"
    )


def test_a_placement_short_of_pages_names_the_entry_it_misses() -> None:
    """A compressed layer alone: 32 tokens are 8 entries, 2 a page of 8 tokens; 3 pages given
    where 4 are needed."""
    only = CacheSpec("c", (compressed_layer(RATE, 8, DType.BFLOAT16),))
    par = ParallelLayout.even(1, 1)
    s = Side(only, par, build_memory(only, par, page_size=8, num_pages=8))
    pairing = Pairing(s, s)
    with pytest.raises(PlacementError, match=r"entry \(one every 4 tokens\) 7 needs page index 3"):
        pairing.check_placement(Placement.simple(32, np.arange(3)), "prefill")


def test_a_layout_whose_entries_page_apart_from_their_tokens_is_refused() -> None:
    """One page table indexes a group's buffers alike: a buffer of entries laid out with a page
    of 8 entries (32 tokens) beside pages of 8 tokens is refused, naming both."""
    s = spec()
    par = ParallelLayout.even(s.num_layers, 1)
    mem = build_memory(s, par, page_size=8, num_pages=4)
    comp = s.layers[3].components[0]
    dims, _ = token_dims(replace(comp, stride=1), 1, 8, 1, KVLayout.NHD)  # (its region's size)
    wrong = replace(mem.buffers[(3, "kv")], dims=dims)
    with pytest.raises(LayoutError, match=r"'kv'.*layer 0 k: 8 tokens, layer 3 kv: 32 tokens"):
        Side(s, par, replace(mem, buffers={**mem.buffers, (3, "kv"): wrong}))
