"""SGLang's hybrid pools as kvbridge describes them, checked by bytes: numpy pools shaped and
filled as SGLang 0.5.23 allocates them for a Mamba2 hybrid (Nemotron-H), a gated-delta-net
hybrid (Qwen3-Next) and a model with a sliding-window sub-pool (``SWAKVPool``), the page tables
and state slots built the way the backend builds them from SGLang's sends and state indices,
every prefill rank's plan executed, and each decode rank's pools compared with what SGLang's own
sharding puts there: a Mamba conv slot is ``[conv_dim / tp, K - 1]``, its channels the rank's
share of each segment in turn (x | B | C; q | k | v), a temporal slot the rank's heads.

The oracle is written here from SGLang's layout, not from kvbridge's planner: each logical state
is drawn whole, and each rank's slot is cut from it by the sharded-axis rule (a segment of
``units`` split over TP ``t``: rank ``r`` holds ``[r*units/t, (r+1)*units/t)``, or the one unit
``r*units//t`` where units < t).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.errors import LayoutError, PlacementError
from kvbridge.integrations.sglang.pools import PoolArgs, PrefillPages, decode_placement, describe
from kvbridge.integrations.sglang.states import StateArgs, StateIndices
from kvbridge.planner.parallel import ParallelLayout
from kvbridge.planner.plan import Pairing, Side
from sglang_sends import pairing, run, sends
from tiers import examples

HEAD_DIM, SLOTS, STATE_SLOTS, AUX = 8, 96, 5, 16
K_1 = 3  # conv kernel 4: three steps kept
CANARY = 0xA5

NEMOTRON_H = {  # Mamba2 in layers 0 and 2, attention in 1, an MLP in 3
    "model_type": "nemotron_h",
    "architectures": ["NemotronHForCausalLM"],
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "layers_block_type": ["mamba", "attention", "mamba", "mlp"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": HEAD_DIM,
    "ssm_state_size": 4,
    "mamba_num_heads": 8,
    "mamba_head_dim": 4,
    "n_groups": 2,
    "conv_kernel": K_1 + 1,
    "expand": 1,
}
QWEN3_NEXT = {  # gated delta net in layer 0, full attention in 1
    "model_type": "qwen3_next",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": HEAD_DIM,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 4,
    "linear_value_head_dim": 4,
    "linear_conv_kernel_dim": K_1 + 1,
}
WINDOW = 12  # the config's (inclusive)
SGLANG_WINDOW = WINDOW - 1  # SGLang's scheduler's, exclusive (gpt-oss, Mellum: the config's - 1)
SLIDING = {  # a sliding-window layer (SGLang's SWA sub-pool), then full attention
    "model_type": "mistral",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "layer_types": ["sliding_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": HEAD_DIM,
    "sliding_window": WINDOW,
}
KIMI_LINEAR = {  # Kimi delta attention in layers 0 and 2 (1-based in the config), MLA in 1
    "model_type": "kimi_linear",
    "hidden_size": 32,
    "num_hidden_layers": 3,
    "kv_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "linear_attn_config": {
        "kda_layers": [1, 3],
        "full_attn_layers": [2],
        "num_heads": 4,
        "head_dim": 4,
        "short_conv_kernel_size": K_1 + 1,
    },
}
# Per model: (segments of the conv channels, as (units, unit size); temporal heads, head bytes/4)
STATES = {
    "nemotron_h": ([(8, 4), (2, 4), (2, 4)], 8, 16),  # x | B | C; heads x (head_dim x state)
    "qwen3_next": ([(2, 4), (2, 4), (4, 4)], 4, 16),  # q | k | v; value heads x (V x K)
    "kimi_linear": ([(4, 4), (4, 4), (4, 4)], 4, 16),  # q | k | v; heads x (K x V)
}
MODELS = {
    "nemotron_h": NEMOTRON_H,
    "qwen3_next": QWEN3_NEXT,
    "mistral": SLIDING,
    "kimi_linear": KIMI_LINEAR,
}
MLA = {"kimi_linear"}  # an MLA full pool: one latent buffer a layer, whole on every rank
SD = {"kimi_linear"}  # a conv slot is [K - 1, channels], not [channels, K - 1]


def held(units: int, tp: int, rank: int) -> list[int]:
    """The units of a segment a rank holds (the sharded-axis rule, as SGLang shards)."""
    if units >= tp:
        n = units // tp
        return list(range(rank * n, (rank + 1) * n))
    return [rank * units // tp]


@dataclass
class Logical:
    """A request's whole state and KV, drawn once: what every rank's pools are cut from."""

    conv: dict[int, np.ndarray]  # layer -> [channels, K-1] uint16 (bf16 bytes)
    temporal: dict[int, np.ndarray]  # layer -> [heads, unit] uint32 (fp32 bytes)

    @staticmethod
    def draw(model: str, layers: list[int], rng: np.random.Generator) -> Logical:
        if model not in STATES:
            return Logical({}, {})
        segs, heads, unit = STATES[model]
        channels = sum(u * s for u, s in segs)
        return Logical(
            {li: rng.integers(0, 2**16, (channels, K_1), dtype=np.uint16) for li in layers},
            {li: rng.integers(0, 2**32, (heads, unit), dtype=np.uint32) for li in layers},
        )

    def conv_of(self, model: str, layer: int, tp: int, rank: int) -> np.ndarray:
        """A rank's conv slot as SGLang stores it."""
        segs, _, _ = STATES[model]
        rows, base = [], 0
        for units, size in segs:
            for u in held(units, tp, rank):
                rows.extend(range(base + u * size, base + (u + 1) * size))
            base += units * size
        slot = self.conv[layer][rows]
        return slot.T if model in SD else slot

    def temporal_of(self, model: str, layer: int, tp: int, rank: int) -> np.ndarray:
        _, heads, _ = STATES[model]
        return self.temporal[layer][held(heads, tp, rank)]


