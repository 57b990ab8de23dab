"""Context parallelism: token maps, who sends which tokens to whom, and the bytes.

A side's tokens may be split over token shards: context-parallel groups (``cp``, each a whole
TP group) and DCP ranks inside a TP group (``dcp``, vLLM's decode context parallel). The
planner routes every token from the rank that holds it to the rank that will hold it, and
takes state and aux from the CP group holding the last token.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge import DType, ParallelLayout, Placement, Side, build_memory
from kvbridge.errors import LayoutError, PlacementError
from kvbridge.model.spec import CacheSpec, attention_layer, mamba2_layer, mla_layer
from kvbridge.planner.plan import Pairing
from kvbridge.planner.tokenmap import TokenMap, TokenSplit, co_shards, shared_runs
from kvbridge.planner.transferplan import PartKind
from oracle import check_bytes
from tiers import examples

BF16, F32 = DType.BFLOAT16, DType.FLOAT32
CONTIGUOUS, ZIGZAG, INTERLEAVED = TokenSplit.CONTIGUOUS, TokenSplit.ZIGZAG, TokenSplit.INTERLEAVED


# ---- token maps ------------------------------------------------------------------------------


@st.composite
def maps(draw: st.DrawFn) -> TokenMap:
    split = draw(st.sampled_from(list(TokenSplit)))
    return TokenMap(
        draw(st.integers(1, 6)), split, draw(st.integers(1, 7)) if split is INTERLEAVED else 1
    )


def brute_runs(m: TokenMap, shard: int, lo: int, hi: int, n: int) -> list[tuple[int, int, int]]:
    """(global start, local start, length) of the shard's tokens in [lo, hi), token by token."""
    t = np.arange(n)
    own = t[m.owner(t, n) == shard]
    out: list[list[int]] = []
    for local, g in enumerate(own.tolist()):
        if lo <= g < hi:
            if out and out[-1][0] + out[-1][2] == g:
                out[-1][2] += 1
            else:
                out.append([g, local, 1])
    return [(a, b, c) for a, b, c in out]


@settings(max_examples=examples(300), deadline=None)
@given(maps(), st.integers(1, 120), st.data())
def test_every_token_has_one_shard_and_a_dense_local_index(
    m: TokenMap, n: int, data: st.DataObject
) -> None:
    t = np.arange(n)
    owner, local = m.owner(t, n), m.local(t, n)
    assert owner.min() >= 0 and owner.max() < m.shards
    for k in range(m.shards):
        mine = owner == k
        # a shard's tokens, in order, sit at local indices 0, 1, 2, ...
        assert local[mine].tolist() == list(range(int(mine.sum())))
        assert m.count(k, n) == int(mine.sum())
        lo = data.draw(st.integers(0, n - 1))
        hi = data.draw(st.integers(lo + 1, n))
        g, loc, ln = m.runs(k, lo, hi, n)
        assert list(zip(g.tolist(), loc.tolist(), ln.tolist(), strict=True)) == brute_runs(
            m, k, lo, hi, n
        )
    assert m.holder(n) == int(owner[-1])


@settings(max_examples=examples(300), deadline=None)
@given(maps(), maps(), st.integers(1, 150), st.data())
def test_shards_sharing_tokens_match_token_by_token(
    a: TokenMap, b: TokenMap, n: int, data: st.DataObject
) -> None:
    t = np.arange(n)
    want = np.zeros((a.shards, b.shards), dtype=bool)
    want[a.owner(t, n), b.owner(t, n)] = True
    assert np.array_equal(co_shards(a, b, n), want)
    ka, kb = data.draw(st.integers(0, a.shards - 1)), data.draw(st.integers(0, b.shards - 1))
    lo = data.draw(st.integers(0, n - 1))
    hi = data.draw(st.integers(lo + 1, n))
    g, la, lb, ln = shared_runs(a, ka, b, kb, lo, hi, n)
    got = {
        int(x + i): (int(y + i), int(z + i))
        for x, y, z, c in zip(g, la, lb, ln, strict=True)
        for i in range(int(c))
    }
    both = [
        int(x)
        for x in t[lo:hi]
        if a.owner(np.array([x]), n)[0] == ka and b.owner(np.array([x]), n)[0] == kb
    ]
    assert got == {
        x: (int(a.local(np.array([x]), n)[0]), int(b.local(np.array([x]), n)[0])) for x in both
    }


def held_by(m: TokenMap, n: int) -> list[list[int]]:
    t = np.arange(n)
    return [t[m.owner(t, n) == k].tolist() for k in range(m.shards)]


