"""How one demo case is laid out: the job every process gets, both sides' memory and the
request's placement on each. Shared by the parent (to validate and count bytes) and the
workers; imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvbridge.demo.models import ModelCase
from kvbridge.model.spec import CacheSpec
from kvbridge.planner.layout import build_memory, default_group, window_pool_group
from kvbridge.planner.placement import Placement
from kvbridge.planner.plan import Side
from kvbridge.planner.sidespec import SideOptions

ROOM = 7
IDLE = "IDLE"  # a rank's state where its DP group does not hold the request


@dataclass(frozen=True)
class Job:
    """One case: a model, a prompt, two sides and a transport."""

    model: ModelCase
    seed: int
    digest: str  # of the weights, as the reference built them
    prompt: tuple[int, ...]
    new_tokens: int
    chunk: int  # prefill chunk, in tokens
    prefill: SideOptions
    decode: SideOptions
    transport: str
    timeout: float
    prefill_settings: Mapping[str, Any] = field(default_factory=dict)
    decode_settings: Mapping[str, Any] = field(default_factory=dict)
    # Tests only: a context-parallel prefill rank drops the cache handed over to it.
    forget_handover: bool = False
    device: str = "cpu"  # where the model and the pools are: cpu or cuda[:I] (torch's names)

    # With attention DP, the request lives in one group a side; the others run idle. Never
    # group ROOM % dp: a decode rank that guessed the prefill group that way would be wrong.
    @property
    def prefill_group(self) -> int:
        return (ROOM + 1) % self.prefill.dp

    @property
    def decode_group(self) -> int:
        return (ROOM + 1) % self.decode.dp


def with_window_pools(
    spec: CacheSpec, prefill: SideOptions, decode: SideOptions
) -> tuple[SideOptions, SideOptions]:
    """Sliding-window layers get a page pool of their own on both sides, as hybrid-SWA engines
    keep them."""
    if any(layer.window is not None for layer in spec.layers):
        return replace(prefill, swa=True), replace(decode, swa=True)
    return prefill, decode


def _pages(opts: SideOptions, tokens: int) -> tuple[int, int]:
    need = -(-tokens // opts.page)
    return need, need + 3


def build_side(spec: CacheSpec, opts: SideOptions, tokens: int) -> Side:
    """A side with room for the request and a few spare pages; LayoutError if the model's heads
    (or groups) cannot be sharded over its TP size."""
    _, pages = _pages(opts, tokens)
    par = opts.parallel(spec.num_layers)
    mem = build_memory(
        spec,
        par,
        page_size=opts.page,
        num_pages=pages,
        kv_layout=opts.layout,
        conv_layout=opts.conv,
        state_slots=2,
        aux_slots=2,
        group_of=window_pool_group if opts.swa else default_group,
    )
    return Side(spec, par, mem)


def placement(spec: CacheSpec, opts: SideOptions, tokens: int, decode: bool) -> Placement:
    """Shuffled pages, and slot 0 (prefill) or 1 (decode). The decode side's sliding-window
    pool holds only the pages of the window: the others are -1, as a hybrid-SWA engine frees
    them."""
    need, pages = _pages(opts, tokens)
    ids = np.random.default_rng(2 if decode else 1).permutation(pages)[:need]
    swa = ids.copy()
    windows = [layer.window for layer in spec.layers if layer.window is not None]
    if decode and opts.swa and windows:
        swa[: max(0, tokens - max(windows)) // opts.page] = -1
    slot = 1 if decode else 0
    return Placement.simple(tokens, ids, state_slot=slot, aux_slot=slot, swa_page_ids=swa)


def prefill_chunk(opts: SideOptions, tokens: int, chunk: int) -> int:
    """The prefill chunk of a case. A context-parallel prefill side computes each shard's
    pieces of the prompt on the rank holding them; every piece boundary is then a chunk
    boundary (and the reference chunks the same way), so that each token's KV comes from the
    same float operations everywhere."""
    pieces = opts.token_map().pieces(tokens)
    cuts = [s for s, _, _ in pieces[1:]]
    return math.gcd(*cuts) if cuts else chunk


def chunks(tokens: int, size: int) -> list[tuple[int, int]]:
    """The prefill chunks ``[start, stop)`` (one chunk when ``size`` is 0)."""
    size = size if size > 0 else tokens
    return [(s, min(tokens, s + size)) for s in range(0, tokens, size)]