def kv_value(layer: int, which: int, token: int, head: int) -> np.ndarray:
    base = layer * 1_000_000 + which * 500_000 + token * 1000 + head * 10
    return (base + np.arange(HEAD_DIM)).astype(np.float32)


class Rank:
    """One SGLang rank's pools: full attention (K of each layer, then V), the sliding-window
    sub-pool or the Mamba pool (conv of each layer, then temporal), aux; as ``KVArgs``."""

    def __init__(
        self, model: str, tp: int, rank: int, page: int, swa_page: int, window: int | None = None
    ) -> None:
        config = MODELS[model]
        self.model, self.tp, self.rank, self.page = model, tp, rank, page
        kinds = {
            "nemotron_h": ["M", "A", "M"],
            "qwen3_next": ["M", "A"],
            "mistral": ["S", "A"],
            "kimi_linear": ["M", "A", "M"],
        }
        self.full = [i for i, k in enumerate(kinds[model]) if k == "A"]
        self.sliding = [i for i, k in enumerate(kinds[model]) if k == "S"]
        self.mamba = [i for i, k in enumerate(kinds[model]) if k == "M"]
        mla = model in MLA
        self.heads = [0] if mla else held(2, tp, rank)  # MLA: the one latent, a "head"
        width = len(self.heads)
        self.kv = [
            np.full((SLOTS + page, width, HEAD_DIM), CANARY, np.uint32).view(np.float32)
            for _ in range((1 if mla else 2) * len(self.full))
        ]
        self.swa = [
            np.full((SLOTS + swa_page, width, HEAD_DIM), CANARY, np.uint32).view(np.float32)
            for _ in range(2 * len(self.sliding))
        ]
        states = []
        if self.mamba:
            segs, heads, unit = STATES[model]
            dim = sum(len(held(u, tp, rank)) * s for u, s in segs)
            shape = (K_1, dim) if model in SD else (dim, K_1)
            self.conv = [np.full((STATE_SLOTS + 1, *shape), CANARY, np.uint16) for _ in self.mamba]
            self.temporal = [
                np.full((STATE_SLOTS + 1, len(held(heads, tp, rank)), unit), CANARY, np.uint32)
                for _ in self.mamba
            ]
            bufs = [*self.conv, *self.temporal]
            states.append(
                StateArgs(
                    "mamba",
                    tuple(b.ctypes.data for b in bufs),
                    tuple(b.nbytes for b in bufs),
                    tuple(b[0].nbytes for b in bufs),
                    tuple(self.mamba) * 2,
                )
            )
        if self.sliding:
            states.append(
                StateArgs(
                    "swa",
                    tuple(b.ctypes.data for b in self.swa),
                    tuple(b.nbytes for b in self.swa),
                    tuple(b[0].nbytes * swa_page for b in self.swa),
                )
            )
        self.aux = np.zeros((4, AUX), np.uint8)
        self.args = PoolArgs(
            kv_ptrs=tuple(b.ctypes.data for b in self.kv),
            kv_lens=tuple(b.nbytes for b in self.kv),
            kv_item_lens=tuple(b[0].nbytes * page for b in self.kv),
            page_size=page,
            kv_heads=0 if mla else width,
            total_kv_heads=0 if mla else 2,
            aux_ptrs=(self.aux.ctypes.data,),
            aux_lens=(self.aux.nbytes,),
            aux_item_lens=(AUX,),
            dtype="auto/float32",
            mla=mla,
            tp=tp,
            tp_rank=rank,
            states=tuple(states),
            kv_layer_ids=tuple(self.full) * (len(self.kv) // len(self.full)),
            model=config,
            window=(window or SGLANG_WINDOW) if self.sliding else None,
        )
        self.d = describe(self.args)
        self.kvb_aux = np.zeros(self.d.memory.region("aux").nbytes, dtype=np.uint8)
        arrays = [*self.kv, *self.swa, *getattr(self, "conv", []), *getattr(self, "temporal", [])]
        self.by_addr = {a.ctypes.data: a for a in arrays}

    def view(self, name: str) -> np.ndarray:
        if name == "aux":
            return self.kvb_aux
        ptr = {n: p for n, p, _ in self.d.regions}[name]
        return self.by_addr[ptr].reshape(-1).view(np.uint8)


def table(tokens: int, page: int, rng: np.random.Generator) -> np.ndarray:
    n = -(-tokens // page)
    return rng.choice(np.arange(1, SLOTS // page + 1), size=n, replace=False).astype(np.int64)


def window_pages(ids: np.ndarray, tokens: int, start: int, page: int, extra: int) -> list[int]:
    """SGLang's window page list: from page_floor(max(prefix, seq_len - window)), ``extra``
    pages earlier where a side counted one more (the seed's lists of different lengths)."""
    first = max(0, max(start, tokens - SGLANG_WINDOW) // page - extra)
    return ids[first:].tolist()


@settings(max_examples=examples(120), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    model=st.sampled_from(sorted(MODELS)),
    tps=st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4])),
    pages=st.tuples(st.sampled_from([1, 4, 8]), st.sampled_from([1, 4, 16])),
    tokens=st.integers(1, 60),
    hit=st.integers(0, 2),
    chunk=st.sampled_from([0, 8, 16]),
    extra=st.tuples(st.integers(0, 1), st.integers(0, 1)),
    seed=st.integers(0, 2**32 - 1),
)
def test_hybrid_pools_move_exactly(
    model: str,
    tps: tuple[int, int],
    pages: tuple[int, int],
    tokens: int,
    hit: int,
    chunk: int,
    extra: tuple[int, int],
    seed: int,
) -> None:
    (ptp, dtp), (ppage, dpage) = tps, pages
    rng = np.random.default_rng(seed)
    start = min(hit * dpage, (tokens - 1) // dpage * dpage)  # a decode prefix hit: whole pages
    prefill = [Rank(model, ptp, r, ppage, ppage) for r in range(ptp)]
    decode = [Rank(model, dtp, r, dpage, dpage) for r in range(dtp)]
    p0, d0 = prefill[0], decode[0]
    logical = Logical.draw(model, p0.mamba, rng)
    p_ids, d_ids = table(tokens, ppage, rng), table(tokens, dpage, rng)
    p_swa, d_swa = table(tokens, ppage, rng), table(tokens, dpage, rng)
    p_slot, d_slot = (int(x) for x in rng.integers(0, STATE_SLOTS, 2))

    for pr in prefill:  # the prefill's forward fills its pools
        for bufs, layers, ids in ((pr.kv, pr.full, p_ids), (pr.swa, pr.sliding, p_swa)):
            for b, buf in enumerate(bufs):
                layer, which = layers[b % len(layers)], b // len(layers)
                for t in range(tokens):
                    for i, h in enumerate(pr.heads):
                        buf[ids[t // ppage] * ppage + t % ppage, i] = kv_value(layer, which, t, h)
        for j, layer in enumerate(pr.mamba):
            pr.conv[j][p_slot] = logical.conv_of(model, layer, ptp, pr.rank)
            pr.temporal[j][p_slot] = logical.temporal_of(model, layer, ptp, pr.rank)

    def state_lists(ids: np.ndarray, page: int, slot: int, more: int) -> list[Any]:
        out: list[Any] = [[slot]] if p0.mamba else []
        return [*out, window_pages(ids, tokens, start, page, more)] if p0.sliding else out

    dst = decode_placement(
        tokens,
        start,
        dpage,
        d_ids[start // dpage :].tolist(),
        1,
        StateIndices.parse(d0.args.states, state_lists(d_swa, dpage, d_slot, extra[1])),
    )
    pair = pairing(prefill, decode)
    # SGLang's sends: chunks ending on prefill pages, the state indices with the last. A model
    # with a window is sent at the last (SGLang names the window's pages only then).
    pp = PrefillPages(tokens, start, ppage, 1)
    begin = start
    for stop in sends(tokens, start, chunk, ppage):
        sent = p_ids[pp.stop // ppage : -(-stop // ppage)]
        last = stop == tokens
        given = state_lists(p_swa, ppage, p_slot, extra[0]) if last else []
        pp.add(
            sent.tolist(),
            stop - pp.stop,
            StateIndices.parse(p0.args.states, given or None) if last else StateIndices(),
        )
        if p0.sliding and not last:
            continue
        run(pair.plan(pp.placement(), dst, begin, stop), prefill, decode)
        begin = stop

    for dr in decode:
        for bufs, layers, ids, lo in (
            (dr.kv, dr.full, d_ids, start),
            (dr.swa, dr.sliding, d_swa, max(start, tokens - SGLANG_WINDOW)),
        ):
            for b, buf in enumerate(bufs):
                layer, which = layers[b % len(layers)], b // len(layers)
                expect = np.full_like(buf.view(np.uint32), CANARY).view(np.float32)
                for t in range(lo, tokens):
                    for i, h in enumerate(dr.heads):
                        expect[ids[t // dpage] * dpage + t % dpage, i] = kv_value(
                            layer, which, t, h
                        )
                np.testing.assert_array_equal(
                    buf.view(np.uint32), expect.view(np.uint32), err_msg=f"{layer}/{which}"
                )
        for j, layer in enumerate(dr.mamba):
            for got, want in (
                (dr.conv[j], logical.conv_of(model, layer, dtp, dr.rank)),
                (dr.temporal[j], logical.temporal_of(model, layer, dtp, dr.rank)),
            ):
                expect = np.full_like(got, CANARY)
                expect[d_slot] = want
                np.testing.assert_array_equal(got, expect, err_msg=f"state of layer {layer}")


def test_a_mamba2_conv_slot_is_not_one_contiguous_slice_across_tp() -> None:
    """What SGLang's own backends move for Nemotron-H across TP 1 -> 2 (no conv shard groups:
    one contiguous slice of the slot) is not what a TP 2 rank holds: x, B and C are each split.
    kvbridge's bytes are the rank's (the property test above); the contiguous slice is not."""
    rng = np.random.default_rng(0)
    logical = Logical.draw("nemotron_h", [0], rng)
    whole = logical.conv_of("nemotron_h", 0, 1, 0)
    for rank in range(2):
        dim = len(whole) // 2
        contiguous = whole[rank * dim : (rank + 1) * dim]
        assert not np.array_equal(contiguous, logical.conv_of("nemotron_h", 0, 2, rank))
    # GDN's channels are q | k | v, split the same way: SGLang passes shard groups for it.
    logical = Logical.draw("qwen3_next", [0], rng)
    whole = logical.conv_of("qwen3_next", 0, 1, 0)
    assert not np.array_equal(whole[:8], logical.conv_of("qwen3_next", 0, 2, 0))


def test_what_does_not_add_up_is_refused_naming_it() -> None:
    r = Rank("nemotron_h", 2, 0, 4, 4)
    mamba = r.args.states[0]
    # A pool whose layer ids are not the model's Mamba layers.
    wrong = StateArgs("mamba", mamba.ptrs, mamba.lens, mamba.item_lens, (0, 3, 0, 3))
    with pytest.raises(LayoutError, match=r"Mamba pool holds layers \[0, 3\].* layers \[0, 2\]"):
        describe(PoolArgs(**{**r.args.__dict__, "states": (wrong,)}))
    # A conv slot of another size than the config's (another conv kernel, say).
    items = (mamba.item_lens[0] - 2, *mamba.item_lens[1:])
    lens = (items[0] * (STATE_SLOTS + 1), *mamba.lens[1:])
    odd = StateArgs("mamba", mamba.ptrs, lens, items, mamba.layer_ids)
    with pytest.raises(LayoutError, match="layer 0 conv state: SGLang keeps"):
        describe(PoolArgs(**{**r.args.__dict__, "states": (odd,)}))
    # Mamba state without layer ids (SGLang's fallback pool).
    bare = StateArgs("mamba", mamba.ptrs, mamba.lens, mamba.item_lens)
    with pytest.raises(LayoutError, match="without layer ids"):
        describe(PoolArgs(**{**r.args.__dict__, "states": (bare,)}))
    # A sliding model whose server kept no window pool.
    s = Rank("mistral", 1, 0, 4, 4)
    with pytest.raises(LayoutError, match="slide, but SGLang gave no sliding-window pool"):
        describe(PoolArgs(**{**s.args.__dict__, "states": (mamba,)}))
    # State indices that do not match the state types.
    with pytest.raises(PlacementError, match="expected one each"):
        StateIndices.parse(r.args.states, [[1], [2]])
    with pytest.raises(PlacementError, match="expected one slot id"):
        StateIndices.parse(r.args.states, [[1, 2]])
    with pytest.raises(PlacementError, match="sliding-window pages for a 8-token request"):
        decode_placement(8, 0, 4, [1, 2], 0, StateIndices(window=(1, 2, 3)))


def test_the_window_pool_is_paired_by_sglangs_layer_ids() -> None:
    """SGLang's KVArgs list the window sub-pool's buffers without layer ids; kvbridge's hook
    takes them from the pool (``SWAKVPool.layers_mapping``: layer -> (index in its sub-pool,
    sliding)), and a config that puts its sliding (Llama 4: chunked) layers elsewhere than
    SGLang's pool is refused, naming both (SGLang 0.5.23 pools Llama 4 by a fixed rule)."""
    from kvbridge.integrations.sglang import internals

    class Pool:  # SWAKVPool's mapping for a Llama 4 of 8 layers, by SGLang's rule
        layers_mapping = {3: (0, False), 7: (1, False)} | {
            lid: (i, True) for i, lid in enumerate((0, 1, 2, 4, 5, 6))
        }

    saved = internals.sliding_window(), internals.sliding_layers()
    try:
        internals.note_pools(20, Pool())
        assert (internals.sliding_window(), internals.sliding_layers()) == (20, (0, 1, 2, 4, 5, 6))
        internals.note_pools(None, object())  # a server without a window pool
        assert (internals.sliding_window(), internals.sliding_layers()) == (None, ())
    finally:
        internals._WINDOW[0], internals._SWA_LAYERS[0] = saved
    s = Rank("mistral", 1, 0, 4, 4)
    same = describe(PoolArgs(**{**s.args.__dict__, "swa_layer_ids": (0,)}))
    assert (same.spec, same.memory) == (s.d.spec, s.d.memory)
    with pytest.raises(
        LayoutError,
        match=r"pool holds layers \[1\]; the model's config has sliding \(or chunked\) "
        r"attention in layers \[0\]",
    ):
        describe(PoolArgs(**{**s.args.__dict__, "swa_layer_ids": (1,)}))


def test_a_window_wider_than_sglangs_is_refused_not_guessed() -> None:
    """Described with the config's inclusive window (12) where SGLang keeps 11 tokens, a
    20-token request needs token 8, which neither side's window list holds: the planner
    refuses, naming it, rather than reading a freed page."""
    src, dst = (Rank("mistral", 1, 0, 1, 1, window=WINDOW) for _ in range(2))
    ids = np.arange(1, 21)
    lists = [window_pages(ids, 20, 0, 1, 0)]  # SGLang's: the last 11 tokens' pages
    place = decode_placement(20, 0, 1, ids.tolist(), 1, StateIndices.parse(dst.args.states, lists))
    pairing = Pairing(
        Side(src.d.spec, ParallelLayout(1, ((0, 2),)), src.d.memory),
        Side(dst.d.spec, ParallelLayout(1, ((0, 2),)), dst.d.memory),
    )
    with pytest.raises(PlacementError, match="token 8"):
        pairing.plan(place, place, 0, 20)
