"""Where a region's bytes live: host memory, or the memory of one CUDA device.

A pure value (no torch here): :class:`Location` is carried by every
:class:`~kvbridge.memory.pools.RegionMemory` and, as a device index, in a transport's metadata,
so that a transport can refuse or register memory by what it is rather than by guessing
from an address. The planner never looks at it: it plans bytes, wherever they live.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvbridge.errors import LayoutError

MAX_DEVICES = 1024  # far past any host; bounds an index read from a peer's metadata


class MemoryKind(enum.Enum):
    HOST = "host"
    CUDA = "cuda"


@dataclass(frozen=True)
class Location:
    """``HOST``, or ``cuda(i)``: device memory of CUDA device ``i`` (as this process numbers
    its visible devices)."""

    kind: MemoryKind = MemoryKind.HOST
    device: int = -1  # the CUDA device index; -1 for host memory (torch's get_device())

    def __post_init__(self) -> None:
        if not isinstance(self.kind, MemoryKind):
            raise LayoutError(f"a location's kind must be a MemoryKind, got {self.kind!r}")
        if self.kind is MemoryKind.HOST and self.device != -1:
            raise LayoutError(f"host memory has no device index, got {self.device}")
        if self.kind is MemoryKind.CUDA and not 0 <= self.device < MAX_DEVICES:
            raise LayoutError(
                f"a CUDA location needs a device index in [0, {MAX_DEVICES}), got {self.device}"
            )

    @property
    def is_device(self) -> bool:
        return self.kind is MemoryKind.CUDA

    @classmethod
    def from_index(cls, device: int) -> Location:
        """The inverse of :attr:`device`: -1 is host memory, ``i >= 0`` CUDA device ``i``
        (how a transport's metadata carries a region's location)."""
        return HOST if device == -1 else cuda(device)

    @classmethod
    def parse(cls, text: str) -> Location:
        """``cpu``/``host``, ``cuda`` (device 0) or ``cuda:I``, as torch spells devices."""
        t = text.strip().lower()
        if t in ("cpu", "host"):
            return HOST
        if t == "cuda":
            return cuda(0)
        head, _, index = t.partition(":")
        if head == "cuda" and index.isdigit():
            return cuda(int(index))
        raise LayoutError(f"unknown device {text!r}: expected cpu, cuda or cuda:INDEX")

    def __str__(self) -> str:
        return "host" if self.kind is MemoryKind.HOST else f"cuda:{self.device}"


HOST = Location()


def cuda(device: int = 0) -> Location:
    """The memory of CUDA device ``device``."""
    return Location(MemoryKind.CUDA, device)
