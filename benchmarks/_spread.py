"""A sample's median and interquartile range, for the benchmarks that run ways in turn and say
whether the spread covers the difference between them (sglang_backends.py, vllm_connectors.py).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


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
