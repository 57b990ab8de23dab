"""SGLang's MLA pools as kvbridge describes them, checked by bytes: numpy pools shaped and filled
as SGLang 0.5.23 allocates an ``MLATokenToKVPool`` (one latent buffer a layer, ``[slots, 1,
kv_cache_dim]``) and a ``DSATokenToKVPool`` (DeepSeek-V3.2: beside the latent, each layer's
indexer keys, ``[pages, page_size * 132]`` bytes: a page holds the 128 fp8 key bytes of each of
its tokens, then the 4 scale bytes of each; a layer that reuses the previous layer's top-k has an
empty buffer), every prefill rank's plan executed across TP sizes and page sizes, and each decode
rank's pools compared with the request's tokens, which every rank holds whole (MLA replicates).

The oracle is written here from SGLang's layout (``mem_cache/index_key_cache.py``: "each
physical page stores all key bytes followed by all scale bytes"), not from kvbridge's planner.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.errors import LayoutError, PlacementError
from kvbridge.integrations.sglang.pools import PoolArgs, PrefillPages, decode_placement, describe
from kvbridge.integrations.sglang.states import StateArgs, StateIndices
from kvbridge.model.spec import LayerKind
from sglang_sends import pairing, run, sends
from tiers import examples

LATENT, KEY, SCALE = 20, 128, 4  # bytes a token
PAGES, AUX, CANARY = 96, 8, 0xA5
SKIP = (False, True, False)  # layer 1 reuses layer 0's top-k: no indexer keys


class Rank:
    """One SGLang rank's MLA pool (and DSA indexer), as ``KVArgs``."""

    def __init__(self, tp: int, rank: int, page: int, dsa: bool, kpool: int = 1) -> None:
        self.page, self.dsa = page, dsa
        self.latent = [np.full((PAGES * page, 1, LATENT), CANARY, np.uint8) for _ in SKIP]
        row = page // kpool * (KEY + SCALE)
        self.index = [
            np.full((0 if skip else PAGES, row), CANARY, np.uint8) for skip in SKIP if dsa
        ]
        states = ()
        if dsa:
            states = (
                StateArgs(
                    "dsa",
                    tuple(b.ctypes.data for b in self.index),
                    tuple(b.nbytes for b in self.index),
                    tuple(b[0].nbytes if len(b) else 0 for b in self.index),
                ),
            )
        self.aux = np.zeros((4, AUX), np.uint8)
        self.args = PoolArgs(
            kv_ptrs=tuple(b.ctypes.data for b in self.latent),
            kv_lens=tuple(b.nbytes for b in self.latent),
            kv_item_lens=tuple(b[0].nbytes * page for b in self.latent),
            page_size=page,
            kv_heads=0,
            total_kv_heads=0,
            aux_ptrs=(self.aux.ctypes.data,),
            aux_lens=(self.aux.nbytes,),
            aux_item_lens=(AUX,),
            dtype="fp8_e4m3/bfloat16",
            mla=True,
            tp=tp,
            tp_rank=rank,
            states=states,
        )

    def describe(self) -> None:
        self.d = describe(self.args)
        self.kvb_aux = np.zeros(self.d.memory.region("aux").nbytes, dtype=np.uint8)
        self.by_addr = {a.ctypes.data: a for a in (*self.latent, *self.index) if a.size}

    def view(self, name: str) -> np.ndarray:
        if name == "aux":
            return self.kvb_aux
        ptr = {n: p for n, p, _ in self.d.regions}[name]
        return self.by_addr[ptr].reshape(-1)

    def write(self, layer: int, token: int, slot: int, cache: dict[str, np.ndarray]) -> None:
        """What SGLang's forward stores for ``token`` at pool slot ``slot``."""
        self.latent[layer][slot, 0] = cache["latent"][layer, token]
        if self.dsa and not SKIP[layer]:
            page, i = divmod(slot, self.page)
            buf = self.index[layer]
            buf[page, i * KEY : (i + 1) * KEY] = cache["key"][layer, token]
            at = self.page * KEY + i * SCALE
            buf[page, at : at + SCALE] = cache["scale"][layer, token]


