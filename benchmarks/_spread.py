"""A sample's median and interquartile range, and the ratio of two ways' times on the same
inputs with its bootstrap interval, for the benchmarks that run ways in turn and say whether the
spread covers the difference between them (sglang_backends.py, sglang_serving.py,
vllm_connectors.py)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Spread:
    median: float
    lo: float  # 25th percentile
    hi: float  # 75th percentile

    @classmethod
    def of(cls, xs: Sequence[float]) -> Spread:
        q = statistics.quantiles(xs, n=4, method="inclusive")
        return cls(statistics.median(xs), q[0], q[2])

    def overlaps(self, other: Spread) -> bool:
        """Whether the two interquartile ranges overlap: the spread covers the difference."""
        return self.lo <= other.hi and other.lo <= self.hi

    def ms(self) -> str:
        """``median (lo-hi)`` of seconds, in ms."""
        return f"{self.median * 1e3:.1f} ({self.lo * 1e3:.1f}-{self.hi * 1e3:.1f})"


@dataclass(frozen=True)
class Paired:
    """One way's times over another's on the same inputs, input by input: the median of the
    ratios and its 95% bootstrap interval. ``groups`` are the inputs that ran together (a
    round under load, whose requests queue behind each other and are not independent): the
    bootstrap draws groups, then inputs within each drawn group."""

    median: float
    lo: float  # 2.5th percentile of the bootstrap's medians
    hi: float  # 97.5th
    n: int  # pairs

    @classmethod
    def of(
        cls, groups: Sequence[Sequence[tuple[float, float]]], draws: int = 2000, seed: int = 0
    ) -> Paired:
        ratios = [np.array([a / b for a, b in g if a > 0 and b > 0]) for g in groups]
        ratios = [r for r in ratios if len(r)]
        if not ratios:
            raise ValueError("no pair of times to compare")
        rng = np.random.default_rng(seed)
        medians = np.empty(draws)
        for i in range(draws):
            picked = rng.integers(len(ratios), size=len(ratios))
            medians[i] = np.median(
                np.concatenate([rng.choice(ratios[j], len(ratios[j])) for j in picked])
            )
        lo, hi = np.percentile(medians, (2.5, 97.5))
        everything = np.concatenate(ratios)
        return cls(float(np.median(everything)), float(lo), float(hi), len(everything))

    def verdict(self) -> str:
        """ "ahead" (under 1 throughout the interval), "behind" (over 1 throughout) or "level"."""
        return "ahead" if self.hi < 1 else "behind" if self.lo > 1 else "level"

    def __str__(self) -> str:
        return f"{self.median:.2f} ({self.lo:.2f}-{self.hi:.2f}) {self.verdict()}"
