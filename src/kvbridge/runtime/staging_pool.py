"""A rank's staging region: allocated once, registered with the transport beside the pools.

Only where it can be used: never with ``staging=never``, and with ``auto`` only on a transport
whose cost model can ever prefer staging (so shm and tcp ranks hold no staging memory unless
staging is forced). A decode rank's region is POSIX shared memory, because the shm transport's
peers write into it directly; a prefill rank's is private (only its own transport reads it). A
rank whose pools are on a CUDA device has one only with ``staging=always``, on that device: its
gathers and scatters run there (:mod:`kvbridge.memory.copier`), never through the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.config import Settings
from kvbridge.errors import LayoutError
from kvbridge.memory.device import DevicePool
from kvbridge.memory.location import HOST, Location
from kvbridge.memory.pools import HostPool, Pool, RegionMemory
from kvbridge.planner.layout import Region
from kvbridge.staging.cost import CostModel, StagingMode

REGION = "kvbridge.staging"  # reserved: an engine's own region may not have this name


@dataclass(frozen=True, eq=False)
class StagingPool:
    """``slots`` slots of ``slot_bytes`` in region :data:`REGION` of ``pool``."""

    pool: Pool
    slots: int
    slot_bytes: int

    def __post_init__(self) -> None:
        if self.slots < 1 or self.slot_bytes < 1:
            raise LayoutError(
                f"a staging pool needs slots >= 1 and slot_bytes >= 1, got "
                f"{self.slots} and {self.slot_bytes}"
            )

    @property
    def region(self) -> RegionMemory:
        return self.pool.regions()[0]

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes

    def offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    def close(self) -> None:
        self.pool.close()


def allocate(
    settings: Settings, cost: CostModel, *, shared: bool, location: Location = HOST
) -> StagingPool | None:
    """This rank's staging pool at ``location`` (the rank's pools'), or None where staging
    cannot be chosen (see the module doc)."""
    mode = settings.staging
    if mode is StagingMode.NEVER or (mode is StagingMode.AUTO and not cost.may_stage):
        return None
    if location.is_device and mode is not StagingMode.ALWAYS:
        # On a device only when asked for: the region is GPU memory the engine sized its
        # cache without (slots x slot bytes, 128 MiB by default), and auto's cost model
        # knows the host's copies, not a device's. auto writes device memory directly.
        return None
    nbytes = settings.staging_slots * settings.staging_slot_bytes
    region = [Region(REGION, nbytes)]
    return StagingPool(
        DevicePool(region, location) if location.is_device else HostPool(region, shared=shared),
        settings.staging_slots,
        settings.staging_slot_bytes,
    )


def check_names(regions: list[RegionMemory]) -> None:
    """Refuse an engine region that takes the staging region's reserved name."""
    if any(r.name == REGION for r in regions):
        raise LayoutError(f"region name {REGION!r} is reserved for kvbridge's staging region")
