"""SGLang's pools with extra state (hybrid models), in kvbridge's terms. Plain data, no SGLang
import.

SGLang 0.5.23 hands its transfer backend, beside the full-attention pool, a list of extra state
components (``KVArgs.state_types`` and the ``state_*`` lists, one entry per component):

- ``mamba`` (``HybridLinearKVPool``: gated delta net, Mamba2): per Mamba layer and state tensor a
  slab ``[slots + 1, ...]``, one slot a request; the entries are every conv tensor of every
  Mamba layer, then the temporal (SSM / recurrent) tensor of every layer, each with its global
  layer id. Conv is ``[conv_dim / tp, K - 1]`` a slot (channel-major: kvbridge's
  :attr:`~kvbridge.layout.ConvLayout.DS`), its channels this rank's share of each segment in
  turn (GDN: q | k | v; Mamba2: x | B | C); temporal is ``[heads / tp, ...]``. Each keeps its own
  dtype (conv in bf16 by default even for an fp32 model), read here from the slot's bytes.
- ``swa`` (``SWAKVPool``): the sliding-window layers' K buffers, then their V buffers, a page an
  item, without layer ids (the model's config says which layers slide); the main KV buffers are
  then the full-attention layers' only.
- ``dsa`` (``DSATokenToKVPool``, DeepSeek-V3.2 beside its MLA pool): each layer's indexer keys, a
  KV page an item (the indexer shares the KV pool's page ids), the page's 128-byte fp8 keys of
  every token then their 4-byte scales; a layer that reuses the previous layer's top-k has none
  (an empty buffer, item 0).

What each state *is* (its segments, how TP shards it) comes from the model's config
(:func:`kvbridge.hf.spec_from_config`), never from the byte counts: SGLang's own backends slice
a Mamba2 conv slot as one contiguous run across different TP sizes, which is not where x, B and
C of another rank's share lie. The byte counts only check that both agree.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.errors import LayoutError, PlacementError
from kvbridge.hf import layer_origins, spec_from_config
from kvbridge.layout import BufferLayout, ConvLayout, Dim, state_dims
from kvbridge.shard import local_axis_elems, local_units
from kvbridge.spec import Component, DType, LayerKind, LayerSpec, Scope, Segment

STATE = "state"  # the slot group of a request's Mamba state
SWA = "swa"  # the page group of the sliding-window sub-pool


class StateKind(enum.Enum):
    """The SGLang state types kvbridge describes (SGLang's ``StateType`` values)."""

    MAMBA = "mamba"
    SWA = "swa"
    DSA = "dsa"


@dataclass(frozen=True)
class StateArgs:
    """One extra state component of SGLang's ``KVArgs``: its buffers (address, bytes, bytes of
    one item: a slot or a page) and, for Mamba state, each buffer's global layer id."""

    kind: str  # SGLang's StateType value, as given
    ptrs: tuple[int, ...]
    lens: tuple[int, ...]
    item_lens: tuple[int, ...]
    layer_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.ptrs)
        if not n or {len(self.lens), len(self.item_lens)} != {n}:
            raise LayoutError(
                f"KVArgs state {self.kind!r}: {n} addresses, {len(self.lens)} lengths, "
                f"{len(self.item_lens)} item lengths: expected as many of each, at least one"
            )
        if self.layer_ids and len(self.layer_ids) != n:
            raise LayoutError(
                f"KVArgs state {self.kind!r}: {len(self.layer_ids)} layer ids for {n} buffers"
            )
        for ln, i in zip(self.lens, self.item_lens, strict=True):
            # DSA elides the indexer of a layer that reuses the previous layer's top-k.
            if i < 1 and (ln or self.kind != StateKind.DSA.value):
                raise LayoutError(
                    f"KVArgs state {self.kind!r}: a buffer of {ln} bytes with empty items "
                    f"(only DSA's indexer leaves a layer empty, with no bytes)"
                )
            if i and ln % i:
                raise LayoutError(
                    f"KVArgs state {self.kind!r}: a buffer of {ln} bytes is not whole items of {i}"
                )

    @property
    def state_kind(self) -> StateKind:
        try:
            return StateKind(self.kind)
        except ValueError:
            raise LayoutError(
                f"SGLang state type {self.kind!r}: kvbridge's SGLang backend describes "
                f"{[k.value for k in StateKind]} state (HybridLinearKVPool's Mamba state, "
                f"SWAKVPool's window, DSATokenToKVPool's indexer keys) so far; {self.kind!r} "
                f"would not be moved"
            ) from None


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
) -> tuple[tuple[LayerSpec, ...], list[dict[str, Buffer]]]:
    """The layers of a hybrid model's pools, in the model's layer order, and the buffers of
    each (component name -> buffer). ``window``: the tokens SGLang keeps of a sliding layer
    (its scheduler's, which may be the config's less one); the config's where None. Refuses,
    saying what, whatever does not add up."""
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
        for i, (lid, ptr, nbytes) in enumerate(zip(sliding * 2, swa.ptrs, swa.lens, strict=True)):
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


