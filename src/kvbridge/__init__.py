"""kvbridge: move the KV cache of LLM requests from prefill ranks to decode ranks.

Public names are re-exported here; modules are one concept each (see docs/architecture.md).
"""

from kvbridge.config import Settings
from kvbridge.errors import (
    BootstrapError,
    FailureKind,
    IncompatibleError,
    KVBridgeError,
    LayoutError,
    PlacementError,
    ProtocolError,
    SpecError,
    TransferFailed,
    TransportError,
    TransportUnavailable,
)
from kvbridge.layout import BufferLayout, Dim, KVLayout, Region, SideMemory, build_memory
from kvbridge.memory import HostPool, RegionMemory
from kvbridge.parallel import ParallelLayout
from kvbridge.placement import Placement
from kvbridge.plan import Pairing, Side, plan
from kvbridge.protocol import Role
from kvbridge.runs import Runs
from kvbridge.runtime import Bridge
from kvbridge.spec import CacheSpec, Component, DType, LayerKind, LayerSpec, Scope, Segment
from kvbridge.status import KVPoll
from kvbridge.transferplan import PairPlan, Part, PartKind, TransferPlan

__version__ = "0.1.0"

__all__ = [
    "BootstrapError",
    "Bridge",
    "BufferLayout",
    "CacheSpec",
    "Component",
    "DType",
    "Dim",
    "FailureKind",
    "HostPool",
    "IncompatibleError",
    "KVBridgeError",
    "KVLayout",
    "KVPoll",
    "LayerKind",
    "LayerSpec",
    "LayoutError",
    "PairPlan",
    "Pairing",
    "ParallelLayout",
    "Part",
    "PartKind",
    "Placement",
    "PlacementError",
    "ProtocolError",
    "Region",
    "RegionMemory",
    "Role",
    "Runs",
    "Scope",
    "Segment",
    "Settings",
    "Side",
    "SideMemory",
    "SpecError",
    "TransferFailed",
    "TransferPlan",
    "TransportError",
    "TransportUnavailable",
    "build_memory",
    "plan",
]
