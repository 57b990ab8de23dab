"""Hypothesis strategies for the whole grid of layouts the planner must serve."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from kvbridge.errors import LayoutError
from kvbridge.integrations.vllm.memory import VllmLayout, vllm_memory
from kvbridge.layout import ConvLayout, KVLayout, build_memory, default_group, window_pool_group
from kvbridge.parallel import ParallelLayout
from kvbridge.placement import Placement
from kvbridge.plan import Side
from kvbridge.shard import check_segment
from kvbridge.spec import (
    CacheSpec,
    DType,
    LayerKind,
    LayerSpec,
    attention_layer,
    gdn_layer,
    mamba1_layer,
    mamba2_layer,
    mla_layer,
    short_conv_layer,
)

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
    if kind == "mla":
        idx = draw(st.sampled_from([None, 6]))
        return mla_layer(draw(st.sampled_from([8, 16])), 4, dt, indexer_dim=idx)
    if kind == "mamba2":
        heads = draw(st.sampled_from([4, 8, 16, 24]))
        groups = draw(st.sampled_from([g for g in (1, 2, 4, 8) if heads % g == 0]))
        return mamba2_layer(heads, draw(st.sampled_from([2, 4])), groups, 4,
                            draw(st.sampled_from([2, 4])), conv_dtype=dt, ssm_dtype=DType.FLOAT32)
    if kind == "gdn":
        k = draw(st.sampled_from([1, 2, 4]))
        return gdn_layer(k, k * draw(st.sampled_from([1, 2, 4])), 4, 4,
                         draw(st.sampled_from([2, 4])), conv_dtype=dt,
                         state_dtype=DType.FLOAT32)
    if kind == "mamba1":
        return mamba1_layer(draw(st.sampled_from([8, 16, 24])), 4, 4, conv_dtype=dt,
                            ssm_dtype=DType.FLOAT32)
    return short_conv_layer(draw(st.sampled_from([8, 16])), draw(st.sampled_from([1, 2, 3])),
                            dtype=dt)


KINDS = ["full", "sliding", "mla", "mamba2", "gdn", "mamba1", "short_conv"]


@st.composite
def specs(draw: st.DrawFn) -> CacheSpec:
    """A model: 1-5 layers of one kind, or a hybrid of several; same shape within a kind."""
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=3, unique=True))
    protos = {k: draw(layers(k)) for k in kinds}
    # Attention layers of a hybrid share head counts, as in real models.
    seq = draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=5))
    return CacheSpec("grid", tuple(protos[k] for k in seq),
                     aux_bytes=draw(st.sampled_from([8, 24])))


def vllm_can_hold(spec: CacheSpec) -> bool:
    """Attention only, K and V of one head size: what vLLM's paged layouts hold."""
    return all(layer.kind in (LayerKind.FULL, LayerKind.SLIDING)
               and layer.components[0].segments[0].unit_size
               == layer.components[1].segments[0].unit_size for layer in spec.layers)


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


@st.composite
def parallel(draw: st.DrawFn, spec: CacheSpec, tp: int) -> ParallelLayout:
    pp = draw(st.integers(1, min(3, spec.num_layers)))
    if pp == 1:
        return ParallelLayout.even(spec.num_layers, tp, 1)
    cuts = sorted(draw(st.lists(st.integers(1, spec.num_layers - 1), min_size=pp - 1,
                                max_size=pp - 1, unique=True)))
    bounds = [0, *cuts, spec.num_layers]
    return ParallelLayout(tp, tuple(zip(bounds[:-1], bounds[1:], strict=True)))


@st.composite
def sides_and_placements(draw: st.DrawFn) -> tuple[Side, Side, Placement, Placement,
                                                   list[tuple[int, int]]]:
    spec = draw(specs())
    tps = valid_tps(spec)
    n = draw(st.integers(1, 40))
    built = []
    swa = draw(st.booleans())  # sliding layers in a pool of their own on both sides
    for side_index in range(2):
        tp = draw(st.sampled_from(tps))
        par = draw(parallel(spec, tp))
        page = draw(st.sampled_from([1, 2, 4, 8, 16]))
        need = -(-n // page)
        num_pages = need + draw(st.integers(0, 6))
        engine = draw(st.sampled_from([None, *VllmLayout])) if \
            not swa and vllm_can_hold(spec) else None
        if engine is None:
            mem = build_memory(spec, par, page_size=page, num_pages=num_pages,
                               kv_layout=draw(st.sampled_from(list(KVLayout))),
                               conv_layout=draw(st.sampled_from(list(ConvLayout))),
                               state_slots=3, aux_slots=3,
                               group_of=window_pool_group if swa else default_group)
        else:  # the engine's own layout (vLLM's CPU one stores K transposed)
            mem = vllm_memory(spec, par.tp, num_blocks=num_pages, block_size=page,
                              layout=engine, aux_slots=3)
        rng = np.random.default_rng(draw(st.integers(0, 2**31)))
        ids = rng.permutation(num_pages)[:need] if draw(st.booleans()) else np.arange(need)
        pages = {"kv": ids}
        if swa:
            swa_ids = rng.permutation(num_pages)[:need]
            if side_index == 1:  # decode frees pages wholly outside the largest window
                w = max((layer.window or 0) for layer in spec.layers)
                first = max(0, n - w) // page if w else need
                swa_ids[:first] = -1
            pages["swa"] = swa_ids
        built.append((Side(spec, par, mem),
                       Placement(n, pages, {"state": draw(st.integers(0, 2)),
                                            "aux": draw(st.integers(0, 2))})))
    cuts = sorted(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=4, unique=True)))
    bounds = [0, *[c for c in cuts if 0 < c < n], n]
    chunks = list(zip(bounds[:-1], bounds[1:], strict=True))
    (p, sp), (d, dp) = built
    return p, d, sp, dp, chunks
