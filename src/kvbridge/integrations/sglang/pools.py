"""SGLang's KV pools on one rank, in kvbridge's terms. Plain data, no SGLang import.

SGLang describes a rank's pools to its transfer backend in a ``KVArgs``: one address, byte
length and per-page byte length per buffer (K of every layer, then V of every layer, for its
MHA pool; one latent buffer per layer for its MLA pool), the page size, the KV heads this rank
holds and the model's total, and its metadata ("aux") buffers, several per request slot. A
pool buffer is ``[slots, heads, head_dim]`` with ``page_size`` consecutive token slots a page
(SGLang's NHD layout; slot ``page * page_size + i`` is token ``i`` of page ``page``).

:func:`describe` turns that into a :class:`~kvbridge.model.spec.CacheSpec` and a
:class:`~kvbridge.planner.layout.SideMemory` over the pools' own memory, in bytes: a head is
``head_bytes`` elements of one byte, so the planner slices KV heads (and GQA replicas) the
same whatever the dtype; the dtype is part of the spec's name, so two sides that store
different dtypes of one width are still refused at registration. The aux buffers of a slot
are packed, in order, into kvbridge's one aux slot (:class:`AuxPacker`). SGLang names pages,
kvbridge plans tokens: :func:`decode_placement` and :class:`PrefillPages` turn the one into
the other (so that the two sides may use different page sizes).
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.errors import LayoutError, PlacementError
from kvbridge.integrations.sglang.hybrid import Attention, Buffer, hybrid_layers, index_keys
from kvbridge.integrations.sglang.states import (
    STATE,
    SWA,
    StateArgs,
    StateIndices,
    StateKind,
    int64_ids,
    window_table,
)
from kvbridge.memory.location import HOST, Location
from kvbridge.model.spec import CacheSpec, Component, DType, LayerKind, LayerSpec, Scope, Segment
from kvbridge.planner.layout import AUX, BufferLayout, Dim, Region, SideMemory
from kvbridge.planner.placement import Placement

KV = "kv"  # the one page table of a request
NO_STATE = StateIndices()  # a request of pools without extra state


@dataclass(frozen=True)
class PoolArgs:
    """What kvbridge reads of SGLang's ``KVArgs`` (and of its server's parallel layout)."""

    kv_ptrs: tuple[int, ...]
    kv_lens: tuple[int, ...]
    kv_item_lens: tuple[int, ...]  # bytes of one page of each buffer
    page_size: int
    kv_heads: int  # this rank's (0 for MLA)
    total_kv_heads: int
    aux_ptrs: tuple[int, ...]
    aux_lens: tuple[int, ...]
    aux_item_lens: tuple[int, ...]
    dtype: str  # the KV cache's dtype, as SGLang names it
    mla: bool = False
    tp: int = 1
    tp_rank: int = 0
    states: tuple[StateArgs, ...] = ()  # the pools' extra state, in SGLang's order
    kv_layer_ids: tuple[int, ...] = ()  # global layer id of each KV buffer (hybrid pools)
    model: Mapping[str, object] | None = None  # the model's HF config (hybrid pools)
    window: int | None = None  # SGLang's sliding window, where it differs from the config's
    swa_layer_ids: tuple[int, ...] = ()  # global layer id of each sliding-window sub-pool layer
    location: Location = HOST  # where the pools are: the server's GPU, or the host

    def __post_init__(self) -> None:
        lens = {len(self.kv_ptrs), len(self.kv_lens), len(self.kv_item_lens)}
        aux = {len(self.aux_ptrs), len(self.aux_lens), len(self.aux_item_lens)}
        if len(lens) != 1 or len(aux) != 1 or not self.kv_ptrs or not self.aux_ptrs:
            raise LayoutError(
                f"KVArgs: {len(self.kv_ptrs)} KV buffer addresses, {len(self.kv_lens)} "
                f"lengths, {len(self.kv_item_lens)} page lengths and {len(self.aux_ptrs)}/"
                f"{len(self.aux_lens)}/{len(self.aux_item_lens)} aux ones: expected as many "
                f"of each, at least one"
            )
        if self.page_size < 1 or not 0 <= self.tp_rank < self.tp:
            raise LayoutError(
                f"KVArgs: page size {self.page_size}, TP rank {self.tp_rank} of {self.tp}"
            )
        if any(n < 1 for n in (*self.kv_item_lens, *self.aux_item_lens)):
            raise LayoutError("KVArgs: a buffer with empty pages or aux items")


@dataclass(frozen=True)
class Description:
    spec: CacheSpec
    memory: SideMemory
    regions: tuple[tuple[str, int, int], ...]  # (name, address, bytes) of each pool buffer
    num_pages: int
    aux_slots: int


Placed = dict[tuple[int, str], tuple[str, int, int, BufferLayout]]


def _layers(args: PoolArgs) -> int:
    n = len(args.kv_ptrs)
    if args.mla:
        return n
    if n % 2:
        raise LayoutError(
            f"an MHA pool lists K then V of every layer: {n} buffers is not an even count"
        )
    return n // 2


def describe(args: PoolArgs) -> Description:
    """This rank's pools as kvbridge describes them (refused, saying what, where kvbridge
    cannot describe SGLang's pools exactly)."""
    item = args.kv_item_lens[0]
    if len(set(args.kv_item_lens)) != 1 or item % args.page_size:
        raise LayoutError(
            f"KV buffers with pages of {sorted(set(args.kv_item_lens))} bytes at page size "
            f"{args.page_size}: expected one page length, a whole number of bytes a token"
        )
    token_bytes = item // args.page_size
    pages = {n // item for n in args.kv_lens}
    if len(pages) != 1 or min(args.kv_lens) % item:
        raise LayoutError(
            f"KV buffers of {sorted(set(args.kv_lens))} bytes: expected one length, whole "
            f"pages of {item} bytes"
        )
    num_pages = pages.pop()
    dims = (
        Dim("page", num_pages, item),
        Dim("token", args.page_size, token_bytes),
        Dim("elem", token_bytes, 1),
    )
    placed: Placed = {}  # (layer, component) -> (region, address, bytes, layout)
    if args.mla and all(s.state_kind is not StateKind.MAMBA for s in args.states):
        specs = _mla(args, dims, placed)
    elif args.states:  # hybrid pools (Kimi Linear's over an MLA pool)
        specs = _hybrid(args, item, placed)
    else:
        heads = args.kv_heads
        want = heads * args.tp if args.total_kv_heads >= args.tp else args.total_kv_heads
        if heads < 1 or token_bytes % heads or want != args.total_kv_heads:
            raise LayoutError(
                f"{heads} KV heads a rank at TP {args.tp} in tokens of {token_bytes} bytes do "
                f"not make the model's {args.total_kv_heads} KV heads"
            )
        layers = _layers(args)
        head = Segment("heads", args.total_kv_heads, token_bytes // heads)
        k = Component("k", Scope.TOKEN, (head,), DType.UINT8)
        v = Component("v", Scope.TOKEN, (head,), DType.UINT8)
        specs = tuple(LayerSpec(LayerKind.FULL, (k, v)) for _ in range(layers))
        # SGLang lists K of every layer, then V of every layer.
        for i, (ptr, n) in enumerate(zip(args.kv_ptrs, args.kv_lens, strict=True)):
            li, name = i % layers, "k" if i < layers else "v"
            region = f"L{li}.{name}"
            placed[(li, name)] = (region, ptr, n, BufferLayout(region, 0, dims, KV, itemsize=1))
    spans = aux_spans(args.aux_item_lens)
    aux_bytes = spans[-1][0] + spans[-1][1]
    aux_slots = min(n // i for n, i in zip(args.aux_lens, args.aux_item_lens, strict=True))
    spec = CacheSpec(f"sglang kv_cache_dtype={args.dtype}", specs, aux_bytes=aux_bytes)
    # One region a buffer (a DSA indexer buffer holds two components).
    regions = tuple({region: (region, ptr, n) for region, ptr, n, _ in placed.values()}.values())
    memory = SideMemory(
        (*(Region(n, b) for n, _, b in regions), Region(AUX, aux_slots * aux_bytes)),
        {key: layout for key, (_, _, _, layout) in placed.items()},
        BufferLayout(AUX, 0, (Dim("slot", aux_slots, aux_bytes), Dim("elem", aux_bytes, 1)), AUX),
    )
    return Description(spec, memory, regions, num_pages, aux_slots)


def _mla(args: PoolArgs, dims: tuple[Dim, ...], placed: Placed) -> tuple[LayerSpec, ...]:
    """An MLA pool: one latent a token, the same on every rank, and where SGLang gives a
    ``DSATokenToKVPool``, each layer's indexer keys in the same pages."""
    token_bytes = dims[-1].size
    layers = len(args.kv_ptrs)
    index: list[tuple[tuple[Component, ...], dict[str, Buffer]]] = [((), {})] * layers
    for state in args.states:
        if state.state_kind is not StateKind.DSA:
            raise LayoutError(
                f"SGLang pools with {state.kind!r} state beside an MLA pool: kvbridge "
                f"describes DSA's indexer and Kimi Linear's Mamba pool there so far"
            )
        index = index_keys(state, layers, args.page_size, KV)
    latent = Component("latent", Scope.TOKEN, (Segment("latent", 1, token_bytes),), DType.UINT8)
    specs = []
    for li, (ptr, n) in enumerate(zip(args.kv_ptrs, args.kv_lens, strict=True)):
        region = f"L{li}.latent"
        placed[(li, "latent")] = (region, ptr, n, BufferLayout(region, 0, dims, KV, itemsize=1))
        comps, buffers = index[li]
        for name, b in buffers.items():
            placed[(li, name)] = (b.region, b.ptr, b.nbytes, b.layout)
        kind = LayerKind.MLA_INDEXER if comps else LayerKind.MLA
        specs.append(LayerSpec(kind, (latent, *comps)))
    return tuple(specs)


def _hybrid(args: PoolArgs, item: int, placed: Placed) -> tuple[LayerSpec, ...]:
    """A hybrid model's layers (from its config) over SGLang's pools with extra state."""
    if args.model is None:
        raise LayoutError(
            f"SGLang pools with extra state {[s.kind for s in args.states]}: describing them "
            f"needs the model's config"
        )
    attention = Attention(
        args.kv_ptrs,
        args.kv_lens,
        item,
        args.page_size,
        args.kv_heads,
        args.total_kv_heads,
        args.kv_layer_ids,
        args.mla,
    )
    specs, buffers = hybrid_layers(
        args.model, attention, args.states, args.tp, KV, args.window, args.swa_layer_ids
    )
    for li, comps in enumerate(buffers):
        for name, b in comps.items():
            placed[(li, name)] = (b.region, b.ptr, b.nbytes, b.layout)
    return specs


def page_ids(pages: object) -> np.ndarray:
    """SGLang's page ids (a list, a numpy array, a CPU tensor) as int64, or PlacementError:
    never a float or a bool read as a page."""
    try:
        return int64_ids(np.asarray(pages))
    except (TypeError, ValueError, OverflowError) as e:
        raise PlacementError(f"page ids {pages!r}: expected integers ({e})") from None


MAX_TOKENS = 1 << 32  # past any model's context: a request's page table is never sized by more


def _check_request(tokens: int, start: int, page_size: int) -> None:
    if page_size < 1 or tokens > MAX_TOKENS:
        raise PlacementError(
            f"a {tokens}-token request in pages of {page_size}: expected pages of >= 1 token "
            f"and at most {MAX_TOKENS} tokens"
        )
    if not 0 <= start < tokens:
        raise PlacementError(
            f"a prefix of {start} tokens leaves nothing of a {tokens}-token request to receive"
        )


def _pages_of(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def _tables(
    kv: np.ndarray, tokens: int, page_size: int, states: StateIndices, aux: int
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """A request's page tables and slots: its KV pages, and where the pools have them, its
    sliding-window pages and its Mamba state slot."""
    pages, slots = {KV: kv}, {AUX: aux}
    if states.window is not None:
        pages[SWA] = np.asarray(window_table(tokens, page_size, states.window), np.int64)
    if states.slot is not None:
        slots[STATE] = states.slot
    return pages, slots


def decode_placement(
    tokens: int,
    start: int,
    page_size: int,
    pages: Sequence[int] | np.ndarray,
    aux: int,
    states: StateIndices = NO_STATE,
) -> Placement:
    """A decode request's placement from what SGLang's decode scheduler gives: the pages it
    allocated past its prefix-cache hit of ``start`` tokens (the pages before are shared with
    other requests: never written, named -1 here), and its state indices."""
    _check_request(tokens, start, page_size)
    held, ids = start // page_size, page_ids(pages)
    table = np.concatenate([np.full(held, -1, dtype=np.int64), ids])
    if len(table) != _pages_of(tokens, page_size):
        raise PlacementError(
            f"{len(ids)} pages of {page_size} past a prefix of {start} tokens do not hold "
            f"exactly the request's {tokens} tokens (expected "
            f"{_pages_of(tokens, page_size) - held})"
        )
    tables, slots = _tables(table, tokens, page_size, states, aux)
    return Placement(tokens, tables, slots, start)


class PrefillPages:
    """A prefill request's page table as SGLang's sends reveal it, chunk by chunk: each send
    gives the pages of the tokens from where the last one stopped (SGLang ends every chunk but
    the last on a page boundary; the first starts at the decode side's prefix, which may fall
    inside a page: its pages start with that one). The state indices come with the last."""

    def __init__(self, tokens: int, start: int, page_size: int, aux: int) -> None:
        _check_request(tokens, start, page_size)
        self.tokens, self.start, self.page_size, self.aux = tokens, start, page_size, aux
        self.stop = start
        self.states = NO_STATE
        self._table = np.full(_pages_of(tokens, page_size), -1, dtype=np.int64)

    def pages_to_send(self) -> int:
        """How many pages SGLang's prefill sends in all."""
        return _pages_of(self.tokens - self.start, self.page_size)

    def add(
        self, pages: Sequence[int], num_tokens: int | None, states: StateIndices = NO_STATE
    ) -> int:
        """A send's pages (of ``num_tokens`` tokens, or as many as they hold) and state
        indices (SGLang's last send's only): the new stop."""
        ids = page_ids(pages)
        first = self.stop // self.page_size
        if first + len(ids) > len(self._table) or not len(ids):
            raise PlacementError(
                f"{len(ids)} pages from token {self.stop}: the request has "
                f"{len(self._table)} pages of {self.page_size} ({self.tokens} tokens)"
            )
        held = (first + len(ids)) * self.page_size
        n = held - self.stop if num_tokens is None else int(num_tokens)
        stop = self.stop + n
        if n < 1 or stop > min(held, self.tokens):
            raise PlacementError(
                f"{n} tokens from token {self.stop} in {len(ids)} pages of {self.page_size} "
                f"(a {self.tokens}-token request)"
            )
        if states != NO_STATE and stop != self.tokens:
            raise PlacementError(
                f"state indices with the send that stops at token {stop}: SGLang gives them "
                f"with the last ({self.tokens})"
            )
        self._table[first : first + len(ids)] = ids
        self.stop, self.states = stop, states if stop == self.tokens else self.states
        return stop

    def placement(self) -> Placement:
        tables, slots = _tables(
            self._table.copy(), self.tokens, self.page_size, self.states, self.aux
        )
        return Placement(self.tokens, tables, slots, self.start)


def aux_spans(item_lens: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """(offset, bytes) of each SGLang aux buffer's item inside kvbridge's aux slot."""
    spans, at = [], 0
    for n in item_lens:
        spans.append((at, n))
        at += n
    return tuple(spans)


@dataclass(frozen=True)
class AuxPacker:
    """Moves one request slot's SGLang metadata (several buffers, ``addresses`` with items of
    ``item_lens`` bytes) to and from kvbridge's aux slot of the same index (at ``base``)."""

    base: int
    addresses: tuple[int, ...]
    item_lens: tuple[int, ...]

    @property
    def slot_bytes(self) -> int:
        return sum(self.item_lens)

    def pack(self, slot: int) -> None:
        at = self.base + slot * self.slot_bytes
        for (off, n), ptr in zip(aux_spans(self.item_lens), self.addresses, strict=True):
            ctypes.memmove(at + off, ptr + slot * n, n)

    def unpack(self, slot: int) -> None:
        at = self.base + slot * self.slot_bytes
        for (off, n), ptr in zip(aux_spans(self.item_lens), self.addresses, strict=True):
            ctypes.memmove(ptr + slot * n, at + off, n)
