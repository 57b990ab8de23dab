"""Hypothesis strategies for the whole grid of layouts the planner must serve."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from kvbridge.errors import LayoutError
from kvbridge.integrations.vllm.memory import VllmLayout, vllm_memory
from kvbridge.model.spec import (
    CacheSpec,
    DType,
    LayerKind,
    LayerSpec,
    Scope,
    attention_layer,
    gdn_layer,
    kda_layer,
    mamba1_layer,
    mamba2_layer,
    mla_layer,
    short_conv_layer,
)
from kvbridge.model.states import (
    compressed_layer,
    hidden_layer,
    lightning_layer,
    mlstm_layer,
    prefix_layer,
    rglru_layer,
    rwkv_layer,
)
from kvbridge.planner.layout import (
    ConvLayout,
    KVLayout,
    build_memory,
    default_group,
    window_pool_group,
)
from kvbridge.planner.parallel import ParallelLayout
from kvbridge.planner.placement import Placement
from kvbridge.planner.plan import Side
from kvbridge.planner.shard import check_dcp, check_segment
from kvbridge.planner.tokenmap import TokenSplit

HEADS = [1, 2, 3, 4, 6, 8, 12, 16, 24]
DTYPES = st.sampled_from([DType.BFLOAT16, DType.FLOAT32, DType.FLOAT8_E4M3])


@st.composite
def layers(draw: st.DrawFn, kind: str) -> LayerSpec:
    dt = draw(DTYPES)
    if kind in ("full", "sliding"):
        window = draw(st.integers(1, 24)) if kind == "sliding" else None
        hd = draw(st.sampled_from([2, 4, 8]))
        v = draw(st.sampled_from([None, hd, 2 * hd]))
        return attention_layer(draw(st.sampled_from(HEADS)), hd, dt, v_head_dim=v, window=window)
    if kind in ("mla", "mla_indexer"):
        idx = 6 if kind == "mla_indexer" else None
        return mla_layer(draw(st.sampled_from([8, 16])), 4, dt, indexer_dim=idx)
    if kind == "sliding_mla":  # dots3's sliding layers: the latent of the last `window` tokens
        return mla_layer(draw(st.sampled_from([8, 16])), 4, dt, window=draw(st.integers(1, 24)))
    if kind == "lightning":
        return lightning_layer(draw(st.sampled_from([1, 2, 4, 8])), 4, dt)
    if kind == "prefix":
        return prefix_layer(draw(st.integers(1, 5)), draw(st.sampled_from(HEADS)), 4, dt)
    if kind == "hidden":  # XLNet's memory, all of it or its last `window` tokens'
        window = draw(st.one_of(st.none(), st.integers(1, 24)))
        return hidden_layer(draw(st.sampled_from([8, 24])), dt, window=window)
    if kind == "compressed":  # DeepSeek V4's: an entry every 2 or 4 tokens, indexer keys or not
        rate = draw(st.sampled_from([2, 4]))
        index = draw(st.sampled_from([None, 6]))
        return compressed_layer(rate, draw(st.sampled_from([4, 8])), dt, indexer_dim=index)
    if kind == "mlstm":
        heads = draw(st.sampled_from([1, 2, 4, 8]))
        return mlstm_layer(heads, draw(st.sampled_from([2, 4])), 4, dt)
    if kind == "rwkv":
        hidden = draw(st.sampled_from([8, 16, 24]))
        return rwkv_layer(hidden, shift_dtype=dt, state_dtype=DType.FLOAT32)
    if kind == "rg_lru":
        heads = draw(st.sampled_from([1, 2, 4, 8]))
        return rglru_layer(
            heads * draw(st.sampled_from([1, 3])),
            heads,
            draw(st.sampled_from([2, 4])),
            conv_dtype=dt,
            state_dtype=DType.FLOAT32,
        )
    if kind == "mamba2":
        heads = draw(st.sampled_from([4, 8, 16, 24]))
        groups = draw(st.sampled_from([g for g in (1, 2, 4, 8) if heads % g == 0]))
        return mamba2_layer(
            heads,
            draw(st.sampled_from([2, 4])),
            groups,
            4,
            draw(st.sampled_from([2, 4])),
            conv_dtype=dt,
            ssm_dtype=DType.FLOAT32,
        )
    if kind == "gdn":
        k = draw(st.sampled_from([1, 2, 4]))
        return gdn_layer(
            k,
            k * draw(st.sampled_from([1, 2, 4])),
            4,
            4,
            draw(st.sampled_from([2, 4])),
            conv_dtype=dt,
            state_dtype=DType.FLOAT32,
        )
    if kind == "kda":
        return kda_layer(
            draw(st.sampled_from([1, 2, 4, 8])),
            draw(st.sampled_from([2, 4])),
            draw(st.sampled_from([2, 4])),
            conv_dtype=dt,
            state_dtype=DType.FLOAT32,
        )
    if kind == "mamba1":  # by channel, or by head (Zamba1)
        return mamba1_layer(
            draw(st.sampled_from([8, 16, 24])),
            4,
            4,
            conv_dtype=dt,
            ssm_dtype=DType.FLOAT32,
            heads=draw(st.sampled_from([1, 2, 4])),
        )
    return short_conv_layer(
        draw(st.sampled_from([8, 16])), draw(st.sampled_from([1, 2, 3])), dtype=dt
    )


KINDS = [
    "full",
    "sliding",
    "mla",
    "mla_indexer",
    "sliding_mla",
    "mamba2",
    "gdn",
    "kda",
    "mamba1",
    "short_conv",
    "lightning",
    "mlstm",
    "rg_lru",
    "rwkv",
    "prefix",
    "hidden",
    "compressed",
]


@st.composite
def specs(draw: st.DrawFn) -> CacheSpec:
    """A model: 1-5 layers of one kind, or a hybrid of several; same shape within a kind."""
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=3, unique=True))
    protos = {k: draw(layers(k)) for k in kinds}
    # Attention layers of a hybrid share head counts, as in real models.
    seq = draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=5))
    return CacheSpec(
        "grid", tuple(protos[k] for k in seq), aux_bytes=draw(st.sampled_from([8, 24]))
    )


def vllm_can_hold(spec: CacheSpec) -> bool:
    """Attention only, K and V of one head size: what vLLM's paged layouts hold."""
    return all(
        layer.kind in (LayerKind.FULL, LayerKind.SLIDING)
        and len(layer.components) == 2  # not a sliding MLA latent
        and layer.components[0].segments[0].unit_size == layer.components[1].segments[0].unit_size
        for layer in spec.layers
    )


