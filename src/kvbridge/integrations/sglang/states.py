"""SGLang's pools with extra state (hybrid models), in kvbridge's terms. Plain data, no SGLang
import.

SGLang 0.5.23 hands its transfer backend, beside the full-attention pool, a list of extra state
components (``KVArgs.state_types`` and the ``state_*`` lists, one entry per component):

- ``mamba`` (``HybridLinearKVPool``: gated delta net, Mamba2): per Mamba layer and state tensor a
  slab ``[slots + 1, ...]``, one slot a request; the entries are every conv tensor of every
  Mamba layer, then the temporal (SSM / recurrent) tensor of every layer, each with its global
  layer id. Conv is ``[conv_dim / tp, K - 1]`` a slot (channel-major: kvbridge's
  :attr:`~kvbridge.planner.layout.ConvLayout.DS`), its channels this rank's share of each segment in
  turn (GDN: q | k | v; Mamba2: x | B | C); temporal is ``[heads / tp, ...]``. Each keeps its own
  dtype (conv in bf16 by default even for an fp32 model), read here from the slot's bytes.
- ``swa`` (``SWAKVPool``): the sliding-window layers' K buffers, then their V buffers, a page an
  item, without layer ids (kvbridge's hook reads them from the pool, and the model's config
  must agree: :func:`.internals.note_pools`); the main KV buffers are then the full-attention
  layers' only. Llama 4's chunked-attention layers are kept there too, with the chunk as the
  window.
- ``dsa`` (``DSATokenToKVPool``, DeepSeek-V3.2 beside its MLA pool): each layer's indexer keys, a
  KV page an item (the indexer shares the KV pool's page ids), the page's 128-byte fp8 keys of
  every token then their 4-byte scales; a layer that reuses the previous layer's top-k has none
  (an empty buffer, item 0).

This module reads what SGLang says (its ``KVArgs`` state components, a request's state
indices); :mod:`.hybrid` describes the pools from them.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.errors import LayoutError, PlacementError

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
    "STATE",
    "SWA",
    "StateArgs",
    "StateIndices",
    "StateKind",
    "int64_ids",
    "states_of",
    "window_table",
]
