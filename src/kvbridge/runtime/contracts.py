"""What the parts of the runtime offer each other, as small typed protocols.

The engine (:class:`~kvbridge.runtime.engine.Bridge`) offers either half a :class:`Rank`: who
this rank is, its settings, memory, transport, fault seam and control channel. Either half
offers the engine a :class:`RoleLogic`. Inside a half, each module states what it needs of the
role that owns it as a small protocol of its own (the sender's and receiver's ``Owner``, the
writer's ``Succeeding``, the worker's ``Notifying``, the staged path's ``Posting``, the
landing's ``Releasing``). No module reaches into another's private names.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from kvbridge.config import Settings
from kvbridge.memory.copier import Copier
from kvbridge.planner.plan import Side
from kvbridge.runtime.faults import Faults
from kvbridge.runtime.metrics import Metrics
from kvbridge.runtime.staging_pool import StagingPool
from kvbridge.transports.base import Transport
from kvbridge.wire.liveness import ProcessId
from kvbridge.wire.protocol import Message, RankInfo


class Rank(Protocol):
    """The engine's side of a rank, as the prefill and decode halves use it."""

    agent: str  # this rank's name on the control channel and the transport
    rank: int  # its engine rank
    engine_id: str
    bootstrap: str | None
    dp: int
    side: Side
    settings: Settings
    faults: Faults  # the fault seam: every hook a no-op unless faults are set
    metrics: Metrics  # what this rank moved, and how its requests ended
    transport: Transport
    views: dict[str, np.ndarray]  # every registered host region, by name
    copier: Copier  # runs between its own regions (staging), host or device
    info: RankInfo
    staging: StagingPool | None

    def check_open(self) -> None: ...
    def progress(self) -> bool: ...
    def send(self, agent: str, msg: Message, *, faults: bool = True) -> None: ...
    def send_to(self, agent: str, endpoint: str, msg: Message) -> None: ...
    def send_raw(self, agent: str, endpoint: str, raw: bytes) -> None: ...
    def add_peer(self, agent: str, endpoint: str, process: ProcessId | None = None) -> None: ...
    def drop_peer(self, agent: str) -> None: ...
    def known_endpoint(self, agent: str) -> str | None: ...


class RoleLogic(Protocol):
    """What the prefill and decode halves offer the engine."""

    def start(self) -> None: ...
    def close(self) -> None: ...
    def closed(self) -> None: ...
    def active_rooms(self) -> int: ...
    def on_message(self, msg: Message) -> None: ...
    def on_peer_dead(self, agent: str, why: str) -> None: ...
    def on_tick(self, now: float) -> None: ...
    def on_paused(self, seconds: float) -> None: ...
