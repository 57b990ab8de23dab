"""ParallelLayout: how one side (prefill or decode) splits the model and a request over ranks.

Three axes: TP shards heads (and every other sharded unit, :mod:`kvbridge.planner.shard`), PP splits
layers (each stage's layer range is given explicitly, so the two sides may split layers
differently), and context parallelism splits a request's tokens. Context parallelism comes in
the two forms engines use, which combine:

* ``cp``: context-parallel groups, each a whole TP group of its own (the world grows:
  SGLang's and vLLM's prefill context parallel);
* ``dcp``: the ranks of one TP group that hold the same KV heads split those heads' tokens
  instead of keeping copies (the world does not grow: vLLM's decode context parallel; TP rank
  ``r`` is DCP rank ``r % dcp``).

A rank's *token shard* is ``cp_rank * dcp + tp_rank % dcp``;
:class:`~kvbridge.planner.tokenmap.TokenMap` says which shard holds each token. Per-request state is
not split by tokens: every rank of the CP group holding the request's last token has it.

Engine ranks are numbered ``(pp_rank * cp + cp_rank) * tp + tp_rank``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from kvbridge.errors import LayoutError
from kvbridge.planner.tokenmap import MAX_SHARDS, TokenMap, TokenSplit

# Far past any real deployment (TP 64 at most today); bounds the rank loops of a pairing.
MAX_TP = 1024
MAX_DP = 1024  # attention DP groups of a side (kvbridge.bootstrap.groups)


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    layer_ranges: tuple[tuple[int, int], ...]  # per PP stage: [start, stop)
    cp: int = 1  # context-parallel groups, each of tp ranks
    dcp: int = 1  # token shards within a TP group (a divisor of tp)
    split: TokenSplit = TokenSplit.INTERLEAVED  # how tokens map to shards (cp * dcp > 1)
    interleave: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.tp <= MAX_TP:
            raise LayoutError(f"TP size must be in [1, {MAX_TP}], got {self.tp}")
        if (
            isinstance(self.cp, bool)
            or not isinstance(self.cp, int)
            or not 1 <= self.cp <= MAX_SHARDS
        ):
            raise LayoutError(f"CP size must be an integer in [1, {MAX_SHARDS}], got {self.cp!r}")
        if (
            isinstance(self.dcp, bool)
            or not isinstance(self.dcp, int)
            or self.dcp < 1
            or self.tp % self.dcp
        ):
            raise LayoutError(
                f"DCP size must divide the TP size {self.tp} (its ranks split "
                f"the tokens of the heads they share), got {self.dcp!r}"
            )
        if self.cp * self.tp > MAX_TP:
            raise LayoutError(f"CP {self.cp} x TP {self.tp} ranks a stage: at most {MAX_TP}")
        TokenMap(self.cp * self.dcp, self.split, self.interleave)  # validates split, interleave
        if not self.layer_ranges:
            raise LayoutError("a parallel layout needs at least one PP stage")
        expect = 0
        for i, (lo, hi) in enumerate(self.layer_ranges):
            if lo != expect or hi <= lo:
                raise LayoutError(
                    f"PP stage {i} covers layers [{lo}, {hi}); expected a non-empty range "
                    f"starting at {expect} (stages must be contiguous and in order)"
                )
            expect = hi

    @classmethod
    def even(
        cls,
        num_layers: int,
        tp: int = 1,
        pp: int = 1,
        *,
        cp: int = 1,
        dcp: int = 1,
        split: TokenSplit = TokenSplit.INTERLEAVED,
        interleave: int = 1,
    ) -> ParallelLayout:
        """PP stages of (nearly) equal size, the earlier ones one larger when uneven."""
        if pp < 1 or pp > num_layers:
            raise LayoutError(
                f"PP size must be in [1, {num_layers}] for {num_layers} layers, got {pp}"
            )
        base, extra = divmod(num_layers, pp)
        ranges, lo = [], 0
        for s in range(pp):
            hi = lo + base + (1 if s < extra else 0)
            ranges.append((lo, hi))
            lo = hi
        return cls(tp, tuple(ranges), cp, dcp, split, interleave)

    @classmethod
    def from_split(
        cls,
        tp: int,
        layers: tuple[int, ...],
        *,
        cp: int = 1,
        dcp: int = 1,
        split: TokenSplit = TokenSplit.INTERLEAVED,
        interleave: int = 1,
    ) -> ParallelLayout:
        """Stages holding ``layers[i]`` layers each, e.g. ``(20, 44)``."""
        ranges, lo = [], 0
        for n in layers:
            ranges.append((lo, lo + n))
            lo += n
        return cls(tp, tuple(ranges), cp, dcp, split, interleave)

    @property
    def pp(self) -> int:
        return len(self.layer_ranges)

    @property
    def num_layers(self) -> int:
        return self.layer_ranges[-1][1]

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp

    @property
    def stage_world(self) -> int:
        """Ranks of one PP stage."""
        return self.tp * self.cp

    @cached_property
    def tokens(self) -> TokenMap:
        return TokenMap(self.cp * self.dcp, self.split, self.interleave)

    def engine_rank(self, pp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        return (pp_rank * self.cp + cp_rank) * self.tp + tp_rank

    def coords(self, engine_rank: int) -> tuple[int, int, int]:
        """``(pp_rank, cp_rank, tp_rank)`` of an engine rank."""
        if not 0 <= engine_rank < self.world:
            raise LayoutError(f"engine rank {engine_rank} out of range [0, {self.world})")
        stage, rest = divmod(engine_rank, self.stage_world)
        cp_rank, tp_rank = divmod(rest, self.tp)
        return stage, cp_rank, tp_rank

    def split_rank(self, engine_rank: int) -> tuple[int, int]:
        """``(pp_rank, tp_rank)`` of an engine rank."""
        stage, _, tp_rank = self.coords(engine_rank)
        return stage, tp_rank

    def shard(self, cp_rank: int, tp_rank: int) -> int:
        """The token shard of the rank at ``(cp_rank, tp_rank)`` of any stage."""
        return cp_rank * self.dcp + tp_rank % self.dcp

    def shard_of(self, engine_rank: int) -> int:
        _, cp_rank, tp_rank = self.coords(engine_rank)
        return self.shard(cp_rank, tp_rank)

    def state_group(self, tokens: int) -> int:
        """The CP group holding a request's per-request state: the one of its last token."""
        return self.tokens.holder(tokens) // self.dcp if self.cp > 1 else 0

    def stage_of_layer(self, layer: int) -> int:
        for s, (lo, hi) in enumerate(self.layer_ranges):
            if lo <= layer < hi:
                return s
        raise LayoutError(f"layer {layer} is outside [0, {self.num_layers})")

    def layers_of(self, engine_rank: int) -> range:
        pp_rank, _ = self.split_rank(engine_rank)
        return range(*self.layer_ranges[pp_rank])

    def describe(self) -> str:
        out = f"CP{self.cp}x" if self.cp > 1 else ""
        out += f"TP{self.tp}" + (f"(DCP{self.dcp})" if self.dcp > 1 else "")
        if self.pp > 1:
            out += (
                f"xPP{self.pp}(" + ",".join(f"{lo}-{hi - 1}" for lo, hi in self.layer_ranges) + ")"
            )
        if self.cp * self.dcp > 1:
            out += f" tokens {self.tokens.describe()}"
        return out