def valid_tps(spec: CacheSpec) -> list[int]:
    out = []
    for tp in range(1, 9):
        try:
            for layer in spec.layers:
                for c in layer.components:
                    for s in c.segments:
                        check_segment(s, tp)
        except LayoutError:
            continue
        out.append(tp)
    return out


def valid_dcps(spec: CacheSpec, tp: int) -> list[int]:
    """DCP sizes whose ranks can split the tokens of every per-token unit they share."""
    out = []
    for dcp in (d for d in range(1, tp + 1) if tp % d == 0):
        try:
            for layer in spec.layers:
                for c in layer.components:
                    if c.scope is Scope.TOKEN:
                        for s in c.segments:
                            check_dcp(s, tp, dcp)
        except LayoutError:
            continue
        out.append(dcp)
    return out


@st.composite
def token_maps(draw: st.DrawFn) -> dict[str, object]:
    split = draw(st.sampled_from(list(TokenSplit)))
    interleave = draw(st.integers(1, 5)) if split is TokenSplit.INTERLEAVED else 1
    return {"split": split, "interleave": interleave}


@st.composite
def parallel(draw: st.DrawFn, spec: CacheSpec, tp: int) -> ParallelLayout:
    """PP with a random split, context parallel groups (CP) and DCP where the spec allows it,
    and a token map; mostly without context parallelism, as most deployments."""
    pp = draw(st.integers(1, min(3, spec.num_layers)))
    cuts = (
        []
        if pp == 1
        else sorted(
            draw(
                st.lists(
                    st.integers(1, spec.num_layers - 1),
                    min_size=pp - 1,
                    max_size=pp - 1,
                    unique=True,
                )
            )
        )
    )
    bounds = [0, *cuts, spec.num_layers]
    context = {}
    strided = any(c.stride > 1 for layer in spec.layers for c in layer.components)
    if not strided and draw(st.integers(0, 2)) == 0:  # (no CP split of compressed entries)
        context = {
            "cp": draw(st.integers(1, 3)),
            "dcp": draw(st.sampled_from(valid_dcps(spec, tp))),
            **draw(token_maps()),
        }
    return ParallelLayout(tp, tuple(zip(bounds[:-1], bounds[1:], strict=True)), **context)  # type: ignore[arg-type]


