"""ParallelLayout: how one side (prefill or decode) splits the model over ranks.

Engine ranks are numbered ``pp_rank * tp + tp_rank``. Each PP stage's layer range is given
explicitly, so the two sides may split layers differently.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.errors import LayoutError

# Far past any real deployment (TP 64 at most today); bounds the rank loops of a pairing.
MAX_TP = 1024


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    layer_ranges: tuple[tuple[int, int], ...]  # per PP stage: [start, stop)

    def __post_init__(self) -> None:
        if not 1 <= self.tp <= MAX_TP:
            raise LayoutError(f"TP size must be in [1, {MAX_TP}], got {self.tp}")
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
    def even(cls, num_layers: int, tp: int = 1, pp: int = 1) -> ParallelLayout:
        """PP stages of (nearly) equal size, the earlier ones one larger when uneven."""
        if pp < 1 or pp > num_layers:
            raise LayoutError(f"PP size must be in [1, {num_layers}] for {num_layers} layers, "
                              f"got {pp}")
        base, extra = divmod(num_layers, pp)
        ranges, lo = [], 0
        for s in range(pp):
            hi = lo + base + (1 if s < extra else 0)
            ranges.append((lo, hi))
            lo = hi
        return cls(tp=tp, layer_ranges=tuple(ranges))

    @classmethod
    def from_split(cls, tp: int, split: tuple[int, ...]) -> ParallelLayout:
        """Stages holding ``split[i]`` layers each, e.g. ``(20, 44)``."""
        ranges, lo = [], 0
        for n in split:
            ranges.append((lo, lo + n))
            lo += n
        return cls(tp=tp, layer_ranges=tuple(ranges))

    @property
    def pp(self) -> int:
        return len(self.layer_ranges)

    @property
    def num_layers(self) -> int:
        return self.layer_ranges[-1][1]

    @property
    def world(self) -> int:
        return self.tp * self.pp

    def engine_rank(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp + tp_rank

    def split_rank(self, engine_rank: int) -> tuple[int, int]:
        """``(pp_rank, tp_rank)`` of an engine rank."""
        if not 0 <= engine_rank < self.world:
            raise LayoutError(f"engine rank {engine_rank} out of range [0, {self.world})")
        return divmod(engine_rank, self.tp)

    def stage_of_layer(self, layer: int) -> int:
        for s, (lo, hi) in enumerate(self.layer_ranges):
            if lo <= layer < hi:
                return s
        raise LayoutError(f"layer {layer} is outside [0, {self.num_layers})")

    def layers_of(self, engine_rank: int) -> range:
        pp_rank, _ = self.split_rank(engine_rank)
        return range(*self.layer_ranges[pp_rank])

    def describe(self) -> str:
        if self.pp == 1:
            return f"TP{self.tp}"
        return f"TP{self.tp}xPP{self.pp}" + "(" + ",".join(f"{lo}-{hi - 1}" for lo, hi in
                                                     self.layer_ranges) + ")"