@settings(max_examples=examples(80), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dsa=st.booleans(),
    tps=st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4])),
    pages=st.tuples(st.sampled_from([1, 4, 16]), st.sampled_from([1, 4, 16])),
    tokens=st.integers(1, 90),
    hit=st.integers(0, 2),
    chunk=st.sampled_from([0, 16, 32]),
    seed=st.integers(0, 2**32 - 1),
)
def test_mla_and_dsa_pools_move_exactly(
    dsa: bool,
    tps: tuple[int, int],
    pages: tuple[int, int],
    tokens: int,
    hit: int,
    chunk: int,
    seed: int,
) -> None:
    (ptp, dtp), (ppage, dpage) = tps, pages
    rng = np.random.default_rng(seed)
    start = min(hit * dpage, (tokens - 1) // dpage * dpage)  # a decode prefix hit: whole pages
    prefill = [Rank(ptp, r, ppage, dsa) for r in range(ptp)]
    decode = [Rank(dtp, r, dpage, dsa) for r in range(dtp)]
    for r in (*prefill, *decode):
        r.describe()
    cache = {
        name: rng.integers(0, 256, (len(SKIP), tokens, n), dtype=np.uint8)
        for name, n in (("latent", LATENT), ("key", KEY), ("scale", SCALE))
    }
    p_ids = rng.choice(np.arange(PAGES), -(-tokens // ppage), replace=False)
    d_ids = rng.choice(np.arange(PAGES), -(-tokens // dpage), replace=False)
    for pr in prefill:  # the prefill's forward: every rank holds every token (MLA replicates)
        for layer in range(len(SKIP)):
            for t in range(tokens):
                pr.write(layer, t, p_ids[t // ppage] * ppage + t % ppage, cache)
    # The DSA state indices both sides give (the request's KV pages; not relied on).
    d_state = [d_ids[start // dpage :].tolist()] if dsa else None
    dst = decode_placement(
        tokens,
        start,
        dpage,
        d_ids[start // dpage :].tolist(),
        1,
        StateIndices.parse(decode[0].args.states, d_state),
    )
    pair = pairing(prefill, decode)
    pp = PrefillPages(tokens, start, ppage, 1)
    for stop in sends(tokens, start, chunk, ppage):
        begin, last = pp.stop, stop == tokens
        given_ = [p_ids[start // ppage :].tolist()] if dsa and last else None
        pp.add(
            p_ids[pp.stop // ppage : -(-stop // ppage)].tolist(),
            stop - pp.stop,
            StateIndices.parse(prefill[0].args.states, given_) if last else StateIndices(),
        )
        run(pair.plan(pp.placement(), dst, begin, stop), prefill, decode)

    for dr in decode:
        want = Rank(dtp, 0, dpage, dsa)  # canaries, then what SGLang's decode holds
        for layer in range(len(SKIP)):
            for t in range(start, tokens):
                want.write(layer, t, d_ids[t // dpage] * dpage + t % dpage, cache)
        for got, expect in zip((*dr.latent, *dr.index), (*want.latent, *want.index), strict=True):
            np.testing.assert_array_equal(got, expect)


def test_the_indexer_and_latent_are_each_layer_s_own() -> None:
    """The spec says which layers carry indexer keys; both components lie in one buffer."""
    r = Rank(1, 0, 4, dsa=True)
    r.describe()
    kinds = [layer.kind for layer in r.d.spec.layers]
    assert kinds == [LayerKind.MLA_INDEXER, LayerKind.MLA, LayerKind.MLA_INDEXER]
    assert [c.name for c in r.d.spec.layers[0].components] == ["latent", "index_k", "index_scale"]
    assert [name for name, _, _ in r.d.regions] == [
        "L0.latent",
        "L0.index",
        "L1.latent",
        "L2.latent",
        "L2.index",
    ]
    # A side with the indexer and one without are not one cache: refused at pairing.
    plain = Rank(1, 0, 4, dsa=False)
    plain.describe()
    assert plain.d.spec != r.d.spec


def test_what_kvbridge_does_not_describe_is_refused_naming_it() -> None:
    with pytest.raises(LayoutError, match="index_kpool"):  # pooled index keys: half the bytes
        Rank(1, 0, 4, dsa=True, kpool=2).describe()
    r = Rank(1, 0, 4, dsa=True)
    draft = StateArgs(
        "dsa", r.args.states[0].ptrs * 2, r.args.states[0].lens * 2, r.args.states[0].item_lens * 2
    )
    with pytest.raises(LayoutError, match="draft"):
        describe(PoolArgs(**{**r.args.__dict__, "states": (draft,)}))
    tail = StateArgs("dsa_tail", (r.aux.ctypes.data,), (8,), (8,))
    with pytest.raises(LayoutError, match="dsa_tail"):
        describe(PoolArgs(**{**r.args.__dict__, "states": (*r.args.states, tail)}))
    with pytest.raises(LayoutError, match="empty"):  # an elided buffer is DSA's alone
        StateArgs("mamba", (1,), (0,), (0,))
    with pytest.raises(PlacementError, match="integer"):
        StateIndices.parse(r.args.states, [["a", "b"]])
