"""Direct or staged: a transport's cost model, and the choice made from it per pair and chunk.

A transport describes what a write costs it (:class:`CostModel`): a fixed time per descriptor
it is given, and its bandwidth once descriptors are large. Whether a strided run is one
descriptor (shm, tcp take strided runs as they are) or one per block (NIXL, Mooncake take flat
(address, length) lists) is part of the model.

Direct costs the pair's descriptors plus its bytes at the transport's bandwidth. Staged costs
a descriptor per segment, the bytes at the transport's bandwidth, two local copies (gather and
scatter) and a control round trip per segment, all counted one after another: in practice the
stages overlap, and a segment whose source is a few contiguous extents is not gathered at all
(:meth:`CostModel.gathers`), so the estimate of staged is an upper bound, and staging is chosen
only where even that bound beats direct. On a transport that takes strided runs at copy speed (shm,
tcp), staging only adds copies: :func:`choose` never picks it there unless forced.

The figures of each transport were measured on a 2-core host with ``kvbridge bench`` (see
docs/benchmarks.md); they decide between paths whose costs differ by far more than
their error wherever the choice matters.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvbridge.planner.runs import Runs
from kvbridge.staging.layout import extents, gather, segments

# Gather and scatter: numpy copies of small pieces between pre-faulted buffers (measured: a
# 512-byte-piece copy at 7 GB/s; about a microsecond of Python per strided run).
COPY_BANDWIDTH = 7e9
COPY_PER_RUN = 1e-6
# A segment's ask, grant and notice on the control channel.
CONTROL_PER_SEGMENT = 2e-4


class StagingMode(enum.Enum):
    """``Settings.staging`` (``KVBRIDGE_STAGING``): how a sender chooses its path."""

    AUTO = "auto"  # staged where the transport's cost model says it is faster
    ALWAYS = "always"  # staged wherever both ranks have a staging region (tests, benchmarks)
    NEVER = "never"  # direct; no staging region is allocated


class Path(enum.Enum):
    DIRECT = "direct"
    STAGED = "staged"


@dataclass(frozen=True)
class CostModel:
    """What writing costs one transport: ``per_descriptor`` seconds for each descriptor it is
    given, ``bandwidth`` bytes/s once descriptors are large; ``strided``: a strided run is one
    descriptor (else one per block)."""

    per_descriptor: float
    bandwidth: float
    strided: bool

    def __post_init__(self) -> None:
        if not (self.per_descriptor >= 0 and self.bandwidth > 0):
            raise ValueError(
                f"a cost model needs per_descriptor >= 0 and bandwidth > 0, got "
                f"{self.per_descriptor} and {self.bandwidth}"
            )

    def descriptors(self, runs: Runs) -> int:
        """How many descriptors the transport is given for ``runs`` written directly."""
        return len(runs) if self.strided else runs.descriptors

    def direct(self, runs: Runs) -> float:
        return self.descriptors(runs) * self.per_descriptor + runs.total_bytes / self.bandwidth

    def staged(self, runs: Runs, segment_bytes: int) -> float:
        nbytes = runs.total_bytes
        segments = -(-nbytes // segment_bytes)
        copies = 2 * (nbytes / COPY_BANDWIDTH + len(runs) * COPY_PER_RUN)
        return (
            segments * (self.per_descriptor + CONTROL_PER_SEGMENT)
            + nbytes / self.bandwidth
            + copies
        )

    def gathers(self, extents: Runs) -> bool:
        """Whether a segment is cheaper gathered into a local slot and written as one
        descriptor than written by the transport straight from its ``extents`` (see
        :func:`kvbridge.staging.layout.extents`) into the remote slot."""
        copy = extents.total_bytes / COPY_BANDWIDTH + len(extents) * COPY_PER_RUN
        return (self.descriptors(extents) - 1) * self.per_descriptor > copy

    def staged_descriptors(self, runs: Runs, segment_bytes: int) -> int:
        """How many descriptors the staged path gives the transport for ``runs``: one per
        gathered segment, a segment's extents where it is written from them."""
        total = 0
        for seg in segments(runs, segment_bytes):
            reach = extents(gather(seg, 0))
            total += 1 if self.gathers(reach) else self.descriptors(reach)
        return total

    @property
    def may_stage(self) -> bool:
        """Whether staging can ever be the faster path: a transport that takes one descriptor
        per block pays per block, which a staged copy does not; one that takes strided runs
        pays per run, and staging pays twice that in copies alone unless its descriptors cost
        more. A rank allocates a staging region in ``auto`` mode only where this holds."""
        return (
            self.per_descriptor > 0 if not self.strided else self.per_descriptor > 2 * COPY_PER_RUN
        )


def choose(runs: Runs, cost: CostModel, mode: StagingMode, segment_bytes: int) -> Path:
    """The path of one pair's chunk: ``mode`` forces one, else the cheaper by ``cost``."""
    if mode is StagingMode.NEVER or not len(runs):
        return Path.DIRECT
    if mode is StagingMode.ALWAYS:
        return Path.STAGED
    return Path.STAGED if cost.staged(runs, segment_bytes) < cost.direct(runs) else Path.DIRECT