def window_table(tokens: int, page_size: int, pages: Sequence[int]) -> list[int]:
    """A request's sliding-window page table from SGLang's window page list: the list ends at
    the page of the request's last token (both servers compute it from the request's own
    length); what it covers before that, and so its length, may differ between the prefill's
    and the decode's list by a page (the seed's index-length bug). Pages before the list are
    -1 (freed: never addressed unless a token the window needs falls there, which the planner
    refuses, naming the token)."""
    n = -(-tokens // page_size)
    ids = [int(p) for p in pages]
    if len(ids) > n:
        raise PlacementError(
            f"{len(ids)} sliding-window pages for a {tokens}-token request: it has {n} pages "
            f"of {page_size}"
        )
    return [-1] * (n - len(ids)) + ids


@dataclass(frozen=True)
class StateIndices:
    """What SGLang's ``state_indices`` (a list parallel to its state types) say of a request:
    its Mamba state slot and its sliding-window page list, where the pools have them."""

    slot: int | None = None
    window: tuple[int, ...] | None = None

    @classmethod
    def parse(cls, states: Sequence[StateArgs], given: Sequence[object] | None) -> StateIndices:
        if not states:
            return cls()
        try:
            lists = list(given or ())
        except TypeError:
            lists = [given]  # not a list: as wrong a count as any
        if len(lists) != len(states):
            raise PlacementError(
                f"state indices: {len(lists)} lists for SGLang's state types "
                f"{[s.kind for s in states]}: expected one each"
            )
        out = cls()
        for s, ids in zip(states, lists, strict=True):
            flat = _ids(ids)
            kind = s.state_kind
            if kind is StateKind.MAMBA:
                if len(flat) != 1 or flat[0] < 0:
                    raise PlacementError(f"Mamba state indices {flat}: expected one slot id, >= 0")
                out = dataclasses.replace(out, slot=flat[0])
            elif kind is StateKind.SWA:
                out = dataclasses.replace(out, window=tuple(flat))
            # DSA: the indexer's pages are the request's KV pages (one page table); the two
            # sides' lists may differ by a page (the seeds' bug), so they are checked as ids
            # and otherwise not relied on.
        return out


def _ids(ids: object) -> list[int]:
    """One state's indices as SGLang gives them (a list, a numpy array, a CPU tensor, or a
    list of those), flat."""
    out: list[int] = []
    try:
        _flatten(ids, out, 0)
    except (TypeError, ValueError, OverflowError) as e:
        raise PlacementError(f"state indices {ids!r}: expected integer ids ({e})") from None
    return out


def int64_ids(arr: np.ndarray) -> np.ndarray:
    """``arr``'s ids as flat int64: TypeError for floats or bools, OverflowError past int64
    (never one read as another id)."""
    flat = arr.reshape(-1)
    if flat.size and not np.issubdtype(flat.dtype, np.integer):
        raise TypeError(f"{flat.dtype} ids")
    if flat.dtype.kind == "u" and flat.size and int(flat.max()) >= 1 << 63:
        raise OverflowError("an id past int64")
    return flat.astype(np.int64)


def _flatten(ids: object, out: list[int], depth: int) -> None:
    if depth > 3:
        raise TypeError("nested deeper than lists of lists")
    tolist = getattr(ids, "cpu", None)  # a torch tensor: numpy reads it from the CPU
    arr = np.asarray(tolist() if callable(tolist) else ids)
    if arr.dtype != object:
        out.extend(int(x) for x in int64_ids(arr))
    elif arr.ndim == 0:  # not an id, nor a list of them (or an id past int64: not SGLang's)
        raise TypeError(f"a {type(ids).__name__} among the ids")
    else:  # a list of arrays or tensors
        for x in arr.reshape(-1):
            _flatten(x, out, depth + 1)


def states_of(args: Any) -> tuple[StateArgs, ...]:
    """The extra state components of SGLang's ``KVArgs`` (one per state type, in its order)."""
    kinds = [str(getattr(t, "value", t)) for t in getattr(args, "state_types", None) or ()]

    def per(field: str) -> list[Any]:
        got = list(getattr(args, field, None) or ())
        return got + [()] * (len(kinds) - len(got))

    return tuple(
        StateArgs(kind, tuple(ptrs), tuple(lens), tuple(items), tuple(int(i) for i in ids or ()))
        for kind, ptrs, lens, items, ids in zip(
            kinds,
            per("state_data_ptrs"),
            per("state_data_lens"),
            per("state_item_lens"),
            per("state_layer_ids"),
            strict=True,
        )
    )


__all__ = [
    "StateIndices",
    "STATE",
    "SWA",
    "Attention",
    "Buffer",
    "StateArgs",
    "StateKind",
    "hybrid_layers",
    "index_keys",
    "states_of",
    "window_table",
]
