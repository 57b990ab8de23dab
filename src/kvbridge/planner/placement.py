"""Placement: where one request lives on one side.

Token ``t`` of a per-token component in page group ``g`` lives in page
``pages[g][t // page_size]`` at slot ``t % page_size``. Page id -1 marks a page the engine did
not allocate (a sliding-window pool frees pages outside the window); it is an error only if a
needed token falls in it. ``slots`` maps a slot group (``"state"``, ``"aux"``) to the request's
slot index.

``start``: the first token this side takes part in. A decode placement starting past 0 already
holds tokens ``[0, start)`` (a prefix-cache hit): only ``[start, tokens)`` is planned, written
and waited for, and its pages before ``start`` (shared with other requests, or -1) are never
read, written or checked. State and aux are the last token's and travel as always.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.errors import PlacementError


@dataclass(frozen=True, eq=False)
class Placement:
    tokens: int
    pages: Mapping[str, np.ndarray]
    slots: Mapping[str, int]
    start: int = 0

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise PlacementError(f"a request needs at least one token, got {self.tokens}")
        if not 0 <= self.start < self.tokens:
            raise PlacementError(
                f"start {self.start} must be in [0, {self.tokens}): a "
                f"placement takes part in at least its last token"
            )
        fixed = {}
        for g, ids in self.pages.items():
            arr = np.asarray(ids)
            if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
                raise PlacementError(
                    f"page ids of group {g!r} must be a 1-D integer array, got "
                    f"shape {arr.shape} dtype {arr.dtype}"
                )
            arr = arr.astype(np.int64, copy=False)
            if arr.size and int(arr.min()) < -1:
                raise PlacementError(
                    f"page ids of group {g!r}: {int(arr.min())} is negative "
                    f"(only -1, 'not allocated', may be)"
                )
            fixed[g] = arr
        object.__setattr__(self, "pages", fixed)
        for g, s in self.slots.items():
            if int(s) < 0:
                raise PlacementError(f"slot {g!r} must be >= 0, got {s}")
        object.__setattr__(self, "slots", {g: int(s) for g, s in self.slots.items()})

    @classmethod
    def simple(
        cls,
        tokens: int,
        page_ids: np.ndarray | list[int],
        *,
        state_slot: int = 0,
        aux_slot: int = 0,
        swa_page_ids: np.ndarray | list[int] | None = None,
        start: int = 0,
    ) -> Placement:
        """The common case: one page table (plus an optional sliding-window one) and slots."""
        pages = {"kv": np.asarray(page_ids, dtype=np.int64)}
        if swa_page_ids is not None:
            pages["swa"] = np.asarray(swa_page_ids, dtype=np.int64)
        return cls(tokens, pages, {"state": state_slot, "aux": aux_slot}, start)

    def page_ids(self, group: str) -> np.ndarray:
        try:
            return self.pages[group]
        except KeyError:
            raise PlacementError(
                f"no page ids for page group {group!r}; the placement has {sorted(self.pages)}"
            ) from None

    def slot(self, group: str) -> int:
        try:
            return self.slots[group]
        except KeyError:
            raise PlacementError(
                f"no slot for {group!r}; the placement has {sorted(self.slots)}"
            ) from None


# One placement for every token shard of a side, or one per shard (index: the shard).
Placements = Placement | Sequence[Placement]


def per_shard(given: Placements, shards: int, side: str) -> Callable[[int], Placement]:
    """The placement of each token shard of a side: one shared, or one per shard."""
    if isinstance(given, Placement):
        return lambda _k: given
    if len(given) != shards:
        raise PlacementError(
            f"{side}: {len(given)} placements for {shards} token shards; give "
            f"one per shard, or one they share"
        )
    return lambda k: given[k]


def common_start(of: Callable[[int], Placement], shards: int, side: str) -> int:
    """The start every token shard's placement of a side shares (a global token index)."""
    starts = {of(k).start for k in range(shards)}
    if len(starts) != 1:
        raise PlacementError(
            f"{side} placements of one request start at different tokens "
            f"{sorted(starts)}; a start is the request's, not a shard's"
        )
    return starts.pop()