def shard_tokens(par: ParallelLayout, shard: int, n: int) -> np.ndarray:
    """The global token of each local index of a shard."""
    g, _, lens = par.tokens.runs(shard, 0, n, n)
    return (
        np.concatenate([np.arange(a, a + b) for a, b in zip(g, lens, strict=True)])
        if len(g)
        else np.zeros(0, dtype=np.int64)
    )


Placements = Placement | list[Placement]


@st.composite
def sides_and_placements(
    draw: st.DrawFn,
) -> tuple[Side, Side, Placements, Placements, list[tuple[int, int]]]:
    spec = draw(specs())
    tps = valid_tps(spec)
    n = draw(st.integers(1, 40))
    built: list[tuple[Side, Placements]] = []
    swa = draw(st.booleans())  # sliding layers in a pool of their own on both sides
    # A decode prefix-cache hit: the decode holds tokens [0, held) already (half the time on a
    # page boundary of its own, as engines hit; otherwise anywhere); the prefill may hold
    # fewer tokens than the request has too (from its own start, never past the decode's).
    held = draw(st.sampled_from([0, 0, n - 1, draw(st.integers(0, n - 1))]))
    # A page holds whole compressed entries (one every `stride` tokens): a multiple of them.
    strides = {c.stride for layer in spec.layers for c in layer.components}
    fit = [p for p in (1, 2, 4, 8, 16) if all(p % r == 0 for r in strides)]
    pages_of = [draw(st.sampled_from(fit)) for _ in range(2)]
    if held and draw(st.booleans()):
        held -= held % pages_of[1]
    have = draw(st.sampled_from([0, held, draw(st.integers(0, held))]))
    for side_index in range(2):
        tp = draw(st.sampled_from(tps))
        par = draw(parallel(spec, tp))
        page = pages_of[side_index]
        shards = par.tokens.shards
        need = -(-n // page)
        num_pages = shards * need + draw(st.integers(0, 6))
        start = held if side_index else have
        engine = (
            draw(st.sampled_from([None, *VllmLayout])) if not swa and vllm_can_hold(spec) else None
        )
        if engine is None:
            mem = build_memory(
                spec,
                par,
                page_size=page,
                num_pages=num_pages,
                kv_layout=draw(st.sampled_from(list(KVLayout))),
                conv_layout=draw(st.sampled_from(list(ConvLayout))),
                state_slots=3,
                aux_slots=3,
                group_of=window_pool_group if swa else default_group,
            )
        else:  # the engine's own layout (vLLM's CPU one stores K transposed)
            mem = vllm_memory(
                spec, par.tp, num_blocks=num_pages, block_size=page, layout=engine, aux_slots=3
            )
        rng = np.random.default_rng(draw(st.integers(0, 2**31)))
        # A context-parallel side: one page table per token shard (its own tokens), or one
        # the shards share (vLLM's DCP block tables).
        shared = shards == 1 or draw(st.booleans())
        perm = rng.permutation(num_pages) if draw(st.booleans()) else np.arange(num_pages)
        places = []
        for k in range(1 if shared else shards):
            own = shard_tokens(par, k, n) if not shared else np.arange(n)
            k_need = -(-len(own) // page)
            ids = perm[k * need : k * need + k_need].copy()
            if shards == 1 and draw(st.booleans()):
                ids[: start // page] = -1  # pages wholly before the start: not given
            pages = {"kv": ids}
            if swa:
                swa_ids = rng.permutation(num_pages)[:k_need]
                if side_index == 1:  # decode frees pages wholly outside the largest window
                    w = max((layer.window or 0) for layer in spec.layers)
                    keep_from = n - w if w else n
                    for pg in range(k_need):
                        held = own[pg * page : (pg + 1) * page]
                        if shared:  # every shard's tokens of this page must be outside
                            held = np.concatenate(
                                [
                                    shard_tokens(par, j, n)[pg * page : (pg + 1) * page]
                                    for j in range(shards)
                                ]
                            )
                        if len(held) and held.max() < keep_from:
                            swa_ids[pg] = -1
                pages["swa"] = swa_ids
            places.append(
                Placement(
                    n,
                    pages,
                    {"state": draw(st.integers(0, 2)), "aux": draw(st.integers(0, 2))},
                    start,
                )
            )
        built.append((Side(spec, par, mem), places[0] if shared else places))
    cuts = sorted(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=4, unique=True)))
    bounds = [0, *[c for c in cuts if 0 < c < n], n]
    chunks = list(zip(bounds[:-1], bounds[1:], strict=True))
    (p, sp), (d, dp) = built
    return p, d, sp, dp, chunks
