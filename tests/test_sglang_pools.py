"""SGLang's pools as kvbridge describes them, checked by bytes: numpy pools shaped and filled as
SGLang 0.5.23 allocates them (``MHATokenToKVPool``: per layer a K and a V buffer of
``[slots + page_size, heads of this rank, head_dim]``; ``MLATokenToKVPool``: one latent buffer a
layer), the page tables built the way the backend builds them from SGLang's sends
(``PrefillPages``, ``decode_placement``), every prefill rank's plan executed, and each decode
rank's pools compared with what SGLang's own layout says token ``t``'s head ``h`` must hold
there: at any pair of TP sizes (GQA replicas included: a head a rank holds is
``rank * heads // tp``), page sizes that differ, a decode prefix-cache hit (pages before it
untouched), and the aux metadata packed, moved and unpacked into another slot index.

SGLang's own transfer backends refuse different page sizes and computed replica offsets from
per-rank head counts (the seed reports); these are the layouts they got wrong.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.errors import LayoutError, PlacementError
from kvbridge.integrations.sglang.pools import (
    AuxPacker,
    PoolArgs,
    PrefillPages,
    decode_placement,
    describe,
)
from kvbridge.integrations.sglang.request import fingerprint
from kvbridge.integrations.sglang.states import StateArgs
from sglang_sends import pairing, run, sends
from tiers import examples

LAYERS, HEAD_DIM, SLOTS = 2, 4, 96  # slots: tokens a pool holds (SGLang adds a padded page)
AUX_ITEMS = (4 * 8, 4 * 2, 8 * 1)  # bytes of one slot of each metadata buffer (int32, f32, i64)
AUX_SLOTS = 6
CANARY = -7.0


class Rank:
    """One SGLang rank's pools: real numpy buffers, described through ``PoolArgs``."""

    def __init__(self, tp: int, rank: int, heads: int, page: int, mla: bool) -> None:
        self.local = 1 if mla else max(1, heads // tp)
        width = 1 if mla else self.local
        n = LAYERS if mla else 2 * LAYERS  # K of each layer, then V of each (MLA: latent)
        shape = (SLOTS + page, width, HEAD_DIM)
        self.kv = [np.full(shape, CANARY, dtype=np.float32) for _ in range(n)]
        self.aux = [np.zeros((AUX_SLOTS, b), dtype=np.uint8) for b in AUX_ITEMS]
        self.args = PoolArgs(
            kv_ptrs=tuple(b.ctypes.data for b in self.kv),
            kv_lens=tuple(b.nbytes for b in self.kv),
            kv_item_lens=tuple(b[0].nbytes * page for b in self.kv),
            page_size=page,
            kv_heads=0 if mla else self.local,
            total_kv_heads=0 if mla else heads,
            aux_ptrs=tuple(a.ctypes.data for a in self.aux),
            aux_lens=tuple(a.nbytes for a in self.aux),
            aux_item_lens=AUX_ITEMS,
            dtype="auto/float32",
            mla=mla,
            tp=tp,
            tp_rank=rank,
        )
        self.d = describe(self.args)
        self.kvb_aux = np.zeros(self.d.memory.region("aux").nbytes, dtype=np.uint8)
        self.packer = AuxPacker(self.kvb_aux.ctypes.data, self.args.aux_ptrs, AUX_ITEMS)

    def view(self, name: str) -> np.ndarray:
        if name == "aux":
            return self.kvb_aux
        names = [n for n, _, _ in self.d.regions]
        return self.kv[names.index(name)].reshape(-1).view(np.uint8)

    def heads_held(self, tp: int, rank: int, heads: int, mla: bool) -> list[int]:
        if mla:
            return [0]
        if heads >= tp:
            return list(range(rank * self.local, (rank + 1) * self.local))
        return [rank * heads // tp]  # a replica: SGLang's rank r holds head r * heads // tp


def value(buf: int, token: int, head: int) -> np.ndarray:
    """What the prefill computed for buffer ``buf`` (K/V of a layer), ``token``, global
    ``head``: distinct per element, so a byte in the wrong place shows."""
    base = buf * 1_000_000 + token * 1000 + head * 10
    return base + np.arange(HEAD_DIM, dtype=np.float32)


def pages_for(tokens: int, page: int, rng: np.random.Generator, pool_pages: int) -> np.ndarray:
    """Distinct pages of a pool for a request (page 0 is SGLang's padding: never used)."""
    n = -(-tokens // page)
    return rng.choice(np.arange(1, pool_pages), size=n, replace=False).astype(np.int64)


def layouts() -> st.SearchStrategy[tuple[int, int, int]]:
    """(total KV heads, prefill TP, decode TP), each TP valid for the heads on its side."""

    def ok(heads: int, tp: int) -> bool:
        return heads % tp == 0 if heads >= tp else tp % heads == 0

    return st.tuples(
        st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4])
    ).filter(lambda t: ok(t[0], t[1]) and ok(t[0], t[2]))


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=layouts(),
    pages=st.tuples(st.sampled_from([1, 4, 16]), st.sampled_from([1, 8, 32])),
    tokens=st.integers(1, 80),
    hit=st.integers(0, 3),
    chunk=st.sampled_from([0, 16, 32]),
    mla=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_sglang_pools_move_exactly(
    layout: tuple[int, int, int],
    pages: tuple[int, int],
    tokens: int,
    hit: int,
    chunk: int,
    mla: bool,
    seed: int,
) -> None:
    heads, ptp, dtp = layout
    ppage, dpage = pages
    rng = np.random.default_rng(seed)
    # A decode prefix hit is whole decode pages (SGLang's radix cache matches pages).
    start = min(hit * dpage, (tokens - 1) // dpage * dpage)
    prefill = [Rank(ptp, r, heads, ppage, mla) for r in range(ptp)]
    decode = [Rank(dtp, r, heads, dpage, mla) for r in range(dtp)]
    p_ids = pages_for(tokens, ppage, rng, prefill[0].d.num_pages)
    d_ids = pages_for(tokens, dpage, rng, decode[0].d.num_pages)
    src_aux, dst_aux = int(rng.integers(AUX_SLOTS)), int(rng.integers(AUX_SLOTS))

    for r, pr in enumerate(prefill):  # the prefill's forward fills its pools
        for b, buf in enumerate(pr.kv):
            for t in range(tokens):
                slot = p_ids[t // ppage] * ppage + t % ppage
                for i, h in enumerate(pr.heads_held(ptp, r, heads, mla)):
                    buf[slot, i] = value(b, t, h)
    # The first output token and its metadata: the same on every TP rank, as SGLang's are.
    want_aux = [rng.integers(0, 256, size=n, dtype=np.uint8) for n in AUX_ITEMS]
    for pr in prefill:
        for a, want in zip(pr.aux, want_aux, strict=True):
            a[src_aux] = want

    dst = decode_placement(tokens, start, dpage, d_ids[start // dpage :].tolist(), dst_aux)
    pair = pairing(prefill, decode)
    # SGLang's sends: from the decode's prefix, chunks ending on prefill pages, then the rest.
    table = PrefillPages(tokens, start, ppage, src_aux)
    for stop in sends(tokens, start, chunk, ppage):
        begin = table.stop
        sent = p_ids[begin // ppage : -(-stop // ppage)]
        assert table.add(sent.tolist(), stop - begin) == stop
        if stop == tokens:
            for pr in prefill:
                pr.packer.pack(src_aux)
        run(pair.plan(table.placement(), dst, begin, stop), prefill, decode)
    assert table.stop == tokens

    for r, dr in enumerate(decode):
        held = dr.heads_held(dtp, r, heads, mla)
        for b, buf in enumerate(dr.kv):
            expect = np.full_like(buf, CANARY)
            for t in range(start, tokens):
                slot = d_ids[t // dpage] * dpage + t % dpage
                for i, h in enumerate(held):
                    expect[slot, i] = value(b, t, h)
            np.testing.assert_array_equal(buf, expect, err_msg=f"decode rank {r} buffer {b}")
        dr.packer.unpack(dst_aux)
        for a, want in zip(dr.aux, want_aux, strict=True):
            assert bytes(a[dst_aux]) == bytes(want)


def test_pools_refuse_what_they_cannot_describe() -> None:
    r = Rank(2, 0, 4, 4, False)
    mamba = StateArgs("mamba", (r.args.kv_ptrs[0],), (64,), (16,), (0,))
    with pytest.raises(LayoutError, match="extra state .*'mamba'.* needs the model's config"):
        describe(PoolArgs(**{**r.args.__dict__, "states": (mamba,)}))
    for kind in ("qsa_pending", "swa_ring"):  # SGLang state types not described yet
        other = StateArgs(kind, (r.args.kv_ptrs[0],), (64,), (16,))
        with pytest.raises(LayoutError, match=f"state type '{kind}'"):
            describe(PoolArgs(**{**r.args.__dict__, "states": (other,), "model": {"x": 1}}))
    dsa = StateArgs("dsa", (r.args.kv_ptrs[0],), (64,), (16,))
    with pytest.raises(LayoutError, match="DSA indexer state beside"):  # not an MLA pool
        describe(PoolArgs(**{**r.args.__dict__, "states": (dsa,), "model": {"x": 1}}))
    with pytest.raises(LayoutError, match="do not make the model's 8 KV heads"):
        describe(PoolArgs(**{**r.args.__dict__, "total_kv_heads": 8}))
    with pytest.raises(LayoutError, match="even count"):
        args = r.args.__dict__
        describe(
            PoolArgs(**{**args, **{k: args[k][:3] for k in ("kv_ptrs", "kv_lens", "kv_item_lens")}})
        )
    with pytest.raises(LayoutError, match="as many of each"):
        describe(PoolArgs(**{**r.args.__dict__, "aux_lens": ()}))


def test_pages_refused_with_what_was_expected() -> None:
    with pytest.raises(PlacementError, match=r"expected 2\)"):
        decode_placement(40, 16, 16, [3, 4, 5], aux=0)
    table = PrefillPages(40, 0, 16, aux=0)
    assert table.pages_to_send() == 3
    with pytest.raises(PlacementError, match="the request has 3 pages"):
        table.add([1, 2, 3, 4], None)
    assert table.add([7], None) == 16
    with pytest.raises(PlacementError, match="30 tokens from token 16 in 1 pages"):
        table.add([8], 30)


def test_the_pools_are_where_sglang_keeps_them_the_servers_gpu_or_the_host() -> None:
    from kvbridge.integrations.sglang.internals import UnsupportedSGLang, kv_location
    from kvbridge.memory.location import HOST, cuda

    assert kv_location("cpu", 3) == HOST  # SGLang's CPU build: --device cpu
    assert kv_location("cuda", 3) == cuda(3)  # KVArgs.gpu_id: the scheduler's GPU
    with pytest.raises(UnsupportedSGLang, match="'npu'"):
        kv_location("npu", 0)


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.integers(0, (1 << 31) - 1), max_size=600))
def test_a_requests_fingerprint_is_its_tokens_digest_from_a_list_or_an_array(
    ids: list[int],
) -> None:
    """Both servers of a request digest its tokens alike whatever holds them (SGLang's lists,
    an array): the 64-bit little-endian ids, as they always were."""
    want = hashlib.blake2b(np.asarray(ids, dtype="<i8").tobytes(), digest_size=16).digest()
    assert fingerprint(ids) == want
    assert fingerprint(np.asarray(ids, dtype=np.int32)) == want
    assert fingerprint([float(i) for i in ids]) == want  # not ints: read as numpy reads them