def test_the_three_splits_as_engines_store_them() -> None:
    # contiguous: the prompt padded to a multiple of the shard count, then cut evenly
    assert held_by(TokenMap(2, CONTIGUOUS), 7) == [[0, 1, 2, 3], [4, 5, 6]]
    assert held_by(TokenMap(4, CONTIGUOUS), 5) == [[0, 1], [2, 3], [4], []]
    # zig-zag: 2K pieces, shard s holds pieces s and 2K-1-s (causal load balance)
    assert held_by(TokenMap(2, ZIGZAG), 8) == [[0, 1, 6, 7], [2, 3, 4, 5]]
    # vLLM's DCP with an interleave of 4: tokens 0-3 on rank 0, 4-7 on rank 1, 8-11 on rank 0
    assert held_by(TokenMap(2, INTERLEAVED, 4), 12) == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7]]
    assert TokenMap(2, ZIGZAG).local(np.array([6, 7]), 8).tolist() == [2, 3]


@pytest.mark.parametrize(
    "bad",
    [
        {"shards": 0},
        {"shards": 2, "split": CONTIGUOUS, "interleave": 4},
        {"interleave": 0},
        {"split": "zigzag"},
    ],
)
def test_a_bad_token_map_says_what_was_expected(bad: dict[str, object]) -> None:
    with pytest.raises(LayoutError, match="must be|applies to"):
        TokenMap(**bad)  # type: ignore[arg-type]


# ---- parallel layouts and routes -------------------------------------------------------------


def heads(h: int, layers: int = 2) -> CacheSpec:
    return CacheSpec(f"{h}kv", tuple(attention_layer(h, 8, BF16) for _ in range(layers)))


def side(
    spec: CacheSpec,
    tp: int,
    *,
    cp: int = 1,
    dcp: int = 1,
    split: TokenSplit = INTERLEAVED,
    interleave: int = 1,
    pp: int = 1,
    page: int = 4,
    pages: int = 64,
) -> Side:
    par = ParallelLayout.even(
        spec.num_layers, tp, pp, cp=cp, dcp=dcp, split=split, interleave=interleave
    )
    return Side(spec, par, build_memory(spec, par, page_size=page, num_pages=pages))


def test_engine_ranks_count_tp_then_cp_then_pp() -> None:
    par = ParallelLayout.even(4, tp=2, pp=2, cp=3, dcp=2)
    assert par.world == 12
    assert [par.coords(r) for r in (0, 1, 2, 5, 6, 11)] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 2, 1),
        (1, 0, 0),
        (1, 2, 1),
    ]
    assert [par.shard_of(r) for r in range(6)] == [0, 1, 2, 3, 4, 5]
    assert par.tokens.shards == 6


def test_dcp_needs_copies_of_every_head_to_split() -> None:
    with pytest.raises(LayoutError, match="must divide the TP size"):
        ParallelLayout.even(2, tp=4, dcp=3)
    # 8 KV heads at TP 4: each rank a different head pair, no copies to split tokens over
    with pytest.raises(LayoutError, match="has 1 holder"):
        side(heads(8), 4, dcp=2)
    with pytest.raises(LayoutError, match="2 holder.*not a multiple of 4"):
        side(heads(2), 4, dcp=4)
    side(heads(2), 4, dcp=2)  # 2 heads, 2 copies each: DCP 2 fits


# vLLM's DCP topology examples (tests/v1/kv_connector/unit/test_dcp_tp_kv_topology.py): 2 KV
# heads, 64 tokens in blocks of 16, interleave 16. There a prefill "TP=a DCP=b" is a*b ranks,
# rank h*b + c holding KV head group h (of a) and the tokens of DCP rank c; here that is TP a
# with CP b (kvbridge rank c*a + h). A decode "TP=t DCP=k" is vLLM's own DCP: t ranks, rank r
# holding head r*2//t and the tokens of DCP rank r % k; here TP t with DCP k, the same ranks.
@pytest.mark.parametrize(
    ("p_tp", "p_dcp", "d_tp", "d_dcp", "expected"),
    [
        (2, 2, 4, 2, [[0], [1], [2], [3]]),
        (2, 4, 4, 2, [[0, 2], [1, 3], [4, 6], [5, 7]]),
        (2, 2, 8, 4, [[0], [1], [0], [1], [2], [3], [2], [3]]),
        (1, 4, 4, 2, [[0, 2], [1, 3], [0, 2], [1, 3]]),
        (2, 1, 2, 1, [[0], [1]]),
        (2, 1, 4, 1, [[0], [0], [1], [1]]),
        (4, 1, 2, 1, [[0, 1], [2, 3]]),
    ],
)
def test_vllm_dcp_topology_examples(
    p_tp: int, p_dcp: int, d_tp: int, d_dcp: int, expected: list[list[int]]
) -> None:
    spec = heads(2)
    pr = Pairing(
        side(spec, p_tp, cp=p_dcp, interleave=16, page=16),
        side(spec, d_tp, dcp=d_dcp, interleave=16, page=16),
    )

    def vllm_rank(kvb: int) -> int:
        c, h = divmod(kvb, p_tp)
        return h * p_dcp + c

    got = [
        sorted(vllm_rank(p) for p, k in pr.senders_of(d, tokens=64).items() if PartKind.KV in k)
        for d in range(d_tp)
    ]
    assert got == expected


