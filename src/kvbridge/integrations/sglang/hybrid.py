"""SGLang's hybrid pools described in kvbridge's terms: the layers of a model with extra state
(Mamba, sliding-window, MLA beside it) over SGLang's buffers, and DSA's indexer keys. Plain
data, no SGLang import.

What each state *is* (its segments, how TP shards it) comes from the model's config
(:func:`kvbridge.model.hf.spec_from_config`), never from the byte counts: SGLang's own backends
slice a Mamba2 conv slot as one contiguous run across different TP sizes, which is not where x, B
and C of another rank's share lie. The byte counts only check that both agree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvbridge.errors import LayoutError
from kvbridge.integrations.sglang.states import STATE, SWA, StateArgs, StateKind
from kvbridge.model.hf import layer_origins, spec_from_config
from kvbridge.model.spec import Component, DType, LayerKind, LayerSpec, Scope, Segment
from kvbridge.planner.layout import BufferLayout, ConvLayout, Dim, state_dims
from kvbridge.planner.shard import local_axis_elems, local_units


@dataclass(frozen=True)
class Buffer:
    """One pool buffer of this rank: its region name, address and bytes, and how a layer's
    component lies in it."""

    region: str
    ptr: int
    nbytes: int
    layout: BufferLayout


_WIDTHS = {1: DType.UINT8, 2: DType.BFLOAT16, 4: DType.FLOAT32}


def _stored(comp: Component, item: int, tp: int, where: str) -> Component:
    """``comp`` in the dtype whose width makes one slot ``item`` bytes on a rank of TP ``tp``
    (only the width matters to the bytes; the dtype names SGLang read are in the spec's name:
    :func:`..internals.pool_args`)."""
    elems = comp.rows * local_axis_elems(comp.segments, tp)
    width = item // elems if item % elems == 0 else 0
    if width not in _WIDTHS:
        raise LayoutError(
            f"{where}: SGLang keeps {item} bytes a slot; the model's config makes {elems} "
            f"elements at TP {tp}, not a whole number of 1, 2 or 4 bytes each"
        )
    return dataclasses.replace(comp, dtype=_WIDTHS[width])


def _mamba_entries(state: StateArgs) -> dict[int, list[int]]:
    """For each Mamba layer id, the indices of its entries in SGLang's order (conv, then
    temporal)."""
    if not state.layer_ids:
        raise LayoutError(
            "KVArgs Mamba state without layer ids (SGLang's fallback for a pool that is not "
            "HybridLinearKVPool): kvbridge cannot tell which layer each buffer is"
        )
    out: dict[int, list[int]] = {}
    for i, lid in enumerate(state.layer_ids):
        out.setdefault(lid, []).append(i)
    return out


def _attention(
    layer_id: int, token_bytes: int, heads: int, total: int, window: int | None
) -> LayerSpec:
    """An attention layer of SGLang's MHA pool in bytes (as :func:`..pools.describe` does)."""
    if heads < 1 or token_bytes % heads:
        raise LayoutError(
            f"layer {layer_id}: tokens of {token_bytes} bytes do not split into {heads} KV heads"
        )
    head = Segment("heads", total, token_bytes // heads)
    k, v = (Component(n, Scope.TOKEN, (head,), DType.UINT8) for n in ("k", "v"))
    return LayerSpec(LayerKind.SLIDING if window else LayerKind.FULL, (k, v), window)


def _mla(token_bytes: int) -> LayerSpec:
    """An MLA layer of SGLang's MLA pool in bytes: one latent a token, on every rank whole."""
    latent = Segment("latent", 1, token_bytes)
    return LayerSpec(LayerKind.MLA, (Component("latent", Scope.TOKEN, (latent,), DType.UINT8),))


# The layers that keep a Mamba-pool slot, and how SGLang orders a conv slot's bytes: channels
# first (``[conv_dim / tp, K - 1]``), except Kimi Linear's (``[K - 1, conv_dim / tp]``).
_CONV_LAYOUTS = {
    LayerKind.MAMBA2: ConvLayout.DS,
    LayerKind.GDN: ConvLayout.DS,
    LayerKind.KDA: ConvLayout.SD,
}
_CONV_LAYOUTS_NAMES = {k.value for k in _CONV_LAYOUTS}


@dataclass(frozen=True)
class Attention:
    """What SGLang's main KV buffers hold, beside the state: the full-attention layers' K then
    V, a page an item, each with its global layer id (or in layer order, where none given)."""

    ptrs: tuple[int, ...]
    lens: tuple[int, ...]
    item: int
    page_size: int
    heads: int
    total_heads: int
    layer_ids: tuple[int, ...] = ()
    mla: bool = False  # one latent buffer a layer (Kimi Linear's MLA), not K and V


def hybrid_layers(
    config: Mapping[str, object],
    attention: Attention,
    states: Sequence[StateArgs],
    tp: int,
    kv_group: str,
    window: int | None = None,
    swa_layer_ids: Sequence[int] = (),
) -> tuple[tuple[LayerSpec, ...], list[dict[str, Buffer]]]:
    """The layers of a hybrid model's pools, in the model's layer order, and the buffers of
    each (component name -> buffer). ``window``: the tokens SGLang keeps of a sliding layer
    (its scheduler's, which may be the config's less one, or Llama 4's chunk); the config's
    where None. ``swa_layer_ids``: the global layer of each sliding-window sub-pool layer, in
    the sub-pool's order (the config's sliding layers in layer order where none given).
    Refuses, saying what, whatever does not add up."""
    by_kind: dict[StateKind, StateArgs] = {}
    for s in states:
        if by_kind.setdefault(s.state_kind, s) is not s:
            raise LayoutError(f"KVArgs lists state {s.kind!r} twice")
    if StateKind.DSA in by_kind:
        raise LayoutError(
            f"SGLang's DSA indexer state beside {[s.kind for s in states]} state: kvbridge "
            f"describes it beside a plain MLA pool (DSATokenToKVPool) so far"
        )
    model = spec_from_config(config)
    origins = layer_origins(config)
    kinds = [layer.kind for layer in model.layers]
    attending = LayerKind.MLA if attention.mla else LayerKind.FULL
    full = [o for o, k in zip(origins, kinds, strict=True) if k is attending]
    sliding = [o for o, k in zip(origins, kinds, strict=True) if k is LayerKind.SLIDING]
    stateful = [o for o, k in zip(origins, kinds, strict=True) if k in _CONV_LAYOUTS]
    other = sorted({k.value for k in kinds} - {attending.value, "sliding", *_CONV_LAYOUTS_NAMES})
    if other:
        raise LayoutError(
            f"the model's layers include {other} beside SGLang's {attending.value} pool: "
            f"kvbridge's SGLang backend describes full attention (or MLA) and sliding-window "
            f"attention, Mamba2, gated-delta-net and Kimi-delta-attention layers of hybrid pools"
        )
    buffers: dict[int, dict[str, Buffer]] = {}

    def add(lid: int, name: str, ptr: int, nbytes: int, layout: BufferLayout) -> None:
        buffers.setdefault(lid, {})[name] = Buffer(layout.region, ptr, nbytes, layout)

    # Full attention: K of each layer then V (MLA: a latent), paired by layer id where SGLang
    # gives them.
    token_bytes = attention.item // attention.page_size
    names = ("latent",) if attention.mla else ("k", "v")
    ids = attention.layer_ids or tuple(full) * len(names)
    per = len(ids) // len(names)
    if sorted(ids[:per]) != full or any(
        ids[:per] != ids[i * per : (i + 1) * per] for i in range(1, len(names))
    ):
        raise LayoutError(
            f"SGLang's {attending.value} buffers are of layers {list(ids)}; the model's config "
            f"has {attending.value} in layers {full} ({' then '.join(names)} of each)"
        )
    for i, (lid, ptr, nbytes) in enumerate(zip(ids, attention.ptrs, attention.lens, strict=True)):
        name = names[i // per]
        add(lid, name, ptr, nbytes, _page_layout(f"L{lid}.{name}", nbytes, attention, kv_group))
    specs: dict[int, LayerSpec] = {
        lid: _mla(token_bytes)
        if attention.mla
        else _attention(lid, token_bytes, attention.heads, attention.total_heads, None)
        for lid in full
    }
    # The sliding-window sub-pool: K of each sliding layer then V, in layer order.
    windows = {o: layer.window for o, layer in zip(origins, model.layers, strict=True)}
    swa = by_kind.get(StateKind.SWA)
    if sliding and swa is None:
        raise LayoutError(
            f"the model's layers {sliding} slide, but SGLang gave no sliding-window pool "
            f"(a server run with --disable-hybrid-swa-memory keeps them in the full pool: "
            f"not described yet)"
        )
    if swa is not None:
        order = list(swa_layer_ids) or sliding
        if sorted(order) != sliding:
            raise LayoutError(
                f"SGLang's sliding-window pool holds layers {order}; the model's config has "
                f"sliding (or chunked) attention in layers {sliding}: SGLang would keep a window "
                f"of layers kvbridge would read whole, or the whole of layers it reads a window "
                f"of (SGLang 0.5.23 puts every layer but each 4th of Llama 4 in that pool, "
                f"whatever its config's no_rope_layers say)"
            )
        if len(swa.ptrs) != 2 * len(sliding) or len(set(swa.item_lens)) != 1:
            raise LayoutError(
                f"SGLang's sliding-window pool has {len(swa.ptrs)} buffers of "
                f"{sorted(set(swa.item_lens))}-byte pages; the model has {len(sliding)} sliding "
                f"layers (a K and a V buffer each, pages of one size)"
            )
        # The window pool's heads are the sliding layers' own (SGLang sizes it by them, and
        # a model may give them fewer KV heads than its full layers).
        (seg,) = model.layers[origins.index(sliding[0])].component("k").segments
        sub = Attention(
            swa.ptrs,
            swa.lens,
            swa.item_lens[0],
            attention.page_size,
            local_units(seg, tp),
            seg.units,
        )
        for i, (lid, ptr, nbytes) in enumerate(zip(order * 2, swa.ptrs, swa.lens, strict=True)):
            name = "k" if i < len(sliding) else "v"
            add(lid, name, ptr, nbytes, _page_layout(f"L{lid}.{name}", nbytes, sub, SWA))
            specs[lid] = _attention(
                lid, sub.item // sub.page_size, sub.heads, sub.total_heads, window or windows[lid]
            )
    # Mamba state: conv then temporal of each layer, paired by layer id.
    mamba = by_kind.get(StateKind.MAMBA)
    if stateful and mamba is None:
        raise LayoutError(f"the model keeps state in layers {stateful}; SGLang gave no Mamba pool")
    if mamba is not None:
        entries = _mamba_entries(mamba)
        if sorted(entries) != stateful:
            raise LayoutError(
                f"SGLang's Mamba pool holds layers {sorted(entries)}; the model's config keeps "
                f"state in layers {stateful}"
            )
        for lid in stateful:
            layer = model.layers[origins.index(lid)]
            idx = entries[lid]
            if len(idx) != len(layer.components):
                raise LayoutError(
                    f"layer {lid}: SGLang's Mamba pool has {len(idx)} state tensors, the "
                    f"model's config {len(layer.components)} "
                    f"({[c.name for c in layer.components]})"
                )
            comps = []
            for comp, i in zip(layer.components, idx, strict=True):
                item, nbytes = mamba.item_lens[i], mamba.lens[i]
                comp = _stored(comp, item, tp, f"layer {lid} {comp.name} state")
                dims, _ = state_dims(comp, tp, nbytes // item, _CONV_LAYOUTS[layer.kind])
                region = f"L{lid}.{comp.name}"
                layout = BufferLayout(region, 0, dims, STATE, itemsize=comp.dtype.itemsize)
                add(lid, comp.name, mamba.ptrs[i], nbytes, layout)
                comps.append(comp)
            specs[lid] = dataclasses.replace(layer, components=tuple(comps))
    order = sorted(specs)
    if order != sorted(origins):
        raise LayoutError(f"layers {sorted(set(origins) - set(order))} of the model are in no pool")
    return tuple(specs[lid] for lid in order), [buffers[lid] for lid in order]


INDEX_KEY, INDEX_SCALE = 128, 4  # bytes a token: SGLang's indexer (index_head_dim 128, fp8)


def index_keys(
    state: StateArgs, layers: int, page_size: int, group: str
) -> list[tuple[tuple[Component, ...], dict[str, Buffer]]]:
    """Each MLA layer's indexer keys in SGLang's ``DSATokenToKVPool`` (``state``, one buffer a
    layer): its components (none where SGLang elides the layer) and their buffers. A page of
    the buffer holds the 128 fp8 key bytes of each of its tokens, then the 4 scale bytes of
    each: two per-token components in one buffer, each moved at its own offset."""
    if len(state.ptrs) != layers:
        raise LayoutError(
            f"SGLang's DSA indexer has {len(state.ptrs)} buffers for {layers} MLA layers "
            f"(a speculative draft model's layers beside them: not described yet)"
        )
    token = INDEX_KEY + INDEX_SCALE
    out: list[tuple[tuple[Component, ...], dict[str, Buffer]]] = []
    buffers = zip(state.ptrs, state.lens, state.item_lens, strict=True)
    for li, (ptr, nbytes, item) in enumerate(buffers):
        if not item:
            out.append(((), {}))
            continue
        if item != page_size * token:
            raise LayoutError(
                f"layer {li}: SGLang's DSA indexer keeps {item} bytes a page of {page_size} "
                f"tokens; kvbridge describes {token} a token (128 fp8 key bytes and a 4-byte "
                f"scale: index_head_dim 128, one index page a KV page, no index_kpool pooling)"
            )
        region, comps, placed = f"L{li}.index", [], {}
        for name, at, width in (("index_k", 0, INDEX_KEY), ("index_scale", INDEX_KEY, INDEX_SCALE)):
            comps.append(Component(name, Scope.TOKEN, (Segment(name, 1, width),), DType.UINT8))
            dims = (
                Dim("page", nbytes // item, item),
                Dim("token", page_size, width),
                Dim("elem", width, 1),
            )
            layout = BufferLayout(region, at * page_size, dims, group, itemsize=1)
            placed[name] = Buffer(region, ptr, nbytes, layout)
        out.append((tuple(comps), placed))
    return out


def _page_layout(region: str, nbytes: int, pool: Attention, group: str) -> BufferLayout:
    """A per-token buffer of pages (SGLang's NHD: ``[slots, heads, head_dim]``, ``page_size``
    slots a page), in bytes."""
    if pool.item % pool.page_size or nbytes % pool.item:
        raise LayoutError(
            f"{region}: {nbytes} bytes in pages of {pool.item} at page size {pool.page_size}: "
            f"expected whole pages of whole tokens"
        )
    token = pool.item // pool.page_size
    dims = (
        Dim("page", nbytes // pool.item, pool.item),
        Dim("token", pool.page_size, token),
        Dim("elem", token, 1),
    )
    return BufferLayout(region, 0, dims, group, itemsize=1)


__all__ = ["Attention", "Buffer", "hybrid_layers", "index_keys"]
