"""Memory a rank registers, and the bytes in it.

==========  ================================================================================
location    where a region lives: ``HOST`` or ``cuda(i)``
pools       host pools (private or POSIX shared memory), regions that carry their location
device      CUDA pools, engine tensors wrapped in place (torch imported only when called)
copy        executing the planner's runs with numpy
integrity   checksums of what a pair delivers, in canonical order
==========  ================================================================================

The pools' public names are re-exported here (``from kvbridge.memory import HostPool``).
"""

from kvbridge.memory.pools import (
    SEGMENT_PREFIX,
    HostPool,
    RegionMemory,
    map_segment,
    pool_view,
    sweep_stale_segments,
    unlink_segment,
    wrap_address,
    wrap_array,
    wrap_shared_memory,
)

__all__ = [
    "SEGMENT_PREFIX",
    "HostPool",
    "RegionMemory",
    "map_segment",
    "pool_view",
    "sweep_stale_segments",
    "unlink_segment",
    "wrap_address",
    "wrap_array",
    "wrap_shared_memory",
]