def test_state_and_aux_come_from_the_cp_group_holding_the_last_token() -> None:
    spec = CacheSpec(
        "hyb",
        (attention_layer(4, 8, BF16), mamba2_layer(8, 4, 2, 4, 4, conv_dtype=BF16, ssm_dtype=F32)),
    )
    pr = Pairing(side(spec, 2, cp=3, interleave=4), side(spec, 2))
    for n, group in [(4, 0), (8, 1), (12, 2), (13, 0), (30, 1)]:
        routes = pr.routes(n)
        tails = {p for (p, _), k in routes.items() if k & {PartKind.STATE, PartKind.AUX}}
        assert {p // 2 for p in tails} == {group}, n
        # only shards holding tokens owe KV: a 4-token request lives on CP group 0
        kv = {p // 2 for (p, _), k in routes.items() if PartKind.KV in k}
        assert kv == set(range(min(3, -(-n // 4))))
    with pytest.raises(ValueError, match="pass tokens"):
        pr.routes()


def test_placements_per_shard_must_match_the_shard_count() -> None:
    spec = heads(2)
    pr = Pairing(side(spec, 1, cp=2), side(spec, 1))
    p = Placement.simple(8, np.arange(2))
    with pytest.raises(PlacementError, match="3 placements for 2 token shards"):
        pr.plan([p, p, p], p)


# ---- bytes -----------------------------------------------------------------------------------


def shard_placement(par: ParallelLayout, n: int, page: int, seed: int) -> list[Placement]:
    """Each token shard's own pages (shuffled) and slots."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(par.tokens.shards):
        need = max(1, -(-par.tokens.count(k, n) // page))
        ids = rng.permutation(64)[:need]
        out.append(
            Placement(
                n, {"kv": ids}, {"state": int(rng.integers(0, 3)), "aux": int(rng.integers(0, 3))}
            )
        )
    return out


MLA = CacheSpec("mla", tuple(mla_layer(16, 4, BF16) for _ in range(3)))
HYBRID = CacheSpec(
    "hyb",
    (
        attention_layer(4, 8, BF16),
        mamba2_layer(8, 4, 2, 4, 4, conv_dtype=BF16, ssm_dtype=F32),
        attention_layer(4, 8, BF16),
    ),
)


@pytest.mark.parametrize(
    ("spec", "p", "d"),
    [
        (heads(4), {"tp": 2, "cp": 2, "split": CONTIGUOUS}, {"tp": 2}),  # prefill CP2 -> TP2
        (heads(4), {"tp": 1, "cp": 2, "split": ZIGZAG}, {"tp": 4}),
        (heads(2), {"tp": 1}, {"tp": 4, "dcp": 2, "interleave": 4}),  # decode DCP2 from TP1
        (MLA, {"tp": 4}, {"tp": 8, "dcp": 8, "interleave": 2}),  # DeepSeek's TP8 DCP8
        (MLA, {"tp": 2, "cp": 3, "split": ZIGZAG}, {"tp": 2, "dcp": 2, "interleave": 3}),
        (HYBRID, {"tp": 2, "cp": 2, "split": CONTIGUOUS}, {"tp": 4}),
        (HYBRID, {"tp": 1, "cp": 3, "interleave": 5}, {"tp": 2, "cp": 2, "interleave": 2}),
        (heads(4), {"tp": 2, "cp": 2, "split": ZIGZAG, "pp": 2}, {"tp": 1, "cp": 2}),
    ],
)
@pytest.mark.parametrize("n", [1, 7, 45])
def test_context_parallel_bytes(
    spec: CacheSpec, p: dict[str, object], d: dict[str, object], n: int
) -> None:
    ps, ds = side(spec, **p, page=4), side(spec, **d, page=8)  # type: ignore[arg-type]
    chunks = [(0, n)] if n < 3 else [(0, n // 3), (n // 3, n)]
    check_bytes(
        ps, ds, shard_placement(ps.parallel, n, 4, 1), shard_placement(ds.parallel, n, 8, 2), chunks
    )
    # and with one page table every shard shares (vLLM's DCP block tables)
    check_bytes(
        ps,
        ds,
        Placement.simple(n, np.arange(-(-n // 4)), state_slot=1, aux_slot=2),
        Placement.simple(n, np.arange(-(-n // 8))[::-1], state_slot=2, aux_slot=0),
        chunks,
        segment_bytes=64,
    )


def test_the_oracle_catches_state_from_the_wrong_cp_group(monkeypatch: pytest.MonkeyPatch) -> None:
    ps, ds = side(HYBRID, 2, cp=2, split=CONTIGUOUS), side(HYBRID, 2)
    src, dst = shard_placement(ps.parallel, 20, 4, 1), shard_placement(ds.parallel, 20, 4, 2)
    check_bytes(ps, ds, src, dst)
    real = Pairing._context
    monkeypatch.setattr(Pairing, "_context", lambda self, n: (real(self, n)[0], 0))
    with pytest.raises(AssertionError, match="differ from the reference"):
        check_bytes(ps, ds, src, dst)
