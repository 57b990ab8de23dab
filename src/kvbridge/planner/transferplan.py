"""What a plan says: the parts a (prefill rank, decode rank) pair delivers, and the runs of
one chunk per pair. :mod:`kvbridge.planner.plan` computes them; transports execute the runs; both
sides' completion rules count the parts."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvbridge.planner.runs import Runs


class PartKind(enum.Enum):
    KV = "kv"
    STATE = "state"
    AUX = "aux"


@dataclass(frozen=True)
class Part:
    """What a pair delivers: KV of tokens ``[start, stop)``, or the state, or the aux slot."""

    kind: PartKind
    start: int = 0
    stop: int = 0

    def __post_init__(self) -> None:
        if self.kind is PartKind.KV and not 0 <= self.start < self.stop:
            raise ValueError(f"a KV part needs 0 <= start < stop, got [{self.start}, {self.stop})")
        if self.kind is not PartKind.KV and (self.start, self.stop) != (0, 0):
            raise ValueError(f"a {self.kind.value} part has no token range")

    def __str__(self) -> str:
        return f"kv[{self.start}:{self.stop}]" if self.kind is PartKind.KV else self.kind.value


@dataclass(frozen=True, eq=False)
class PairPlan:
    prefill_rank: int
    decode_rank: int
    parts: tuple[Part, ...]
    runs: Runs


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """The plan of one chunk. Run region indices point into ``src_regions``/``dst_regions``."""

    start: int
    stop: int
    last: bool
    src_regions: tuple[str, ...]
    dst_regions: tuple[str, ...]
    pairs: tuple[PairPlan, ...]

    @property
    def total_bytes(self) -> int:
        return sum(p.runs.total_bytes for p in self.pairs)

    @property
    def total_runs(self) -> int:
        return sum(len(p.runs) for p in self.pairs)

    def pair(self, prefill_rank: int, decode_rank: int) -> PairPlan | None:
        for p in self.pairs:
            if (p.prefill_rank, p.decode_rank) == (prefill_rank, decode_rank):
                return p
        return None
