"""The bridge: one per rank, what an inference engine embeds.

A :class:`Bridge` owns the rank's transport, its control channel and its worker thread, and
hands out senders (prefill) and receivers (decode) in the vocabulary engines know::

    bridge = Bridge(role=Role.PREFILL, spec=spec, parallel=par, rank=r, memory=side_memory,
                    regions=pool.regions(), transport="shm", bootstrap="127.0.0.1:8998")
    bridge.start()
    sender = bridge.sender(room, placement)       # prefill
    sender.send(stop)                             # as chunked prefill produces tokens
    receiver = bridge.receiver(room)              # decode
    receiver.init(placement); receiver.poll()     # -> KVPoll

The role-specific logic lives in :mod:`kvbridge.sender` and :mod:`kvbridge.receiver`; this
module holds what both share: identity, peers, heartbeats and the tick.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvbridge.config import Settings
from kvbridge.control import ControlChannel
from kvbridge.errors import KVBridgeError, LayoutError
from kvbridge.faults import Faults
from kvbridge.layout import SideMemory
from kvbridge.memory import HostPool, RegionMemory
from kvbridge.parallel import ParallelLayout
from kvbridge.plan import Side
from kvbridge.protocol import Heartbeat, Message, Role, agent_name, rank_info
from kvbridge.spec import CacheSpec
from kvbridge.transports import create as create_transport
from kvbridge.transports import transport_class

if TYPE_CHECKING:
    from kvbridge.placement import Placement
    from kvbridge.receiver import Receiver
    from kvbridge.sender import Sender

log = logging.getLogger("kvbridge.engine")


class _RoleLogic(Protocol):
    """What the prefill and decode halves (sender.py, receiver.py) provide to the bridge."""

    def start(self) -> None: ...
    def close(self) -> None: ...
    def active_rooms(self) -> int: ...
    def on_message(self, msg: Message) -> None: ...
    def on_peer_dead(self, agent: str) -> None: ...
    def on_tick(self, now: float) -> None: ...


class Bridge:
    def __init__(self, *, role: Role, spec: CacheSpec, parallel: ParallelLayout, rank: int,
                 memory: SideMemory, regions: Sequence[RegionMemory] | HostPool,
                 transport: str = "shm", bootstrap: str | None = None,
                 engine_id: str = "engine", settings: Settings | None = None,
                 transport_options: dict[str, Any] | None = None) -> None:
        self.role = role
        self.side = Side(spec, parallel, memory)
        parallel.split_rank(rank)
        self.rank = rank
        self.engine_id = engine_id
        self.bootstrap = bootstrap
        self.settings = settings or Settings.from_env()
        self.faults = Faults.parse(self.settings.faults)
        self.agent = agent_name(engine_id, role, rank)
        regs = tuple(regions.regions() if isinstance(regions, HostPool) else regions)
        _check_regions(self.side, rank, regs)
        self.views = {r.name: r.view() for r in regs}
        options = dict(transport_options or {})
        accepts = inspect.signature(transport_class(transport)).parameters
        if role is Role.PREFILL and "allow_private" in accepts:
            # A prefill rank's pools are only read by its own transport (peers never write
            # them), so private memory (an engine's own pool tensors) is fine there.
            options.setdefault("allow_private", True)
        if "io_timeout" in accepts:  # a stuck transfer fails within the request's deadline
            options.setdefault("io_timeout", self.settings.transfer_timeout)
        self.transport = create_transport(transport, self.agent, **options)
        meta = self.transport.register(regs)
        self.channel = ControlChannel(self.agent, host=self.settings.host,
                                      token=self.settings.token, on_message=self._on_message,
                                      on_tick=self._on_tick, outgoing=self.faults.outgoing)
        self.info = rank_info(engine_id, role, rank, self.channel.endpoint, self.side, transport,
                              meta)
        self._endpoints: dict[str, str] = {}
        self._last_seen: dict[str, float] = {}
        self._peers_lock = threading.Lock()
        self._next_beat = 0.0
        self._closed = False
        from kvbridge.receiver import DecodeRole
        from kvbridge.sender import PrefillRole

        self._prefill: PrefillRole | None = None
        self._decode: DecodeRole | None = None
        self._role: _RoleLogic
        if role is Role.PREFILL:
            self._role = self._prefill = PrefillRole(self)
        else:
            self._role = self._decode = DecodeRole(self)

    # ---- life ----------------------------------------------------------------------------

    def start(self) -> Bridge:
        self.channel.start()
        self._role.start()
        return self

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._role.close()
        self.channel.close()
        self.transport.close()

    def __enter__(self) -> Bridge:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- engine API ----------------------------------------------------------------------

    def sender(self, room: int, placement: Placement) -> Sender:
        """A prefill rank's sender for request ``room`` (see :class:`kvbridge.sender.Sender`)."""
        if self._prefill is None:
            raise KVBridgeError("sender() is for prefill bridges; this one is decode")
        return self._prefill.sender(room, placement)

    def receiver(self, room: int, bootstrap: str | None = None) -> Receiver:
        """A decode rank's receiver for request ``room`` from the prefill engine at
        ``bootstrap`` (default: the bridge's). See :class:`kvbridge.receiver.Receiver`."""
        if self._decode is None:
            raise KVBridgeError("receiver() is for decode bridges; this one is prefill")
        return self._decode.receiver(room, bootstrap or self.bootstrap)

    def active_rooms(self) -> int:
        """Requests this rank still holds state for (0 once everything ended and drained)."""
        return self._role.active_rooms()

    # ---- peers ---------------------------------------------------------------------------

    def add_peer(self, agent: str, endpoint: str) -> None:
        with self._peers_lock:
            self._endpoints[agent] = endpoint
            self._last_seen[agent] = time.monotonic()

    def live_peers(self) -> set[str]:
        """Agents this rank talks to and has not declared dead."""
        with self._peers_lock:
            return set(self._endpoints)

    def drop_peer(self, agent: str) -> None:
        with self._peers_lock:
            self._endpoints.pop(agent, None)
            self._last_seen.pop(agent, None)
        self.channel.forget(agent)

    def send(self, agent: str, msg: Message, *, faults: bool = True) -> None:
        endpoint = self._endpoints.get(agent)
        if endpoint is None:
            log.warning("%s: no endpoint for %s; %s not sent", self.agent, agent,
                        type(msg).__name__)
            return
        self.channel.send(agent, endpoint, msg, faults=faults)

    def _on_message(self, msg: Message) -> None:
        with self._peers_lock:
            if msg.sender in self._last_seen:
                self._last_seen[msg.sender] = time.monotonic()
        if not isinstance(msg, Heartbeat):
            self._role.on_message(msg)

    def _on_tick(self, now: float) -> None:
        if now >= self._next_beat:
            self._next_beat = now + self.settings.heartbeat_interval
            with self._peers_lock:
                peers = list(self._endpoints)
                dead = [a for a, seen in self._last_seen.items()
                        if now - seen > self.settings.dead_after]
            for agent in peers:
                self.send(agent, Heartbeat(sender=self.agent, token=self.settings.token))
            for agent in dead:
                log.warning("%s: peer %s silent for %.1f s: dead", self.agent, agent,
                            self.settings.dead_after)
                self.drop_peer(agent)
                self._role.on_peer_dead(agent)
        self._role.on_tick(now)


def _check_regions(side: Side, rank: int, regions: Sequence[RegionMemory]) -> None:
    have = {r.name: r for r in regions}
    for want in side.memory.regions_of(side.parallel.layers_of(rank)):
        got = have.get(want.name)
        if got is None:
            raise LayoutError(f"rank {rank} must register region {want.name!r} "
                              f"({want.nbytes} bytes); registered: {sorted(have)[:8]}")
        if got.nbytes < want.nbytes:
            raise LayoutError(f"region {want.name!r} has {got.nbytes} bytes; the memory layout "
                              f"needs {want.nbytes}")
