"""One rank of an engine as the Bridge tests make it: TP 1, not started, over the memory and
pool given (tests/test_bridge_api.py and the fault tests beside it)."""

from __future__ import annotations

from kvbridge import CacheSpec, DType, ParallelLayout
from kvbridge.config import Settings
from kvbridge.memory.pools import Pool
from kvbridge.model.spec import attention_layer
from kvbridge.planner.layout import SideMemory
from kvbridge.runtime import Bridge
from kvbridge.wire.protocol import Role

SPEC = CacheSpec("m", tuple(attention_layer(2, 8, DType.BFLOAT16) for _ in range(2)))
SETTINGS = Settings(
    bootstrap_timeout=10,
    waiting_timeout=10,
    transfer_timeout=10,
    abort_timeout=2,
    heartbeat_interval=0.2,
    heartbeat_misses=5,
)


def bridge(
    role: Role,
    name: str,
    memory: SideMemory,
    pool: Pool,
    bootstrap: str,
    *,
    spec: CacheSpec = SPEC,
    transport: str = "inproc",
    settings: Settings = SETTINGS,
) -> Bridge:
    """One rank of engine ``name``, TP 1, not started."""
    return Bridge(
        role=role,
        spec=spec,
        parallel=ParallelLayout.even(spec.num_layers, 1),
        rank=0,
        memory=memory,
        regions=pool,
        transport=transport,
        bootstrap=bootstrap,
        engine_id=name,
        settings=settings,
    )
